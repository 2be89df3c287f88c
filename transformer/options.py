"""Per-request options: ``etl_args`` (a JSON object) over the service defaults.

Fields: ``preset`` or ``transforms`` (a spec), ``dtype``, ``layout``, ``seed``, ``epoch``,
``on_error``, ``skip``, ``crop_decode``, ``dct_scaling``. Unknown fields are refused rather than ignored,
so a typo never silently falls back to a default. Every error names the field.

``skip`` passes over the shard's first samples without decoding or writing them: a reader resuming in
the middle of a shard asks for the rest only. It applies to this pod's input; the ``etl_args``
forwarded to a next stage or a destination leave it out (``forwarded_etl_args``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from .config import Settings
from .errors import OptionsError
from .spec import Pipeline, build_pipeline, parse_spec_text
from .wire import DTYPES, ERROR_POLICIES, ETL_ARG_FIELDS, LAYOUTS


@dataclass(frozen=True)
class TransformOptions:
    """Everything the engine needs to know about one request."""

    pipeline: Pipeline
    dtype: str
    layout: str
    on_error: str
    seed: int  # always concrete: a random one when the caller gave none
    seeded: bool  # whether ``seed`` came from the caller (reproducible) or was drawn
    epoch: int
    skip: int  # input samples passed over before the first one transformed
    image_exts: frozenset[str]
    mask_exts: frozenset[str]
    max_member_bytes: int
    max_image_pixels: int
    error_manifest: bool
    crop_decode: bool = True  # decode only the JPEG region the leading crop/resize steps read (cropdecode.py)
    dct_scaling: bool = False  # and at a reduced DCT scale when it is large: faster, not torchvision's pixels


def parse_etl_args(raw: str | None, settings: Settings) -> TransformOptions:
    """Parse the ``etl_args`` string (may be empty) into options; raise ``OptionsError`` on bad input."""
    args: dict[str, Any] = {}
    if raw is not None and raw.strip():
        try:
            args = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise OptionsError("etl_args", f"not valid JSON: {exc.msg} at position {exc.pos}") from None
        if not isinstance(args, dict):
            raise OptionsError("etl_args", f"must be a JSON object, got {type(args).__name__}")
    return options_from_mapping(args, settings)


def options_from_mapping(args: dict[str, Any], settings: Settings) -> TransformOptions:
    unknown = sorted(set(args) - set(ETL_ARG_FIELDS))
    if unknown:
        raise OptionsError(unknown[0], f"unknown field; known fields are {', '.join(ETL_ARG_FIELDS)}")
    if "preset" in args and "transforms" in args:
        raise OptionsError("transforms", "give either 'preset' or 'transforms', not both")

    if "transforms" in args:
        spec = args["transforms"]
        if isinstance(spec, str):
            spec = parse_spec_text(spec, "transforms")
        pipeline = build_pipeline(spec, "transforms")
    elif "preset" in args:
        if not isinstance(args["preset"], str):
            raise OptionsError("preset", "must be a string")
        pipeline = build_pipeline(args["preset"], "preset")
    elif settings.transforms is not None:
        pipeline = build_pipeline(settings.transforms, "ETL_TRANSFORMS")
    else:
        pipeline = build_pipeline(settings.preset, "ETL_PRESET")

    seed_value = args.get("seed", settings.seed)
    if seed_value is not None and (not isinstance(seed_value, int) or isinstance(seed_value, bool)):
        raise OptionsError("seed", "must be an integer")
    epoch = args.get("epoch", 0)
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise OptionsError("epoch", "must be a non-negative integer")
    skip = args.get("skip", 0)
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise OptionsError("skip", "must be a non-negative integer (samples to pass over)")

    crop_decode = args.get("crop_decode", settings.crop_decode)
    if not isinstance(crop_decode, bool):
        raise OptionsError("crop_decode", "must be true or false")
    dct_scaling = args.get("dct_scaling", settings.dct_scaling)
    if not isinstance(dct_scaling, bool):
        raise OptionsError("dct_scaling", "must be true or false")

    return TransformOptions(
        pipeline=pipeline,
        dtype=_choice(args, "dtype", DTYPES, settings.dtype),
        layout=_choice(args, "layout", LAYOUTS, settings.layout),
        on_error=_choice(args, "on_error", ERROR_POLICIES, settings.on_error),
        seed=seed_value if seed_value is not None else int.from_bytes(os.urandom(8), "little"),
        seeded=seed_value is not None,
        epoch=epoch,
        skip=skip,
        image_exts=settings.image_exts,
        mask_exts=settings.mask_exts,
        max_member_bytes=settings.max_member_bytes,
        max_image_pixels=settings.max_image_pixels,
        error_manifest=settings.error_manifest,
        crop_decode=crop_decode,
        dct_scaling=dct_scaling,
    )


def settings_digest(options: TransformOptions) -> str:
    """A digest of everything in ``options`` that shapes the output bytes, for the end marker.

    The pipeline counts by its canonical steps (a preset and the same steps spelled out are one
    pipeline); a seed drawn at random counts as none (each such output is one random draw anyway).
    Equal digests with equal package versions mean the same input gives the same output.
    """
    effective = {
        "transforms": options.pipeline.describe(),
        "dtype": options.dtype,
        "layout": options.layout,
        "seed": options.seed if options.seeded else None,
        "epoch": options.epoch,
        "skip": options.skip,
        "on_error": options.on_error,
        "error_manifest": options.error_manifest,
        "crop_decode": options.crop_decode,
        "dct_scaling": options.dct_scaling,
        "image_exts": sorted(options.image_exts),
        "mask_exts": sorted(options.mask_exts),
    }
    text = json.dumps(effective, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]  # 128 bits: the marker stays within one tar block


def forwarded_etl_args(raw: str) -> str:
    """The ``etl_args`` a next hop gets: the same, without ``skip`` (it applied to this pod's input).

    Parsed already (``parse_etl_args`` accepted it), so ``raw`` is empty or a JSON object.
    """
    if not raw or not raw.strip():
        return raw
    args = json.loads(raw)
    if "skip" not in args:
        return raw
    del args["skip"]
    return json.dumps(args, separators=(",", ":")) if args else ""


def _choice(args: dict[str, Any], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = args.get(name, default)
    if value not in allowed:
        raise OptionsError(name, f"{value!r} is not one of {', '.join(allowed)}")
    return value
