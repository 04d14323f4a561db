"""GPUs to compile for without having one: `xlatrain lower --target h100` (docs/performance.md).

XLA:GPU compiles from a description of the device (XLA's GpuTargetConfigProto, as text): compute capability,
SM count, shared memory, memory size and bandwidth. jax's CUDA plugin takes one and gives compile-only devices
(xlatrain/compat/backends.py), so a CPU-only host can compile a config's train step for a GPU, read XLA's memory
analysis of it, and check its HLO, before anyone rents the GPU. Nothing runs: on a host without such a GPU, XLA picks
kernels without timing them (no autotuning), so they may differ from those the device itself gets.

The known targets below are the vendors' figures for each device. Any other device: a target config written as
text, e.g. one of XLA's own (xla/backends/gpu/target_config/specs/) or one dumped from the device itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    message_factory,
    text_format,
)

from xlatrain.errors import UserError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    """The device kind the device reports (what xlatrain/observe/peaks.py looks up for MFU)."""
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
SPEC_FILES = "a GPU target config in text format (XLA's xla/backends/gpu/target_config/specs/*.txtpb)"


@dataclass(frozen=True)
class GpuTarget:
    label: str
    """What the user asked for: a known name, or the file."""
    device_kind: str
    memory_bytes: int
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


DEVICE_FIGURES = {
    "threads_per_block_limit": "int32", "threads_per_warp": "int32", "shared_memory_per_block": "int32",
    "shared_memory_per_core": "int32", "shared_memory_per_block_optin": "int32", "threads_per_core_limit": "int32",
    "core_count": "int32", "fpus_per_core": "int64", "block_dim_limit_x": "int64", "block_dim_limit_y": "int64",
    "block_dim_limit_z": "int64", "memory_bandwidth": "int64", "l2_cache_size": "int64", "clock_rate_ghz": "float",
    "device_memory_size": "int64", "registers_per_core_limit": "int64", "registers_per_block_limit": "int64",
}
"""The figures of gpu_device_info (XLA's GpuDeviceInfoProto, xla/stream_executor/device_description.proto) that
XLA:GPU's compiler reads, by their proto type; each must be positive. XLA takes a file without one and then
crashes the process (a division by zero, a failed launch-config check), runs out of shared memory, or, without
device_memory_size, rematerialises the step to fit 0 bytes."""


@cache
def _target_config_subset():
    """The message class of the part of XLA's GpuTargetConfigProto that xlatrain checks. Text format names
    fields, not numbers, so a target file parses against it with the rest of XLA's fields skipped."""
    field = descriptor_pb2.FieldDescriptorProto
    scalars = {"int32": field.TYPE_INT32, "int64": field.TYPE_INT64, "float": field.TYPE_FLOAT,
               "string": field.TYPE_STRING}
    file = descriptor_pb2.FileDescriptorProto(name="xlatrain_gpu_target.proto", package="xlatrain", syntax="proto3")

    def message(name: str, fields: dict[str, str]) -> None:
        described = file.message_type.add(name=name)
        for number, (field_name, kind) in enumerate(fields.items(), start=1):
            if kind in scalars:
                described.field.add(name=field_name, number=number, type=scalars[kind])
            else:
                described.field.add(name=field_name, number=number, type=field.TYPE_MESSAGE,
                                    type_name=f".xlatrain.{kind}")

    message("CudaComputeCapability", {"major": "int32", "minor": "int32"})
    message("GpuDeviceInfo", {**DEVICE_FIGURES, "cuda_compute_capability": "CudaComputeCapability"})
    message("GpuTargetConfig", {"gpu_device_info": "GpuDeviceInfo", "platform_name": "string",
                                "device_description_str": "string"})
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("xlatrain.GpuTargetConfig"))


def parse_target_config(text: str) -> tuple[object, list[str]]:
    """Pure: the checked part of a GpuTargetConfigProto in text format, and what keeps it from describing a CUDA
    GPU that XLA can compile for ([] when nothing does). Fields xlatrain does not check are left to XLA."""
    config = _target_config_subset()()
    try:
        text_format.Parse(text, config, allow_unknown_field=True)
    except text_format.ParseError as error:
        return config, [f"not a GPU target config in text format ({error})"]
    if not config.HasField("gpu_device_info") or not config.device_description_str:
        return config, ["not a GPU target config in text format: it needs gpu_device_info and device_description_str"]
    info = config.gpu_device_info
    unset = [f"{name} ({getattr(info, name)})" for name in DEVICE_FIGURES if not getattr(info, name) > 0]
    problems = [f"gpu_device_info lacks a positive {', '.join(unset)}"] if unset else []
    if info.cuda_compute_capability.major < 1:
        problems.append("gpu_device_info.cuda_compute_capability.major is missing or 0: jax's CUDA plugin compiles for "
                        "a CUDA compute capability")
    if config.platform_name not in ("", "CUDA"):
        problems.append(f'platform_name is "{config.platform_name}": jax\'s CUDA plugin compiles for "CUDA" only')
    return config, problems


_RESOLVED_MEMORY: dict[str, int] = {}
"""The memory of each target resolved in this process, by its device kind: compile-only devices do not report
their memory, and remat: auto and the train state's check ask for it (resolved_memory)."""


def resolve_target(asked: str) -> GpuTarget:
    """A known name (case-insensitive) or a target-config file that parse_target_config accepts; a clear
    error otherwise. Its device memory is remembered for resolved_memory."""
    spec = GPU_TARGETS.get(asked.lower())
    if spec is not None:
        _RESOLVED_MEMORY[spec.name] = spec.memory_bytes
        return GpuTarget(asked.lower(), spec.name, spec.memory_bytes, target_config_text(spec))
    path = Path(asked)
    if not path.is_file():
        raise UserError(f"--target {asked}: neither a known GPU ({', '.join(GPU_TARGETS)}) nor a file; give one of "
                        f"those names, or the path of {SPEC_FILES}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--target {asked}: cannot read the target config: {error}") from None
    config, problems = parse_target_config(text)
    if problems:
        raise UserError(f"--target {asked}: {'; '.join(problems)}; give {SPEC_FILES}, with every figure of "
                        "gpu_device_info that they set")
    kind, memory = config.device_description_str, config.gpu_device_info.device_memory_size
    _RESOLVED_MEMORY[kind] = memory
    return GpuTarget(str(path), kind, memory, text)


def resolved_memory(device_kind: str) -> int:
    """The memory of the target resolved in this process whose compile-only devices report this device kind."""
    return _RESOLVED_MEMORY[device_kind]


def target_devices(mesh_data: int, per_replica: int, asked: int | None) -> int:
    """How many GPUs to compile for: --devices, else what the mesh names (mesh.data=-1: one data replica of
    `per_replica` devices, mesh.stage x mesh.tensor)."""
    if asked is not None:
        if asked < 1:
            raise UserError(f"--devices {asked}: compile for at least 1 GPU")
        return asked
    return (1 if mesh_data == -1 else mesh_data) * per_replica
