"""ppermute: participant `source` sends its buffer to participant `target` for each (source, target)
pair of a static permutation; a participant nobody sends to gets zeros. Reference: `lax.ppermute`. Its
transpose is the inverse permutation. Pipeline stages use it to pass activations to their neighbour."""

from __future__ import annotations

import jax
import numpy as np
from xlatrain.custom_calls._collective import axis_location, collective_primitive, timeout_ms

Permutation = tuple[tuple[int, int], ...]


def ppermute(
    x: jax.Array, axis_name: str, perm: list[tuple[int, int]] | Permutation, *, timeout_s: float | None = None
) -> jax.Array:
    participants, where = axis_location(axis_name)
    pairs = tuple((int(s), int(t)) for s, t in perm)
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    if (
        len(set(sources)) != len(sources)
        or len(set(targets)) != len(targets)
        or not all(0 <= i < participants for i in sources + targets)
    ):
        raise ValueError(
            f"ppermute: perm={list(pairs)} must pair distinct sources with distinct targets in 0..{participants - 1}"
        )
    return _ppermute_p.bind(
        x, where, perm=pairs, participants=participants, axis_name=axis_name, timeout_ms=timeout_ms(timeout_s)
    )


def reference(x: jax.Array, axis_name: str, perm: list[tuple[int, int]] | Permutation) -> jax.Array:
    return jax.lax.ppermute(x, axis_name, perm)


def _transpose(ct, where, *, perm, **params):
    return _ppermute_p.bind(ct, where, perm=tuple((t, s) for s, t in perm), **params)


_ppermute_p = collective_primitive(
    "ppermute",
    abstract_eval=lambda x, where, **_: x,
    batch=lambda x, bdim, where, **params: (_ppermute_p.bind(x, where, **params), bdim),
    transpose=_transpose,
    attributes=lambda perm, participants, timeout_ms: {
        "sources": np.array([s for s, _ in perm], np.int64),
        "targets": np.array([t for _, t in perm], np.int64),
        "participants": np.int64(participants),
        "timeout_ms": np.int64(timeout_ms),
    },
)
