"""One sample: decode its images, transform them jointly, encode each as ``.npy``.

A sample is the run of tar members sharing a WebDataset key (``key.jpg``, ``key.cls``, ...).
Image members (last suffix in ``image_exts``) are decoded, transformed and replaced by
``<key>.<ext with its last suffix replaced by npy>``; mask members (full extension in ``mask_exts``)
get the same geometric draw with nearest-neighbour resampling and no normalization; every other
member passes through byte-exact. Nothing here knows about HTTP or tar framing.
"""

from __future__ import annotations

import io
import math
import re
import tarfile
import threading
from collections import Counter
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.io import ImageReadMode
from torchvision.transforms.v2.functional import to_dtype

from .cropdecode import FULL, decode_window, window_of
from .errors import SampleTransformError, StepRefused
from .options import TransformOptions
from .shards import Member, Sample
from .spec import check_canvas, known_canvas, sample_seed

# The pixel limit is ours (ETL_MAX_IMAGE_PIXELS, checked from the header before decoding); PIL's
# own warning/error thresholds would otherwise fire first with a less useful message.
Image.MAX_IMAGE_PIXELS = None

# torchvision's decoder, called as the op ``torchvision.io.decode_image`` calls (input, mode, apply EXIF
# orientation). The wrapper adds a DeprecationWarning per call (torchvision 0.29 moves decoding to
# TorchCodec) and an op lookup by name: Python holding the GIL the other threads wait for (the A/B is
# in docs/design.md). tests/test_samples.py checks the two agree.
_decode_op = torch.ops.image.decode_image.default


def member_kind(extension: str | None, options: TransformOptions) -> str:
    """'mask', 'image' or 'other' for a member's extension (case-insensitive)."""
    if extension is None:
        return "other"
    ext = extension.lower()
    if ext in options.mask_exts:
        return "mask"
    if ext.rsplit(".", 1)[-1] in options.image_exts:
        return "image"
    return "other"


def needs_transform(sample: Sample, options: TransformOptions) -> bool:
    return any(member_kind(ext, options) != "other" for ext in sample.extensions)


def transform_sample(sample: Sample, options: TransformOptions, shard: str, object_name: str) -> list[Member]:
    """The sample's output members, in input order.

    ``SampleTransformError`` (naming the member) when the sample's own content fails: a decoder refuses its
    bytes, a limit, a transform step refuses it, an output name is taken. Any other exception is a failure
    of the pod's own code, raised as it is: the engine fails the shard for it.
    """
    kinds = [member_kind(ext, options) for ext in sample.extensions]
    out_names = set()
    positions = []
    for position, (member, kind) in enumerate(zip(sample.members, kinds)):
        if kind == "other":
            out_names.add(member.info.name)
        else:
            positions.append(position)
    seed = sample_seed(options.seed, options.epoch, object_name, sample.key)
    # Intermediate canvases get the decode limit, but never less than 4096 x 4096: a small
    # ETL_MAX_IMAGE_PIXELS (meant for inputs) must not refuse ordinary 224 x 224 outputs.
    max_pixels = max(options.max_image_pixels, 4096 * 4096)
    images = [p for p in positions if kinds[p] == "image"]
    try:
        if len(images) == 1:
            outputs = _transform_cropped(sample, kinds, positions, images[0], options, shard, seed, max_pixels)
        else:
            if images:
                _count(FULL, "several_images")
            outputs = None
        if outputs is None:
            inputs = [_decode(sample.members[p], kinds[p], options, shard, sample.key) for p in positions]
            outputs = options.pipeline.apply(_typed(inputs), seed, max_pixels)
    except StepRefused as refused:  # a step refused this input (e.g. a crop larger than the image)
        member = sample.members[positions[0]].info.name
        raise SampleTransformError(shard, sample.key, member, f"transform failed: {refused.cause}") from refused.cause

    result = list(sample.members)
    for position, tensor in zip(positions, outputs):
        source = sample.members[position].info
        kind = kinds[position]
        if kind == "mask":
            payload = _encode_mask(tensor)
        else:
            payload = _encode_image(tensor, options, shard, sample.key, source.name)
        name = source.name.rsplit(".", 1)[0] + ".npy"
        if name in out_names:
            raise SampleTransformError(shard, sample.key, source.name,
                                       f"output name '{name}' collides with another member")
        out_names.add(name)
        result[position] = _npy_member(source, name, payload)
    return result


_outputs = threading.local()  # per transform thread: where its output arrays go (``transform_into``)


def transform_into(allocate: Callable[[int], memoryview | None], sample: Sample, options: TransformOptions, shard: str,
                   object_name: str) -> list[Member]:
    """``transform_sample`` with each image's output array written straight into ``allocate(nbytes)``'s
    buffer (shared memory another process writes out from, server/spread.py); None: an ordinary array.
    The bytes are the same either way."""
    _outputs.allocate = allocate
    try:
        return transform_sample(sample, options, shard, object_name)
    finally:
        _outputs.allocate = None


def _output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An output tensor in the buffer ``transform_into`` gives this thread, or None (allocate one as usual)."""
    allocate = getattr(_outputs, "allocate", None)
    if allocate is None:
        return None
    view = allocate(math.prod(shape) * dtype.itemsize)
    return None if view is None else torch.frombuffer(view, dtype=dtype).view(shape)


def _typed(inputs: list) -> list:
    if len(inputs) > 1:
        # Images decode as plain tensors: alone, v2 transforms a plain tensor as the image and calls its
        # kernels directly; beside other images or masks each needs its tv_tensor type to be told apart.
        return [tv_tensors.Image(x) if type(x) is torch.Tensor else x for x in inputs]
    return inputs


def _transform_cropped(sample: Sample, kinds: list[str], positions: list[int], image: int,
                       options: TransformOptions, shard: str, seed: int, max_pixels: int) -> list | None:
    """The sample's outputs with its one image decoded only as far as the output needs, or None.

    The leading geometric steps are drawn first, on a stand-in of the image's size (the same draws as
    ``Pipeline.apply`` makes on the decoded image: each step's generator is seeded by the sample and the
    step alone), then the image is decoded through ``cropdecode`` straight to those steps' output; masks
    take the same steps with the same draws, and the remaining steps run on everything as usual.
    None (counted with its reason): decode the whole image instead.
    """
    pipeline = options.pipeline
    if not options.crop_decode:
        return _count(FULL, "disabled")
    if not pipeline.geometry:
        return _count(FULL, "transforms")
    member = sample.members[image]
    data = _member_bytes(member, shard, sample.key)
    header = _jpeg_header(data)
    if header is None:
        return _count(FULL, "not_jpeg")
    width, height, colorspace = header
    _check_pixels(width, height, options, shard, sample.key, member.info.name)
    if colorspace not in ("YCbCr", "Gray"):
        return _count(FULL, "colorspace")  # CMYK/YCCK/RGB JPEGs: torchvision's decoder and its conversions
    masks = [_decode(sample.members[p], kinds[p], options, shard, sample.key) for p in positions if p != image]
    if any(tuple(mask.shape[-2:]) != (height, width) for mask in masks):
        return _count(FULL, "mask_size")  # torchvision's own path words the mismatch
    stand_in = torch.zeros((), dtype=torch.uint8).expand(3, height, width)  # the image's size, no pixels
    flat = _typed([stand_in, *masks])
    decisions = []
    for index in range(pipeline.geometry):
        decision = pipeline.decide(index, flat, seed)
        transform = pipeline.transforms[index]
        check_canvas(transform, decision[1], flat[0], max_pixels)
        decisions.append(decision)
        if index + 1 < pipeline.geometry:  # the next step's stand-ins: the same types at this step's output size
            canvas = known_canvas(transform, *flat[0].shape[-2:])
            flat = [x.as_subclass(torch.Tensor)[..., :1, :1].expand(*x.shape[:-2], *canvas).as_subclass(type(x))
                    for x in flat]
    window = window_of(pipeline.transforms[:pipeline.geometry], [d[1] for d in decisions], height, width)
    decoded = decode_window(data, height, width, window, options.dct_scaling) if window is not None else "pads"
    if isinstance(decoded, str):
        return _count(FULL, decoded)
    tensor, path = decoded
    _count(path, "")
    if masks:  # the geometric steps' draws, without the image's place in them
        masks = pipeline.apply(masks, seed, max_pixels, stop=pipeline.geometry,
                               decisions=[(needs[1:], params) for needs, params in decisions])
    inputs = iter(masks)
    flat = _typed([tensor if p == image else next(inputs) for p in positions])
    return pipeline.apply(flat, seed, max_pixels, start=pipeline.geometry)


_paths: Counter[tuple[str, str]] = Counter()
_paths_lock = threading.Lock()


def _count(path: str, reason: str) -> None:
    with _paths_lock:
        _paths[path, reason] += 1


def decode_paths() -> dict[tuple[str, str], int]:
    """Images decoded so far in this process, by (path, reason): what /metrics reports."""
    with _paths_lock:
        return dict(_paths)


def _member_bytes(member: Member, shard: str, key: str) -> bytearray | memoryview:
    pieces = member.pieces
    # A large member arrives in its own bytearray (shards.Chunks), or in shared memory from the shard's
    # leader (server/spread.py): the decoder reads it in place. Anything else becomes one bytearray.
    data = pieces[0] if len(pieces) == 1 and _in_place(pieces[0]) else bytearray(member.data)
    if not data:
        raise SampleTransformError(shard, key, member.info.name, "empty image member (0 bytes)")
    return data


def _in_place(piece: bytes | bytearray | memoryview) -> bool:
    return type(piece) is bytearray or (type(piece) is memoryview and not piece.readonly and piece.format == "B")


def _decode(member: Member, kind: str, options: TransformOptions, shard: str, key: str):
    name = member.info.name
    data = _member_bytes(member, shard, key)
    header = _jpeg_header(data) if kind == "image" else None
    if header is not None:
        _check_pixels(header[0], header[1], options, shard, key, name)
    else:
        mask = _probe(data, kind, options, shard, key, name)
        if mask is not None:
            return mask
    try:
        tensor = _decode_op(torch.frombuffer(data, dtype=torch.uint8), ImageReadMode.RGB.value, False)
    except Exception:
        tensor = _decode_with_pil(data, shard, key, name)  # formats libjpeg/libpng refuse but PIL reads
    if tensor.dtype == torch.uint16:  # 16-bit PNG: keep the fast uint8 paths; 8 bits carry the signal
        tensor = to_dtype(tensor, torch.uint8, scale=True)  # torch implements no uint16 shift on CPU
    return tensor  # a plain tensor: transform_sample types it when the sample has several inputs


def _jpeg_header(data: bytes) -> tuple[int, int, str] | None:
    """(width, height, colorspace) from a JPEG's frame header, or None: not a JPEG, or one libjpeg cannot read.

    libjpeg-turbo through simplejpeg reads it in C; PIL's probe walks the markers in Python, holding
    the GIL that the other transform threads and the shard driver wait for, once per image.
    None sends the image to PIL's probe, which words the error.
    """
    if data[:2] != b"\xff\xd8":
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # simplejpeg raises ValueError, but any refusal means: let PIL look at it
        return None
    return width, height, colorspace


def _check_pixels(width: int, height: int, options: TransformOptions, shard: str, key: str, name: str) -> None:
    if width * height > options.max_image_pixels:
        raise SampleTransformError(
            shard, key, name,
            f"image is {width}x{height} = {width * height} pixels, over the limit of "
            f"{options.max_image_pixels} (ETL_MAX_IMAGE_PIXELS)",
        )


def _probe(data: bytes, kind: str, options: TransformOptions, shard: str, key: str, name: str):
    """PIL's look at a non-JPEG image or a mask: the pixel limit, and a mask's decoded values."""
    try:
        with Image.open(io.BytesIO(data)) as probe:
            _check_pixels(*probe.size, options, shard, key, name)
            if kind == "mask":
                # Masks keep their values (class indices, palette indices), so PIL, not an RGB decode.
                probe.load()
                array = np.array(probe)  # a writable copy: torch refuses read-only buffers
                if array.ndim == 3:
                    array = array[..., 0]
                return tv_tensors.Mask(torch.from_numpy(_mask_dtype(array)))
    except SampleTransformError:
        raise
    except Exception as exc:
        raise SampleTransformError(shard, key, name, f"not a decodable image: {_clean(exc)}") from None
    return None


def _decode_with_pil(data: bytes, shard: str, key: str, name: str) -> torch.Tensor:
    try:
        with Image.open(io.BytesIO(data)) as image:
            array = np.asarray(image.convert("RGB"))
    except Exception as exc:
        raise SampleTransformError(shard, key, name, f"not a decodable image: {_clean(exc)}") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def _clean(exc: Exception) -> str:
    """An exception as a short, reproducible message (PIL names the BytesIO object by address)."""
    text = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc)) or exc.__class__.__name__
    return text[:300]


def _mask_dtype(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.bool_:
        return array.astype(np.uint8)
    if array.dtype in (np.uint8, np.int16, np.int32, np.int64):
        return np.ascontiguousarray(array)
    return array.astype(np.int32)


def _encode_image(tensor: torch.Tensor, options: TransformOptions, shard: str, key: str, name: str) -> np.ndarray:
    image = tensor.as_subclass(torch.Tensor)
    channels = image.shape[0]
    if options.layout == "HWC":
        image = image.permute(1, 2, 0)
    image = image.contiguous()  # contiguous uint8 first, float math after: it is slower on a strided view
    if options.dtype == "uint8":
        out = _output(tuple(image.shape), torch.uint8)
        return image.numpy() if out is None else out.copy_(image).numpy()
    scale, shift = _affine(options.pipeline.normalize, channels, options.layout)
    if scale is None:
        raise SampleTransformError(
            shard, key, name,
            f"image has {channels} channels but Normalize has {len(options.pipeline.normalize[0])} values",
        )
    if options.dtype == "float16":
        out = _output(tuple(image.shape), torch.float16)
        values = image.to(torch.float32).mul_(scale).add_(shift)
        return values.to(torch.float16).numpy() if out is None else out.copy_(values).numpy()
    out = _output(tuple(image.shape), torch.float32)
    if out is None:
        return image.to(torch.float32).mul_(scale).add_(shift).numpy()
    return out.copy_(image).mul_(scale).add_(shift).numpy()  # the same float math (``to`` is a copy), into ``out``


@lru_cache(maxsize=32)
def _affine(normalize, channels: int, layout: str):
    """(x / 255 - mean) / std as one multiply-add: x * scale + shift, shaped for the layout."""
    if normalize is None:
        mean, std = (0.0,) * channels, (1.0,) * channels
    else:
        mean, std = normalize
        if len(mean) == 1:
            mean, std = mean * channels, std * channels
        if len(mean) != channels:
            return None, None
    shape = (channels, 1, 1) if layout == "CHW" else (channels,)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(shape)
    std_t = torch.tensor(std, dtype=torch.float32).view(shape)
    return 1.0 / (255.0 * std_t), -mean_t / std_t


def _encode_mask(tensor: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.as_subclass(torch.Tensor).numpy())


@lru_cache(maxsize=256)
def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def npy_pieces(array: np.ndarray) -> list[bytes | memoryview]:
    """A ``.npy`` file as (header, payload view): no copy of the array's bytes."""
    array = np.ascontiguousarray(array)
    header = _npy_header(np.lib.format.dtype_to_descr(array.dtype), array.shape)
    return [header, memoryview(array).cast("B")]


def _npy_member(source: tarfile.TarInfo, name: str, array: np.ndarray) -> Member:
    pieces = npy_pieces(array)
    info = tarfile.TarInfo(name)
    info.size = sum(len(p) for p in pieces)
    info.mtime, info.mode = source.mtime, source.mode
    info.uid, info.gid, info.uname, info.gname = source.uid, source.gid, source.uname, source.gname
    return Member(info=info, pieces=pieces)
