"""The canvas check's fast path (``spec.known_canvas``) predicts exactly what the probe measures.

``spec.check_canvas`` refuses a step whose output would exceed the pixel limit. For the common steps
it reads the output size from the step's own size rule instead of running the step on a one-box
``BoundingBoxes`` (a few dozen small torch ops per step, measurable in the benchmark). Every step and
argument form the fast path covers is compared here with the probe on awkward canvases, so a
torchvision change in a size rule fails this test instead of silently weakening the limit.
"""

from __future__ import annotations

import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

from transformer import spec
from transformer.errors import StepRefused

CANVASES = [(375, 500), (500, 375), (1, 1000), (1000, 3), (224, 224), (10, 10), (1024, 683), (257, 1000)]

KNOWN = [
    v2.RandomResizedCrop(224),
    v2.RandomResizedCrop((100, 300), scale=(0.5, 1.0)),
    v2.CenterCrop(224),
    v2.CenterCrop((50, 700)),
    v2.Resize(256),
    v2.Resize([224, 224]),
    v2.Resize(256, max_size=300),
    v2.Resize(size=None, max_size=300),
    v2.RandomHorizontalFlip(p=1.0),
    v2.RandomVerticalFlip(p=1.0),
    v2.ColorJitter(0.4, 0.4, 0.4, 0.1),
    v2.RandomGrayscale(p=1.0),
    v2.Grayscale(3),
    v2.GaussianBlur(5),
    v2.RandomAutocontrast(p=1.0),
    v2.RandomEqualize(p=1.0),
    v2.RandomAdjustSharpness(2.0, p=1.0),
    v2.RandomInvert(p=1.0),
    v2.RandomPosterize(4, p=1.0),
    v2.RandomSolarize(128, p=1.0),
    v2.RandomAffine(20, translate=(0.1, 0.1), scale=(0.5, 2.0), shear=10),
    v2.RandomPerspective(0.5, p=1.0),
    v2.RandomRotation(30),
]

PROBED = [v2.Pad(10), v2.RandomRotation(30, expand=True), v2.RandomCrop(100, pad_if_needed=True)]


def probe(transform: v2.Transform, height: int, width: int) -> tuple[int, int]:
    image = tv_tensors.Image(torch.zeros(3, height, width, dtype=torch.uint8))
    torch.manual_seed(0)
    params = transform.make_params([image])
    boxes = tv_tensors.BoundingBoxes(torch.zeros(1, 4), format="XYXY", canvas_size=(height, width))
    return tuple(transform.transform(boxes, params).canvas_size)


@pytest.mark.parametrize("transform", KNOWN, ids=repr)
@pytest.mark.parametrize("canvas", CANVASES, ids=str)
def test_fast_path_matches_the_probe(transform: v2.Transform, canvas: tuple[int, int]) -> None:
    try:
        expected = probe(transform, *canvas)
    except Exception:
        # Degenerate canvas (a perspective of a 1-pixel strip): the step itself fails on the image too,
        # so skipping the probe loses nothing; the sample fails either way.
        image = tv_tensors.Image(torch.zeros(3, *canvas, dtype=torch.uint8))
        with pytest.raises(Exception):  # noqa: B017 - whatever the step raises on the probe
            transform(image)
        return
    assert spec.known_canvas(transform, *canvas) == expected


@pytest.mark.parametrize("transform", PROBED, ids=repr)
def test_steps_that_can_grow_the_canvas_are_still_probed(transform: v2.Transform) -> None:
    assert spec.known_canvas(transform, 375, 500) is None


def test_the_presets_take_the_fast_path_and_the_limit_still_holds() -> None:
    for preset in spec.PRESETS:
        for transform in spec.build_pipeline(preset).transforms:
            assert spec.known_canvas(transform, 375, 500) is not None, (preset, transform)
    # Resize(256) of a 1 x 100000 strip asks for 25.6M x 256 pixels: refused from the size rule alone.
    strip = tv_tensors.Image(torch.zeros(3, 1, 100_000, dtype=torch.uint8))
    with pytest.raises(StepRefused, match="ETL_MAX_IMAGE_PIXELS") as refused:
        spec.build_pipeline("imagenet-val").apply([strip], seed=0, max_pixels=4096 * 4096)
    assert isinstance(refused.value.cause, ValueError)
