"""Dense layers whose weight gradient reads the smaller of its two operands transposed.

A dense layer y = x @ w has the weight gradient dw = x^T @ dy, a contraction over the rows that both x and dy
share. XLA:CPU's matmul kernels want the left operand's contracted axis innermost, so XLA copies one operand into
a transposed layout first. JAX's differentiation rule always puts the cotangent first (dw = (dy^T @ x)^T), so the
copy is of dy: for a GPT's first MLP layer dy has four times x's size (8 MB for the 4 x 256 GPT on 2,048 tokens,
about 5 ms a copy on two cores). Here the weight gradient transposes whichever side is smaller, the same products
summed in another order: 0.91x the 4 x 256 GPT's step time on an Intel Xeon (README, "GPT on CPU, the Intel host").
"""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx


def linear(in_features: int, out_features: int, **kwargs) -> nnx.Linear:
    """nnx.Linear with the weight gradient of `dense_dot_general`."""
    return nnx.Linear(in_features, out_features, dot_general=dense_dot_general, **kwargs)


def dense_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                      preferred_element_type=None, out_sharding=None) -> jax.Array:
    """lax.dot_general as nnx.Linear calls it (inputs [..., in] by kernel [in, out]), with `_dense`'s gradient;
    any other contraction, output type or sharding goes to lax.dot_general unchanged."""
    dense = (((lhs.ndim - 1,), (0,)), ((), ()))
    if (tuple(map(tuple, dimension_numbers[0])), tuple(map(tuple, dimension_numbers[1]))) != dense or \
            rhs.ndim != 2 or lhs.dtype != rhs.dtype or preferred_element_type is not None or out_sharding is not None:
        extra = {} if out_sharding is None else {"out_sharding": out_sharding}
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **extra)
    return _dense(precision, lhs, rhs)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense(precision, x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _dense_forward(precision, x, w):
    return _dense(precision, x, w), (x, w)


def _dense_backward(precision, residuals, dy):
    x, w = residuals
    rows = tuple(range(x.ndim - 1))
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())), precision=precision)
    if x.size <= dy.size + w.size:  # XLA transposes x for x^T @ dy
        dw = jax.lax.dot_general(x, dy, ((rows, rows), ((), ())), precision=precision)
    else:  # it transposes dy, then the [out, in] product
        dw = jax.lax.dot_general(dy, x, ((rows, rows), ((), ())), precision=precision).T
    return dx, dw


_dense.defvjp(_dense_forward, _dense_backward)
