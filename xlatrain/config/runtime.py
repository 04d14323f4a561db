"""The `runtime` section: which kernels the process runs a step's work on."""

from __future__ import annotations

from typing import Literal, get_args

from xlatrain.config.base import Strict

CpuMatmul = Literal["auto", "xla", "mkl", "openblas"]
CPU_KERNELS = tuple(name for name in get_args(CpuMatmul) if name != "auto")
"""What runtime.cpu_matmul resolves to (derived.cpu_matmul)."""


class RuntimeConfig(Strict):
    """Kernels of the process."""

    cpu_matmul: CpuMatmul = "auto"
    """The built-in models' float32 dense layers on CPU (forward and both gradients of the train and eval steps):
    xla: XLA's own dots; openblas or mkl: that BLAS, single-threaded, each product split over XLA's thread pool
    (`pip install -e '.[openblas]'`, or scipy's copy of OpenBLAS; `pip install -e '.[mkl]'`). A BLAS runs where
    each device runs a program of its own (one device, parallel.mode=shard_map or pmap, pipelines), not under
    parallel.mode=jit over several devices. auto: the one the run chose at its first start; for a new run MKL with
    the mkl extra installed, else OpenBLAS with the openblas extra installed, else xla; xla where a BLAS cannot
    run. The choice is written to the run's config.yaml (derived.cpu_matmul)."""
