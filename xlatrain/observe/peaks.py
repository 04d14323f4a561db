"""Peak matmul throughput of one device, for MFU: vendors' dense figures for known accelerators, a measured
matmul on CPU (stated as measured: a CPU has no datasheet figure that XLA:CPU could reach)."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np

PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    # (device_kind substring, checked in this order; TFLOP/s dense per dtype: fp32 means TF32 tensor cores, which
    # XLA uses for float32 matmuls at the default precision)
    ("GH200", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0}),
    ("L40S", {"bfloat16": 362.1, "float16": 362.1, "float32": 183.0}),
    ("L4", {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0}),
    ("A10", {"bfloat16": 125.0, "float16": 125.0, "float32": 62.5}),
    ("TPU v4", {"bfloat16": 275.0, "float32": 275.0}),
    ("TPU v5 lite", {"bfloat16": 197.0, "float32": 197.0}),
    ("TPU v5p", {"bfloat16": 459.0, "float32": 459.0}),
)


def known_peak(device_kind: str, dtype: str) -> float | None:
    """FLOP/s of one device of that kind in that compute dtype, from the table; None when not listed."""
    for pattern, peaks in PEAK_TFLOPS:
        if _names(device_kind, pattern) and dtype in peaks:
            return peaks[dtype] * 1e12
    return None


def _names(device_kind: str, pattern: str) -> bool:
    """Whether the pattern's words occur in the device kind as whole words: an L40 or an A10G is not an L4 or an
    A10 (a wrong peak would misstate MFU; an unknown device says it is not in the table)."""
    words, wanted = _words(device_kind), _words(pattern)
    return any(words[i:i + len(wanted)] == wanted for i in range(len(words)))


def _words(text: str) -> list[str]:
    return re.split(r"[\s_-]+", text.strip().lower())


def measured_cpu_peak(device: jax.Device, dtype: str, local_devices: int, size: int = 1024) -> float:
    """FLOP/s of the best of several square matmuls on one CPU device, divided among the CPU devices of this
    process (they share the host's cores)."""
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = np.inf
    for _ in range(5):
        began = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - began)
    return 2.0 * size**3 / best / local_devices


def peak_per_device(devices: list, dtype: str) -> tuple[float | None, str]:
    """(FLOP/s of one device, where the figure comes from)."""
    device = devices[0]
    if device.platform == "cpu":
        local = sum(1 for d in devices if d.process_index == jax.process_index())
        return (measured_cpu_peak(device, dtype, local),
                f"measured {dtype} matmul on this CPU, shared by {local} devices")
    peak = known_peak(device.device_kind, dtype)
    source = f"{device.device_kind} {dtype} dense, datasheet" if peak else f"{device.device_kind}: not in the table"
    return peak, source
