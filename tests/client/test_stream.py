"""One resumable stream, on in-memory shards: a stream stopped anywhere and made again from its snapshot
continues exactly, and reads again only the shards its buffer holds samples of and the open one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer.client.errors import ResumeError
from transformer.client.stream import SampleStream, ShardReader, StreamSpec, draw, generator_key
from transformer.client.urls import get_etl_args, set_etl_args

KEYS = ("cls", "__key__")


class Shards:
    """In-memory shards: URL -> sample keys; ``read`` as ``ShardReader.read`` does, recording each read."""

    def __init__(self, sizes: list[int]):
        self.keys = {f"mem://s{s}.tar": [f"s{s}-k{i}" for i in range(size)] for s, size in enumerate(sizes)}
        self.reads: list[tuple[str, int]] = []

    def read(self, url: str, start: int = 0, anchor: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        self.reads.append((url, start))
        keys = self.keys[url]
        if start and (start >= len(keys) or keys[start] != anchor):
            raise ResumeError(url, f"no sample '{anchor}' at {start}")
        for position in range(start, len(keys)):
            yield position, {"__key__": keys[position], "__url__": url, "cls": str(position).encode()}


def spec(shards: Shards, buffer: int, resampled: bool = False) -> StreamSpec:
    urls = tuple(shards.keys)
    order = None if resampled else tuple(reversed(range(len(urls))))
    return StreamSpec(urls, order, generator_key(1, "shards"), generator_key(1, "buffer"), buffer, KEYS)


def refuse(exc: BaseException) -> bool:
    raise exc


def keys_of(stream: SampleStream, limit: int | None = None) -> list[str]:
    return [key for _, key in islice(stream.tuples(), limit)]


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5), buffer=st.integers(0, 9),
       resampled=st.booleans(), data=st.data())
def test_a_stream_resumed_anywhere_continues_exactly(sizes: list[int], buffer: int, resampled: bool, data) -> None:
    if resampled and not any(sizes):
        return  # an endless stream of empty shards
    shards = Shards(sizes)
    limit = 40 if resampled else None
    whole = keys_of(SampleStream(spec(shards, buffer, resampled), shards, refuse), limit)
    assert resampled or sorted(whole) == sorted(k for keys in shards.keys.values() for k in keys)
    stop = data.draw(st.integers(0, len(whole)))
    first = SampleStream(spec(shards, buffer, resampled), shards, refuse)
    taken = keys_of(first, stop)
    state = json.loads(json.dumps(first.snapshot()))
    shards.reads.clear()
    resumed = SampleStream(spec(shards, buffer, resampled), shards, refuse, state)
    rest = keys_of(resumed, None if limit is None else limit - stop)
    assert taken + rest == whole
    # The reads made to restore: the buffered shards and the open one, once each.
    restored = len({index for index, _, _ in state["buffer"]} | ({first.url_index(state["shard"])}
                                                                 if state["taken"] and not state["ended"] else set()))
    opened = [url for url, start in shards.reads[:restored]]
    assert len(set(opened)) == len(opened)
    if state["ended"]:
        assert len(shards.reads) == restored  # nothing but the buffer's samples is read again


def test_the_snapshot_names_the_buffer_by_identity_and_draws_are_counted() -> None:
    shards = Shards([5, 5])
    stream = SampleStream(spec(shards, 4), shards, refuse)
    samples = stream.tuples()
    next(samples)
    state = stream.snapshot()
    assert state["shard"] == 0 and state["taken"] == 4 and state["last"] == "s1-k3"  # order: s1 first
    assert state["draws"] == 1 and len(state["buffer"]) == 3
    assert all(index == 1 and key == f"s1-k{position}" for index, position, key in state["buffer"])
    assert json.loads(json.dumps(state)) == {**state, "buffer": [list(entry) for entry in state["buffer"]]}


def test_draws_are_spread_and_keyed() -> None:
    counts = [0] * 7
    for number in range(7000):
        counts[draw(generator_key("a"), number, 7)] += 1
    assert min(counts) > 850 and max(counts) < 1150
    assert [draw(generator_key("a"), n, 1000) for n in range(20)] != [draw(generator_key("b"), n, 1000)
                                                                      for n in range(20)]


def test_restoring_reads_the_buffered_shards_from_their_first_needed_sample() -> None:
    shards = Shards([10, 10, 10])
    stream = SampleStream(spec(shards, 6), shards, refuse)  # reads s2, s1, s0
    keys_of(stream, 13)  # 18 taken: s2 whole, s1 up to k7; 5 in the buffer
    state = stream.snapshot()
    assert (state["shard"], state["taken"]) == (1, 8)
    shards.reads.clear()
    resumed = SampleStream(spec(shards, 6), shards, refuse, state)
    keys_of(resumed, 1)
    buffered = {}
    for index, position, _ in state["buffer"]:
        buffered[index] = min(position, buffered.get(index, position))
    expected = [(f"mem://s{index}.tar", start) for index, start in buffered.items() if index != 1]
    open_start = min(buffered.get(1, 7), 7)  # one read of s1 serves its buffered samples and its rest
    assert shards.reads[:len(expected) + 1] == expected + [("mem://s1.tar", open_start)]


class EtlShards(ShardReader):
    """A ShardReader whose shards come from an in-memory ETL: it honours ``skip`` (input samples) and
    leaves out the samples it cannot transform, as the service does under ``on_error=skip``."""

    def __init__(self, keys: list[str], dropped: set[str]):
        super().__init__()
        self.keys, self.dropped = keys, dropped
        self.asked: list[int] = []

    def samples(self, url: str, shown: str | None = None) -> Iterator[dict[str, Any]]:
        skip = get_etl_args(url).get("skip", 0)
        self.asked.append(skip)
        for key in self.keys[skip:]:
            if key not in self.dropped:
                yield {"__key__": key, "__url__": shown or url, "cls": b"1"}


URL = set_etl_args("http://pod:8000/ais%2F%40%23%2Fb%2Fs.tar?etl_fqn=%2Fm%2Fs.tar", {"seed": 1})


def test_a_skipped_read_finds_its_first_sample_by_key_when_the_etl_left_some_out() -> None:
    keys = [f"k{i}" for i in range(10)]
    reader = EtlShards(keys, dropped={"k1", "k2"})
    whole = [(position, sample["__key__"]) for position, sample in reader.read(URL)]
    assert whole[:3] == [(0, "k0"), (1, "k3"), (2, "k4")]  # positions count what a whole read yields
    for position, key in whole:
        again = [(p, s["__key__"]) for p, s in reader.read(URL, position, key)]
        assert again == whole[position:]
        assert reader.asked[-1] == (position if position else 0)  # the ETL was asked to skip
        assert all(s["__url__"] == URL for _, s in reader.read(URL, position, key))  # the URL the user gave
    with pytest.raises(ResumeError, match="sample 'k9x' .* is not in it"):
        list(reader.read(URL, 3, "k9x"))


def test_urls_not_through_the_etl_are_skipped_here() -> None:
    class Local(EtlShards):
        pass

    reader = Local([f"k{i}" for i in range(5)], dropped=set())
    local = "/data/s.tar"
    assert not reader.pod_skips(local) and reader.pod_skips(URL)
    assert [p for p, _ in reader.read(local, 3, "k3")] == [3, 4] and reader.asked[-1] == 0
    with pytest.raises(ResumeError, match="sample 3 is 'k3', not 'other'"):
        list(reader.read(local, 3, "other"))
    with pytest.raises(ResumeError, match="it has 5 samples or fewer"):
        list(reader.read(local, 5, "k5"))
    assert not ShardReader(require_marker=False).pod_skips(URL)  # shards not written by this ETL


def test_a_shard_that_changed_is_an_error_for_the_handler_and_the_stream_goes_on() -> None:
    shards = Shards([6, 6])
    stream = SampleStream(spec(shards, 4), shards, refuse)
    keys_of(stream, 3)
    state = stream.snapshot()
    shards.keys["mem://s1.tar"] = [f"new-{i}" for i in range(6)]  # s1 (read first) was rewritten
    errors: list[BaseException] = []
    resumed = SampleStream(spec(shards, 4), shards, lambda exc: errors.append(exc) or True, state)
    rest = keys_of(resumed)
    assert len(errors) == 1 and isinstance(errors[0], ResumeError)
    assert all(key.startswith("s0-") for key in rest)  # the next shard, whole


def test_an_etl_that_refuses_skip_is_read_from_the_start(caplog: pytest.LogCaptureFixture) -> None:
    from http.server import BaseHTTPRequestHandler
    from threading import Thread

    from testbed.httpserve import QuietServer
    from testbed.shardgen import make_tar, sealed

    shard = sealed(make_tar([(f"k{i}.cls", b"%d" % i) for i in range(6)]))
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            refused = "skip" in self.path
            body = b"invalid etl_args field 'skip': unknown field" if refused else shard
            self.send_response(400 if refused else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = QuietServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/s.tar?etl_args=%7B%22seed%22%3A1%7D"
        reader = ShardReader(timeout=(2, 10))
        assert [(p, s["__key__"]) for p, s in reader.read(url, 4, "k4")] == [(4, "k4"), (5, "k5")]
        assert len(asked) == 2 and "skip" in asked[0] and "skip" not in asked[1]
        assert "refuses etl_args 'skip'" in caplog.text
    finally:
        server.shutdown()
        server.server_close()
