"""How the stages of one replica talk: activations on to the next chunk, gradients back to the previous one
(`ppermute`, XLA's or xlatrain's custom call; a V's second chunk sends the other way), and sums over the
`stage` axis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from xlatrain.mesh import STAGE
from xlatrain.pipeline.slots import SlotProgram

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


def next_stage_pairs(slots: SlotProgram, stages: int) -> tuple[tuple[int, int], ...]:
    """(stage, next stage): where activations go; the last stage feeds the first when chunks wrap around."""
    return tuple((s, (s + 1) % stages) for s in range(stages if slots.ring else stages - 1))


def hand_over(link: StageLink, slots: SlotProgram, stage: jax.Array, round_: jax.Array, value: Tree,
              gradient: bool) -> tuple[Tree, Tree | None]:
    """`_hand_over` of each leaf of `value` (the activation, and an MoE's reports with it: chunks.StageReports)."""
    leaves, tree = jax.tree.flatten(value)
    arrived = [_hand_over(link, slots, stage, round_, leaf, gradient) for leaf in leaves]
    usual = tree.unflatten([usual for usual, _ in arrived])
    return usual, None if arrived[0][1] is None else tree.unflatten([reverse for _, reverse in arrived])


def _hand_over(link: StageLink, slots: SlotProgram, stage: jax.Array, round_: jax.Array, value: jax.Array,
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


def receive(pool: Tree, arrivals: tuple[Tree, Tree | None], write: jax.Array, write_reverse: jax.Array) -> Tree:
    """`pool` with `hand_over`'s arrivals stored where the slot program says (unused ones into its scratch)."""
    usual, reverse = arrivals
    pool = jax.tree.map(lambda p, value: p.at[write].set(value), pool, usual)
    return pool if reverse is None else jax.tree.map(lambda p, value: p.at[write_reverse].set(value), pool, reverse)


def pool_of(shapes: Tree, buffers: int) -> Tree:
    """`buffers` zeros of each leaf of `shapes` (what passes between stages), stacked in front."""
    return jax.tree.map(lambda s: jnp.zeros((buffers, *s.shape), s.dtype), shapes)


def read(pool: Tree, index: jax.Array) -> Tree:
    return jax.tree.map(lambda p: p[index], pool)
