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
    """A mesh over every device, with axis `data` (and `stage` for a pipeline); fails clearly when config and
    devices disagree. Within one process neighbouring stages sit on consecutive devices; over several processes
    the stages are spread over the processes, each process holding whole stages of every data replica (the
    pipeline sends only activations between processes, each stage's gradient all-reduce stays inside one)."""
    devices = jax.devices() if devices is None else devices
    data = resolve_data_parallel(config.mesh, devices)
    stages = config.mesh.stage
    if stages == 1:
        return Mesh(np.asarray(devices).reshape(data), (DATA,))
    if len({d.process_index for d in devices}) > 1:
        return Mesh(np.asarray(devices).reshape(stages, data).T, (DATA, STAGE))
    return Mesh(np.asarray(devices).reshape(data, stages), (DATA, STAGE))


def process_row_block(mesh: Mesh) -> tuple[int, int]:
    """(this process's block, number of blocks): every batch's rows split into equal blocks along the data axis,
    one per group of processes whose devices hold the same data replicas; this process reads only its block."""
    axis = mesh.axis_names.index(DATA)
    mine = sorted({index[axis] for index, device in np.ndenumerate(mesh.devices)
                   if device.process_index == jax.process_index()})
    return mine[0] // len(mine), mesh.shape[DATA] // len(mine)


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
