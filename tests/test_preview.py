"""The preview picture: a grid of de-normalized samples, for transformed (.npy) and raw shards."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from testbed.shardgen import jpeg_bytes, make_tar, read_tar
from transformer.cli import main
from transformer.config import VARIABLES, Settings
from transformer.demo import CLASSES, make_shards
from transformer.engine import transform_shard
from transformer.errors import TransformerError
from transformer.options import parse_etl_args
from transformer.pool import TransformPool
from transformer.preview import (
    collect_cells,
    detect_layout,
    grid_shape,
    mask_overlay,
    preview_figure,
    render_preview,
    to_display,
)
from transformer.spec import IMAGENET_MEAN, IMAGENET_STD

IMAGENET = (IMAGENET_MEAN, IMAGENET_STD)
DPI = 50  # small pictures keep the tests fast; the grid arithmetic is the same


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preview reads the service settings from the environment: make that environment known."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ETL_WORKERS", "2")


@pytest.fixture(scope="module")
def raw_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    (path,) = make_shards(tmp_path_factory.mktemp("raw"), shards=1, samples=5, seed=2, progress=False)
    return path


@pytest.fixture(scope="module")
def pet_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    (path,) = make_shards(tmp_path_factory.mktemp("pets"), shards=1, samples=3, seed=2, masks=True, progress=False)
    return path


def transformed(source: Path, target: Path, etl_args: str) -> Path:
    """``source`` through the engine exactly as ``wds-transform apply`` does (object name = file name)."""
    settings = Settings.from_env({"ETL_WORKERS": "2"})
    pool = TransformPool(2, 8)
    try:
        with open(source, "rb") as stream:
            chunks = transform_shard(stream, parse_etl_args(etl_args, settings), pool, shard=str(source),
                                     object_name=source.name, window=4)
            target.write_bytes(b"".join(bytes(c) for c in chunks))
    finally:
        pool.shutdown()
    return target


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as picture:
        assert picture.format == "PNG"
        return picture.size


# -- array handling ------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "layout"), [
    ((3, 224, 224), "CHW"), ((224, 224, 3), "HWC"), ((1, 64, 48), "CHW"), ((64, 48, 1), "HWC"),
    ((64, 48), "HW"), ((3, 5, 3), "HWC"),
])
def test_layout_is_read_from_the_shape(shape: tuple[int, ...], layout: str) -> None:
    assert detect_layout(shape) == layout


@pytest.mark.parametrize("shape", [(5, 64, 64), (224,), (2, 3, 4, 5)])
def test_an_array_that_is_no_image_is_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(TransformerError, match="neither CHW, HWC nor HW"):
        detect_layout(shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_normalized_floats_are_shown_as_the_pixels_they_came_from(dtype: type, layout: str) -> None:
    pixels = np.asarray(Image.open(io.BytesIO(jpeg_bytes(1, (40, 30)))).convert("RGB"))
    normalized = (pixels / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    array = (np.moveaxis(normalized, -1, 0) if layout == "CHW" else normalized).astype(dtype)
    shown = to_display(array, IMAGENET)
    assert shown.shape == (30, 40, 3)
    assert np.abs(shown - pixels / 255.0).max() < (2e-3 if dtype == np.float16 else 1e-5)


def test_uint8_is_shown_as_is_and_unnormalized_floats_as_unit_range() -> None:
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 14
    assert np.array_equal(to_display(pixels, IMAGENET), pixels / np.float32(255))  # never de-normalized
    assert np.allclose(to_display(pixels / np.float32(255), None), pixels / 255.0)
    gray = to_display(np.zeros((1, 8, 8), np.float32), ((0.5,), (0.25,)))  # Grayscale(1) + one-value Normalize
    assert gray.shape == (8, 8) and np.allclose(gray, 0.5)
    with pytest.raises(TransformerError, match="Normalize has 3 values but the image has 1 channels"):
        to_display(np.zeros((1, 8, 8), np.float32), IMAGENET)


def test_mask_overlay_leaves_the_background_clear() -> None:
    trimap = np.array([[2, 2, 3], [2, 1, 3]], np.uint8)
    overlay = mask_overlay(trimap, background=2)
    assert overlay.shape == (2, 3, 4)
    assert (overlay[..., 3][trimap == 2] == 0).all() and (overlay[..., 3][trimap != 2] > 0).all()
    assert not np.allclose(overlay[0, 2, :3], overlay[1, 1, :3])  # border and pet differ in colour


@pytest.mark.parametrize(("samples", "shape"), [(1, (1, 1)), (4, (2, 2)), (5, (3, 2)), (16, (4, 4)), (17, (5, 4))])
def test_grid_is_about_square(samples: int, shape: tuple[int, int]) -> None:
    assert grid_shape(samples) == shape


# -- transformed shards --------------------------------------------------------------------------


@pytest.mark.parametrize("etl_args", ['{"seed": 3}', '{"seed": 3, "dtype": "float16"}',
                                      '{"seed": 3, "dtype": "uint8", "layout": "HWC"}'])
def test_a_transformed_shard_is_drawn_de_normalized_with_keys_and_labels(
    raw_shard: Path, tmp_path: Path, etl_args: str
) -> None:
    shard = transformed(raw_shard, tmp_path / "out.tar", etl_args)
    reference = transformed(raw_shard, tmp_path / "uint8.tar", '{"seed": 3, "dtype": "uint8"}')
    cells, title = collect_cells(shard, 4)
    assert [cell.key for cell in cells] == [f"sample-{i:06d}" for i in range(4)]
    labels = [data.decode() for name, data in read_tar(shard.read_bytes()) if name.endswith(".cls")]
    assert [cell.label for cell in cells] == [f"cls {label} ({CLASSES[int(label)]})" for label in labels[:4]]
    assert cells[0].caption.startswith(parse_etl_args(etl_args, Settings()).dtype)
    # Whatever the dtype and layout, the picture is the same pixels (up to rounding).
    for cell, expected in zip(cells, collect_cells(reference, 4)[0]):
        assert cell.image.shape == (224, 224, 3) and cell.original is None
        assert np.abs(cell.image - expected.image).max() < 3 / 255

    output = tmp_path / "grid.png"
    render_preview(shard, output, count=4, dpi=DPI)
    columns, rows = grid_shape(4)
    figure = preview_figure(cells, title)
    inches = figure.get_size_inches()
    assert png_size(output) == (round(inches[0] * DPI), round(inches[1] * DPI))
    assert inches[0] == pytest.approx(columns * 2.3) and len(figure.subfigs) == columns * rows


def test_metadata_members_and_samples_without_pictures_are_not_drawn(tmp_path: Path) -> None:
    shard = tmp_path / "mixed.tar"
    shard.write_bytes(make_tar([
        ("a.txt", b"no picture here"), ("b.jpg", jpeg_bytes(0, (64, 48))), ("b.cls", b"1"),
        ("__etl__/errors.json", b'{"errors": []}'), ("c.png", jpeg_bytes(1, (64, 48))),
    ]))
    cells, _ = collect_cells(shard, 10, '{"seed": 1}')
    assert [cell.key for cell in cells] == ["b", "c"]
    assert cells[0].label == "cls 1" and cells[1].label == ""


# -- raw shards ----------------------------------------------------------------------------------


def test_a_raw_shard_goes_through_the_engine_first(raw_shard: Path, tmp_path: Path) -> None:
    cells, title = collect_cells(raw_shard, 3, '{"seed": 9}')
    assert "imagenet-train" in title and "seed 9" in title
    expected, _ = collect_cells(transformed(raw_shard, tmp_path / raw_shard.name, '{"seed": 9}'), 3)
    for cell, reference in zip(cells, expected):
        assert cell.key == reference.key and cell.label == reference.label
        assert np.array_equal(cell.image, reference.image)  # same seed, object name and key: same draw
        assert cell.original is not None and max(cell.original.shape[:2]) == 500

    output = tmp_path / "raw.png"
    render_preview(raw_shard, output, count=3, etl_args='{"seed": 9}', dpi=DPI)
    alone = tmp_path / "alone.png"
    render_preview(raw_shard, alone, count=3, etl_args='{"seed": 9}', originals=False, dpi=DPI)
    (wide, high), (narrow, same_high) = png_size(output), png_size(alone)
    assert wide == 2 * narrow and high == same_high  # originals double each cell's width


def test_a_raw_pet_shard_shows_the_trimap_on_both_pictures(pet_shard: Path, tmp_path: Path) -> None:
    cells, _ = collect_cells(pet_shard, 3, '{"seed": 1, "dtype": "uint8"}')
    for cell in cells:
        assert cell.mask.shape == (224, 224) and set(np.unique(cell.mask)) <= {1, 2, 3}
        assert cell.original_mask.shape == cell.original.shape[:2]
        assert cell.background == 2
    output = tmp_path / "pets.png"
    assert main(["preview", str(pet_shard), "-o", str(output), "--count", "3", "--etl-args", '{"seed": 1}']) == 0
    with Image.open(output) as picture:
        assert np.asarray(picture.convert("RGB")).std() > 20  # photographs were drawn, not an empty canvas


def test_a_skipped_sample_shows_why(tmp_path: Path) -> None:
    shard = tmp_path / "broken.tar"
    shard.write_bytes(make_tar([("a.jpg", jpeg_bytes(0, (64, 48))), ("b.jpg", b"not a jpeg"),
                                ("c.jpg", jpeg_bytes(2, (64, 48)))]))
    cells, _ = collect_cells(shard, 3, '{"seed": 1, "preset": "resize-224"}')
    assert [cell.key for cell in cells] == ["a", "b", "c"]
    assert cells[1].image is None and cells[1].caption.startswith("skipped: not a decodable image")
    assert cells[0].image is not None and cells[2].image is not None
    render_preview(shard, tmp_path / "grid.png", count=3, etl_args='{"seed": 1}', dpi=DPI)


# -- refusals ------------------------------------------------------------------------------------


def test_refusals_name_the_problem(tmp_path: Path, raw_shard: Path) -> None:
    text = tmp_path / "text.tar"
    text.write_bytes(make_tar([("a.txt", b"hello")]))
    with pytest.raises(TransformerError, match="no image or .npy samples"):
        render_preview(text, tmp_path / "grid.png")
    with pytest.raises(TransformerError, match="cannot open"):
        render_preview(tmp_path / "missing.tar", tmp_path / "grid.png")
    with pytest.raises(TransformerError, match="count must be at least 1"):
        render_preview(raw_shard, tmp_path / "grid.png", count=0)
    with pytest.raises(TransformerError, match="etl_args field 'dtype'"):
        render_preview(raw_shard, tmp_path / "grid.png", etl_args='{"dtype": "int7"}')
    assert not (tmp_path / "grid.png").exists()
