"""Host reads of device arrays between step boundaries: jax's transfer guard, plus the implicit reads
XLA:CPU's arrays allow without it."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import jax

_HOST_READS = threading.local()


def _guard_array_reads() -> None:
    """Make implicit reads of jax.Array values (float(x), np.asarray(x), x.tolist()) check a per-thread
    flag. Needed on XLA:CPU, where arrays already live in host memory and jax's transfer guard does not
    count reading them as a device-to-host transfer. Idempotent."""
    from jax._src.array import ArrayImpl

    original = ArrayImpl.__dict__["_value"]
    if getattr(original.fget, "xlatrain_guarded", False):
        return

    def value(self):
        if getattr(_HOST_READS, "forbidden", False):
            raise RuntimeError(f"Disallowed device-to-host transfer: implicit read of a {self.aval.str_short()} "
                               "array between step boundaries")
        return original.fget(self)

    value.xlatrain_guarded = True
    ArrayImpl._value = property(value)


@contextlib.contextmanager
def _host_reads(forbidden: bool, guard: str) -> Iterator[None]:
    previous = getattr(_HOST_READS, "forbidden", False)
    _HOST_READS.forbidden = forbidden
    try:
        with jax.transfer_guard(guard):
            yield
    finally:
        _HOST_READS.forbidden = previous


def forbid_implicit_transfers() -> contextlib.AbstractContextManager[None]:
    """jax.transfer_guard("disallow") on this thread, plus implicit array reads on every backend."""
    _guard_array_reads()
    return _host_reads(True, "disallow")


def allow_transfers() -> contextlib.AbstractContextManager[None]:
    """Undo forbid_implicit_transfers inside it (step boundaries: closures, checkpoints)."""
    return _host_reads(False, "allow")
