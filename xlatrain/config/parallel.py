"""The `mesh`, `parallel` and `collectives` sections: devices, strategies, pipelines and gradient sync."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from xlatrain.config.base import PositiveInt, Strict, positive_ints
from xlatrain.config.precision import FloatDtype


class MeshConfig(Strict):
    """The device mesh: a `data` axis, a `stage` axis for a pipeline, an `expert` axis that splits a Mixture of
    Experts' experts, a `context` axis that splits the sequence and a `tensor` axis that splits the layers, in that
    order; mesh.data x mesh.stage x mesh.expert x mesh.context x mesh.tensor must be the devices present, or the run
    stops before compiling, naming them (docs/parallelism.md)."""

    data: Annotated[int, Field(ge=-1)] = -1
    """Data-parallel size; -1 uses every device present (divided by mesh.stage x mesh.expert x mesh.context x
    mesh.tensor)."""
    stage: PositiveInt = 1
    """Pipeline stages; more than 1 runs the model as a pipeline (parallel.pipeline) on a data x stage mesh."""
    expert: PositiveInt = 1
    """Expert-parallel size (model.moe): each MoE layer's experts split over this many devices (the `expert` axis,
    between `stage` and `context`), which also share each data replica's rows, so that the rest of the model runs
    data-parallel over them; tokens reach their experts' devices by an all-to-all and come back by another
    (docs/parallelism.md)."""
    context: PositiveInt = 1
    """Context-parallel size: every layer's activations split along the sequence over this many devices (the
    `context` axis, between `stage` and `tensor`), attention by parallel.context_attention; each device holds an
    early and a late chunk of the row, so that causal attention's work is balanced (docs/parallelism.md)."""
    tensor: PositiveInt = 1
    """Tensor-parallel size: each layer split over this many devices (the innermost mesh axis, neighbouring
    devices), Megatron-style by the default parallel.logical_rules: attention heads and the MLP's hidden
    dimension (column-parallel in, row-parallel out) and the vocabulary of the embedding and the head, with a
    vocabulary-parallel cross-entropy (docs/parallelism.md)."""
    cpu_devices: Literal["auto", "per_core"] | PositiveInt = "auto"
    """XLA:CPU devices the `xlatrain` command makes in a single-process run on CPU (ignored on GPUs, and where
    the environment sets a count: XLA_FLAGS' --xla_force_host_platform_device_count or JAX_NUM_CPU_DEVICES).
    auto: what the mesh asks for (mesh.data x mesh.stage when mesh.data is set, mesh.stage for a pipeline),
    else JAX's one. per_core: with mesh.data=-1 and no pipeline, one per core, data-parallel, as far as
    batch.global_size divides and the replicas' train state fits the host's memory (otherwise as auto).
    A number: that many."""

    @field_validator("cpu_devices", mode="before")
    @classmethod
    def _cpu_devices_is_a_mode_or_a_count(cls, value: Any) -> Any:
        if value not in ("auto", "per_core") and not positive_ints([value]):
            raise ValueError("must be auto, per_core or a device count of at least 1")
        return value

    @model_validator(mode="after")
    def _not_zero(self) -> MeshConfig:
        if self.data == 0:
            raise ValueError("mesh.data must be a positive device count, or -1 for all devices")
        return self

    def per_replica(self) -> int:
        """Devices that hold one data replica: mesh.stage x mesh.expert x mesh.context x mesh.tensor."""
        return self.stage * self.expert * self.context * self.tensor


TENSOR = "tensor"
MESH_AXES = ("data", "expert", TENSOR)
"""Mesh axes that parallel.logical_rules may name (the `stage` axis holds pipeline stages, not tensor dims)."""
MeshAxes = tuple[str, ...]
DEFAULT_LOGICAL_RULES: dict[str, MeshAxes] = {
    "vocab": ("tensor", "data"), "embed": ("data",), "mlp": ("tensor", "data"), "heads": ("tensor", "data"),
    "kv_heads": ("tensor", "data"), "hidden": ("data",), "channels": ("data",), "experts": ("expert", "data")}
"""Megatron-style tensor parallelism over `tensor` (heads, the MLP's hidden dimension, the vocabulary), and what
zero1/fsdp split over `data`: a dimension goes to each listed axis in turn that is not used by another of the
parameter's dimensions and divides it, together (e.g. heads over tensor x data)."""


PipelineSchedule = Literal["gpipe", "1f1b", "interleaved", "zb1p", "zbv"]
ZERO_BUBBLE = ("zb1p", "zbv")
"""The schedules whose backward is B and W, both run from the forward's residuals."""
SCHEDULES_BY_OTHER_NAMES = {
    "dualpipev": "the nearest here is zbv, DualPipeV's V placement (stage i holds chunks i and 2 x mesh.stage - 1 - i)"
                 " in ZB-V's order; DualPipeV's overlap of one microbatch's forward with another's backward is not "
                 "built",
    **{name: f"here it is {ours}" for name, ours in [("zbvzerobubble", "zbv"), ("zbv", "zbv"), ("zbh1", "zb1p"),
                                                      ("zerobubble", "zb1p"), ("interleaved1f1b", "interleaved"),
                                                      ("1f1b", "1f1b"), ("gpipe", "gpipe")]}}
"""Names of schedules elsewhere (torch.distributed.pipelining's Schedule* classes, DeepSeek's DualPipeV, the
Zero Bubble paper), as letters and digits in lower case: what a user may type for one of xlatrain's."""


class PipelineConfig(Strict):
    """How the model runs as a pipeline over the `stage` mesh axis (used when mesh.stage > 1)."""

    schedule: PipelineSchedule = "1f1b"
    """gpipe: every forward, then every backward. 1f1b: one forward one backward, at most mesh.stage
    microbatches of activations per stage. interleaved: 1f1b over virtual_stages model chunks per stage.
    zb1p: zero-bubble ZB-H1, 1f1b with each backward split into the input gradient (B) and the weight
    gradients (W), which fill the cool-down bubble; 1f1b's memory (keeps residuals: remat none). zbv: ZB-V,
    two chunks per stage placed in a V (stage i holds chunks i and 2 x mesh.stage - 1 - i, so the first and
    the last chunk share stage 0), B and W split as in zb1p; 1f1b's memory (keeps residuals: remat none)."""
    microbatches: PositiveInt | None = None
    """Pipeline microbatches each gradient-accumulation microbatch is split into; null = 2 x mesh.stage."""
    virtual_stages: PositiveInt | None = None
    """Model chunks per stage (interleaved: 2 or more, zbv: 2); null = 2 for interleaved and zbv, 1 otherwise."""
    partition: Literal["auto"] | tuple[PositiveInt, ...] = "auto"
    """auto: blocks per chunk chosen from XLA's cost and memory analysis; or a list of block counts, one per
    chunk (mesh.stage x virtual_stages of them), in model order."""
    remat: Literal["none", "full", "auto"] = "full"
    """full (the default; none for zb1p and zbv, whose B and W run from the residuals and cannot recompute them):
    each chunk's backward recomputes its forward from the stored input activation (~1.33x the model's work).
    none: the forward keeps the chunk's residuals (what its VJP saves) until the backward, which only runs the
    pullback: the model's work, for more memory (residuals of every microbatch in flight). auto: none when XLA's
    memory analysis of the step compiled with none fits memory_budget_bytes, full otherwise (zb1p, zbv: an
    error naming both sizes)."""
    memory_budget_bytes: PositiveInt | None = None
    """What one device may use (remat: auto only); null = the device's memory (a CPU device: its share of the
    host's RAM)."""

    @model_validator(mode="before")
    @classmethod
    def _zero_bubble_keeps_residuals_by_default(cls, value: Any) -> Any:
        if isinstance(value, dict) and "remat" not in value and value.get("schedule") in ZERO_BUBBLE:
            return {**value, "remat": "none"}
        return value

    @field_validator("schedule", mode="before")
    @classmethod
    def _names_from_elsewhere_point_to_ours(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in get_args(PipelineSchedule):
            known = SCHEDULES_BY_OTHER_NAMES.get(re.sub(r"[^a-z0-9]", "", value.lower()).removeprefix("schedule"))
            if known:
                raise ValueError(f"not a schedule name of xlatrain's; {known}")
        return value

    @field_validator("partition", mode="before")
    @classmethod
    def _partition_is_auto_or_block_counts(cls, value: Any) -> Any:
        if value != "auto" and not positive_ints(value):
            raise ValueError("must be auto or a list of block counts, each at least 1, one per pipeline chunk")
        return value

    def chunks_per_stage(self) -> int:
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.schedule in ("interleaved", "zbv") else 1

    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as B and W (a zero-bubble schedule)."""
        return self.schedule in ZERO_BUBBLE

    def microbatches_for(self, stages: int) -> int:
        return self.microbatches if self.microbatches is not None else 2 * stages


class ParallelConfig(Strict):
    """How the step runs over the mesh: one global program or one device's, and what each device holds
    (docs/parallelism.md); a pipeline's schedule over the `stage` axis (docs/pipelines.md)."""

    strategy: Literal["replicated", "zero1", "fsdp"] = "replicated"
    """replicated: plain data parallel. zero1: optimizer state sharded over `data`. fsdp: params too. Every
    strategy splits layers over `tensor` (mesh.tensor)."""
    logical_rules: dict[str, MeshAxes] = DEFAULT_LOGICAL_RULES
    """Logical axis name -> a mesh axis, a list of them (the dimension split over their product, as far as each
    divides it), or null (not split); merged over the defaults. `data` is used by zero1 (optimizer state) and
    fsdp (params too), `tensor` by every strategy when mesh.tensor > 1."""
    sequence_parallel: bool = False
    """With mesh.tensor > 1: the activations between the tensor-parallel regions (norms, dropout, residual adds)
    split along the sequence over `tensor` (gathered before the column-parallel matmul, reduce-scattered after
    the row-parallel one), so their memory per device falls by mesh.tensor."""
    mode: Literal["auto", "jit", "shard_map", "pmap"] = "auto"
    """auto: shard_map where a per-device program is needed (a pipeline, mesh.stage > 1, or
    collectives.impl=custom), jit otherwise. jit: one global program, XLA's partitioner inserts the gradient
    all-reduce. shard_map: a per-device program whose gradient sync is written out (balanced buckets,
    collectives.impl). pmap: the same per-device program through the legacy jax.pmap API."""
    pipeline: PipelineConfig = PipelineConfig()
    context_attention: Literal["ring", "all_gather"] = "ring"
    """With mesh.context > 1: ring passes each device's keys and values round the context group, step by step,
    into an online softmax (no device holds more than its own share of them); all_gather gathers every layer's
    keys and values whole on each device. In a pipeline the ring needs collectives.impl=custom (XLA's
    collective-permute waits for every device of the mesh, and stages act at different times)."""

    @field_validator("logical_rules", mode="before")
    @classmethod
    def _rules_name_mesh_axes(cls, rules: Any) -> Any:
        if not isinstance(rules, dict):
            return rules
        as_axes = {name: () if axes is None else (axes,) if isinstance(axes, str) else axes
                   for name, axes in rules.items()}
        unknown = {name: axes for name, axes in as_axes.items()
                   if not isinstance(axes, (list, tuple)) or any(axis not in MESH_AXES for axis in axes)}
        if unknown:
            raise ValueError(f"parallel.logical_rules maps {unknown} to mesh axes that do not exist; "
                             f"mesh axes are {list(MESH_AXES)} (one, a list of them, or null for not sharded)")
        repeated = {name: axes for name, axes in as_axes.items() if len(set(axes)) != len(axes)}
        if repeated:
            raise ValueError(f"parallel.logical_rules maps {repeated} to a mesh axis twice; name each axis once")
        return {**DEFAULT_LOGICAL_RULES, **{name: tuple(axes) for name, axes in as_axes.items()}}


class CollectivesConfig(Strict):
    """How gradients cross the data replicas; impl, bucket_bytes and timeout_s apply to parallel.mode shard_map
    and pmap, where the gradient sync is written out."""

    dtype: FloatDtype = "float32"
    """Dtype the gradients are summed in across data replicas (still loss-scaled), in every mode."""
    impl: Literal["xla", "custom"] = "xla"
    """Which collectives sync the gradients in parallel.mode=shard_map: XLA's own, or xlatrain's
    custom calls (custom_calls/)."""
    bucket_bytes: PositiveInt = 4 * 2**20
    """Gradients are packed into buckets of at most this many bytes (in the communication dtype); each
    bucket is reduce-scattered then all-gathered, so every replica sends and receives the same bytes."""
    timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """How long a custom collective waits for every participant before failing (CPU backend)."""


def check_block_partition(pipe: PipelineConfig, stages: int, blocks: int, counted_by: str) -> None:
    """The model's blocks must fill mesh.stage x virtual_stages chunks, one block or more each."""
    per_stage = pipe.chunks_per_stage()
    chunks = stages * per_stage
    virtual = per_stage > 1 and pipe.schedule != "zbv"
    times = (f" x {per_stage} chunks per stage (schedule=zbv)" if pipe.schedule == "zbv"
             else f" x virtual_stages={per_stage}" if virtual else "")
    if blocks < chunks:
        raise ValueError(f"{counted_by}={blocks} blocks cannot fill mesh.stage={stages}{times} = {chunks} pipeline "
                         f"chunks (one block or more each); use fewer stages{' or virtual stages' if virtual else ''}, "
                         "or more blocks")
    if pipe.partition != "auto" and (len(pipe.partition) != chunks or sum(pipe.partition) != blocks):
        raise ValueError(f"parallel.pipeline.partition={list(pipe.partition)} must give {chunks} block counts "
                         f"(mesh.stage={stages}{times}) that add up to {counted_by}={blocks}; or use partition=auto")
