"""matmul: op(a) @ op(b) of 2-D float32 arrays through a BLAS (custom_calls/blas.py), op transposing where asked.
Reference: `lax.dot_general` of the same contraction. It differentiates (forward and reverse, to any order) as a
bilinear product, each derivative another such product; under vmap it stays one product where the batch folds into
its rows (a batch of one: a train step's replicas on one device), and is XLA's batched dot elsewhere.

The dense layers (xlatrain/models/linear.py) call it for their float32 products while a step is traced inside
`dense_matmuls(library)`, which the program chooses per run (runtime.cpu_matmul)."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from xlatrain.compat.primitives import define_primitive, is_being_transposed

_LIBRARY = jax.make_user_context(default_value="xla")
"""Part of jax's tracing and compilation cache keys: a function traced for XLA's dots is traced again for a BLAS."""


@contextlib.contextmanager
def dense_matmuls(library: str) -> Iterator[None]:
    """While a step is traced: the dense layers' float32 matmuls run on `library` ("xla": XLA's own dots)."""
    if library != "xla":
        from xlatrain.custom_calls.blas import load

        load(library)
    with _LIBRARY(library):
        yield


def dense_library() -> str:
    return _LIBRARY.value


def matmul(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False,
           library: str = "openblas") -> jax.Array:
    return _matmul_p.bind(a, b, trans_a=bool(trans_a), trans_b=bool(trans_b), library=library)


def reference(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    return jax.lax.dot_general(a, b, (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ())))


def _compute(a, b, *, trans_a, trans_b, library):
    from xlatrain.custom_calls.backend import PREFIX
    from xlatrain.custom_calls.blas import load

    rows, cols = a.shape[1 if trans_a else 0], b.shape[0 if trans_b else 1]
    return jax.ffi.ffi_call(PREFIX["cpu"] + "gemm", jax.ShapeDtypeStruct((rows, cols), a.dtype))(
        a, b, trans_a=np.int64(trans_a), trans_b=np.int64(trans_b), library=np.int64(load(library)))


def _jvp(primals, tangents, **params):
    (a, b), (da, db) = primals, tangents
    parts = ([] if da is None else [_matmul_p.bind(da, b, **params)]) + \
        ([] if db is None else [_matmul_p.bind(a, db, **params)])
    return sum(parts[1:], parts[0])


def _transpose(ct, a, b, *, trans_a, trans_b, library):
    """For C = op(A) op(B): dop(A) = dC op(B)^T and dop(B) = op(A)^T dC, each written as one product."""
    product = partial(matmul, library=library)
    if is_being_transposed(a):
        da = product(b, ct, trans_a=trans_b, trans_b=True) if trans_a else product(ct, b, trans_b=not trans_b)
        return [da, None]
    db = product(ct, a, trans_a=True, trans_b=trans_a) if trans_b else product(a, ct, trans_a=not trans_a)
    return [None, db]


def _batch(operands, dims, **params):
    """A batch of one is the product itself; a batch of left operands (not transposed) against one right operand is
    more rows. Any other batch is XLA's batched dot."""
    (a, b), (a_dim, b_dim) = operands, dims
    a, b = (x if d is None else jnp.moveaxis(x, d, 0) for x, d in ((a, a_dim), (b, b_dim)))
    size = (a if a_dim is not None else b).shape[0]
    if size == 1:
        return _matmul_p.bind(a if a_dim is None else a[0], b if b_dim is None else b[0], **params)[None], 0
    if b_dim is None and not params["trans_a"]:
        out = _matmul_p.bind(a.reshape(-1, a.shape[-1]), b, **params)
        return out.reshape(size, a.shape[1], -1), 0
    product = partial(reference, trans_a=params["trans_a"], trans_b=params["trans_b"])
    return jax.vmap(product, in_axes=(None if a_dim is None else 0, None if b_dim is None else 0))(a, b), 0


_matmul_p = define_primitive("xlatrain_blas_matmul", compute=_compute, jvp=_jvp, transpose=_transpose, batch=_batch)


def is_blas_matmul(primitive) -> bool:
    """For jax.checkpoint policies: the primitive is this matmul (saved where a policy saves dots)."""
    return primitive is _matmul_p
