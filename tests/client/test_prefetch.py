"""CudaPrefetcher: the CPU path always (same API, no pinning, no streams); the CUDA path when present."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch

from transformer.client import CudaPrefetcher
from transformer.client.prefetch import IMAGENET_MEAN, IMAGENET_STD, resolve_device

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def uint8_batches(count: int, size: int = 4, layout: str = "CHW") -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shape = (size, 3, 8, 6) if layout == "CHW" else (size, 8, 6, 3)
    return [(torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator), torch.arange(size) + i * size)
             for i in range(count)]


def reference(images: torch.Tensor) -> torch.Tensor:
    """(x / 255 - mean) / std in float64, the definition the service uses for float32 output."""
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    return ((images.double() / 255 - mean) / std).float()


def test_cpu_normalizes_uint8_in_order_and_keeps_labels() -> None:
    batches = uint8_batches(5)
    prefetcher = CudaPrefetcher(batches, device="cpu", depth=3)
    assert not prefetcher.uses_cuda and len(prefetcher) == 5
    out = list(prefetcher)
    assert len(out) == 5
    for (images, labels), (raw, raw_labels) in zip(out, batches):
        assert images.dtype == torch.float32 and images.shape == raw.shape
        torch.testing.assert_close(images, reference(raw), atol=1e-5, rtol=1e-5)
        assert torch.equal(labels, raw_labels)
    assert prefetcher.stats.batches == 5 and prefetcher.stats.bytes_to_device == 0
    assert list(prefetcher)[0][1].tolist() == [0, 1, 2, 3]  # iterable again


def test_cpu_hwc_uint8_becomes_nchw_with_channels_last_strides() -> None:
    (raw, _), = uint8_batches(1, layout="HWC")
    ((images, _),) = list(CudaPrefetcher([(raw, torch.zeros(4))], device="cpu", layout="HWC"))
    assert images.shape == (4, 3, 8, 6)
    assert images.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(images, reference(raw.permute(0, 3, 1, 2)), atol=1e-5, rtol=1e-5)


def test_cpu_options_dtype_no_normalize_channels_last_and_float_input() -> None:
    (raw, labels), = uint8_batches(1)
    ((half, _),) = list(CudaPrefetcher([(raw, labels)], device="cpu", dtype=torch.float16, channels_last=True))
    assert half.dtype == torch.float16 and half.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(half.float(), reference(raw), atol=2e-2, rtol=1e-2)
    ((plain, _),) = list(CudaPrefetcher([(raw, labels)], device="cpu", normalize=False))
    torch.testing.assert_close(plain, raw.float() / 255)
    served = reference(raw).half()  # the service sent float16: only the dtype changes
    ((floats, _),) = list(CudaPrefetcher([(served, labels)], device="cpu"))
    assert floats.dtype == torch.float32 and torch.equal(floats, served.float())


def test_cpu_dict_batches_and_image_key() -> None:
    (raw, labels), = uint8_batches(1)
    (batch,) = list(CudaPrefetcher([{"image": raw, "label": labels, "key": ["a"] * 4}], device="cpu",
                                   image_index="image"))
    torch.testing.assert_close(batch["image"], reference(raw), atol=1e-5, rtol=1e-5)
    assert torch.equal(batch["label"], labels) and batch["key"] == ["a"] * 4


def test_wait_time_is_measured() -> None:
    import time

    def slow():
        for batch in uint8_batches(3):
            time.sleep(0.05)
            yield batch

    prefetcher = CudaPrefetcher(slow(), device="cpu")
    assert len(list(prefetcher)) == 3
    assert prefetcher.stats.wait_seconds >= 0.14


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="depth"):
        CudaPrefetcher([], depth=0)
    with pytest.raises(ValueError, match="layout"):
        CudaPrefetcher([], layout="NCHW")
    with pytest.raises(ValueError, match="floating point"):
        CudaPrefetcher([], dtype=torch.uint8)
    (raw, labels), = uint8_batches(1)
    with pytest.raises(ValueError, match="channels"):
        list(CudaPrefetcher([(raw[:, :1], labels)], device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_without_cuda_the_same_script_runs_on_the_cpu(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_device(None) == torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="transformer.client"):
        prefetcher = CudaPrefetcher(uint8_batches(2), device="cuda")
    assert prefetcher.device == torch.device("cpu") and "falls back to the CPU" in caplog.text
    assert len(list(prefetcher)) == 2


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_cuda_matches_the_cpu_reference(depth: int) -> None:
    batches = [(images.pin_memory(), labels.pin_memory()) for images, labels in uint8_batches(6)]
    prefetcher = CudaPrefetcher(batches, device="cuda", depth=depth, channels_last=True)
    out = list(prefetcher)
    assert len(out) == 6 and prefetcher.stats.bytes_to_device == sum(a.numel() + b.numel() * 8 for a, b in batches)
    for (images, labels), (raw, raw_labels) in zip(out, batches):
        assert images.is_cuda and labels.is_cuda
        assert images.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(images.cpu(), reference(raw), atol=1e-5, rtol=1e-5)
        assert torch.equal(labels.cpu(), raw_labels)


def read_late(batches: list, sleep_ms: float = 30.0) -> list[float]:
    """Each batch's sum, read late on the consumer stream (``bench.gpu.checks.read_late``, the device check's way)."""
    from bench.gpu.checks import read_late as device_read_late

    return device_read_late(batches, sleep_ms)


def filled_batches(count: int = 8, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pinned uint8 batches of ImageNet-sized images, each filled with a value of its own."""
    return [(torch.full((size, 3, 224, 224), 10 + 20 * i, dtype=torch.uint8).pin_memory(),
             torch.arange(size).pin_memory()) for i in range(count)]


@CUDA
@pytest.mark.gpu
def test_cuda_batches_are_kept_while_the_step_still_reads_them() -> None:
    batches = filled_batches()
    expected = [reference(raw).double().sum().item() for raw, _ in batches]
    assert read_late(batches) == pytest.approx(expected, rel=1e-6)


@CUDA
@pytest.mark.gpu
def test_without_record_stream_the_late_read_sees_later_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with no tensor handed out marked as used on the consumer stream, the
    caching allocator gives a batch's memory to a later copy while the step still reads it."""
    from transformer.client import prefetch

    monkeypatch.setattr(prefetch, "_tensors", lambda batch: iter(()))
    batches = filled_batches()
    expected = [reference(raw).double().sum().item() for raw, _ in batches]
    assert read_late(batches) != pytest.approx(expected, rel=1e-6)


def test_uint8_normalized_here_is_the_pods_float32_within_its_quantization(pool_module) -> None:
    """The same seeded shard through the pod's engine as uint8 and as float32 (random crops and flips,
    ImageNet normalization): the uint8 images normalized by the CPU path are the pod's float32 images
    within the uint8 quantization, half a step (0.5/255) per pixel before normalization."""
    from testbed.shardgen import imagenet_like_shard, read_output
    from transformer.config import Settings
    from transformer.engine import transform_shard
    from transformer.options import options_from_mapping

    spec = {"transforms": [{"RandomResizedCrop": {"size": 48, "antialias": True}}, {"RandomHorizontalFlip": {}},
                           {"Normalize": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}}], "seed": 5}
    shard = imagenet_like_shard(6, extra=False)
    arrays = {}
    for dtype in ("uint8", "float32"):
        options = options_from_mapping({**spec, "dtype": dtype}, Settings.from_env({}))
        data = b"".join(bytes(chunk) for chunk in transform_shard(io.BytesIO(shard), options, pool_module,
                                                                  shard="s.tar", object_name="s.tar", window=4))
        members = {name: np.load(io.BytesIO(payload)) for name, payload in read_output(data) if name.endswith(".npy")}
        arrays[dtype] = torch.stack([torch.from_numpy(members[name]) for name in sorted(members)])
    assert arrays["uint8"].dtype == torch.uint8 and arrays["float32"].dtype == torch.float32
    assert arrays["uint8"].shape == arrays["float32"].shape == (6, 3, 48, 48)
    ((normalized, _),) = list(CudaPrefetcher([(arrays["uint8"], torch.arange(6))], device="cpu"))
    steps = (normalized - arrays["float32"]).abs() * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
    assert float(steps.max()) <= 0.5, f"{float(steps.max()):.3f} uint8 steps apart"
