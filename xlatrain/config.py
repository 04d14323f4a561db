"""The typed run config: YAML plus dotted overrides (OmegaConf), validated by a frozen pydantic schema.

Every problem becomes one `UserError` naming the dotted key and how to fix it.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from xlatrain.errors import UserError, first_line

INT32_MAX = 2**31 - 1
"""Counts and sizes must fit the int32 that array shapes, indices and XLA's loop counters use."""
PositiveInt = Annotated[int, Field(gt=0, le=INT32_MAX)]
NonNegativeInt = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
"""What numpy's and torch's generators accept."""
Fraction = Annotated[float, Field(gt=0.0, lt=1.0)]
DropoutRate = Annotated[float, Field(ge=0.0, lt=1.0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, allow_inf_nan=False)


# --- model -------------------------------------------------------------------------------------


class ModelBase(Strict):
    loss: Literal["cross_entropy", "mse"] = "cross_entropy"
    """cross_entropy: integer targets, logits on the last axis. mse: targets shaped like the output."""


class MLPConfig(ModelBase):
    name: Literal["mlp"]
    hidden: tuple[PositiveInt, ...] = (128, 128)
    dropout: DropoutRate = 0.0


class CNNConfig(ModelBase):
    name: Literal["cnn"]
    channels: tuple[PositiveInt, ...] = (16, 32)
    hidden: PositiveInt = 64


CPU_UNROLLED_LAYERS = 16


class GPTConfig(ModelBase):
    name: Literal["gpt"]
    layers: PositiveInt = 4
    width: PositiveInt = 128
    heads: PositiveInt = 4
    mlp_ratio: PositiveInt = 4
    vocab: PositiveInt = 256
    max_len: PositiveInt | None = None
    """Positional table size; defaults to data.seq_len."""
    dropout: DropoutRate = 0.0
    scan_layers: Literal["auto"] | bool = "auto"
    """`lax.scan` over the blocks; auto: see `scans_layers`."""

    def scans_layers(self, platform: str) -> bool:
        """auto scans on accelerators and unrolls on CPU up to CPU_UNROLLED_LAYERS blocks, where XLA:CPU runs
        the unrolled step 1.06-1.27x faster (bench/results/cpu_speed.json) and deeper stacks compile slowly
        unrolled (about 0.4 s more per block)."""
        if self.scan_layers != "auto":
            return self.scan_layers
        return platform != "cpu" or self.layers > CPU_UNROLLED_LAYERS

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.width % self.heads:
            raise ValueError(f"model.width={self.width} must be divisible by model.heads={self.heads}")
        return self


class CustomModelConfig(ModelBase):
    name: Literal["custom"]
    target: Annotated[str, Field(pattern=r"^[\w.]+:[\w.]+$")]
    """"package.module:ClassName" of a flax.nnx.Module; see README "Bring your own model"."""
    kwargs: dict[str, Any] = {}


class TorchModelConfig(ModelBase):
    name: Literal["torch"]
    target: Annotated[str, Field(pattern=r"^[\w.]+:[\w.]+$")]
    """"package.module:Name" of a torch.nn.Module subclass, or of a function returning a module."""
    kwargs: dict[str, Any] = {}
    init_from: str | None = None
    """A torch state_dict (.pt) to start from instead of the module's own initialisation."""
    shard_dims: dict[str, int | None] = {}
    """Parameter-name glob -> the dimension zero1/fsdp shard over `data` (null: keep it whole); the first
    matching pattern wins. Unmatched params: their largest dimension that the data axis divides."""
    blocks: str = "blocks"
    """For pipelines: the nn.ModuleList attribute holding the repeated blocks (the module also defines
    before_blocks(inputs) and after_blocks(x))."""

    @model_validator(mode="after")
    def _init_file_exists(self) -> TorchModelConfig:
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise ValueError(f"model.init_from={self.init_from!r} is not a file; give a torch state_dict saved "
                             "with torch.save(module.state_dict(), PATH)")
        return self


ModelConfig = Annotated[
    Union[MLPConfig, CNNConfig, GPTConfig, CustomModelConfig, TorchModelConfig], Field(discriminator="name")
]

# --- data --------------------------------------------------------------------------------------


class DataBase(Strict):
    shuffle: bool = True
    prefetch: PositiveInt = 2
    """Batches kept in flight on the devices by the device loader."""


class DigitsData(DataBase):
    source: Literal["digits"]
    holdout: Fraction = 0.2


class TextData(DataBase):
    source: Literal["text"]
    path: str | None = None
    """Directory of text files; default: this Python's standard-library sources."""
    glob: str = "**/*.py"
    seq_len: PositiveInt = 64
    max_bytes: PositiveInt = 8_000_000
    holdout: Fraction = 0.05
    buckets: tuple[PositiveInt, ...] | None = None
    """Variable-length examples (one paragraph each, up to seq_len bytes), every batch padded to the
    shortest of these lengths (or seq_len) that fits it, with padding masked out of the loss.
    Default: fixed windows of seq_len."""

    @field_validator("glob")
    @classmethod
    def _relative_pattern(cls, pattern: str) -> str:
        if not pattern or Path(pattern).is_absolute():
            raise ValueError(f"data.glob={pattern!r} must be a non-empty pattern relative to data.path, e.g. "
                             "'**/*.txt'")
        return pattern

    @model_validator(mode="after")
    def _path_exists(self) -> TextData:
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"data.path={self.path!r} is not a directory; point it at a folder of text files")
        if self.buckets is not None:
            if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[-1] > self.seq_len:
                raise ValueError(f"data.buckets={list(self.buckets)} must be strictly increasing lengths "
                                 f"no longer than data.seq_len={self.seq_len}")
        return self


class ArrayData(DataBase):
    source: Literal["arrays"]
    path: str
    """A directory holding inputs.npy and targets.npy (memory-mapped), or an .npz file with those keys."""
    holdout: Fraction = 0.1

    @model_validator(mode="after")
    def _path_exists(self) -> ArrayData:
        if not Path(self.path).exists():
            raise ValueError(
                f"data.path={self.path!r} does not exist; give a directory with inputs.npy and "
                "targets.npy, or an .npz file"
            )
        return self


DataConfig = Annotated[Union[DigitsData, TextData, ArrayData], Field(discriminator="source")]

# --- batch, optimizer, mesh, trainer ----------------------------------------------------------


class BatchConfig(Strict):
    global_size: PositiveInt | None = None
    """Samples per optimizer step over all replicas; 16 when neither size is set."""
    per_replica: PositiveInt | None = None
    """Samples per optimizer step on each data-parallel replica (alternative to global_size)."""
    microbatches: PositiveInt = 1
    """Gradient-accumulation steps inside one compiled step."""

    @model_validator(mode="after")
    def _at_most_one_size(self) -> BatchConfig:
        if self.global_size is not None and self.per_replica is not None:
            raise ValueError("set only one of batch.global_size and batch.per_replica")
        if self.global_size is None and self.per_replica is None:
            object.__setattr__(self, "global_size", 16)
        return self


class OptimizerBase(Strict):
    lr: Annotated[float, Field(gt=0)] = 3e-3
    """Peak learning rate at optimizer.base_batch_size."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch_size: PositiveInt | None = None
    """Global batch that optimizer.lr was tuned for; default: the run's global batch."""
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    """Linear warmup from 0, clamped to the schedule's horizon."""
    decay_steps: PositiveInt | None = None
    """The schedule's horizon (warmup included): the step where decay ends. null: trainer.steps when the run is
    created; saved in the run's config.yaml, so resuming with more trainer.steps keeps it unless this is set."""
    final_lr_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    clip_norm: Annotated[float, Field(gt=0)] | None = 1.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0


class AdamWConfig(OptimizerBase):
    name: Literal["adamw"]
    b1: Fraction = 0.9
    b2: Fraction = 0.999
    eps: Annotated[float, Field(gt=0)] = 1e-8


class SGDConfig(OptimizerBase):
    name: Literal["sgd"]
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    nesterov: bool = False


class LionConfig(OptimizerBase):
    name: Literal["lion"]
    b1: Fraction = 0.9
    b2: Fraction = 0.99


class AdafactorConfig(OptimizerBase):
    name: Literal["adafactor"]
    decay_rate: Fraction = 0.8
    min_dim_size_to_factor: PositiveInt = 128


OptimizerConfig = Annotated[
    Union[AdamWConfig, SGDConfig, LionConfig, AdafactorConfig], Field(discriminator="name")
]


class MeshConfig(Strict):
    data: Annotated[int, Field(ge=-1)] = -1
    """Data-parallel size; -1 uses every device present (divided by mesh.stage)."""
    stage: PositiveInt = 1
    """Pipeline stages; more than 1 runs the model as a pipeline (parallel.pipeline) on a data x stage mesh."""
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
        if value not in ("auto", "per_core") and not _positive_ints([value]):
            raise ValueError("must be auto, per_core or a device count of at least 1")
        return value

    @model_validator(mode="after")
    def _not_zero(self) -> MeshConfig:
        if self.data == 0:
            raise ValueError("mesh.data must be a positive device count, or -1 for all devices")
        return self


MESH_AXES = ("data",)
"""Mesh axes that parallel.logical_rules may name (the `stage` axis holds pipeline stages, not tensor dims)."""
DEFAULT_LOGICAL_RULES = {"vocab": "data", "embed": "data", "mlp": "data",
                         "heads": "data", "hidden": "data", "channels": "data"}


def _positive_ints(value: Any) -> bool:
    """Whether a raw config value is a list of integers >= 1 (YAML's true is not one)."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)


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
        if value != "auto" and not _positive_ints(value):
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
    strategy: Literal["replicated", "zero1", "fsdp"] = "replicated"
    """replicated: plain data parallel. zero1: optimizer state sharded over `data`. fsdp: params too."""
    logical_rules: dict[str, str | None] = DEFAULT_LOGICAL_RULES
    """Logical axis name -> mesh axis (or null), merged over the defaults; used by zero1/fsdp."""
    mode: Literal["auto", "jit", "shard_map", "pmap"] = "auto"
    """auto: shard_map where a per-device program is needed (a pipeline, mesh.stage > 1, or
    collectives.impl=custom), jit otherwise. jit: one global program, XLA's partitioner inserts the gradient
    all-reduce. shard_map: a per-device program whose gradient sync is written out (balanced buckets,
    collectives.impl). pmap: the same per-device program through the legacy jax.pmap API."""
    pipeline: PipelineConfig = PipelineConfig()

    @field_validator("logical_rules")
    @classmethod
    def _rules_name_mesh_axes(cls, rules: dict[str, str | None]) -> dict[str, str | None]:
        unknown = {name: axis for name, axis in rules.items() if axis is not None and axis not in MESH_AXES}
        if unknown:
            raise ValueError(f"parallel.logical_rules maps {unknown} to mesh axes that do not exist; "
                             f"mesh axes are {list(MESH_AXES)} (or null for not sharded)")
        return {**DEFAULT_LOGICAL_RULES, **rules}


FloatDtype = Literal["float32", "bfloat16", "float16"]


class LossScaleConfig(Strict):
    """Dynamic loss scaling (used when the compute dtype is float16)."""

    initial: Annotated[float, Field(gt=0)] = 2.0**15
    growth_factor: Annotated[float, Field(gt=1)] = 2.0
    growth_interval: PositiveInt = 2000
    """Grow the scale after this many consecutive steps with finite gradients."""
    backoff_factor: Fraction = 0.5
    min: Annotated[float, Field(gt=0)] = 1.0
    max: Annotated[float, Field(gt=0)] = 2.0**24

    @model_validator(mode="after")
    def _ordered(self) -> LossScaleConfig:
        if not self.min <= self.initial <= self.max:
            raise ValueError(f"precision.loss_scale needs min <= initial <= max (got min={self.min}, "
                             f"initial={self.initial}, max={self.max})")
        return self


class PrecisionConfig(Strict):
    policy: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32: everything float32. bf16 / fp16: float32 params, compute in bfloat16 / float16, float32
    outputs; fp16 adds dynamic loss scaling."""
    param_dtype: FloatDtype | None = None
    """Stored (master) parameter dtype; default float32."""
    compute_dtype: FloatDtype | None = None
    """Dtype of params and floating inputs inside the forward/backward pass; default from the policy."""
    output_dtype: FloatDtype | None = None
    """Dtype of the model's outputs (the logits the loss sees); default float32."""
    loss_scale: LossScaleConfig = LossScaleConfig()


class CollectivesConfig(Strict):
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


class TrainerConfig(Strict):
    steps: PositiveInt = 300
    run_dir: str | None = None
    """Default: runs/<name>. An existing run directory is resumed from its latest checkpoint."""
    log_every: PositiveInt = 10
    eval_every: PositiveInt = 100
    eval_batches: PositiveInt = 4
    checkpoint_every: PositiveInt = 100
    keep_checkpoints: PositiveInt = 3
    on_nonfinite: Literal["stop", "skip"] = "stop"
    progress: bool = True
    steps_per_sync: PositiveInt = 1
    """Optimizer steps fused into one executable (a step boundary every k steps); host work such as
    logging, eval and checkpoints happens only at boundaries."""
    compile_budget: PositiveInt | None = None
    """Stop the run, with the recompile report, once the steps have been compiled more than this often."""
    profile_steps: tuple[PositiveInt, PositiveInt] | None = None
    """[a, b]: a jax.profiler trace of steps a..b (numbered from 1) in RUN_DIR/profile."""
    compile_cache: str = "auto"
    """JAX's persistent compilation cache: auto (JAX_COMPILATION_CACHE_DIR, else ~/.cache/xlatrain/jax), a
    directory, or off."""

    @field_validator("compile_cache", mode="before")
    @classmethod
    def _yaml_switches(cls, value: Any) -> Any:
        """YAML reads a bare off/no/false as False (and on/yes/true as True)."""
        if value is False or value is None:
            return "off"
        return "auto" if value is True else value

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _profile_steps_are_two_steps(cls, value: Any) -> Any:
        if value is not None and not (_positive_ints(value) and len(value) == 2):
            raise ValueError("must be [first, last]: two step numbers from 1 (e.g. [3, 5]), or null for no trace")
        return value

    @model_validator(mode="after")
    def _steps_fill_boundaries(self) -> TrainerConfig:
        if self.steps % self.steps_per_sync:
            raise ValueError(f"trainer.steps={self.steps} must be a multiple of trainer.steps_per_sync="
                             f"{self.steps_per_sync} (steps run in fused groups)")
        if self.profile_steps is not None:
            a, b = self.profile_steps
            if not a <= b <= self.steps:
                raise ValueError(f"trainer.profile_steps=[{a}, {b}] must be [first, last] with first <= last <= "
                                 f"trainer.steps={self.steps}")
        return self


Seconds = Annotated[float, Field(gt=0, le=7 * 24 * 3600)]


class StallTimeouts(Strict):
    """How long a process may stay in one phase at one step before the watchdog stops the run (seconds).
    A single number sets every phase."""

    starting: Seconds = 600
    compiling: Seconds = 1800
    loading_data: Seconds = 300
    training: Seconds = 180
    hook: Seconds = 180
    evaluating: Seconds = 600
    checkpointing: Seconds = 900

    @model_validator(mode="before")
    @classmethod
    def _one_for_all(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {phase: value for phase in cls.model_fields}
        return value


class DistributedConfig(Strict):
    coordinator: Annotated[str, Field(pattern=r"^[\w.\-\[\]:]+:\d+$")] | None = None
    """"host:port" of process 0. Unset: a single process, or the cluster's own values when run under SLURM,
    Open MPI's mpirun or Kubernetes (detected by jax.distributed); set keys win over detected ones."""
    num_processes: PositiveInt | None = None
    process_id: NonNegativeInt | None = None
    stall_timeout: StallTimeouts = StallTimeouts()
    heartbeat_timeout: Annotated[float, Field(ge=2, le=3600)] = 10.0
    """Seconds without a heartbeat from a process before the watchdog counts it as dead."""

    @model_validator(mode="after")
    def _consistent(self) -> DistributedConfig:
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise ValueError(f"distributed.process_id={self.process_id} must be below "
                             f"distributed.num_processes={self.num_processes}")
        return self


class Config(Strict):
    _mode_chosen_for: str | None = PrivateAttr(default=None)
    name: Annotated[str, Field(pattern=r"^[\w.-]+$")] = "gpt-stdlib"
    seed: Seed = 0
    model: ModelConfig = GPTConfig(name="gpt")
    data: DataConfig = TextData(source="text")
    batch: BatchConfig = BatchConfig()
    optimizer: OptimizerConfig = AdamWConfig(name="adamw")
    mesh: MeshConfig = MeshConfig()
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    collectives: CollectivesConfig = CollectivesConfig()
    trainer: TrainerConfig = TrainerConfig()
    distributed: DistributedConfig = DistributedConfig()

    @model_validator(mode="after")
    def _resolve_auto_mode(self) -> Config:
        """Runs first: the checks below and the saved config see the mode that will run."""
        if self.parallel.mode == "auto":
            why = ("a pipeline (mesh.stage > 1)" if self.mesh.stage > 1 else "collectives.impl=custom"
                   if self.collectives.impl == "custom" else None)
            object.__setattr__(self, "parallel", self.parallel.model_copy(
                update={"mode": "shard_map" if why else "jit"}))
            self._mode_chosen_for = why
        return self

    @model_validator(mode="after")
    def _model_fits_data(self) -> Config:
        if isinstance(self.model, (MLPConfig, CNNConfig)) and isinstance(self.data, TextData):
            raise ValueError(
                f"model.name={self.model.name} classifies arrays: use data.source=digits or arrays"
            )
        if isinstance(self.model, GPTConfig):
            if not isinstance(self.data, TextData):
                raise ValueError("model.name=gpt trains on token sequences: use data.source=text")
            if self.model.max_len is not None and self.model.max_len < self.data.seq_len:
                raise ValueError(
                    f"model.max_len={self.model.max_len} is shorter than data.seq_len={self.data.seq_len}"
                )
        return self

    @model_validator(mode="after")
    def _collectives_fit_the_mode(self) -> Config:
        mode = self.parallel.mode
        if self.collectives.impl == "custom" and mode == "jit":
            raise ValueError("collectives.impl=custom syncs gradients in a per-device program: set "
                             "parallel.mode=shard_map or pmap (with parallel.mode=jit XLA's partitioner owns the "
                             "collectives)")
        if self.mesh.stage > 1:  # a pipeline's strategies and optimizers: _pipeline_fits
            return self
        supported = {"jit": ("replicated", "zero1", "fsdp"), "shard_map": ("replicated", "zero1"),
                     "pmap": ("replicated",)}[mode]
        if self.parallel.strategy not in supported:
            chosen = f" (chosen by parallel.mode=auto for {self._mode_chosen_for})" if self._mode_chosen_for else ""
            raise ValueError(f"parallel.mode={mode}{chosen} supports parallel.strategy {' or '.join(supported)}, "
                             f"not {self.parallel.strategy!r}; parallel.mode=jit runs zero1/fsdp")
        if mode == "shard_map" and self.parallel.strategy == "zero1" and self.optimizer.name == "adafactor":
            raise ValueError("parallel.mode=shard_map with parallel.strategy=zero1 updates each block of a "
                             "parameter on its own, which needs an elementwise optimizer (adamw, sgd, lion), not "
                             "adafactor; use parallel.mode=jit")
        return self

    @model_validator(mode="after")
    def _pipeline_fits(self) -> Config:
        pipe, stages = self.parallel.pipeline, self.mesh.stage
        if stages == 1:
            changed = [k for k in PipelineConfig.model_fields if getattr(pipe, k) != getattr(PipelineConfig(), k)]
            if changed:
                raise ValueError(f"parallel.pipeline.{changed[0]} is set but mesh.stage=1: set mesh.stage to the "
                                 "number of pipeline stages (2 or more) to run a pipeline")
            return self
        if isinstance(self.model, (MLPConfig, CNNConfig)):
            raise ValueError(f"model.name={self.model.name} cannot be pipelined (mesh.stage={stages}): it is not a "
                             "stack of repeated blocks. Pipelines take model.name=gpt or a custom model built on "
                             "xlatrain.models.BlockStack; or set mesh.stage=1")
        if self.parallel.mode != "shard_map":
            raise ValueError(f"mesh.stage={stages} runs a pipeline, a per-device program whose stages pass "
                             f"activations to each other: use parallel.mode=auto or shard_map, not "
                             f"{self.parallel.mode}")
        v, m = pipe.chunks_per_stage(), pipe.microbatches_for(stages)
        if pipe.schedule == "zbv" and v != 2:
            raise ValueError(f"parallel.pipeline.schedule=zbv places exactly 2 chunks per stage in a V: set "
                             f"virtual_stages=2 or leave it null (not {v})")
        if pipe.schedule not in ("interleaved", "zbv") and v != 1:
            raise ValueError(f"parallel.pipeline.virtual_stages={v} applies to schedule=interleaved only, not "
                             f"{pipe.schedule}")
        if pipe.schedule == "interleaved" and v < 2:
            raise ValueError("parallel.pipeline.schedule=interleaved needs virtual_stages >= 2 (model chunks per "
                             "stage); use schedule=1f1b for one chunk per stage")
        if pipe.splits_backward() and pipe.remat == "full":
            raise ValueError(f"parallel.pipeline.schedule={pipe.schedule} runs each backward as B and W from the "
                             "forward's residuals, so it cannot recompute them: set parallel.pipeline.remat=none "
                             "or auto, or leave it unset (not full)")
        if pipe.memory_budget_bytes is not None and pipe.remat != "auto":
            raise ValueError(f"parallel.pipeline.memory_budget_bytes is read by remat=auto only, and remat="
                             f"{pipe.remat} is fixed: set remat=auto, or drop memory_budget_bytes")
        if m < stages:
            raise ValueError(f"parallel.pipeline.microbatches={m} is fewer than mesh.stage={stages}: the "
                             f"{pipe.schedule} schedule needs at least one microbatch per stage to fill the "
                             f"pipeline; use {stages} or more")
        if pipe.schedule == "interleaved" and m % stages:
            raise ValueError(f"parallel.pipeline.schedule=interleaved sends microbatches through the stages in "
                             f"groups of mesh.stage={stages}: microbatches={m} must be a multiple of {stages}")
        if isinstance(self.model, GPTConfig):
            check_block_partition(pipe, stages, self.model.layers, "model.layers")
        return self

    def run_dir(self) -> Path:
        return Path(self.trainer.run_dir or f"runs/{self.name}")


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


# --- derived values ----------------------------------------------------------------------------


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
    pipeline_partition: tuple[int, ...] | None = None
    """Blocks per chunk, as planned (pipelines only); saved in the run's config.yaml and kept on resume."""
    scan_layers: bool | None = None
    """Whether the GPT's blocks run in a `lax.scan` on these devices (model.scan_layers resolved; gpt only)."""
    model_flops_per_step: float | None = None
    """Matmul and convolution FLOPs of one step's forward and backward over the global batch, counted on the
    jaxpr (lowering/flops.py); None until the model is built, or when a while loop hides a trip count."""
    data_examples: tuple[int, int] | None = None
    """Training and held-out examples of the data at this start; with data_digest (of sampled examples) saved with
    each checkpoint, so that a resume on data that changed since says so (xlatrain/data/identity.py)."""
    data_digest: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v is not None}


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
        scan_layers=config.model.scans_layers(devices[0].platform) if isinstance(config.model, GPTConfig) else None,
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
    """mesh.data x mesh.stage must be the devices present; -1 for mesh.data takes what the stages leave."""
    present, stages = len(devices), mesh.stage
    data = present // stages if mesh.data == -1 else mesh.data
    if data >= 1 and data * stages == present:
        return data
    platform = devices[0].platform if devices else "cpu"
    found = ", ".join(str(d) for d in devices[:8]) + (" ..." if len(devices) > 8 else "")
    wanted = (mesh.data if mesh.data != -1 else max(data, 1)) * stages
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
    if stages == 1:
        asked, fix = f"mesh.data={mesh.data} needs {mesh.data}", f"Set mesh.data={present} (or -1 for all)"
    elif mesh.data == -1:
        asked = f"mesh.stage={stages} needs a multiple of {stages}"
        fix = f"Set mesh.stage to a divisor of {present}"
    else:
        asked = f"mesh.data={mesh.data} x mesh.stage={stages} needs {wanted}"
        fix = f"Set mesh.data x mesh.stage to {present} (mesh.data=-1 takes what the stages leave)"
    raise UserError(
        f"config: {asked} devices but {present} {platform} device(s) are present: [{found}]. {fix}, or {how}."
    )


# --- loading -----------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Config from an optional YAML file plus `key=value` overrides; None means the built-in default."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    _reject_malformed_overrides(overrides)
    try:
        merged = OmegaConf.create(raw)
    except (OmegaConfBaseException, TypeError, ValueError) as err:
        raise UserError(f"config: {path}: {first_line(err)}") from None
    for item in overrides:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, yaml.YAMLError, TypeError, ValueError) as err:
            raise UserError(f"config: override {item!r}: {first_line(err) or type(err).__name__}; values are YAML: "
                            "quote ones that start with *, & or ! (e.g. data.glob='*.txt'), and a section takes "
                            "its keys one by one (section.key=value)") from None
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise UserError(f"config: {first_line(err)} (a value with ${{...}} is an interpolation; quote or change "
                        "it)") from None
    return validate_config(data)


def validate_config(data: dict) -> Config:
    _fill_missing_tags(data)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


DERIVED_SECTION = "derived"
"""The section after the config in `xlatrain config`'s output and a run's config.yaml: the values computed from
it (batch sizes, the scan choice, a pipeline's partition...). Reading such a file as a config leaves it out."""


def config_and_derived_to_yaml(config: Config, derived: dict[str, Any]) -> str:
    return config_to_yaml(config) + yaml.safe_dump({DERIVED_SECTION: derived}, sort_keys=False)


def without_derived(data: dict) -> dict:
    """A config file's keys less its derived section, which is computed again; one that is not a mapping stays,
    to be refused as an unknown key."""
    if isinstance(data.get(DERIVED_SECTION), dict):
        return {key: value for key, value in data.items() if key != DERIVED_SECTION}
    return data


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise UserError(f"config: {str(path)!r} is a directory; pass a YAML file (e.g. {str(path / 'config.yaml')!r})")
    if not path.is_file():
        if path.suffix.lower() not in (".yaml", ".yml") and re.fullmatch(r"[A-Za-z_][\w.]*", str(path)):
            raise UserError(f"config: {str(path)!r} is neither a YAML file nor key=value; to set a key write "
                            f"{path}=VALUE")
        raise UserError(f"config: file {str(path)!r} not found; pass a YAML file or no file for the default run")
    data = parse_yaml(_read_text(path), str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config: {path} must hold a mapping of keys at the top level, not a {type(data).__name__}")
    return without_derived(data)


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        if b"\0" in raw:
            raise UnicodeError("it holds NUL bytes")
        return raw.decode("utf-8")
    except UnicodeError as err:
        raise UserError(f"config: {path} is not a UTF-8 text file ({first_line(err)}); a config is YAML text") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys are refused by the schema later
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1}); "
                    "give each key once", key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, name: str) -> Any:
    """YAML text as Python values; a syntax error or duplicate key is one line `name:line:column: problem`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        problem = getattr(err, "problem", None) or first_line(err)
        context = getattr(err, "context", None)
        hint = " (YAML indents with spaces, not tabs)" if "\\t" in problem else ""
        raise UserError(f"config: {where}: {problem}{hint}" + (f", {context}" if context else "")) from None


def _reject_malformed_overrides(overrides: list[str]) -> None:
    for item in overrides:
        if not re.match(r"^[A-Za-z_][\w.]*=", item):
            raise UserError(f"config: override {item!r} must look like key.path=value")


_TAGGED_FIELDS = {"model": "name", "data": "source", "optimizer": "name"}


def _fill_missing_tags(data: dict) -> None:
    """`model.layers=2` alone means "the default model with 2 layers": take the tag from the default."""
    defaults = Config()
    for field, tag in _TAGGED_FIELDS.items():
        section = data.get(field)
        if isinstance(section, dict) and tag not in section:
            section[tag] = getattr(getattr(defaults, field), tag)


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        loc = _dotted_loc(item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown key {loc!r}{_did_you_mean(item['loc'])}")
        elif item["type"] in ("model_type", "model_attributes_type", "dict_type") and loc:
            lines.append(f"{loc} must be a mapping of keys (e.g. {loc}.KEY=VALUE), not {item.get('input')!r}")
        else:
            msg = item["msg"].removeprefix("Value error, ")
            got = item.get("input")
            shown = "" if isinstance(got, dict) or loc == "" else f" (got {got!r})"
            names_itself = loc and f"{loc.split('.')[0]}." in msg
            lines.append(msg if names_itself or not loc else f"{loc}: {msg}{shown}")
    return "config: " + "; ".join(lines)


def _dotted_loc(loc: tuple) -> str:
    """('model', 'gpt', 'layerz') -> 'model.layerz': pydantic puts the union's tag into the path."""
    parts = list(loc)
    if len(parts) > 1 and parts[0] in _TAGGED_FIELDS and parts[1] in _tag_classes(parts[0]):
        del parts[1]
    return ".".join(str(p) for p in parts)


def _tag_classes(field: str) -> dict[str, type[BaseModel]]:
    union = Config.model_fields[field].annotation
    tag = _TAGGED_FIELDS[field]
    return {cls.model_fields[tag].annotation.__args__[0]: cls for cls in union.__args__}


def _did_you_mean(loc: tuple) -> str:
    cls: type[BaseModel] = Config
    path = list(loc[:-1])
    if len(path) > 1 and path[0] in _TAGGED_FIELDS:
        cls = _tag_classes(path[0]).get(path[1], cls)
        path = path[2:]
    for part in path:
        annotation = cls.model_fields[part].annotation if part in cls.model_fields else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            cls = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(cls.model_fields), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint}; valid keys here: {', '.join(cls.model_fields)}"


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys (`trainer.steps`); empty mappings stay as values."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
