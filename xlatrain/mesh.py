"""The device mesh and the shardings of batches on it."""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlatrain.config import Config, resolve_data_parallel
from xlatrain.errors import UserError
from xlatrain.sharding import CONTEXT, EXPERT, TENSOR

DATA = "data"
STAGE = "stage"


def build_mesh(config: Config, devices: list | None = None) -> Mesh:
    """A mesh over every device, with axis `data` (and `stage` for a pipeline, `expert` for expert parallelism,
    `context` for context parallelism, `tensor` innermost for tensor parallelism, in that order); fails clearly when
    config and devices disagree.
    Within one process neighbouring stages sit on consecutive devices, and a context and a tensor group on
    consecutive devices inside a stage (the fastest links); over several processes the stages are spread over the
    processes, each process holding whole stages of every data replica (the pipeline sends only activations
    between processes, each stage's gradient all-reduce stays inside one), and every context x tensor group lies
    inside one process."""
    devices = jax.devices() if devices is None else devices
    data = resolve_data_parallel(config.mesh, devices)
    stages, experts, context, tensor = config.mesh.stage, config.mesh.expert, config.mesh.context, config.mesh.tensor
    check_tensor_groups_inside_processes(devices, tensor)
    check_tensor_groups_inside_processes(devices, context * tensor, "mesh.context x mesh.tensor")
    in_order = np.asarray(devices)
    if stages > 1 and len({d.process_index for d in devices}) > 1:
        grid = in_order.reshape(stages, data, experts, context, tensor).transpose(1, 0, 2, 3, 4)
    else:
        grid = in_order.reshape(data, stages, experts, context, tensor)
    axes = ((DATA, data), (STAGE, stages), (EXPERT, experts), (CONTEXT, context), (TENSOR, tensor))
    kept = [i for i, (axis, size) in enumerate(axes) if axis == DATA or size > 1]
    return Mesh(grid.reshape([grid.shape[i] for i in kept]), tuple(axes[i][0] for i in kept))


def check_tensor_groups_inside_processes(devices: list, size: int, named: str = "mesh.tensor") -> None:
    """A tensor group (and a context group) talks at every layer: its devices must share a process (and its fast
    links). `named`: the mesh keys whose product `size` is."""
    if size == 1:
        return
    per_process = collections.Counter(d.process_index for d in devices)
    if any(count % size for count in per_process.values()):
        counts = sorted(set(per_process.values()))
        raise UserError(f"config: {named}={size} splits every layer over devices that talk at each layer, so such a "
                        f"group stays inside one process, but the processes hold {counts} devices each; set {named} "
                        "to a divisor of each process's device count")


def tensor_size(mesh: Mesh) -> int:
    return mesh.shape.get(TENSOR, 1)


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
    """Constrain trees with a leading replica axis to one replica per `data` shard (inside jit); their other
    dimensions are the partitioner's (a tensor-parallel gradient stays split over `tensor`)."""
    def pinned(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(DATA, *[P.UNCONSTRAINED] * (x.ndim - 1))))

    return jax.tree.map(pinned, tree)


def eval_batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA))
