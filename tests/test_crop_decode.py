"""Decoding only the crop window, or at a reduced DCT scale when asked: same draws, torchvision's output, fallbacks."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

import numpy as np
import pytest
import torch
from PIL import Image
from prometheus_client import generate_latest
from torchvision.transforms import v2

from testbed.shardgen import jpeg_bytes, photo, png_bytes, textured_jpeg, torchvision_decode, trimap_bytes
from transformer import samples as samples_module
from transformer.cropdecode import Window, window_of
from transformer.errors import SampleTransformError
from transformer.options import TransformOptions
from transformer.samples import transform_sample
from transformer.shards import Member, Sample
from transformer.spec import IMAGENET_MEAN, IMAGENET_STD, build_pipeline

MakeOptions = Callable[..., TransformOptions]
MakeSample = Callable[[list[tuple[str, bytes]]], Sample]


def run(sample: Sample, options: TransformOptions) -> dict[str, np.ndarray]:
    members: list[Member] = transform_sample(sample, options, "shard.tar", "bucket/shard.tar")
    return {m.info.name: np.load(io.BytesIO(m.data)) for m in members if m.info.name.endswith(".npy")}


def paths_during(action: Callable[[], object]) -> dict[tuple[str, str], int]:
    before = samples_module.decode_paths()
    action()
    after = samples_module.decode_paths()
    return {key: count - before.get(key, 0) for key, count in after.items() if count != before.get(key, 0)}


def grainy_jpeg(size: tuple[int, int], index: int = 1, quality: int = 90) -> bytes:
    """A photograph at ``size`` with sensor-like grain, as a camera's multi-megapixel JPEG."""
    image = np.asarray(Image.fromarray(photo(index)).convert("RGB").resize(size, Image.Resampling.BICUBIC))
    grain = np.random.default_rng(index).normal(0, 6, image.shape[:2] + (1,))
    noisy = np.clip(image + grain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noisy).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


VAL_GEOMETRY = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])


def val_reference(data: bytes) -> np.ndarray:
    """torchvision's imagenet-val on the fully decoded image, float32 normalized."""
    reference = v2.Compose([VAL_GEOMETRY, v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD)])
    return reference(torchvision_decode(data, rgb=True)).numpy()


def in_pixel_units(difference: np.ndarray) -> float:
    """Mean absolute difference of normalized CHW outputs, in [0, 1] pixel units (undoing the std)."""
    return float((np.abs(difference) * np.array(IMAGENET_STD).reshape(3, 1, 1)).mean())


# --- accuracy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("index, size", [(0, (500, 375)), (1, (375, 500)), (2, (500, 333)), (0, (640, 480)),
                                         (1, (2048, 1365))])
def test_random_resized_crop_from_the_window_is_the_full_decodes_output_bit_for_bit(
    make_sample: MakeSample, make_options: MakeOptions, index: int, size: tuple[int, int]
) -> None:
    data = jpeg_bytes(index, size)
    for seed in range(8):
        on = run(make_sample([("k.jpg", data)]), make_options(seed=seed, dtype="uint8"))
        off = run(make_sample([("k.jpg", data)]), make_options(seed=seed, dtype="uint8", crop_decode=False))
        np.testing.assert_array_equal(on["k.npy"], off["k.npy"])


def test_center_crop_alone_is_the_window_itself_and_outputs_do_not_share_the_decoders_buffer(
    make_sample: MakeSample, make_options: MakeOptions
) -> None:
    crop = {"transforms": [{"CenterCrop": {"size": [200, 300]}}], "dtype": "uint8"}
    first, second = jpeg_bytes(0, (500, 375)), jpeg_bytes(1, (500, 375))
    kept = {}

    def both() -> None:
        kept["first"] = run(make_sample([("k.jpg", first)]), make_options(**crop))["k.npy"]
        kept["second"] = run(make_sample([("k.jpg", second)]), make_options(**crop))["k.npy"]

    assert paths_during(both) == {("window", ""): 2}
    for name, data in (("first", first), ("second", second)):
        whole = run(make_sample([("k.jpg", data)]), make_options(crop_decode=False, **crop))["k.npy"]
        np.testing.assert_array_equal(kept[name], whole)


def test_imagenet_size_images_take_the_window_for_train_and_decode_whole_for_val(
    make_sample: MakeSample, make_options: MakeOptions
) -> None:
    data = jpeg_bytes(0, (500, 375))
    train = paths_during(lambda: [run(make_sample([("k.jpg", data)]), make_options(seed=s)) for s in range(20)])
    assert train.get(("window", ""), 0) >= 15 and "scaled" not in {path for path, _ in train}
    val = paths_during(lambda: run(make_sample([("k.jpg", data)]), make_options(preset="imagenet-val")))
    assert val == {("full", "no_gain"): 1}  # a sub-pixel region at full scale


# Sizes like ImageNet's validation set, (width, height): short side 200 to 2400, aspect ratios 1:1 to 4:1,
# both orientations, odd sizes; from a short side of 512 on, the region imagenet-val reads is at least
# twice its output, where a DCT-scaled decode would apply.
SPREAD = [(267, 200), (200, 300), (500, 375), (375, 500), (500, 333), (448, 448), (511, 383), (683, 512),
          (512, 768), (833, 557), (1001, 751), (769, 1153), (1500, 1000), (2048, 1365), (1367, 2049), (3008, 2000),
          (4000, 1000), (600, 2400)]


def spread_jpeg(size: tuple[int, int]) -> bytes:
    index = SPREAD.index(size)  # quality 75 to 95, every fifth image greyscale
    return textured_jpeg(*size, index, 75 + 5 * (index % 5), grey=index % 5 == 4)


@pytest.mark.parametrize("size", SPREAD, ids=lambda size: f"{size[0]}x{size[1]}")
def test_imagenet_val_by_default_is_torchvisions_output_at_every_size(
    make_sample: MakeSample, make_options: MakeOptions, size: tuple[int, int]
) -> None:
    data = spread_jpeg(size)
    outputs = {}

    def both() -> None:
        outputs["uint8"] = run(make_sample([("k.jpg", data)]), make_options(preset="imagenet-val", dtype="uint8"))
        outputs["float32"] = run(make_sample([("k.jpg", data)]), make_options(preset="imagenet-val"))

    paths = paths_during(both)
    assert set(paths) == {("full", "no_gain")}, paths  # decoded whole, never at a reduced DCT scale
    np.testing.assert_array_equal(outputs["uint8"]["k.npy"], VAL_GEOMETRY(torchvision_decode(data, rgb=True)).numpy())
    error = in_pixel_units(outputs["float32"]["k.npy"] - val_reference(data))
    assert error <= 0.002, f"mean absolute error {error:.5f} in [0, 1] units for {size}"


@pytest.mark.parametrize("size", SPREAD, ids=lambda size: f"{size[0]}x{size[1]}")
def test_the_other_presets_by_default_are_torchvisions_output_at_every_size(
    make_sample: MakeSample, make_options: MakeOptions, size: tuple[int, int]
) -> None:
    data = spread_jpeg(size)
    outputs = {}

    def presets() -> None:
        outputs["resize"] = run(make_sample([("k.jpg", data)]), make_options(preset="resize-224", dtype="uint8"))
        for seed in range(2):
            outputs[seed] = run(make_sample([("k.jpg", data)]), make_options(seed=seed, dtype="uint8"))

    assert "scaled" not in {path for path, _ in paths_during(presets)}
    resize = v2.Resize([224, 224], antialias=True)
    np.testing.assert_array_equal(outputs["resize"]["k.npy"], resize(torchvision_decode(data, rgb=True)).numpy())
    for seed in range(2):  # torchvision's RandomResizedCrop and flip with the same draws: the whole-image path
        whole = run(make_sample([("k.jpg", data)]), make_options(seed=seed, dtype="uint8", crop_decode=False))
        np.testing.assert_array_equal(outputs[seed]["k.npy"], whole["k.npy"])


@pytest.mark.parametrize("size", [s for s in SPREAD if min(s) >= 512], ids=lambda size: f"{size[0]}x{size[1]}")
def test_dct_scaling_is_the_faster_inexact_path_when_asked_for(
    make_sample: MakeSample, make_options: MakeOptions, size: tuple[int, int]
) -> None:
    data = spread_jpeg(size)
    outputs = {}

    def val() -> None:
        outputs["val"] = run(make_sample([("k.jpg", data)]), make_options(preset="imagenet-val", dct_scaling=True))

    assert paths_during(val) == {("scaled", ""): 1}
    error = in_pixel_units(outputs["val"]["k.npy"] - val_reference(data))
    assert error < 0.015, f"imagenet-val with dct_scaling: {error:.5f} for {size}"  # measured: up to 0.0096


@pytest.mark.parametrize("size", [(3000, 2000), (2000, 3000), (1024, 683), (4000, 3000)])
def test_dct_scaling_on_multi_megapixel_photos_is_within_0_01_of_torchvision_in_pixel_units(
    make_sample: MakeSample, make_options: MakeOptions, size: tuple[int, int]
) -> None:
    data = grainy_jpeg(size)
    counted = {}

    def val() -> None:
        counted["val"] = run(make_sample([("k.jpg", data)]), make_options(preset="imagenet-val", dct_scaling=True))

    assert paths_during(val) == {("scaled", ""): 1}
    val_error = in_pixel_units(counted["val"]["k.npy"] - val_reference(data))
    assert val_error < 0.01, f"imagenet-val: {val_error:.5f} for {size}"
    for seed in range(3):  # torchvision's own pipeline with the same draws is the full-decode path
        fast = run(make_sample([("k.jpg", data)]), make_options(seed=seed, dct_scaling=True))["k.npy"]
        default = run(make_sample([("k.jpg", data)]), make_options(seed=seed))["k.npy"]
        off = run(make_sample([("k.jpg", data)]), make_options(seed=seed, crop_decode=False))["k.npy"]
        np.testing.assert_array_equal(default, off)
        train_error = in_pixel_units(fast - off)
        assert train_error < 0.01, f"imagenet-train seed {seed}: {train_error:.5f} for {size}"


def test_seeded_imagenet_train_is_reproducible_and_draws_what_it_drew_before(
    make_sample: MakeSample, make_options: MakeOptions
) -> None:
    big = grainy_jpeg((3000, 2000))
    for data in (jpeg_bytes(0), big):
        first = run(make_sample([("k.jpg", data)]), make_options(seed=7, epoch=2))["k.npy"]
        again = run(make_sample([("k.jpg", data)]), make_options(seed=7, epoch=2))["k.npy"]
        np.testing.assert_array_equal(first, again)
    # A DCT-scaled crop is the one the full-decode path draws: another seed's crop is far further away.
    fast = run(make_sample([("k.jpg", big)]), make_options(seed=7, dct_scaling=True))["k.npy"]
    same = in_pixel_units(fast - run(make_sample([("k.jpg", big)]), make_options(seed=7, crop_decode=False))["k.npy"])
    other = in_pixel_units(fast - run(make_sample([("k.jpg", big)]), make_options(seed=8, crop_decode=False))["k.npy"])
    assert same < 0.01 < other


def test_masks_get_the_same_crop_as_the_window(make_sample: MakeSample, make_options: MakeOptions) -> None:
    members = [("k.image.jpg", jpeg_bytes(0, (500, 375))), ("k.trimap.png", trimap_bytes((500, 375)))]
    for seed in range(6):
        on = run(make_sample(members), make_options(seed=seed, dtype="uint8"))
        off = run(make_sample(members), make_options(seed=seed, dtype="uint8", crop_decode=False))
        np.testing.assert_array_equal(on["k.trimap.npy"], off["k.trimap.npy"])
        np.testing.assert_array_equal(on["k.image.npy"], off["k.image.npy"])
    big = [("k.image.jpg", grainy_jpeg((2000, 1500))), ("k.trimap.png", trimap_bytes((2000, 1500)))]
    for preset in ("imagenet-train", "imagenet-val"):
        fast = make_options(preset=preset, seed=1, dtype="uint8", dct_scaling=True)
        assert paths_during(lambda fast=fast: run(make_sample(big), fast)) == {("scaled", ""): 1}
        off = run(make_sample(big), make_options(preset=preset, seed=1, dtype="uint8", crop_decode=False))
        np.testing.assert_array_equal(run(make_sample(big), fast)["k.trimap.npy"], off["k.trimap.npy"])
        default = run(make_sample(big), make_options(preset=preset, seed=1, dtype="uint8"))
        np.testing.assert_array_equal(default["k.trimap.npy"], off["k.trimap.npy"])
        np.testing.assert_array_equal(default["k.image.npy"], off["k.image.npy"])


# --- fallbacks, counted ----------------------------------------------------------------------------


def test_every_fallback_decodes_whole_and_says_why(make_sample: MakeSample, make_options: MakeOptions) -> None:
    jpeg = jpeg_bytes(0, (500, 375))
    cmyk = jpeg_bytes(0, (500, 375), mode="CMYK")
    progressive = io.BytesIO()
    Image.open(io.BytesIO(jpeg_bytes(0, (2000, 1500)))).save(progressive, "JPEG", quality=90, progressive=True)
    cases = [
        ([("k.png", png_bytes(photo(0)))], {}, "not_jpeg"),
        ([("k.jpg", progressive.getvalue())], {}, "progressive"),
        ([("k.jpg", progressive.getvalue())], {"preset": "imagenet-val"}, "progressive"),
        ([("k.jpg", cmyk)], {}, "colorspace"),
        ([("k.jpg", jpeg)], {"crop_decode": False}, "disabled"),
        ([("k.jpg", jpeg)], {"transforms": [{"ColorJitter": {"brightness": 0.2}}, {"RandomResizedCrop": {"size": 64}}]},
         "transforms"),
        ([("k.jpg", jpeg), ("k.left.jpg", jpeg)], {}, "several_images"),
        ([("k.jpg", jpeg)], {"preset": "imagenet-val"}, "no_gain"),
        ([("k.jpg", jpeg)], {"transforms": [{"CenterCrop": {"size": 600}}]}, "pads"),
        ([("k.image.jpg", jpeg), ("k.trimap.png", trimap_bytes((400, 300)))], {}, "mask_size"),
    ]
    for members, etl_args, reason in cases:
        options = make_options(seed=3, dtype="uint8", **etl_args)

        def transform(members=members, options=options) -> None:
            # mask_size: torchvision's own path refuses the mismatch, as with crop_decode off
            with contextlib.suppress(SampleTransformError):
                run(make_sample(members), options)

        counted = paths_during(transform)
        assert set(counted) == {("full", reason)}, (reason, counted)
    off = make_options(seed=3, dtype="uint8", crop_decode=False)
    np.testing.assert_array_equal(run(make_sample([("k.jpg", cmyk)]), make_options(seed=3, dtype="uint8"))["k.npy"],
                                  run(make_sample([("k.jpg", cmyk)]), off)["k.npy"])


def test_grey_jpegs_take_the_window_and_match_the_full_decode(make_sample: MakeSample,
                                                              make_options: MakeOptions) -> None:
    grey = jpeg_bytes(1, (500, 375), mode="L")
    for seed in range(4):
        on = run(make_sample([("k.jpg", grey)]), make_options(seed=seed, dtype="uint8"))["k.npy"]
        off = run(make_sample([("k.jpg", grey)]), make_options(seed=seed, dtype="uint8", crop_decode=False))["k.npy"]
        np.testing.assert_array_equal(on, off)


def test_a_corrupt_jpeg_fails_on_its_member_or_decodes_either_way(make_sample: MakeSample,
                                                                  make_options: MakeOptions) -> None:
    data = jpeg_bytes(0, (3000, 2000))
    cut = data[: len(data) // 3] + b"\xff\xd9"
    for crop_decode in (True, False):
        try:
            out = run(make_sample([("k.jpg", cut)]), make_options(seed=1, crop_decode=crop_decode))
        except SampleTransformError as exc:
            assert exc.member == "k.jpg"
        else:
            assert out["k.npy"].shape == (3, 224, 224)  # libjpeg's warning, not an error, either way


def test_progressive_is_told_from_the_frame_header() -> None:
    from transformer.cropdecode import _progressive

    image = Image.fromarray(photo(0)).resize((64, 48))
    for progressive in (False, True):
        for extra in ({}, {"exif": Image.Exif().tobytes()}, {"icc_profile": b"\0" * 3000}):
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", progressive=progressive, **extra)
            assert _progressive(bytearray(buffer.getvalue())) is progressive, (progressive, list(extra))
    assert _progressive(bytearray(b"\xff\xd8\xff")) is False


def test_metrics_count_the_paths() -> None:
    from transformer.server.metrics import Metrics

    samples_module._count("window", "")
    text = generate_latest(Metrics().registry).decode()
    assert 'etl_decode_path_total{path="window",reason=""}' in text


# --- geometry ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("height, width", [(375, 500), (2000, 3000), (683, 1024), (257, 1000), (4000, 300)])
def test_the_dct_scale_never_leaves_the_region_below_the_output_size(height: int, width: int) -> None:
    for preset in ("imagenet-train", "imagenet-val", "resize-224"):
        pipeline = build_pipeline(preset)
        transforms = pipeline.transforms[: pipeline.geometry]
        for seed in range(20):
            torch.manual_seed(seed)
            stand_in = torch.zeros((), dtype=torch.uint8).expand(3, height, width)
            params = [transforms[0].make_params([stand_in])]
            if len(transforms) > 1:
                params.append({})
            window = window_of(transforms, params, height, width)
            scale = window.dct_scale()
            assert scale in (1, 2, 4, 8)
            if scale > 1:  # a reduced decode is never upsampled (full scale upsamples as torchvision does)
                assert window.height / scale >= window.out_height and window.width / scale >= window.out_width
            if scale < 8:
                assert window.height / (2 * scale) < window.out_height or window.width / (2 * scale) < window.out_width


def test_val_window_is_the_center_crop_mapped_back_to_the_source() -> None:
    pipeline = build_pipeline("imagenet-val")
    window = window_of(pipeline.transforms[:2], [{}, {}], 375, 500)  # resized to 256 x 341, crop at (16, 58)
    assert window == Window(16 * 375 / 256, 58 * 500 / 341, 240 * 375 / 256, 282 * 500 / 341, 224, 224, False)
    assert build_pipeline("imagenet-train").geometry == 1 and pipeline.geometry == 2
    assert build_pipeline([{"Resize": {"size": 64, "interpolation": "bicubic"}}]).geometry == 0
    assert build_pipeline([{"RandomResizedCrop": {"size": 64, "antialias": False}}]).geometry == 0
