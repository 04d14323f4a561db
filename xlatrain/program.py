"""Config -> mesh -> data -> model + state -> the lowered steps: everything a run needs, built once."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from xlatrain import compat
from xlatrain.compile_cache import use_compile_cache
from xlatrain.config import Config, Derived, derive
from xlatrain.data.identity import check_every_process_reads_the_same, data_identity, identity_record
from xlatrain.data.sources import Dataset, open_dataset
from xlatrain.data.spec import DataSpec
from xlatrain.distributed import as_primary_has_it, everyones
from xlatrain.errors import UserError
from xlatrain.lowering.block_costs import measure_block_costs
from xlatrain.lowering.compile import CompileBook, StepExecutables, compile_eval_step, compile_train_step
from xlatrain.lowering.flops import UncountedLoop, step_flops
from xlatrain.lowering.grad_sync import ExplicitReplicas, PartitionedReplicas, explicit_replicas
from xlatrain.lowering.hlo_graph import amp_order_problems, parse_hlo
from xlatrain.lowering.inspect import peak_memory_bytes
from xlatrain.lowering.pipeline_eval import make_pipeline_eval
from xlatrain.lowering.pipeline_step import make_pipeline_gradients
from xlatrain.lowering.pipeline_work import pipeline_work, residual_bytes
from xlatrain.lowering.platform import compiling_for
from xlatrain.lowering.stage_link import StagedTrees, stage_link
from xlatrain.lowering.step import (
    eval_metrics,
    fuse_steps,
    loss_sums,
    make_eval_step,
    make_forward,
    make_gradient_step,
    make_train_step,
)
from xlatrain.mesh import DATA, build_mesh, eval_batch_sharding, per_replica, replicated, train_batch_sharding
from xlatrain.models import build_model
from xlatrain.models.fit import check_model_outputs
from xlatrain.models.interface import PARTLY_FROZEN
from xlatrain.optim import build_optimizer, learning_rate_schedule
from xlatrain.pipeline.layout import StageLayout
from xlatrain.pipeline.plan import PipelinePlan, plan_pipeline
from xlatrain.pipeline.remat import RematChoice, choose_remat, configured
from xlatrain.precision import Policy, resolve_policy
from xlatrain.sharding import named, param_specs
from xlatrain.state import (
    DeviceMemory,
    ModelDef,
    TrainState,
    check_state_fits,
    check_step_fits,
    create_state,
    device_memory,
    init_variables,
    make_init,
    state_specs,
    verify_replicas_identical,
    with_shardings,
)


@dataclass(frozen=True)
class Program:
    config: Config
    derived: Derived
    mesh: jax.sharding.Mesh
    dataset: Dataset
    model: ModelDef
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    init: Any
    abstract_state: TrainState
    specs: TrainState
    policy: Policy
    compile_book: CompileBook = field(default_factory=CompileBook)
    pipeline: PipelinePlan | None = None
    compile_cache: Path | None = None
    """Where JAX's persistent compilation cache is (trainer.compile_cache), or None when it is off."""
    device_memory: DeviceMemory = (None, "")
    """What one device may hold (state.device_memory), measured before the steps compile."""
    _train_steps: dict[str, StepExecutables] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The train step per remat ("full" alone without a pipeline); remat: auto may compile two."""

    @property
    def state_shardings(self) -> TrainState:
        return named(self.mesh, self.specs)

    @property
    def param_count(self) -> int:
        if self.pipeline is not None:
            return self.pipeline.layout.real_size(self.abstract_state.params)
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.abstract_state.params))

    @property
    def steps_per_sync(self) -> int:
        return self.config.trainer.steps_per_sync

    def train_batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """[steps per sync (when > 1), microbatches, rows per microbatch, ...] per key, rows over `data`."""
        d, k = self.derived, self.steps_per_sync
        steps = (k,) if k > 1 else ()
        return self._batch_shapes((*steps, d.microbatches, d.microbatch_size), train_batch_sharding(self.mesh, k))

    def eval_batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        return self._batch_shapes((self.derived.global_batch,), eval_batch_sharding(self.mesh))

    def _batch_shapes(self, rows: tuple[int, ...], sharding) -> dict[str, jax.ShapeDtypeStruct]:
        return batch_structs(self.dataset.spec, rows, sharding)

    @cached_property
    def train_step(self) -> StepExecutables:
        """k fused optimizer steps (trainer.steps_per_sync) per call, compiled per batch shape."""
        return self._train_step_for(self._remat_name)

    @property
    def _remat_name(self) -> str:
        return self.remat.remat if self.remat is not None else "full"

    @cached_property
    def remat(self) -> RematChoice | None:
        """A pipeline's remat; `auto` compiles the train step with remat: none to measure it, and that
        executable is the train step when it fits."""
        if self.pipeline is None:
            return None
        pipe = self.config.parallel.pipeline
        zero_bubble = pipe.schedule if pipe.splits_backward() else None
        if pipe.remat != "auto":
            return configured(pipe.remat, zero_bubble)
        budget, source = ((pipe.memory_budget_bytes, "parallel.pipeline.memory_budget_bytes")
                          if pipe.memory_budget_bytes is not None else self.device_memory)
        return choose_remat(self._most_bytes_with_residuals, budget, source, zero_bubble)

    def _most_bytes_with_residuals(self) -> int:
        """Peak bytes per device of the train step compiled with remat: none, the most any process measured: they
        must choose alike, and XLA's figure depends on the device kind. The wait is a compilation's, as others may
        compile what this process loaded from its compile cache."""
        mine = peak_memory_bytes(self._train_step_for("none").first.compiled)
        return max(everyones("remat_none_bytes", mine, self.config.distributed.stall_timeout.compiling))

    def _train_step_for(self, remat: str) -> StepExecutables:
        if remat not in self._train_steps:
            fn = make_train_step(self.model, self.tx, self.schedule, self.config.model.loss, self.policy,
                                 clip_norm=self.config.optimizer.clip_norm,
                                 skip_nonfinite=self.config.trainer.on_nonfinite == "skip",
                                 replicas=self._replicas(), compute_params=self._gather_params,
                                 **self._pipelined(remat))
            fused = self._per_device(fuse_steps(fn, self.steps_per_sync))
            name = "train_step" if self.steps_per_sync == 1 else f"train_step x{self.steps_per_sync}"
            self._train_steps[remat] = StepExecutables(name, lambda batch: compile_train_step(
                fused, self._abstract_sharded_state(), self.state_shardings, batch,
                train_batch_sharding(self.mesh, self.steps_per_sync)), self.train_batch_shapes(), self.compile_book)
        return self._train_steps[remat]

    @cached_property
    def eval_step(self) -> StepExecutables:
        if self.pipeline is None:
            fn = make_eval_step(self.model, self.config.model.loss, self.policy, self._gather_params)
        else:
            fn = self._per_device(self._pipelined_eval(), out_specs=P(), batch_spec=eval_batch_sharding(self.mesh).spec)
        return StepExecutables("eval_step", lambda batch: compile_eval_step(
            fn, self._abstract_sharded_state(), self.state_shardings, batch, eval_batch_sharding(self.mesh)),
            self.eval_batch_shapes(), self.compile_book)

    @property
    def gradients_synchronised(self) -> bool:
        """Whether the update sums gradients across devices: not in a pipeline over one data replica, where each
        stage updates its blocks from its own gradients (and only their norm and finiteness are summed)."""
        return self.pipeline is None or self.derived.data_parallel > 1

    def check_steps_fit(self) -> None:
        """Compiles the train and eval steps, and refuses one that cannot fit a device's memory."""
        for step in (self.train_step, self.eval_step):
            check_step_fits(step.name, peak_memory_bytes(step.first.compiled), self.device_memory)

    def amp_order_problems(self) -> list[str]:
        """The AMP order checked on the compiled (single-step) train program; empty when it holds."""
        leaves = jax.tree_util.tree_flatten_with_path(self.abstract_state)[0]
        params = [i for i, (path, _) in enumerate(leaves) if jax.tree_util.keystr(path).startswith(".params")]
        skips = self.policy.dynamic_scale or self.config.trainer.on_nonfinite == "skip"
        return amp_order_problems(parse_hlo(self.train_step.first.compiled.as_text()), params,
                                  sorted(self.train_batch_shapes()), skips_nonfinite=skips,
                                  clips=self.config.optimizer.clip_norm is not None,
                                  scales=self.policy.dynamic_scale, synchronised=self.gradients_synchronised)

    def pipeline_report(self, compiled: Any) -> dict[str, Any]:
        """The pipeline of a compiled train step: schedule, partition, bubble, and the activations a stage
        holds, beside XLA's temporaries (memory analysis) that hold them."""
        plan, s = self.pipeline, self.pipeline.schedule
        memory = compiled.memory_analysis()
        return {"schedule": s.name, "stages": s.stages, "virtual_stages": s.virtual_stages,
                "microbatches": s.microbatches, "partition": list(plan.layout.partition),
                "partition_source": plan.partition_source, "compute_balance": plan.balance.compute_ratio,
                "memory_balance": plan.balance.memory_ratio,
                "bubble": s.bubble(), "theoretical_bubble": s.theoretical_bubble(),
                "activation_buffers": plan.slots.activation_buffers,
                "gpipe_activation_buffers": plan.gpipe_activation_buffers(),
                "activation_bytes_per_microbatch": plan.costs.boundary_bytes,
                "remat": self.remat.remat, "remat_reason": self.remat.reason,
                "residual_buffers": plan.slots.residual_buffers if self.remat.remat == "none" else 0,
                "stash_buffers": plan.slots.stash_buffers,
                "stash_bytes_per_microbatch": plan.count_stash_bytes() if plan.slots.splits_backward else 0,
                "residual_bytes_per_microbatch": plan.count_residual_bytes() if self.remat.remat == "none" else 0,
                "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else 0}

    def create_state(self) -> TrainState:
        given = self.model.initial_values() if self.model.initial_values is not None else None
        state = create_state(self.init, self.specs, self.mesh, given)
        verify_replicas_identical(state, self.specs, self.mesh)
        return state

    def _pipelined(self, remat: str) -> dict[str, Any]:
        """A pipeline's gradient computation and its stage-split norms, for make_train_step."""
        if self.pipeline is None:
            return {}
        c = self.config.collectives
        link = stage_link(self.derived.stages, c.impl, c.timeout_s)
        plan = self.pipeline
        return {"gradients": make_pipeline_gradients(self.model.blocks, plan.layout, plan.slots,
                                                     self.derived.pipeline_microbatches, self.config.model.loss,
                                                     self.policy, link, remat),
                "trees": StagedTrees(link, self._gather_params)}

    def _pipelined_eval(self) -> Callable[[TrainState, dict], dict]:
        """Each replica's rows through the stages, forward only; the replicas' sums added."""
        c, plan = self.config.collectives, self.pipeline
        evaluate = make_pipeline_eval(self.model.blocks, plan.layout, plan.eval_slots, plan.evaluation.microbatches,
                                      self.config.model.loss, self.policy,
                                      stage_link(self.derived.stages, c.impl, c.timeout_s))
        replicas = self._replicas()

        def eval_step(state: TrainState, batch: dict) -> dict:
            return eval_metrics(jax.tree.map(replicas.total, evaluate(self._gather_params(state.params), batch)))

        return eval_step

    def _replicas(self) -> PartitionedReplicas | ExplicitReplicas:
        if self.config.parallel.mode == "jit":
            return PartitionedReplicas(self.derived.data_parallel, lambda tree: per_replica(self.mesh, tree))
        c = self.config.collectives
        strategy = self.config.parallel.strategy
        return explicit_replicas(DATA, self.derived.data_parallel, c.bucket_bytes, c.impl, c.timeout_s,
                                 self._split_dims() if strategy in ("zero1", "fsdp") else None,
                                 across_processes=c.impl == "custom" and self._data_axis_processes() > 1,
                                 params_split=strategy == "fsdp")

    def _data_axis_processes(self) -> int:
        from xlatrain.custom_calls.backend import processes_along

        return processes_along(self.mesh, DATA)

    def _split_dims(self) -> Any:
        """Per param, the dimension its optimizer state (and with FSDP the param) is split along over `data`
        (None: not split)."""
        if self.pipeline is not None:
            specs = pipeline_split(self.config, self.pipeline.layout, self.derived.data_parallel)(
                self.abstract_state.params)
        else:
            specs = param_specs(self.abstract_state.params, self.model.logical_axes, True,
                                self.model.rules(self.config.parallel.logical_rules), self.mesh)
        return jax.tree.map(lambda spec: spec.index(DATA) if DATA in spec else None, specs,
                            is_leaf=lambda x: isinstance(x, P))

    def gradients(self, state: TrainState, batch: dict) -> tuple[Any, dict]:
        """One batch's gradients as the train step computes them (synchronised over the replicas, unscaled,
        float32, in the state's parameter layout) and the metric sums: for checks against a reference."""
        return self.compiled_gradients(state, batch)(state, batch)

    def compiled_gradients(self, state: TrainState, batch: dict) -> Any:
        """`gradients`' compiled program for such arguments: its HLO is the train step's without the update."""
        gradient_step = make_gradient_step(self.model, self.config.model.loss, self.policy,
                                           replicas=self._replicas(), compute_params=self._gather_params,
                                           gradients=self._pipelined(self._remat_name).get("gradients"))

        def fn(state: TrainState, batch: dict) -> tuple[Any, dict]:
            return gradient_step(state, batch)[:2]

        return jax.jit(self._per_device(fn, out_specs=(self.specs.params, P()), steps=1)).lower(state, batch).compile()

    def _per_device(self, step: Any, out_specs: Any = None, steps: int | None = None, batch_spec: P | None = None,
                    ) -> Any:
        """parallel.mode=shard_map or pmap: the step as written is one device's program over its rows."""
        mode = self.config.parallel.mode
        batch_spec = batch_spec or train_batch_sharding(self.mesh, steps or self.steps_per_sync).spec
        if mode == "shard_map":
            return compat.shard_map(step, self.mesh, in_specs=(self.specs, batch_spec),
                                    out_specs=(self.specs, P()) if out_specs is None else out_specs)
        if mode == "pmap":
            return compat.pmap_over_rows(step, DATA, list(self.mesh.devices.ravel()), rows_axis=len(batch_spec) - 1)
        return step

    def _gather_params(self, params: Any) -> Any:
        """FSDP keeps params sharded at rest and gathers them for compute; other strategies store them whole.
        In a pipeline's per-device program the gather is written out (an all-gather over `data`)."""
        if self.config.parallel.strategy != "fsdp":
            return params
        if self.pipeline is not None:
            return self._replicas().gather(params)
        return jax.lax.with_sharding_constraint(params, jax.tree.map(lambda _: replicated(self.mesh), params))

    def _abstract_sharded_state(self) -> TrainState:
        return with_shardings(self.abstract_state, self.specs, self.mesh)


def batch_structs(spec: DataSpec, rows: tuple[int, ...], sharding=None) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract batch entries [*rows, *example shape] (with a `mask` when examples are padded)."""
    shapes = {"inputs": (spec.input_shape, spec.input_dtype), "targets": (spec.target_shape, spec.target_dtype)}
    if spec.buckets is not None:
        shapes["mask"] = (spec.target_shape, np.dtype(np.float32))
    return {k: jax.ShapeDtypeStruct((*rows, *shape), dtype, sharding=sharding) for k, (shape, dtype) in shapes.items()}


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
                  pinned_partition: tuple[int, ...] | None = None) -> Program:
    """`pinned_partition`: the block partition a resumed pipelined run chose at its first start. `devices` may be
    compile-only (a GPU target of `xlatrain lower --target`): what is traced here follows their platform."""
    devices = jax.devices() if devices is None else devices
    with compiling_for(devices[0].platform):
        return _build_program(config, devices, pinned_partition)


def _build_program(config: Config, devices: list, pinned_partition: tuple[int, ...] | None) -> Program:
    compile_cache = use_compile_cache(config.trainer.compile_cache)
    derived = derive(config, devices)
    mesh = build_mesh(config, devices)
    if config.collectives.impl == "custom":
        prepare_custom_collectives(mesh)
    dataset = open_dataset(config.data, config.model.loss)
    examples, digest = data_identity(dataset)
    check_every_process_reads_the_same(config.data, identity_record(examples, digest))
    derived = dataclasses.replace(derived, data_examples=examples, data_digest=digest)
    policy = resolve_policy(config.precision, config.collectives.dtype)
    model = build_model(config.model, dataset.spec, policy.compute, config.seed, derived.data_parallel,
                        derived.scan_layers)
    if derived.stages > 1:
        _refuse_unpipelinable(config, derived, model)
    check_model_outputs(model, dataset.spec, config.model.loss, policy, _model_name(config))
    if model.torch is not None:
        from xlatrain.models.torch_module import with_frozen_known

        model = with_frozen_known(model, dataset.spec)
    _refuse_partly_frozen(config, derived, model)
    schedule = learning_rate_schedule(config.optimizer, derived,
                                        config.optimizer.decay_steps or config.trainer.steps)
    pipeline = _plan_pipeline(config, derived, model, dataset.spec, policy, pinned_partition)
    derived = dataclasses.replace(derived, model_flops_per_step=_model_flops(config, derived, model, dataset.spec,
                                                                             policy))
    if pipeline is not None:
        derived = dataclasses.replace(derived, pipeline_partition=pipeline.layout.partition)
    # Params of a BlockStack's layers are stacked: [layers, ...], or [virtual stages, stages, blocks, ...].
    block_axes = 0 if model.blocks is None else 3 if pipeline else 1
    tx = build_optimizer(config.optimizer, schedule, block_axes, model.frozen)
    init = make_init(model, tx, config.seed, policy, arrange=pipeline.layout.stage_params if pipeline else None)
    rules = model.rules(config.parallel.logical_rules)
    strategy = config.parallel.strategy
    split = pipeline_split(config, pipeline.layout, derived.data_parallel) if pipeline else None
    abstract, specs = state_specs(init, model, tx, strategy, rules, mesh,
                                  fixed_param_specs=(split if strategy == "fsdp" else pipeline.layout.param_specs)
                                  if pipeline else None,
                                  fixed_optimizer_specs=split if strategy in ("zero1", "fsdp") else None)
    _refuse_nothing_to_train(config, abstract.params, model.frozen)
    memory = device_memory(mesh)
    check_state_fits(with_shardings(abstract, specs, mesh), memory)
    return Program(config, derived, mesh, dataset, model, tx, schedule, init, abstract, specs, policy,
                   CompileBook(config.trainer.compile_budget), pipeline, compile_cache, memory)


def replica_state_bytes(config: Config) -> int:
    """Bytes of one replica's train state (params, optimizer state), traced without touching a device."""
    policy = resolve_policy(config.precision, config.collectives.dtype)
    model = build_model(config.model, open_dataset(config.data, config.model.loss).spec, policy.compute,
                        config.seed, data_parallel=1, scan_layers=False)
    tx = build_optimizer(config.optimizer, optax.constant_schedule(config.optimizer.lr),
                         block_axes=0 if model.blocks is None else 1)
    abstract = jax.eval_shape(make_init(model, tx, config.seed, policy))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))


def pipeline_split(config: Config, layout: StageLayout, data: int) -> Callable[[Any], Any]:
    """How a pipeline's zero1 and fsdp split each leaf over `data` (StageLayout.split_specs): by whole layers
    for adafactor, whose update reads each layer's whole matrices."""
    return partial(layout.split_specs, data=data, whole_layers=config.optimizer.name == "adafactor")


def _model_flops(config: Config, derived: Derived, model: ModelDef, spec: DataSpec, policy: Policy) -> float | None:
    """The unpipelined model's forward and backward over the global batch, traced (lowering/flops.py): what
    every layout of the step (sharded, accumulated, pipelined) computes, recomputation aside."""
    forward = make_forward(model, policy)

    def objective(params, model_state, batch):
        outputs, _ = forward(params, model_state, batch["inputs"], jax.random.PRNGKey(0))
        return loss_sums(outputs, batch, config.model.loss)["loss"]

    params, model_state = jax.eval_shape(lambda: init_variables(model, jax.random.PRNGKey(0), policy))
    try:
        return step_flops(jax.grad(objective), params, model_state, batch_structs(spec, (derived.global_batch,)))
    except UncountedLoop:
        return None


def _model_name(config: Config) -> str:
    target = getattr(config.model, "target", None)
    return f"model.target={target!r}" if target else f"model.name={config.model.name}"


def _plan_pipeline(config: Config, derived: Derived, model: ModelDef, spec: DataSpec, policy: Policy,
                   pinned_partition: tuple[int, ...] | None) -> PipelinePlan | None:
    if derived.stages == 1:
        return None

    def abstract() -> tuple[dict, dict]:
        """The model's abstract params and one pipeline microbatch's abstract batch."""
        return (jax.eval_shape(lambda: init_variables(model, jax.random.PRNGKey(0), policy)[0]),
                batch_structs(spec, (derived.pipeline_microbatch_size,)))

    def measure():
        return measure_block_costs(model.blocks, *abstract(), config.model.loss, policy,
                                   split_backward=config.parallel.pipeline.splits_backward())

    def count_work(schedule, partition, remat):
        return pipeline_work(model.blocks, *abstract(), config.model.loss, policy, schedule, partition, remat)

    def count_residual_bytes(partition, stash):
        return residual_bytes(model.blocks, *abstract(), config.model.loss, policy, partition, stash)

    def as_process_0_chose(partition: tuple[int, ...]) -> tuple[int, ...]:
        """Every process measures the costs on its own devices, and one kind's may cut the blocks differently."""
        return tuple(json.loads(as_primary_has_it("pipeline_partition", json.dumps(partition))))

    return plan_pipeline(config.parallel.pipeline, derived.stages, derived.pipeline_microbatches,
                         model.blocks.layers, measure, count_work, count_residual_bytes,
                         derived.microbatches * derived.pipeline_microbatches, pinned_partition, as_process_0_chose)


def _refuse_nothing_to_train(config: Config, params: Any, frozen: Any) -> None:
    """As torch.optim refuses an empty parameter list: a run that could change nothing is a mistake."""
    leaves = jax.tree.leaves(params)
    flags = jax.tree.leaves(frozen) if frozen is not None else [False] * len(leaves)
    if not any(leaf.size and flag is not True for leaf, flag in zip(leaves, flags, strict=True)):
        why = ("all of its parameters are frozen (requires_grad=False) or get no gradient from its forward (unused, "
               "detached or under torch.no_grad()); unfreeze some" if leaves else
               "it has no parameters; give it some")
        raise UserError(f"config: {_model_name(config)} has nothing to train: {why}")


def _refuse_partly_frozen(config: Config, derived: Derived, model: ModelDef) -> None:
    """Weight decay skips a frozen parameter as a whole, and a pipeline runs every block through one block's
    module; the blocks' stacked parameters hold one leaf per name."""
    flat = jax.tree_util.tree_flatten_with_path(model.frozen)[0] if model.frozen is not None else []
    partly = [jax.tree_util.keystr(path) for path, leaf in flat if leaf == PARTLY_FROZEN]
    if partly and derived.stages > 1:
        raise UserError(f"config: {_model_name(config)} cannot be pipelined (mesh.stage={derived.stages}): it freezes "
                        "(requires_grad=False) some of its blocks and not others, and a pipeline runs every block "
                        "through one block's module; freeze every block or none, or set mesh.stage=1")
    if partly and config.optimizer.weight_decay > 0:
        raise UserError(f"config: {_model_name(config)} freezes (requires_grad=False) {partly[0]} in some of its "
                        f"blocks and not in others, and optimizer.weight_decay={config.optimizer.weight_decay} would "
                        "decay the frozen ones: freeze it in every block or none, or set optimizer.weight_decay=0")


def _refuse_unpipelinable(config: Config, derived: Derived, model: ModelDef) -> None:
    if model.blocks is None:
        why = model.not_pipelinable or "it is not a xlatrain.models.BlockStack"
        raise UserError(f"config: {_model_name(config)} cannot be pipelined (mesh.stage={derived.stages}): {why} (see "
                        "README, \"Pipelines\"); or set mesh.stage=1")
    model_state = jax.eval_shape(model.init, jax.random.PRNGKey(0))[1]
    if jax.tree.leaves(model_state):
        raise UserError(f"config: {_model_name(config)} cannot be pipelined (mesh.stage={derived.stages}): it keeps "
                        f"model state ({', '.join(list(model_state)[:3])}), and a pipeline passes only activations "
                        "between stages; or set mesh.stage=1")
