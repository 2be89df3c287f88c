"""Transforms that would allocate a huge canvas are refused before they allocate.

``ETL_MAX_IMAGE_PIXELS`` checks the decoded image, but a transform can still grow it: an ordinary
``Resize(256)`` of a 1 x 100000 strip (100k pixels, accepted) asks for 256 x 25.6M pixels (19 GB),
and ``Pad``/``CenterCrop`` with a large size from ``etl_args`` do the same on any image. Each step's
output size is predicted from metadata first; an oversized one is a sample error naming the step.
"""

from __future__ import annotations

import io
import resource
import time
from collections.abc import Callable

import numpy as np
import pytest

from testbed import inputs
from testbed.shardgen import png_bytes
from transformer.errors import SampleTransformError
from transformer.options import TransformOptions
from transformer.samples import transform_sample
from transformer.shards import Sample


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize(
    ("etl_args", "image", "expected"),
    [
        ({"preset": "imagenet-val"}, png_bytes(np.full((1, 100_000, 3), 9, np.uint8)),
         "Resize would turn 1x100000 into 256x25600000 = 6553600000 pixels"),
        ({"transforms": [{"Resize": {"size": 100_000}}]}, inputs.photo_jpeg(), "Resize would turn 120x160 into"),
        ({"transforms": [{"Pad": {"padding": 100_000}}]}, inputs.photo_jpeg(), "Pad would turn 120x160 into"),
        ({"transforms": [{"CenterCrop": {"size": 50_000}}]}, inputs.photo_jpeg(),
         "CenterCrop would turn 120x160 into 50000x50000"),
        ({"transforms": [{"RandomCrop": {"size": 40_000, "pad_if_needed": True}}]}, inputs.photo_jpeg(),
         "RandomCrop would turn 120x160 into 40000x40000"),
    ],
    ids=["strip-through-imagenet-val", "resize", "pad", "center-crop", "random-crop-padded"],
)
def test_oversized_canvas_is_a_sample_error_before_allocating(
    etl_args: dict, image: bytes, expected: str,
    make_options: Callable[..., TransformOptions], make_sample: Callable[[list[tuple[str, bytes]]], Sample],
) -> None:
    sample = make_sample([("k.png", image), ("k.cls", b"1")])
    before, started = peak_rss(), time.monotonic()
    with pytest.raises(SampleTransformError) as info:
        transform_sample(sample, make_options(**etl_args), "s.tar", "s.tar")
    assert (info.value.shard, info.value.key, info.value.member) == ("s.tar", "k", "k.png")
    assert expected in info.value.reason and "(ETL_MAX_IMAGE_PIXELS)" in info.value.reason
    assert time.monotonic() - started < 5
    assert peak_rss() - before < 300 * 2**20, "the canvas was allocated"


def test_ordinary_outputs_pass_under_a_small_pixel_limit(
    make_sample: Callable[[list[tuple[str, bytes]]], Sample],
) -> None:
    # A small ETL_MAX_IMAGE_PIXELS is about inputs; 224 x 224 outputs stay allowed (floor 4096 x 4096).
    from transformer.config import Settings
    from transformer.options import options_from_mapping

    options = options_from_mapping({"preset": "resize-224"}, Settings.from_env({"ETL_MAX_IMAGE_PIXELS": "20000"}))
    (member,) = transform_sample(make_sample([("k.jpg", inputs.jpeg_bytes(0, (160, 120)))]), options, "s", "s")
    assert np.load(io.BytesIO(member.data), allow_pickle=False).shape == (3, 224, 224)
