"""Where an evaluation runs: the process's own devices, as one mesh axis (`data`) that splits each batch's rows; the
weights replicated over it, or split as a run trained with parallel.strategy=fsdp split its params (its
parallel.logical_rules over `data`), for a model one device cannot hold (its checkpoint read spread over the
devices). With several processes each one scores its share of the batches on its own devices, and every process gets
every score through jax.distributed's key-value store (runtime/distributed.py: everyones), so that each computes the
same metrics."""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlatrain.config import Config
from xlatrain.evaluation.decoder import decoder_definition
from xlatrain.runtime.distributed import everyones
from xlatrain.sharding import Rules, named, param_specs, rules_over

DATA = "data"
RESULTS_WAIT_S = 3600.0
"""How long a process that scored its share waits for the others' results of the same call."""
Item = TypeVar("Item")


def evaluation_mesh() -> Mesh:
    """This process's devices, one axis."""
    return Mesh(np.asarray(jax.local_devices()), (DATA,))


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """A batch's rows split over the devices."""
    return NamedSharding(mesh, P(DATA))


def spread_over(mesh: Mesh) -> Callable[[tuple[int, ...]], NamedSharding]:
    """Where a checkpoint's array of a shape is read for evaluation: split over the devices along its largest
    dimension they divide (whole on each where none does), so that no device holds a whole model before the weights
    are laid out (placed_weights)."""
    def sharding(shape: tuple[int, ...]) -> NamedSharding:
        divided = [dim for dim in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[dim] % mesh.size == 0]
        spec = [None] * len(shape)
        if divided and mesh.size > 1:
            spec[divided[0]] = DATA
        return NamedSharding(mesh, P(*spec))

    return sharding


def trained_split(config: Config) -> Rules | None:
    """The logical rules a run's params were split over `data` by (fsdp), or None: each device held them whole."""
    return config.parallel.logical_rules if config.parallel.strategy == "fsdp" else None


def placed_weights(model: Any, params: Any, model_state: Any, mesh: Mesh, split: Rules | None) -> Any:
    """The decoder `model`'s variables (its params with the model state among them) on `mesh`: replicated, or the
    params split by `split`'s rules over `data` as far as each dimension divides."""
    replicated = NamedSharding(mesh, P())
    if split is None:
        params = jax.device_put(params, replicated)
    else:
        params = jax.device_put(params, named(mesh, param_specs(params, decoder_definition(model).logical_axes,
                                                                rules_over(split, (DATA,)), mesh)))
    return merged_variables(params, jax.device_put(model_state or {}, replicated))


def merged_variables(params: dict, model_state: dict) -> dict:
    """One nested dict of a decoder's params and its model state (whose leaves sit beside the params' in the
    modules): what its nnx graph definition merges with."""
    found = dict(params)
    for key, value in model_state.items():
        found[key] = merged_variables(found.get(key, {}), value) if isinstance(value, dict) else value
    return found


def my_share(items: Sequence[Item]) -> list[tuple[int, Item]]:
    """(index, item) of the items this process works on: every process_count-th from its own index."""
    return list(enumerate(items))[jax.process_index()::jax.process_count()]


def everyones_results(name: str, mine: dict[int, Any], count: int) -> list[Any]:
    """The results of items 0 .. count - 1 (JSON values), each from the process that worked on it, on every
    process."""
    found: dict[int, Any] = {}
    for theirs in everyones(f"evaluation/{name}", sorted(mine.items()), RESULTS_WAIT_S):
        found.update((int(index), value) for index, value in theirs)
    return [found[index] for index in range(count)]
