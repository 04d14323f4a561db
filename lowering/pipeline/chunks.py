"""What a stage runs in a slot: each kind of chunk (first, middle, last) as a function of its inputs, traced
with its VJP once (`TracedChunk`), what it keeps for its backward, and what passes between stages: the activation,
and for a model whose blocks report (an MoE's router statistics) every layer's reports so far (`StageReports`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from xlatrain.lowering.pipeline.residuals import ResidualLayout, saving_matmuls
from xlatrain.lowering.pipeline.split_backward import BackwardSplit, abstract_value, split_pullback
from xlatrain.lowering.step import loss_sums, reported_objective

from xlatrain.compat.jaxprs import evaluate, without_exact_roundings
from xlatrain.models.blocks import BLOCKS, BlockParts, layer_numbers, split_blocks
from xlatrain.models.interface import documents_of
from xlatrain.precision import Policy, cast_floats

Tree = Any


@dataclass(frozen=True)
class StageReports:
    """A model whose blocks report (ModelDef.reports: an MoE's router statistics) in a pipeline. What passes
    between the stages is (the activation, every layer's reports so far, stacked [layers, ...], zeros for the layers
    not yet run): each chunk adds its layers', and the last turns them into the layers' losses over the global
    microbatch as the unpipelined step does (lowering/step.py). The auxiliary loss multiplies sums over every layer,
    so a stage's router gradient needs the later stages' loads: they come back with the activation's gradient."""

    objective: Any
    """ModelDef.reports (RouterBalance), whose objective(reports, across) is (this replica's loss, its metric sums)."""
    layer: Any
    """One layer's report, abstract."""
    layers: int
    across: Callable[[jax.Array], jax.Array] | None
    """A value summed over the replicas of the microbatch (and the devices that share its rows); None at evaluation,
    whose loss is the model's alone (as the unpipelined eval step's)."""
    microbatches: int
    """Every microbatch of the step: pipeline microbatches x gradient-accumulation rounds (each microbatch's loss
    is over its global rows, the step's their mean, as transformers' Trainer accumulates)."""

    def carried(self, x: Any) -> tuple:
        """The first chunk's input: the activation and no reports yet."""
        return x, jax.tree.map(lambda r: jnp.zeros((self.layers, *r.shape), r.dtype), self.layer)

    @staticmethod
    def add(carried: tuple, out: tuple, numbers: jax.Array) -> tuple:
        """The chunk's output `out` (activation, its layers' reports) added to what came in; a padded chunk's
        layers past the last report nothing."""
        x, found = out
        return x, jax.tree.map(lambda all_, mine: all_.at[numbers].add(mine, mode="drop"), carried[1], found)

    def objective_of(self, carried: tuple, scale: jax.Array, total_weight: jax.Array) -> tuple:
        """(the layers' scaled loss, their metric sums) of the last chunk's reports."""
        return reported_objective(self.objective, carried[1], self.across, scale, total_weight, self.microbatches)


def activation_of(carried: Any) -> jax.Array:
    """The activation of what passes between stages (with or without reports)."""
    return carried[0] if isinstance(carried, tuple) else carried


def scoped(name: str, fn: Callable) -> Callable:
    """`fn` with its ops under `jax.named_scope(name)`: what a profile's trace and the HLO call them."""

    def run(*args):
        with jax.named_scope(name):
            return fn(*args)

    return run


KINDS = ("first", "middle", "last")
"""The kinds of chunk: the first starts from the tokens, the last ends in the loss."""


SCALAR = jax.ShapeDtypeStruct((), jnp.float32)
"""The loss scale and total weight, traced as the step's are."""


def chunk_functions(parts: BlockParts, policy: Policy, loss: str, micro_j: dict, keys: jax.Array | None,
                    active: jax.Array | None, scale: jax.Array, total_weight: jax.Array,
                    layers: jax.Array | None = None, reports: StageReports | None = None) -> dict[str, Callable]:
    """Each kind of chunk for microbatch j, as a function of what it is differentiated by (`chunk_inputs`):
    the block params `cb` and other params `cr`, both cast to the compute dtype, and the input `x` (the activation,
    or with `reports` the activation and the reports so far). The first chunk's `x` is zeros added to its
    embedding, so that its pullback too has an input gradient, which a split backward's B computes through the
    chunk's blocks (XLA folds the addition away). The last returns the scaled loss and, as aux, the loss sums (and
    the layers' losses and metric sums, with `reports`). `layers`: the chunk's layer numbers, for a model whose
    blocks take them or report (chunk_layers)."""

    documents = documents_of(micro_j)

    def run(cb, x):
        out = parts.run(cb, activation_of(x), keys, active, documents, layers if parts.numbered else None)
        return out if reports is None else reports.add(x, out, layers)

    def embed(cb, cr):
        return parts.before({**cr, BLOCKS: cb}, cast_floats(micro_j["inputs"], policy.compute), documents)

    def first(cb, cr, x):
        embedded = embed(cb, cr) + activation_of(x)
        return run(cb, embedded if reports is None else (embedded, x[1]))

    def last(cb, cr, x):
        y = run(cb, x)
        outputs = parts.after({**cr, BLOCKS: cb}, activation_of(y)).astype(policy.output)
        sums = loss_sums(outputs, micro_j, loss)
        objective = sums["loss"] * scale / total_weight
        if reports is None or reports.across is None:
            return objective, sums
        layer_loss, layer_sums = reports.objective_of(y, scale, total_weight)
        return objective + layer_loss, {**sums, **layer_sums}

    return {"first": first, "middle": run, "last": last}


def chunk_inputs(kind: str, cb: Tree, cr: dict, x: jax.Array) -> tuple:
    return {"first": (cb, cr, x), "middle": (cb, x), "last": (cb, cr, x)}[kind]


def vjp_of(kind: str, fn: Callable, inputs: tuple, keep: bool = False) -> tuple:
    """(output, pullback); the last kind's output is (scaled loss, loss sums). `keep`: the pullback's residuals
    are to be kept until a later slot, so they are only what the matmuls computed (`saving_matmuls`)."""
    out, pullback, *aux = jax.vjp(saving_matmuls(fn) if keep else fn, *inputs, has_aux=kind == "last")
    return ((out, *aux) if aux else out), pullback


def chunk_arguments(cb: Tree, cr: dict, x: Any, micro_j: dict, keys: Any, active: Any, scale: Any = SCALAR,
                    total_weight: Any = SCALAR, layers: Any = None) -> tuple:
    """What a traced chunk takes (`TracedChunk`), in its order; the microbatch's data are at DATA_ARGUMENTS."""
    return cb, cr, x, micro_j, keys, active, scale, total_weight, layers


DATA_ARGUMENTS = (2, 3, 4, 5, 8)


def chunk_layers(parts: BlockParts, first: jax.Array | int, width: int, reporting: bool = False) -> jax.Array | None:
    """The numbers of a chunk's `width` layers from `first` on, where the model's blocks read their kind from them
    or `reporting` (their reports go to their layers' places; None otherwise); a padded chunk's numbers past the last
    layer belong to blocks that do not run."""
    return layer_numbers(parts.numbered or reporting, first, width)


@dataclass(frozen=True)
class TracedChunk:
    """One kind of chunk's forward and VJP (`vjp_of`), traced once: (chunk_arguments) -> (output, pullback).
    Every slot that runs that kind evaluates this program instead of tracing the model and differentiating it
    again, which took most of a pipelined step's tracing time (a step's slot runs up to nine actions)."""

    program: Any
    """The closed jaxpr, from the arguments' leaves to those of (output, pullback), without the float32 residuals'
    roundings to their own precision (without_exact_roundings: 2% of a 1f1b step's time on CPU)."""
    arguments: tuple
    """The arguments it was traced with, abstract (jax.ShapeDtypeStruct leaves)."""
    results: Any

    @staticmethod
    def of(fn: Callable, arguments: tuple) -> TracedChunk:
        leaves, tree = jax.tree.flatten(arguments)
        results = []

        def flat(*leaves):
            out, result_tree = jax.tree.flatten(fn(*jax.tree.unflatten(tree, leaves)))
            results.append(result_tree)
            return out

        abstract = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        program = without_exact_roundings(jax.make_jaxpr(flat)(*abstract))
        return TracedChunk(program, jax.tree.unflatten(tree, abstract), results[0])

    def __call__(self, *arguments: Any) -> tuple:
        leaves, tree = jax.tree.flatten(arguments)
        if tree != jax.tree.structure(self.arguments):
            raise AssertionError(f"a chunk traced with arguments {jax.tree.structure(self.arguments)} is run with "
                                 f"{tree}")
        return jax.tree.unflatten(self.results, evaluate(self.program, leaves))


def trace_chunks(parts: BlockParts, policy: Policy, loss: str, arguments: tuple, keep: bool,
                 reports: StageReports | None = None) -> dict[str, TracedChunk]:
    """Each kind of chunk traced from `arguments` (chunk_arguments; any may be abstract). `keep`: with
    remat: none, its pullback's residuals are kept from the forward slot to the backward slot."""

    def traced(kind):
        def forward_and_pullback(cb, cr, x, micro_j, keys, active, scale, total_weight, layers):
            functions = chunk_functions(parts, policy, loss, micro_j, keys, active, scale, total_weight, layers,
                                        reports)
            return vjp_of(kind, functions[kind], chunk_inputs(kind, cb, cr, x), keep)

        return TracedChunk.of(forward_and_pullback, arguments)

    return {kind: traced(kind) for kind in KINDS}


def residual_layouts(chunks: dict[str, TracedChunk]) -> dict[str, ResidualLayout]:
    """What each kind of chunk keeps from its forward slot to its backward slot with remat: none."""
    return {kind: ResidualLayout.of(_pullback(chunk), chunk.arguments, data=DATA_ARGUMENTS)
            for kind, chunk in chunks.items()}


def backward_splits(chunks: dict[str, TracedChunk]) -> dict[str, BackwardSplit]:
    """Each kind of chunk's backward split into B and W (lowering/pipeline/split_backward.py)."""
    return {kind: split_pullback(abstract_value(_pullback(chunk), *chunk.arguments),
                                 SCALAR if kind == "last" else chunk.arguments[2])
            for kind, chunk in chunks.items()}


def _pullback(chunk: TracedChunk) -> Callable:
    return lambda *arguments: chunk(*arguments)[1]


def split_rows(batch: dict, microbatches: int) -> dict:
    """[rows, ...] -> [microbatches, rows / microbatches, ...]"""
    return jax.tree.map(lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]), batch)


def stage_blocks(params: dict) -> tuple[Tree, dict]:
    """This stage's blocks [virtual stages, width, ...] and the other params, from its [v, 1, width, ...] share."""
    staged, rest = split_blocks(params)
    return jax.tree.map(lambda b: b[:, 0], staged), rest


def microbatch_shapes(parts: BlockParts, policy: Policy, loss: str, blocks: Tree, rest: dict,
                      micro: dict, reports: StageReports | None = None) -> tuple[Tree, Tree]:
    """What passes between stages and the loss sums (and the layers' metric sums), for one of `micro`'s
    [microbatches, ...]."""

    def one_microbatch():
        first = jax.tree.map(lambda x: x[0], micro)
        chunk = cast_floats({**rest, BLOCKS: jax.tree.map(lambda b: b[0], blocks)}, policy.compute)
        x = parts.before(chunk, cast_floats(first["inputs"], policy.compute), documents_of(first))
        sums = loss_sums(parts.after(chunk, x).astype(policy.output), first, loss)
        if reports is None:
            return x, sums
        carried = reports.carried(x)
        if reports.across is None:
            return carried, sums
        return carried, {**sums, **reports.objective_of(carried, jnp.ones(()), jnp.ones(()))[1]}

    return jax.eval_shape(one_microbatch)


def stage_reports(parts: BlockParts, policy: Policy, objective: Any, across: Callable[[jax.Array], jax.Array] | None,
                  microbatches: int, block: Tree, rest: dict, micro_j: dict) -> StageReports | None:
    """What passes between the stages beside the activation for a model whose blocks report (`objective`:
    ModelDef.reports), None for others; `block`: one layer's params, `micro_j`: one microbatch (either may be
    abstract)."""
    if objective is None:
        return None

    def one_layer(block, rest, micro_j):
        block, rest = cast_floats((block, rest), policy.compute)
        x = parts.before({**rest, BLOCKS: block}, cast_floats(micro_j["inputs"], policy.compute), documents_of(micro_j))
        return parts.layer(block, x, None, documents_of(micro_j), jnp.int32(0) if parts.numbered else None)[1]

    return StageReports(objective, jax.eval_shape(one_layer, block, rest, micro_j), parts.layers, across,
                        microbatches)


def zeros_of(shapes: Tree) -> Tree:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
