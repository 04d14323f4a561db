"""Step boundaries and step closures: the only places where host code sees values from the device.

A boundary is the end of one dispatched executable (one optimizer step, or `trainer.steps_per_sync`
fused steps). Between boundaries the loop runs under `forbid_implicit_transfers()` (jax's
transfer guard, extended to XLA:CPU), so reading a device value implicitly (`float(loss)`,
`np.asarray(x)`) is an error instead of a hidden sync. Host work
is queued with `Boundary.add_step_closure(fn, *values)`: `fn` later receives those values, fetched to
the host in one transfer, for exactly the step they came from (torch_xla's `add_step_closure`).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from xlatrain.compat.transfers import allow_transfers
from xlatrain.errors import UserError


class StepClosures:
    """Closures queued at boundaries; run in registration order once their values are fetched."""

    def __init__(self, waiting: Callable[[], AbstractContextManager] = nullcontext) -> None:
        """`waiting()`: a context around each fetch of values from the device (the time breakdown's)."""
        self._waiting = waiting
        self._queue: list[tuple[int, Callable, tuple]] = []
        self._donated: set[int] = set()
        self.must_run_before_dispatch = False
        self.device_to_host_bytes = 0
        self.wait_seconds = 0.0
        self._seen_finishing: tuple[int, float] | None = None

    def add(self, step: int, fn: Callable, args: tuple) -> None:
        self._queue.append((step, fn, args))
        if any(id(leaf) in self._donated for leaf in jax.tree.leaves(args)):
            self.must_run_before_dispatch = True  # the next step consumes (donates) these buffers

    def will_donate(self, tree: Any) -> None:
        """The arrays the next dispatch will donate (the new state): closures holding them run before it."""
        self._donated = {id(leaf) for leaf in jax.tree.leaves(tree)}

    def seen_finishing(self, step: int) -> float | None:
        """When the last fetch, which had to wait for the executable ending at `step`, saw it finish on the
        device; None when that fetch was for another step or its values were ready before it."""
        return self._seen_finishing[1] if self._seen_finishing and self._seen_finishing[0] == step else None

    def run(self, through_step: int | None = None) -> None:
        """Fetch and run the closures registered at boundaries up to `through_step` (all when None)."""
        ready = [c for c in self._queue if through_step is None or c[0] <= through_step]
        if not ready:
            return
        self._queue = [c for c in self._queue if through_step is not None and c[0] > through_step]
        if not self._queue:
            self.must_run_before_dispatch = False
        with allow_transfers():  # a boundary: the fetch, and closures are host code
            start = time.perf_counter()
            waits = not all(leaf.is_ready() for leaf in jax.tree.leaves(ready[-1][2]) if isinstance(leaf, jax.Array))
            with self._waiting():
                values = jax.device_get([args for _, _, args in ready])
            end = time.perf_counter()
            self.wait_seconds += end - start
            self._seen_finishing = (ready[-1][0], end) if waits else None
            self.device_to_host_bytes += sum(np.asarray(v).nbytes for v in jax.tree.leaves(values))
            for (_, fn, _), host_args in zip(ready, values, strict=True):
                fn(*host_args)


@dataclass(frozen=True)
class Boundary:
    """What a hook sees right after the executable ending at `step` was dispatched. The values are device
    arrays that may not be computed yet: pass them to `add_step_closure` instead of reading them."""

    first_step: int
    step: int
    state: Any
    """The train state after `step`."""
    metrics: dict[str, jax.Array]
    """Per-step metrics; each has a leading axis of length steps_per_sync when steps are fused."""
    _closures: StepClosures

    def add_step_closure(self, fn: Callable[..., None], *args: Any) -> None:
        """Call `fn(*host_args)` at a later boundary with `args` (pytrees of device arrays) on the host."""
        self._closures.add(self.step, fn, args)


Hook = Callable[[Boundary], None]


def call_hook(hook: Hook, boundary: Boundary) -> None:
    """Run a user hook between boundaries, turning an implicit device read into advice."""
    try:
        hook(boundary)
    except Exception as err:
        if "Disallowed" not in str(err) or "transfer" not in str(err):
            raise
        name = getattr(hook, "__qualname__", repr(hook))
        raise UserError(
            f"hook {name} read a device value inside the training loop at step {boundary.step} "
            f"({str(err).splitlines()[0][:120]}). Values exist on the host only at step boundaries: register "
            "boundary.add_step_closure(fn, value) and fn receives the value of this step") from None
