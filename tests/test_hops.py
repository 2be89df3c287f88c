"""``put_stream``'s retries: what the caller learns when the object timeout ends them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from transformer.errors import TransformerError, UpstreamError
from transformer.server.hops import put_stream

URL = "https://target:8080/v1/etl/_object/etl/dst%2Fx.tar"


def test_a_retry_cut_by_the_object_timeout_reports_why_the_first_attempt_failed() -> None:
    deadline = time.monotonic() + 0.6
    attempts, bodies = [], []

    def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(request)
        for _ in request.stream:  # the body's first attempt goes out and is cut, as a refused client certificate is
            raise httpx.WriteError("[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] cut")
        raise AssertionError("not reached")

    def body() -> Iterator[bytes]:
        bodies.append(1)
        if len(bodies) > 1:  # a retry: the transform runs into the object timeout, as under load
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)
            raise TransformerError("shard 'x.tar': object timeout exceeded after 0 samples")
        yield b"tar bytes"

    with httpx.Client(transport=httpx.MockTransport(refuse)) as client, pytest.raises(UpstreamError) as info:
        put_stream(client, URL, body, headers={}, deadline=deadline, replayable=True)
    assert len(bodies) == 2 and len(attempts) == 1  # the second attempt failed in its body
    assert info.value.status == 502  # the destination's refusal, not a 500 of the transform
    assert "WriteError" in info.value.message and "object timeout exceeded after 2 attempt(s)" in info.value.message


def test_a_transform_failure_on_the_first_attempt_is_the_transforms() -> None:
    def never(request: httpx.Request) -> httpx.Response:
        for _ in request.stream:
            pass
        return httpx.Response(200)

    def body() -> Iterator[bytes]:
        raise TransformerError("shard 'x.tar': sample 'a': broken")
        yield b""

    with httpx.Client(transport=httpx.MockTransport(never)) as client:
        with pytest.raises(TransformerError, match="sample 'a': broken") as info:
            put_stream(client, URL, body, headers={}, deadline=time.monotonic() + 5, replayable=True)
    assert not isinstance(info.value, UpstreamError)


def test_the_deadline_before_a_retry_names_the_last_failure() -> None:
    def unavailable(request: httpx.Request) -> httpx.Response:
        for _ in request.stream:
            pass
        return httpx.Response(503, text="target busy")

    with httpx.Client(transport=httpx.MockTransport(unavailable)) as client, pytest.raises(UpstreamError) as info:
        put_stream(client, URL, lambda: [b"tar"], headers={}, deadline=time.monotonic() + 0.3, replayable=True)
    assert info.value.status == 503 and "target busy" in info.value.message
