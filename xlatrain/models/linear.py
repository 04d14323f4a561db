"""Dense layers whose weight gradient reads the smaller of its two operands transposed.

A dense layer y = x @ w has the weight gradient dw = x^T @ dy, a contraction over the rows that both x and dy
share. XLA:CPU's matmul kernels want the left operand's contracted axis innermost, so XLA copies one operand into
a transposed layout first. JAX's differentiation rule always puts the cotangent first (dw = (dy^T @ x)^T), so the
copy is of dy: for a GPT's first MLP layer dy has four times x's size (8 MB for the 4 x 256 GPT on 2,048 tokens,
about 5 ms a copy on two cores). Here the weight gradient transposes whichever side is smaller, the same products
summed in another order: 0.91x the 4 x 256 GPT's step time on an Intel Xeon (bench/README.md, the GPT on CPU).

The layer's product is a `custom_jvp` whose tangent for the weight is a primitive of its own (`x @ dw`, linear in
dw) with that transpose: forward-mode differentiation (jvp, jacfwd, Hessian-vector products) works as for any
matmul, reverse mode transposes the tangent with the rule above, and the forward is a plain matmul, which
`jax.checkpoint` policies see as one.

While a step is traced for a CPU BLAS (runtime.cpu_matmul; `custom_calls/ops/matmul.py`), the three products of
float32 layers (forward, input gradient, weight gradient) are that BLAS's, as 2-D products over the rows with the
transposes inside the BLAS call; everything else stays XLA's.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from jax.custom_derivatives import SymbolicZero

from xlatrain.compat.primitives import define_primitive, is_being_transposed
from xlatrain.custom_calls.ops.matmul import dense_library, matmul


def linear(in_features: int, out_features: int, **kwargs) -> nnx.Linear:
    """nnx.Linear with the weight gradient of `dense_dot_general`."""
    return nnx.Linear(in_features, out_features, dot_general=dense_dot_general, **kwargs)


class GroupedLinear(nnx.Module):
    """[..., in] -> [..., groups, out]: several projections of one input in one matmul (a decoder's query, key and
    value), its kernel [in, groups, out] and bias [groups, out], so that splitting `out` over a mesh axis splits
    every projection alike (whole heads, where `out` is heads x head width). Initialised with nnx.Linear(in,
    groups x out)'s draws, reshaped; its weight gradient is `dense_dot_general`'s."""

    def __init__(self, in_features: int, groups: int, out_features: int, *, rngs: nnx.Rngs,
                 kernel_metadata: dict | None = None, bias_metadata: dict | None = None):
        kernel = default_kernel_init(rngs.params(), (in_features, groups * out_features), jnp.float32)
        self.kernel = nnx.Param(kernel.reshape(in_features, groups, out_features), **(kernel_metadata or {}))
        self.bias = nnx.Param(default_bias_init(rngs.params(), (groups, out_features), jnp.float32),
                              **(bias_metadata or {}))

    def __call__(self, x: jax.Array) -> jax.Array:
        x, kernel, bias = promote_dtype((x, self.kernel[...], self.bias[...]), dtype=None)
        return _dense(None, x, kernel) + bias.reshape((1,) * (x.ndim - 1) + bias.shape)


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


def _blas(*operands: jax.Array) -> str | None:
    """The BLAS the step's dense layers run on, for float32 operands; None: XLA's dot."""
    library = dense_library()
    return None if library == "xla" or any(o.dtype != jnp.float32 for o in operands) else library


def _rows(a: jax.Array, features: int) -> jax.Array:
    return a.reshape(-1, features)


def _product(x: jax.Array, w: jax.Array, precision) -> jax.Array:
    """x [..., in] @ w [in, *out]."""
    if library := _blas(x, w):
        out = matmul(_rows(x, w.shape[0]), w.reshape(w.shape[0], -1), library=library)
        return out.reshape(*x.shape[:-1], *w.shape[1:])
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _input_gradient(dy: jax.Array, w: jax.Array, precision) -> jax.Array:
    """dy [..., *out] against w [in, *out]: [..., in]."""
    outs = w.ndim - 1
    if library := _blas(dy, w):
        out = matmul(_rows(dy, math.prod(w.shape[1:])), w.reshape(w.shape[0], -1), trans_b=True, library=library)
        return out.reshape(*dy.shape[:dy.ndim - outs], w.shape[0])
    return jax.lax.dot_general(dy, w, ((tuple(range(dy.ndim - outs, dy.ndim)), tuple(range(1, w.ndim))), ((), ())),
                               precision=precision)


def _weight_gradient(x: jax.Array, dy: jax.Array, precision) -> jax.Array:
    """x^T @ dy over every row, with the smaller side transposed: [in, *out]."""
    rows = tuple(range(x.ndim - 1))
    outputs = dy.size // max(1, math.prod(dy.shape[:len(rows)]))
    if library := _blas(x, dy):  # the BLAS reads x transposed in place
        out = matmul(_rows(x, x.shape[-1]), _rows(dy, outputs), trans_a=True, library=library)
        return out.reshape(x.shape[-1], *dy.shape[len(rows):])
    if x.size <= dy.size + x.shape[-1] * outputs:  # XLA transposes x for x^T @ dy
        return jax.lax.dot_general(x, dy, ((rows, rows), ((), ())), precision=precision)
    # it transposes dy, then the [*out, in] product
    return jnp.moveaxis(jax.lax.dot_general(dy, x, ((rows, rows), ((), ())), precision=precision), -1, 0)


def _product_tangent(x, w, dx, dw, precision) -> jax.Array:
    """The tangent of x @ w for the tangents dx and dw (None: zero; not both)."""
    parts = ([] if dx is None else [_product(dx, w, precision)]) + \
        ([] if dw is None else [_times_weight_tangent.bind(dw, x, precision=precision)])
    return sum(parts[1:], parts[0])


def _weight_tangent_jvp(primals, tangents, precision):
    (tw, x), (dtw, dx) = primals, tangents
    return _product_tangent(x, tw, dx, dtw, precision)


def _weight_tangent_transpose(ct, tw, x, precision):
    if is_being_transposed(tw):
        return [_weight_gradient(x, ct, precision), None]
    return [None, _input_gradient(ct, tw, precision)]


def _weight_tangent_batch(operands, dims, precision):
    (tw, x), (tw_dim, x_dim) = operands, dims
    if tw_dim is None:  # a batch of inputs is more rows
        return _times_weight_tangent.bind(tw, jnp.moveaxis(x, x_dim, 0), precision=precision), 0
    tw = jnp.moveaxis(tw, tw_dim, 0)
    x = jnp.broadcast_to(x, (tw.shape[0], *x.shape)) if x_dim is None else jnp.moveaxis(x, x_dim, 0)
    return jax.lax.dot_general(x, tw, (((x.ndim - 1,), (1,)), ((0,), (0,))), precision=precision), 0


_times_weight_tangent = define_primitive(
    "xlatrain_dense_weight_tangent", compute=lambda tw, x, precision: _product(x, tw, precision),
    jvp=_weight_tangent_jvp, transpose=_weight_tangent_transpose, batch=_weight_tangent_batch)
"""x @ tw for a weight tangent tw: its transpose is `_weight_gradient`, where jax's own rule for a dot's operand
would transpose the cotangent."""


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def _dense(precision, x: jax.Array, w: jax.Array) -> jax.Array:
    return _product(x, w, precision)


def _dense_jvp(precision, primals, tangents):
    (x, w), (dx, dw) = primals, [None if isinstance(t, SymbolicZero) else t for t in tangents]
    y = _product(x, w, precision)  # a plain matmul: jax.checkpoint's dots_saveable sees it as one
    return y, jnp.zeros_like(y) if dx is None and dw is None else _product_tangent(x, w, dx, dw, precision)


_dense.defjvp(_dense_jvp, symbolic_zeros=True)
