"""The one composition root: config -> mesh -> data -> model + state -> the lowered steps, built once.

`build_program` composes the rooms in the order the data flows; `Program` is what it built, and compiles the train
and eval steps on first use. How a step runs over the mesh is `Program.parallel`: data parallelism
(lowering/data_parallel.py), or a pipeline beside it (lowering/pipeline/parallel.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from xlatrain.config import (
    DECODERS,
    Config,
    Derived,
    MuonConfig,
    ScheduleFreeAdamWConfig,
    TextData,
    TorchModelConfig,
    derive,
    saved_values,
)
from xlatrain.config.hugging_face import checkpoint_directory
from xlatrain.custom_calls.blas import choose as choose_cpu_matmul
from xlatrain.data.identity import (
    check_every_process_reads_the_same,
    data_identity,
    identity_record,
)
from xlatrain.data.sources import Dataset, open_dataset
from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError, warn
from xlatrain.hf.names import naming_of, stacked_layers
from xlatrain.hf.peft import adapter_weights
from xlatrain.hf.tokenizer import other_tokens_than_the_checkpoints
from xlatrain.hf.weights import HuggingFaceWeights, placed_params
from xlatrain.lowering.compile import (
    CompileBook,
    StepExecutables,
    compile_eval_step,
    compile_train_step,
)
from xlatrain.lowering.data_parallel import DataParallel
from xlatrain.lowering.flops import UncountedLoop, step_flops
from xlatrain.lowering.inspect import peak_memory_bytes
from xlatrain.lowering.pipeline.parallel import pipeline_parallel, refuse_unpipelinable
from xlatrain.lowering.preference import objective_of
from xlatrain.lowering.step import (
    fuse_steps,
    make_forward,
    make_gradient_step,
    make_train_step,
    model_inputs,
    objective_sums,
    reference_log_probs,
)
from xlatrain.mesh import DATA, build_mesh, eval_batch_sharding, train_batch_sharding
from xlatrain.models import flax_model, model_factory, router_balance
from xlatrain.models.fit import check_model_outputs
from xlatrain.models.interface import PARTLY_FROZEN, ModelDef, documents_of, outputs_and_reports
from xlatrain.models.lora import adapters_of, adapters_off, base_of, joined
from xlatrain.muon import muon_labels
from xlatrain.optim import build_optimizer, learning_rate_schedule
from xlatrain.pipeline.plan import PipelinePlan
from xlatrain.pipeline.remat import RematChoice
from xlatrain.precision import Policy, resolve_policy
from xlatrain.run.directory import SHARD_SCANS_FILE
from xlatrain.run.reference import REFERENCE_FILE, read_reference, write_reference
from xlatrain.runtime import cpu_devices
from xlatrain.runtime.compile_cache import use_compile_cache
from xlatrain.runtime.device_memory import (
    DeviceMemory,
    check_state_fits,
    check_step_fits,
    device_memory,
)
from xlatrain.runtime.distributed import everyones, is_primary
from xlatrain.runtime.platform import compiling_for
from xlatrain.sharding import named, without_axis
from xlatrain.state import (
    TrainState,
    create_state,
    init_variables,
    make_init,
    verify_replicas_identical,
    with_shardings,
)


@dataclass(frozen=True)
class Measured:
    """What building the program found: the data's identity at this start, the model's FLOPs, a pipeline's
    partition and the dense layers' CPU kernels. Saved beside the derived values in the derived section of a run's
    config.yaml."""

    data_examples: tuple[int, int]
    """Training and held-out examples; with data_digest (of sampled examples) saved with each checkpoint, so that
    a resume on data that changed since says so (xlatrain/data/identity.py)."""
    data_digest: str
    model_flops_per_step: float | None
    """Matmul and convolution FLOPs of one step's forward and backward over the global batch, counted on the
    jaxpr (lowering/flops.py); None when a while loop hides a trip count."""
    pipeline_partition: tuple[int, ...] | None = None
    """Blocks per chunk, as planned (pipelines only); kept on resume."""
    cpu_matmul: str = "xla"
    """The dense layers' kernels on CPU (runtime.cpu_matmul chosen); auto keeps it on resume."""


@dataclass(frozen=True)
class Program:
    config: Config
    derived: Derived
    measured: Measured
    mesh: jax.sharding.Mesh
    dataset: Dataset
    model: ModelDef
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    init: Any
    abstract_state: TrainState
    specs: TrainState
    policy: Policy
    parallel: DataParallel
    """How the steps run over the mesh: data parallel, or a pipeline beside it."""
    compile_book: CompileBook = field(default_factory=CompileBook)
    compile_cache: Path | None = None
    """Where JAX's persistent compilation cache is (trainer.compile_cache), or None when it is off."""
    device_memory: DeviceMemory = (None, "")
    """What one device may hold (runtime/device_memory.py), measured before the steps compile."""
    _train_steps: dict[str, StepExecutables] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The train step per remat ("full" alone without a pipeline); remat: auto may compile two."""

    @property
    def pipeline(self) -> PipelinePlan | None:
        return self.parallel.pipeline

    @property
    def state_shardings(self) -> TrainState:
        return named(self.mesh, self.specs)

    @property
    def param_count(self) -> int:
        return self.parallel.param_count(self.abstract_state.params)

    @property
    def steps_per_sync(self) -> int:
        return self.config.trainer.steps_per_sync

    @property
    def gradients_synchronised(self) -> bool:
        """Whether the update sums gradients across devices (not in a pipeline over one data replica)."""
        return self.parallel.gradients_synchronised

    def saved_derived(self) -> dict[str, Any]:
        """The derived section of the run's config.yaml: what follows from the config and devices, and what
        building the program measured."""
        return {**self.derived.as_dict(), **saved_values(self.measured)}

    def train_batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """[steps per sync (when > 1), microbatches, rows per microbatch, ...] per key, rows over `data`."""
        d, k = self.derived, self.steps_per_sync
        steps = (k,) if k > 1 else ()
        return self.dataset.spec.abstract_batch((*steps, d.microbatches, d.microbatch_size),
                                                train_batch_sharding(self.mesh, k))

    def eval_batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        return self.dataset.spec.abstract_batch((self.derived.global_batch,), eval_batch_sharding(self.mesh))

    @cached_property
    def train_step(self) -> StepExecutables:
        """k fused optimizer steps (trainer.steps_per_sync) per call, compiled per batch shape."""
        return self._train_step_for(self._remat_name)

    @cached_property
    def remat(self) -> RematChoice | None:
        """A pipeline's remat; `auto` compiles the train step with remat: none to measure it, and that
        executable is the train step when it fits."""
        return self.parallel.choose_remat(self.device_memory, self._most_bytes_with_residuals)

    @cached_property
    def eval_step(self) -> StepExecutables:
        fn = self.parallel.eval_step(self.specs, self.abstract_state.params)
        return StepExecutables("eval_step", lambda batch: compile_eval_step(
            fn, self._abstract_sharded_state(), self.state_shardings, batch, eval_batch_sharding(self.mesh),
            self.measured.cpu_matmul),
            self.eval_batch_shapes(), self.compile_book)

    def check_steps_fit(self) -> None:
        """Compiles the train and eval steps, and refuses one that cannot fit a device's memory."""
        for step in (self.train_step, self.eval_step):
            check_step_fits(step.name, peak_memory_bytes(step.first.compiled), self.device_memory)

    def create_state(self) -> TrainState:
        """A new run's state: the model's own initialisation, the values it comes with (a torch module's), or
        a Hugging Face checkpoint's weights (model.init_from=hf:DIR), read as each device holds them."""
        model = self.config.model
        if isinstance(model, DECODERS) and (model.init_from is not None or (
                model.lora is not None and model.lora.init_from is not None)):
            state = create_state(self.init, self.specs, self.mesh, (self._checkpoint_params(), {}), arranged=True)
        else:
            given = self.model.initial_values() if self.model.initial_values is not None else None
            state = create_state(self.init, self.specs, self.mesh, given)
        verify_replicas_identical(state, self.specs, self.mesh)
        return state

    def use_reference(self, state: TrainState | None, run_dir: Path) -> None:
        """With model.dpo: the reference log-probabilities of every pair, given to the data's pairs. A new run
        (`state`: the state it starts from) computes them, from its weights with any adapters off (the base, as
        TRL's DPO with peft), and keeps them in the run directory, which a resumed one (`state` None) reads."""
        if not self.dataset.spec.pairs:
            return
        path, identity = run_dir / REFERENCE_FILE, self.dataset.spec.tokenizer["shards"]
        if state is None:
            values = read_reference(path, identity)
        else:
            values = {split: self._reference_of(state, getattr(self.dataset, split)) for split in ("train", "eval")}
            if is_primary():
                write_reference(path, identity, values)
        for split in ("train", "eval"):
            getattr(self.dataset, split).use_reference(values[split])

    def _reference_of(self, state: TrainState, pairs: Any) -> np.ndarray:
        forward = make_forward(self.model, self.policy)
        params = adapters_off(state.params)
        compute = jax.jit(lambda params, model_state, batch: reference_log_probs(forward, params, model_state, batch))
        rows, found = self.derived.global_batch, []
        for first in range(0, len(pairs), rows):
            chosen = [pairs[min(i, len(pairs) - 1)] for i in range(first, first + rows)]
            batch = {key: np.stack([c[key] for c in chosen]) for key in ("inputs", "targets", "mask")}
            found.append(np.asarray(compute(params, state.model_state, batch)))
        return np.concatenate(found)[:len(pairs)]

    def _checkpoint_params(self) -> Any:
        """The params that checkpoints give, each device's piece read from them: a Hugging Face checkpoint's
        (model.init_from) and a PEFT adapter's (model.lora.init_from); with adapters, a checkpoint without them
        gives the base, and what no checkpoint gives is initialised (state.make_init)."""
        model = self.config.model
        layers_at = None if self.pipeline is None else self.pipeline.layout.layers_at
        model_params = jax.eval_shape(self.model.init, jax.random.PRNGKey(0))[0]
        abstract, shardings = self.abstract_state.params, named(self.mesh, self.specs.params)
        parts = []
        if model.init_from is not None:
            directory, given_as = checkpoint_directory(model.init_from), f"model.init_from={model.init_from!r}"
            weights = HuggingFaceWeights(directory, naming_of(model), given_as, stacked_layers(model))
            weights.check(base_of(model_params))
            other_tokens = other_tokens_than_the_checkpoints(directory, self.dataset.spec.tokenizer,
                                                             isinstance(self.config.data, TextData))
            if other_tokens and is_primary():
                warn(f"{given_as}: {other_tokens}")
            parts.append(placed_params(weights, base_of(abstract), base_of(shardings), layers_at))
        if model.lora is not None and model.lora.init_from is not None:
            adapter = adapter_weights(Path(model.lora.init_from), model.lora,
                                      f"model.lora.init_from={model.lora.init_from!r}", stacked_layers(model))
            adapter.check(adapters_of(model_params))
            parts.append(placed_params(adapter, adapters_of(abstract), adapters_of(shardings), layers_at))
        return joined(*parts)

    def gradients(self, state: TrainState, batch: dict) -> tuple[Any, dict]:
        """One batch's gradients as the train step computes them (synchronised over the replicas, unscaled,
        float32, in the state's parameter layout) and the metric sums: for checks against a reference."""
        return self.compiled_gradients(state, batch)(state, batch)

    def compiled_gradients(self, state: TrainState, batch: dict) -> Any:
        """`gradients`' compiled program for such arguments: its HLO is the train step's without the update."""
        params = self.abstract_state.params
        gradient_step = make_gradient_step(self.model, objective_of(self.config.model), self.policy,
                                           replicas=self.parallel.replicas(params),
                                           compute_params=self.parallel.gather_params(params),
                                           gradients=self.parallel.gradient_parts(self._remat_name, params)
                                           .get("gradients"))

        def fn(state: TrainState, batch: dict) -> tuple[Any, dict]:
            return gradient_step(state, batch)[:2]

        # Synchronised gradients are whole over `data` (FSDP splits only the update), as the params are laid out
        # over `stage` and `tensor`.
        whole_over_data = jax.tree.map(lambda spec: without_axis(spec, DATA), self.specs.params,
                                       is_leaf=lambda x: isinstance(x, P))
        per_device = self.parallel.per_device(fn, self.specs, out_specs=(whole_over_data, P()), steps=1)
        return jax.jit(per_device).lower(state, batch).compile()

    @property
    def _remat_name(self) -> str:
        return self.remat.remat if self.remat is not None else "full"

    def _most_bytes_with_residuals(self) -> int:
        """Peak bytes per device of the train step compiled with remat: none, the most any process measured: they
        must choose alike, and XLA's figure depends on the device kind. The wait is a compilation's, as others may
        compile what this process loaded from its compile cache."""
        mine = peak_memory_bytes(self._train_step_for("none").first.compiled)
        return max(everyones("remat_none_bytes", mine, self.config.distributed.stall_timeout.compiling))

    def _train_step_for(self, remat: str) -> StepExecutables:
        if remat not in self._train_steps:
            params = self.abstract_state.params
            fn = make_train_step(self.model, self.tx, self.schedule, objective_of(self.config.model), self.policy,
                                 clip_norm=self.config.optimizer.clip_norm,
                                 skip_nonfinite=self.config.trainer.on_nonfinite == "skip",
                                 replicas=self.parallel.replicas(params),
                                 compute_params=self.parallel.gather_params(params),
                                 **self.parallel.gradient_parts(remat, params))
            fused = self.parallel.per_device(fuse_steps(fn, self.steps_per_sync), self.specs)
            name = "train_step" if self.steps_per_sync == 1 else f"train_step x{self.steps_per_sync}"
            self._train_steps[remat] = StepExecutables(name, lambda batch: compile_train_step(
                fused, self._abstract_sharded_state(), self.state_shardings, batch,
                train_batch_sharding(self.mesh, self.steps_per_sync), self.measured.cpu_matmul),
                self.train_batch_shapes(), self.compile_book)
        return self._train_steps[remat]

    def _abstract_sharded_state(self) -> TrainState:
        return with_shardings(self.abstract_state, self.specs, self.mesh)


def prepare_custom_collectives(mesh: jax.sharding.Mesh) -> None:
    """The CPU backend meets in each process and exchanges across processes with MPI; the CUDA one needs its NCCL
    communicators before the first step."""
    platform = mesh.devices.flat[0].platform
    if platform == "cpu" and jax.process_count() > 1:
        from xlatrain.custom_calls.backend import check_mpi_spans

        check_mpi_spans(jax.process_count(), jax.process_index())
    if platform in ("gpu", "cuda"):
        from xlatrain.custom_calls.nccl import setup_communicators

        setup_communicators(mesh, tuple(mesh.axis_names))


def build_program(config: Config, devices: list | None = None,
                  pinned_partition: tuple[int, ...] | None = None, pinned_cpu_matmul: str | None = None) -> Program:
    """`pinned_partition`: the block partition a resumed pipelined run chose at its first start;
    `pinned_cpu_matmul`: the dense layers' CPU kernels it chose. `devices` may be compile-only (a GPU target of
    `xlatrain lower --target`): what is traced here follows their platform."""
    devices = jax.devices() if devices is None else devices
    with compiling_for(devices[0].platform):
        return _build_program(config, devices, pinned_partition, pinned_cpu_matmul)


def _build_program(config: Config, devices: list, pinned_partition: tuple[int, ...] | None,
                   pinned_cpu_matmul: str | None) -> Program:
    compile_cache = use_compile_cache(config.trainer.compile_cache)
    derived = derive(config, devices)
    cpu_matmul = choose_cpu_matmul(config.runtime.cpu_matmul, pinned_cpu_matmul, platform=devices[0].platform,
                                   partitioned=config.parallel.mode == "jit" and len(devices) > 1,
                                   built_in_model=not isinstance(config.model, TorchModelConfig))
    mesh = build_mesh(config, devices)
    if config.collectives.impl == "custom":
        prepare_custom_collectives(mesh)
    dataset = open_dataset(config.data, config.model.loss, config.run_dir(), config.run_dir() / SHARD_SCANS_FILE)
    _refuse_preference_misfits(config, dataset.spec.pairs)
    examples, digest = data_identity(dataset)
    check_every_process_reads_the_same(config.data, identity_record(examples, digest))
    policy = resolve_policy(config.precision, config.collectives.dtype)
    model = build_model(config, dataset.spec, policy.compute, derived.data_parallel, derived.scan_layers)
    if derived.stages > 1:
        refuse_unpipelinable(config, derived, model)
    check_model_outputs(model, dataset.spec, config.model.loss, policy, config.model.named())
    if model.torch is not None:
        from xlatrain.torch_bridge.module import with_frozen_known

        model = with_frozen_known(model, dataset.spec)
    _refuse_partly_frozen(config, derived, model)
    schedule = learning_rate_schedule(config.optimizer, derived, config.optimizer.decay_steps or config.trainer.steps)
    parallel = (pipeline_parallel(config, derived, mesh, model, dataset.spec, policy, pinned_partition)
                if derived.stages > 1 else DataParallel(config, derived, mesh, model, policy))
    measured = Measured(examples, digest, _model_flops(config, derived, model, dataset.spec, policy),
                        parallel.partition, cpu_matmul)
    tx = build_optimizer(config.optimizer, schedule, parallel.block_axes, model.frozen, parallel.matrix_owners())
    init = make_init(model, tx, config.seed, policy, arrange=parallel.arrange)
    abstract, specs = parallel.state_specs(init, tx)
    _refuse_nothing_to_train(config, abstract.params, model.frozen)
    if isinstance(config.optimizer, MuonConfig):
        _refuse_muon_misfits(config, parallel, abstract.params, model.frozen)
    if isinstance(config.optimizer, ScheduleFreeAdamWConfig) and True in jax.tree.leaves(model.frozen):
        raise UserError("config: optimizer.name=schedule_free_adamw is not built for frozen parameters (LoRA's base, "
                        "a torch module's requires_grad=False): its average would have to skip them; choose another "
                        "optimizer.name (e.g. adamw)")
    memory = device_memory(mesh)
    check_state_fits(with_shardings(abstract, specs, mesh), memory)
    return Program(config, derived, measured, mesh, dataset, model, tx, schedule, init, abstract, specs, policy,
                   parallel, CompileBook(config.trainer.compile_budget), compile_cache, memory)


def build_model(config: Config, spec: DataSpec, compute_dtype: jnp.dtype, data_parallel: int,
                scan_layers: bool | None) -> ModelDef:
    """The model of a run: a flax model (xlatrain/models/), or a torch module through the torch bridge.
    `data_parallel` (the size of the `data` axis) decides the dimension of a torch parameter that zero1/fsdp
    shard; `scan_layers`: the run's resolved model.scan_layers (a GPT's)."""
    if isinstance(config.model, TorchModelConfig):
        from xlatrain.torch_bridge.module import torch_model

        return torch_model(config.model, config.seed, data_parallel)
    model = flax_model(model_factory(config.model, spec, compute_dtype, scan_layers))
    return dataclasses.replace(model, reports=router_balance(config.model))


def replica_state_bytes(config: Config) -> int:
    """Bytes of one replica's train state (params, optimizer state), traced without touching a device."""
    policy = resolve_policy(config.precision, config.collectives.dtype)
    # No run directory: this runs before the run holds (or has checked) its directory, so a tokenizer a text run
    # trains is trained here in memory only, never written; its vocabulary is the configured one either way.
    spec = open_dataset(config.data, config.model.loss).spec
    model = build_model(config, spec, policy.compute, data_parallel=1, scan_layers=False)
    tx = build_optimizer(config.optimizer, optax.constant_schedule(config.optimizer.lr),
                         block_axes=0 if model.blocks is None else 1)
    abstract = jax.eval_shape(make_init(model, tx, config.seed, policy))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))


def apply_cpu_devices(*configs: Config) -> cpu_devices.CpuDevicePlan:
    """mesh.cpu_devices for this host, before JAX starts its backends (runtime/cpu_devices.py), a replica sized
    from the config's model. A script that builds programs itself calls it before any JAX operation."""
    return cpu_devices.apply_cpu_devices(*configs, replica_state_bytes=replica_state_bytes)


def _model_flops(config: Config, derived: Derived, model: ModelDef, spec: DataSpec, policy: Policy) -> float | None:
    """The unpipelined model's forward and backward over the global batch, traced (lowering/flops.py): what
    every layout of the step (sharded, accumulated, pipelined) computes, recomputation aside. An MoE model's
    experts are traced as grouped matmuls, whose products are the chosen experts' alone (the active parameters)."""
    if getattr(config.model, "moe", None) is not None:
        model = dataclasses.replace(model, run=flax_model(model_factory(
            config.model, spec, policy.compute, derived.scan_layers, formulation="sorted")).run)
    forward = make_forward(model, policy)

    loss = objective_of(config.model)

    def objective(params, model_state, batch):
        outputs, _ = forward(params, model_state, model_inputs(batch, loss), jax.random.PRNGKey(0),
                             documents_of(batch))
        return objective_sums(outputs_and_reports(outputs)[0], batch, loss)["loss"]

    params, model_state = jax.eval_shape(lambda: init_variables(model, jax.random.PRNGKey(0), policy))
    try:
        return step_flops(jax.grad(objective), params, model_state, spec.abstract_batch((derived.global_batch,)))
    except UncountedLoop:
        return None


def _refuse_preference_misfits(config: Config, pairs: bool) -> None:
    """DPO and preference pairs go together, and (for now) without what splits a pair's sequences or the step's
    loss otherwise: pipeline stages, context parallelism, MoE routers' losses."""
    dpo = getattr(config.model, "dpo", None)
    if dpo is None and pairs:
        raise UserError(f"config: data.path={config.data.path!r} holds preference pairs, which train with DPO: set "
                        "model.dpo (e.g. model.dpo.beta=0.1)")
    if dpo is None:
        return
    if not pairs:
        raise UserError("config: model.dpo trains on preference pairs, and the data holds none: prepare preference "
                        "records (prompt, chosen, rejected) with `xlatrain data prepare` and train on those shards "
                        "(data.source=tokens)")
    refused = {"mesh.stage": config.mesh.stage > 1, "mesh.context": config.mesh.context > 1,
               "model.moe": getattr(config.model, "moe", None) is not None}
    for key, found in refused.items():
        if found:
            raise UserError(f"config: model.dpo is not built with {key} yet (a pipeline's last stage, a context "
                            "group's split sequences and a router's losses would each need DPO's own sum); drop "
                            f"{key}")


def _refuse_muon_misfits(config: Config, parallel: Any, params: Any, frozen: Any) -> None:
    """Muon needs hidden matrices to orthogonalise, and, in a per-device program, each matrix whole on its device."""
    if "muon" not in jax.tree.leaves(muon_labels(params, frozen)):
        raise UserError(f"config: optimizer.name=muon orthogonalises the hidden matrices of a built-in decoder's "
                        f"stacked layers (attention and MLP projections, experts), and {config.model.named()} has "
                        "none to train: choose another optimizer.name (e.g. adamw)")
    strategy, mode = config.parallel.strategy, config.parallel.mode
    if mode != "jit" and (strategy != "replicated" or config.mesh.tensor > 1):
        what = f"parallel.strategy={strategy}" if strategy != "replicated" else f"mesh.tensor={config.mesh.tensor}"
        raise UserError(f"config: optimizer.name=muon with {what} runs in parallel.mode=jit (each matrix gathered "
                        f"whole on one of the devices that hold its shards); the per-device program of "
                        f"parallel.mode={mode}{' (a pipeline)' if config.mesh.stage > 1 else ''} holds only shards: "
                        "set parallel.mode=jit, or parallel.strategy=replicated and mesh.tensor=1")


def _refuse_nothing_to_train(config: Config, params: Any, frozen: Any) -> None:
    """As torch.optim refuses an empty parameter list: a run that could change nothing is a mistake."""
    leaves = jax.tree.leaves(params)
    flags = jax.tree.leaves(frozen) if frozen is not None else [False] * len(leaves)
    if not any(leaf.size and flag is not True for leaf, flag in zip(leaves, flags, strict=True)):
        why = ("all of its parameters are frozen (requires_grad=False) or get no gradient from its forward (unused, "
               "detached or under torch.no_grad()); unfreeze some" if leaves else
               "it has no parameters; give it some")
        raise UserError(f"config: {config.model.named()} has nothing to train: {why}")


def _refuse_partly_frozen(config: Config, derived: Derived, model: ModelDef) -> None:
    """Weight decay skips a frozen parameter as a whole, and a pipeline runs every block through one block's
    module; the blocks' stacked parameters hold one leaf per name."""
    flat = jax.tree_util.tree_flatten_with_path(model.frozen)[0] if model.frozen is not None else []
    partly = [jax.tree_util.keystr(path) for path, leaf in flat if leaf == PARTLY_FROZEN]
    if partly and derived.stages > 1:
        raise UserError(f"config: {config.model.named()} cannot be pipelined (mesh.stage={derived.stages}): it "
                        "freezes (requires_grad=False) some of its blocks and not others, and a pipeline runs every "
                        "block through one block's module; freeze every block or none, or set mesh.stage=1")
    if partly and config.optimizer.weight_decay > 0:
        raise UserError(f"config: {config.model.named()} freezes (requires_grad=False) {partly[0]} in some of its "
                        f"blocks and not in others, and optimizer.weight_decay={config.optimizer.weight_decay} would "
                        "decay the frozen ones: freeze it in every block or none, or set optimizer.weight_decay=0")
