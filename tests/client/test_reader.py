"""The one-copy reader: ``.npy`` members read straight into arrays and batch rows hold what ``np.load``
reads from the same bytes, for every dtype, order and header the reader takes or hands to numpy, in
every batching mode; headers parsed inline agree with tarfile's reading."""

from __future__ import annotations

import io
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from webdataset.tariterators import base_plus_ext

from testbed.shardgen import make_tar, npy_bytes, sealed
from transformer.client import ClientError, ErrorCounter, make_loader
from transformer.client.errors import DuplicateMember
from transformer.client.reading import MalformedMember, shard_samples, split_key
from transformer.wire import plain_file, plain_member, ustar_header

ARRAYS = {
    "u8": np.arange(3 * 5 * 7, dtype=np.uint8).reshape(3, 5, 7),
    "big": np.random.default_rng(0).random((3, 64, 64), dtype=np.float32),  # 48 KB: past a read chunk
    "f16": np.linspace(-1, 1, 12, dtype=np.float16).reshape(3, 4),
    "scalar": np.array(7, dtype=np.int64),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "fortran": np.asfortranarray(np.arange(20, dtype=np.float64).reshape(4, 5)),
    "bigendian": np.arange(6, dtype=">f4").reshape(2, 3),
    "bool": np.array([True, False, True]),
    "complex": np.array([1 + 2j, 3 - 4j], dtype=np.complex64),  # not a memoryview format: read another way
    "record": np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i2"), ("b", "<f8")]),
}


def shard_of(members: list[tuple[str, bytes]]) -> bytes:
    return sealed(make_tar(members))


def test_arrays_are_what_np_load_reads() -> None:
    members = [(f"{name}.npy", npy_bytes(array)) for name, array in ARRAYS.items()]
    members.append(("v2.npy", npy_bytes(ARRAYS["u8"], version=(2, 0))))  # handed to np.load as bytes
    members.append(("object.npy", npy_bytes(np.array([{"a": 1}], dtype=object))))  # np.load refuses it
    members.append(("x" * 120 + ".npy", npy_bytes(ARRAYS["f16"])))  # a pax header: tarfile reads it
    data = shard_of(members)
    as_bytes = {s["__key__"]: s["npy"] for s in shard_samples(io.BytesIO(data), "s.tar")}
    as_arrays = {s["__key__"]: s["npy"] for s in shard_samples(io.BytesIO(data), "s.tar", arrays=True)}
    assert as_bytes.keys() == as_arrays.keys() == {name.rsplit(".", 1)[0] for name, _ in members}
    for key, raw in as_bytes.items():
        got = as_arrays[key]
        if key in ("v2", "object"):
            assert got == raw  # bytes, for webdataset's decoder (np.load) to read or refuse
            continue
        want = np.load(io.BytesIO(raw))
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, key
        assert np.array_equal(got, want) and got.flags.f_contiguous == want.flags.f_contiguous, key


def test_a_sample_with_two_members_of_one_extension_is_a_client_error_by_name() -> None:
    data = shard_of([("a.cls", b"1"), ("a.cls", b"2"), ("b.cls", b"3")])
    with pytest.raises(DuplicateMember, match=r"s\.tar: sample 'a' has two 'cls' members") as raised:
        list(shard_samples(io.BytesIO(data), "s.tar"))
    assert isinstance(raised.value, ClientError) and isinstance(raised.value, ValueError)
    assert (raised.value.key, raised.value.extension) == ("a", "cls")


@pytest.mark.parametrize("change", [+8, -8])
def test_an_array_whose_size_is_not_its_headers_is_refused_by_name(tmp_path: Path, change: int) -> None:
    good = npy_bytes(ARRAYS["u8"])
    bad = good + b"\0" * change if change > 0 else good[:change]
    data = shard_of([("a.npy", good), ("a.cls", b"1"), ("b.npy", bad), ("b.cls", b"2"), ("c.npy", good),
                     ("c.cls", b"3")])
    samples = list(shard_samples(io.BytesIO(data), "s.tar", arrays=True))
    assert isinstance(samples[1]["npy"], MalformedMember)  # the shard goes on: only that sample is bad
    path = tmp_path / "s.tar"
    path.write_bytes(data)
    errors = ErrorCounter(log_first=0, max_errors=0)
    loader = make_loader([str(path)], 4, keys=("npy", "cls"), num_workers=0, shuffle_buffer=0, errors=errors)
    with pytest.raises(Exception, match=r"s\.tar: sample 'b': 'npy' holds \d+ bytes of array data, its \.npy "
                                        r"header \(3, 5, 7\) uint8 says 105"):
        list(loader)


def labelled_shards(folder: Path, shards: int, per_shard: int, shape=(3, 6, 5), both: bool = False) -> list[str]:
    """``<key>.npy`` filled with the sample's number (and ``<key>.image.npy`` with its negative when
    ``both``, in either order), ``<key>.cls`` the number."""
    urls = []
    for s in range(shards):
        members = []
        for i in range(s * per_shard, (s + 1) * per_shard):
            key = f"k{i:05d}"
            image = npy_bytes(np.full(shape, i, np.float32))
            own = [(f"{key}.npy", image)]
            if both:
                other = (f"{key}.image.npy", npy_bytes(np.full(shape, -i, np.float32)))
                own = [other, *own] if i % 2 else [*own, other]
            members += [(f"{key}.cls", b"%d" % i), *own]
        path = folder / f"s{s}.tar"
        path.write_bytes(shard_of(members))
        urls.append(str(path))
    return urls


@pytest.mark.parametrize("buffer", [0, 7])
@pytest.mark.parametrize("last_batch", ["partial", "drop", "pad"])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_batch_row_holds_its_own_samples_array(tmp_path: Path, buffer: int, last_batch: str,
                                                     workers: int) -> None:
    urls = labelled_shards(tmp_path, 3, 9, both=True)
    loader = make_loader(urls, 4, keys=("npy;image.npy", "cls", "__key__"), num_workers=workers,
                         shuffle_buffer=buffer, last_batch=last_batch, seed=2)
    labels = []
    for batch in loader:
        images, classes, keys = batch[:3]
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 6, 5)
        real = int(batch[3].sum()) if last_batch == "pad" else len(keys)
        for image, label, key in zip(images[:real], classes[:real].tolist(), keys[:real]):
            assert key == f"k{label:05d}" and torch.equal(image, torch.full((3, 6, 5), float(label)))  # npy first
        if last_batch == "pad":
            assert all(torch.equal(images[j], images[real - 1]) for j in range(real, 4))
        labels += classes[:real].tolist()
    if last_batch == "drop":
        assert len(labels) == sum(n - n % 4 for n in ([27] if workers == 0 else [18, 9]))
    else:
        assert sorted(labels) == list(range(27))
    assert loader.errors.count == 0


def test_the_one_copy_batch_is_what_np_load_and_stack_give(tmp_path: Path) -> None:
    urls = labelled_shards(tmp_path, 2, 5)
    loader = make_loader(urls, 3, keys=("npy", "cls"), num_workers=0, shuffle_buffer=0, shuffle_shards=False)
    got = [images for images, _ in loader]
    arrays = [np.load(io.BytesIO(s["npy"])) for url in urls for s in shard_samples(open(url, "rb"), url)]
    want = [torch.from_numpy(np.stack(arrays[i:i + 3])) for i in range(0, len(arrays), 3)]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_inline_header_reads_as_tarfile_does() -> None:
    for name, size, mode, mtime in [("a.npy", 0, 0o644, 0), ("dir/b.cls", 150656, 0o600, 1_700_000_000),
                                    ("c" * 99, 8**11 - 1, 0o7777, 8**11 - 1)]:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, mode, mtime
        block = ustar_header(info)
        assert plain_member(block) == (name, size) == (plain_file(block, 0).name, plain_file(block, 0).size)
        assert tarfile.TarInfo.frombuf(block, "utf-8", "strict").size == size
        broken = block[:148] + b"0000000\0" + block[156:]  # a wrong checksum: tarfile's to refuse
        assert plain_member(broken) is None and plain_file(broken, 0) is None
        gnu = block[:257] + tarfile.GNU_MAGIC + block[265:]
        assert plain_member(gnu) is None
        devices = block[:329] + b"0000001\0" + block[337:]  # device numbers: tarfile's
        assert plain_member(devices) is None
    for name in ["p" * 120 + "/q.npy", "ünï/çödé.cls"]:  # a ustar name prefix; utf-8 bytes
        info = tarfile.TarInfo(name)
        info.size = 5
        block = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
        assert plain_member(block) == (name, 5) == (tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape").name, 5)


@pytest.mark.parametrize("name", ["a.cls", "sample-000001.image.npy", "dir/sub/k.x.y", "d.e/k.npy", "k", "k.",
                                  ".hidden", "a/.b", "a.b/.c", "x/y", "a.b/c", "/.c", "a\nb/c.d", "a/b\nc.d",
                                  "é/ü.npy", "a..b", "__etl__/end.json", ""])
def test_keys_split_as_webdataset_splits_them(name: str) -> None:
    assert split_key(name) == base_plus_ext(name)


def scattered(count: int, size: int, samples: int) -> tuple[list[list[int]], list]:
    """Samples 0, 1, ... through a ``Batcher`` of ``count`` open batches, each one's array read into
    the row ``place`` gives (as the reader does): the batches' labels, and the batches."""
    from transformer.client.batching import Batcher
    from transformer.client.stream import generator_key

    batcher = Batcher(size, ("npy", "cls"), "partial", count, generator_key("test"))
    batches = []
    for label in range(samples):
        fields = {"__key__": f"k{label}"}
        row = batcher.place(fields, "npy", (2,), np.dtype(np.int64))
        row[:] = label  # the reader's readinto
        batch = batcher.add((row, label), (0, label, f"k{label}"))
        if batch is not None:
            batches.append(batch)
    batches += list(batcher.drain())
    return [batch[1].tolist() for batch in batches], batches


def test_open_batches_shuffle_without_copying_and_end_whole() -> None:
    labels, batches = scattered(16, 64, 8000)
    assert sorted(label for batch in labels for label in batch) == list(range(8000))
    assert [len(batch) for batch in labels] == [64] * 125  # the open batches end as whole batches
    for (images, _), batch in zip(batches, labels):  # each row holds its own sample's array
        assert images.tolist() == [[label, label] for label in batch]
    order = [label for batch in labels for label in batch]
    displacement = np.abs(np.array(order) - np.arange(8000))
    assert 200 < displacement.mean() < 2000  # mixed over about a thousand samples, as a 1000-sample buffer
    assert min(labels[0]) < 64 and max(labels[0]) > 400  # the first batch leaves after hundreds of samples
    position = {label: index for index, label in enumerate(order)}
    together = sum(position[n + 1] // 64 == position[n] // 64 for n in range(0, 8000, 7))
    assert together < 0.2 * len(range(0, 8000, 7))  # neighbours in the stream rarely share a batch
    in_order, _ = scattered(1, 64, 200)  # one open batch: the stream's order
    assert [label for batch in in_order for label in batch] == list(range(200))


def test_a_batch_array_is_reused_only_once_nothing_refers_to_it() -> None:
    from transformer.client.batchmemory import Recycler

    recycler = Recycler(keep=2)
    array = np.zeros((4, 3), np.float32)
    tensor = torch.from_numpy(array)
    row, part = array[1], tensor[:2]
    recycler.give(array, -1)
    del array
    assert recycler._take((4, 3), np.dtype(np.float32)) is None  # the tensor, a row and a slice refer to it
    del tensor, row
    assert recycler._take((4, 3), np.dtype(np.float32)) is None  # the slice still does
    del part
    assert recycler._take((4, 3), np.dtype(np.int64)) is None  # another dtype
    reused = recycler._take((4, 3), np.dtype(np.float32))
    assert reused is not None and reused.shape == (4, 3) and recycler._take((4, 3), np.dtype(np.float32)) is None


def received(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """The main process's own mapping of a worker's shared-memory segment, as torch.multiprocessing
    rebuilds a batch it receives: the worker's storage object is not the one the consumer gets."""
    fd, size = storage._share_fd_cpu_()
    return torch.UntypedStorage._new_shared_fd_cpu(fd, size)


def _send_one_batch(flags: torch.Tensor, queue, done) -> None:
    """A DataLoader worker's part, in a process of its own: a batch written into a shared-memory slot of
    its own, sent to the main process (torch sends the segment, not a copy), kept until told to stop."""
    from transformer.client.batchmemory import SharedSlots

    slots = SharedSlots(flags[1].numpy())
    slot, storage = slots.take(4 * 12)
    queue.put((torch.empty(0).set_(storage, 0, (4, 3)).fill_(7), slot))
    done.wait(60)


def test_a_shared_slot_is_handed_back_only_once_nothing_refers_to_it() -> None:
    """The main process's side of a worker's shared-memory batches (Lent), with a batch from another
    process as a DataLoader's: its slot is free again (flag 0) only when no tensor, slice, view or numpy
    array over its storage is left in this process; a batch that arrived as a copy (pinned memory) frees
    its slot at once. A worker's slots (SharedSlots) take a free one again, the same segment."""
    import multiprocessing

    from transformer.client.batchmemory import Lent, SharedSlots

    flags = torch.zeros((2, 3), dtype=torch.int8).share_memory_()
    context = multiprocessing.get_context("fork")
    queue, done = context.Queue(), context.Event()
    worker = context.Process(target=_send_one_batch, args=(flags, queue, done))
    worker.start()
    try:
        images, slot = queue.get(timeout=60)
        assert slot == 0 and flags[1, 0] == 1 and images.is_shared() and images.sum() == 84
        lent = Lent(flags)
        lent.receive((images, torch.arange(4)), 1, ((0, 0),))
        still = [images[1], images[:2], images.numpy()]  # a row, a slice, a numpy view
        del images
        while still:
            lent.hand_back()
            assert flags[1, 0] == 1, f"handed back while {len(still)} of them still refer to it"
            still.pop()
        lent.hand_back()
        assert flags[1, 0] == 0
    finally:
        done.set()
        worker.join(60)
    lent.receive((torch.zeros(4, 3), None), 1, ((1, 1),))  # a copy (pin_memory): its slot is free at once
    assert flags[1, 1] == 0

    flags.zero_()
    slots = SharedSlots(flags[1].numpy())
    first, storage = slots.take(4 * 12)
    assert first == 0 and flags[1, 0] == 1
    assert slots.take(4 * 12)[0] == 1  # slot 0 is held: another one
    flags[1, 0] = 0  # handed back (Lent)
    again, reused = slots.take(4 * 12)
    assert again == 0 and reused.data_ptr() == storage.data_ptr()  # the same segment, filled again
    assert slots.take(4 * 20)[0] == 2  # another size: the free slot gets a segment of its own
    assert slots.take(4 * 20)[0] == -1  # every slot held: a segment that is not kept


@pytest.mark.parametrize("how", ["untyped_storage", "storage", "storage slice"])
def test_a_shared_slot_whose_storage_object_is_kept_is_not_handed_back(how: str) -> None:
    """The storage object a consumer gets from ``untyped_storage()`` (or inside ``storage()``) is the very
    object Lent holds, so torch's count of references reads as if Lent alone held it: the slot stays
    held until the consumer lets it go too."""
    from transformer.client.batchmemory import Lent, SharedSlots

    flags = torch.zeros((1, 2), dtype=torch.int8).share_memory_()
    slots = SharedSlots(flags[0].numpy())
    slot, storage = slots.take(4 * 12)
    images = torch.empty(0).set_(received(storage), 0, (4, 3))
    del storage
    lent = Lent(flags)
    lent.receive((images,), 0, ((0, slot),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # storage(): TypedStorage is deprecated
        kept = KEPT[how](images)
    del images
    lent.hand_back()
    assert flags[0, slot] == 1
    del kept
    lent.hand_back()
    assert flags[0, slot] == 0


KEPT = {
    "untyped_storage": lambda images: images.untyped_storage(),
    "storage": lambda images: images.storage(),
    "storage slice": lambda images: images.untyped_storage()[8:],
    "view": lambda images: images[1:],
    "numpy": lambda images: images.numpy(),
    "dlpack": lambda images: torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(images)),
}


@pytest.mark.parametrize("how", KEPT)
def test_memory_of_a_batch_kept_in_any_form_is_never_filled_again(tmp_path: Path, how: str) -> None:
    """Whatever the consumer keeps of a batch from a worker (its storage alone, a view, a numpy array),
    its bytes stay as they were while the rest of the epoch is read through the same few slots."""
    urls = labelled_shards(tmp_path, 4, 30)
    loader = make_loader(urls, 3, keys=("npy", "cls"), num_workers=2, shuffle_buffer=0, seed=1)
    kept = before = None
    for images, _ in loader:
        if kept is None:
            before = images.clone()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # storage(): TypedStorage is deprecated
                kept = KEPT[how](images)
        del images  # the consumer keeps only what KEPT took
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        after = KEPT[how](before)
    if isinstance(kept, torch.TypedStorage):
        kept, after = kept.untyped(), after.untyped()
    if isinstance(kept, torch.UntypedStorage):
        assert bytes(kept) == bytes(after)
    else:
        assert torch.equal(torch.as_tensor(kept), torch.as_tensor(after))


def test_worker_batches_reuse_their_shared_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker writes its batches into shared memory it keeps: batches let go come back to the same
    few slots (torch sends them without a copy), and each batch still holds its own samples. Without
    pinning: with CUDA present, ``make_loader`` pins by default, and a pinned batch is a copy."""
    from transformer.client import loader as loader_module

    seen: list[tuple[int, int]] = []
    receive = loader_module.Lent.receive

    def spy(self, batch, worker, slots):
        seen.extend((worker, slot) for _, slot in slots)
        return receive(self, batch, worker, slots)

    monkeypatch.setattr(loader_module.Lent, "receive", spy)
    urls = labelled_shards(tmp_path, 4, 30)
    loader = make_loader(urls, 3, keys=("npy", "cls"), num_workers=2, shuffle_buffer=9, seed=1, pin_memory=False)
    labels_seen = []
    for images, labels in loader:
        assert images.is_shared()
        for image, label in zip(images, labels.tolist()):
            assert torch.equal(image, torch.full((3, 6, 5), float(label)))
        labels_seen.extend(labels.tolist())
    assert sorted(labels_seen) == list(range(120))
    assert len(seen) == 40 and all(slot >= 0 for _, slot in seen)
    assert len(set(seen)) < len(seen) / 2, sorted(set(seen))  # reused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_hold_their_samples_and_hand_their_slots_back_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """With CUDA present ``make_loader`` pins by default: each batch arrives as a pinned copy of the
    worker's shared memory, in make_loader's batch type, and its slot is free for the worker again at once."""
    from transformer.client import loader as loader_module

    held: list[int] = []
    receive = loader_module.Lent.receive

    def spy(self, batch, worker, slots):
        receive(self, batch, worker, slots)
        held.extend(int(self.flags[worker, slot]) for _, slot in slots)

    monkeypatch.setattr(loader_module.Lent, "receive", spy)
    urls = labelled_shards(tmp_path, 4, 30)
    loader = make_loader(urls, 3, keys=("npy", "cls", "__key__"), num_workers=workers, shuffle_buffer=9, seed=1)
    kept = list(loader)  # every batch held: none may change while the workers go on
    assert sorted(label for batch in kept for label in batch[1].tolist()) == list(range(120))
    for batch in kept:
        images, labels, keys = batch
        assert type(batch) is tuple and images.is_pinned() and labels.is_pinned() and not images.is_shared()
        for image, label, key in zip(images, labels.tolist(), keys):
            assert key == f"k{label:05d}" and torch.equal(image, torch.full((3, 6, 5), float(label)))
    assert len(held) == (40 if workers else 0) and not any(held)  # every slot handed back as its batch arrived


def test_without_torchs_private_storage_calls_workers_send_batches_through_torchs_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared slots rest on two private torch calls; without them the loader still works, through
    torch's own copy of each batch (as before the slots), with nothing to hand back."""
    from transformer.client import loader as loader_module

    monkeypatch.setattr(loader_module, "SHARED_SLOTS", False)
    urls = labelled_shards(tmp_path, 2, 12)
    loader = make_loader(urls, 4, keys=("npy", "cls"), num_workers=2, shuffle_buffer=8, seed=3)
    kept = list(loader)
    assert loader.streams.flags is None
    assert sorted(label for _, labels in kept for label in labels.tolist()) == list(range(24))
    for images, labels in kept:
        for image, label in zip(images, labels.tolist()):
            assert torch.equal(image, torch.full((3, 6, 5), float(label)))


@pytest.mark.parametrize("buffer", [0, 9])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_the_consumer_keeps_stay_as_they_were(tmp_path: Path, buffer: int, workers: int) -> None:
    urls = labelled_shards(tmp_path, 4, 10)
    loader = make_loader(urls, 3, keys=("npy", "cls"), num_workers=workers, shuffle_buffer=buffer, seed=1)
    kept = list(loader)  # every batch held until the end: none may be filled again
    assert sorted(label for _, labels in kept for label in labels.tolist()) == list(range(40))
    for images, labels in kept:
        for image, label in zip(images, labels.tolist()):
            assert torch.equal(image, torch.full((3, 6, 5), float(label)))
    dropped = [(images.clone(), labels) for images, labels in loader]  # each batch let go at once: reused
    assert sorted(label for _, labels in dropped for label in labels.tolist()) == list(range(40))
    for images, labels in dropped:
        for image, label in zip(images, labels.tolist()):
            assert torch.equal(image, torch.full((3, 6, 5), float(label)))
