"""Muon on xlatrain's stacked layers: which parameters are hidden matrices, how each leaf is a batch of matrices,
and where each matrix is orthogonalised.

optax's Muon sends every 2-D leaf to Newton-Schulz; xlatrain stacks its layers ([layers, in, out], a pipeline's
[virtual stages, stages, blocks, in, out], the GPT's qkv [layers, in, 3, out], experts [layers, experts, in, out]),
so the matrices are chosen by name and each leaf is read as [matrices, in, out]. The momentum stays laid out as its
parameter; each step, the matrices of one shape whose shards the same devices hold (fsdp's `data`, `tensor`,
`expert`) are spread whole over those devices, orthogonalised there, and sent back to their shards."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, MuonState

from xlatrain.compat.muon import orthogonalize_via_newton_schulz
from xlatrain.models.blocks import in_blocks

EXPERT_MATRICES = ("up", "gate", "down")
"""An MoE layer's experts' matrices, [experts, in, out] per layer, under its `moe` key."""
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (optax's default)."""


def _keys(path: tuple) -> list:
    return [getattr(entry, "key", None) for entry in path]


def is_hidden_matrix(path: tuple) -> bool:
    """A BlockStack's dense `kernel` (attention and MLP projections, shared experts) or an expert matrix; not a
    router (a classifier over the experts), nor anything outside the stacked layers (embeddings, head)."""
    keys = _keys(path)
    if not in_blocks(path) or "router" in keys:
        return False
    return keys[-1] == "kernel" or (len(keys) >= 2 and keys[-2] == "moe" and keys[-1] in EXPERT_MATRICES)


@dataclass(frozen=True)
class Matrices:
    """How a leaf is a batch of matrices: its reduction (input) axis, its output axis (the last), and every other
    axis a batch axis (the stacked layers, an expert axis, the GPT's q, k and v)."""

    reduction: int
    output: int

    def batch_axes(self, ndim: int) -> tuple[int, ...]:
        return tuple(axis for axis in range(ndim) if axis not in (self.reduction, self.output))

    def dimension_numbers(self) -> MuonDimensionNumbers:
        return MuonDimensionNumbers(reduction_axis=self.reduction, output_axis=self.output)

    def flat(self, x: jax.Array) -> jax.Array:
        """[matrices, in, out]."""
        order = (*self.batch_axes(x.ndim), self.reduction, self.output)
        return x.transpose(order).reshape(-1, x.shape[self.reduction], x.shape[self.output])

    def unflat(self, flat: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        order = (*self.batch_axes(len(shape)), self.reduction, self.output)
        return flat.reshape(tuple(shape[axis] for axis in order)).transpose(
            tuple(sorted(range(len(shape)), key=order.__getitem__)))


def matrices_of(path: tuple, shape: tuple[int, ...], stacked: int) -> Matrices | None:
    """`stacked`: the leading axes that stack layers. None: not a hidden matrix."""
    if not is_hidden_matrix(path) or len(shape) - stacked < 2:
        return None
    experts = 1 if _keys(path)[-2] == "moe" else 0
    return Matrices(reduction=stacked + experts, output=len(shape) - 1)


@dataclass(frozen=True)
class MatrixOwners:
    """Where the matrices are orthogonalised in one global program (parallel.mode=jit): the matrices of one shape
    whose momentum is split over the same mesh axes (`spec_of(path, shape)`: fsdp's `data`, `tensor`, `expert`)
    are spread over those axes' devices, each matrix whole on one device, then sent back to their shards."""

    mesh: jax.sharding.Mesh
    spec_of: Callable[[tuple, tuple[int, ...]], P]

    def owners(self, spec: P) -> tuple[str, ...]:
        """The mesh axes `spec` splits over, in the mesh's order."""
        named = {axis for entry in spec if entry is not None
                 for axis in ((entry,) if isinstance(entry, str) else entry)}
        return tuple(axis for axis in self.mesh.axis_names if axis in named)

    def orthogonalise(self, leaves: list[tuple[tuple, jax.Array, Matrices]],
                      newton_schulz: Callable[[jax.Array, Matrices], jax.Array]) -> list[jax.Array]:
        """Each (path, leaf, its matrices) orthogonalised, in their order."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        flats, specs = [], []
        for index, (path, x, matrices) in enumerate(leaves):
            flats.append(_wide(matrices.flat(x)))
            specs.append(self.spec_of(path, x.shape))
            groups[flats[-1].shape[1:], self.owners(specs[-1])].append(index)
        done: list[jax.Array] = [None] * len(leaves)
        for (_, owners), members in groups.items():
            count = math.prod(self.mesh.shape[axis] for axis in owners)
            batch = jnp.concatenate([flats[i] for i in members])
            spread = NamedSharding(self.mesh, P(owners or None, None, None))
            pad = -batch.shape[0] % count  # zero matrices orthogonalise to zero
            batch = jax.lax.with_sharding_constraint(jnp.pad(batch, ((0, pad), (0, 0), (0, 0))), spread)
            result = jax.lax.with_sharding_constraint(newton_schulz(batch, Matrices(1, 2)), spread)
            offsets = np.cumsum([0] + [flats[i].shape[0] for i in members])
            for i, start, stop in zip(members, offsets[:-1], offsets[1:], strict=True):
                path, x, matrices = leaves[i]
                wide = result[start:stop]
                mine = wide if x.shape[matrices.reduction] <= x.shape[matrices.output] else wide.transpose(0, 2, 1)
                done[i] = jax.lax.with_sharding_constraint(matrices.unflat(mine, x.shape),
                                                           NamedSharding(self.mesh, specs[i]))
        return done


def _wide(flat: jax.Array) -> jax.Array:
    """[matrices, short, long]: Newton-Schulz orthogonalises a tall matrix as its transpose (as optax's does), so
    matrices of one shape either way round share a batch."""
    return flat if flat.shape[1] <= flat.shape[2] else flat.transpose(0, 2, 1)


def update_scale(fan_in: int, fan_out: int, rms_match: float | None) -> float:
    """Keller Jordan's sqrt(max(1, fan_out / fan_in)) (rms_match null), or Moonlight's
    sqrt(max(fan_in, fan_out)) x rms_match, which gives the update AdamW's RMS."""
    if rms_match is None:
        return math.sqrt(max(1.0, fan_out / fan_in))
    return math.sqrt(max(fan_in, fan_out)) * rms_match


def scale_by_muon(beta: float, nesterov: bool, ns_steps: int, rms_match: float | None, block_axes: int,
                  owners: MatrixOwners | None = None, eps: float = 1e-8) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon's momentum, state and Newton-Schulz, with its width scaling (scale_by_shape),
    on the hidden matrices of stacked layers (`block_axes` leading axes stack them). `owners`: where each matrix is
    orthogonalised (None: where its momentum is)."""
    coefficients = jnp.asarray(NS_COEFFICIENTS)

    def init(params):
        return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params), ns_coeffs=coefficients)

    def newton_schulz(x: jax.Array, matrices: Matrices) -> jax.Array:
        return orthogonalize_via_newton_schulz(x, coefficients, ns_steps, "frobenius", eps,
                                               matrices.dimension_numbers())

    def orthogonalised(mu_hat):
        flat, treedef = jax.tree_util.tree_flatten_with_path(mu_hat)
        leaves = [(path, x, matrices_of(path, x.shape, block_axes)) for path, x in flat]
        done = (owners.orthogonalise(leaves, newton_schulz) if owners is not None
                else [newton_schulz(x, matrices) for _, x, matrices in leaves])
        return treedef.unflatten([
            d * update_scale(x.shape[matrices.reduction], x.shape[matrices.output], rms_match)
            for d, (_, x, matrices) in zip(done, leaves, strict=True)])

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        return (orthogonalised(mu_hat),
                MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs))

    return optax.GradientTransformation(init, update)


def muon_labels(params: Any, frozen: Any = None) -> Any:
    """Per leaf: "muon" (a hidden matrix), "adam" (the rest) or "frozen" (ModelDef.frozen)."""
    frozen = jax.tree.map(lambda _: False, params) if frozen is None else frozen
    return jax.tree_util.tree_map_with_path(
        lambda path, _, f: "frozen" if f is True else "muon" if is_hidden_matrix(path) else "adam", params, frozen)
