"""One data replica's gradients through a pipeline: a schedule's time slots as one SPMD program.

Runs inside `shard_map` over (data, stage). Every stage steps through the slot program
(xlatrain/pipeline/slots.py) with `lax.scan`; in each slot it runs its own action (`lax.switch` on its
row of the table: idle, a chunk's forward, or a chunk's backward), then all stages pass their output
activation to the next stage and their input gradient to the previous one (`ppermute`, XLA's or
xlatrain's custom call). A chunk's backward recomputes its forward from the stored input activation and
differentiates it (`jax.vjp`), so a stage stores one activation per microbatch in flight. The last
chunk's backward starts from the scaled loss, exactly as the unpipelined step's `grad` does.

Gradients come out float32, summed over microbatches (and gradient-accumulation rounds): the blocks'
on their own stage, the rest (embeddings, head) summed over the stages; the loss sums likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from xlatrain.lowering.step import all_finite, loss_sums

from xlatrain.mesh import STAGE
from xlatrain.models.blocks import BLOCKS, BlockParts, layer_keys, split_blocks
from xlatrain.pipeline.layout import StageLayout
from xlatrain.pipeline.slots import Branch, SlotProgram
from xlatrain.precision import Policy, cast_floats

Tree = Any


@dataclass(frozen=True)
class StageLink:
    """How the stages of one replica talk: neighbour exchange and sums over the `stage` axis."""

    stages: int
    ppermute: Callable[[jax.Array, tuple[tuple[int, int], ...]], jax.Array]
    sum: Callable[[jax.Array], jax.Array]

    def sum_tree(self, tree: Tree) -> Tree:
        return jax.tree.map(self.sum, tree)


def stage_link(stages: int, impl: str, timeout_s: float) -> StageLink:
    if impl == "custom":
        from xlatrain import custom_calls as ops

        return StageLink(stages, lambda x, perm: ops.ppermute(x, STAGE, perm, timeout_s=timeout_s),
                         lambda x: ops.all_reduce(x, STAGE, timeout_s=timeout_s))
    return StageLink(stages, lambda x, perm: jax.lax.ppermute(x, STAGE, perm), lambda x: jax.lax.psum(x, STAGE))


@dataclass(frozen=True)
class StagedTrees:
    """Parameter-shaped trees whose blocks are split over the stages (the rest is the same on every
    stage): a norm or finite check adds the stages' parts."""

    link: StageLink

    def norm(self, tree: dict) -> jax.Array:
        blocks, rest = split_blocks(tree)
        return jnp.sqrt(self.link.sum(optax.tree.norm(blocks, squared=True)) + optax.tree.norm(rest, squared=True))

    def all_finite(self, tree: dict) -> jax.Array:
        finite_stages = self.link.sum(all_finite(tree).astype(jnp.float32))
        return finite_stages == self.link.stages


def make_pipeline_gradients(parts: BlockParts, layout: StageLayout, slots: SlotProgram, microbatches: int,
                            loss: str, policy: Policy, link: StageLink) -> Callable:
    """(params, batch, key, scale, total_weight) -> (grads, loss sums) for this device's stage, where
    `batch` is the replica's [accumulation microbatches, rows, ...] and params are this stage's."""
    p, width = layout.stages, layout.width
    forward_pairs = tuple((s, (s + 1) % p) for s in range(p if slots.ring else p - 1))
    backward_pairs = tuple((t, s) for s, t in forward_pairs)

    def compute(tree: Tree) -> Tree:
        return cast_floats(tree, policy.compute)

    def split(batch: dict) -> dict:
        """[rows, ...] -> [microbatches, rows / microbatches, ...]"""
        return jax.tree.map(lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]), batch)

    def chunk_keys(microbatch_key: jax.Array, start: jax.Array) -> jax.Array:
        """The dropout keys of a chunk's blocks (and padding): those BlockStack gives the same layers."""
        keys_L = layer_keys(microbatch_key, layout.layers)
        padded = jnp.concatenate([keys_L, jnp.zeros((width, *keys_L.shape[1:]), keys_L.dtype)])
        return jax.lax.dynamic_slice_in_dim(padded, start, width)

    def run_round(blocks: Tree, rest: dict, batch: dict, key: jax.Array, scale: jax.Array,
                  total_weight: jax.Array, totals: tuple, x_shape: jax.ShapeDtypeStruct) -> tuple:
        """One accumulation microbatch cut into `microbatches` pieces, through every slot of the schedule."""
        stage = jax.lax.axis_index(STAGE)
        micro = split(batch)
        tables = {name: jnp.asarray(table) for name, table in slots.tables().items()}
        starts = jnp.asarray(layout.starts)
        active_blocks = None if layout.even else jnp.asarray(layout.partition, jnp.int32)
        nothing = jnp.zeros(x_shape.shape, x_shape.dtype)
        pools = (jnp.zeros((slots.activation_buffers + 1, *x_shape.shape), x_shape.dtype),
                 jnp.zeros((slots.cotangent_buffers + 1, *x_shape.shape), x_shape.dtype))

        def slot(carry, t):
            (activations, cotangents), totals = carry
            at = {name: table[t, stage] for name, table in tables.items()}
            j, r = at["microbatch"], at["round"]
            chunk = r * p + stage
            micro_j = jax.tree.map(lambda x: x[j], micro)
            block_r = jax.tree.map(lambda b: b[r], blocks)
            keys = chunk_keys(jax.random.fold_in(key, j), starts[chunk])
            active = None if active_blocks is None else active_blocks[chunk]
            x_in, dy = activations[at["activation_read"]], cotangents[at["cotangent_read"]]

            def run_chunk(b, x):
                return parts.run(compute(b), x, keys, active)

            def embed(r_):
                return parts.before(compute({**r_, BLOCKS: block_r}), compute(micro_j["inputs"]))

            def head_sums(r_, y):
                outputs = parts.after(compute({**r_, BLOCKS: block_r}), y).astype(policy.output)
                return loss_sums(outputs, micro_j, loss)

            def add(totals, grad_blocks=None, grad_rest=None, sums=None):
                g_blocks, g_rest, s = totals
                if grad_blocks is not None:
                    g_blocks = jax.tree.map(lambda acc, g: acc.at[r].add(g.astype(jnp.float32)), g_blocks, grad_blocks)
                if grad_rest is not None:
                    g_rest = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), g_rest, grad_rest)
                if sums is not None:
                    s = jax.tree.map(jnp.add, s, sums)
                return g_blocks, g_rest, s

            def idle(totals):
                return totals, nothing, nothing

            def forward_first(totals):
                return totals, run_chunk(block_r, embed(rest)), nothing

            def forward(totals):
                return totals, run_chunk(block_r, x_in), nothing

            def forward_last(totals):
                return add(totals, sums=head_sums(rest, run_chunk(block_r, x_in))), nothing, nothing

            def backward_first(totals):
                _, pullback = jax.vjp(lambda b, r_: run_chunk(b, embed(r_)), block_r, rest)
                grad_blocks, grad_rest = pullback(dy)
                return add(totals, grad_blocks, grad_rest), nothing, nothing

            def backward(totals):
                _, pullback = jax.vjp(run_chunk, block_r, x_in)
                grad_blocks, dx = pullback(dy)
                return add(totals, grad_blocks), nothing, dx

            def backward_last(totals):
                def scaled_loss(b, r_, x):
                    return head_sums(r_, run_chunk(b, x))["loss"] * scale / total_weight

                grad_blocks, grad_rest, dx = jax.grad(scaled_loss, argnums=(0, 1, 2))(block_r, rest, x_in)
                return add(totals, grad_blocks, grad_rest), nothing, dx

            branches = {Branch.IDLE: idle, Branch.FORWARD_FIRST: forward_first, Branch.FORWARD: forward,
                        Branch.FORWARD_LAST: forward_last, Branch.BACKWARD_FIRST: backward_first,
                        Branch.BACKWARD: backward, Branch.BACKWARD_LAST: backward_last}
            totals, to_next, to_previous = jax.lax.switch(at["branch"], [branches[b] for b in Branch], totals)
            received = link.ppermute(to_next, forward_pairs)
            returned = link.ppermute(to_previous, backward_pairs)
            pools = (activations.at[at["activation_write"]].set(received),
                     cotangents.at[at["cotangent_write"]].set(returned))
            return (pools, totals), None

        return jax.lax.scan(slot, (pools, totals), jnp.arange(slots.slots))[0][1]

    def gradients(params: dict, batch: dict, key: jax.Array, scale: jax.Array, total_weight: jax.Array):
        staged, rest = split_blocks(params)
        blocks = jax.tree.map(lambda b: b[:, 0], staged)

        def one_microbatch():
            micro = jax.tree.map(lambda x: x[0], split(jax.tree.map(lambda x: x[0], batch)))
            chunk = compute({**rest, BLOCKS: jax.tree.map(lambda b: b[0], blocks)})
            x = parts.before(chunk, compute(micro["inputs"]))
            return x, loss_sums(parts.after(chunk, x).astype(policy.output), micro, loss)

        x_shape, sums_shape = jax.eval_shape(one_microbatch)
        totals = (jax.tree.map(lambda b: jnp.zeros(b.shape, jnp.float32), blocks),
                  jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), rest),
                  jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), sums_shape))
        count = jax.tree.leaves(batch)[0].shape[0]
        if count == 1:
            totals = run_round(blocks, rest, jax.tree.map(lambda x: x[0], batch), key, scale, total_weight, totals,
                               x_shape)
        else:
            def one(totals, indexed):
                index, round_batch = indexed
                return run_round(blocks, rest, round_batch, jax.random.fold_in(key, index), scale, total_weight,
                                 totals, x_shape), None

            totals = jax.lax.scan(one, totals, (jnp.arange(count), batch))[0]
        grad_blocks, grad_rest, sums = totals
        grad_rest, sums = link.sum_tree((grad_rest, sums))
        return {**grad_rest, BLOCKS: jax.tree.map(lambda g: g[:, None], grad_blocks)}, sums

    return gradients
