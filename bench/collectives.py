"""xlatrain's custom-call collectives vs XLA's own, 8 CPU devices in one process.

For all_reduce, reduce_scatter and all_gather, at 4 KiB .. 64 MiB per device, in float32 and bfloat16,
each pair (ours, XLA's) is timed in interleaved rounds in the same run. Reported as nccl-tests does:
size = the bytes of the full buffer on each device (all_reduce's input, reduce_scatter's input,
all_gather's output), algorithm bandwidth = size / time, bus bandwidth = algbw x 2(n-1)/n for
all_reduce and x (n-1)/n for the others. CPU devices share the machine's cores and memory, so the
absolute numbers are memory-copy numbers; the ratios are what this measures.

    python3 -m bench.collectives            # writes bench/results/collectives.json

The process tunes malloc to keep freed memory as the `xlatrain` command does (xlatrain/runtime/malloc.py), so the large
sizes measure the collectives, not the kernel mapping fresh output pages for both sides;
`XLATRAIN_MALLOC=release` in front of the command measures with the system allocator's defaults instead.
"""

from __future__ import annotations

import os

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX starts a thread

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench.common import interleaved_medians, write_results  # noqa: E402
from xlatrain import custom_calls as ours  # noqa: E402
from xlatrain.compat.mapping import shard_map  # noqa: E402

AXIS = "d"
SIZES = [4 * 2**10 * 4**i for i in range(8)]  # 4 KiB .. 64 MiB
DTYPES = ["float32", "bfloat16"]
OPS = {
    "all_reduce": (lambda x: ours.all_reduce(x, AXIS), lambda x: jax.lax.psum(x, AXIS)),
    "reduce_scatter": (lambda x: ours.reduce_scatter(x, AXIS), lambda x: jax.lax.psum_scatter(x, AXIS, tiled=True)),
    "all_gather": (lambda x: ours.all_gather(x, AXIS, tiled=True), lambda x: jax.lax.all_gather(x, AXIS, tiled=True)),
}
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def runner(mesh, fn, x):
    compiled = jax.jit(shard_map(fn, mesh, P(AXIS), P(AXIS))).lower(x).compile()
    return lambda: compiled(x)


def measure(mesh, op: str, dtype: str, size: int) -> dict:
    n = mesh.size
    per_device = size // jnp.dtype(dtype).itemsize // (n if op == "all_gather" else 1)
    x = jax.device_put(jnp.ones((n * per_device,), dtype), NamedSharding(mesh, P(AXIS)))
    mine, xla = OPS[op]
    # Fresh output buffers page-fault for a while after start (the allocator's arenas grow), so the large sizes
    # get more warm-up and enough samples for a stable median.
    rounds, steps = (10, 10) if size <= 2**20 else (12, 5) if size <= 2**24 else (8, 3)
    seconds = interleaved_medians({"xlatrain": runner(mesh, mine, x), "xla": runner(mesh, xla, x)},
                                  rounds=rounds, steps_per_round=steps, warmup=5)
    row = {"op": op, "dtype": dtype, "bytes": size}
    for name, secs in seconds.items():
        algbw = size / secs / 1e9
        row[name] = {"seconds": secs, "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](n)}
    row["bandwidth_ratio"] = seconds["xla"] / seconds["xlatrain"]
    row["latency_ratio"] = seconds["xlatrain"] / seconds["xla"]
    return row


def main() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), (AXIS,))
    rows = []
    print(f"malloc: {MALLOC}")
    for op in OPS:
        for dtype in DTYPES:
            for size in SIZES:
                row = measure(mesh, op, dtype, size)
                rows.append(row)
                ms = {name: row[name]["seconds"] * 1e3 for name in ("xlatrain", "xla")}
                print(f"{op:<15} {dtype:<9} {size / 2**10:>8.0f} KiB  xlatrain {ms['xlatrain']:8.3f} ms  "
                      f"xla {ms['xla']:8.3f} ms  bandwidth ratio {row['bandwidth_ratio']:.2f}", flush=True)
    write_results("collectives", "python3 -m bench.collectives", {
        "devices": mesh.size, "malloc": MALLOC,
        "note": "8 CPU devices sharing the machine's cores: ratios, not absolute speed",
        "targets": "all_reduce bandwidth >= 1.0x XLA at >= 1 MiB; latency <= 1.5x XLA at 4 KiB",
        "rows": rows})


if __name__ == "__main__":
    main()
