"""Values that follow from a config and the devices present: batch sizes, the effective LR, pipeline sizes,
the layer scan."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from xlatrain.config.model import DECODERS
from xlatrain.config.parallel import MeshConfig
from xlatrain.config.schema import Config
from xlatrain.errors import UserError


@dataclass(frozen=True)
class Derived:
    """Values that follow from the config and the devices present; printed by `xlatrain config`."""

    devices: int
    data_parallel: int
    global_batch: int
    per_replica_batch: int
    microbatches: int
    microbatch_size: int
    lr_scale: float
    effective_lr: float
    stages: int = 1
    pipeline_microbatches: int | None = None
    """Per gradient-accumulation microbatch and replica (pipelines only)."""
    pipeline_microbatch_size: int | None = None
    """Rows of one pipeline microbatch on one replica (pipelines only)."""
    scan_layers: bool | None = None
    """Whether a built-in decoder's blocks run in a `lax.scan` on these devices (model.scan_layers resolved)."""
    tensor_whole: tuple[str, ...] | None = None
    """Logical names parallel.logical_rules split over `tensor` that each device of a tensor group keeps whole
    (grouped-query attention's model.kv_heads when fewer than mesh.tensor: every device computes every key/value
    head for its query heads)."""

    def as_dict(self) -> dict[str, Any]:
        return saved_values(self)


def saved_values(record: Any) -> dict[str, Any]:
    """A dataclass's fields as a run's config.yaml saves them: tuples as lists, unset (None) ones left out."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(record).items() if v is not None}


def derive(config: Config, devices: list) -> Derived:
    """Check the config against the devices present and compute batch sizes and the effective LR."""
    data_parallel = resolve_data_parallel(config.mesh, devices)
    micro = config.batch.microbatches
    if config.batch.global_size is not None:
        global_batch = config.batch.global_size
        if global_batch % (data_parallel * micro):
            raise UserError(
                f"config: batch.global_size={global_batch} is not divisible by data-parallel size "
                f"{data_parallel} x batch.microbatches {micro} = {data_parallel * micro}; "
                f"use a multiple of {data_parallel * micro}"
            )
    else:
        global_batch = config.batch.per_replica * data_parallel
        if config.batch.per_replica % micro:
            raise UserError(
                f"config: batch.per_replica={config.batch.per_replica} is not divisible by "
                f"batch.microbatches={micro}"
            )
    base = config.optimizer.base_batch_size or global_batch
    lr_scale = {"none": 1.0, "linear": global_batch / base, "sqrt": math.sqrt(global_batch / base)}[
        config.optimizer.lr_scaling
    ]
    return Derived(
        devices=len(devices),
        data_parallel=data_parallel,
        global_batch=global_batch,
        per_replica_batch=global_batch // data_parallel,
        microbatches=micro,
        microbatch_size=global_batch // micro,
        lr_scale=lr_scale,
        effective_lr=config.optimizer.lr * lr_scale,
        scan_layers=config.model.scans_layers(devices[0].platform) if isinstance(config.model, DECODERS) else None,
        tensor_whole=config.tensor_whole() or None,
        **_pipeline_sizes(config, global_batch // data_parallel),
    )


def _pipeline_sizes(config: Config, per_replica_batch: int) -> dict[str, int]:
    """A replica's batch is cut into batch.microbatches accumulation microbatches, and each of those into
    parallel.pipeline.microbatches pipeline microbatches."""
    stages = config.mesh.stage
    if stages == 1:
        return {}
    accumulation = config.batch.microbatches
    pipelined = config.parallel.pipeline.microbatches_for(stages)
    if per_replica_batch % (accumulation * pipelined):
        raise UserError(
            f"config: the per-replica batch {per_replica_batch} is not divisible by batch.microbatches "
            f"{accumulation} x parallel.pipeline.microbatches {pipelined} = {accumulation * pipelined}; "
            "change the batch size or either count"
        )
    return {"stages": stages, "pipeline_microbatches": pipelined,
            "pipeline_microbatch_size": per_replica_batch // (accumulation * pipelined)}


def resolve_data_parallel(mesh: MeshConfig, devices: list) -> int:
    """mesh.data x mesh.stage x mesh.expert x mesh.context x mesh.tensor must be the devices present; -1 for
    mesh.data takes what the others leave."""
    present, per_replica = len(devices), mesh.per_replica()
    data = present // per_replica if mesh.data == -1 else mesh.data
    if data >= 1 and data * per_replica == present:
        return data
    platform = devices[0].platform if devices else "cpu"
    found = ", ".join(str(d) for d in devices[:8]) + (" ..." if len(devices) > 8 else "")
    wanted = (mesh.data if mesh.data != -1 else max(data, 1)) * per_replica
    processes = len({d.process_index for d in devices})
    if processes > 1:  # mesh.cpu_devices is for one process; each process's own count makes the total
        how = (f"start {wanted} devices over the processes ({processes} now): with `xlatrain launch`, --nproc x "
               "--devices-per-proc" + (", or choose each host's GPUs with CUDA_VISIBLE_DEVICES" if platform != "cpu"
                                       else ", elsewhere XLA_FLAGS=--xla_force_host_platform_device_count in each"))
    elif platform == "cpu":
        how = (f"set mesh.cpu_devices={wanted} (or, where the environment sets the count, "
               f"XLA_FLAGS=--xla_force_host_platform_device_count={wanted}) to get that many CPU devices")
    else:
        how = "choose the GPUs with CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES=0,1,2,3)"
    split = [(f"mesh.{axis}", size) for axis, size in (("stage", mesh.stage), ("expert", mesh.expert),
                                                       ("context", mesh.context), ("tensor", mesh.tensor)) if size > 1]
    named, sized = " x ".join(n for n, _ in split), " x ".join(f"{n}={size}" for n, size in split)
    if per_replica == 1:
        asked, fix = f"mesh.data={mesh.data} needs {mesh.data}", f"Set mesh.data={present} (or -1 for all)"
    elif mesh.data == -1:
        asked, fix = f"{sized} needs a multiple of {per_replica}", f"Set {named} to a divisor of {present}"
    else:
        asked = f"mesh.data={mesh.data} x {sized} needs {wanted}"
        fix = f"Set mesh.data x {named} to {present} (mesh.data=-1 takes what the others leave)"
    raise UserError(
        f"config: {asked} devices but {present} {platform} device(s) are present: [{found}]. {fix}, or {how}."
    )
