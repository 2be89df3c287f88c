"""atheris (libFuzzer) run over the ``Ais-Node-Url`` parser: ``python -m bench.fuzz_node_url``.

Any header value must give no hop, a destination target or a next stage, or raise ``RequestError``
(400/500); a destination URL keeps the scheme of ``AIS_TARGET_URL``. Anything else is a crash.
Example::

    python -m bench.fuzz_node_url -max_total_time=300 -timeout=10 -rss_limit_mb=2048

libFuzzer prints ``Done <N> runs in <T> second(s)`` at the end: N is the number of executions.
"""

from __future__ import annotations

import atheris

with atheris.instrument_imports(include=["transformer"]):
    from transformer.errors import RequestError
    from transformer.server.hops import DirectPutTarget, EtlStage, parse_node_url

TARGET_URL = "https://t.example:8080/v1/etl/_object/etl/S3cret"


def seeds() -> list[bytes]:
    return [
        b"http://10.0.0.7:31001",
        b"http://10.0.0.7:31001,http://10.0.0.9:51081/ais%2F@%23%2Fdst%2Fo?owt=3&uuid=x",
        b"http://10.0.0.9:51081/ais%2F@%23%2Fdst%2Fo",
        b"http://[::1]:1/p?q=1,",
    ]


def test_one_input(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    value = provider.ConsumeUnicodeNoSurrogates(provider.ConsumeIntInRange(0, 400))
    path = provider.ConsumeUnicodeNoSurrogates(40)
    etl_args = provider.ConsumeUnicodeNoSurrogates(40)
    try:
        hop = parse_node_url(value, path, etl_args, TARGET_URL)
    except RequestError as exc:
        if exc.status not in (400, 500):
            raise AssertionError(f"status {exc.status} for {value!r}") from None
        return
    if hop is not None and not isinstance(hop, DirectPutTarget | EtlStage):
        raise AssertionError(f"unexpected hop {hop!r}")
    if isinstance(hop, DirectPutTarget) and not hop.url.startswith("https://"):
        raise AssertionError(f"direct put lost the target's scheme: {hop.url}")


def main() -> None:
    from bench.fuzzing import run

    run(test_one_input, seeds(), "nodeurl")


if __name__ == "__main__":
    main()
