"""atheris (libFuzzer) run over ``etl_args``, the spec and its use on a sample: ``python -m bench.fuzz_etl_args``.

Any ``etl_args`` string must parse into options or raise ``OptionsError`` (a 400); options that parse
must transform a small real image or raise ``SampleTransformError`` (a per-sample outcome). Anything else is a
crash; ``-timeout`` catches hangs, ``-rss_limit_mb`` unbounded memory (a huge Resize/Pad from the
arguments must be refused, not allocated). Example::

    python -m bench.fuzz_etl_args -max_total_time=600 -timeout=20 -rss_limit_mb=3072

libFuzzer prints ``Done <N> runs in <T> second(s)`` at the end: N is the number of executions.
"""

from __future__ import annotations

import contextlib
import io
import json
import tarfile

import atheris

with atheris.instrument_imports(include=["transformer"]):
    from transformer.config import Settings
    from transformer.errors import OptionsError, SampleTransformError
    from transformer.options import parse_etl_args
    from transformer.samples import transform_sample
    from transformer.shards import read_samples

from PIL import Image  # noqa: E402 - after the instrumented imports

SETTINGS = Settings.from_env({"ETL_WORKERS": "1"})


def _sample():
    image = io.BytesIO()
    Image.new("RGB", (32, 24), (120, 40, 200)).save(image, "JPEG")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in (("k.jpg", image.getvalue()), ("k.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return next(read_samples(io.BytesIO(buffer.getvalue()), "fuzz.tar", 1 << 20))


SAMPLE = _sample()


def seeds() -> list[bytes]:
    specs = [
        {},
        {"preset": "imagenet-val", "dtype": "uint8"},
        {"preset": "imagenet-train", "seed": 3, "epoch": 1, "layout": "HWC"},
        {"transforms": [{"Resize": {"size": 40}}, {"CenterCrop": {"size": 16}},
                        {"Normalize": {"mean": [0.5, 0.5, 0.5], "std": [0.2, 0.2, 0.2]}}]},
        {"transforms": ["RandomHorizontalFlip", {"name": "ColorJitter", "brightness": 0.4}], "on_error": "fail"},
        {"transforms": [{"RandomRotation": {"degrees": 30, "expand": True, "interpolation": "bilinear"}}]},
        {"transforms": "- Resize: {size: 20}\n- GaussianBlur: {kernel_size: 3}"},
    ]
    return [json.dumps(s).encode() for s in specs]


def test_one_input(data: bytes) -> None:
    raw = data.decode("utf-8", "replace")
    try:
        options = parse_etl_args(raw, SETTINGS)
    except OptionsError:
        return
    with contextlib.suppress(SampleTransformError):  # a per-sample outcome, reported in the error manifest
        transform_sample(SAMPLE, options, "fuzz.tar", "fuzz.tar")


def main() -> None:
    from bench.fuzzing import run

    run(test_one_input, seeds(), "args")


if __name__ == "__main__":
    main()
