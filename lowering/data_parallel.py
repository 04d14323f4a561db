"""How a step runs over the mesh: parallel.mode (one global program, or one device's program through shard_map or
pmap) x parallel.strategy (replicated, zero1, fsdp) over the `data` axis. A pipeline adds the `stage` axis
(lowering/pipeline/parallel.py); the program (xlatrain/program.py) asks the same questions of either."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from xlatrain.lowering.context_link import context_group
from xlatrain.lowering.expert_link import expert_group
from xlatrain.lowering.grad_sync import (
    ExplicitReplicas,
    PartitionedReplicas,
    explicit_replicas,
)
from xlatrain.lowering.preference import objective_of
from xlatrain.lowering.step import SplitTrees, make_eval_step
from xlatrain.lowering.tensor_link import partial_gradients, split_over_tensor, summed_over_tensor, tensor_group

from xlatrain.compat.mapping import pmap_over_rows, shard_map
from xlatrain.config import Config, Derived
from xlatrain.errors import UserError
from xlatrain.mesh import (
    CONTEXT,
    DATA,
    EXPERT,
    TENSOR,
    per_replica,
    tensor_size,
    train_batch_sharding,
)
from xlatrain.models.context import inside_context_group
from xlatrain.models.interface import ModelDef
from xlatrain.models.lora import RANK_AXIS
from xlatrain.models.moe import inside_expert_group
from xlatrain.muon import MatrixOwners
from xlatrain.pipeline.plan import PipelinePlan
from xlatrain.pipeline.remat import RematChoice
from xlatrain.precision import Policy
from xlatrain.runtime.device_memory import DeviceMemory
from xlatrain.sharding import (
    ActivationLayout,
    activations_laid_out,
    dim_over,
    named,
    param_specs,
    rules_over,
    spec_at_path,
    tensor_undivided,
)
from xlatrain.state import TrainState, split_axes, state_specs
from xlatrain.tensor_group import TensorGroup, inside_tensor_group

Replicas = PartitionedReplicas | ExplicitReplicas


@dataclass(frozen=True)
class DataParallel:
    """Data parallelism alone: every device holds the whole model (or, with fsdp, a block of each parameter)."""

    config: Config
    derived: Derived
    mesh: Mesh
    model: ModelDef
    policy: Policy

    @property
    def block_axes(self) -> int:
        """Leading axes of a BlockStack's stacked parameters: [layers, ...]."""
        return 0 if self.model.blocks is None else 1

    @property
    def arrange(self) -> Callable[[Any], Any] | None:
        """How the model's params are laid out for training; None: as the model makes them."""
        return None

    @property
    def pipeline(self) -> PipelinePlan | None:
        """The run's pipeline (lowering/pipeline/parallel.py), if it has one."""
        return None

    @property
    def partition(self) -> tuple[int, ...] | None:
        """Blocks per pipeline chunk (pipelines only)."""
        return None

    @property
    def gradients_synchronised(self) -> bool:
        """Whether the update sums gradients across devices."""
        return True

    def state_specs(self, init: Callable[[], TrainState], tx: optax.GradientTransformation,
                    ) -> tuple[TrainState, TrainState]:
        """(abstract state, its PartitionSpecs) from the model's logical axes and parallel.logical_rules; a
        parameter that the rules split over `tensor` and mesh.tensor does not divide is refused."""
        abstract, specs = state_specs(init, self.model, tx, self.config.parallel.strategy, self._rules(), self.mesh)
        check_tensor_split(self.config, abstract.params, self.model.logical_axes, self._rules(), self.mesh)
        return abstract, specs

    def param_count(self, params: Any) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))

    def param_split_specs(self, params: Any) -> Any:
        """Per abstract param, its PartitionSpec when split over `data` (zero1's optimizer state, fsdp's params),
        and over `tensor` where the rules say so."""
        return param_specs(params, self.model.logical_axes, rules_over(self._rules(), (TENSOR, DATA)), self.mesh)

    def tensor_specs(self, params: Any) -> Any:
        """Per abstract param, its PartitionSpec over `tensor` alone."""
        return param_specs(params, self.model.logical_axes, rules_over(self._rules(), (TENSOR,)), self.mesh)

    @property
    def tensor_inside(self) -> bool:
        """Whether a tensor group meets inside the per-device program, through collectives written out
        (xlatrain/tensor_group.py), rather than through XLA's partitioner."""
        return self.config.parallel.mode != "jit" and tensor_size(self.mesh) > 1

    def matrix_owners(self) -> MatrixOwners | None:
        """Where Muon orthogonalises each hidden matrix: in one global program, whole on one of the devices that
        hold its momentum's shards (xlatrain/muon.py); in a per-device program, on the device that holds it."""
        if self.config.parallel.mode != "jit" or self.model.logical_axes is None:
            return None
        rules = rules_over(self._rules(), split_axes(self.config.parallel.strategy, "optimizer"))
        return MatrixOwners(self.mesh, spec_at_path(self.model.logical_axes, rules, self.mesh))

    def choose_remat(self, memory: DeviceMemory, most_bytes_with_residuals: Callable[[], int]) -> RematChoice | None:
        """How a pipeline's backward gets its residuals; nothing to choose without one."""
        return None

    def replicas(self, params: Any) -> Replicas:
        """How the step's replicas meet (lowering/grad_sync.py): XLA's partitioner (parallel.mode=jit), or
        written out in the per-device program; `params`: the abstract params."""
        if self.config.parallel.mode == "jit":
            inner_regions = self.config.mesh.context > 1 or self.config.mesh.expert > 1
            return PartitionedReplicas(self.derived.data_parallel, lambda tree: per_replica(self.mesh, tree),
                                       DATA if inner_regions else None)
        c, strategy = self.config.collectives, self.config.parallel.strategy
        complete = None
        if self.tensor_inside:
            complete = summed_over_tensor(self._tensor_group(), partial_gradients(
                self.tensor_specs(params), self.model.logical_axes, (*(self.derived.tensor_whole or ()), RANK_AXIS),
                self.config.parallel.sequence_parallel))
        return explicit_replicas(DATA, self.derived.data_parallel, c.bucket_bytes, c.impl, c.timeout_s,
                                 self._split_dims(params) if strategy in ("zero1", "fsdp") else None,
                                 across_processes=c.impl == "custom" and self._data_axis_processes() > 1,
                                 params_split=strategy == "fsdp", complete=complete, context=self.config.mesh.context,
                                 expert=self.config.mesh.expert,
                                 expert_leaves=self._expert_leaves(params) if self._experts_inside else None)

    def per_device(self, step: Any, specs: TrainState, out_specs: Any = None, steps: int | None = None,
                   batch_spec: P | None = None) -> Any:
        """parallel.mode=shard_map or pmap: the step as written is one device's program over its rows."""
        mode = self.config.parallel.mode
        batch_spec = batch_spec or train_batch_sharding(self.mesh, steps or self.config.trainer.steps_per_sync).spec
        if self.config.mesh.expert > 1:  # an expert group's devices hold each their share of the replica's rows
            batch_spec = P(*[(DATA, EXPERT) if entry == DATA else entry for entry in batch_spec])
        if mode == "shard_map":
            return shard_map(self._in_groups(step), self.mesh, in_specs=(specs, batch_spec),
                             out_specs=(specs, P()) if out_specs is None else out_specs)
        if mode == "pmap":
            return pmap_over_rows(step, DATA, list(self.mesh.devices.ravel()), rows_axis=len(batch_spec) - 1)
        return self._laid_out(step)

    def gather_params(self, params: Any) -> Callable[[Any], Any]:
        """params -> the whole params compute reads: FSDP keeps them sharded at rest and gathers them; other
        strategies store them whole. `params`: the abstract params."""
        return self._gather_whole(params) if self.config.parallel.strategy == "fsdp" else _as_they_are

    def gradient_parts(self, remat: str, params: Any) -> dict[str, Any]:
        """What make_train_step needs beside the model's own gradients: without a pipeline, the norms of trees
        split over a tensor group inside the per-device program."""
        return {"trees": self._split_trees(params)} if self.tensor_inside or self._experts_inside else {}

    def eval_step(self, specs: TrainState, params: Any) -> Callable[[TrainState, dict], dict]:
        """One global program over the whole eval batch."""
        return self._laid_out(make_eval_step(self.model, objective_of(self.config.model), self.policy,
                                             self.gather_params(params)), rows_on=DATA)

    def _laid_out(self, step: Callable, rows_on: str | None = None) -> Callable:
        """One global program's step with its activations split over `tensor` as the rules (and
        parallel.sequence_parallel) say, and along the sequence over `context`, while it is traced; the step as it
        is without either axis. `rows_on`: the mesh axis the activations' rows are on where no vmap over replicas
        places them (the eval step's)."""
        if tensor_size(self.mesh) == 1 and self.config.mesh.context == 1 and self.config.mesh.expert == 1:
            return step
        layout = ActivationLayout.of(self.mesh, self._rules(), self.config.parallel.sequence_parallel,
                                     self.config.parallel.context_attention, rows_on)
        return _traced_within(lambda: activations_laid_out(layout), step)

    def _in_groups(self, step: Callable) -> Callable:
        """A per-device step whose models' regions meet through the tensor group, and whose attention meets the
        rest of the sequence through the context group, while it is traced."""
        c, context = self.config.collectives, self.config.mesh.context
        tensor = self._tensor_group() if self.tensor_inside else None
        group = (context_group(context, self.config.parallel.context_attention, c.impl, c.timeout_s)
                 if context > 1 else None)
        experts = expert_group(self.config.mesh.expert, c.impl, c.timeout_s) if self._experts_inside else None
        if tensor is None and group is None and experts is None:
            return step

        @contextlib.contextmanager
        def inside():
            with inside_tensor_group(tensor), inside_context_group(group), inside_expert_group(experts):
                yield

        return _traced_within(inside, step)

    def _tensor_group(self) -> TensorGroup:
        c = self.config.collectives
        return tensor_group(tensor_size(self.mesh), self.config.parallel.sequence_parallel, c.impl, c.timeout_s)

    def _split_trees(self, params: Any, leading: Any = None, sums: dict | None = None,
                     gather: Callable[[Any], Any] | None = None) -> SplitTrees:
        """Norms of param-shaped trees whose leaves split over a tensor group inside the per-device program are
        summed over it; `leading`: per leaf the mesh axes it is split over besides (a pipeline's blocks over
        `stage`), summed by `sums`."""
        own = self._expert_leaves(params) if self._experts_inside else jax.tree.map(lambda _: False, params)
        over = jax.tree.map(lambda spec, mine: ((TENSOR,) if self.tensor_inside and split_over_tensor(spec) else ())
                            + ((EXPERT,) if mine else ()), self.tensor_specs(params), own, is_leaf=_is_spec)
        if leading is not None:
            over = jax.tree.map(lambda first, rest: first + rest, leading, over, is_leaf=lambda x: isinstance(x, tuple))
        sums = {**(sums or {}), **({TENSOR: self._tensor_group().all_reduce} if self.tensor_inside else {}),
                **({EXPERT: self._expert_sum()} if self._experts_inside else {})}
        return SplitTrees(over, sums, gather or _as_they_are)

    @property
    def _experts_inside(self) -> bool:
        """Whether an expert group meets inside the per-device program (rather than in a global program's MoE
        regions)."""
        return self.config.parallel.mode != "jit" and self.config.mesh.expert > 1

    def _expert_leaves(self, params: Any) -> Any:
        """Per param, whether each device holds its own part of it over `expert` (an MoE layer's experts)."""
        specs = param_specs(params, self.model.logical_axes, rules_over(self._rules(), (EXPERT,)), self.mesh)
        return jax.tree.map(lambda spec: dim_over(spec, EXPERT) is not None, specs, is_leaf=_is_spec)

    def _expert_sum(self) -> Callable[[jax.Array], jax.Array]:
        c = self.config.collectives
        if c.impl != "custom":
            return lambda x: jax.lax.psum(x, EXPERT)
        from xlatrain import custom_calls as ops

        return lambda x: ops.all_reduce(x, EXPERT, timeout_s=c.timeout_s)

    def _gather_whole(self, params: Any) -> Callable[[Any], Any]:
        """In one global program the partitioner gathers what a sharding constraint asks for: each param whole
        over `data`, still split over `tensor` where the rules say so."""
        compute_specs = self.tensor_specs(params)
        return lambda tree: jax.lax.with_sharding_constraint(tree, named(self.mesh, compute_specs))

    def _split_dims(self, params: Any) -> Any:
        """Per param, the dimension its optimizer state (and with FSDP the param) is split along over `data`
        (None: not split)."""
        return jax.tree.map(lambda spec: dim_over(spec, DATA), self.param_split_specs(params),
                            is_leaf=lambda x: isinstance(x, P))

    def _data_axis_processes(self) -> int:
        from xlatrain.custom_calls.backend import processes_along

        return processes_along(self.mesh, DATA)

    def _rules(self) -> dict:
        """parallel.logical_rules over the model's own, less `tensor` for the names a tensor group keeps whole; in
        one global program with context or expert parallelism, what they split over `data` split over `data` x
        `expert` x `context` (fsdp's params and zero1's and fsdp's optimizer state: the devices of a context or
        expert group hold the same params, as a data replica's would, but for each expert's own)."""
        whole = self.derived.tensor_whole or ()
        jit, mesh = self.config.parallel.mode == "jit", self.config.mesh
        over_data = (DATA, *((EXPERT,) if jit and mesh.expert > 1 else ()), *((CONTEXT,) if jit and mesh.context > 1
                                                                              else ()))
        return {name: tuple(spread for axis in axes if name not in whole or axis != TENSOR
                            for spread in (over_data if axis == DATA else (axis,)))
                for name, axes in self.model.rules(self.config.parallel.logical_rules).items()}


def check_tensor_split(config: Config, abstract_params: Any, logical_axes: Any, rules: dict, mesh: Mesh) -> None:
    """Tensor parallelism splits what the rules name, never replicating a dimension silently: one it does not
    divide, or a model it splits nothing of, is refused."""
    tensor = tensor_size(mesh)
    if tensor == 1:
        return
    undivided = tensor_undivided(abstract_params, logical_axes, rules, mesh)
    if undivided:
        hint = " (model.vocab_multiple rounds the vocabulary up)" if "(vocab:" in undivided[0] else ""
        raise UserError(f"config: mesh.tensor={tensor} does not divide {undivided[0]}{hint}, which "
                        "parallel.logical_rules split over the tensor axis: choose a mesh.tensor that divides it, or "
                        "take `tensor` out of that logical name's rule")
    specs = param_specs(abstract_params, logical_axes, rules_over(rules, (TENSOR,)), mesh)
    if not any(split_over_tensor(spec) for spec in jax.tree.leaves(specs, is_leaf=_is_spec)):
        raise UserError(f"config: mesh.tensor={tensor} splits no parameter of {config.model.named()}: its logical "
                        "names map to no `tensor` axis in parallel.logical_rules (a built-in decoder's heads, mlp and "
                        "vocab do); map some there, or set mesh.tensor=1")


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _traced_within(context: Callable[[], Any], step: Callable) -> Callable:
    """`step`, traced inside `context()`."""

    @functools.wraps(step)
    def within(*args):
        with context():
            return step(*args)

    return within


def _as_they_are(params: Any) -> Any:
    return params
