"""Transform specs and presets -> a torchvision ``transforms.v2`` pipeline.

A spec is either a preset name or a list of steps. A step is a transform name from ``ALLOWED``
with its keyword arguments, written ``{"Resize": {"size": 256}}``, ``{"name": "Resize", "size": 256}``
or just ``"RandomHorizontalFlip"``. Nothing is imported or evaluated by name: the allow-list is the
only way in. ``Normalize``, if present, must be the last step; it is applied at encode time so that
``dtype=uint8`` can skip it (normalize on the GPU instead).

Randomness is decided apart from the work (as torchvision's own ``make_params``/``transform`` split):
the parameters of each step are drawn under a short lock from a generator seeded per sample and step,
and the pixel work runs outside the lock. Samples transformed concurrently on a thread pool therefore
get exactly the draws they would get alone, which is what makes ``seed``/``epoch`` reproducible.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from torchvision import tv_tensors
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2._transform import _RandomApplyTransform
from torchvision.transforms.v2.functional._geometry import (
    _compute_resized_output_size,
    _do_native_uint8_resize_on_cpu,
)

from .errors import OptionsError, StepRefused

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Per-sample image transforms that make sense before .npy encoding. Tensor-dtype conversions are
# not here on purpose: the output dtype is an option of its own (``dtype``).
ALLOWED: dict[str, type[v2.Transform]] = {
    cls.__name__: cls
    for cls in (
        v2.Resize,
        v2.CenterCrop,
        v2.RandomCrop,
        v2.RandomResizedCrop,
        v2.RandomHorizontalFlip,
        v2.RandomVerticalFlip,
        v2.Pad,
        v2.RandomRotation,
        v2.RandomAffine,
        v2.RandomPerspective,
        v2.ColorJitter,
        v2.RandomGrayscale,
        v2.Grayscale,
        v2.GaussianBlur,
        v2.RandomAutocontrast,
        v2.RandomEqualize,
        v2.RandomAdjustSharpness,
        v2.RandomInvert,
        v2.RandomPosterize,
        v2.RandomSolarize,
        v2.Normalize,
    )
}

PRESETS: dict[str, list[Any]] = {
    "imagenet-train": [
        {"RandomResizedCrop": {"size": 224, "antialias": True}},
        {"RandomHorizontalFlip": {"p": 0.5}},
        {"Normalize": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}},
    ],
    "imagenet-val": [
        {"Resize": {"size": 256, "antialias": True}},
        {"CenterCrop": {"size": 224}},
        {"Normalize": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}},
    ],
    "resize-224": [
        {"Resize": {"size": [224, 224], "antialias": True}},
        {"Normalize": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}},
    ],
}
DEFAULT_PRESET = "imagenet-train"

_INTERPOLATIONS = {mode.value: mode for mode in InterpolationMode}

# torch's default CPU generator is process-global; holding this lock while seeding it and drawing
# one step's parameters is what keeps concurrent samples independent (microseconds per step).
_RNG_LOCK = threading.Lock()
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Pipeline:
    """A validated, built transform pipeline; safe to share between threads."""

    name: str
    steps: tuple[tuple[str, str], ...]  # (transform name, canonical JSON kwargs)
    transforms: tuple[v2.Transform, ...]
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None

    def describe(self) -> list[dict[str, Any]]:
        """The canonical spec, as JSON-able data (used in logs and the error manifest)."""
        return [{name: json.loads(kwargs)} for name, kwargs in self.steps]

    # How many leading steps form a crop/resize geometry that a decoder can serve from part of a JPEG
    # (``RandomResizedCrop``, ``Resize`` + ``CenterCrop``, ``CenterCrop``, ``Resize``); 0: none.
    geometry: int = 0

    def decide(self, index: int, flat: list[Any], seed: int) -> tuple[list[bool], dict[str, Any]] | None:
        """Step ``index``'s random draw for ``flat``, from the generator seeded for this sample and step.

        Each step reseeds, so a step's draw depends only on (seed, index) and its inputs' sizes: drawing
        a step early (before decoding, for a crop window) gives the draw ``apply`` would make.
        """
        with _RNG_LOCK:
            torch.default_generator.manual_seed((seed + index * _GOLDEN) & (2**63 - 1))
            try:
                return _decide(self.transforms[index], flat)
            except MemoryError:
                raise
            except Exception as exc:  # the step's check of its inputs refused them (a mask of another size)
                raise StepRefused(exc) from exc

    def apply(self, inputs: list[Any], seed: int, max_pixels: int | None = None, *, start: int = 0,
              stop: int | None = None, decisions: list | None = None) -> list[Any]:
        """Run steps ``start`` to ``stop`` jointly over a sample's tv_tensors (images and masks share each draw).

        With ``max_pixels``, a step that would produce a larger canvas is refused before it allocates
        anything (``ValueError``): an ordinary ``Resize(256)`` of a 1 x 100000 image, or a huge ``Pad``
        or ``CenterCrop``, would otherwise ask for gigabytes and get the pod OOM-killed. ``decisions``
        (one per step from ``start``, as ``decide`` returns them) replaces the draws.

        A step that refuses the sample raises ``StepRefused`` (the sample's own failure); anything raised
        between the steps is the pod's.
        """
        flat = list(inputs)
        stop = len(self.transforms) if stop is None else stop
        for index in range(start, stop):
            transform = self.transforms[index]
            decision = self.decide(index, flat, seed) if decisions is None else decisions[index - start]
            if decision is not None:
                needs, params = decision
                if max_pixels is not None and flat:
                    check_canvas(transform, params, flat[0], max_pixels)
                try:
                    direct = _direct_step(transform, params, flat[0]) if len(flat) == 1 and needs[0] else None
                    if direct is not None:
                        flat = [direct]
                    else:
                        flat = [transform.transform(x, params) if need else x for x, need in zip(flat, needs)]
                except MemoryError:
                    raise
                except Exception as exc:  # e.g. a crop larger than the image, a kernel refusing a shape
                    raise StepRefused(exc) from exc
        return flat


@functools.lru_cache(maxsize=1)
def native_uint8_bilinear() -> bool:
    """Whether torchvision resizes uint8 images bilinearly as uint8 on this CPU (its own test, cached)."""
    return _do_native_uint8_resize_on_cpu(InterpolationMode.BILINEAR)


def _direct_step(transform: v2.Transform, params: dict[str, Any], image: Any) -> torch.Tensor | None:
    """The presets' geometric steps on a lone uint8 image, as the same torch calls v2 ends in.

    Through ``Transform.transform``, a step goes through v2's kernel dispatch and torchvision's resize
    and crop functions: Python per step that holds the GIL the other transform threads and the shard
    driver wait for, a large share of the service's GIL time under ``py-spy --gil``. Here the crop is
    the same slice and the resize the same ``interpolate`` call with the same arguments as
    ``resize_image`` makes for uint8 CPU images (docs/design-decoding.md gives the figures). Anything else
    (other steps, masks, several images, float or CUDA tensors, another interpolation, a crop reaching
    past the edge) returns None and takes v2's own path;
    ``tests/test_spec.py`` checks the outputs are identical, pixel for pixel, to ``transform.transform``.
    """
    if type(image) is not torch.Tensor or image.dtype != torch.uint8 or image.ndim != 3 or image.device.type != "cpu":
        return None
    kind = type(transform)
    if kind is v2.RandomHorizontalFlip:
        return image.flip(-1)  # horizontal_flip_image
    height, width = image.shape[-2:]
    if kind is v2.RandomResizedCrop:
        top, left, crop_height, crop_width = params["top"], params["left"], params["height"], params["width"]
        if top < 0 or left < 0 or top + crop_height > height or left + crop_width > width:
            return None
        image = image[:, top:top + crop_height, left:left + crop_width]  # crop_image
        size, antialias = transform.size, transform.antialias
    elif kind is v2.Resize:
        if transform.size is None or transform.max_size is not None:
            return None
        size, antialias = _compute_resized_output_size((height, width), size=transform.size), transform.antialias
    elif kind is v2.CenterCrop:
        crop_height, crop_width = transform.size
        if crop_height > height or crop_width > width:
            return None  # torchvision pads first
        top, left = int(round((height - crop_height) / 2.0)), int(round((width - crop_width) / 2.0))
        return image[:, top:top + crop_height, left:left + crop_width]  # center_crop_image's anchor
    else:
        return None
    if transform.interpolation not in (InterpolationMode.BILINEAR, "bilinear") or min(image.shape) == 0:
        return None  # (v2 keeps the mode as given: the enum, its string, or a PIL integer)
    if not native_uint8_bilinear():
        return None  # without AVX2 (or on ppc64le, s390x), torchvision resizes in float32 and rounds
    return resize_uint8(image, size, antialias)


def resize_uint8(image: torch.Tensor, size: Sequence[int], antialias: bool | None) -> torch.Tensor:
    """torchvision's bilinear ``resize_image`` of a uint8 CPU image on a CPU with its native uint8 kernel."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image  # resize_image returns an image already at the size unchanged
    return torch.nn.functional.interpolate(image[None], size=list(size), mode="bilinear", align_corners=False,
                                           antialias=bool(antialias))[0]


# Steps whose output canvas is known without running anything (hot path: the probe below runs dozens of
# small torch ops per step under GIL contention; docs/design.md gives the A/B against probing all).
# Pixel-value and same-canvas geometric steps keep the input's size; these crops and resizes output
# their own ``size`` (or torchvision's resize rule). Everything else is probed.
# tests/test_canvas_fast_path.py checks every entry against the probe.
_SAME_CANVAS = (
    v2.RandomHorizontalFlip, v2.RandomVerticalFlip, v2.ColorJitter, v2.RandomGrayscale, v2.Grayscale,
    v2.GaussianBlur, v2.RandomAutocontrast, v2.RandomEqualize, v2.RandomAdjustSharpness, v2.RandomInvert,
    v2.RandomPosterize, v2.RandomSolarize, v2.RandomAffine, v2.RandomPerspective,
)


def known_canvas(transform: v2.Transform, height: int, width: int) -> tuple[int, int] | None:
    if isinstance(transform, _SAME_CANVAS) or (isinstance(transform, v2.RandomRotation) and not transform.expand):
        return height, width
    if isinstance(transform, (v2.RandomResizedCrop, v2.CenterCrop)):
        return transform.size[0], transform.size[1]
    if isinstance(transform, v2.Resize):
        out = _compute_resized_output_size((height, width), size=transform.size, max_size=transform.max_size)
        return out[0], out[1]
    return None


def check_canvas(transform: v2.Transform, params: dict[str, Any], first: Any, max_pixels: int) -> None:
    """Predict the step's output size, from its size rule or on a one-box ``BoundingBoxes`` (no pixels);
    ``StepRefused`` when it is over ``max_pixels`` or the step refuses the probe."""
    height, width = first.shape[-2:]
    known = known_canvas(transform, height, width)
    if known is not None:
        out_height, out_width = known
    else:
        probe = tv_tensors.BoundingBoxes(torch.zeros(1, 4), format="XYXY", canvas_size=(height, width))
        try:
            out_height, out_width = transform.transform(probe, params).canvas_size
        except Exception as exc:
            raise StepRefused(exc) from exc
    if out_height * out_width > max_pixels:
        raise StepRefused(ValueError(
            f"{type(transform).__name__} would turn {height}x{width} into {out_height}x{out_width} = "
            f"{out_height * out_width} pixels, over the limit of {max_pixels} (ETL_MAX_IMAGE_PIXELS)"
        ))


def _decide(transform: v2.Transform, flat: list[Any]) -> tuple[list[bool], dict[str, Any]] | None:
    """The random half of ``Transform.forward``: whether to apply, and with which parameters.

    Mirrors torchvision's ``Transform.forward`` / ``_RandomApplyTransform.forward`` step for step;
    ``tests/test_spec.py`` checks it against calling the transform directly with the same seed.
    """
    transform.check_inputs(flat)
    if isinstance(transform, _RandomApplyTransform) and torch.rand(1) >= transform.p:
        return None
    needs = transform._needs_transform_list(flat)
    return needs, transform.make_params([x for x, need in zip(flat, needs) if need])


def sample_seed(seed: int | None, epoch: int, object_name: str, key: str) -> int:
    """The per-sample seed: a stable hash of (seed, epoch, object name, sample key)."""
    # surrogateescape: tar member names that are not UTF-8 arrive as lone surrogates; hash their raw bytes.
    text = f"{seed}\x00{epoch}\x00{object_name}\x00{key}".encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)


def parse_spec_text(text: str, field: str) -> Any:
    """A spec given as text (environment variable or etl_args string): JSON, YAML or a preset name."""
    stripped = text.strip()
    if stripped in PRESETS:
        return stripped
    try:
        return yaml.safe_load(stripped)  # YAML is a superset of JSON
    except yaml.YAMLError as exc:
        raise OptionsError(field, f"not valid JSON or YAML ({exc.__class__.__name__})") from None


def build_pipeline(spec: Any, field: str = "transforms") -> Pipeline:
    """Validate a spec (preset name or list of steps) and build its pipeline (cached)."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise OptionsError(field, f"unknown preset '{spec}'; choose one of {sorted(PRESETS)}")
        name, steps = spec, _canonical(PRESETS[spec], field)
    else:
        name, steps = "custom", _canonical(spec, field)
    try:
        return _build(name, steps)
    except OptionsError as exc:  # _build is cached per spec, not per field, so the field is named here
        raise OptionsError(field + exc.field, exc.reason) from None


def _canonical(spec: Any, field: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(spec, list) or not spec:
        raise OptionsError(field, "must be a preset name or a non-empty list of transform steps")
    steps = []
    for position, step in enumerate(spec):
        where = f"{field}[{position}]"
        if isinstance(step, str):
            name, kwargs = step, {}
        elif isinstance(step, dict) and "name" in step:
            name, kwargs = step["name"], {k: v for k, v in step.items() if k != "name"}
        elif isinstance(step, dict) and len(step) == 1:
            ((name, kwargs),) = step.items()
            kwargs = {} if kwargs is None else kwargs
        else:
            raise OptionsError(where, 'a step is "Name", {"Name": {kwargs}} or {"name": "Name", ...}')
        if not isinstance(name, str) or name not in ALLOWED:
            raise OptionsError(where, f"transform '{name}' is not allowed; allowed: {sorted(ALLOWED)}")
        if not isinstance(kwargs, dict):
            raise OptionsError(where, f"arguments of {name} must be a mapping, got {type(kwargs).__name__}")
        try:
            steps.append((name, json.dumps(kwargs, sort_keys=True)))
        except (TypeError, ValueError) as exc:  # YAML gives non-string keys, dates, sets, bytes
            raise OptionsError(where, f"arguments of {name} must be JSON values with string names ({exc})") from None
    for position, (name, _) in enumerate(steps[:-1]):
        if name == "Normalize":
            raise OptionsError(f"{field}[{position}]", "Normalize must be the last step")
    return tuple(steps)


@functools.lru_cache(maxsize=64)
def _build(name: str, steps: tuple[tuple[str, str], ...]) -> Pipeline:
    transforms: list[v2.Transform] = []
    normalize = None
    for position, (step_name, kwargs_json) in enumerate(steps):
        kwargs = json.loads(kwargs_json)
        where = f"[{position}] ({step_name})"  # prefixed with the field by build_pipeline
        if "interpolation" in kwargs:
            mode = kwargs["interpolation"]
            if not isinstance(mode, str) or mode not in _INTERPOLATIONS:
                raise OptionsError(where, f"interpolation must be one of {sorted(_INTERPOLATIONS)}")
            kwargs["interpolation"] = _INTERPOLATIONS[mode]
        try:
            transform = ALLOWED[step_name](**kwargs)
        except (TypeError, ValueError) as exc:
            raise OptionsError(where, str(exc)) from None
        if isinstance(transform, v2.Normalize):
            normalize = _normalize_constants(transform, where)
        else:
            transforms.append(transform)
    return Pipeline(name=name, steps=steps, transforms=tuple(transforms), normalize=normalize,
                    geometry=_leading_geometry(transforms))


def _bilinear_antialiased(transform: v2.Transform) -> bool:
    return transform.interpolation in (InterpolationMode.BILINEAR, "bilinear") and bool(transform.antialias)


def _leading_geometry(transforms: Sequence[v2.Transform]) -> int:
    """How many leading steps a partial decode can serve: a crop and/or a bilinear, antialiased resize.

    The resize must be the one a reduced JPEG decode approximates (bilinear with antialiasing, as the
    presets); ``Resize`` with ``max_size`` is torchvision's own size rule and stays supported.
    """
    kinds = [type(t) for t in transforms[:2]]
    if kinds[:1] == [v2.RandomResizedCrop]:
        return 1 if _bilinear_antialiased(transforms[0]) else 0
    if kinds[:1] == [v2.Resize]:
        if transforms[0].size is None or not _bilinear_antialiased(transforms[0]):
            return 0
        return 2 if kinds[1:] == [v2.CenterCrop] else 1
    if kinds[:1] == [v2.CenterCrop]:
        return 1
    return 0


def _normalize_constants(transform: v2.Normalize, where: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    mean, std = _floats(transform.mean, where, "mean"), _floats(transform.std, where, "std")
    if len(mean) != len(std) or len(mean) not in (1, 3):
        raise OptionsError(where, "mean and std need 1 or 3 values each")
    if any(s <= 0 for s in std):
        raise OptionsError(where, "std values must be positive")
    return mean, std


def _floats(values: Sequence[Any], where: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise OptionsError(where, f"{what} must be a list of numbers") from None
