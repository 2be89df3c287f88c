"""Train a small torchvision model for a few steps from ETL'd shards, with GPU prefetch when there is one.

Two ways to run it:

* Local (no AIS cluster): the shards are written in an AIS mountpath layout on local disk, the
  transformer service runs on 127.0.0.1, and the loader reads it exactly as an AIS hpull redirect
  would send it there::

      python examples/train.py --steps 5

* Against AIS: the dataset is converted and uploaded to a bucket, the ETL is registered (or reused),
  and the loader reads the ETL'd object URLs through the cluster::

      python examples/train.py --ais-endpoint http://ais-proxy:51080 --image REGISTRY/ais-wds-transformer:0.1.0

  With ``--no-etl`` it stops before the ETL: upload, list, and read every sample back directly
  (checking each arrives once). That part runs on any AIS cluster; registering an ETL needs AIS
  deployed in Kubernetes, and on a cluster without it the example stops with the cluster's message.

The dataset is ``--data`` in a ``--layout`` that ``transformer.client.convert`` reads (``folders``,
``pets`` or ``labels``); without ``--data`` a small demo dataset of four classes is made from the
photographs bundled with scikit-image. The service sends uint8 images (4x fewer bytes than float32);
the prefetcher normalizes them on the GPU (or on the CPU when there is none).

Checkpoints hold the loader's state with the model's: ``--checkpoint ck.pt`` saves every
``--checkpoint-every`` steps, ``--resume`` continues from it, in the middle of an epoch, with exactly
the batches the interrupted run would have had next::

      python examples/train.py --steps 20 --checkpoint ck.pt --checkpoint-every 5   # stopped at any point
      python examples/train.py --steps 40 --checkpoint ck.pt --resume

In local mode the shards live in ``--workdir`` (next to the checkpoint by default when there is one), so
that a resumed run reads the same shards.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import torch
import torchvision
from PIL import Image

from transformer.client import (
    CudaPrefetcher,
    EpochUrls,
    EtlRequestError,
    EtlSettings,
    convert,
    etl_args,
    make_loader,
    register,
    runtime_spec_yaml,
    shard_urls,
)
from transformer.client.urls import pod_urls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="dataset folder (default: a demo dataset is made)")
    parser.add_argument("--layout", default="folders", choices=["folders", "pets", "labels"])
    parser.add_argument("--labels-file", type=Path, help="for --layout labels")
    parser.add_argument("--ais-endpoint", default=os.environ.get("AIS_ENDPOINT"),
                        help="AIS proxy URL (default: AIS_ENDPOINT; none: local mode)")
    parser.add_argument("--image", default="aistorage/ais-wds-transformer:0.1.0", help="transformer image (AIS mode)")
    parser.add_argument("--etl-name", default="wds-etl")
    parser.add_argument("--bucket", default="wds-demo")
    parser.add_argument("--preset", default="imagenet-train")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=16, help="samples per shard")
    parser.add_argument("--arch", default="resnet18", help="a torchvision.models classifier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-etl", action="store_true",
                        help="AIS mode: upload, list and read the shards back directly; no ETL, no training")
    parser.add_argument("--checkpoint", type=Path, help="save the model, optimizer and loader state here")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint, mid-epoch")
    parser.add_argument("--workdir", type=Path, help="local mode's shards and service log (default: "
                        "<checkpoint>.work with --checkpoint, else a temporary folder)")
    parser.add_argument("--log-batches", action="store_true", help="print a digest of each batch (to compare runs)")
    args = parser.parse_args()
    if args.resume and not (args.checkpoint and args.checkpoint.is_file()):
        parser.error("--resume needs an existing --checkpoint file")
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)

    with ExitStack() as cleanup:
        workdir = args.workdir or (args.checkpoint.with_name(args.checkpoint.name + ".work") if args.checkpoint
                                   else None)
        if workdir is None:
            workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="wds-train-")))
        workdir.mkdir(parents=True, exist_ok=True)
        data = args.data or make_demo_dataset(workdir / "demo")
        # The service sends uint8 (not normalized); CudaPrefetcher normalizes with the ImageNet constants.
        wire = etl_args(preset=args.preset, dtype="uint8")
        settings = EtlSettings(image=args.image, comm_type="hpull", preset=args.preset, dtype="uint8",
                               images_per_shard=args.shard_size)
        if args.ais_endpoint and args.no_etl:
            return check_without_etl(args, data)
        if args.ais_endpoint:
            try:
                urls, classes = from_ais(args, data, settings, wire)
            except EtlRequestError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        else:
            urls, classes = local(args, data, wire, workdir, cleanup)
            print("On an AIS cluster this ETL would be registered with this runtime spec (ais etl init -f):")
            print(runtime_spec_yaml(args.etl_name, settings))
        train(args, urls, classes)
    return 0


def make_demo_dataset(root: Path, per_class: int = 24) -> Path:
    """Four classes (one per photograph), each image a random crop of its photograph (kept when made already)."""
    import skimage.data

    if (root / "rocket").is_dir() and len(list((root / "rocket").iterdir())) == per_class:
        return root
    rng = np.random.default_rng(0)
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        photo = getattr(skimage.data, name)()
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = photo.shape[:2]
            top, left = rng.integers(0, h // 3), rng.integers(0, w // 3)
            crop = photo[top : top + 2 * h // 3, left : left + 2 * w // 3]
            Image.fromarray(crop).convert("RGB").save(root / name / f"{i:03d}.jpg", quality=90)
    return root


def local(args, data: Path, wire: dict, workdir: Path, cleanup: ExitStack) -> tuple[EpochUrls, int]:
    """Shards on local disk in the AIS layout, the transformer service on loopback, hpull-style URLs."""
    mountpath = workdir / "mountpath"
    shard_dir = mountpath / "@ais" / args.bucket / "%ob" / "train"
    report = convert(data, layout=args.layout, labels_file=args.labels_file, output_dir=shard_dir,
                     max_samples=args.shard_size)
    names = [f"train/{Path(p).name}" for p in report.shards]
    print(f"{report.samples} samples in {len(names)} shards ({len(report.skipped)} incomplete records skipped)")
    service = start_service(mountpath, workdir, cleanup)
    urls = pod_urls(service, args.bucket, names, mountpath=str(mountpath))
    return EpochUrls(tuple(urls), wire, seed=args.seed), len(report.classes)


def start_service(mountpath: Path, workdir: Path, cleanup: ExitStack, timeout: float = 120.0) -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "ETL_FQN_ROOTS": str(mountpath), "ETL_LOG_LEVEL": "warning"}
    log = open(workdir / "service.log", "wb")  # noqa: SIM115 - closed by the ExitStack
    cleanup.callback(log.close)
    process = subprocess.Popen([sys.executable, "-m", "transformer", "serve", "--host", "127.0.0.1", "--port",
                                str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop() -> None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()

    cleanup.callback(stop)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the service exited: {(workdir / 'service.log').read_text()[-2000:]}")
        try:
            with urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    print(f"transformer service on {url}")
                    return url
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"the service was not healthy within {timeout:.0f}s")


def upload(args, data: Path):
    """Convert the dataset into shards under ais://<bucket>/train/; returns the SDK client and the report."""
    from aistore.sdk import Client

    client = Client(args.ais_endpoint)
    bucket = client.bucket(args.bucket).create(exist_ok=True)
    report = convert(data, layout=args.layout, labels_file=args.labels_file, bucket=bucket, prefix="train/",
                     max_samples=args.shard_size)
    print(f"uploaded {report.samples} samples in {len(report.shards)} shards to ais://{args.bucket}/train/")
    return client, report


def check_without_etl(args, data: Path) -> int:
    """Upload, list the raw shards, and read every sample back through the cluster (no ETL)."""
    client, report = upload(args, data)
    urls = shard_urls(client, args.bucket, None, prefix="train/")
    print(f"listed {len(urls)} shards in ais://{args.bucket}/train/")
    loader = make_loader(urls, args.batch_size, keys=("__key__", "cls"), num_workers=args.workers,
                         shuffle_buffer=0, require_marker=False)  # source shards carry no ETL end marker
    keys = [key for batch_keys, _ in loader for key in batch_keys]
    duplicates = len(keys) - len(set(keys))
    print(f"read back {len(keys)} samples ({len(set(keys))} distinct) directly, loader errors {loader.errors.count}")
    if len(keys) != report.samples or duplicates or loader.errors.count:
        print(f"error: uploaded {report.samples} samples, read {len(keys)} ({duplicates} repeated)", file=sys.stderr)
        return 1
    return 0


def from_ais(args, data: Path, settings: EtlSettings, wire: dict) -> tuple[EpochUrls, int]:
    """Upload the shards, register (or reuse) the ETL, list the ETL'd URLs through the cluster."""
    client, report = upload(args, data)
    registration = register(client, args.etl_name, settings)
    print(f"ETL {args.etl_name}: {'registered' if registration.created else 'already registered, reused'}")
    urls = shard_urls(client, args.bucket, args.etl_name, prefix="train/")
    return EpochUrls(tuple(urls), wire, seed=args.seed), len(report.classes)


def train(args, urls: EpochUrls, classes: int) -> None:
    loader = make_loader(urls, args.batch_size, keys=("npy;image.npy", "cls"), num_workers=args.workers,
                         shuffle_buffer=64, seed=args.seed, last_batch="drop")
    prefetcher = CudaPrefetcher(loader, depth=2, channels_last=torch.cuda.is_available())
    device = prefetcher.device
    model = getattr(torchvision.models, args.arch)(num_classes=classes).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if args.resume:
        checkpoint = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        torch.set_rng_state(checkpoint["rng"].cpu())
        step = checkpoint["step"]
        prefetcher.load_state_dict(checkpoint["loader"])  # the next pass continues that epoch mid-way
        print(f"resumed from {args.checkpoint} at step {step}: epoch {loader.epoch}, after batch "
              f"{checkpoint['loader']['batches']} of it")
    model.train()
    done, started = step, time.perf_counter()
    print(f"training {args.arch} ({classes} classes) on {device} for {args.steps} steps")
    while step < args.steps:
        epoch, before = loader.epoch, step
        print(f"epoch {epoch}")
        for images, labels in prefetcher:  # one epoch per pass; EpochUrls give new augmentation per epoch
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            rate = (step - done) * args.batch_size / (time.perf_counter() - started)
            batch = f", batch {digest(images, labels)}" if args.log_batches else ""
            print(f"step {step}: loss {loss.item():.3f}, {rate:.1f} img/s, input wait "
                  f"{prefetcher.stats.wait_seconds:.2f}s, loader errors {loader.errors.count}{batch}")
            if args.checkpoint and step % args.checkpoint_every == 0:
                save(args.checkpoint, model, optimizer, step, prefetcher)
            if step == args.steps:
                break
        if step == before:  # every shard failed (logged above): another pass would fail the same way
            raise SystemExit(f"error: epoch {epoch} gave no batch ({loader.errors.count} loader errors so far)")


def save(path: Path, model, optimizer, step: int, prefetcher: CudaPrefetcher) -> None:
    """Model, optimizer, RNG and the loader's state after the last batch trained on, written atomically."""
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                  "step": step, "loader": prefetcher.state_dict()}
    partial = path.with_name(path.name + ".partial")
    torch.save(checkpoint, partial)
    partial.replace(path)
    print(f"checkpoint {path}: step {step}, epoch {checkpoint['loader']['epoch']} after batch "
          f"{checkpoint['loader']['batches']}")


def digest(images: torch.Tensor, labels: torch.Tensor) -> str:
    data = hashlib.sha256(images.float().cpu().numpy().tobytes())
    data.update(labels.cpu().numpy().tobytes())
    return data.hexdigest()[:12]


if __name__ == "__main__":
    sys.exit(main())
