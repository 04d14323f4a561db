"""One data replica's gradients through a pipeline: a schedule's time slots as one SPMD program.

Runs inside `shard_map` over (data, stage). Every stage steps through the slot program
(xlatrain/pipeline/slots.py) with `lax.scan`; in each slot it runs its own action (the table's row says which:
a chunk's forward, a chunk's backward, or nothing; each action is a `while_loop` of zero or one trips, see
`run_when`), then all stages pass their output activation
to the next stage and their input gradient to the previous one (`ppermute`, XLA's or xlatrain's custom call;
in a V (ZB-V) a stage's second chunk sends the other way, so each direction takes two `ppermute`s, and the
V's tip hands over on the last stage itself). A stage stores one input activation per microbatch in flight.
With `remat: full` a chunk's backward recomputes its forward from that activation and differentiates it
(`jax.vjp`); with `remat: none` the forward slot runs `jax.vjp` once and keeps the pullback's residuals
(lowering/pipeline/residuals.py: the matmuls' results) until the backward slot, which only runs the pullback. Either
way the last chunk's backward starts from the scaled loss, exactly as the unpipelined step's `grad` does, and
every chunk is differentiated with respect to its parameters cast to the compute dtype (the cast's transpose
takes the gradient back to float32). Each kind of chunk (first, middle, last) is traced with its VJP once
(`TracedChunk`), and every action evaluates that program: the model's Python runs three times per step's trace,
not once per kind of action.

Gradients come out float32, summed over microbatches (and gradient-accumulation rounds): the blocks' on
their own stage, the rest (embeddings, head) summed over the stages; the loss sums likewise.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from xlatrain.lowering.pipeline.chunks import (
    backward_splits,
    chunk_arguments,
    chunk_layers,
    microbatch_shapes,
    residual_layouts,
    scoped,
    split_rows,
    stage_blocks,
    stage_reports,
    trace_chunks,
    zeros_of,
)
from xlatrain.lowering.pipeline.residuals import buffer_counts, empty_buffers, pack, unpack
from xlatrain.lowering.pipeline.stage_link import StageLink, hand_over, pool_of, read, receive

from xlatrain.mesh import STAGE
from xlatrain.models.blocks import BLOCKS, BlockParts, layer_keys
from xlatrain.pipeline.layout import StageLayout
from xlatrain.pipeline.slots import Branch, SlotProgram
from xlatrain.precision import Policy, cast_floats

Tree = Any


class SlotInputs(NamedTuple):
    """What a slot's action reads: the chunk's blocks and the other params (in the compute dtype), its input
    activation and incoming gradient, the microbatch, where its dropout keys come from (the microbatch's index
    and the chunk's first layer: the action derives them, so a slot without an action, or a model without
    dropout, computes none) and its active blocks."""

    cb: Tree
    cr: dict
    x_in: Tree
    dy: Tree
    micro: dict
    microbatch: jax.Array
    start: jax.Array
    active: jax.Array | None


class SlotState(NamedTuple):
    """What a slot's action may change: the gradient and loss sums, what the stage sends to the next and the
    previous stage, and its pools of kept residuals and stashes."""

    totals: tuple
    to_next: Tree
    to_previous: Tree
    residuals: dict[str, jax.Array]
    stashes: dict[str, jax.Array]


def run_when(active: jax.Array, action: Callable[[Tree, Tree], Tree], state: Tree, inputs: Tree) -> Tree:
    """`action(state, inputs)` if `active`, else `state`, as a `while_loop` of zero or one trips: XLA updates a
    loop's carry in place, where a `cond`'s branches would return new buffers and the stage's residual pools
    would be copied around every slot. `inputs` go through an optimization barrier with the trip counter, so
    that XLA cannot hoist the action's work on them out of the loop (it would then run in every slot)."""

    def once(carry):
        count, state = carry
        count, inputs_now = jax.lax.optimization_barrier((count, inputs))
        return count + 1, action(state, inputs_now)

    return jax.lax.while_loop(lambda carry: carry[0] < active.astype(jnp.int32), once, (jnp.int32(0), state))[1]


def write(pools: dict[str, jax.Array], index: jax.Array, values: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {name: pool.at[index].set(values[name]) for name, pool in pools.items()}


def make_pipeline_gradients(parts: BlockParts, layout: StageLayout, slots: SlotProgram, microbatches: int,
                            loss: str, policy: Policy, link: StageLink, remat: str = "full", objective: Any = None,
                            across: Callable[[jax.Array], jax.Array] | None = None) -> Callable:
    """(params, batch, key, scale, total_weight) -> (grads, loss sums) for this device's stage, where
    `batch` is the replica's [accumulation microbatches, rows, ...] and params are this stage's. `remat`:
    "full" recomputes each chunk's forward in its backward slot, "none" keeps its residuals instead.
    `objective`: ModelDef.reports of a model whose blocks report, whose reports travel with the activations
    (chunks.StageReports); `across` sums a value over the microbatch's replicas."""
    keep_residuals = {"none": True, "full": False}[remat]
    if slots.splits_backward and not keep_residuals:
        raise ValueError("a schedule that splits the backward into B and W keeps the forward's residuals: remat none")
    width = layout.width

    def compute(tree: Tree) -> Tree:
        return cast_floats(tree, policy.compute)

    def chunk_keys(microbatch_key: jax.Array, start: jax.Array) -> jax.Array:
        """The dropout keys of a chunk's blocks (and padding): those BlockStack gives the same layers."""
        keys_L = layer_keys(microbatch_key, layout.layers)
        padded = jnp.concatenate([keys_L, jnp.zeros((width, *keys_L.shape[1:]), keys_L.dtype)])
        return jax.lax.dynamic_slice_in_dim(padded, start, width)

    def run_round(blocks: Tree, rest: dict, batch: dict, key: jax.Array, scale: jax.Array,
                  total_weight: jax.Array, totals: tuple, x_shape: Tree, reports: Any) -> tuple:
        """One accumulation microbatch cut into `microbatches` pieces, through every slot of the schedule."""
        stage = jax.lax.axis_index(STAGE)
        micro = split_rows(batch, microbatches)
        tables = {name: jnp.asarray(table) for name, table in slots.tables().items()}
        chunk_table = jnp.asarray(layout.chunk_table)
        starts = jnp.asarray(layout.starts)
        active_blocks = None if layout.even else jnp.asarray(layout.partition, jnp.int32)
        cr = compute(rest)
        reporting = reports is not None
        arguments = chunk_arguments(compute(jax.tree.map(lambda b: b[0], blocks)), cr, x_shape,
                                    jax.tree.map(lambda x: x[0], micro), chunk_keys(key, jnp.int32(0)),
                                    None if active_blocks is None else active_blocks[0],
                                    layers=chunk_layers(parts, jnp.int32(0), width, reporting))
        traced = trace_chunks(parts, policy, loss, arguments, keep_residuals, reports)
        layouts = residual_layouts(traced) if keep_residuals else {}
        kept_counts = buffer_counts(list(layouts.values()))
        splits = backward_splits(traced) if slots.splits_backward else {}
        stash_counts = buffer_counts([split.stash_layout for split in splits.values()])
        nothing = zeros_of(x_shape)
        one = jnp.ones((), jnp.float32)
        pools = (pool_of(x_shape, slots.activation_buffers + 1), pool_of(x_shape, slots.cotangent_buffers + 1),
                 empty_buffers(kept_counts, slots.residual_buffers + 1),
                 empty_buffers(stash_counts, slots.stash_buffers + 1))

        def slot(carry, t):
            (activations, cotangents, residuals, stashes), totals = carry
            at = {name: table[t, stage] for name, table in tables.items()}
            j, r = at["microbatch"], at["round"]
            chunk = chunk_table[r, stage]
            inputs = SlotInputs(compute(jax.tree.map(lambda b: b[r], blocks)), cr,
                                read(activations, at["activation_read"]), read(cotangents, at["cotangent_read"]),
                                jax.tree.map(lambda x: x[j], micro), j,
                                starts[chunk], None if active_blocks is None else active_blocks[chunk])

            def run_chunk(kind, i, x):
                """(output, pullback) of the chunk on microbatch i: its dropout keys derived here, in the action."""
                keys = chunk_keys(jax.random.fold_in(key, i.microbatch), i.start)
                return traced[kind](i.cb, i.cr, x, i.micro, keys, i.active, scale, total_weight,
                                    chunk_layers(parts, i.start, width, reporting))

            def add(totals, grad_blocks=None, grad_rest=None, sums=None):
                g_blocks, g_rest, s = totals
                if grad_blocks is not None:
                    g_blocks = jax.tree.map(lambda acc, g: acc.at[r].add(g.astype(jnp.float32)), g_blocks, grad_blocks)
                if grad_rest is not None:
                    g_rest = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), g_rest, grad_rest)
                if sums is not None:
                    s = jax.tree.map(jnp.add, s, sums)
                return g_blocks, g_rest, s

            def forward_of(kind, state, i, x):
                """(output, state): the output, and with remat: none the state keeping what its backward needs."""
                out, pullback = run_chunk(kind, i, x)
                if not keep_residuals:
                    return out, state
                kept = pack(layouts[kind].kept_from(pullback), kept_counts)
                return out, state._replace(residuals=write(state.residuals, at["residual_write"], kept))

            def pullback_of(kind, state, i, x):
                """The chunk's pullback: from its recomputed forward, or from the residuals its forward kept."""
                pullback = run_chunk(kind, i, x)[1]
                if not keep_residuals:
                    return pullback
                kept = {name: pool[at["residual_read"]] for name, pool in state.residuals.items()}
                return layouts[kind].with_kept(pullback, unpack(kept, layouts[kind]))

            def forward_first(state, i):
                y, state = forward_of("first", state, i, nothing)
                return state._replace(to_next=y)

            def forward(state, i):
                y, state = forward_of("middle", state, i, i.x_in)
                return state._replace(to_next=y)

            def forward_last(state, i):
                (_, sums), state = forward_of("last", state, i, i.x_in)
                return state._replace(totals=add(state.totals, sums=sums))

            def backward_first(state, i):
                grad_blocks, grad_rest, _ = pullback_of("first", state, i, nothing)(i.dy)
                return state._replace(totals=add(state.totals, grad_blocks, grad_rest))

            def backward(state, i):
                grad_blocks, dx = pullback_of("middle", state, i, i.x_in)(i.dy)
                return state._replace(totals=add(state.totals, grad_blocks), to_previous=dx)

            def backward_last(state, i):
                grad_blocks, grad_rest, dx = pullback_of("last", state, i, i.x_in)(one)
                return state._replace(totals=add(state.totals, grad_blocks, grad_rest), to_previous=dx)

            def input_of(kind, i):
                """The activation entering the chunk: the first chunk's is zeros added to its embedding."""
                return nothing if kind == "first" else i.x_in

            def split_backward(kind):
                def run(state, i):
                    pullback = pullback_of(kind, state, i, input_of(kind, i))
                    dx, stash = splits[kind].b(pullback, one if kind == "last" else i.dy)
                    state = state._replace(stashes=write(state.stashes, at["stash_write"], pack(stash, stash_counts)))
                    return state if kind == "first" else state._replace(to_previous=dx)

                return run

            def weight_gradients(kind):
                def run(state, i):
                    stash_in = {name: pool[at["stash_read"]] for name, pool in state.stashes.items()}
                    stash = unpack(stash_in, splits[kind].stash_layout)
                    grads = splits[kind].w(pullback_of(kind, state, i, input_of(kind, i)), stash)
                    return state._replace(totals=add(state.totals, *grads))

                return run

            actions = {Branch.FORWARD_FIRST: forward_first, Branch.FORWARD: forward, Branch.FORWARD_LAST: forward_last}
            if slots.splits_backward:
                actions |= {Branch.BACKWARD_FIRST: split_backward("first"), Branch.BACKWARD: split_backward("middle"),
                            Branch.BACKWARD_LAST: split_backward("last"),
                            Branch.WEIGHT_FIRST: weight_gradients("first"), Branch.WEIGHT: weight_gradients("middle"),
                            Branch.WEIGHT_LAST: weight_gradients("last")}
            else:
                actions |= {Branch.BACKWARD_FIRST: backward_first, Branch.BACKWARD: backward,
                            Branch.BACKWARD_LAST: backward_last}
            state = SlotState(totals, nothing, nothing, residuals, stashes)
            for branch, action in actions.items():
                state = run_when(at["branch"] == branch, scoped(branch.name.lower(), action), state, inputs)
            received = hand_over(link, slots, stage, r, state.to_next, gradient=False)
            returned = hand_over(link, slots, stage, r, state.to_previous, gradient=True)
            pools = (receive(activations, received, at["activation_write"], at["activation_write_reverse"]),
                     receive(cotangents, returned, at["cotangent_write"], at["cotangent_write_reverse"]),
                     state.residuals, state.stashes)
            return (pools, state.totals), None

        return jax.lax.scan(scoped("pipeline_slot", slot), (pools, totals), jnp.arange(slots.slots))[0][1]

    def gradients(params: dict, batch: dict, key: jax.Array, scale: jax.Array, total_weight: jax.Array):
        blocks, rest = stage_blocks(params)
        count = jax.tree.leaves(batch)[0].shape[0]
        micro = split_rows(jax.tree.map(lambda x: x[0], batch), microbatches)
        reports = stage_reports(parts, policy, objective, across, microbatches * count,
                                jax.tree.map(lambda b: b[0, 0], blocks), rest, jax.tree.map(lambda x: x[0], micro))
        x_shape, sums_shape = microbatch_shapes(parts, policy, loss, blocks, rest, micro, reports)
        totals = (jax.tree.map(lambda b: jnp.zeros(b.shape, jnp.float32), blocks),
                  jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), rest), zeros_of(sums_shape))
        if count == 1:
            totals = run_round(blocks, rest, jax.tree.map(lambda x: x[0], batch), key, scale, total_weight, totals,
                               x_shape, reports)
        else:
            def one(totals, indexed):
                index, round_batch = indexed
                return run_round(blocks, rest, round_batch, jax.random.fold_in(key, index), scale, total_weight,
                                 totals, x_shape, reports), None

            totals = jax.lax.scan(one, totals, (jnp.arange(count), batch))[0]
        grad_blocks, grad_rest, sums = totals
        grad_rest, sums = link.sum_tree((grad_rest, sums))
        return {**grad_rest, BLOCKS: jax.tree.map(lambda g: g[:, None], grad_blocks)}, sums

    return gradients
