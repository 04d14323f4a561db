"""Logical-axis rules -> PartitionSpecs for parameters and optimizer state (replicated, ZeRO-1, FSDP, tensor
parallelism), and the activations' layout that tensor and sequence parallelism pin inside a traced step."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Rules = Mapping[str, tuple[str, ...]]
"""Logical name -> the mesh axes its dimension is split over (parallel.logical_rules)."""
TENSOR = "tensor"
CONTEXT = "context"
EXPERT = "expert"


def logical_spec(names: tuple[str | None, ...], shape: tuple[int, ...], rules: Rules, mesh: Mesh) -> P:
    """Split each dimension over the mesh axes its logical name maps to, in order, as far as each is a mesh axis
    of more than one device that no earlier dimension used and that divides what is left of the dimension."""
    used, spec = set(), []
    for name, size in zip(names, shape, strict=True):
        chosen = []
        for axis in rules.get(name, ()) if name is not None else ():
            parts = mesh.shape.get(axis, 1)
            if axis not in used and parts > 1 and size % parts == 0:
                chosen.append(axis)
                used.add(axis)
                size //= parts
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*spec)


def entry_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry splits its dimension over: none, one, or several together."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def dim_over(spec: P, axis: str) -> int | None:
    """The dimension `spec` splits over `axis` (alone or with other axes), or None."""
    return next((dim for dim, entry in enumerate(spec) if axis in entry_axes(entry)), None)


def without_axis(spec: P, axis: str) -> P:
    """`spec` with `axis` taken out of every entry (what stays split over the other axes)."""
    def less(entry):
        kept = tuple(a for a in entry_axes(entry) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*map(less, spec))


def rules_over(rules: Rules, axes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The rules less the mesh axes not in `axes` (the replicated strategy splits only over `tensor`)."""
    return {name: tuple(axis for axis in mapped if axis in axes) for name, mapped in rules.items()}


def param_specs(abstract_params: Any, logical_axes: Any, rules: Rules, mesh: Mesh) -> Any:
    return jax.tree.map(lambda leaf, names: logical_spec(names, leaf.shape, rules, mesh),
                        abstract_params, logical_axes, is_leaf=_is_axes)


def spec_at_path(logical_axes: Any, rules: Rules, mesh: Mesh) -> Callable[[tuple, tuple[int, ...]], P]:
    """(a param's key path, its shape) -> its PartitionSpec, as param_specs lays it out."""
    names = dict(jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=_is_axes)[0])
    return lambda path, shape: logical_spec(names[tuple(path)], shape, rules, mesh)


def optimizer_specs(tx: optax.GradientTransformation, abstract_opt_state: Any, abstract_params: Any,
                    logical_axes: Any, rules: Rules, mesh: Mesh) -> Any:
    """Param-shaped optimizer leaves (moments) follow the param's logical axes (see specs_following_params);
    the rest is replicated."""
    wanted = param_specs(abstract_params, logical_axes, rules, mesh)
    return specs_following_params(tx, abstract_opt_state, abstract_params, wanted)


def tensor_undivided(abstract_params: Any, logical_axes: Any, rules: Rules, mesh: Mesh) -> list[str]:
    """Parameters with a dimension the rules split over `tensor` that mesh.tensor does not divide, as
    "path (name: size)": tensor parallelism never replicates such a dimension silently."""
    parts = mesh.shape.get(TENSOR, 1)
    if parts == 1:
        return []
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    names = jax.tree.leaves(logical_axes, is_leaf=_is_axes)
    return [f"{jax.tree_util.keystr(path, simple=True, separator='.')} ({name}: {size})"
            for (path, leaf), leaf_names in zip(flat, names, strict=True)
            for name, size in zip(leaf_names, leaf.shape, strict=True)
            if name is not None and TENSOR in rules.get(name, ()) and size % parts]


def specs_following_params(tx: optax.GradientTransformation, abstract_opt_state: Any, abstract_params: Any,
                           wanted: Any) -> Any:
    """Optimizer leaves shaped like their param take the param's spec `wanted`. A leaf that shares the param's
    leading dimensions up to the last one the spec splits (Adafactor's factored moments of stacked layers, kept
    per layer) takes that part of the spec; the rest is replicated. A parameter the optimizer is masked off
    (optax.masked: a frozen one) has no state, and no spec."""

    def for_leaf(leaf, spec, param):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        shape = getattr(leaf, "shape", None)
        if shape == param.shape:
            return spec
        split = len(spec) - next((i for i, name in enumerate(reversed(spec)) if name is not None), len(spec))
        return P(*spec[:split]) if shape is not None and tuple(shape[:split]) == param.shape[:split] else P()

    return optax.tree_map_params(tx, for_leaf, abstract_opt_state, wanted, abstract_params,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, (P, optax.MaskedNode)))


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


BATCH, LENGTH, SEQUENCE = "batch", "length", "sequence"
"""Logical names of activation dimensions beside the parameters' (heads, kv_heads, mlp, vocab): the sequence of the
residual stream (LENGTH, split over `tensor` too with sequence parallelism) and of the activations inside the
tensor-parallel regions (SEQUENCE); both split over `context` with context parallelism."""


@dataclass(frozen=True)
class ActivationLayout:
    """Which activation dimensions are split over `tensor` and `context` in one global program (parallel.mode=jit)."""

    mesh: Mesh
    split: frozenset[str]
    """Logical names split over `tensor`: those the rules split (heads, mlp, vocab...), and LENGTH with
    sequence parallelism."""
    context_attention: str = "ring"
    """How attention meets over `context` (parallel.context_attention), where the mesh has that axis."""
    rows_on: str | None = None
    """The mesh axis the activations' rows are on where nothing else places them (the eval step's; the train
    step's vmap over replicas puts them on `data` itself)."""

    @staticmethod
    def of(mesh: Mesh, rules: Rules, sequence_parallel: bool, context_attention: str = "ring",
           rows_on: str | None = None) -> ActivationLayout:
        split = {name for name, axes in rules.items() if TENSOR in axes} if TENSOR in mesh.shape else set()
        return ActivationLayout(mesh, frozenset(split | ({LENGTH} if sequence_parallel else set())),
                                context_attention, rows_on)

    @property
    def context(self) -> int:
        return self.mesh.shape.get(CONTEXT, 1)

    @property
    def expert(self) -> int:
        return self.mesh.shape.get(EXPERT, 1)

    def rows(self) -> Any:
        """The mesh axes the rows are split over where nothing else places them: `rows_on`, and `expert`, whose
        devices share a replica's rows (None: left to the partitioner and the replicas' vmap)."""
        over = tuple(axis for axis in (self.rows_on, EXPERT if self.expert > 1 else None) if axis)
        return over[0] if len(over) == 1 else over or None

    def axes_of(self, name: str | None) -> Any:
        """The mesh axes a dimension of logical `name` is split over (the batch: over `expert` where it shares the
        rows, else P.UNCONSTRAINED)."""
        if name == BATCH:
            return self.rows() if self.expert > 1 else P.UNCONSTRAINED
        over = ((CONTEXT,) if name in (LENGTH, SEQUENCE) and self.context > 1 else ()) + (
            (TENSOR,) if name in self.split else ())
        return over[0] if len(over) == 1 else over or None


_LAYOUT: ContextVar[ActivationLayout | None] = ContextVar("activation_layout", default=None)


@contextlib.contextmanager
def activations_laid_out(layout: ActivationLayout | None) -> Iterator[None]:
    """While a step is traced: `constrain` pins activations to `layout` (None: leaves them as they are)."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """`x` with each dimension named: split over `tensor` and `context` where the traced step's layout says so,
    whole where it does not, the batch left to the partitioner (the data axis, and the replicas' vmap, place it).
    Outside a tensor- or context-parallel step, `x` as it is."""
    layout = _LAYOUT.get()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, P(*map(layout.axes_of, names))))


def context_split() -> ActivationLayout | None:
    """The traced step's layout where it splits the sequence over `context` (None elsewhere)."""
    layout = _LAYOUT.get()
    return layout if layout is not None and layout.context > 1 else None


def expert_split() -> ActivationLayout | None:
    """The traced step's layout where it splits the experts over `expert` (None elsewhere)."""
    layout = _LAYOUT.get()
    return layout if layout is not None and layout.expert > 1 else None
