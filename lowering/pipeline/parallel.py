"""The pipeline's part of a program: the plan made from the model's measured costs, the remat chosen for it, and
the train and eval steps run through the stages (lowering/pipeline/), beside data parallelism over `data`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import jax
import optax
from jax.sharding import PartitionSpec as P
from xlatrain.lowering.data_parallel import DataParallel, check_tensor_split
from xlatrain.lowering.pipeline.block_costs import measure_block_costs
from xlatrain.lowering.pipeline.evaluation import make_pipeline_eval
from xlatrain.lowering.pipeline.gradients import make_pipeline_gradients
from xlatrain.lowering.pipeline.stage_link import StageLink, stage_link
from xlatrain.lowering.pipeline.work import pipeline_work, residual_bytes
from xlatrain.lowering.step import eval_metrics, in_context_order

from xlatrain.config import Config, Derived
from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError
from xlatrain.mesh import STAGE, eval_batch_sharding
from xlatrain.models.blocks import BLOCKS
from xlatrain.models.interface import ModelDef
from xlatrain.optim import evaluated_params
from xlatrain.pipeline.plan import PipelinePlan, plan_pipeline
from xlatrain.pipeline.remat import RematChoice, choose_remat, configured
from xlatrain.precision import Policy
from xlatrain.runtime.device_memory import DeviceMemory
from xlatrain.runtime.distributed import as_primary_has_it
from xlatrain.sharding import EXPERT, TENSOR, param_specs, rules_over, without_axis
from xlatrain.state import TrainState, init_variables, state_specs


@dataclass(frozen=True)
class PipelineParallel(DataParallel):
    """A pipeline over the `stage` axis inside each data replica: every device runs the slot program of its stage,
    holding only its stage's chunks of the blocks."""

    plan: PipelinePlan

    @property
    def pipeline(self) -> PipelinePlan:
        return self.plan

    @property
    def block_axes(self) -> int:
        """The stage layout's leading axes of the blocks' params: [virtual stages, stages, blocks, ...]."""
        return 3

    @property
    def arrange(self) -> Callable[[Any], Any]:
        return self.plan.layout.stage_params

    @property
    def partition(self) -> tuple[int, ...]:
        return self.plan.layout.partition

    @property
    def gradients_synchronised(self) -> bool:
        """Over one data replica each stage updates its blocks from its own gradients (and only their norm and
        finiteness are summed over the stages)."""
        return self.derived.data_parallel > 1

    def state_specs(self, init: Callable[[], TrainState], tx: optax.GradientTransformation,
                    ) -> tuple[TrainState, TrainState]:
        """The stage layout's specs (blocks over `stage`, and over `tensor` what the rules split), split over
        `data` too for zero1 (the optimizer state) and fsdp (the params as well)."""
        strategy = self.config.parallel.strategy
        abstract, specs = state_specs(
            init, self.model, tx, strategy, self._rules(), self.mesh,
            fixed_param_specs=self.param_split_specs if strategy == "fsdp" else self._stage_specs,
            fixed_optimizer_specs=self.param_split_specs if strategy in ("zero1", "fsdp") else None)
        check_tensor_split(self.config, self.plan.layout.model_shapes(abstract.params), self.model.logical_axes,
                           self._rules(), self.mesh)
        return abstract, specs

    def tensor_specs(self, params: Any) -> Any:
        """The stage layout's specs over `tensor` alone: the blocks' as the model's, behind [virtual stages, 1]."""
        return jax.tree.map(lambda spec: without_axis(spec, STAGE), self._stage_specs(params),
                            is_leaf=lambda x: isinstance(x, P))

    def param_count(self, params: Any) -> int:
        """The model's parameters, less the padding blocks of uneven chunks."""
        return self.plan.layout.real_size(params)

    def param_split_specs(self, params: Any) -> Any:
        """StageLayout.split_specs: by whole layers for adafactor, whose update reads each layer's whole matrices."""
        return self.plan.layout.split_specs(params, data=self.derived.data_parallel,
                                            whole_layers=self.config.optimizer.name == "adafactor",
                                            within=self._model_tensor_specs(params))

    def _stage_specs(self, params: Any) -> Any:
        """Blocks over `stage`, and what the rules split over `tensor`."""
        return self.plan.layout.param_specs(params, within=self._model_tensor_specs(params))

    def _model_tensor_specs(self, params: Any) -> Any:
        """The specs over `tensor` (and over `expert`, an MoE layer's experts, when each device holds its own) of
        the stage layout's params, in the model's layout."""
        shapes = self.plan.layout.model_shapes(params)
        axes = (TENSOR, EXPERT) if self._experts_inside else (TENSOR,)
        return param_specs(shapes, self.model.logical_axes, rules_over(self._rules(), axes), self.mesh)

    def _expert_leaves(self, params: Any) -> Any:
        """Per param of the stage layout, whether each device holds its own part of it over `expert`."""
        return super()._expert_leaves(self.plan.layout.model_shapes(params))

    def choose_remat(self, memory: DeviceMemory, most_bytes_with_residuals: Callable[[], int]) -> RematChoice:
        """parallel.pipeline.remat; `auto` measures the step compiled with remat: none against the budget."""
        pipe = self.config.parallel.pipeline
        zero_bubble = pipe.schedule if pipe.splits_backward() else None
        if pipe.remat != "auto":
            return configured(pipe.remat, zero_bubble)
        budget, source = ((pipe.memory_budget_bytes, "parallel.pipeline.memory_budget_bytes")
                          if pipe.memory_budget_bytes is not None else memory)
        return choose_remat(most_bytes_with_residuals, budget, source, zero_bubble)

    def gradient_parts(self, remat: str, params: Any) -> dict[str, Any]:
        """The gradients through the stages, and the stage-split trees whose norms sum over the stages."""
        plan, link = self.plan, self._link()
        return {"gradients": make_pipeline_gradients(self.model.blocks, plan.layout, plan.slots,
                                                     self.derived.pipeline_microbatches, self.config.model.loss,
                                                     self.policy, link, remat, self.model.reports,
                                                     self.replicas(params).across),
                "trees": self._split_trees(params, leading=self._stage_split(params), sums={STAGE: link.sum},
                                           gather=self.gather_params(params))}

    def eval_step(self, specs: TrainState, params: Any) -> Callable[[TrainState, dict], dict]:
        """Each replica's rows through the stages, forward only; the replicas' sums added."""
        plan = self.plan
        evaluate = make_pipeline_eval(self.model.blocks, plan.layout, plan.eval_slots, plan.evaluation.microbatches,
                                      self.config.model.loss, self.policy, self._link(), self.model.reports)
        replicas, gather = self.replicas(params), self.gather_params(params)

        def eval_step(state: TrainState, batch: dict) -> dict:
            params = gather(evaluated_params(state.opt_state, state.params))
            return eval_metrics(jax.tree.map(replicas.total, evaluate(params, in_context_order(batch))))

        return self.per_device(eval_step, specs, out_specs=P(), batch_spec=eval_batch_sharding(self.mesh).spec)

    def _gather_whole(self, params: Any) -> Callable[[Any], Any]:
        """In the per-device program the gather is written out: an all-gather over `data`."""
        return self.replicas(params).gather

    @staticmethod
    def _stage_split(params: dict) -> dict:
        """Per leaf, the mesh axes the stages split it over: `stage` for the blocks, none for the rest."""
        return {**jax.tree.map(lambda _: (), params), BLOCKS: jax.tree.map(lambda _: (STAGE,), params[BLOCKS])}

    def _link(self) -> StageLink:
        c = self.config.collectives
        return stage_link(self.derived.stages, c.impl, c.timeout_s)


def pipeline_parallel(config: Config, derived: Derived, mesh: jax.sharding.Mesh, model: ModelDef, spec: DataSpec,
                      policy: Policy, pinned_partition: tuple[int, ...] | None) -> PipelineParallel:
    """The run's pipeline, its partition measured from the model's pieces (or `pinned_partition`: the one a resumed
    run chose at its first start)."""
    return PipelineParallel(config, derived, mesh, model, policy,
                            _plan(config, derived, model, spec, policy, pinned_partition))


def refuse_unpipelinable(config: Config, derived: Derived, model: ModelDef) -> None:
    if model.blocks is None:
        why = model.not_pipelinable or "it is not a xlatrain.models.BlockStack"
        raise UserError(f"config: {config.model.named()} cannot be pipelined (mesh.stage={derived.stages}): {why} "
                        "(see docs/pipelines.md); or set mesh.stage=1")
    model_state = jax.eval_shape(model.init, jax.random.PRNGKey(0))[1]
    if jax.tree.leaves(model_state):
        raise UserError(f"config: {config.model.named()} cannot be pipelined (mesh.stage={derived.stages}): it "
                        f"keeps model state ({', '.join(list(model_state)[:3])}), and a pipeline passes only "
                        "activations between stages; or set mesh.stage=1")
    if getattr(config.data, "packing", False) and not model.blocks.takes_documents:
        raise UserError(f"config: {config.model.named()} cannot be pipelined on data.packing=true: its "
                        "before_blocks and blocks must take the packed documents (`documents` for a flax BlockStack, "
                        "`segment_ids` for a torch module; docs/models.md); or set data.packing=false")


def _plan(config: Config, derived: Derived, model: ModelDef, spec: DataSpec, policy: Policy,
          pinned_partition: tuple[int, ...] | None) -> PipelinePlan:
    def abstract() -> tuple[dict, dict]:
        """The model's abstract params and one pipeline microbatch's abstract batch."""
        return (jax.eval_shape(lambda: init_variables(model, jax.random.PRNGKey(0), policy)[0]),
                spec.abstract_batch((derived.pipeline_microbatch_size,)))

    def measure():
        return measure_block_costs(model.blocks, *abstract(), config.model.loss, policy,
                                   split_backward=config.parallel.pipeline.splits_backward())

    def count_work(schedule, partition, remat):
        return pipeline_work(model.blocks, *abstract(), config.model.loss, policy, schedule, partition, remat,
                             model.reports)

    def count_residual_bytes(partition, stash):
        return residual_bytes(model.blocks, *abstract(), config.model.loss, policy, partition, stash, model.reports)

    def as_process_0_chose(partition: tuple[int, ...]) -> tuple[int, ...]:
        """Every process measures the costs on its own devices, and one kind's may cut the blocks differently."""
        return tuple(json.loads(as_primary_has_it("pipeline_partition", json.dumps(partition))))

    return plan_pipeline(config.parallel.pipeline, derived.stages, derived.pipeline_microbatches,
                         model.blocks.layers, measure, count_work, count_residual_bytes,
                         derived.microbatches * derived.pipeline_microbatches, pinned_partition, as_process_0_chose)
