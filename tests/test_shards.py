"""Streaming tar: webdataset's grouping rule, order, odd members and names, every kind of broken input."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import random
import tarfile

import pytest
import webdataset as wds

from testbed.shardgen import make_tar
from transformer.errors import ShardError
from transformer.shards import Member, Sample, json_member, member_bytes, read_samples
from transformer.wire import BLOCK, END_OF_ARCHIVE

LIMIT = 2**30


def read(data: bytes, shard: str = "bucket/shard-007.tar", limit: int = LIMIT) -> list[Sample]:
    return list(read_samples(io.BytesIO(data), shard, limit))


def write(samples: list[Sample]) -> bytes:
    """Samples back to a tar with the module's own writer pieces."""
    return b"".join(bytes(p) for s in samples for m in s.members for p in member_bytes(m)) + END_OF_ARCHIVE


def tar_of(infos: list[tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape") as archive:
        for info, data in infos:
            archive.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buffer.getvalue()


def file_info(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
    return info, data


# --- grouping -------------------------------------------------------------------------------------


def test_members_group_by_key_in_order() -> None:
    members = [("a.jpg", b"1"), ("a.cls", b"2"), ("b.jpg", b"3"), ("b.cls", b"4"), ("b.json", b"5"), ("c.cls", b"6")]
    samples = read(make_tar(members))
    assert [(s.key, s.extensions) for s in samples] == [
        ("a", ["jpg", "cls"]), ("b", ["jpg", "cls", "json"]), ("c", ["cls"])
    ]
    assert [(m.info.name, m.data) for s in samples for m in s.members] == members


TRICKY_NAMES = [
    "a.jpg", "a.cls", "a.seg.png",  # key ends at the first dot of the basename
    "dir/b.jpg", "dir/b.cls",  # directories are part of the key
    "dir/c.jpg",  # same directory, next key
    "dir.v2/d.tar.gz", "dir.v2/d.JPG",  # dots in directories do not split the key
    "x/y/z/e.left.png", "x/y/z/e.right.png",
    "f.jpg", "other/f.jpg",  # same basename, different directory: different keys
    "g.b.c.d",
]


def test_grouping_agrees_with_webdatasets_reader(tmp_path) -> None:
    members = [(name, name.encode()) for name in TRICKY_NAMES]
    path = tmp_path / "tricky.tar"
    path.write_bytes(make_tar(members))
    ours = [(s.key, {ext.lower(): m.data for ext, m in zip(s.extensions, s.members)}) for s in read(path.read_bytes())]
    theirs = [
        (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
        for s in wds.WebDataset(str(path), shardshuffle=False)
    ]
    assert ours == theirs
    assert [key for key, _ in ours] == ["a", "dir/b", "dir/c", "dir.v2/d", "x/y/z/e", "f", "other/f", "g"]


def test_members_without_a_key_are_groups_of_their_own() -> None:
    members = [("README", b"r"), ("k.jpg", b"j"), (".hidden", b"h"), ("dir.x/noext", b"n"), ("k2.cls", b"c")]
    samples = read(make_tar(members))
    assert [(s.key, s.extensions) for s in samples] == [
        ("README", [None]), ("k", ["jpg"]), (".hidden", [None]), ("dir.x/noext", [None]), ("k2", ["cls"])
    ]
    assert write(samples) and [m.data for s in samples for m in s.members] == [b"r", b"j", b"h", b"n", b"c"]


def test_non_file_members_pass_through_as_their_own_groups() -> None:
    directory = tarfile.TarInfo("dir")
    directory.type, directory.mode = tarfile.DIRTYPE, 0o755
    link = tarfile.TarInfo("k.jpg")
    link.type, link.linkname = tarfile.SYMTYPE, "elsewhere.jpg"
    hard = tarfile.TarInfo("k.png")
    hard.type, hard.linkname = tarfile.LNKTYPE, "k.cls"
    data = tar_of([(directory, b""), file_info("k.cls", b"1"), (link, b""), (hard, b""), file_info("k.json", b"{}")])
    samples = read(data)
    assert [(s.key, s.extensions) for s in samples] == [
        ("dir", [None]), ("k", ["cls"]), ("k.jpg", [None]), ("k.png", [None]), ("k", ["json"])
    ]
    # A symlink named like an image is never handed to the decoder: it is not a file with a payload.
    assert samples[2].members[0].pieces == [] and samples[2].members[0].info.issym()

    with tarfile.open(fileobj=io.BytesIO(write(samples))) as archive:
        out = archive.getmembers()
        assert [(m.name, m.type) for m in out] == [
            ("dir", tarfile.DIRTYPE), ("k.cls", tarfile.REGTYPE), ("k.jpg", tarfile.SYMTYPE),
            ("k.png", tarfile.LNKTYPE), ("k.json", tarfile.REGTYPE)
        ]
        assert out[2].linkname == "elsewhere.jpg" and out[3].linkname == "k.cls"
        assert archive.extractfile(out[1]).read() == b"1"


def test_keyless_member_does_not_absorb_the_next_sample() -> None:
    """'k' (no dot) and 'k.cls' are different things; webdataset drops the first and keys the second 'k'.

    Merged, a failing 'k' sample under on_error=skip would also drop the unrelated 'k' member.
    """
    samples = read(make_tar([("k", b"plain file"), ("k.cls", b"1"), ("k.jpg", b"2")]))
    assert [(s.key, s.extensions) for s in samples] == [("k", [None]), ("k", ["cls", "jpg"])]


def test_duplicate_members_stay_in_their_sample() -> None:
    """Unlike webdataset (which raises), a duplicate is left to the sample's error policy."""
    samples = read(make_tar([("k.jpg", b"1"), ("k.jpg", b"2"), ("k.cls", b"3")]))
    assert [(s.key, s.extensions) for s in samples] == [("k", ["jpg", "jpg", "cls"])]


# --- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_names_round_trip(fmt: int) -> None:
    deep = "/".join(f"directory-{i:02d}" for i in range(12))  # well over the 100-byte ustar name field
    names = [f"{deep}/sample-0001.jpg", f"{deep}/sample-0001.cls", f"{deep}/sample-0002.übersicht.json"]
    data = tar_of([file_info(name, name.encode()) for name in names], fmt)
    samples = read(data)
    assert [s.key for s in samples] == [f"{deep}/sample-0001", f"{deep}/sample-0002"]
    with tarfile.open(fileobj=io.BytesIO(write(samples))) as archive:
        assert [(m.name, archive.extractfile(m).read()) for m in archive] == [(n, n.encode()) for n in names]


def test_non_utf8_names_round_trip_byte_exact() -> None:
    raw_names = [b"caf\xe9/k\xff.jpg", b"caf\xe9/k\xff.cls", b"plain.cls"]
    names = [os.fsdecode(n) for n in raw_names]  # surrogate-escaped, as tarfile reads them
    data = tar_of([file_info(name, b"x") for name in names], tarfile.GNU_FORMAT)
    samples = read(data)
    assert [s.key for s in samples] == [os.fsdecode(b"caf\xe9/k\xff"), "plain"]
    output = write(samples)
    with tarfile.open(fileobj=io.BytesIO(output), encoding="utf-8", errors="surrogateescape") as archive:
        assert [os.fsencode(m.name) for m in archive] == raw_names
    assert b"caf\xe9/k\xff.jpg" in output  # the raw bytes themselves, not a re-encoding


# --- compressed and broken input ------------------------------------------------------------------


def test_gzip_compressed_input() -> None:
    members = [("a.jpg", b"1" * 3000), ("a.cls", b"2"), ("b.jpg", b"3" * 10)]
    samples = read(gzip.compress(make_tar(members)))
    assert [(m.info.name, m.data) for s in samples for m in s.members] == members


def test_reading_is_streaming() -> None:
    """The first sample arrives long before the whole shard has been read."""
    data = make_tar([(f"s{i:03d}.bin", bytes([i]) * 200_000) for i in range(20)])

    class Counting(io.BytesIO):
        consumed = 0

        def read(self, size: int | None = -1) -> bytes:
            chunk = super().read(size)
            self.consumed += len(chunk)
            return chunk

    stream = Counting(data)
    iterator = read_samples(stream, "big.tar", LIMIT)
    first = next(iterator)
    assert first.key == "s000" and stream.consumed < len(data) // 4
    assert len(list(iterator)) == 19


def member_offsets(data: bytes) -> list[tuple[int, int, int]]:
    """(header offset, data offset, data size) of every member."""
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return [(m.offset, m.offset_data, m.size) for m in archive.getmembers()]


SHARD = make_tar([("a.jpg", b"j" * 1500), ("a.cls", b"1"), ("b.jpg", b"k" * 700), ("b.cls", b"2")])
OFFSETS = member_offsets(SHARD)
END = OFFSETS[-1][1] + OFFSETS[-1][2] + (-OFFSETS[-1][2] % BLOCK)  # where the end-of-archive marker starts


@pytest.mark.parametrize(
    "cut, where",
    [
        (100, "inside the first header"),
        (OFFSETS[1][0] + 300, "inside the second header"),
        (OFFSETS[3][0] + 1, "one byte into the last header"),
        (OFFSETS[0][1] + 700, "inside the first member"),
        (OFFSETS[2][1] + 1, "one byte into a member"),
        (OFFSETS[2][1] + OFFSETS[2][2], "inside the padding after a member"),
        (OFFSETS[1][0], "at a member boundary"),
        (OFFSETS[3][0], "at the boundary before the last member"),
        (END, "after the last member, before the end-of-archive marker"),
        (END + 200, "inside the end-of-archive marker"),
    ],
)
def test_truncated_tar_is_a_shard_error(cut: int, where: str) -> None:
    with pytest.raises(ShardError) as info:
        read(SHARD[:cut])
    assert info.value.shard == "bucket/shard-007.tar"
    assert "bucket/shard-007.tar" in info.value.message
    assert "truncated" in info.value.reason or "end-of-archive" in info.value.reason, (where, info.value.reason)


def test_truncated_gzip_is_a_shard_error() -> None:
    for data in (gzip.compress(SHARD)[:-30], gzip.compress(SHARD[: OFFSETS[2][0]])):
        with pytest.raises(ShardError, match="shard-007"):
            read(data)


def test_a_complete_tar_with_one_or_two_zero_blocks_is_accepted() -> None:
    assert len(read(SHARD[: END + BLOCK])) == 2
    assert len(read(SHARD)) == 2


def test_garbage_instead_of_the_end_marker_is_a_shard_error() -> None:
    with pytest.raises(ShardError, match="shard-007"):
        read(SHARD[:END] + b"this is no tar header" * 40)


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "not a tar"),
        (b"PK\x03\x04 a zip file is not a tar" * 30, "not a tar"),
        (os.urandom(4096), "not a tar"),
        (b"\x1f\x8b\x08\x00 broken gzip header", ""),
    ],
)
def test_not_a_tar_is_a_shard_error(data: bytes, words: str) -> None:
    with pytest.raises(ShardError) as info:
        read(data)
    assert info.value.shard == "bucket/shard-007.tar" and words in info.value.reason


def test_empty_archive_has_no_samples() -> None:
    assert read(END_OF_ARCHIVE) == []


def test_member_over_the_size_limit_is_a_shard_error() -> None:
    data = make_tar([("a.cls", b"1"), ("a.jpg", b"x" * 1001)])
    assert len(read(data, limit=1001)) == 1
    with pytest.raises(ShardError) as info:
        read(data, limit=1000)
    assert "'a.jpg'" in info.value.reason and "1001 bytes" in info.value.reason
    assert "ETL_MAX_MEMBER_BYTES" in info.value.reason


# --- writer pieces --------------------------------------------------------------------------------


def test_member_bytes_are_block_aligned_and_readable() -> None:
    for size in (0, 1, 511, 512, 513, 5000):
        info = tarfile.TarInfo(f"k{size}.bin")
        info.size = size
        member = Member(info, [b"a" * (size // 2), memoryview(b"b" * (size - size // 2))] if size else [])
        blob = b"".join(bytes(p) for p in member_bytes(member))
        assert len(blob) % BLOCK == 0
        with tarfile.open(fileobj=io.BytesIO(blob + END_OF_ARCHIVE)) as archive:
            (only,) = archive.getmembers()
            assert archive.extractfile(only).read() == b"a" * (size // 2) + b"b" * (size - size // 2)


def test_json_member() -> None:
    member = json_member("__etl__/errors.json", b'{"errors": []}', 1_700_000_000.7)
    assert (member.info.name, member.info.size, member.info.mtime, member.info.mode) == (
        "__etl__/errors.json", 14, 1_700_000_000, 0o644
    )
    assert member.data == b'{"errors": []}'


# --- pass-through headers, other compressions, odd member types ------------------------------------


def raw_members(data: bytes) -> list[bytes]:
    """Each member's bytes in a tar (header blocks, payload, padding), split with tarfile's offsets."""
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        spans = [(m.offset, m.offset_data + m.size + (-m.size % BLOCK)) for m in archive.getmembers()]
    return [data[start:end] for start, end in spans]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_passed_through_members_keep_their_header_bytes(fmt: int) -> None:
    deep = "/".join(f"d{i:03d}" for i in range(30))  # a GNU long name or a pax path; too long for ustar
    infos = [file_info("k.cls", b"1"), file_info("k.json", b'{"a": 1}')]
    if fmt != tarfile.USTAR_FORMAT:
        infos.append(file_info(f"{deep}/k2.cls", b"2"))
    for info, _ in infos:
        info.uid, info.gid, info.uname, info.gname = 1234, 5678, "someone", "some-group"
    data = tar_of(infos, fmt)
    assert write(read(data)) == b"".join(raw_members(data)) + END_OF_ARCHIVE


def test_global_pax_headers_are_applied_and_not_lost() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT,
                      pax_headers={"comment": "global", "uname": "everyone"}) as archive:
        info, data = file_info("k.cls", b"1")
        archive.addfile(info, io.BytesIO(data))
    samples = read(buffer.getvalue())
    assert samples[0].members[0].info.uname == "everyone"
    with tarfile.open(fileobj=io.BytesIO(write(samples))) as archive:
        (member,) = archive.getmembers()
        assert (member.name, member.uname, archive.extractfile(member).read()) == ("k.cls", "everyone", b"1")


def test_a_member_of_unknown_type_keeps_its_payload() -> None:
    odd = tarfile.TarInfo("k.odd")
    odd.type, odd.size = b"Z", 700  # not a type tarfile knows: it is read like a regular file
    data = file_info("k.cls", b"1")[0].tobuf(format=tarfile.USTAR_FORMAT) + b"1" + b"\0" * 511
    data += odd.tobuf(format=tarfile.USTAR_FORMAT) + b"o" * 700 + b"\0" * (-700 % BLOCK)
    data += file_info("z.cls", b"2")[0].tobuf(format=tarfile.USTAR_FORMAT) + b"2" + b"\0" * 511 + END_OF_ARCHIVE
    samples = read(data)
    assert [(m.info.name, m.data) for s in samples for m in s.members] == [
        ("k.cls", b"1"), ("k.odd", b"o" * 700), ("z.cls", b"2")
    ]
    assert write(samples) == data


def test_a_sparse_member_is_refused_by_name() -> None:
    sparse = tarfile.TarInfo("k.img")
    sparse.type, sparse.size = tarfile.GNUTYPE_SPARSE, 0
    data = sparse.tobuf(format=tarfile.GNU_FORMAT) + END_OF_ARCHIVE
    with pytest.raises(ShardError, match="'k.img' is a sparse file"):
        read(data)


@pytest.mark.parametrize("compress", [bz2.compress, lzma.compress], ids=["bzip2", "xz"])
def test_bzip2_and_xz_input(compress) -> None:
    members = [("a.jpg", b"1" * 3000), ("a.cls", b"2"), ("b.jpg", b"3" * 10)]
    packed = compress(make_tar(members))
    assert [(m.info.name, m.data) for s in read(packed) for m in s.members] == members
    with pytest.raises(ShardError, match="shard-007"):
        read(packed[:-20])  # cut before the stream's end: the end-of-archive marker alone is not enough


def test_an_extended_header_larger_than_the_member_limit_is_refused() -> None:
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, 10_000
    data = pax.tobuf(format=tarfile.USTAR_FORMAT) + b"x" * 10_240 + END_OF_ARCHIVE
    with pytest.raises(ShardError, match="extended header of 10240 bytes"):
        read(data, limit=4096)


def test_reader_agrees_with_tarfile_on_many_archives() -> None:
    rng = random.Random(3)
    for case in range(40):
        fmt = rng.choice([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
        infos = []
        for _ in range(rng.randint(1, 12)):
            stem = rng.choice(["", "dir/", "a/b.c/"]) + f"s{rng.randint(0, 5)}"
            name = stem + rng.choice([".jpg", ".cls", ".x.y", ""])
            if fmt != tarfile.USTAR_FORMAT and rng.random() < 0.2:
                name = "long/" * 30 + name
            infos.append(file_info(name, rng.randbytes(rng.choice([0, 1, 511, 512, 513, 3000]))))
        data = tar_of(infos, fmt)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            expected = [(m.name, archive.extractfile(m).read()) for m in archive.getmembers()]
        got = [(m.info.name, m.data) for s in read(data) for m in s.members]
        assert got == expected, case
        assert write(read(data)) == b"".join(raw_members(data)) + END_OF_ARCHIVE


class _ReadOnly:
    """A stream with ``read`` only (no ``readinto``), handing out at most ``most`` bytes per call."""

    def __init__(self, data: bytes, most: int):
        self._data, self._at, self._most = data, 0, most

    def read(self, size: int = -1) -> bytes:
        size = self._most if size is None or size < 0 else min(size, self._most)
        chunk = self._data[self._at:self._at + size]
        self._at += len(chunk)
        return chunk


class _ShortReadinto(_ReadOnly):
    """``readinto`` that fills at most ``most`` bytes per call, as a socket or pipe may."""

    def readinto(self, buffer) -> int:
        chunk = self.read(len(buffer))
        buffer[:len(chunk)] = chunk
        return len(chunk)


@pytest.mark.parametrize("stream", ["bytesio", "read-only", "short-readinto", "read-only-7", "gzip"])
def test_large_members_read_alike_through_every_kind_of_stream(stream: str) -> None:
    rng = random.Random(11)
    sizes = [0, 1, 16_383, 16_384, 16_385, 70_000, 300_001, 5, 65_536]
    infos = [file_info(f"s{i // 2}.{'jpg' if i % 2 else 'cls'}", rng.randbytes(size)) for i, size in enumerate(sizes)]
    data = tar_of(infos)
    source = {
        "bytesio": lambda: io.BytesIO(data),
        "read-only": lambda: _ReadOnly(data, 1 << 20),
        "short-readinto": lambda: _ShortReadinto(data, 1000),
        "read-only-7": lambda: _ReadOnly(data, 7),
        "gzip": lambda: io.BytesIO(gzip.compress(data)),
    }[stream]
    samples = list(read_samples(source(), "s.tar", LIMIT))
    assert [(m.info.name, m.data) for s in samples for m in s.members] == [(i.name, d) for i, d in infos]
    assert write(samples) == data[:len(write(samples)) - len(END_OF_ARCHIVE)] + END_OF_ARCHIVE
    # a large member is read into its own writable buffer (the decoder takes it without a copy)
    big = [m for s in samples for m in s.members if m.info.size > 16_384]
    if stream in ("bytesio", "short-readinto", "gzip"):
        assert big and all(type(m.pieces[0]) is bytearray for m in big)
    # and a cut inside it is still a truncation, named
    cut = data[:data.index(infos[6][1]) + 1000]
    with pytest.raises(ShardError, match="truncated inside member 's3.cls'"):
        list(read_samples(_ShortReadinto(cut, 1000), "s.tar", LIMIT))


def test_a_header_alone_does_not_allocate_its_member() -> None:
    # A header claiming 200 MB and then 1 KB of data: the reader's memory follows the bytes that
    # arrive, not the size a header claims (ETL_MAX_MEMBER_BYTES is 256 MiB by default).
    import tracemalloc

    info = tarfile.TarInfo("k.bin")
    info.size = 200 << 20
    data = info.tobuf(format=tarfile.USTAR_FORMAT) + b"x" * 1024
    tracemalloc.start()
    try:
        with pytest.raises(ShardError, match="truncated inside member 'k.bin'"):
            list(read_samples(_ShortReadinto(data, 1 << 20), "s.tar", LIMIT))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak >> 20} MiB for 1 KB of data"


def test_a_member_larger_than_the_first_buffer_grows_and_reads_exactly() -> None:
    payload = random.Random(2).randbytes(3 * (1 << 20) + 123)  # past two doublings of the 1 MiB start
    data = tar_of([file_info("k.bin", payload), file_info("k.cls", b"7")])
    for stream in (io.BytesIO(data), _ShortReadinto(data, 100_000)):
        (sample,) = read_samples(stream, "s.tar", LIMIT)
        assert [m.data for m in sample.members] == [payload, b"7"]


def test_the_plain_header_fast_path_agrees_with_tarfile_field_by_field() -> None:
    from transformer.wire import plain_file

    rng = random.Random(5)
    names = ["k.jpg", "dir/sample-000001.cls", "a" * 100, "p/" * 60 + "deep.json", "caf\u00e9.txt", "x"]
    checked = fallbacks = 0
    for case in range(600):
        info = tarfile.TarInfo(rng.choice(names))
        info.size, info.mtime = rng.choice([0, 1, 511, 8**11 - 1]), rng.choice([0, 1_700_000_000, 8**11 - 1])
        info.mode, info.uid, info.gid = rng.choice([0o644, 0o7777]), rng.randint(0, 8**7 - 1), rng.randint(0, 99)
        info.uname, info.gname = rng.choice(["", "user", "\u00fc"]), rng.choice(["", "group"])
        block = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="surrogateescape"))
        if case % 4 == 1:  # numbers as other writers format them (libarchive: "000644 \0"; leading spaces)
            for start, width in ((100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (329, 8), (337, 8)):
                if not any(block[start:start + width]):
                    continue  # tarfile leaves a regular file's device numbers empty
                value = int(block[start:start + width - 1], 8)
                style = rng.choice(["%0*o \0", "%*o\0", "%0*o\0", "%0*o "])
                digits = width - (len(style) - len(style.rstrip(" \0")))  # what the terminators leave
                block[start:start + width] = (style.replace("*", str(digits)) % value).encode()[:width]
            block[148:156] = b"%06o\0 " % (256 + sum(block[:148]) + sum(block[156:]))
        if case % 3 == 0:  # damage one byte: the fast path must agree or step aside, never differ
            block[rng.randrange(BLOCK)] = rng.randrange(256)
        block = bytes(block)
        fast = plain_file(block, 1024)
        try:
            slow = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            slow = None
        if fast is None:
            fallbacks += 1
            continue
        assert slow is not None, block
        assert (fast.get_info(), fast.offset, fast.offset_data) == (slow.get_info(), 1024, 1024 + BLOCK)
        checked += 1
    assert checked > 300 and fallbacks > 50


def test_the_header_writer_fast_path_agrees_with_tarfile_byte_for_byte() -> None:
    from transformer.wire import ustar_header

    rng = random.Random(7)
    names = ["k.npy", "dir/sample-000001.image.npy", "a" * 100, "a" * 101, "caf\u00e9.npy", "x\udcff.npy", "n"]
    fast_cases = 0
    for case in range(800):
        info = tarfile.TarInfo(rng.choice(names))
        info.size = rng.choice([0, 1, 602_240, 8**11 - 1, 8**11])
        info.mtime = rng.choice([0, 1_700_000_000, 1_700_000_000.5, 8**11 - 1, 8**11, -1])
        info.mode = rng.choice([0o644, 0o7777, 0o100644])
        info.uid, info.gid = rng.choice([0, 1000, 8**7 - 1, 8**7, -1]), rng.choice([0, 99, 8**7])
        info.uname, info.gname = rng.choice(["", "user", "u" * 33, "\u00fc"]), rng.choice(["", "group"])
        if case % 2 == 0:  # half the cases plain, as the service writes them: the fast path answers
            info.name, info.size, info.mtime, info.uid, info.gid = f"s{case}.npy", 602_240, 1_700_000_000, 0, 0
            info.uname = rng.choice(["", "user"])
        if case % 10 == 0:
            info.type = rng.choice([tarfile.SYMTYPE, tarfile.DIRTYPE, tarfile.AREGTYPE])
            info.linkname = "target" if info.type == tarfile.SYMTYPE else ""
        if case % 13 == 0:
            info.pax_headers = {"comment": "x"}
        expected = info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")
        fast = ustar_header(info)
        if fast is not None:
            assert fast == expected, info.get_info()
            fast_cases += 1
    assert fast_cases > 100
