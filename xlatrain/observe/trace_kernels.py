"""Where a GPU step's time goes, from a profiler trace: the kernels of the device planes, by what they do.

A jax profiler trace (`*.xplane.pb`, `trainer.profile_steps`) holds one plane per GPU, and in it one line per
CUDA stream with an event per kernel, named for XLA's fusion or the library's kernel. The classes are those of
`xlatrain lower`'s kernel split (lowering/kernels.py, which tells them apart by the HLO), told apart here by the
kernel's name.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

KERNEL_CLASSES = ("matmul", "attention", "scan slices", "copy or transpose", "reduction", "elementwise", "collective",
                  "other")
"""What a kernel does, in the order reports list them; the first two are the work of a transformer."""

_BY_NAME = (("attention", ("fmha", "sdpa", "flash", "cudnn")),
            ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "matmul", "dot")),
            ("collective", ("nccl", "all_reduce", "all_gather", "reduce_scatter", "allreduce", "sendrecv")),
            ("scan slices", ("dynamic_update_slice", "dynamic_slice")),
            ("copy or transpose", ("copy", "transpose", "memcpy", "memset")),
            ("reduction", ("reduce",)))
"""Name fragments, first match wins: cuDNN's attention before the gemms it contains, a gemm fused with its
epilogue before the reduction it may hold."""


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in _BY_NAME:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "elementwise" if "fusion" in lowered else "other"


def trace_kernel_split(trace: Path | str, steps: int) -> dict:
    """{"ms_per_step", "kernels_per_step", "by_class": {class: {"ms", "kernels"}}} per step of the `steps` steps
    the trace holds, from the kernels of every GPU's streams (summed over the GPUs: one device's time when
    there is one); empty classes left out. A trace without a GPU plane (a CPU run) gives zeros."""
    from jax.profiler import ProfileData

    return split_of(ProfileData.from_file(str(trace)), steps)


def split_of(profile, steps: int) -> dict:
    nanoseconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # the "XLA Ops" and "XLA Modules" lines repeat the streams' kernels by op and module
            for event in line.events:
                kind = kernel_class(event.name)
                nanoseconds[kind] += event.duration_ns
                counts[kind] += 1
    return {"ms_per_step": round(sum(nanoseconds.values()) / 1e6 / steps, 3),
            "kernels_per_step": round(sum(counts.values()) / steps, 1),
            "by_class": {kind: {"ms": round(nanoseconds[kind] / 1e6 / steps, 3),
                                "kernels": round(counts[kind] / steps, 1)}
                         for kind in KERNEL_CLASSES if counts[kind]}}
