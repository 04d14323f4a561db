"""GPUs to compile for without having one: `xlatrain lower --target h100` (README, "Compile for a GPU you do not have").

XLA:GPU compiles from a description of the device (XLA's GpuTargetConfigProto, as text): compute capability,
SM count, shared memory, memory size and bandwidth. jax's CUDA plugin takes one and gives compile-only devices
(xlatrain/compat.py), so a CPU-only host can compile a config's train step for a GPU, read XLA's memory analysis
of it, and check its HLO, before anyone rents the GPU. Nothing runs: on a host without such a GPU, XLA picks
kernels without timing them (no autotuning), so they may differ from those the device itself gets.

The known targets below are the vendors' figures for each device. Any other device: a target config written as
text, e.g. one of XLA's own (xla/backends/gpu/target_config/specs/) or one dumped from the device itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from xlatrain.errors import UserError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    """The device kind the device reports (what xlatrain/peaks.py looks up for MFU)."""
    compute_capability: tuple[int, int]
    sms: int
    memory_bytes: int
    """The total nvidia-smi reports; a CUDA context takes a few hundred MiB of it."""
    memory_bandwidth_bytes_per_s: int
    l2_cache_bytes: int
    clock_ghz: float
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    threads_per_sm: int
    fp32_lanes_per_sm: int


MIB = 2**20
GPU_TARGETS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 81559 * MIB, 3_350_000_000_000, 50 * MIB, 1.98,
                    228 * 1024, 227 * 1024, 2048, 128),
    "h200": GpuSpec("NVIDIA H200", (9, 0), 132, 143771 * MIB, 4_800_000_000_000, 50 * MIB, 1.98,
                    228 * 1024, 227 * 1024, 2048, 128),
    "a100": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 81920 * MIB, 2_039_000_000_000, 40 * MIB, 1.41,
                    164 * 1024, 163 * 1024, 2048, 64),
    "l4": GpuSpec("NVIDIA L4", (8, 9), 58, 23034 * MIB, 300_000_000_000, 48 * MIB, 2.04,
                  100 * 1024, 99 * 1024, 1536, 128),
}
"""SXM parts where there are several (an H100 PCIe has 114 SMs and 2.0 TB/s: give its target config as a file)."""


@dataclass(frozen=True)
class GpuTarget:
    label: str
    """What the user asked for: a known name, or the file."""
    device_kind: str
    memory_bytes: int | None
    config_text: str
    """XLA's GpuTargetConfigProto in text format."""


def target_config_text(spec: GpuSpec) -> str:
    """Pure: the GpuTargetConfigProto (text format) of a known device."""
    major, minor = spec.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {spec.shared_memory_per_sm}
  shared_memory_per_block_optin: {spec.shared_memory_per_block_optin}
  threads_per_core_limit: {spec.threads_per_sm}
  core_count: {spec.sms}
  fpus_per_core: {spec.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {spec.memory_bandwidth_bytes_per_s}
  l2_cache_size: {spec.l2_cache_bytes}
  clock_rate_ghz: {spec.clock_ghz}
  device_memory_size: {spec.memory_bytes}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
}}
device_description_str: "{spec.name}"
"""


_FILE_TARGET_MEMORY: dict[str, int] = {}
"""The memory of each target file's device resolved in this process, by its device kind: compile-only devices do
not report their memory, and remat: auto and the train state's check ask for it (known_memory)."""


def resolve_target(asked: str) -> GpuTarget:
    """A known name (case-insensitive) or a target-config file; a clear error otherwise. A file's device memory
    is remembered for known_memory."""
    spec = GPU_TARGETS.get(asked.lower())
    if spec is not None:
        return GpuTarget(asked.lower(), spec.name, spec.memory_bytes, target_config_text(spec))
    path = Path(asked)
    if not path.is_file():
        raise UserError(f"--target {asked}: neither a known GPU ({', '.join(GPU_TARGETS)}) nor a file; give one of "
                        "those names, or the path of a GPU target config in text format (XLA's "
                        "xla/backends/gpu/target_config/specs/*.txtpb)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--target {asked}: cannot read the target config: {error}") from None
    name = re.search(r'device_description_str:\s*"([^"]*)"', text)
    memory = re.search(r"device_memory_size:\s*(\d+)", text)
    if "gpu_device_info" not in text or name is None:
        raise UserError(f"--target {asked}: not a GPU target config in text format (it needs gpu_device_info and "
                        "device_description_str; see XLA's xla/backends/gpu/target_config/specs/*.txtpb)")
    if memory:
        _FILE_TARGET_MEMORY[name.group(1)] = int(memory.group(1))
    return GpuTarget(str(path), name.group(1), int(memory.group(1)) if memory else None, text)


def known_memory(device_kind: str) -> int | None:
    """The memory of a known target, or of a target file's device resolved in this process, by the device kind
    its compile-only devices report; None for others."""
    known = next((spec.memory_bytes for spec in GPU_TARGETS.values() if spec.name == device_kind), None)
    return known or _FILE_TARGET_MEMORY.get(device_kind)


def target_devices(mesh_data: int, mesh_stage: int, asked: int | None) -> int:
    """How many GPUs to compile for: --devices, else what the mesh names (mesh.data=-1: one data replica)."""
    if asked is not None:
        if asked < 1:
            raise UserError(f"--devices {asked}: compile for at least 1 GPU")
        return asked
    return (1 if mesh_data == -1 else mesh_data) * mesh_stage
