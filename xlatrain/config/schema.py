"""The whole run config: every section, and the checks that span sections."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, PrivateAttr, model_validator

from xlatrain.config.base import Seed, Strict
from xlatrain.config.data import DataConfig, DigitsData, TextData, TokensData
from xlatrain.config.distributed import DistributedConfig
from xlatrain.config.model import (
    DECODERS,
    CNNConfig,
    GPTConfig,
    LlamaConfig,
    MLPConfig,
    ModelConfig,
)
from xlatrain.config.optimizer import AdamWConfig, BatchConfig, OptimizerConfig
from xlatrain.config.parallel import (
    TENSOR,
    CollectivesConfig,
    MeshConfig,
    ParallelConfig,
    PipelineConfig,
    check_block_partition,
)
from xlatrain.config.precision import PrecisionConfig
from xlatrain.config.runtime import RuntimeConfig
from xlatrain.config.trainer import TrainerConfig


class Config(Strict):
    """A run: YAML plus dotted overrides; the built-in default trains a byte-level GPT on this Python's own
    standard library."""

    _mode_chosen_for: str | None = PrivateAttr(default=None)
    name: Annotated[str, Field(pattern=r"^[\w.-]+$")] = "gpt-stdlib"
    """The run's name; the default run directory is runs/<name>."""
    seed: Seed = 0
    """One seed for init, dropout and data order, 0..2**32-1; replicas are checked identical after init."""
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
    runtime: RuntimeConfig = RuntimeConfig()

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
        if isinstance(self.model, (MLPConfig, CNNConfig)) and isinstance(self.data, (TextData, TokensData)):
            raise ValueError(
                f"model.name={self.model.name} classifies arrays: use data.source=digits or arrays"
            )
        if isinstance(self.model, DECODERS):
            if isinstance(self.data, DigitsData):
                raise ValueError(f"model.name={self.model.name} trains on token sequences: use data.source=text, "
                                 "tokens or arrays (integer token ids)")
            seq_len = getattr(self.data, "seq_len", None)
            if self.model.max_len is not None and seq_len is not None and self.model.max_len < seq_len:
                raise ValueError(
                    f"model.max_len={self.model.max_len} is shorter than data.seq_len={seq_len}; raise model.max_len "
                    "or lower data.seq_len"
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
    def _context_parallel_fits(self) -> Config:
        context = self.mesh.context
        if context == 1:
            return self
        if not isinstance(self.model, DECODERS):
            raise ValueError(f"mesh.context={context} splits the sequence of the built-in decoders' attention (gpt, "
                             f"llama); model.name={self.model.name} has none to split: set mesh.context=1")
        seq_len = getattr(self.data, "seq_len", None)
        if seq_len is not None and seq_len % (2 * context):
            raise ValueError(f"mesh.context={context} cuts each row into 2 x mesh.context = {2 * context} equal "
                             f"chunks (each device an early and a late one), and data.seq_len={seq_len} is not a "
                             f"multiple of {2 * context}: choose a data.seq_len that is")
        if getattr(self.data, "buckets", None) is not None:
            raise ValueError(f"mesh.context={context} splits rows of one length, data.seq_len; data.buckets pads "
                             "batches to other lengths: drop data.buckets, or set mesh.context=1")
        if self.parallel.mode == "pmap":
            raise ValueError(f"mesh.context={context} with parallel.mode=pmap: pmap maps the step over `data` alone, "
                             "with no axis to split the sequence over; use parallel.mode=jit")
        if self.mesh.stage > 1 and self.parallel.context_attention == "ring" and self.collectives.impl == "xla":
            raise ValueError(f"mesh.context={context} with mesh.stage={self.mesh.stage}: the ring's steps run inside "
                             "each stage's own actions, and XLA's collective-permute waits for every device of the "
                             "mesh (stages act at different times); set collectives.impl=custom (xlatrain's ppermute "
                             "meets the context group alone) or parallel.context_attention=all_gather")
        return self

    @model_validator(mode="after")
    def _experts_fit(self) -> Config:
        moe, split = getattr(self.model, "moe", None), self.mesh.expert
        if moe is None:
            if split > 1:
                raise ValueError(f"mesh.expert={split} splits a Mixture of Experts' experts, and {self.model.named()} "
                                 "has none: set model.moe (model.name=llama), or mesh.expert=1")
            return self
        if moe.experts % split:
            raise ValueError(f"mesh.expert={split} splits model.moe.experts={moe.experts} experts into equal groups: "
                             f"choose a mesh.expert that divides {moe.experts}")
        chosen = f" (chosen by parallel.mode=auto for {self._mode_chosen_for})" if self._mode_chosen_for else ""
        if split > 1 and self.parallel.mode == "pmap":
            raise ValueError(f"mesh.expert={split}: parallel.mode=pmap maps the step over `data` alone; use "
                             "parallel.mode=shard_map (the expert group's all-to-all written out) or jit")
        if split > 1 and self.parallel.mode == "shard_map" and self.parallel.strategy != "replicated":
            raise ValueError(f"mesh.expert={split} in parallel.mode=shard_map{chosen} runs parallel.strategy="
                             f"replicated (each device's own experts, the rest whole); zero1 and fsdp with experts "
                             "run in parallel.mode=jit")
        if self.mesh.stage > 1 and moe.bias_rate is not None:
            raise ValueError(f"model.moe.bias_rate with mesh.stage={self.mesh.stage}: the balancing bias is model "
                             "state, which a pipeline's stages do not hold; drop bias_rate (balance by "
                             "aux_loss_weight) or set mesh.stage=1")
        if self.mesh.stage > 1 and len(moe.layers_with_experts(self.model.layers)) < self.model.layers:
            raise ValueError(f"model.moe.dense_layers_first={moe.dense_layers_first} and interleave={moe.interleave} "
                             f"with mesh.stage={self.mesh.stage}: a pipeline cuts one stack of layers, and the dense "
                             "layers are a second; put experts in every layer or set mesh.stage=1")
        if self.mesh.tensor > 1 and self.parallel.mode != "jit":
            raise ValueError(f"model.moe with mesh.tensor={self.mesh.tensor} in parallel.mode={self.parallel.mode}: "
                             "a per-device program's tensor group has no collectives for the experts' matmuls yet; "
                             "use parallel.mode=jit (XLA's partitioner splits each expert's MLP over `tensor`)")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> Config:
        tensor = self.mesh.tensor
        if self.model.name == "torch" and self.model.tensor_dims and tensor == 1:
            raise ValueError("model.tensor_dims says how a torch module splits over the tensor axis: set mesh.tensor "
                             "to 2 or more, or drop model.tensor_dims")
        if self.parallel.sequence_parallel and tensor == 1:
            raise ValueError("parallel.sequence_parallel=true splits activations along the sequence over the tensor "
                             "axis: set mesh.tensor to 2 or more, or sequence_parallel=false")
        if tensor == 1:
            return self
        if self.model.name == "torch" and not self.model.tensor_dims:
            raise ValueError(f"mesh.tensor={tensor} splits layers by the logical names of their parameters, and a "
                             "torch module's parameters name none: say how its linears split in model.tensor_dims "
                             "(e.g. {'*.fc1.*': column, '*.fc2.weight': row}), or set mesh.tensor=1")
        if self.parallel.mode != "jit":
            self._tensor_group_fits_a_per_device_program(tensor)
        if isinstance(self.model, DECODERS):
            self._decoder_splits_by_whole_heads(tensor)
        return self

    def _tensor_group_fits_a_per_device_program(self, tensor: int) -> None:
        """Inside a per-device program the built-in decoders' regions call the tensor group's collectives
        (xlatrain/tensor_group.py), Megatron's layout: heads, kv heads, the MLP and the vocabulary split."""
        mode = self.parallel.mode
        chosen = f" (chosen by parallel.mode=auto for {self._mode_chosen_for})" if self._mode_chosen_for else ""
        instead = "use mesh.stage=1, collectives.impl=xla and parallel.mode=jit, or set mesh.tensor=1"
        if mode == "pmap":
            raise ValueError(f"mesh.tensor={tensor}: parallel.mode=pmap maps the step over `data` alone; use "
                             "parallel.mode=shard_map (the tensor group's collectives written out) or jit")
        if not isinstance(self.model, DECODERS):
            why = ("runs a torch module as one whole forward, which has no place for the tensor group's "
                   "collectives (model.tensor_dims splits its linears in parallel.mode=jit, where XLA inserts them)"
                   if self.model.name == "torch" else
                   f"splits the layers of the built-in decoders (model.name=gpt or llama), whose attention, MLP, "
                   f"embedding and head call the tensor group's collectives; model.name={self.model.name} does not")
            raise ValueError(f"mesh.tensor={tensor} with parallel.mode={mode}{chosen}: a per-device program {why}; "
                             f"{instead}")
        if self.optimizer.name == "adafactor":
            raise ValueError(f"mesh.tensor={tensor} with parallel.mode={mode}{chosen}: each device updates its part "
                             "of a split matrix on its own, and adafactor's factored moments read the whole matrix: "
                             "use optimizer.name=adamw, sgd or lion, or parallel.mode=jit")
        rules = self.parallel.logical_rules
        for name in ("heads", "kv_heads", "mlp", "vocab"):
            if TENSOR not in rules.get(name, ()):
                raise ValueError(f"parallel.logical_rules.{name} leaves `tensor` out, and a per-device program "
                                 f"(parallel.mode={mode}{chosen}) splits the decoders Megatron's way, {name} over "
                                 f"`tensor`: put `tensor` back in it, or use parallel.mode=jit")
        other = sorted(name for name, axes in rules.items()
                       if TENSOR in axes and name not in ("heads", "kv_heads", "mlp", "vocab"))
        if other:
            raise ValueError(f"parallel.logical_rules.{other[0]} maps to `tensor`, which a per-device program "
                             f"(parallel.mode={mode}{chosen}) splits only heads, kv_heads, mlp and vocab over: take "
                             "`tensor` out of it, or use parallel.mode=jit")
        if isinstance(self.model, LlamaConfig) and self.model.qk_norm == "projection":
            raise ValueError(f"model.qk_norm=projection normalises over every head of the projection, which a "
                             f"per-device program (parallel.mode={mode}{chosen}) splits over mesh.tensor={tensor}; use "
                             "parallel.mode=jit (XLA's partitioner sums the squares over the group), model.qk_norm="
                             "head, or mesh.tensor=1")
        kv_heads = self.model.kv_head_count() if isinstance(self.model, LlamaConfig) else self.model.heads
        if kv_heads < tensor and tensor % kv_heads:
            raise ValueError(f"mesh.tensor={tensor} has more devices than model.kv_heads={kv_heads}, so each keeps the "
                             f"key/value heads whole and uses the one its query heads read; in a per-device program "
                             f"(parallel.mode={mode}{chosen}) that needs mesh.tensor to be a multiple of {kv_heads}")

    def _decoder_splits_by_whole_heads(self, tensor: int) -> None:
        """Each device of a tensor group holds whole attention heads and an equal part of the MLP."""
        model, rules = self.model, self.parallel.logical_rules
        kv_heads = model.kv_head_count() if isinstance(model, LlamaConfig) else model.heads
        mlp = model.mlp_width() if isinstance(model, LlamaConfig) else model.mlp_ratio * model.width
        sizes = [("heads", "model.heads", model.heads, "attention heads"),
                 ("mlp", "model.mlp_hidden" if isinstance(model, LlamaConfig) else "model.mlp_ratio x model.width",
                  mlp, "the MLP's hidden width")]
        if kv_heads >= tensor:
            sizes.append(("kv_heads", "model.kv_heads", kv_heads, "key/value heads"))
        for name, field, size, what in sizes:
            if TENSOR in rules.get(name, ()) and size % tensor:
                raise ValueError(f"mesh.tensor={tensor} splits {what} over the tensor axis, and {field}={size} does "
                                 f"not divide by {tensor}: choose a mesh.tensor that divides it, or take `tensor` "
                                 f"out of parallel.logical_rules.{name}")

    def tensor_whole(self) -> tuple[str, ...]:
        """Logical names the rules split over `tensor` that each device of a tensor group keeps whole: grouped-query
        attention's key/value heads when there are fewer than mesh.tensor (each device computes them all)."""
        if self.mesh.tensor > 1 and isinstance(self.model, LlamaConfig) \
                and TENSOR in self.parallel.logical_rules.get("kv_heads", ()) \
                and self.model.kv_head_count() < self.mesh.tensor:
            return ("kv_heads",)
        return ()

    @model_validator(mode="after")
    def _tasks_score_text(self) -> Config:
        if self.trainer.eval_tasks and not isinstance(self.model, DECODERS):
            raise ValueError(f"trainer.eval_tasks scores text with a built-in decoder (model.name=gpt or llama), "
                             f"and model.name={self.model.name} cannot score text: drop trainer.eval_tasks")
        if self.trainer.eval_tasks and getattr(self.model, "dpo", None) is not None:
            raise ValueError("trainer.eval_tasks is not built for DPO runs (a pair's two sequences per record): "
                             "evaluate a checkpoint with `xlatrain eval RUN_DIR` instead")
        return self

    @model_validator(mode="after")
    def _one_start(self) -> Config:
        lora = getattr(self.model, "lora", None)
        starts = {"model.init_from": getattr(self.model, "init_from", None),
                  "model.lora.init_from": lora.init_from if lora is not None else None}
        for key, value in starts.items():
            if value is not None and self.trainer.init_from is not None:
                raise ValueError(f"trainer.init_from starts the run from another run's whole state, and {key} from "
                                 "a checkpoint's weights: set one of them")
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
                             "stack of repeated blocks. Pipelines take model.name=gpt or llama, or a custom model "
                             "built on xlatrain.models.BlockStack; or set mesh.stage=1")
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
        if m < stages and pipe.splits_backward():
            raise ValueError(f"parallel.pipeline.microbatches={m} is fewer than mesh.stage={stages}: schedule="
                             f"{pipe.schedule} fills the pipeline's bubble with the weight gradients of at least "
                             f"mesh.stage microbatches, and with fewer it has nothing to fill it with; use {stages} or "
                             "more, or schedule=1f1b or gpipe (which run any count, with a larger bubble)")
        if pipe.schedule == "interleaved" and m % stages:
            raise ValueError(f"parallel.pipeline.schedule=interleaved sends microbatches through the stages in "
                             f"groups of mesh.stage={stages}: microbatches={m} must be a multiple of {stages}")
        if isinstance(self.model, DECODERS):
            check_block_partition(pipe, stages, self.model.layers, "model.layers")
        return self

    def run_dir(self) -> Path:
        return Path(self.trainer.run_dir or f"runs/{self.name}")
