"""Feed the GPU: host-to-device copies of the next batches overlap the current step.

``CudaPrefetcher`` keeps ``depth`` batches in flight. Each is copied with ``non_blocking=True`` on
a side stream from pinned host memory (the DataLoader's pin thread pins it: ``make_loader`` turns
``pin_memory`` on when CUDA is present), converted there (uint8 -> normalized float, optional
``channels_last``), and handed to the consumer only after ``current_stream.wait_event``; every
tensor handed out gets ``record_stream(current)`` so the caching allocator does not reuse its memory
while the training step may still read it (the apex data_prefetcher recipe). The pinned
source is safe to drop after the copy is queued: PyTorch's caching host allocator records the copy's
event on the pinned block and does not reuse it before the copy completes.

On a machine without CUDA the same class runs the same conversions on the CPU, with no pinning and no
streams, so training scripts do not branch.

Over a resumable loader (``make_loader``), ``state_dict()`` is the loader's state as of the last batch
handed to the training step, not of the ``depth`` batches read ahead; ``load_state_dict`` passes a
state on to the loader.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..wire import LAYOUTS

log = logging.getLogger("transformer.client")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class PrefetchStats:
    """``wait_seconds``: host time blocked on the loader (non-zero means the input pipeline is the
    bottleneck, not the copy); ``bytes_to_device``: bytes copied host-to-device."""

    batches: int = 0
    wait_seconds: float = 0.0
    bytes_to_device: int = 0


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``; an explicit CUDA device without CUDA -> cpu
    with a warning, so one script runs on both kinds of machine."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log.warning("CUDA is not available; CudaPrefetcher falls back to the CPU")
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class CudaPrefetcher:
    """Iterate ``loader`` with batches already on ``device``, converted, ``depth`` batches ahead.

    Batches are tuples/lists (or dicts) of tensors; the element at ``image_index`` (a key for dicts)
    is the image batch. uint8 images (``dtype=uint8`` from the service: 4x fewer bytes) become
    ``dtype`` and, with ``normalize``, ``(x / 255 - mean) / std``; ``layout="HWC"`` batches are
    permuted to NCHW (a view with channels_last strides). Float images only change dtype. Other
    tensors are moved as they are.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: str | torch.device | None = None,
        depth: int = 2,
        *,
        image_index: int | str = 0,
        dtype: torch.dtype = torch.float32,
        normalize: bool = True,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        layout: str = "CHW",
        channels_last: bool = False,
    ):
        if depth < 1:
            raise ValueError("CudaPrefetcher: depth must be at least 1")
        if layout not in LAYOUTS:
            raise ValueError(f"CudaPrefetcher: layout {layout!r} is not CHW or HWC")
        if not dtype.is_floating_point:
            raise ValueError(f"CudaPrefetcher: dtype {dtype} is not a floating point type")
        if len(mean) != len(std) or any(s <= 0 for s in std):
            raise ValueError("CudaPrefetcher: mean and std need the same length and positive std")
        self.loader = loader
        self.device = resolve_device(device)
        self.depth = depth
        self.image_index = image_index
        self.dtype = dtype
        self.normalize = normalize
        self.layout = layout
        self.channels_last = channels_last
        self.stats = PrefetchStats()
        self._handed: Any = None  # the loader's position after the last batch handed out (None: its own)
        # On the 0-255 scale, as uint8 input arrives (apex/timm idiom): one sub and one div per pixel.
        shape = (1, len(mean), 1, 1)
        self._mean = torch.tensor([m * 255 for m in mean], dtype=dtype, device=self.device).view(shape)
        self._std = torch.tensor([s * 255 for s in std], dtype=dtype, device=self.device).view(shape)

    @property
    def uses_cuda(self) -> bool:
        return self.device.type == "cuda"

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """The loader's ``state_dict()`` as of the last batch this prefetcher handed out."""
        if not hasattr(self.loader, "state_dict"):
            raise TypeError(f"{type(self.loader).__name__} has no state_dict(); make_loader's loader has")
        if self._handed is None:
            return self.loader.state_dict()
        return self.loader.state_at(self._handed)  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Pass ``state`` on to the loader: the next ``iter()`` resumes there."""
        self._handed = None
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        self._handed = None
        return self._tracked(self._iter_cuda() if self.uses_cuda else self._iter_cpu())

    def _tracked(self, batches: Iterator[tuple[Any, Any]]) -> Iterator[Any]:
        """The batches, noting the loader's position after each (taken when it was read from the loader)."""
        for batch, after in batches:
            self._handed = after
            yield batch
        self._handed = None  # all handed out: the loader's own state is the one to save

    def _next(self, source: Iterator[Any]) -> Any:
        started = time.perf_counter()
        try:
            return next(source)
        finally:
            self.stats.wait_seconds += time.perf_counter() - started

    def _position(self) -> Any:
        position = getattr(self.loader, "_position", None)
        return position() if position is not None else None

    def _iter_cpu(self) -> Iterator[Any]:
        source = iter(self.loader)
        while True:
            try:
                batch = self._next(source)
            except StopIteration:
                return
            self.stats.batches += 1
            yield self._convert_batch(batch), self._position()

    def _iter_cuda(self) -> Iterator[Any]:
        source = iter(self.loader)
        side = torch.cuda.Stream(self.device)
        consumer = torch.cuda.current_stream(self.device)
        side.wait_stream(consumer)  # mean/std were made on the consumer stream
        in_flight: deque[tuple[Any, torch.cuda.Event, Any]] = deque()

        def issue() -> bool:
            try:
                batch = self._next(source)
            except StopIteration:
                return False
            position = self._position()  # the loader's, right after this batch
            with torch.cuda.stream(side):
                moved = self._convert_batch(batch)
                ready = torch.cuda.Event()
                ready.record(side)
            in_flight.append((moved, ready, position))
            return True

        for _ in range(self.depth):
            if not issue():
                break
        while in_flight:
            batch, ready, position = in_flight.popleft()
            consumer.wait_event(ready)
            for tensor in _tensors(batch):
                tensor.record_stream(consumer)  # memory made on `side`, used on `consumer`
            issue()  # queue the next copy before handing this batch out, so they overlap
            self.stats.batches += 1
            yield batch, position

    def _convert_batch(self, batch: Any) -> Any:
        if isinstance(batch, dict):
            return {k: self._convert(v, k == self.image_index) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            converted = [self._convert(v, i == self.image_index) for i, v in enumerate(batch)]
            return type(batch)(converted) if isinstance(batch, tuple) else converted
        return self._convert(batch, True)

    def _convert(self, value: Any, is_image: bool) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if self.uses_cuda:
            self.stats.bytes_to_device += value.numel() * value.element_size()
            value = value.to(self.device, non_blocking=True)
        if not is_image:
            return value
        return self.convert_images(value)

    def convert_images(self, images: torch.Tensor) -> torch.Tensor:
        """The on-device conversion of one image batch (N,C,H,W or N,H,W,C), exposed for tests."""
        if self.layout == "HWC":
            images = images.permute(0, 3, 1, 2)  # a view: NCHW shape with channels_last strides
        if images.dtype == torch.uint8:
            images = images.to(self.dtype)
            if self.normalize:
                if images.shape[1] != self._mean.shape[1]:
                    raise ValueError(f"CudaPrefetcher: images have {images.shape[1]} channels, "
                                     f"mean/std have {self._mean.shape[1]}")
                images = images.sub_(self._mean).div_(self._std)
            else:
                images = images.div_(255)
        elif images.dtype != self.dtype:
            images = images.to(self.dtype)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
