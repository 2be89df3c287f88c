"""Inline reads through the real proxy and targets: the loader gets every sample of every shard once,
the three communication types give the same bytes, odd object names and a bucket in a namespace
work, and a loader resumes mid-epoch exactly."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch

from testbed.etl_cluster import EtlCluster
from testbed.shardgen import read_output
from transformer.client import ErrorCounter, make_loader, shard_urls

from .conftest import owner_of, put_shards

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]
COMMS = ("hpush", "hpull", "ws")
SHARDS = [f"train-{i:04d}.tar" for i in range(8)]
SAMPLES = 6
ARGS = {"seed": 11, "dtype": "uint8"}


@pytest.fixture(scope="module")
def inline(etl_client, etls: dict[str, str]) -> dict[str, str]:
    """A bucket of 8 shards over both targets; the package's ETL of each communication type."""
    put_shards(etl_client, "inline-src", SHARDS, SAMPLES)
    return etls


def test_shards_spread_over_both_targets(etl_cluster: EtlCluster, inline) -> None:
    assert {owner_of(etl_cluster, "inline-src", name) for name in SHARDS} == {0, 1}


def sample_ids(batches) -> list[tuple[int, int]]:
    ids = []
    for batch in batches:
        for raw in batch[2]:
            info = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
            ids.append((info["shard"], info["sample"]))
    return ids


@pytest.mark.parametrize("comm", COMMS)
def test_loader_delivers_every_sample_of_every_shard_once(etl_client, inline, comm: str) -> None:
    urls = shard_urls(etl_client, "inline-src", inline[comm], prefix="", etl_args=ARGS)
    assert len(urls) == len(SHARDS)
    errors = ErrorCounter()
    loader = make_loader(urls, batch_size=5, keys=("npy", "cls", "json"), num_workers=2, shuffle_buffer=8,
                         seed=3, errors=errors)
    batches = list(loader)
    ids = sample_ids(batches)
    assert errors.count == 0
    assert Counter(ids) == Counter(itertools.product(range(len(SHARDS)), range(SAMPLES)))
    images = torch.cat([batch[0] for batch in batches])
    assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, 224, 224)


def read_through(client, bucket: str, name: str, etl: str, namespace=None, args=ARGS) -> bytes:
    from aistore.sdk.etl import ETLConfig

    handle = client.bucket(bucket, namespace=namespace) if namespace is not None else client.bucket(bucket)
    return handle.object(name).get_reader(etl=ETLConfig(etl, args=json.dumps(args))).read_all()


def test_comm_types_give_byte_identical_output(etl_client, inline) -> None:
    for shard in SHARDS[:3]:
        outputs = {comm: read_through(etl_client, "inline-src", shard, inline[comm]) for comm in COMMS}
        assert outputs["hpush"] == outputs["hpull"] == outputs["ws"], shard
        members = read_output(outputs["hpush"])  # whole: the end marker matches
        assert sum(name.endswith(".npy") for name, _ in members) == SAMPLES


ODD = ["with space.tar", "hash#1.tar", "pct%41 and %zz.tar", "ünï©ødé/文字.tar", "q?x=1.tar"]


def test_odd_names_in_a_namespaced_bucket(etl_client, inline) -> None:
    from aistore.sdk.types import Namespace

    team = Namespace(name="team")
    shards = put_shards(etl_client, "odd-names", ODD, 3, namespace=team)
    expected = {}
    for name in ODD:
        expected[name] = read_through(etl_client, "odd-names", name, inline["hpull"], namespace=team)
        assert sum(n.endswith(".npy") for n, _ in read_output(expected[name])) == 3, name
        assert read_through(etl_client, "odd-names", name, inline["ws"], namespace=team) == expected[name], name
    assert set(shards) == set(expected)



def test_hpush_odd_names_are_exact_or_refused(etl_client, inline) -> None:
    """hpush gets the raw object name in its URL (AIS does not escape it): spaces and non-ASCII arrive
    intact; '#', a bad '%' and '?' cut or break the URL, and each ends in an error, never in a shard
    transformed without its etl_args."""
    from aistore.sdk.errors import AISError
    from aistore.sdk.types import Namespace

    team = Namespace(name="team")
    put_shards(etl_client, "odd-names", ODD, 3, namespace=team)
    for name in ("with space.tar", "ünï©ødé/文字.tar"):
        hpull = read_through(etl_client, "odd-names", name, inline["hpull"], namespace=team)
        assert read_through(etl_client, "odd-names", name, inline["hpush"], namespace=team) == hpull, name
    refused = {"hash#1.tar": (422, "shard 'odd-names/hash': not a tar archive (empty file)"),
               "pct%41 and %zz.tar": (400, "invalid URL escape"),
               "q?x=1.tar": (400, "the object name holds a '?'")}
    for name, (status, text) in refused.items():
        with pytest.raises(AISError) as caught:
            read_through(etl_client, "odd-names", name, inline["hpush"], namespace=team)
        assert caught.value.status_code == status and text in caught.value.message, (name, caught.value)


@pytest.mark.parametrize("comm", ["hpush", "ws"])
def test_resume_mid_epoch_through_the_real_target(etl_client, inline, comm: str) -> None:
    """A checkpoint inside a shard, samples in the shuffle buffer: the resumed run's batches are the
    uninterrupted run's, bit for bit (random crops and flips seeded per epoch through etl_args)."""
    from tests.client.test_resume import RANDOM, assert_same, mid_shard_with_buffer, resumed, stopped
    from transformer.client import EpochUrls

    urls = EpochUrls(tuple(shard_urls(etl_client, "inline-src", inline[comm], prefix="")), RANDOM, seed=21)
    options = {"batch_size": 4, "keys": ("npy", "cls", "__key__")}
    whole = list(make_loader(urls(1), num_workers=2, shuffle_buffer=4, seed=3, epoch=1, **options))
    assert len({key for batch in whole for key in batch[2]}) == len(SHARDS) * SAMPLES
    head, state = stopped(urls, 3, **options)
    assert mid_shard_with_buffer(state), state
    assert_same(head + resumed(urls, state, **options), whole)
