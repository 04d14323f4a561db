"""Every custom-call collective across processes against its lax reference (XLA's gloo collectives), under
`mpirun -np 2` with 4 CPU devices per process: on a 1-D mesh of 8 devices (one group spanning both processes)
and on a 2 x 4 mesh whose two rows each span both processes (two MPI lanes at once). Each process checks its
own shards and prints how many cases it checked; any mismatch raises. Last, process 1 skips one all-reduce and
process 0 must fail it within its timeout, naming process 1 (never a silent hang)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from xlatrain.custom_calls import ops
from xlatrain.custom_calls.backend import check_mpi_spans

from xlatrain.compat.mapping import shard_map
from xlatrain.config import DistributedConfig
from xlatrain.runtime.distributed import initialize


def meshes() -> dict[str, Mesh]:
    devices = np.array(jax.devices())  # process 0's devices, then process 1's
    rows = devices.reshape(2, 2, 2).transpose(1, 0, 2).reshape(2, 4)  # each row: two of each process
    return {"1-D": Mesh(devices, ("x",)), "2-D": Mesh(rows, ("g", "x"))}


def cases(size: int) -> dict[str, tuple]:
    """name -> (custom, reference, per-device block shape) for an axis of `size` participants."""
    ring = [(i, (i + 1) % size) for i in range(size)]
    partial = [(0, size - 1), (size - 1, 1)]
    return {
        "all_reduce sum": (lambda x: ops.all_reduce.all_reduce(x, "x"), lambda x: jax.lax.psum(x, "x"), (2, 5)),
        "all_reduce mean": (lambda x: ops.all_reduce.all_reduce(x, "x", "mean"), lambda x: jax.lax.pmean(x, "x"),
                            (3, 7)),
        "all_reduce max": (lambda x: ops.all_reduce.all_reduce(x, "x", "max"), lambda x: jax.lax.pmax(x, "x"), (9,)),
        "reduce_scatter sum": (lambda x: ops.reduce_scatter.reduce_scatter(x, "x"),
                               lambda x: ops.reduce_scatter.reference(x, "x"), (size * 3, 2)),
        "reduce_scatter mean": (lambda x: ops.reduce_scatter.reduce_scatter(x, "x", "mean"),
                                lambda x: ops.reduce_scatter.reference(x, "x", "mean"), (size, 5)),
        "all_gather": (lambda x: ops.all_gather.all_gather(x, "x", tiled=True),
                       lambda x: jax.lax.all_gather(x, "x", tiled=True), (3, 4)),
        "ppermute ring": (lambda x: ops.ppermute.ppermute(x, "x", ring), lambda x: jax.lax.ppermute(x, "x", ring),
                          (4, 3)),
        "ppermute partial": (lambda x: ops.ppermute.ppermute(x, "x", partial),
                             lambda x: jax.lax.ppermute(x, "x", partial), (2, 2)),
        "all_to_all": (lambda x: ops.all_to_all.all_to_all(x, "x", 0, 1, tiled=True),
                       lambda x: jax.lax.all_to_all(x, "x", 0, 1, tiled=True), (size * 2, 3)),
        "broadcast": (lambda x: ops.broadcast.broadcast(x, "x", root=size - 1),
                      lambda x: ops.broadcast.reference(x, "x", root=size - 1), (5,)),
    }


def run_both(mesh: Mesh, custom, reference, block: tuple, dtype: str) -> int:
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    rows = mesh.devices.size * block[0]
    data = np.random.default_rng(rows).normal(size=(rows, *block[1:])) * 4
    global_x = (data.round() if dtype == "int32" else data).astype(dtype)
    x = jax.make_array_from_callback(global_x.shape, NamedSharding(mesh, spec), lambda index: global_x[index])
    outs = [jax.jit(shard_map(fn, mesh, spec, spec))(x) for fn in (custom, reference)]
    tolerance = {"bfloat16": 2e-2}.get(dtype, 1e-6)
    for got, want in zip(outs[0].addressable_shards, outs[1].addressable_shards, strict=True):
        np.testing.assert_allclose(np.asarray(got.data, np.float64), np.asarray(want.data.astype(jnp.float32),
                                   np.float64), rtol=tolerance, atol=tolerance)
    return 1


def missing_process_is_named(mesh: Mesh) -> str:
    """Process 0 runs an all-reduce (2 s timeout) that process 1 skips: its error must name process 1."""
    if jax.process_index() == 1:
        return "skipped the all-reduce"
    x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("x")), lambda index: np.ones(8, np.float32)[index])
    reduce = jax.jit(shard_map(lambda v: ops.all_reduce.all_reduce(v, "x", timeout_s=2.0), mesh, P("x"), P("x")))
    try:
        jax.block_until_ready(reduce(x))
    except Exception as error:  # jax's runtime error type differs between versions
        if "no message from process(es) [1] within 2000 ms" not in str(error):
            raise
        return "named the missing process"
    raise AssertionError("the all-reduce without process 1 did not fail")


def main() -> None:
    initialize(DistributedConfig())
    check_mpi_spans(jax.process_count(), jax.process_index())
    checked = 0
    for mesh in meshes().values():
        for name, (custom, reference, block) in cases(mesh.shape["x"]).items():
            for dtype in ("float32", "bfloat16", "int32"):
                if "mean" in name and dtype == "int32":
                    continue
                checked += run_both(mesh, custom, reference, block, dtype)
    print(f"rank {jax.process_index()}: {checked} cases match", flush=True)
    print(f"rank {jax.process_index()}: {missing_process_is_named(meshes()['1-D'])}", flush=True)


if __name__ == "__main__":
    main()
