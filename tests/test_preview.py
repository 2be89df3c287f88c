"""The preview picture: a grid of transformed samples, for transformed and raw shards."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.shardgen import imagenet_like_shard, make_tar
from transformer.config import Settings
from transformer.engine import TransformPool, transform_shard
from transformer.options import parse_etl_args
from transformer.preview import render_preview, to_displayable
from transformer.spec import IMAGENET_MEAN, IMAGENET_STD


def _transformed(raw: bytes, etl_args: str) -> bytes:
    settings = Settings.from_env({"ETL_WORKERS": "2"})
    pool = TransformPool(2, 8)
    try:
        return b"".join(bytes(c) for c in transform_shard(io.BytesIO(raw), parse_etl_args(etl_args, settings), pool,
                                                          shard="s", object_name="s", window=4))
    finally:
        pool.shutdown()


@pytest.mark.parametrize("etl_args", ['{"preset": "imagenet-val"}', '{"dtype": "uint8", "layout": "HWC"}',
                                      '{"dtype": "float16", "preset": "resize-224"}'])
def test_preview_of_a_transformed_shard_is_a_png_grid(tmp_path, etl_args):
    shard = tmp_path / "out.tar"
    shard.write_bytes(_transformed(imagenet_like_shard(4, extra=False), etl_args))
    render_preview(shard, tmp_path / "grid.png", count=4)
    with Image.open(tmp_path / "grid.png") as picture:
        assert picture.format == "PNG" and picture.size[0] > 200 and picture.size[1] > 200
        pixels = np.asarray(picture.convert("RGB"))
    assert pixels.std() > 20  # real photographs were drawn, not an empty canvas


def test_preview_of_a_raw_shard_transforms_it_first(tmp_path):
    shard = tmp_path / "raw.tar"
    shard.write_bytes(imagenet_like_shard(2, extra=False))
    output = tmp_path / "grid.png"
    subprocess.run([sys.executable, "-m", "transformer", "preview", str(shard), "-o", str(output), "--count", "2",
                    "--etl-args", '{"seed": 1}'], check=True, capture_output=True, timeout=120)
    with Image.open(output) as picture:
        assert picture.format == "PNG"


def test_preview_refuses_a_shard_without_images(tmp_path):
    shard = tmp_path / "text.tar"
    shard.write_bytes(make_tar([("a.txt", b"hello")]))
    with pytest.raises(ValueError, match="no image"):
        render_preview(shard, tmp_path / "grid.png")


def test_to_displayable_undoes_imagenet_normalization():
    rgb = np.random.default_rng(0).random((8, 8, 3)).astype(np.float32)
    normalized = (rgb - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD, np.float32)
    chw = np.moveaxis(normalized, -1, 0)
    assert np.allclose(to_displayable(chw), rgb, atol=1e-5)
    assert np.allclose(to_displayable((rgb * 255).astype(np.uint8)), np.floor(rgb * 255) / 255, atol=1e-6)
