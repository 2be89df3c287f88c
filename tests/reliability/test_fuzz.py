"""Property-based fuzzing (hypothesis) of every parser a request reaches.

Each parser either succeeds or raises its one documented error type (``ShardError``,
``OptionsError``, ``RequestError``): no other exception, no hang (hypothesis' per-example deadline),
no unbounded memory (tracemalloc peak for the tar reader). Kept to a few seconds each for CI; the
long runs are ``bench/fuzz_*.py`` under atheris.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import tracemalloc
from pathlib import Path
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from webdataset.tariterators import base_plus_ext

from testbed.shardgen import make_tar, read_tar
from transformer.config import Settings
from transformer.engine import transform_shard
from transformer.errors import OptionsError, RequestError, ShardError
from transformer.options import TransformOptions, options_from_mapping, parse_etl_args
from transformer.pool import TransformPool
from transformer.server.fqn import resolve_fqn
from transformer.server.hops import DirectPutTarget, EtlStage, parse_node_url
from transformer.shards import read_samples
from transformer.spec import ALLOWED, PRESETS, build_pipeline, parse_spec_text

SETTINGS = Settings.from_env({"ETL_MAX_MEMBER_BYTES": str(2**20)})
FAST = settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
SEED_SHARD = make_tar([("a.cls", b"1"), ("a.json", b'{"k": 1}'), ("b/c.txt", b"x" * 700), ("d.cls", b"2")])


def _read_all(data: bytes) -> list:
    return [(s.key, [(m.info.name, m.data) for m in s.members]) for s in read_samples(io.BytesIO(data), "f.tar", 2**20)]


def _reads_or_refuses(data: bytes) -> None:
    tracemalloc.start()
    try:
        _read_all(data)
    except ShardError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak} bytes for a {len(data)}-byte input"


# ------------------------------------------------------------------------------------ tar reader


@FAST
@given(st.binary(max_size=8192))
def test_tar_reader_on_arbitrary_bytes(data: bytes) -> None:
    _reads_or_refuses(data)


@FAST
@given(st.lists(st.tuples(st.integers(0, len(SEED_SHARD) - 1), st.integers(0, 255)), min_size=1, max_size=12),
       st.integers(0, len(SEED_SHARD)), st.booleans())
def test_tar_reader_on_mutated_shards(flips: list[tuple[int, int]], cut: int, compress: bool) -> None:
    data = bytearray(SEED_SHARD)
    for position, value in flips:
        data[position] = value
    mutated = bytes(data[:cut])
    _reads_or_refuses(gzip.compress(mutated, mtime=0) if compress else mutated)


@FAST
@given(st.integers(0, 2**40), st.sampled_from([b"0", b"5", b"L", b"x", b"g", b"K"]))
def test_tar_reader_on_lying_headers(size: int, kind: bytes) -> None:
    # Headers that claim huge sizes or odd types, with a few bytes of payload behind them.
    info = tarfile.TarInfo("liar.bin")
    header = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    header[124:136] = (b"%011o\0" % size) if size < 8**11 else b"\x80" + size.to_bytes(11, "big")
    header[156:157] = kind
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    _reads_or_refuses(bytes(header) + b"A" * 1024 + b"\0" * 1024)


# ----------------------------------------------------------------------------------- grouping

_SEGMENT = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\0/"), min_size=1,
                   max_size=12).filter(lambda s: s not in (".", ".."))
_NAME = st.builds(lambda parts, ext: "/".join(parts) + ext,
                  st.lists(st.one_of(_SEGMENT, st.sampled_from([".", "..", "a.b", "__k__"])), min_size=1, max_size=3),
                  st.sampled_from(["", ".cls", ".json", ".seg.txt", ".a.b.c", ".", ".CLS"]))
_MEMBERS = st.lists(st.tuples(_NAME, st.binary(max_size=600)), min_size=1, max_size=12)


@FAST
@given(_MEMBERS)
def test_grouping_keeps_every_member_in_order_under_its_webdataset_key(members: list[tuple[str, bytes]]) -> None:
    assume(all(not n.endswith("/") for n, _ in members))
    samples = list(read_samples(io.BytesIO(make_tar(members)), "g.tar", 2**20))
    flat = [(m.info.name, m.data) for s in samples for m in s.members]
    assert flat == members
    for sample in samples:
        for member, extension in zip(sample.members, sample.extensions):
            if extension is not None:
                assert base_plus_ext(member.info.name) == (sample.key, extension)


@pytest.fixture(scope="module")
def pool():
    pool = TransformPool(workers=1, max_inflight=4)
    yield pool
    pool.shutdown()


@FAST
@given(members=_MEMBERS)
def test_shards_without_images_stream_through_byte_exact(members: list[tuple[str, bytes]], pool) -> None:
    assume(all(not n.endswith("/") for n, _ in members))
    assume(not any(n.rsplit(".", 1)[-1].lower() in SETTINGS.image_exts for n, _ in members if "." in n))
    options = options_from_mapping({}, SETTINGS)
    output = b"".join(bytes(c) for c in transform_shard(io.BytesIO(make_tar(members)), options, pool,
                                                          shard="g.tar", object_name="g.tar", window=3))
    assert read_tar(output) == members


# ------------------------------------------------------------------------------- etl_args, spec

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
_KWARG_VALUE = (st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_infinity=True)
                | st.text(max_size=12) | st.lists(st.integers(-5, 5000) | st.floats(-10, 10), max_size=4))
_KWARG_NAMES = st.sampled_from(["size", "p", "degrees", "padding", "fill", "kernel_size", "sigma", "mean", "std",
                                "scale", "ratio", "interpolation", "antialias", "max_size", "brightness", "hue",
                                "distortion_scale", "bits", "threshold", "sharpness_factor", "expand", "center",
                                "translate", "shear", "padding_mode", "pad_if_needed", "num_output_channels", "evil"])
_STEP = st.one_of(
    st.sampled_from(sorted(ALLOWED)),
    st.builds(lambda n, kw: {n: kw}, st.sampled_from(sorted(ALLOWED) + ["Lambda", "Compose", ""]),
              st.dictionaries(_KWARG_NAMES, _KWARG_VALUE, max_size=4)),
    st.builds(lambda n, kw: {"name": n, **kw}, st.sampled_from(sorted(ALLOWED)),
              st.dictionaries(_KWARG_NAMES, _KWARG_VALUE, max_size=3)),
    _JSON,
)
_ARGS = st.fixed_dictionaries({}, optional={
    "preset": st.sampled_from(sorted(PRESETS)) | st.text(max_size=15) | _JSON,
    "transforms": st.lists(_STEP, max_size=4) | st.text(max_size=40) | _JSON,
    "dtype": st.sampled_from(["float32", "float16", "uint8", "int8", ""]) | _JSON,
    "layout": st.sampled_from(["CHW", "HWC", "hwc"]) | _JSON,
    "seed": st.integers(-(2**70), 2**70) | _JSON,
    "epoch": st.integers(-5, 2**40) | _JSON,
    "on_error": st.sampled_from(["skip", "fail", "passthrough", "explode"]) | _JSON,
    "extra": _JSON,
})


def _options_or_refusal(raw: str) -> TransformOptions | None:
    try:
        return parse_etl_args(raw, SETTINGS)
    except OptionsError as exc:
        assert exc.status == 400 and exc.field and exc.reason
        return None


@FAST
@given(st.text(max_size=200))
def test_etl_args_on_arbitrary_text(raw: str) -> None:
    _options_or_refusal(raw)


@settings(max_examples=1000, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(_ARGS)
def test_etl_args_on_structured_objects(args: dict) -> None:
    options = _options_or_refusal(json.dumps(args))
    if options is not None:  # what is accepted is a usable pipeline
        assert options.dtype in ("float32", "float16", "uint8") and options.on_error in ("skip", "fail", "passthrough")


@FAST
@given(st.text(max_size=300))
def test_spec_text_parser(text: str) -> None:
    try:
        spec = parse_spec_text(text, "ETL_TRANSFORMS")
        build_pipeline(spec, "ETL_TRANSFORMS")
    except OptionsError:
        pass


# -------------------------------------------------------------------------------- Ais-Node-Url

_URLISH = st.one_of(
    st.text(max_size=60),
    st.builds(lambda scheme, host, path, query: f"{scheme}{host}{path}{query}",
              st.sampled_from(["http://", "https://", "ftp://", "", "http:", "//"]),
              st.sampled_from(["127.0.0.1:1", "[::1]:2", "host", "", "a@b:3", "h:99999", "h:-1", "h:x"]),
              st.sampled_from(["", "/", "/ais%2F@%23%2Fb%2Fo", "/a/b", "/%zz", "/x y"]),
              st.sampled_from(["", "?owt=3&uuid=x", "?", "#frag"])),
)


@FAST
@given(st.lists(_URLISH, min_size=1, max_size=4), st.text(max_size=30), st.text(max_size=30))
def test_ais_node_url_parser(entries: list[str], path: str, etl_args: str) -> None:
    value = ",".join(entries)
    try:
        hop = parse_node_url(value, path, etl_args, "http://t:8080/v1/etl/_object/e/S")
    except RequestError as exc:
        assert exc.status in (400, 500) and ("Ais-Node-Url" in exc.message or "AIS_TARGET_URL" in exc.message)
        return
    assert hop is None or isinstance(hop, DirectPutTarget | EtlStage)
    if isinstance(hop, DirectPutTarget):
        assert hop.url.startswith(("http://", "https://"))
    if isinstance(hop, EtlStage):
        # Any object path reaches the next stage as a valid request target that decodes back to it.
        target = hop.url.split("://", 1)[1]
        target = target[target.index("/"):]
        assert all("!" <= c <= "~" for c in target), target
        assert unquote(target.split("?", 1)[0]) == "/" + path


# ----------------------------------------------------------------------------------------- fqn

_FQN_PART = st.sampled_from(["..", ".", "%ob", "@ais", "bck", "o.tar", "%2e%2e", "%252e", "link", "mp1", "", "a%2Fb",
                             "@", "%"])


@pytest.fixture(scope="module")
def fqn_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fqnroot")
    obj = root / "mp1" / "@ais" / "bck" / "%ob" / "o.tar"
    obj.parent.mkdir(parents=True)
    obj.write_bytes(b"x")
    outside = tmp_path_factory.mktemp("outside") / "@ais" / "bck" / "%ob"
    outside.mkdir(parents=True)
    (outside / "o.tar").write_bytes(b"secret")
    os.symlink(outside / "o.tar", root / "mp1" / "@ais" / "bck" / "%ob" / "link")
    return root


@FAST
@given(parts=st.lists(_FQN_PART, max_size=8), absolute=st.booleans())
def test_resolved_fqn_is_always_an_object_file_under_the_root(parts: list[str], absolute: bool,
                                                              fqn_root: Path) -> None:
    raw = (str(fqn_root) + "/" if absolute else "") + "/".join(parts)
    try:
        path = resolve_fqn(raw, (str(fqn_root),))
    except RequestError as exc:
        assert exc.status in (400, 403, 404)
        return
    assert path.startswith(str(fqn_root) + "/") and os.path.isfile(path)
    assert "/%ob/" in path and Path(path).read_bytes() == b"x"


@pytest.mark.parametrize(
    "spec_text",
    [
        "- Resize: {size: ,7777777770}\n- GaussianBlur: {kernel_size: 3}",  # found by bench/fuzz_etl_args.py
        "- Resize: {size: 2020-01-01}",
        "- Resize: {size: !!set {1, 2}}",
        "- Resize: {size: !!binary aGk=}",
    ],
    ids=["int-key", "date", "set", "bytes"],
)
def test_yaml_values_that_are_not_json_are_a_400(spec_text: str) -> None:
    with pytest.raises(OptionsError) as info:
        parse_etl_args(json.dumps({"transforms": spec_text}), SETTINGS)
    assert info.value.field == "transforms[0]"
