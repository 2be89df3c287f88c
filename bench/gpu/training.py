"""Part 6: a training step alone, then fed by ``make_loader`` through ``CudaPrefetcher``."""

from __future__ import annotations

import gc
import time
from typing import Any

from .budget import Budget, check
from .constants import CLASSES

# ---- 6. the training step -----------------------------------------------------------------------------------


def training(shards: dict, batch: int, steps: int, workers: int, model_name: str, size: int, budget: Budget,
             limit_s: float) -> dict:
    import torch
    import torch.nn.functional as functional

    from transformer.client import CudaPrefetcher, make_loader

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if model_name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None)
    else:  # a stand-in small enough for a CPU smoke run
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4), torch.nn.ReLU(),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, CLASSES))
    model = model.to(device, memory_format=torch.channels_last)
    parameters = list(model.parameters())
    torch.backends.cudnn.benchmark = True

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = functional.cross_entropy(model(images), labels % CLASSES)
        for parameter in parameters:
            parameter.grad = None
        loss.backward()
        with torch.no_grad():  # plain SGD in one multi-tensor op, as torch.optim.SGD(foreach=True) does it
            torch._foreach_add_(parameters, [p.grad for p in parameters], alpha=-0.01)

    fixed = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    fixed_labels = torch.randint(0, CLASSES, (batch,), device=device)
    for _ in range(3):
        step(fixed, fixed_labels)
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    timed = 0
    while timed < 10 and (timed < 2 or time.perf_counter() - started < limit_s / 2):
        step(fixed, fixed_labels)
        timed += 1
    if cuda:
        torch.cuda.synchronize()
    alone_s = (time.perf_counter() - started) / timed
    result: dict[str, Any] = {"model": model_name, "batch_size": batch, "step_alone_ms": alone_s * 1000,
                              "step_alone_samples_per_s": batch / alone_s, "fed": []}
    warm = 3  # steps before the steady state: the workers' start and the first batches
    for dtype in ("uint8", "float32"):
        limit = budget.cap(limit_s)
        if limit < 2:
            result["fed"].append({"dtype": dtype, "status": "cut: out of time"})
            continue
        # Drawn with replacement: one epoch of ``steps`` batches, the workers started once.
        loader = make_loader([str(p) for p in shards[dtype]], batch, num_workers=workers, split_by_node=False,
                             resampled=True, epoch_batches=steps, pin_memory=cuda)
        prefetcher = CudaPrefetcher(loader, depth=2, channels_last=True)
        done = 0
        began = time.perf_counter()
        wait_at_warm = steady_from = None
        for images, labels in prefetcher:
            step(images, labels)
            done += 1
            if done == warm:
                if cuda:
                    torch.cuda.synchronize()
                wait_at_warm, steady_from = prefetcher.stats.wait_seconds, time.perf_counter()
            if time.perf_counter() - began > limit:
                break
        if cuda:
            torch.cuda.synchronize()
        ended = time.perf_counter()
        row: dict[str, Any] = {"dtype": dtype, "workers": workers, "steps": done, "seconds": round(ended - began, 2),
                               "wait_s": prefetcher.stats.wait_seconds}
        del prefetcher, loader
        gc.collect()
        if steady_from is None or done <= warm:
            row["status"] = "failed: fewer steps than the warm-up"
        else:
            steady_s = ended - steady_from
            wait = row["wait_s"] - wait_at_warm
            rate = (done - warm) * batch / steady_s
            row.update(steady_steps=done - warm, steady_samples_per_s=rate, steady_wait_s=wait,
                       steady_wait_share=wait / steady_s, starved=rate < 0.95 * result["step_alone_samples_per_s"],
                       status="passed")
        result["fed"].append(row)
        print(f"bench.gpu: training: {dtype}: {row}", flush=True)
    for row in result["fed"]:
        check(result, f"fed by make_loader ({row['dtype']})", not row["status"].startswith("failed"), row["status"])
    late = [row["dtype"] for row in result["fed"] if row["status"].startswith("cut")]
    if late and result.get("status") != "failed":
        result.update(status="cut", reason=f"out of time for the fed step: {', '.join(late)}")
    return result
