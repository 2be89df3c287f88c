"""Batching: each sample read straight into a row of a batch tensor, several batches open at once.

``_Batch`` is one batch being filled: its arrays' columns are batch tensors (``batchmemory``), the
other columns are combined as webdataset combines them. ``Batcher`` keeps several batches open and
sends each sample to one drawn at random: the loader's shuffle, without a second copy of a sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from webdataset.filters import combine_values

from .batchmemory import Recycler, SharedSlots
from .errors import ClientError
from .stream import draw

if TYPE_CHECKING:
    import torch  # the batch tensors come from batchmemory


class _Batch:
    """One batch of ``size`` tuples being filled: array columns go into batch tensors allocated per
    batch, other columns are combined as webdataset's ``default_collation_fn`` does (ints -> a numpy
    array, str -> a list). ``ids`` names each row's sample (URL index, position in its shard, key).

    ``place`` gives the reader the next row for an ``.npy`` member, so its array is read from the
    stream straight into the batch tensor; an array read elsewhere is copied into its row by ``add``.
    ``last_batch``: ``partial`` (a shorter last batch), ``drop``, or ``pad`` (the last row repeated,
    and a bool ``valid`` array appended to every batch).
    """

    def __init__(self, size: int, keys: Sequence[str], last_batch: str, recycler: Recycler | None = None):
        self.size = size
        self.last_batch = last_batch
        self.recycler = recycler or Recycler(0)
        self.width = len(keys)
        self.column: dict[str, int] = {}  # extension -> the column it may fill
        for index, key in enumerate(keys):
            for name in key.split(";"):
                self.column.setdefault(name, index)
        self._fresh()

    def _fresh(self) -> None:
        self.rows = 0
        self.ids: list[tuple] = []
        self.tensors: list[torch.Tensor | None] = [None] * self.width
        self.views: list[np.ndarray | None] = [None] * self.width  # numpy views of the tensors
        self.kinds: list[tuple | None] = [None] * self.width  # their rows' (shape, dtype)
        self.lists: list[list] = [[] for _ in range(self.width)]  # the other columns' values
        self.placed: list[np.ndarray | None] = [None] * self.width  # the rows handed to the reader
        self.slots: list[int] = [-1] * self.width  # the tensors' shared-memory slots (-1: none)
        self._sample: dict | None = None
        self._given = 0  # the columns handed out for the sample being read, as bits

    def _allocate(self, column: int, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
        """The column's batch tensor, made for arrays of ``shape`` and ``dtype``; None for a dtype
        torch does not hold (the column is then combined by numpy, as before)."""
        if self.views[column] is not None:  # made for another first row: given back
            self.recycler.give(self.views[column], self.slots[column])
        self.tensors[column] = self.views[column] = self.kinds[column] = None
        self.slots[column] = -1
        if not dtype.isnative:
            return None
        made = self.recycler.array((self.size, *shape), dtype)
        if made is None:
            return None
        self.tensors[column], self.views[column], self.slots[column] = made
        self.kinds[column] = (shape, dtype)
        return self.views[column]

    def place(self, fields: dict, extension: str, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
        column = self.column.get(extension)
        if column is None:
            return None
        if fields is not self._sample:
            self._sample, self._given = fields, 0
        elif self._given >> column & 1:
            return None  # another member of this sample got the row (keys "a;b": the one picked decides)
        if self.kinds[column] != (shape, dtype) and (self.rows or self._allocate(column, shape, dtype) is None):
            return None  # the batch's first row decides its rows' shape and dtype
        self._given |= 1 << column
        place = self.placed[column] = self.views[column][self.rows]
        return place

    def add(self, values: tuple, identity: tuple | None) -> None:
        """Take one sample's values into the next row."""
        row = self.rows
        for column, value in enumerate(values):
            if type(value) is np.ndarray:
                if value is self.placed[column]:
                    continue  # read into its row already
                view = self.views[column]
                fits = self.kinds[column] == (value.shape, value.dtype)
                if not fits and not row:  # the batch's first row decides (a row handed out may not)
                    view = self._allocate(column, value.shape, value.dtype)
                elif not fits and view is not None:
                    raise ClientError(f"batch column {column}: a {value.dtype} array of shape {value.shape}, "
                                      f"the batch's are {view.dtype} {view.shape[1:]}")
                if view is not None:
                    view[row] = value
                    continue
            elif self.views[column] is not None:
                if row:
                    raise ClientError(f"batch column {column}: a {type(value).__name__}, the batch's are arrays")
                self.recycler.give(self.views[column], self.slots[column])
                self.tensors[column] = self.views[column] = self.kinds[column] = None
                self.slots[column] = -1
            self.lists[column].append(value)
        self.rows = row + 1
        self.ids.append(identity)
        self._sample = None

    def last_row(self) -> tuple:
        """The last row's values (views of the batch tensors) and its sample."""
        row = self.rows - 1
        values = tuple(self.views[c][row] if self.views[c] is not None else self.lists[c][row]
                       for c in range(self.width))
        return values, self.ids[row]

    def drop_last_row(self) -> None:
        self.rows -= 1
        self.ids.pop()
        for values in self.lists:
            if values:
                values.pop()

    def finish(self) -> tuple | None:
        """The last, incomplete batch as ``last_batch`` says (None: none)."""
        real = self.rows
        if not real or self.last_batch == "drop":
            self.release()
            return None
        if self.last_batch == "partial":
            return self.take(real)
        for column in range(self.width):
            if self.tensors[column] is not None:
                self.tensors[column][real:] = self.tensors[column][real - 1]
            else:
                self.lists[column].extend([self.lists[column][-1]] * (self.size - real))
        return self.take(self.size, real)

    def take(self, rows: int, real: int | None = None) -> tuple:
        """The batch's columns; the batch starts again, empty."""
        columns = []
        for column in range(self.width):
            tensor = self.tensors[column]
            if tensor is not None:
                columns.append(tensor if rows == self.size else tensor[:rows])
            else:
                columns.append(combine_values(self.lists[column]))  # webdataset's: as before
        if self.last_batch == "pad":
            valid = np.zeros(self.size, dtype=bool)
            valid[:self.size if real is None else real] = True
            columns.append(valid)
        self.recycler.sent = [(column, slot) for column, slot in enumerate(self.slots) if slot >= 0]
        self.slots = [-1] * self.width  # handed out: the main process gives these slots back
        self.release()
        return tuple(columns)

    def release(self) -> None:
        """Start again, empty; the batch arrays go to the recycler (reused once no one holds them)."""
        given = [(view, slot) for view, slot in zip(self.views, self.slots) if view is not None]
        self._fresh()
        for view, slot in given:
            self.recycler.give(view, slot)


class Batcher:
    """Batches built while samples arrive, shuffled without copying: ``count`` batches are open at once
    and each sample joins one of them, drawn at random (counter-based draws, as the shuffle buffer's),
    its arrays read from the stream straight into their rows; a batch leaves once it is full. One open
    batch: no shuffle, the samples in stream order.

    A buffer that picks samples in random order keeps each one in an array of its own and copies it
    into its batch row when it is picked, about a thousand samples later: its bytes are out of every
    cache by then, and the copy costs about as much as reading the sample (``python -m bench.reader``).
    Here a sample costs the one copy from the stream; batches mix samples from a window of about
    ``count x size`` samples, about as well as a picking buffer of half as many (``bench.reader``'s
    mixing table).

    At the end of the stream the open batches' rows are gathered into whole batches: the last row of
    the last open batch moves into the first one until it is full (``drain``). The state between two
    batches is the stream's and, per open batch, which samples its rows hold (``snapshot``).
    """

    def __init__(self, size: int, keys: Sequence[str], last_batch: str, count: int, key: bytes,
                 slots: SharedSlots | None = None):
        self.size = size
        self.recycler = Recycler(keep=(count + 4) * len(keys), slots=slots)  # the open batches' and a few more
        self.batches = [_Batch(size, keys, last_batch, self.recycler) for _ in range(count)]
        self.key = key
        self.draws = 0  # samples taken, each by a draw of its batch
        self._target: _Batch | None = None

    def _choose(self) -> _Batch:
        """The open batch the next sample joins (the same until it is added: a sample that fails on
        the way leaves its row to the next one)."""
        if self._target is None:
            batches = self.batches
            self._target = batches[0] if len(batches) == 1 else batches[draw(self.key, self.draws, len(batches))]
        return self._target

    def place(self, fields: dict, extension: str, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
        return self._choose().place(fields, extension, shape, dtype)

    def add(self, values: tuple, identity: tuple | None) -> tuple | None:
        """Take one sample's values; a batch once one is full."""
        target = self._choose()
        target.add(values, identity)
        self.draws += 1
        self._target = None
        return target.take(self.size) if target.rows == self.size else None

    def drain(self) -> Iterator[tuple]:
        """At the end of the stream: the rows still open, as whole batches, then the last one as
        ``last_batch`` says."""
        while True:
            open_ = [batch for batch in self.batches if batch.rows]
            if not open_:
                return
            target = open_[0]
            while target.rows < self.size and len(open_) > 1:
                source = open_[-1]
                values, identity = source.last_row()
                target.add(values, identity)  # copied into the target's row
                source.drop_last_row()
                if not source.rows:
                    source.release()
                    open_.pop()
            if target.rows < self.size:
                batch = target.finish()
                if batch is not None:
                    yield batch
                return
            yield target.take(self.size)

    def snapshot(self) -> dict[str, Any]:
        """The open batches' samples (``buffer``, in order; ``open``: rows per batch) and the draws."""
        return {"draws": self.draws, "buffer": [list(identity) for batch in self.batches for identity in batch.ids],
                "open": [batch.rows for batch in self.batches]}

    def restore(self, state: dict[str, Any], held: dict[tuple[int, int], tuple]) -> None:
        """Fill the open batches again with the samples a snapshot names (read again: ``held`` maps
        (URL index, position) to the sample's values); one that could not be read is left out."""
        self.draws = state["draws"]
        entries = iter(state["buffer"])
        for batch, rows in zip(self.batches, state["open"]):
            for index, position, key in (next(entries) for _ in range(rows)):
                values = held.get((index, position))
                if values is not None:
                    batch.add(values, (index, position, key))
