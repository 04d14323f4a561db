"""Every XLA compiler option xlatrain sets, per platform, in one place, and the CPU options it has measured.

`compiler_options(platform)` is what every step compiles with. `python3 -m bench.cpu_speed` measures each
option of CPU_OPTIONS_TRIED alone on the default GPT's train step, and whether it changes the step's results
(bench/results/cpu_speed.json); an option joins CPU_OPTIONS only when it makes that step faster beyond the
benchmark's noise without changing its results.
The other setting that changes CPU step time is not XLA's: glibc's allocator (xlatrain/runtime/malloc.py).
"""

from __future__ import annotations

CPU_OPTIONS: dict[str, bool | int | str] = {}
"""None so far: no option tried below made the default GPT's step faster (bench/README.md)."""

CPU_OPTIONS_TRIED: dict[str, bool | int | str] = {
    "xla_cpu_multi_thread_eigen": False,  # Eigen's own thread pool for dots and convolutions (on by default)
    "xla_cpu_use_xnnpack": True,  # XNNPACK kernels for dots and some elementwise work
    "xla_cpu_use_onednn": True,  # oneDNN kernels for dots
    "xla_cpu_enable_concurrency_optimized_scheduler": True,  # schedule for independent thunks to overlap
    "xla_cpu_use_fusion_emitters": False,  # the older loop emitters for fusions
    "xla_cpu_parallel_codegen_split_count": 8,  # code generation split into more modules
    "xla_cpu_enable_fast_math": True,  # reassociation, no NaN/inf care: changes results, never a default
    "xla_cpu_prefer_vector_width": 512,  # full AVX-512 vectors in generated loops (256 by default): changes results
    # YNNPACK's kernels for elementwise fusions too, in place of XLA's own loops; jaxlib 0.10.2's default hands
    # YNNPACK the dots and reductions only
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE,"
                                            "LIBRARY_FUSION_TYPE_ELTWISE",
}


def compiler_options(platform: str) -> dict[str, bool | int | str]:
    return dict(CPU_OPTIONS) if platform == "cpu" else {}
