"""``wds-transform inspect``: a shard's summary (members, arrays, labels, errors) and whether it is whole."""

from __future__ import annotations

import collections
import io
import json
import sys

import numpy as np

from .engine import ERROR_MANIFEST_NAME
from .errors import TransformerError
from .integrity import ShardCheck
from .shards import read_samples


def inspect_shard(shard: str, raw: bool = False) -> int:
    """A summary of the shard, read with the service's strict reader, and whether it is whole.

    Printed to stdout (errors to stderr); the exit status: 0 whole, 1 cut short or unreadable, 2 not
    opened. A shard the service wrote ends with its end marker; one without it was cut short, unless
    ``raw`` says it is not an ETL'd shard.
    """
    extensions: collections.Counter[str] = collections.Counter()
    labels: collections.Counter[str] = collections.Counter()
    arrays: collections.Counter[str] = collections.Counter()
    first_array, manifest, members, samples = None, None, 0, 0
    check, failure = ShardCheck(shard), None
    try:
        stream = _open_for_reading(shard)
    except OSError as exc:
        print(f"error: {shard}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        for sample in read_samples(stream, shard, 1 << 40):
            if check.sample(sample):
                continue
            samples += 1
            check.samples += 1
            for member in sample.members:
                info = member.info
                if not info.isfile():
                    continue
                if info.name == ERROR_MANIFEST_NAME:
                    manifest = json.loads(member.data)
                    samples -= 1
                    continue
                members += 1
                base = info.name.rsplit("/", 1)[-1]
                ext = base.partition(".")[2]
                extensions[ext] += 1
                if ext.endswith("cls"):
                    labels[member.data.decode(errors="replace").strip()] += 1
                if ext.endswith("npy"):
                    array = np.load(io.BytesIO(member.data), allow_pickle=False)
                    arrays[f"{ext}: {array.dtype} {tuple(array.shape)}"] += 1
                    if first_array is None:
                        first_array = (info.name, array)
    except TransformerError as exc:
        failure = exc.message
    finally:
        stream.close()
    if failure is not None and not samples and not members:  # not a tar: nothing to summarize
        print(f"error: {failure}", file=sys.stderr)
        return 1
    print(f"{shard}: {samples} samples, {members} members")
    print("  members by extension: " + ", ".join(f"{e or '(none)'} x{n}" for e, n in sorted(extensions.items())))
    for description, count in sorted(arrays.items()):
        print(f"  arrays {description} x{count}")
    if first_array is not None:
        name, array = first_array
        values = array.astype(np.float64)
        print(f"  first array {name}: min {values.min():.3f} max {values.max():.3f} mean {values.mean():.3f}")
    if labels:
        print("  labels: " + _label_summary(labels))
    if manifest:
        print(f"  {len(manifest['errors'])} sample(s) with errors, policy {manifest['policy']}:")
        for error in manifest["errors"][:10]:
            print(f"    {error['key']} ({error['member']}): {error['reason']} -> {error['action']}")
    else:
        print("  no sample errors")
    if failure is None and check.marker is None and raw:
        print("  no end marker: not checked (--raw)")
        return 0
    if failure is None:
        try:
            marker = check.finish()
        except TransformerError as exc:
            failure = f"{exc.message}; cut short, or not written by this ETL (--raw for a shard that is not ETL'd)"
        else:
            print(f"  whole: the end marker matches ({marker['members']} members, {marker['bytes']} bytes; the "
                  f"ETL read {marker['samples_in']} samples, wrote {marker['samples_out']}, skipped "
                  f"{marker['skipped']}, passed {marker['passed_through']} through unchanged)")
            return 0
    print(f"error: {failure}", file=sys.stderr)
    return 1


def _label_summary(labels: dict[str, int], shown: int = 5) -> str:
    """How many labels, how many distinct, and the most common few (all of them when they are few)."""
    total = sum(labels.values())
    common = sorted(labels.items(), key=_most_common_first)[:shown]
    listed = ", ".join(f"{label} x{n}" for label, n in common)
    if len(labels) <= shown:
        return f"{total} ({len(labels)} distinct): {listed}"
    return f"{total} ({len(labels)} distinct); most common: {listed}"


def _most_common_first(item: tuple[str, int]) -> tuple:
    """Sort key: the higher count first; ties in label order, numbers by value (2 before 10)."""
    label, count = item
    return (-count, 0, int(label), "") if label.isdigit() else (-count, 1, 0, label)


def _open_for_reading(shard: str):
    """A local file, or an http(s) URL read with the training client's opener (the service's error text kept)."""
    if shard.startswith(("http://", "https://")):
        from .client.reading import open_shard

        return open_shard(shard)
    return open(shard, "rb")
