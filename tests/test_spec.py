"""Transform specs: presets, the allow-list, step forms, and seeded draws equal to torchvision's own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import InterpolationMode, v2

from testbed.shardgen import photo
from transformer.errors import OptionsError
from transformer.spec import (
    ALLOWED,
    IMAGENET_MEAN,
    IMAGENET_STD,
    PRESETS,
    build_pipeline,
    parse_spec_text,
    sample_seed,
)

# The per-step seed derivation is part of the reproducibility promise (a changed formula changes every
# user's seeded crops), so the test writes it out instead of importing it.
GOLDEN = 0x9E3779B97F4A7C15


def step_seed(seed: int, index: int) -> int:
    return (seed + index * GOLDEN) & (2**63 - 1)


def small_inputs(index: int = 0, size: tuple[int, int] = (96, 72)) -> tuple[tv_tensors.Image, tv_tensors.Mask]:
    """A real photo as an image tensor and a mask derived from it (so both carry structure)."""
    from PIL import Image

    array = np.asarray(Image.fromarray(photo(index)).convert("RGB").resize(size))
    image = tv_tensors.Image(torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous())
    mask = tv_tensors.Mask((image[0] > 127).to(torch.uint8) + 1)
    return image, mask


def direct(transforms: list[v2.Transform], inputs: list, seed: int) -> list:
    """What calling each torchvision transform directly gives, seeded the way ``Pipeline.apply`` seeds."""
    outputs = tuple(inputs)
    for index, transform in enumerate(transforms):
        torch.manual_seed(step_seed(seed, index))
        outputs = transform(*outputs)
    return list(outputs)


# --- presets and the allow-list -------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, kinds",
    [
        ("imagenet-train", [v2.RandomResizedCrop, v2.RandomHorizontalFlip]),
        ("imagenet-val", [v2.Resize, v2.CenterCrop]),
        ("resize-224", [v2.Resize]),
    ],
)
def test_presets_build_with_imagenet_normalize_split_off(preset: str, kinds: list[type]) -> None:
    pipeline = build_pipeline(preset)
    assert pipeline.name == preset
    assert [type(t) for t in pipeline.transforms] == kinds
    assert pipeline.normalize == (IMAGENET_MEAN, IMAGENET_STD)
    assert pipeline.describe() == PRESETS[preset]


def test_preset_parameters_are_the_imagenet_recipe() -> None:
    crop, flip = build_pipeline("imagenet-train").transforms
    assert tuple(crop.size) == (224, 224) and crop.scale == (0.08, 1.0) and crop.antialias is True
    assert flip.p == 0.5
    resize, center = build_pipeline("imagenet-val").transforms
    assert resize.size == [256] and resize.antialias is True
    assert InterpolationMode(resize.interpolation) == InterpolationMode.BILINEAR
    assert tuple(center.size) == (224, 224)


def test_unknown_preset_names_the_field() -> None:
    with pytest.raises(OptionsError) as info:
        build_pipeline("imagenet-tran", "preset")
    assert info.value.field == "preset"
    assert "imagenet-train" in info.value.reason


@pytest.mark.parametrize(
    "name",
    ["__import__", "os.system", "Lambda", "ToDtype", "Compose", "ToImage", "eval", "resize",
     "torchvision.transforms.v2.Resize", "RandomChoice", "__class__"],
)
def test_allow_list_refuses(name: str) -> None:
    with pytest.raises(OptionsError) as info:
        build_pipeline([{"Resize": {"size": 8}}, {name: {}}])
    assert info.value.field == "transforms[1]"
    assert f"'{name}' is not allowed" in info.value.reason


def test_allow_list_refuses_in_every_step_form() -> None:
    for spec in (["Lambda"], [{"name": "Lambda", "lambd": "print"}], [{"name": 3}]):
        with pytest.raises(OptionsError, match="not allowed"):
            build_pipeline(spec)


def test_allow_list_holds_only_v2_transforms() -> None:
    assert "Lambda" not in ALLOWED and "ToDtype" not in ALLOWED
    assert all(issubclass(cls, v2.Transform) and cls.__module__.startswith("torchvision.") for cls in ALLOWED.values())


def test_step_forms_are_equivalent_and_cached() -> None:
    forms = [
        ["RandomHorizontalFlip"],
        [{"RandomHorizontalFlip": {}}],
        [{"RandomHorizontalFlip": None}],
        [{"name": "RandomHorizontalFlip"}],
    ]
    pipelines = [build_pipeline(spec) for spec in forms]
    assert all(p is pipelines[0] for p in pipelines)  # one canonical form -> one cached pipeline
    assert pipelines[0].normalize is None
    with_args = build_pipeline([{"name": "Resize", "size": 32, "antialias": True}])
    assert with_args is build_pipeline([{"Resize": {"antialias": True, "size": 32}}])  # key order is irrelevant
    assert with_args is not build_pipeline([{"Resize": {"size": 33, "antialias": True}}])
    assert with_args.describe() == [{"Resize": {"antialias": True, "size": 32}}]


@pytest.mark.parametrize(
    "spec, field",
    [
        ([], "transforms"),
        ({"Resize": {"size": 8}}, "transforms"),
        (5, "transforms"),
        ([5], "transforms[0]"),
        ([["Resize"]], "transforms[0]"),
        ([{"Resize": {"size": 8}, "CenterCrop": {"size": 4}}], "transforms[0]"),
        ([{"Resize": 256}], "transforms[0]"),
        ([{"Resize": [256]}], "transforms[0]"),
    ],
)
def test_malformed_specs_name_the_step(spec: object, field: str) -> None:
    with pytest.raises(OptionsError) as info:
        build_pipeline(spec)
    assert info.value.field == field


def test_normalize_must_be_last() -> None:
    normalize = {"Normalize": {"mean": [0.5], "std": [0.5]}}
    with pytest.raises(OptionsError) as info:
        build_pipeline([{"Resize": {"size": 8}}, normalize, {"CenterCrop": {"size": 4}}])
    assert info.value.field == "transforms[1]" and "last" in info.value.reason
    pipeline = build_pipeline([{"Resize": {"size": 8}}, normalize])
    assert pipeline.normalize == ((0.5,), (0.5,))
    assert [type(t) for t in pipeline.transforms] == [v2.Resize]  # applied at encode time, not here


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"mean": [0.5, 0.5], "std": [0.5, 0.5]}, "1 or 3 values"),
        ({"mean": [0.5, 0.5, 0.5], "std": [0.5]}, "1 or 3 values"),
        ({"mean": [0.5], "std": [0.0]}, "positive"),
        ({"mean": ["a"], "std": [1.0]}, "list of numbers"),
    ],
)
def test_bad_normalize_constants(kwargs: dict, words: str) -> None:
    with pytest.raises(OptionsError) as info:
        build_pipeline([{"Normalize": kwargs}])
    assert "Normalize" in info.value.field and words in info.value.reason


@pytest.mark.parametrize(
    "step, name",
    [
        ({"Resize": {"sizee": 256}}, "Resize"),
        ({"RandomHorizontalFlip": {"p": 2}}, "RandomHorizontalFlip"),
        ({"ColorJitter": {"hue": 0.9}}, "ColorJitter"),
        ({"RandomResizedCrop": {}}, "RandomResizedCrop"),
        ({"GaussianBlur": {"kernel_size": 4}}, "GaussianBlur"),
    ],
)
def test_bad_kwargs_name_the_step(step: dict, name: str) -> None:
    with pytest.raises(OptionsError) as info:
        build_pipeline([{"CenterCrop": {"size": 8}}, step])
    assert info.value.field == f"transforms[1] ({name})"
    assert info.value.reason  # torchvision's own explanation, passed on


@pytest.mark.parametrize(
    "text, mode",
    [("nearest", InterpolationMode.NEAREST), ("bicubic", InterpolationMode.BICUBIC),
     ("bilinear", InterpolationMode.BILINEAR), ("nearest-exact", InterpolationMode.NEAREST_EXACT)],
)
def test_interpolation_strings(text: str, mode: InterpolationMode) -> None:
    (resize,) = build_pipeline([{"Resize": {"size": 32, "interpolation": text}}]).transforms
    assert InterpolationMode(resize.interpolation) == mode


@pytest.mark.parametrize("mode", ["cubic", [], {"a": 1}, 2])
def test_unknown_interpolation_lists_the_choices(mode) -> None:
    with pytest.raises(OptionsError) as info:
        build_pipeline([{"RandomRotation": {"degrees": 10, "interpolation": mode}}])
    assert info.value.field == "transforms[0] (RandomRotation)"
    assert "bicubic" in info.value.reason


def test_spec_text_yaml_json_and_preset() -> None:
    expected = [{"Resize": {"size": 256}}, {"CenterCrop": {"size": 224}}, "RandomHorizontalFlip"]
    yaml_text = "- Resize: {size: 256}\n- CenterCrop:\n    size: 224\n- RandomHorizontalFlip\n"
    json_text = '[{"Resize": {"size": 256}}, {"CenterCrop": {"size": 224}}, "RandomHorizontalFlip"]'
    assert parse_spec_text(yaml_text, "f") == expected
    assert parse_spec_text(json_text, "f") == expected
    assert build_pipeline(parse_spec_text(yaml_text, "f")) is build_pipeline(parse_spec_text(json_text, "f"))
    assert parse_spec_text("  imagenet-val \n", "f") == "imagenet-val"


@pytest.mark.parametrize("text", ["[{", "- a: b\n c", "!!python/object/apply:os.system ['echo pwned']"])
def test_spec_text_refuses_bad_or_unsafe_yaml(text: str) -> None:
    with pytest.raises(OptionsError) as info:
        parse_spec_text(text, "ETL_TRANSFORMS")
    assert info.value.field == "ETL_TRANSFORMS"


# --- seeded draws: identical to torchvision's own forward() ---------------------------------------

EQUIVALENCE_SPECS = {
    "RandomResizedCrop": [{"RandomResizedCrop": {"size": 48, "antialias": True}}],
    "RandomHorizontalFlip": [{"RandomHorizontalFlip": {"p": 0.5}}],
    "ColorJitter": [{"ColorJitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1}}],
    "RandomRotation": [{"RandomRotation": {"degrees": 30}}],
    "RandomAffine": [{"RandomAffine": {"degrees": 20, "translate": [0.1, 0.1], "scale": [0.8, 1.2], "shear": 10}}],
    "chain": [
        {"RandomResizedCrop": {"size": 48, "antialias": True}},
        {"RandomHorizontalFlip": {}},
        {"ColorJitter": {"brightness": 0.3, "hue": 0.05}},
        {"RandomRotation": {"degrees": 15}},
    ],
}
SEEDS = [0, 1, 2, 3, 12345, 2**40 + 7, 2**63 - 1, 987654321987]


@pytest.mark.parametrize("name", list(EQUIVALENCE_SPECS))
def test_apply_equals_torchvision_forward_with_the_same_seed(name: str) -> None:
    pipeline = build_pipeline(EQUIVALENCE_SPECS[name])
    image, mask = small_inputs()
    outputs = []
    for seed in SEEDS:
        got = pipeline.apply([image, mask], seed)
        want = direct(list(pipeline.transforms), [image, mask], seed)
        assert type(got[0]) is tv_tensors.Image and type(got[1]) is tv_tensors.Mask
        assert torch.equal(got[0], want[0]), f"{name}: image differs for seed {seed}"
        assert torch.equal(got[1], want[1]), f"{name}: mask differs for seed {seed}"
        outputs.append(got[0])
    # The draws really are random: a seed-independent pipeline would pass the comparison trivially.
    distinct = {o.numpy().tobytes() for o in outputs}
    assert len(distinct) >= (2 if name == "RandomHorizontalFlip" else len(SEEDS) - 1)
    if name == "RandomHorizontalFlip":
        assert any(torch.equal(o, image) for o in outputs) and any(not torch.equal(o, image) for o in outputs)


def test_apply_is_independent_of_global_rng_state() -> None:
    pipeline = build_pipeline(EQUIVALENCE_SPECS["chain"])
    image, mask = small_inputs(1)
    first = pipeline.apply([image, mask], 42)
    torch.manual_seed(999)
    torch.rand(100)
    second = pipeline.apply([image, mask], 42)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_concurrent_applies_equal_sequential_ones() -> None:
    pipeline = build_pipeline(EQUIVALENCE_SPECS["chain"])
    inputs = [small_inputs(i % 4) for i in range(4)]
    jobs = [(seed, i % 4) for i, seed in enumerate(range(100, 148))]
    sequential = {seed: pipeline.apply(list(inputs[which]), seed) for seed, which in jobs}

    results: dict[int, list] = {}
    lock = threading.Lock()
    start = threading.Barrier(3)

    def worker(part: list[tuple[int, int]]) -> None:
        start.wait(timeout=30)
        for seed, which in part:
            out = pipeline.apply(list(inputs[which]), seed)
            with lock:
                results[seed] = out

    threads = [threading.Thread(target=worker, args=(jobs[k::3],)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert sorted(results) == sorted(sequential)
    for seed, want in sequential.items():
        got = results[seed]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed {seed}"


def test_val_preset_shapes_image_and_mask_alike() -> None:
    pipeline = build_pipeline("imagenet-val")
    image, mask = small_inputs(2, (300, 260))
    out_image, out_mask = pipeline.apply([image, mask], 0)
    assert out_image.shape == (3, 224, 224) and out_mask.shape == (224, 224)


# --- per-sample seeds -----------------------------------------------------------------------------


def test_sample_seed_is_stable_and_sensitive_to_every_part() -> None:
    base = sample_seed(7, 0, "bucket/shard-000.tar", "sample-000001")
    assert base == sample_seed(7, 0, "bucket/shard-000.tar", "sample-000001")
    assert 0 <= base < 2**63
    variants = [
        sample_seed(8, 0, "bucket/shard-000.tar", "sample-000001"),
        sample_seed(7, 1, "bucket/shard-000.tar", "sample-000001"),
        sample_seed(7, 0, "bucket/shard-001.tar", "sample-000001"),
        sample_seed(7, 0, "bucket/shard-000.tar", "sample-000002"),
        sample_seed(None, 0, "bucket/shard-000.tar", "sample-000001"),
    ]
    assert len({base, *variants}) == 6
    # Fields are separated: moving characters between object name and key changes the seed.
    assert sample_seed(1, 0, "ab", "c") != sample_seed(1, 0, "a", "bc")


DIRECT_STEPS = [
    v2.RandomResizedCrop(48, antialias=True),
    v2.RandomResizedCrop((40, 56), antialias=False),
    v2.RandomHorizontalFlip(p=1.0),
    v2.Resize(37, antialias=True),
    v2.Resize([30, 70], antialias=False),
    v2.Resize(64),
    v2.CenterCrop(32),
    v2.CenterCrop([64, 20]),
]


def uint8_layouts(seed: int) -> dict[str, torch.Tensor]:
    """One random uint8 image in the memory layouts decoders and earlier steps hand over."""
    generator = torch.Generator().manual_seed(seed)
    height, width = (int(v) for v in torch.randint(40, 130, (2,), generator=generator))
    hwc = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    return {
        "contiguous": hwc.permute(2, 0, 1).contiguous(),
        "channels_last": hwc.permute(2, 0, 1),  # what decode_image returns
        "strided": hwc.permute(2, 0, 1).contiguous()[:, ::2, 1:],
    }


def test_direct_steps_equal_torchvisions_transform_pixel_for_pixel() -> None:
    from transformer.spec import _direct_step

    taken = 0
    for seed in range(16):
        for layout, image in uint8_layouts(seed).items():
            for step in DIRECT_STEPS:
                torch.manual_seed(seed)
                params = step.make_params([image])
                got = _direct_step(step, params, image)
                if got is None:
                    continue
                want = step.transform(image, params)
                assert got.shape == want.shape and torch.equal(got, want), (layout, step, params)
                taken += 1
    assert taken > 300


_WITHOUT_AVX2 = """
import torch
from tests.test_spec import DIRECT_STEPS, uint8_layouts
from transformer.spec import _direct_step

assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
taken = set()
for seed in range(6):
    for image in uint8_layouts(seed).values():
        for step in DIRECT_STEPS:
            torch.manual_seed(seed)
            params = step.make_params([image])
            got = _direct_step(step, params, image)
            if got is not None:
                assert torch.equal(got, step.transform(image, params)), (step, params)
                taken.add(type(step).__name__)
assert taken == {"RandomHorizontalFlip", "CenterCrop"}, taken  # resizes: torchvision goes through float32
"""


def test_direct_steps_follow_torchvision_on_cpus_without_avx2() -> None:
    # torchvision resizes uint8 natively only with AVX2/AVX512 (or on ARM); elsewhere it converts to
    # float32 and rounds, so the direct resize would differ by 1 here and there: it must step aside.
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_AVX2], env=env, cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_direct_steps_leave_everything_else_to_torchvision() -> None:
    from transformer.spec import _direct_step

    image = uint8_layouts(0)["contiguous"]
    params = {"top": 0, "left": 0, "height": 30, "width": 30}
    crop = v2.RandomResizedCrop(24, antialias=True)
    assert _direct_step(crop, params, image) is not None
    assert _direct_step(crop, params, image.float()) is None  # float images
    assert _direct_step(crop, params, tv_tensors.Image(image)) is None  # tv_tensors (masks ride along)
    assert _direct_step(crop, params, image[None]) is None  # batched
    assert _direct_step(v2.RandomResizedCrop(24, interpolation=InterpolationMode.BICUBIC), params, image) is None
    assert _direct_step(crop, {**params, "left": image.shape[-1] - 10}, image) is None  # past the edge
    assert _direct_step(v2.Resize(30, max_size=40), {}, image) is None
    assert _direct_step(v2.CenterCrop(image.shape[-1] + 1), {}, image) is None  # torchvision pads
    assert _direct_step(v2.ColorJitter(brightness=0.5), {}, image) is None
