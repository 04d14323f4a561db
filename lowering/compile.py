"""The one place where step functions meet jit: shardings, donation, and ahead-of-time compilation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from xlatrain import compat


@dataclass
class CompileLog:
    """Every XLA compilation seen while it is installed: (function name, seconds)."""

    events: list[tuple[str, float]] = field(default_factory=list)

    def count(self, name: str | None = None) -> int:
        return sum(1 for fun, _ in self.events if name is None or fun in (name, f"jit({name})"))

    def listening(self):
        return compat.backend_compile_listener(lambda fun, secs: self.events.append((fun, secs)))


@dataclass(frozen=True)
class CompiledStep:
    lowered: Any
    compiled: Any
    compile_seconds: float

    def __call__(self, *args):
        return self.compiled(*args)


def compile_step(fn: Callable, abstract_args: tuple, in_shardings: tuple, out_shardings: Any,
                 donate_argnums: tuple[int, ...] = ()) -> CompiledStep:
    """Lower `fn` from abstract shapes with explicit shardings and compile it once, ahead of time."""
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate_argnums)
    start = time.perf_counter()
    lowered = jitted.lower(*abstract_args)
    compiled = lowered.compile()
    return CompiledStep(lowered, compiled, time.perf_counter() - start)


def compile_train_step(train_step: Callable, abstract_state: Any, state_shardings: Any,
                       abstract_batch: Any, batch_sharding: NamedSharding) -> CompiledStep:
    """train_step(state, batch): state donated and kept in its shardings, metrics replicated."""
    replicated = NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return compile_step(train_step, (abstract_state, abstract_batch), (state_shardings, batch_sharding),
                        (state_shardings, replicated), donate_argnums=(0,))


def compile_eval_step(eval_step: Callable, abstract_state: Any, state_shardings: Any, abstract_batch: Any,
                      batch_sharding: NamedSharding) -> CompiledStep:
    replicated = NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return compile_step(eval_step, (abstract_state, abstract_batch), (state_shardings, batch_sharding),
                        replicated)
