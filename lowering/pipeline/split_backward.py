"""A chunk's backward split in two (Zero Bubble, arXiv 2401.10241): B, the gradient with respect to the chunk's
input, which the previous stage waits for, and W, the gradient with respect to its weights, which can wait.

The split works on the pullback's program (a jaxpr of (residuals, output cotangent) -> input cotangents): B runs
what the input gradient needs, and hands W the values W reads that B computed (for a matmul's weight gradient,
the cotangent of the matmul's output), its *stash*; W runs the rest. Nothing is computed twice. A `scan` whose
outputs both need (the backward of scanned layers) is cut into two scans: B's carries the input gradient
through the layers and stacks each iteration's stash; W's runs over those stacks and accumulates the weight
gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from xlatrain.lowering.pipeline.residuals import ResidualLayout

from xlatrain.compat.jaxprs import bind_equation

Var = Any
"""A jaxpr variable (or literal, as an equation's input or a jaxpr's output)."""


@dataclass(frozen=True, eq=False)
class StashStack:
    """A value made by a cut scan (one stash entry of its body, stacked over the iterations)."""

    shape: jax.ShapeDtypeStruct


@dataclass(frozen=True)
class SplitScan:
    """A scan equation both parts need: B's and W's scans over the split body."""

    equation: Any
    body: Split
    b_carries: tuple[int, ...]
    w_carries: tuple[int, ...]
    b_ys: tuple[int, ...]
    w_ys: tuple[int, ...]
    stash_stacks: tuple[StashStack, ...]
    """Names for the stacked per-iteration stash B's scan hands W's."""


@dataclass(frozen=True)
class Split:
    """One jaxpr's B and W parts. B computes outputs `b_outputs` and the `stash`; W computes `w_outputs` from
    the inputs flagged readable and the stash."""

    jaxpr: Any
    consts: tuple[Any, ...]
    b_steps: tuple[Any, ...]
    w_steps: tuple[Any, ...]
    b_outputs: tuple[int, ...]
    w_outputs: tuple[int, ...]
    stash: tuple[Var | StashStack, ...]
    w_reads: tuple[bool, ...]
    """Per input: whether W reads it."""

    def run_b(self, inputs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(B's outputs, the stash) from all the jaxpr's inputs."""
        env = self._environment(inputs)
        for step in self.b_steps:
            _run_b_step(step, env)
        return [_read(env, self.jaxpr.outvars[i]) for i in self.b_outputs], [env[v] for v in self.stash]

    def run_w(self, inputs: Sequence[Any], stash: Sequence[Any]) -> list[Any]:
        """W's outputs from the inputs (those W may not read can be anything of their shape) and the stash."""
        env = self._environment(inputs)
        env.update(zip(self.stash, stash, strict=True))
        for step in self.w_steps:
            _run_w_step(step, env)
        return [_read(env, self.jaxpr.outvars[i]) for i in self.w_outputs]

    def stash_shapes(self) -> list[jax.ShapeDtypeStruct]:
        return [v.shape if isinstance(v, StashStack) else jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                for v in self.stash]

    def _environment(self, inputs: Sequence[Any]) -> dict:
        env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        env.update(zip(self.jaxpr.invars, inputs, strict=True))
        return env


@dataclass(frozen=True)
class BackwardSplit:
    """A pullback (of a function whose last argument is its input activation) run as B, which returns the input
    activation's cotangent and the stash, and W, which returns the other arguments' cotangents from the stash."""

    split: Split
    pullback_tree: Any
    output_tree: Any
    input_leaves: int
    """How many of the pullback's flat outputs, at the end, are the input activation's cotangent."""

    @property
    def stash_layout(self) -> ResidualLayout:
        shapes = tuple(self.split.stash_shapes())
        return ResidualLayout((True,) * len(shapes), shapes)

    def b(self, pullback: Callable, cotangent: Any) -> tuple[Any, list[jax.Array]]:
        """(the input activation's cotangent, the stash)."""
        outputs, stash = self.split.run_b(self._inputs(pullback, jax.tree.leaves(cotangent)))
        return jax.tree.unflatten(self.output_tree.children()[-1], outputs), stash

    def w(self, pullback: Callable, stash: list[jax.Array]) -> tuple:
        """The cotangents of every argument but the last (W never reads the output's cotangent: what it needs
        of it is in the stash)."""
        cotangent = [_zeros(v.aval) for v in self.split.jaxpr.invars[-self._cotangents:]]
        outputs = self.split.run_w(self._inputs(pullback, cotangent), stash)
        return tuple(jax.tree.unflatten(tree, [outputs.pop(0) for _ in range(tree.num_leaves)])
                     for tree in self.output_tree.children()[:-1])

    @property
    def _cotangents(self) -> int:
        return len(self.split.jaxpr.invars) - self.pullback_tree.num_leaves

    def _inputs(self, pullback: Callable, cotangent_leaves: list) -> list:
        """The pullback's residuals and the cotangent, as the split's jaxpr takes them. A pullback traced again
        (in another slot) has a tree of its own (its jaxpr is another object), but the same residuals."""
        leaves = jax.tree.leaves(pullback)
        shapes = [(tuple(v.aval.shape), v.aval.dtype) for v in self.split.jaxpr.invars[:len(leaves)]]
        if len(leaves) != self.pullback_tree.num_leaves or shapes != [(tuple(x.shape), x.dtype) for x in leaves]:
            raise AssertionError("the chunk's pullback has other residuals than the one whose backward was split")
        return [*leaves, *cotangent_leaves]


def split_pullback(pullback: Callable, cotangent: Any) -> BackwardSplit:
    """The B/W split of `pullback` (from `jax.vjp` of a function whose last argument is its input activation;
    leaves may be abstract) called on `cotangent`. W may read every residual of the pullback: they stay
    until its slot."""
    leaves, tree = jax.tree.flatten(pullback)
    closed = jax.make_jaxpr(lambda res, ct: jax.tree.unflatten(tree, res)(ct))(leaves, cotangent)
    output_tree = jax.tree.structure(jax.eval_shape(lambda res, ct: jax.tree.unflatten(tree, res)(ct), leaves,
                                                    cotangent))
    input_leaves = output_tree.children()[-1].num_leaves
    outputs = len(closed.jaxpr.outvars)
    b_out = [i >= outputs - input_leaves for i in range(outputs)]
    readable = [True] * len(leaves) + [False] * len(jax.tree.leaves(cotangent))
    split = split_jaxpr(closed.jaxpr, tuple(closed.consts), b_out, [not b for b in b_out], readable)
    return BackwardSplit(split, tree, output_tree, input_leaves)


def abstract_value(fn: Callable, *args: Any) -> Any:
    """fn(*args) with its array leaves as jax.ShapeDtypeStruct (any pytree: a pullback too)."""
    trees = []

    def leaves_of(*a):
        leaves, tree = jax.tree.flatten(fn(*a))
        trees.append(tree)
        return leaves

    shapes = jax.eval_shape(leaves_of, *args)
    return jax.tree.unflatten(trees[0], shapes)


def split_jaxpr(jaxpr: Any, consts: tuple, b_out: Sequence[bool], w_out: Sequence[bool],
                w_readable: Sequence[bool]) -> Split:
    """Split `jaxpr` so that B computes the outputs flagged in `b_out` and W those in `w_out`; W reads only the
    inputs flagged in `w_readable` (and the consts), and the stash."""
    eqns = list(jaxpr.eqns)
    b_live = {v for v, b in zip(jaxpr.outvars, b_out) if b and _is_var(v)}
    b_needs: dict[int, list[bool]] = {}
    """Per equation B runs: which of its outputs B needs."""
    for index in reversed(range(len(eqns))):
        needed = [v in b_live for v in eqns[index].outvars]
        if any(needed):
            b_needs[index] = needed
            b_live.update(_inputs_of(eqns[index], needed))
    b_defined = {v for index in b_needs for v in eqns[index].outvars}

    readable = {v for v, r in zip(jaxpr.invars, w_readable) if r} | set(jaxpr.constvars)
    w_live = {v for v, w in zip(jaxpr.outvars, w_out) if w and _is_var(v)}
    stash: set = set()
    stacks: list[StashStack] = []
    w_steps: list[Any] = []
    b_steps: dict[int, Any] = {index: eqns[index] for index in b_needs}
    for index in reversed(range(len(eqns))):
        eqn = eqns[index]
        needed = [v in w_live for v in eqn.outvars]
        if not any(needed):
            continue
        if index in b_needs and _is_scan(eqn) and any(w and not b for w, b in zip(needed, b_needs[index])):
            scan = _split_scan(eqn, b_needs[index], [w and not b for w, b in zip(needed, b_needs[index])])
            b_steps[index] = scan
            w_steps.append(scan)
            stacks.extend(scan.stash_stacks)
            w_live.update(_scan_w_inputs(scan))
            stash.update(v for v, w, b in zip(eqn.outvars, needed, b_needs[index]) if w and b)
        elif index in b_needs:
            stash.update(v for v, w in zip(eqn.outvars, needed) if w)
        else:
            w_steps.append(eqn)
            w_live.update(_inputs_of(eqn, needed))
    w_defined = {v for step in w_steps for v in _w_defines(step)}
    stash.update(v for v in w_live if _is_var(v) and v not in readable and v not in w_defined)
    missing = [v for v in stash if v not in b_defined and v not in jaxpr.invars]
    if missing:
        raise AssertionError(f"W needs values neither B nor the inputs provide: {missing}")
    order = {v: i for i, v in enumerate(_definition_order(jaxpr))}
    w_reads = tuple(v in w_live and v in readable for v in jaxpr.invars)
    return Split(jaxpr, consts, tuple(b_steps[i] for i in sorted(b_steps)), tuple(reversed(w_steps)),
                 tuple(i for i, b in enumerate(b_out) if b), tuple(i for i, w in enumerate(w_out) if w),
                 (*sorted(stash, key=order.__getitem__), *stacks), w_reads)


def _split_scan(eqn: Any, b_needs: list[bool], w_needs: list[bool]) -> SplitScan:
    """Cut a scan whose outputs flagged in `b_needs` B needs and those in `w_needs` only W: B's scan keeps the
    carries B's outputs depend on, W's the rest; what W's body reads of B's carries is stashed per iteration."""
    params = eqn.params
    body, n_consts, n_carry = params["jaxpr"], params["num_consts"], params["num_carry"]
    b_carries = _carry_closure(body.jaxpr, n_consts, n_carry, {i for i in range(n_carry) if b_needs[i]})
    w_carries = _carry_closure(body.jaxpr, n_consts, n_carry, {i for i in range(n_carry) if w_needs[i]}) - b_carries
    n_ys = len(eqn.outvars) - n_carry
    b_ys = tuple(i for i in range(n_ys) if b_needs[n_carry + i])
    w_ys = tuple(i for i in range(n_ys) if w_needs[n_carry + i])
    body_b = [i in b_carries for i in range(n_carry)] + [i in b_ys for i in range(n_ys)]
    body_w = [i in w_carries for i in range(n_carry)] + [i in w_ys for i in range(n_ys)]
    readable = ([True] * n_consts + [i in w_carries for i in range(n_carry)]
                + [True] * (len(body.jaxpr.invars) - n_consts - n_carry))
    split = split_jaxpr(body.jaxpr, tuple(body.consts), body_b, body_w, readable)
    stacks = tuple(StashStack(jax.ShapeDtypeStruct((params["length"], *s.shape), s.dtype))
                   for s in split.stash_shapes())
    return SplitScan(eqn, split, tuple(sorted(b_carries)), tuple(sorted(w_carries)), b_ys, w_ys, stacks)


def _carry_closure(body: Any, n_consts: int, n_carry: int, wanted: set[int]) -> set[int]:
    """The carries the carry outputs in `wanted` depend on, across iterations (a fixed point)."""
    carries = set(wanted)
    carry_in = body.invars[n_consts:n_consts + n_carry]
    while True:
        live = _live_before(body.eqns, {body.outvars[i] for i in carries if _is_var(body.outvars[i])})
        grown = carries | {i for i, v in enumerate(carry_in) if v in live}
        if grown == carries:
            return carries
        carries = grown


def _scan_operands(step: SplitScan, env: dict) -> tuple[list, list, list]:
    """The split scan's consts, carries and xs from `env`; those the half being run does not read may be
    missing (None)."""
    eqn, params = step.equation, step.equation.params
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    values = [_value(env, v) for v in eqn.invars]
    return values[:n_consts], values[n_consts:n_consts + n_carry], values[n_consts + n_carry:]


def _store_scan_outputs(step: SplitScan, env: dict, carries: list[int], finals: list, ys_at: list[int],
                        ys: list) -> None:
    """Bind the scan's outputs that one half computed: its final carries and its stacked ys."""
    eqn, n_carry = step.equation, step.equation.params["num_carry"]
    for i, value in zip(carries, finals):
        env[eqn.outvars[i]] = value
    for i, value in zip(ys_at, ys):
        env[eqn.outvars[n_carry + i]] = value


def _run_b_step(step: Any, env: dict) -> None:
    if not isinstance(step, SplitScan):
        _bind(step, env)
        return
    eqn, params = step.equation, step.equation.params
    consts, carry, xs = _scan_operands(step, env)
    inits = [_or_zeros(carry[i], eqn.invars[params["num_consts"] + i]) for i in step.b_carries]

    def body(kept, x):
        full = list(carry)  # W's carries: B's body never reads them
        for i, value in zip(step.b_carries, kept):
            full[i] = value
        outputs, stash = step.body.run_b([*consts, *full, *x])
        kept_out = outputs[:len(step.b_carries)]
        return kept_out, (outputs[len(step.b_carries):], stash)

    finals, (ys, stacks) = jax.lax.scan(body, inits, xs, length=params["length"], reverse=params["reverse"],
                                         unroll=params["unroll"])
    _store_scan_outputs(step, env, step.b_carries, finals, step.b_ys, ys)
    env.update(zip(step.stash_stacks, stacks, strict=True))


def _run_w_step(step: Any, env: dict) -> None:
    if not isinstance(step, SplitScan):
        _bind(step, env)
        return
    eqn, params = step.equation, step.equation.params
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, carry, xs = _scan_operands(step, env)
    inits = [_or_zeros(carry[i], eqn.invars[n_consts + i]) for i in step.w_carries]
    stand_ins = [v.aval for v in eqn.invars[n_consts:n_consts + n_carry]]

    def body(kept, x):
        x_values, stash = x
        full = [_zeros(s) for s in stand_ins]  # B's carries: W's body reads them through the stash only
        for i, value in zip(step.w_carries, kept):
            full[i] = value
        outputs = step.body.run_w([*consts, *full, *x_values], stash)
        return outputs[:len(step.w_carries)], outputs[len(step.w_carries):]

    finals, ys = jax.lax.scan(body, inits, (xs, [env[v] for v in step.stash_stacks]), length=params["length"],
                              reverse=params["reverse"], unroll=params["unroll"])
    _store_scan_outputs(step, env, step.w_carries, finals, step.w_ys, ys)


def _scan_w_inputs(scan: SplitScan) -> list[Var]:
    """What W's scan reads at the scan's level: the consts and xs its body reads, its carries' initial values."""
    eqn, params = scan.equation, scan.equation.params
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    reads = [read and (i < n_consts or i >= n_consts + n_carry) for i, read in enumerate(scan.body.w_reads)]
    reads = [r or (i - n_consts) in scan.w_carries for i, r in enumerate(reads)]
    return [v for v, read in zip(eqn.invars, reads) if read and _is_var(v)]


def _w_defines(step: Any) -> list[Var]:
    if isinstance(step, SplitScan):
        n_carry = step.equation.params["num_carry"]
        return [*(step.equation.outvars[i] for i in step.w_carries),
                *(step.equation.outvars[n_carry + i] for i in step.w_ys)]
    return list(step.outvars)


def _inputs_of(eqn: Any, needed: list[bool]) -> list[Var]:
    """The variables `eqn` reads to compute its outputs flagged in `needed` (for a scan, only those the needed
    outputs depend on; every input otherwise)."""
    if not _is_scan(eqn) or all(needed):
        return [v for v in eqn.invars if _is_var(v)]
    params = eqn.params
    body, n_consts, n_carry = params["jaxpr"].jaxpr, params["num_consts"], params["num_carry"]
    carries = _carry_closure(body, n_consts, n_carry, {i for i in range(n_carry) if needed[i]})
    live = {body.outvars[i] for i in carries} | {v for v, n in zip(body.outvars[n_carry:], needed[n_carry:]) if n}
    live = _live_before(body.eqns, {v for v in live if _is_var(v)})
    return [outer for outer, inner in zip(eqn.invars, body.invars) if inner in live and _is_var(outer)]


def _live_before(eqns: Sequence[Any], live: set) -> set:
    """`live` (the variables wanted after `eqns`) grown, going back through them, by what each equation reads
    to compute the wanted values it defines."""
    for eqn in reversed(eqns):
        needed = [v in live for v in eqn.outvars]
        if any(needed):
            live.update(_inputs_of(eqn, needed))
    return live


def _definition_order(jaxpr: Any) -> list[Var]:
    return [*jaxpr.constvars, *jaxpr.invars, *(v for eqn in jaxpr.eqns for v in eqn.outvars)]


def _bind(eqn: Any, env: dict) -> None:
    """Run `eqn`; an input its needed outputs do not read (a scan's, say) may be missing: zeros stand in."""
    outputs = bind_equation(eqn, [_or_zeros(_value(env, v), v) for v in eqn.invars])
    env.update(zip(eqn.outvars, outputs, strict=True))


def _value(env: dict, v: Var) -> Any:
    return _read(env, v) if not _is_var(v) or v in env else None


def _or_zeros(value: Any, v: Var) -> Any:
    return value if value is not None else _zeros(v.aval)


def _read(env: dict, v: Var) -> Any:
    return v.val if not _is_var(v) else env[v]


def _is_var(v: Var) -> bool:
    return not hasattr(v, "val")


def _is_scan(eqn: Any) -> bool:
    return eqn.primitive.name == "scan"


def _zeros(like: Any) -> jax.Array:
    """Zeros of the shape and dtype of `like` (an abstract value)."""
    return jnp.zeros(like.shape, like.dtype)
