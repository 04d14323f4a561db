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
(lowering/residuals.py: the matmuls' results) until the backward slot, which only runs the pullback. Either
way the last chunk's backward starts from the scaled loss, exactly as the unpipelined step's `grad` does, and
every chunk is differentiated with respect to its parameters cast to the compute dtype (the cast's transpose
takes the gradient back to float32). Each kind of chunk (first, middle, last) is traced with its VJP once
(`TracedChunk`), and every action evaluates that program: the model's Python runs three times per step's trace,
not once per kind of action.

Gradients come out float32, summed over microbatches (and gradient-accumulation rounds): the blocks' on
their own stage, the rest (embeddings, head) summed over the stages; the loss sums likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from xlatrain.lowering.residuals import ResidualLayout, buffer_counts, empty_buffers, pack, saving_matmuls, unpack
from xlatrain.lowering.split_backward import BackwardSplit, abstract_value, split_pullback
from xlatrain.lowering.step import loss_sums

from xlatrain import compat
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


def scoped(name: str, fn: Callable) -> Callable:
    """`fn` with its ops under `jax.named_scope(name)`: what a profile's trace and the HLO call them."""

    def run(*args):
        with jax.named_scope(name):
            return fn(*args)

    return run


def stage_link(stages: int, impl: str, timeout_s: float) -> StageLink:
    if impl == "custom":
        from xlatrain import custom_calls as ops

        return StageLink(stages, lambda x, perm: ops.ppermute(x, STAGE, perm, timeout_s=timeout_s),
                         lambda x: ops.all_reduce(x, STAGE, timeout_s=timeout_s))
    return StageLink(stages, lambda x, perm: jax.lax.ppermute(x, STAGE, perm), lambda x: jax.lax.psum(x, STAGE))


@dataclass(frozen=True)
class StagedTrees:
    """Parameter-shaped trees whose blocks are split over the stages (the rest is the same on every
    stage): a norm adds the stages' parts. With FSDP the params are also split over `data`:
    `gather` assembles a stage's whole share first."""

    link: StageLink
    gather: Callable[[Tree], Tree] = lambda params: params

    def param_norm(self, params: dict) -> jax.Array:
        return self.norm(self.gather(params))

    def norm(self, tree: dict) -> jax.Array:
        blocks, rest = split_blocks(tree)
        return jnp.sqrt(self.link.sum(optax.tree.norm(blocks, squared=True)) + optax.tree.norm(rest, squared=True))


KINDS = ("first", "middle", "last")
"""The kinds of chunk: the first starts from the tokens, the last ends in the loss."""


SCALAR = jax.ShapeDtypeStruct((), jnp.float32)
"""The loss scale and total weight, traced as the step's are."""


def chunk_functions(parts: BlockParts, policy: Policy, loss: str, micro_j: dict, keys: jax.Array | None,
                    active: jax.Array | None, scale: jax.Array, total_weight: jax.Array) -> dict[str, Callable]:
    """Each kind of chunk for microbatch j, as a function of what it is differentiated by (`chunk_inputs`):
    the block params `cb` and other params `cr`, both cast to the compute dtype, and the input activation `x`.
    The first chunk's `x` is zeros added to its embedding, so that its pullback too has an input gradient,
    which a split backward's B computes through the chunk's blocks (XLA folds the addition away).
    The last returns the scaled loss and, as aux, the loss sums."""

    def run(cb, x):
        return parts.run(cb, x, keys, active)

    def embed(cb, cr):
        return parts.before({**cr, BLOCKS: cb}, cast_floats(micro_j["inputs"], policy.compute))

    def last(cb, cr, x):
        outputs = parts.after({**cr, BLOCKS: cb}, run(cb, x)).astype(policy.output)
        sums = loss_sums(outputs, micro_j, loss)
        return sums["loss"] * scale / total_weight, sums

    return {"first": lambda cb, cr, x: run(cb, embed(cb, cr) + x), "middle": run, "last": last}


def chunk_inputs(kind: str, cb: Tree, cr: dict, x: jax.Array) -> tuple:
    return {"first": (cb, cr, x), "middle": (cb, x), "last": (cb, cr, x)}[kind]


def vjp_of(kind: str, fn: Callable, inputs: tuple, keep: bool = False) -> tuple:
    """(output, pullback); the last kind's output is (scaled loss, loss sums). `keep`: the pullback's residuals
    are to be kept until a later slot, so they are only what the matmuls computed (`saving_matmuls`)."""
    out, pullback, *aux = jax.vjp(saving_matmuls(fn) if keep else fn, *inputs, has_aux=kind == "last")
    return ((out, *aux) if aux else out), pullback


def chunk_arguments(cb: Tree, cr: dict, x: Any, micro_j: dict, keys: Any, active: Any, scale: Any = SCALAR,
                    total_weight: Any = SCALAR) -> tuple:
    """What a traced chunk takes (`TracedChunk`), in its order; the microbatch's data are at DATA_ARGUMENTS."""
    return cb, cr, x, micro_j, keys, active, scale, total_weight


DATA_ARGUMENTS = (2, 3, 4, 5)


@dataclass(frozen=True)
class TracedChunk:
    """One kind of chunk's forward and VJP (`vjp_of`), traced once: (chunk_arguments) -> (output, pullback).
    Every slot that runs that kind evaluates this program instead of tracing the model and differentiating it
    again, which took most of a pipelined step's tracing time (a step's slot runs up to nine actions)."""

    program: Any
    """The closed jaxpr, from the arguments' leaves to those of (output, pullback), without the float32 residuals'
    roundings to their own precision (compat.without_exact_roundings: 2% of a 1f1b step's time on CPU)."""
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
        program = compat.without_exact_roundings(jax.make_jaxpr(flat)(*abstract))
        return TracedChunk(program, jax.tree.unflatten(tree, abstract), results[0])

    def __call__(self, *arguments: Any) -> tuple:
        leaves, tree = jax.tree.flatten(arguments)
        if tree != jax.tree.structure(self.arguments):
            raise AssertionError(f"a chunk traced with arguments {jax.tree.structure(self.arguments)} is run with "
                                 f"{tree}")
        return jax.tree.unflatten(self.results, compat.evaluate(self.program, leaves))


def trace_chunks(parts: BlockParts, policy: Policy, loss: str, arguments: tuple, keep: bool,
                 ) -> dict[str, TracedChunk]:
    """Each kind of chunk traced from `arguments` (chunk_arguments; any may be abstract). `keep`: with
    remat: none, its pullback's residuals are kept from the forward slot to the backward slot."""

    def traced(kind):
        def forward_and_pullback(cb, cr, x, micro_j, keys, active, scale, total_weight):
            functions = chunk_functions(parts, policy, loss, micro_j, keys, active, scale, total_weight)
            return vjp_of(kind, functions[kind], chunk_inputs(kind, cb, cr, x), keep)

        return TracedChunk.of(forward_and_pullback, arguments)

    return {kind: traced(kind) for kind in KINDS}


def residual_layouts(chunks: dict[str, TracedChunk]) -> dict[str, ResidualLayout]:
    """What each kind of chunk keeps from its forward slot to its backward slot with remat: none."""
    return {kind: ResidualLayout.of(_pullback(chunk), chunk.arguments, data=DATA_ARGUMENTS)
            for kind, chunk in chunks.items()}


def backward_splits(chunks: dict[str, TracedChunk]) -> dict[str, BackwardSplit]:
    """Each kind of chunk's backward split into B and W (lowering/split_backward.py)."""
    return {kind: split_pullback(abstract_value(_pullback(chunk), *chunk.arguments),
                                 SCALAR if kind == "last" else chunk.arguments[2])
            for kind, chunk in chunks.items()}


def _pullback(chunk: TracedChunk) -> Callable:
    return lambda *arguments: chunk(*arguments)[1]


class SlotInputs(NamedTuple):
    """What a slot's action reads: the chunk's blocks and the other params (in the compute dtype), its input
    activation and incoming gradient, the microbatch, where its dropout keys come from (the microbatch's index
    and the chunk's first layer: the action derives them, so a slot without an action, or a model without
    dropout, computes none) and its active blocks."""

    cb: Tree
    cr: dict
    x_in: jax.Array
    dy: jax.Array
    micro: dict
    microbatch: jax.Array
    start: jax.Array
    active: jax.Array | None


class SlotState(NamedTuple):
    """What a slot's action may change: the gradient and loss sums, what the stage sends to the next and the
    previous stage, and its pools of kept residuals and stashes."""

    totals: tuple
    to_next: jax.Array
    to_previous: jax.Array
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


def split_rows(batch: dict, microbatches: int) -> dict:
    """[rows, ...] -> [microbatches, rows / microbatches, ...]"""
    return jax.tree.map(lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]), batch)


def next_stage_pairs(slots: SlotProgram, stages: int) -> tuple[tuple[int, int], ...]:
    """(stage, next stage): where activations go; the last stage feeds the first when chunks wrap around."""
    return tuple((s, (s + 1) % stages) for s in range(stages if slots.ring else stages - 1))


def hand_over(link: StageLink, slots: SlotProgram, stage: jax.Array, round_: jax.Array, value: jax.Array,
              gradient: bool) -> tuple[jax.Array, jax.Array | None]:
    """What reaches this stage at the end of a slot (from the usual direction, and from the reverse one in a V)
    when every stage sends `value`: its output activation on to the next chunk, or with `gradient` its input
    gradient back to the previous chunk. In a loop activations go to the next stage and gradients to the
    previous one. In a V the first chunk of a stage (round 0) sends that way and the second the reverse way,
    except at the tip: the last stage's first chunk feeds its second, whose gradient comes back to it."""
    pairs = next_stage_pairs(slots, link.stages)
    usual_pairs = tuple((t, s) for s, t in pairs) if gradient else pairs
    if slots.placement == "loop":
        return link.ppermute(value, usual_pairs), None
    zero = jnp.zeros_like(value)
    first, second = jnp.where(round_ == 0, value, zero), jnp.where(round_ == 0, zero, value)
    usual = link.ppermute(first, usual_pairs)
    reverse = link.ppermute(second, tuple((t, s) for s, t in usual_pairs))
    tip = stage == link.stages - 1
    if gradient:
        return jnp.where(tip, second, usual), reverse
    return usual, jnp.where(tip, first, reverse)


def receive(pool: jax.Array, arrivals: tuple[jax.Array, jax.Array | None], write: jax.Array,
            write_reverse: jax.Array) -> jax.Array:
    """`pool` with `hand_over`'s arrivals stored where the slot program says (unused ones into its scratch)."""
    usual, reverse = arrivals
    pool = pool.at[write].set(usual)
    return pool if reverse is None else pool.at[write_reverse].set(reverse)


def stage_blocks(params: dict) -> tuple[Tree, dict]:
    """This stage's blocks [virtual stages, width, ...] and the other params, from its [v, 1, width, ...] share."""
    staged, rest = split_blocks(params)
    return jax.tree.map(lambda b: b[:, 0], staged), rest


def microbatch_shapes(parts: BlockParts, policy: Policy, loss: str, blocks: Tree, rest: dict,
                      micro: dict) -> tuple[jax.ShapeDtypeStruct, Tree]:
    """The activation passed between stages and the loss sums, for one of `micro`'s [microbatches, ...]."""

    def one_microbatch():
        first = jax.tree.map(lambda x: x[0], micro)
        chunk = cast_floats({**rest, BLOCKS: jax.tree.map(lambda b: b[0], blocks)}, policy.compute)
        x = parts.before(chunk, cast_floats(first["inputs"], policy.compute))
        return x, loss_sums(parts.after(chunk, x).astype(policy.output), first, loss)

    return jax.eval_shape(one_microbatch)


def zeros_of(shapes: Tree) -> Tree:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def make_pipeline_eval(parts: BlockParts, layout: StageLayout, slots: SlotProgram, microbatches: int, loss: str,
                       policy: Policy, link: StageLink) -> Callable:
    """(params, batch) -> this replica's loss sums, where `batch` is its [rows, ...] and params this stage's:
    the rows cut into `microbatches` pieces go through a forward-only slot program, each stage running
    only its own chunks (no device holds another stage's blocks); the last chunk's sums are added over the
    stages."""
    def evaluate(params: dict, batch: dict) -> dict:
        blocks, rest = stage_blocks(params)
        micro = split_rows(batch, microbatches)
        x_shape, sums_shape = microbatch_shapes(parts, policy, loss, blocks, rest, micro)
        stage = jax.lax.axis_index(STAGE)
        tables = {name: jnp.asarray(table) for name, table in slots.tables().items()}
        chunk_table = jnp.asarray(layout.chunk_table)
        active_blocks = None if layout.even else jnp.asarray(layout.partition, jnp.int32)
        cr = cast_floats(rest, policy.compute)
        nothing = jnp.zeros(x_shape.shape, x_shape.dtype)
        one = jnp.ones((), jnp.float32)

        def slot(carry, t):
            activations, sums = carry
            at = {name: table[t, stage] for name, table in tables.items()}
            r = at["round"]
            chunk = chunk_table[r, stage]
            cb = cast_floats(jax.tree.map(lambda b: b[r], blocks), policy.compute)
            functions = chunk_functions(parts, policy, loss, jax.tree.map(lambda x: x[at["microbatch"]], micro),
                                        None, None if active_blocks is None else active_blocks[chunk], one, one)
            x_in = activations[at["activation_read"]]

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

        pool = jnp.zeros((slots.activation_buffers + 1, *x_shape.shape), x_shape.dtype)
        sums = jax.lax.scan(scoped("pipeline_slot", slot), (pool, zeros_of(sums_shape)), jnp.arange(slots.slots))[0][1]
        return link.sum_tree(sums)

    return evaluate


def make_pipeline_gradients(parts: BlockParts, layout: StageLayout, slots: SlotProgram, microbatches: int,
                            loss: str, policy: Policy, link: StageLink, remat: str = "full") -> Callable:
    """(params, batch, key, scale, total_weight) -> (grads, loss sums) for this device's stage, where
    `batch` is the replica's [accumulation microbatches, rows, ...] and params are this stage's. `remat`:
    "full" recomputes each chunk's forward in its backward slot, "none" keeps its residuals instead."""
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
                  total_weight: jax.Array, totals: tuple, x_shape: jax.ShapeDtypeStruct) -> tuple:
        """One accumulation microbatch cut into `microbatches` pieces, through every slot of the schedule."""
        stage = jax.lax.axis_index(STAGE)
        micro = split_rows(batch, microbatches)
        tables = {name: jnp.asarray(table) for name, table in slots.tables().items()}
        chunk_table = jnp.asarray(layout.chunk_table)
        starts = jnp.asarray(layout.starts)
        active_blocks = None if layout.even else jnp.asarray(layout.partition, jnp.int32)
        cr = compute(rest)
        arguments = chunk_arguments(compute(jax.tree.map(lambda b: b[0], blocks)), cr, x_shape,
                                    jax.tree.map(lambda x: x[0], micro), chunk_keys(key, jnp.int32(0)),
                                    None if active_blocks is None else active_blocks[0])
        traced = trace_chunks(parts, policy, loss, arguments, keep_residuals)
        layouts = residual_layouts(traced) if keep_residuals else {}
        kept_counts = buffer_counts(list(layouts.values()))
        splits = backward_splits(traced) if slots.splits_backward else {}
        stash_counts = buffer_counts([split.stash_layout for split in splits.values()])
        nothing = jnp.zeros(x_shape.shape, x_shape.dtype)
        one = jnp.ones((), jnp.float32)
        pools = (jnp.zeros((slots.activation_buffers + 1, *x_shape.shape), x_shape.dtype),
                 jnp.zeros((slots.cotangent_buffers + 1, *x_shape.shape), x_shape.dtype),
                 empty_buffers(kept_counts, slots.residual_buffers + 1),
                 empty_buffers(stash_counts, slots.stash_buffers + 1))

        def slot(carry, t):
            (activations, cotangents, residuals, stashes), totals = carry
            at = {name: table[t, stage] for name, table in tables.items()}
            j, r = at["microbatch"], at["round"]
            chunk = chunk_table[r, stage]
            inputs = SlotInputs(compute(jax.tree.map(lambda b: b[r], blocks)), cr, activations[at["activation_read"]],
                                cotangents[at["cotangent_read"]], jax.tree.map(lambda x: x[j], micro), j,
                                starts[chunk], None if active_blocks is None else active_blocks[chunk])

            def run_chunk(kind, i, x):
                """(output, pullback) of the chunk on microbatch i: its dropout keys derived here, in the action."""
                keys = chunk_keys(jax.random.fold_in(key, i.microbatch), i.start)
                return traced[kind](i.cb, i.cr, x, i.micro, keys, i.active, scale, total_weight)

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
        x_shape, sums_shape = microbatch_shapes(parts, policy, loss, blocks, rest,
                                                split_rows(jax.tree.map(lambda x: x[0], batch), microbatches))
        totals = (jax.tree.map(lambda b: jnp.zeros(b.shape, jnp.float32), blocks),
                  jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), rest), zeros_of(sums_shape))
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
