"""NCCL communicators for the CUDA collectives: one per (mesh axis, group of devices along it), set up
before the first step. Process 0 of each group draws the NCCL unique id and shares it through the
jax.distributed key-value store; every process registers it for its own devices. The handlers create
the communicator on first use, on XLA's stream, and keep it."""

from __future__ import annotations

import jax
import numpy as np
from xlatrain.custom_calls.backend import communicator_key, cuda_extension

from xlatrain.compat.multihost import key_value_get, key_value_set


def setup_communicators(mesh, axes: tuple[str, ...] | None = None) -> None:
    cuda = cuda_extension()
    for axis in axes or mesh.axis_names:
        position = mesh.axis_names.index(axis)
        groups = np.moveaxis(mesh.devices, position, -1).reshape(-1, mesh.devices.shape[position])
        for number, group in enumerate(groups):
            unique_id = _shared_unique_id(cuda, f"xlatrain/nccl/{axis}/{number}", group)
            for rank, device in enumerate(group):
                if device.process_index == jax.process_index():
                    cuda.register_communicator(communicator_key(axis), device.id, unique_id, rank, len(group))


def _shared_unique_id(cuda, name: str, group) -> bytes:
    if group[0].process_index == jax.process_index():
        unique_id = cuda.new_unique_id()
        key_value_set(name, unique_id)
        return unique_id
    return key_value_get(name)
