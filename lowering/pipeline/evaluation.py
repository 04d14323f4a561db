"""A pipelined model's evaluation: a forward-only slot program through the stages, each holding only its own
chunks."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from xlatrain.lowering.pipeline.chunks import (
    chunk_functions,
    chunk_layers,
    microbatch_shapes,
    scoped,
    split_rows,
    stage_blocks,
    stage_reports,
    zeros_of,
)
from xlatrain.lowering.pipeline.stage_link import StageLink, hand_over, pool_of, read, receive

from xlatrain.mesh import STAGE
from xlatrain.models.blocks import BlockParts
from xlatrain.pipeline.layout import StageLayout
from xlatrain.pipeline.slots import Branch, SlotProgram
from xlatrain.precision import Policy, cast_floats


def make_pipeline_eval(parts: BlockParts, layout: StageLayout, slots: SlotProgram, microbatches: int, loss: str,
                       policy: Policy, link: StageLink, objective: Any = None) -> Callable:
    """(params, batch) -> this replica's loss sums, where `batch` is its [rows, ...] and params this stage's:
    the rows cut into `microbatches` pieces go through a forward-only slot program, each stage running
    only its own chunks (no device holds another stage's blocks); the last chunk's sums are added over the
    stages. `objective`: ModelDef.reports of a model whose blocks report, whose reports pass between the stages
    (and are not part of the evaluated loss)."""
    def evaluate(params: dict, batch: dict) -> dict:
        blocks, rest = stage_blocks(params)
        micro = split_rows(batch, microbatches)
        reports = stage_reports(parts, policy, objective, None, microbatches, jax.tree.map(lambda b: b[0, 0], blocks),
                                rest, jax.tree.map(lambda x: x[0], micro))
        x_shape, sums_shape = microbatch_shapes(parts, policy, loss, blocks, rest, micro, reports)
        stage = jax.lax.axis_index(STAGE)
        tables = {name: jnp.asarray(table) for name, table in slots.tables().items()}
        chunk_table = jnp.asarray(layout.chunk_table)
        starts = jnp.asarray(layout.starts)
        active_blocks = None if layout.even else jnp.asarray(layout.partition, jnp.int32)
        cr = cast_floats(rest, policy.compute)
        nothing = zeros_of(x_shape)
        one = jnp.ones((), jnp.float32)

        def slot(carry, t):
            activations, sums = carry
            at = {name: table[t, stage] for name, table in tables.items()}
            r = at["round"]
            chunk = chunk_table[r, stage]
            cb = cast_floats(jax.tree.map(lambda b: b[r], blocks), policy.compute)
            functions = chunk_functions(parts, policy, loss, jax.tree.map(lambda x: x[at["microbatch"]], micro),
                                        None, None if active_blocks is None else active_blocks[chunk], one, one,
                                        chunk_layers(parts, starts[chunk], layout.width, reports is not None),
                                        reports)
            x_in = read(activations, at["activation_read"])

            def last(sums):
                return jax.tree.map(jnp.add, sums, functions["last"](cb, cr, x_in)[1]), nothing

            branches = {Branch.IDLE: lambda sums: (sums, nothing),
                        Branch.FORWARD_FIRST: lambda sums: (sums, functions["first"](cb, cr, nothing)),
                        Branch.FORWARD: lambda sums: (sums, functions["middle"](cb, x_in)),
                        Branch.FORWARD_LAST: last}
            sums, to_next = jax.lax.switch(
                at["branch"], [scoped(b.name.lower(), branches[b]) for b in sorted(branches)], sums)
            arrivals = hand_over(link, slots, stage, r, to_next, gradient=False)
            return (receive(activations, arrivals, at["activation_write"], at["activation_write_reverse"]), sums), None

        pool = pool_of(x_shape, slots.activation_buffers + 1)
        sums = jax.lax.scan(scoped("pipeline_slot", slot), (pool, zeros_of(sums_shape)), jnp.arange(slots.slots))[0][1]
        return link.sum_tree(sums)

    return evaluate
