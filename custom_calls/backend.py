"""Loads the compiled collectives and registers them with XLA: the C++ CPU extension (always built) and
the CUDA/NCCL one (built only with -Ccmake.define.XLATRAIN_CUDA=ON)."""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib
import itertools
from typing import Any, Callable

import jax
import numpy as np

from xlatrain.compat.multihost import detected_cluster
from xlatrain.compat.primitives import ffi_lowering, lowering_mesh, register_ffi_targets
from xlatrain.errors import UserError

PREFIX = {"cpu": "xlatrain_cpu_", "cuda": "xlatrain_cuda_"}
_EXTENSION = {"cpu": "xlatrain.custom_calls._cpu", "cuda": "xlatrain.custom_calls._cuda"}
_sites = itertools.count()


@functools.cache
def extension(platform: str) -> Any | None:
    """The loaded extension module for `platform` with its targets registered, or None if not built."""
    try:
        module = importlib.import_module(_EXTENSION[platform])
    except ImportError:
        return None
    register_ffi_targets(module.handlers(), PREFIX[platform], platform)
    return module


def cpu_extension() -> Any:
    module = extension("cpu")
    if module is None:
        raise UserError("the xlatrain CPU collectives extension is not built: reinstall with "
                        "`python3 -m pip install -e .` (it compiles custom_calls/csrc with CMake)")
    return module


def cuda_extension() -> Any:
    module = extension("cuda")
    if module is None:
        raise UserError("collectives.impl=custom on GPU needs the CUDA extension, which was not built: reinstall "
                        "with `python3 -m pip install -e '.[cuda]' -Ccmake.define.XLATRAIN_CUDA=ON`, or set "
                        "collectives.impl=xla")
    return module


def communicator_key(axis_name: str) -> int:
    """The same int64 on every process for a mesh axis (Python's hash of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(axis_name.encode(), digest_size=8).digest(), "little", signed=True)


def processes_along(mesh: jax.sharding.Mesh | None, axis_name: str) -> int:
    """How many processes each group of devices along `axis_name` spans (1 inside one process). Across processes
    the CPU collectives need each group to hold equal blocks of consecutive ranks per process, in process order,
    over every process (they exchange with every process of MPI_COMM_WORLD)."""
    if mesh is None or jax.process_count() == 1:
        return 1
    owners = np.vectorize(lambda d: d.process_index)(mesh.devices)
    lines = np.moveaxis(owners, mesh.axis_names.index(axis_name), -1).reshape(-1, mesh.shape[axis_name])
    spans = {len(set(line.tolist())) for line in lines}
    if spans == {1}:
        return 1
    processes = jax.process_count()
    in_order = all(np.array_equal(line, np.repeat(np.arange(processes), len(line) // processes)) for line in lines)
    if spans != {processes} or not in_order:
        raise UserError(f"collectives.impl=custom: the devices along mesh axis {axis_name!r} span some but not all "
                        f"{processes} processes, or not in equal blocks in process order; the CPU collectives "
                        "reduce across all processes at once: use collectives.impl=xla for this mesh")
    return processes


def lowering(op: str, attributes: Callable[..., dict[str, Any]]) -> dict[str, Callable]:
    """MLIR lowering rules per platform for `op`. `attributes(**params)` gives the handler's attributes;
    every lowered instance gets its own call-site id (how the CPU rendezvous tells calls apart, and, with the
    group, how the MPI messages of a collective across processes are tagged: the same on every process, which
    lowers the same programs in the same order). On CPU it also gets how many processes its axis spans."""

    def rule_for(platform: str) -> Callable:
        def rule(ctx, x, where, **params):
            if platform == "cpu":
                cpu_extension()
            else:
                cuda_extension()
            axis_name = params.pop("axis_name")
            attrs = {**attributes(**params), "site": np.int64(next(_sites))}
            if platform == "cuda":
                attrs["comm"] = np.int64(communicator_key(axis_name))
            else:
                attrs["processes"] = np.int64(processes_along(lowering_mesh(ctx), axis_name))
            return ffi_lowering(PREFIX[platform] + op)(ctx, x, where, **attrs)

        return rule

    return {platform: rule_for(platform) for platform in PREFIX}


@functools.cache
def _finalize_mpi_at_exit() -> None:
    atexit.register(cpu_extension().mpi_finalize)


def check_mpi_spans(processes: int, process: int) -> None:
    """Refuse, with the fix, a multi-process run whose CPU collectives cannot reach the other processes."""
    size, rank = cpu_extension().mpi_world() if detected_cluster() == "ompi" else (None, None)
    if size == processes and rank == process:
        _finalize_mpi_at_exit()
        return
    if size == processes:
        raise UserError(f"collectives.impl=custom: this process is MPI rank {rank} but jax.distributed process "
                        f"{process}; let jax.distributed number the processes under mpirun (drop "
                        "distributed.process_id), or set collectives.impl=xla")
    if size == -1:
        raise UserError("collectives.impl=custom across processes on CPU needs MPI, and this xlatrain was built "
                        "without it: install Open MPI (apt install libopenmpi-dev openmpi-bin), reinstall with "
                        "`python3 -m pip install -e .`, or set collectives.impl=xla")
    raise UserError(f"collectives.impl=custom across processes on CPU exchanges between processes with MPI: start "
                    f"the {processes} processes with mpirun (e.g. `mpirun -np {processes} xlatrain train ...`), or "
                    "set collectives.impl=xla (gloo)")
