"""The GPU check's ``results.md``: the verdict, then each part's figures and checks."""

from __future__ import annotations

from typing import Any


def _figure(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(results: dict) -> str:
    env = results.get("environment", {})
    meta = results.get("meta", {})
    cut = results.get("cut") or []
    headline = "FAILED" if not results.get("ok") else "passed" + (f", cut for time: {', '.join(cut)}" if cut else "")
    if not meta.get("finished", True):
        headline += " (so far: the run has not finished)"
    lines = [f"# GPU check: {headline}", "",
             f"{env.get('device') or 'no CUDA device'}, torch {env.get('torch')} (CUDA {env.get('cuda')}), "
             f"torchvision {env.get('packages', {}).get('torchvision')}, Python {env.get('python')}, "
             f"{env.get('cpus')} CPUs, /dev/shm {env.get('dev_shm_gib')} GiB; {meta.get('started')}, "
             f"{meta.get('duration_s')} s of a {meta.get('budget_s'):.0f} s budget; `{meta.get('command')}`", "",
             "| part | status | seconds | note |", "| --- | --- | --- | --- |"]
    for name, part in results["parts"].items():
        lines.append(f"| {name} | {part['status']} | {part.get('seconds', '-')} | {part.get('reason', '')[:200]} |")
    parts = results["parts"]
    for name, part in parts.items():
        for failed in (c for c in part.get("checks", []) if not c["ok"]):
            lines.append(f"- {name}: {failed['check']}: {failed['detail'][:500]}")
    install_part = parts.get("install", {})
    if "wheels" in install_part:
        lines.append(f"\nInstalled {len(install_part['wheels'])} carried wheels "
                     f"({install_part['bytes'] / 1e6:.1f} MB): {', '.join(install_part['installed'])}")
    tests = parts.get("tests", {})
    if "counts" in tests:
        lines += ["", f"Tests: {', '.join(f'{n} {k}' for k, n in sorted(tests['counts'].items()))}."]
        for entry in tests.get("failed", []):
            lines.append(f"- FAILED {entry['test']}: {entry['reason'][-300:]}")
        for entry in tests.get("skipped", []):
            lines.append(f"- skipped {entry['test']}: {entry['reason']}")
        for entry in tests.get("left_out", []):
            lines.append(f"- left out {entry['test']}: {entry['reason']}")
    prefetch = parts.get("prefetch", {})
    for row in prefetch.get("overlap", []) if isinstance(prefetch.get("overlap"), list) else []:
        lines.append(f"\nprefetch_overlap.py, batch 256 {row['dtype']}: copy {_figure(row.get('copy_ms'), 2)} ms "
                     f"({_figure(row.get('h2d_gb_per_s'), 1)} GB/s), compute {_figure(row.get('compute_ms'), 2)} ms, "
                     f"serial {_figure(row.get('serial_ms'), 2)} ms, prefetched {_figure(row.get('prefetched_ms'), 2)} "
                     f"ms: overlap {_figure(row.get('overlap'), 2)} (1.0: the copy hidden)")
    if isinstance(prefetch.get("kept_while_read"), dict):
        for name, row in prefetch["kept_while_read"].items():
            lines.append(f"\nKept while read ({name}): {row['wrong_batches']} of {row['batches']} batches read "
                         "overwritten")
    bandwidth_part = parts.get("bandwidth", {})
    if "h2d_pinned_gb_per_s" in bandwidth_part:
        lines.append(f"\nOne float32 batch ({bandwidth_part['batch_bytes'] / 1e6:.0f} MB): host-to-device "
                     f"{bandwidth_part['h2d_pinned_gb_per_s']:.1f} GB/s pinned, "
                     f"{bandwidth_part['h2d_pageable_gb_per_s']:.1f} GB/s pageable; pinning it (the pin thread's "
                     f"copy) {bandwidth_part['pin_memory_gb_per_s']:.1f} GB/s, "
                     f"{bandwidth_part['pin_memory_ms_per_batch']:.1f} ms")
    loaders = parts.get("loaders", {})
    if loaders.get("rows"):
        lines += ["", f"Into device memory through CudaPrefetcher, batch {loaders['batch_size']}, pin_memory "
                  f"{loaders['pin_memory']} (but where the row says otherwise), the shards read {loaders['passes']} "
                  f"times over, each case for {loaders['case_limit_s']:.0f} s at most:", "",
                  "| dtype | reader | samples/s | steady samples/s | GB/s | first batch s | host wait s | status |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in loaders["rows"]:
            lines.append(f"| {row['dtype']} | {row['reader']} | {_figure(row.get('samples_per_s'))} | "
                         f"{_figure(row.get('steady_samples_per_s'))} | {_figure(row.get('gb_per_s'), 2)} | "
                         f"{_figure(row.get('first_batch_s'), 2)} | {_figure(row.get('wait_s'), 2)} | "
                         f"{row['status']} |")
    train = parts.get("training", {})
    if "step_alone_ms" in train:
        lines += ["", f"Training step ({train['model']}, batch {train['batch_size']}): alone "
                  f"{train['step_alone_ms']:.1f} ms ({train['step_alone_samples_per_s']:,.0f} samples/s)", ""]
        for row in train["fed"]:
            if "steady_samples_per_s" in row:
                lines.append(f"- fed by make_loader ({row['workers']} workers), {row['dtype']}: "
                             f"{row['steady_samples_per_s']:,.0f} samples/s over {row['steady_steps']} steady steps, "
                             f"host wait {row['steady_wait_s']:.2f} s ({row['steady_wait_share']:.0%}): "
                             f"{'STARVED' if row['starved'] else 'not starved'}")
            else:
                lines.append(f"- {row['dtype']}: {row['status']}")
    return "\n".join(lines) + "\n"
