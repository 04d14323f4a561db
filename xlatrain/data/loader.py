"""grain pipelines for training and eval, and a device loader that prefetches sharded batches.

Training batches are laid out [microbatches, global_batch / microbatches, ...] so the compiled step
scans over the leading axis; each process reads its own slice of every global batch.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

import grain
import jax
import numpy as np

from xlatrain.data.sources import ArraySource, TokenWindows

Batch = dict[str, Any]


def train_iterator(source: ArraySource | TokenWindows, *, seed: int, shuffle: bool, local_batch: int,
                   process_index: int, process_count: int) -> grain.DatasetIterator:
    """An endless, epoch-reshuffled iterator of this process's batches; its state is checkpointable."""
    dataset = grain.MapDataset.source(source)
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat()[process_index::process_count].batch(local_batch, drop_remainder=True)
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))


def eval_batches(source: ArraySource | TokenWindows, *, local_batch: int, max_batches: int,
                 process_index: int, process_count: int) -> list[Batch]:
    """The first `max_batches` held-out batches of this process, in a fixed order."""
    dataset = grain.MapDataset.source(source)[process_index::process_count]
    dataset = dataset.batch(local_batch, drop_remainder=True)
    return [dataset[i] for i in range(min(max_batches, len(dataset)))]


def split_microbatches(batch: Batch, microbatches: int) -> Batch:
    return {k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:]) for k, v in batch.items()}


class DeviceLoader:
    """Moves host batches onto the devices `prefetch` batches ahead, on a background thread.

    `state()` is the host iterator's state after the last batch handed out, so a checkpoint taken at
    a step boundary resumes with exactly the next batch, whatever was prefetched.
    """

    _DONE = object()

    def __init__(self, host: grain.DatasetIterator, to_device: Callable[[Batch], Batch], prefetch: int):
        self._host = host
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
                host_batch = next(self._host)
                item = (self._to_device(host_batch), self._host.get_state())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # handed to the consumer, which re-raises it on the main thread
            self._queue.put(err)


def make_global(batch: Batch, sharding: jax.sharding.Sharding, global_shapes: dict[str, tuple]) -> Batch:
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), global_shapes[k])
            for k, v in batch.items()}
