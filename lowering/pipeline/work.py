"""How much work a pipelined step does, counted by XLA, beside the unpipelined model's.

XLA's cost analysis counts the body of a loop once, so the pipelined step's own program (a loop over time slots,
and in each slot a loop of zero or one trips per kind of action) cannot be counted whole. Instead every action
of the schedule (one chunk's forward or backward on one microbatch) is compiled on its own from abstract
shapes, exactly as the step's slot runs it (lowering/pipeline/gradients.py: with `remat: full` the backward
recomputes the forward, with `remat: none` it starts from the kept residuals; a split backward's B and W run
their parts of the pullback), and its FLOPs are summed over the table. The
reference is the gradient of the whole model on one microbatch, times the microbatches. Blocks run unrolled
here, for the same reason.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
from xlatrain.lowering.pipeline.chunks import (
    KINDS,
    StageReports,
    backward_splits,
    chunk_arguments,
    chunk_functions,
    chunk_layers,
    residual_layouts,
    stage_reports,
    trace_chunks,
)
from xlatrain.lowering.pipeline.residuals import ResidualLayout, buffer_counts, unpack

from xlatrain.compat.monitoring import cost_analysis
from xlatrain.models.blocks import BLOCKS, BlockParts, split_blocks
from xlatrain.models.interface import documents_of
from xlatrain.pipeline.schedule import Schedule
from xlatrain.precision import Policy, cast_floats
from xlatrain.runtime.platform import compiling_for


@dataclass(frozen=True)
class PipelineWork:
    pipelined_flops: float
    """One replica's step: every action of the table, for one gradient-accumulation microbatch."""
    unpipelined_flops: float
    """The model's gradient over the same microbatches, unpipelined."""

    @property
    def ratio(self) -> float:
        return self.pipelined_flops / self.unpipelined_flops


def pipeline_work(parts: BlockParts, abstract_params: dict, micro: dict[str, jax.ShapeDtypeStruct], loss: str,
                  policy: Policy, schedule: Schedule, partition: tuple[int, ...], remat: str,
                  objective: Any = None) -> PipelineWork:
    """`micro`: one pipeline microbatch's abstract batch; `partition`: blocks per chunk, in model order;
    `objective`: ModelDef.reports of a model whose blocks report (chunks.StageReports). Traced and compiled for the
    host's devices, also under `lower --target`."""
    with compiling_for(jax.default_backend()):
        return _pipeline_work(parts, abstract_params, micro, loss, policy, schedule, partition, remat, objective)


def _pipeline_work(parts: BlockParts, abstract_params: dict, micro: dict[str, jax.ShapeDtypeStruct], loss: str,
                   policy: Policy, schedule: Schedule, partition: tuple[int, ...], remat: str,
                   objective: Any) -> PipelineWork:
    unrolled = copy.copy(parts)
    unrolled.scan = False
    reports = chunk_reports(unrolled, abstract_params, micro, policy, objective)
    _, cr, x = abstract_chunk(unrolled, abstract_params, micro, policy, 1, reports)
    reporting = reports is not None
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    scales = (scalar, scalar)  # the loss scale and the total weight, as the step's chunks get them

    def cast_blocks(count: int) -> dict:
        return abstract_chunk(unrolled, abstract_params, micro, policy, count)[0]

    def keys_for(count: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((count, 2), jnp.uint32)

    @cache
    def traced(count: int) -> tuple:
        """A chunk of `count` blocks: each kind traced as the step traces it, and with remat: none what each kind
        keeps and how a split backward divides it."""
        arguments = chunk_arguments(cast_blocks(count), cr, x, micro, keys_for(count), None, *scales,
                                    chunk_layers(unrolled, 0, count, reporting))
        chunks = trace_chunks(unrolled, policy, loss, arguments, keep=remat == "none", reports=reports)
        layouts = residual_layouts(chunks) if remat == "none" else {}
        return chunks, layouts, backward_splits(chunks) if schedule.splits_backward else {}

    @cache
    def action_flops(kind: str, count: int, action: str) -> float:
        chunks, layouts, splits = traced(count)
        run = chunks[kind]
        arguments = run.arguments
        cotangent = scalar if kind == "last" else x
        if remat == "full":
            if action == "F":
                return _flops(lambda *a: run(*a)[0], *arguments)
            return _flops(lambda *a: run(*a[:-1])[1](a[-1]), *arguments, cotangent)
        layout = layouts[kind]
        if action == "F":
            return _flops(lambda *a: _kept_by(layout, *run(*a)), *arguments)

        def pullback(*a):
            """The pullback from the kept residuals (the last argument), as the backward slot runs it."""
            return layout.with_kept(run(*a[:-1])[1], unpack(a[-1], layout))

        kept = {name: jax.ShapeDtypeStruct((n,), name) for name, n in layout.counts().items()}
        if not splits:
            return _flops(lambda *a: pullback(*a[:-1])(a[-1]), *arguments, kept, cotangent)
        split = splits[kind]
        if action == "B":
            return _flops(lambda *a: split.b(pullback(*a[:-1]), a[-1]), *arguments, kept, cotangent)
        return _flops(lambda *a: split.w(pullback(*a[:-1]), a[-1]), *arguments, kept, split.split.stash_shapes())

    chunks = len(partition)
    pipelined = 0.0
    for row in schedule.table:
        for action in row:
            if action is None:
                continue
            kind = KINDS[0] if action.chunk == 0 else KINDS[2] if action.chunk == chunks - 1 else KINDS[1]
            pipelined += action_flops(kind, partition[action.chunk], action.kind)

    def whole_model(cb, cr, micro_j, keys, scales):
        def scaled_loss(cb, cr):
            embedded = unrolled.before({**cr, BLOCKS: cb}, cast_floats(micro_j["inputs"], policy.compute),
                                       documents_of(micro_j))
            return chunk_functions(unrolled, policy, loss, micro_j, keys, None, *scales,
                                   chunk_layers(unrolled, 0, layers, reporting), reports)["last"](
                cb, cr, embedded if reports is None else reports.carried(embedded))[0]

        return jax.grad(scaled_loss, argnums=(0, 1))(cb, cr)

    layers = sum(partition)
    unpipelined = schedule.microbatches * _flops(whole_model, cast_blocks(layers), cr, micro, keys_for(layers), scales)
    return PipelineWork(pipelined, unpipelined)


def _kept_by(layout: ResidualLayout, output: Any, pullback: Any) -> tuple:
    """What a forward slot keeps with remat: none: its output and its pullback's kept residuals."""
    return output, layout.kept_from(pullback)


def _flops(fn, *args) -> float:
    return float(cost_analysis(jax.jit(fn).lower(*args).compile()).get("flops", 0.0))


def residual_bytes(parts: BlockParts, abstract_params: dict, micro: dict[str, jax.ShapeDtypeStruct], loss: str,
                   policy: Policy, partition: tuple[int, ...], stash: bool = False, objective: Any = None) -> int:
    """Bytes of the buffers that hold one microbatch's residuals on a stage with remat: none (every kind of
    chunk fits them), for chunks as the step runs them (padded to the largest, and masked when unequal).
    `stash`: the bytes of the buffers that hold a split backward's stash from B to W instead."""
    width = max(partition)
    reports = chunk_reports(parts, abstract_params, micro, policy, objective)
    cb, cr, x = abstract_chunk(parts, abstract_params, micro, policy, width, reports)
    active = None if len(set(partition)) == 1 else jax.ShapeDtypeStruct((), jnp.int32)
    arguments = chunk_arguments(cb, cr, x, micro, jax.ShapeDtypeStruct((width, 2), jnp.uint32), active,
                                layers=chunk_layers(parts, 0, width, reports is not None))
    chunks = trace_chunks(parts, policy, loss, arguments, keep=True, reports=reports)
    layouts = ([split.stash_layout for split in backward_splits(chunks).values()] if stash
               else list(residual_layouts(chunks).values()))
    return sum(count * jnp.dtype(name).itemsize for name, count in buffer_counts(layouts).items())


def abstract_chunk(parts: BlockParts, abstract_params: dict, micro: dict[str, jax.ShapeDtypeStruct], policy: Policy,
                   count: int, reports: StageReports | None = None) -> tuple[dict, dict, Any]:
    """A chunk of `count` blocks' inputs as the step's slots get them, abstract: its blocks and the other params
    cast to the compute dtype, and what enters it (the activation, and with `reports` the reports so far)."""
    blocks, rest = split_blocks(abstract_params)
    resized = jax.tree.map(lambda b: jax.ShapeDtypeStruct((count, *b.shape[1:]), b.dtype), blocks)
    cb, cr = jax.eval_shape(lambda b, r: cast_floats((b, r), policy.compute), resized, rest)
    x = jax.eval_shape(lambda cb, cr, m: parts.before({**cr, BLOCKS: cb}, cast_floats(m["inputs"], policy.compute),
                                                      documents_of(m)), cb, cr, micro)
    return cb, cr, x if reports is None else jax.eval_shape(reports.carried, x)


def chunk_reports(parts: BlockParts, abstract_params: dict, micro: dict[str, jax.ShapeDtypeStruct], policy: Policy,
                  objective: Any) -> StageReports | None:
    """chunks.StageReports for counting a chunk's work (the layers' losses left out: they are a few sums)."""
    blocks, rest = split_blocks(abstract_params)
    return stage_reports(parts, policy, objective, None, 1,
                         jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype), blocks), rest, micro)
