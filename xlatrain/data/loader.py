"""grain pipelines for training and eval, and a device loader that prefetches sharded batches.

Training batches are laid out [microbatches, global_batch / microbatches, ...] so the compiled step
scans over the leading axis ([steps, microbatches, ...] when steps are fused); each process reads its
own slice of every global batch. Variable-length examples are padded per batch to a bucket length.
"""

from __future__ import annotations

import queue
import threading
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import grain
import jax
import numpy as np

from xlatrain.data.sources import Dataset, Source
from xlatrain.mesh import eval_batch_sharding, process_row_block, train_batch_sharding

Batch = dict[str, Any]


def train_iterator(source: Source, *, seed: int, shuffle: bool, local_batch: int, block: int,
                   blocks: int, buckets: tuple[int, ...] | None = None) -> grain.DatasetIterator:
    """An endless, epoch-reshuffled iterator of this process's batches; its state is checkpointable."""
    dataset = grain.MapDataset.source(source)
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    dataset = _batches(dataset.repeat(), local_batch, block, blocks, buckets)
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))


def eval_batches(source: Source, *, local_batch: int, max_batches: int, block: int,
                 blocks: int, buckets: tuple[int, ...] | None = None) -> list[Batch]:
    """The first `max_batches` held-out batches of this process, in a fixed order."""
    dataset = _batches(grain.MapDataset.source(source), local_batch, block, blocks, buckets)
    return [dataset[i] for i in range(min(max_batches, len(dataset)))]


def _batches(dataset: grain.MapDataset, local_batch: int, block: int, blocks: int,
             buckets: tuple[int, ...] | None) -> grain.MapDataset:
    if buckets is None:
        return dataset[block::blocks].batch(local_batch, drop_remainder=True)
    # Every process pads the same global batch, so all agree on its bucket, then keeps its own rows.
    rows = slice(block * local_batch, (block + 1) * local_batch)
    padded = dataset.batch(local_batch * blocks, drop_remainder=True,
                           batch_fn=partial(pad_to_bucket, buckets=buckets))
    return padded.map(lambda batch: {k: v[rows] for k, v in batch.items()})


def pad_to_bucket(examples: Sequence[Batch], buckets: tuple[int, ...]) -> Batch:
    """Variable-length token examples -> one batch padded to the shortest bucket that fits the longest,
    with `mask` marking the real targets (padding never enters the loss)."""
    longest = max(len(e["targets"]) for e in examples)
    length = next(b for b in buckets if b >= longest)
    batch = {k: np.zeros((len(examples), length), np.int32) for k in ("inputs", "targets")}
    batch["mask"] = np.zeros((len(examples), length), np.float32)
    for row, example in enumerate(examples):
        size = len(example["targets"])
        batch["inputs"][row, :size] = example["inputs"]
        batch["targets"][row, :size] = example["targets"]
        batch["mask"][row, :size] = 1.0
    return batch


def stack_steps(batches: Sequence[Batch]) -> Batch:
    """k batches -> one [k, ...] batch for fused steps; padded batches are padded to the longest first."""
    length = max(b["targets"].shape[-1] for b in batches)

    def widen(x: np.ndarray) -> np.ndarray:
        return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, length - x.shape[-1])])

    return {k: np.stack([widen(b[k]) if "mask" in b else b[k] for b in batches]) for k in batches[0]}


def split_microbatches(batch: Batch, microbatches: int) -> Batch:
    return {k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:]) for k, v in batch.items()}


class DeviceLoader:
    """Moves host batches onto the devices `prefetch` batches ahead, on a background thread.

    `state()` is the host iterator's state after the last batch handed out, so a checkpoint taken at
    a step boundary resumes with exactly the next batch, whatever was prefetched.
    """

    _DONE = object()

    def __init__(self, host: grain.DatasetIterator, to_device: Callable[[list[Batch]], Batch], prefetch: int,
                 group: int = 1):
        """`to_device` receives `group` consecutive host batches (one per fused step)."""
        self._host = host
        self._group = group
        self._to_device = to_device
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._state = host.get_state()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="xlatrain-device-loader", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        batch, self._state = item
        return batch

    def state(self) -> dict:
        return self._state

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                host_batches = [next(self._host) for _ in range(self._group)]
                item = (self._to_device(host_batches), self._host.get_state())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # handed to the consumer, which re-raises it on the main thread
            self._queue.put(err)


def make_global(batch: Batch, sharding: jax.sharding.Sharding, rows_axis: int, blocks: int) -> Batch:
    """This process's block of rows -> global arrays whose `rows_axis` holds all `blocks` blocks."""

    def global_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:rows_axis], shape[rows_axis] * blocks, *shape[rows_axis + 1:])

    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), global_shape(np.shape(v)))
            for k, v in batch.items()}


def device_train_loader(dataset: Dataset, mesh: jax.sharding.Mesh, *, seed: int, shuffle: bool, global_batch: int,
                        microbatches: int, steps_per_sync: int, prefetch: int, data_state: dict | None,
                        moved: Callable[[int], None]) -> DeviceLoader:
    """The run's training batches on the devices, laid out as the train step takes them (train_batch_sharding),
    this process reading its block of rows; `data_state`: where a resumed run's data left off. `moved(bytes)` is
    told each batch's host-to-device bytes."""
    k = steps_per_sync
    block, blocks = process_row_block(mesh)
    host = train_iterator(dataset.train, seed=seed, shuffle=shuffle, local_batch=global_batch // blocks, block=block,
                          blocks=blocks, buckets=dataset.spec.buckets)
    if data_state is not None:
        host.set_state(data_state)
    sharding = train_batch_sharding(mesh, k)

    def to_device(batches: list[Batch]) -> Batch:
        split = [split_microbatches(b, microbatches) for b in batches]
        local = split[0] if k == 1 else stack_steps(split)
        moved(sum(v.nbytes for v in local.values()))
        return make_global(local, sharding, rows_axis=2 if k > 1 else 1, blocks=blocks)

    return DeviceLoader(host, to_device, prefetch, group=k)


def device_eval_batches(dataset: Dataset, mesh: jax.sharding.Mesh, *, global_batch: int, max_batches: int,
                        moved: Callable[[int], None]) -> list[Batch]:
    """The held-out batches every evaluation runs, on the devices (eval_batch_sharding); `moved(bytes)` is told
    the host-to-device bytes of this process's rows."""
    sharding = eval_batch_sharding(mesh)
    block, blocks = process_row_block(mesh)
    host = eval_batches(dataset.eval, local_batch=global_batch // blocks, max_batches=max_batches, block=block,
                        blocks=blocks, buckets=dataset.spec.buckets)
    moved(sum(v.nbytes for b in host for v in b.values()))
    return [make_global(b, sharding, rows_axis=0, blocks=blocks) for b in host]
