"""Decode only what the output needs: a JPEG's crop window, or (by choice) the image at a reduced DCT scale.

A pipeline's leading crop and resize steps (``Pipeline.geometry``: ``RandomResizedCrop``, ``Resize`` +
``CenterCrop``, ``CenterCrop``, ``Resize``) fix, once their parameters are drawn, which region of the
image the output is made from and at what size. ``window_of`` turns the drawn parameters into that
region in source pixels; ``decode_window`` then decodes no more of the JPEG than it needs:

* **window**: for a crop whose corners are whole pixels (``RandomResizedCrop``, ``CenterCrop``),
  libjpeg-turbo decodes only that window at full scale (rows above it are entropy decoded and skipped,
  rows below it are not read, columns outside it skip IDCT and colour conversion): its pixels are the
  full decode's, bit for bit, and the same resize follows, so the output is torchvision's;
* **scaled**, only when asked for (``dct_scaling``): when the region is at least twice the output in
  both directions, libjpeg-turbo decodes the whole image at 1/2, 1/4 or 1/8 in the DCT domain (the
  smallest scale that still leaves the region at least at the output's size: never an upsample), and
  PIL resamples the region, given as an exact, fractional box, to the output size with the same
  bilinear antialiased filter torchvision uses. Faster on large images, but the DCT-domain reduction
  is not the antialiased resize of the full decode: the output differs from torchvision's
  (docs/design-decoding.md gives the error per preset, ``python -m bench.accuracy`` measures it).

Everything else (no gain expected, or a decoder that refuses) returns None and the caller decodes the
whole image; ``Resize`` + ``CenterCrop`` (imagenet-val) reads a sub-pixel region, so without
``dct_scaling`` it always decodes whole, then resizes exactly as torchvision does.

The libraries, both with libjpeg-turbo inside their wheels (no system package): simplejpeg for the DCT
scaling (``min_height``/``min_width`` choose the scale; it cannot decode a region), and NVIDIA's
nvImageCodec (``nvidia-nvimgcodec-cu13``; its CPU-only libjpeg-turbo 3.1 backend needs neither a GPU
nor CUDA) for the window, the one maintained binding found with a region decode. On ImageNet-size
JPEGs the window decode of ``RandomResizedCrop`` is what saves time, since DCT scaling never applies (a
crop of a 500 x 375 image is under 2 x 224); ``python -m bench.experiments.decode`` measures it,
docs/design-decoding.md gives the figures. Left out: PIL's ``draft`` scales like simplejpeg but decodes
slower; pyvips-binary stops after the window's last row but costs more per call; PyTurboJPEG loads a
system libturbojpeg (a package the image would need); TorchCodec's decoders take torchvision's
options, with neither a region nor a DCT scale.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F
from torchvision.transforms.v2.functional._geometry import _compute_resized_output_size

from .spec import native_uint8_bilinear, resize_uint8


def _import_quietly():
    """nvImageCodec, or None; imported with stdout and stderr pointed at /dev/null.

    Without CUDA (the CPU image) its import prints, whatever the verbosity, that the GPU codecs'
    libraries (nvJPEG, nvJPEG2000, nvTIFF) are missing and asks for the CUDA toolkit: misleading in a
    pod's log, since only its CPU decoder is used. It also logs each file it cannot decode; here that only
    sends the image to the full decode, which words the error if there is one (verbosity 0 unless set).
    """
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = [os.dup(1), os.dup(2)], os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        from nvidia import nvimgcodec

        ctypes.CDLL(None).fflush(None)  # what the C library still buffers goes to /dev/null too
        return nvimgcodec
    except ImportError:  # pragma: no cover - the server extra installs it
        return None
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


# Optional: without it, windows at full scale are decoded whole. Imported once, with the module,
# before the service starts its threads (nothing else writes to stdout or stderr meanwhile).
nvimgcodec = _import_quietly()

# Which way each image was decoded (the ``path`` label of /metrics); "full" gives a reason.
WINDOW, SCALED, FULL = "window", "scaled", "full"
# A window covering at least this share of the image is decoded whole: nvImageCodec's full-image
# decode costs more than torchvision's (same libjpeg-turbo, more per-call overhead).
_MOST_OF_IMAGE = 0.9
_REUSED_BYTES = 16 * 2**20  # the largest window buffer a transform thread keeps between decodes
_SCALES = (8, 4, 2)  # libjpeg-turbo's DCT scalings with SIMD (1/2, 1/4) or trivial (1/8, DC only) IDCTs


@dataclass(frozen=True)
class Window:
    """The source region (pixels, fractional for a resize) the geometric steps read, and their output size."""

    top: float
    left: float
    bottom: float
    right: float
    out_height: int
    out_width: int
    whole_pixels: bool  # the output is resize(crop(region)) of an integer region, as torchvision computes it

    @property
    def height(self) -> float:
        return self.bottom - self.top

    @property
    def width(self) -> float:
        return self.right - self.left

    def dct_scale(self) -> int:
        """The largest of 8, 4, 2 that leaves the region at least at the output's size, else 1."""
        room = min(self.height / self.out_height, self.width / self.out_width)
        return next((scale for scale in _SCALES if room >= scale), 1)


def window_of(transforms: tuple[v2.Transform, ...], params: list[dict[str, Any]], height: int,
              width: int) -> Window | None:
    """The region the leading geometric ``transforms`` read with these drawn ``params``; None if they pad."""
    first = transforms[0]
    if isinstance(first, v2.RandomResizedCrop):
        top, left, crop_h, crop_w = (params[0][k] for k in ("top", "left", "height", "width"))
        return Window(top, left, top + crop_h, left + crop_w, first.size[0], first.size[1], True)
    if isinstance(first, v2.CenterCrop):
        return _center(first.size, height, width, height, width)
    out_h, out_w = _compute_resized_output_size((height, width), size=first.size, max_size=first.max_size)
    if len(transforms) == 1:
        return Window(0, 0, height, width, out_h, out_w, True)
    crop = _center(transforms[1].size, out_h, out_w, height, width)
    if crop is None or (out_h, out_w) == (height, width):
        return crop
    scale_y, scale_x = height / out_h, width / out_w  # torchvision's resize maps output to input thus
    return Window(crop.top * scale_y, crop.left * scale_x, crop.bottom * scale_y, crop.right * scale_x,
                  crop.out_height, crop.out_width, False)


def _center(size: list[int], height: int, width: int, source_h: int, source_w: int) -> Window | None:
    crop_h, crop_w = size
    if crop_h > height or crop_w > width:
        return None  # torchvision pads: the whole image it is
    top, left = int(round((height - crop_h) / 2.0)), int(round((width - crop_w) / 2.0))  # center_crop's anchor
    return Window(top, left, top + crop_h, left + crop_w, crop_h, crop_w, True)


def decode_window(data: bytearray, height: int, width: int, window: Window,
                  dct_scaling: bool = False) -> tuple[torch.Tensor, str] | str:
    """The geometric steps' output (uint8, CHW) and the path taken, or the reason to decode it all.

    ``dct_scaling`` allows the reduced-scale decode (inexact); without it the output is torchvision's.
    """
    if _progressive(data):
        # All scans are read before any row comes out: a window saves nothing measurable and a reduced
        # scale little (docs/design-decoding.md), not worth inexact pixels.
        return "progressive"
    scale = window.dct_scale() if dct_scaling else 1
    if scale > 1:
        image = _decode_scaled(data, height, width, scale, window)
        return (image, SCALED) if image is not None else "decoder"
    if not window.whole_pixels:
        return "no_gain"  # a sub-pixel region at full scale: exact resampling of a part costs more than it saves
    if window.height * window.width >= _MOST_OF_IMAGE * height * width:
        return "no_gain"
    if nvimgcodec is None:
        return "no_region_decoder"
    crop = _decode_region(data, window)
    if crop is None:
        return "decoder"
    size = (window.out_height, window.out_width)
    if tuple(crop.shape[-2:]) == size:
        return crop.clone(), WINDOW  # the crop is the output (the decoder's buffer is reused next time)
    if native_uint8_bilinear():
        return resize_uint8(crop, size, True), WINDOW
    return F.resize_image(crop, list(size), antialias=True), WINDOW


_PROGRESSIVE = frozenset((0xC2, 0xC6, 0xCA, 0xCE))  # SOF markers of the progressive processes
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOFn (C4 DHT, C8 JPG, CC DAC are not frames)


def _progressive(data: bytearray) -> bool:
    """Whether the JPEG's frame header is a progressive one: a walk over the segments before it (a few)."""
    position, end = 2, len(data) - 4
    while position < end and data[position] == 0xFF:
        marker = data[position + 1]
        if marker in _FRAMES:
            return marker in _PROGRESSIVE
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        position += 2 + (data[position + 2] << 8 | data[position + 3])
    return False


def _decode_scaled(data: bytearray, height: int, width: int, scale: int, window: Window) -> torch.Tensor | None:
    scaled_h, scaled_w = -(-height // scale), -(-width // scale)  # libjpeg rounds scaled sizes up
    try:
        pixels = simplejpeg.decode_jpeg(data, "RGBX", min_height=scaled_h, min_width=scaled_w)
    except Exception:  # any refusal: the full decode words the error, if there is one
        return None
    if pixels.shape[:2] != (scaled_h, scaled_w):
        return None
    # RGBX is PIL's own pixel layout: the image wraps the decoder's array without a copy.
    image = Image.frombuffer("RGBX", (scaled_w, scaled_h), pixels, "raw", "RGBX", 0, 1)
    box = (window.left / scale, window.top / scale, window.right / scale, window.bottom / scale)
    # PIL's bilinear resampling of a fractional box: the triangle filter, stretched when reducing, that
    # torchvision's antialiased bilinear resize was ported from, so the region needs no rounding.
    out = image.resize((window.out_width, window.out_height), Image.Resampling.BILINEAR, box=box)
    return torch.from_numpy(np.array(out))[..., :3].permute(2, 0, 1)


_local = threading.local()


def _new_decoder():
    return nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                              backends=[nvimgcodec.Backend(nvimgcodec.CPU_ONLY)])


def _decode_region(data: bytearray, window: Window) -> torch.Tensor | None:
    """The window's pixels (uint8 CHW view), valid until this thread's next call: the buffer is reused."""
    decoder = getattr(_local, "decoder", None)
    if decoder is None:  # one per transform thread: a decoder is not meant to be shared between threads
        decoder = _local.decoder = _new_decoder()
        _local.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.SRGB,
                                                sample_format=nvimgcodec.I_RGB)
        _local.image = None
    top, left, bottom, right = int(window.top), int(window.left), int(window.bottom), int(window.right)
    try:
        stream = nvimgcodec.CodeStream(np.frombuffer(data, np.uint8)).get_sub_code_stream(
            region=nvimgcodec.Region(top, left, bottom, right))
        # Decoding into the last call's buffer spares an allocation and its page faults (~5% of a decode).
        image = decoder.decode(stream, params=_local.params, image=_local.image)
    except Exception:
        _local.image = None
        return None
    # Kept for the next call only while small: a thread must not hold a huge window's buffer for good.
    _local.image = image if (bottom - top) * (right - left) * 3 <= _REUSED_BYTES else None
    if image is None:  # nvImageCodec reports a failed decode as None (and logs it)
        return None
    pixels = np.asarray(image)  # HWC, a view of the decoder's buffer (kept alive by the array)
    if pixels.shape != (bottom - top, right - left, 3) or pixels.dtype != np.uint8:
        return None
    return torch.from_numpy(pixels).permute(2, 0, 1)
