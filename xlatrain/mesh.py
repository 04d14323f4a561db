"""The device mesh and the shardings of batches on it."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlatrain.config import Config, resolve_data_parallel

DATA = "data"
STAGE = "stage"


def build_mesh(config: Config, devices: list | None = None) -> Mesh:
    """A mesh over every device, with axis `data` (and `stage` for a pipeline, neighbouring stages on
    consecutive devices); fails clearly when config and devices disagree."""
    devices = jax.devices() if devices is None else devices
    data = resolve_data_parallel(config.mesh, devices)
    if config.mesh.stage > 1:
        return Mesh(np.asarray(devices).reshape(data, config.mesh.stage), (DATA, STAGE))
    return Mesh(np.asarray(devices).reshape(data), (DATA,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def train_batch_sharding(mesh: Mesh, fused_steps: int = 1) -> NamedSharding:
    """[microbatches, rows, ...] (with a leading [steps] axis when steps are fused): rows split over
    the data axis, every microbatch (and step) on every replica."""
    return NamedSharding(mesh, P(*([None] * (2 if fused_steps > 1 else 1)), DATA))


def per_replica(mesh: Mesh, tree):
    """Constrain trees with a leading replica axis to one replica per `data` shard (inside jit)."""
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: NamedSharding(mesh, P(DATA)), tree))


def eval_batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA))
