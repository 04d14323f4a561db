"""What one microbatch costs in each piece of a BlockStack model, measured by XLA.

Small programs per piece, compiled (not run) from abstract shapes: the forward, the gradient (the forward
recomputed plus the backward, which is what a pipeline's backward action runs), and the weight-gradient part
of the backward (W of its B/W split, lowering/pipeline/split_backward.py). FLOPs come
from XLA's cost analysis; activation bytes from the temporaries of the gradient program (XLA memory
analysis); parameter bytes from the parameters the piece reads (`before_blocks` and `after_blocks` see
the whole parameter tree but are charged only for what they use).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from xlatrain.lowering.pipeline.split_backward import abstract_value, split_pullback
from xlatrain.lowering.step import loss_sums

from xlatrain.compat.jaxprs import used_inputs
from xlatrain.compat.monitoring import cost_analysis
from xlatrain.models.blocks import BLOCKS, BlockParts
from xlatrain.pipeline.partition import ModelCosts, PieceCost
from xlatrain.precision import Policy, cast_floats
from xlatrain.runtime.platform import compiling_for


def measure_block_costs(parts: BlockParts, abstract_params: dict, micro: dict[str, jax.ShapeDtypeStruct],
                        loss: str, policy: Policy, split_backward: bool = False) -> ModelCosts:
    """`micro`: one pipeline microbatch's abstract batch (inputs, targets, and mask when padded).
    `split_backward`: measure W's FLOPs too (for a zero-bubble schedule; weight_flops stays 0 otherwise)."""
    one_block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract_params[BLOCKS])
    whole = {**abstract_params, BLOCKS: one_block}  # before/after read everything but the blocks
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # a raw dropout key, as the train step passes

    def before(params, inputs):
        return parts.before(cast_floats(params, policy.compute), cast_floats(inputs, policy.compute))

    def block(params, x, key):
        layer = jnp.int32(0) if parts.numbered else None  # a block of several kinds: its switch's dearest branch
        out = parts.layer(cast_floats(params, policy.compute), x, key, None, layer)  # documents' mask: not counted
        return out[0] if isinstance(out, tuple) else out  # a block's report (router statistics): a few sums

    def after(params, x, batch):
        outputs = parts.after(cast_floats(params, policy.compute), x).astype(policy.output)
        return loss_sums(outputs, batch, loss)["loss"]

    x = jax.eval_shape(before, whole, micro["inputs"])
    pieces = [(before, (whole, micro["inputs"]), _total(before)), (block, (one_block, x, key), _total(block)),
              (after, (whole, x, micro), after)]
    with compiling_for(jax.default_backend()):  # the host's devices compile them, also under `lower --target`
        before_cost, block_cost, after_cost = [_piece(*piece, split_backward) for piece in pieces]
    return ModelCosts(before=before_cost, block=block_cost, after=after_cost,
                      blocks=parts.layers, boundary_bytes=_bytes(x))


def _total(fn: Callable) -> Callable:
    """A scalar of fn's output, to take a gradient of."""
    return lambda params, *args: jnp.sum(fn(params, *args).astype(jnp.float32))


def _piece(forward: Callable, args: tuple, objective: Callable, split_backward: bool) -> PieceCost:
    """args[0] is the params; the gradient is taken with respect to the params and args[1] (the input)."""
    fwd = jax.jit(forward).lower(*args).compile()
    grad = jax.jit(jax.grad(objective, argnums=(0, 1) if _differentiable(args[1]) else 0)).lower(*args).compile()
    used = used_inputs(forward, *args)[:len(jax.tree.leaves(args[0]))]
    memory = grad.memory_analysis()
    return PieceCost(forward_flops=_flops(fwd), backward_flops=_flops(grad),
                     param_bytes=float(sum(_bytes(leaf) for leaf, read in zip(jax.tree.leaves(args[0]), used,
                                                                               strict=True) if read)),
                     activation_bytes=float(memory.temp_size_in_bytes) if memory is not None else 0.0,
                     weight_flops=_weight_flops(forward, args) if split_backward else 0.0)


def _weight_flops(forward: Callable, args: tuple) -> float:
    """FLOPs of W, the weight gradients, when the piece's backward is split into B and W. A piece whose input
    is not differentiable (the embedding's tokens) gets zeros added to its output as its input: B is empty."""

    def pullback(params, x, *rest):
        if _differentiable(x):
            return jax.vjp(lambda p, x: forward(p, x, *rest), params, x)[1]
        out = jax.eval_shape(forward, params, x, *rest)
        return jax.vjp(lambda p, offset: forward(p, x, *rest) + offset, params, jnp.zeros(out.shape, out.dtype))[1]

    abstract = abstract_value(pullback, *args)
    split = split_pullback(abstract, jax.eval_shape(forward, *args))
    return _flops(jax.jit(split.w).lower(abstract, split.split.stash_shapes()).compile())


def _differentiable(x: Any) -> bool:
    return all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(x))


def _flops(compiled: Any) -> float:
    return float(cost_analysis(compiled).get("flops", 0.0))


def _bytes(tree: Any) -> int:
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))
