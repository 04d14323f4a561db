"""Config -> mesh -> data -> model + state -> the lowered steps: everything a run needs, built once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import numpy as np
import optax

from xlatrain.config import Config, Derived, derive
from xlatrain.data.sources import Dataset, open_dataset
from xlatrain.lowering.compile import CompiledStep, compile_eval_step, compile_train_step
from xlatrain.lowering.step import make_eval_step, make_train_step
from xlatrain.mesh import build_mesh, eval_batch_sharding, replicated, train_batch_sharding
from xlatrain.models import model_factory
from xlatrain.optim import build_optimizer, learning_rate_schedule
from xlatrain.sharding import named
from xlatrain.state import (
    ModelDef,
    TrainState,
    create_state,
    describe_model,
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

    @property
    def state_shardings(self) -> TrainState:
        return named(self.mesh, self.specs)

    @property
    def param_count(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.abstract_state.params))

    def train_batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """[microbatches, rows per microbatch, ...] per key, rows sharded over `data`."""
        d = self.derived
        return self._batch_shapes((d.microbatches, d.microbatch_size), train_batch_sharding(self.mesh))

    def eval_batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        return self._batch_shapes((self.derived.global_batch,), eval_batch_sharding(self.mesh))

    def _batch_shapes(self, rows: tuple[int, ...], sharding) -> dict[str, jax.ShapeDtypeStruct]:
        spec = self.dataset.spec
        return {"inputs": jax.ShapeDtypeStruct((*rows, *spec.input_shape), spec.input_dtype, sharding=sharding),
                "targets": jax.ShapeDtypeStruct((*rows, *spec.target_shape), spec.target_dtype, sharding=sharding)}

    @cached_property
    def train_step(self) -> CompiledStep:
        fn = make_train_step(self.model, self.tx, self.schedule, self.config.model.loss,
                             skip_nonfinite=self.config.trainer.on_nonfinite == "skip",
                             compute_params=self._gather_params)
        return compile_train_step(fn, self._abstract_sharded_state(), self.state_shardings,
                                  self.train_batch_shapes(), train_batch_sharding(self.mesh))

    @cached_property
    def eval_step(self) -> CompiledStep:
        fn = make_eval_step(self.model, self.config.model.loss)
        return compile_eval_step(fn, self._abstract_sharded_state(), self.state_shardings,
                                 self.eval_batch_shapes(), eval_batch_sharding(self.mesh))

    def create_state(self) -> TrainState:
        state = create_state(self.init, self.specs, self.mesh)
        verify_replicas_identical(state, self.specs, self.mesh)
        return state

    def _gather_params(self, params: Any) -> Any:
        """FSDP keeps params sharded at rest and gathers them for compute; other strategies store them whole."""
        if self.config.parallel.strategy != "fsdp":
            return params
        return jax.lax.with_sharding_constraint(params, jax.tree.map(lambda _: replicated(self.mesh), params))

    def _abstract_sharded_state(self) -> TrainState:
        return with_shardings(self.abstract_state, self.specs, self.mesh)


def build_program(config: Config, devices: list | None = None) -> Program:
    devices = jax.devices() if devices is None else devices
    derived = derive(config, devices)
    mesh = build_mesh(config, devices)
    dataset = open_dataset(config.data)
    factory = model_factory(config.model, dataset.spec)
    model = describe_model(factory)
    schedule = learning_rate_schedule(config.optimizer, derived, config.trainer.steps)
    tx = build_optimizer(config.optimizer, schedule)
    init = make_init(factory, tx, config.seed)
    abstract, specs = state_specs(init, model, tx, config.parallel.strategy, config.parallel.logical_rules, mesh)
    return Program(config, derived, mesh, dataset, model, tx, schedule, init, abstract, specs)
