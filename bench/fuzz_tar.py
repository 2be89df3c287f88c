"""atheris (libFuzzer) run over the tar reader and the sample grouping: ``python -m bench.fuzz_tar``.

Any input must either give samples whose keyed members follow webdataset's key rule, or raise
``ShardError``; anything else is a crash, ``-timeout`` catches hangs and ``-rss_limit_mb``
unbounded memory. The CI runs the hypothesis version of this (tests/reliability/test_fuzz.py);
this is the long run, as docs/reliability.md reports it::

    python -m bench.fuzz_tar -max_total_time=300 -timeout=10 -rss_limit_mb=2048

libFuzzer prints ``Done <N> runs in <T> second(s)`` at the end: N is the number of executions.
Without a corpus folder on the command line, a temporary one is seeded with a few valid shards.
"""

from __future__ import annotations

import gzip
import io
import tarfile

import atheris

with atheris.instrument_imports(include=["transformer"]):
    from transformer.errors import ShardError
    from transformer.shards import read_samples

from webdataset.tariterators import base_plus_ext  # noqa: E402 - after the instrumented imports

MAX_MEMBER_BYTES = 1 << 20


def _tar(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def seeds() -> list[bytes]:
    plain = [("a.cls", b"1"), ("a.json", b"{}"), ("dir/b.seg.txt", b"x" * 600), ("c", b"keyless")]
    return [
        _tar(plain),
        _tar(plain, tarfile.GNU_FORMAT),
        _tar([("l" * 150 + ".cls", b"2"), ("\u00e9t\u00e9.txt", b"3")]),
        gzip.compress(_tar(plain), mtime=0),
        _tar(plain)[:700],
    ]


def test_one_input(data: bytes) -> None:
    try:
        for sample in read_samples(io.BytesIO(data), "fuzz.tar", MAX_MEMBER_BYTES):
            for member, extension in zip(sample.members, sample.extensions):
                if extension is not None and base_plus_ext(member.info.name) != (sample.key, extension):
                    raise AssertionError(f"member {member.info.name!r} grouped under key {sample.key!r}")
    except ShardError:
        pass


def main() -> None:
    from bench.fuzzing import run

    run(test_one_input, seeds(), "tar")


if __name__ == "__main__":
    main()
