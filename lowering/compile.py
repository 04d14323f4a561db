"""The one place where step functions meet jit: shardings, donation, ahead-of-time compilation, and the
per-shape executable cache that counts, times and explains every (re)compilation."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import jax
from jax.sharding import NamedSharding
from xlatrain.custom_calls.ops.matmul import dense_matmuls
from xlatrain.lowering.xla_options import compiler_options

from xlatrain.compat.monitoring import backend_compile_listener
from xlatrain.errors import UserError
from xlatrain.runtime.platform import compiling_for


@dataclass
class CompileLog:
    """Every XLA compilation seen while it is installed: (function name, seconds, phase of the run)."""

    events: list[tuple[str, float, str]] = field(default_factory=list)
    current_phase: str = "other"
    cache_hits: int = 0
    """Of the events, executables loaded from the persistent compilation cache (trainer.compile_cache)."""

    def count(self, name: str | None = None) -> int:
        return sum(1 for fun, _, _ in self.events if name is None or fun in (name, f"jit({name})"))

    def seconds(self) -> float:
        return sum(secs for _, secs, _ in self.events)

    def by_phase(self) -> dict[str, int]:
        return dict(Counter(phase for _, _, phase in self.events))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Compilations inside are counted under `name` (e.g. "set-up", "checkpoints")."""
        outer, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = outer

    def listening(self):
        return backend_compile_listener(lambda fun, secs: self.events.append((fun, secs, self.current_phase)),
                                        self._count_cache_hit)

    def _count_cache_hit(self) -> None:
        self.cache_hits += 1


@dataclass(frozen=True)
class CompiledStep:
    lowered: Any
    compiled: Any
    compile_seconds: float

    def __call__(self, *args):
        return self.compiled(*args)


def compile_step(fn: Callable, abstract_args: tuple, in_shardings: tuple, out_shardings: Any,
                 donate_argnums: tuple[int, ...] = (), cpu_matmul: str = "xla") -> CompiledStep:
    """Lower `fn` from abstract shapes with explicit shardings and compile it once, ahead of time; the dense layers'
    float32 matmuls run on `cpu_matmul` (runtime.cpu_matmul as the program chose it: "xla" off CPU)."""
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate_argnums)
    platform = next(iter(jax.tree.leaves(in_shardings)[0].device_set)).platform
    start = time.perf_counter()
    with compiling_for(platform), dense_matmuls(cpu_matmul):
        lowered = jitted.lower(*abstract_args)
        compiled = lowered.compile(compiler_options(platform) or None)
    return CompiledStep(lowered, compiled, time.perf_counter() - start)


def compile_train_step(train_step: Callable, abstract_state: Any, state_shardings: Any,
                       abstract_batch: Any, batch_sharding: NamedSharding, cpu_matmul: str = "xla") -> CompiledStep:
    """train_step(state, batch): state donated and kept in its shardings, metrics replicated."""
    replicated = NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return compile_step(train_step, (abstract_state, abstract_batch), (state_shardings, batch_sharding),
                        (state_shardings, replicated), donate_argnums=(0,), cpu_matmul=cpu_matmul)


def compile_eval_step(eval_step: Callable, abstract_state: Any, state_shardings: Any, abstract_batch: Any,
                      batch_sharding: NamedSharding, cpu_matmul: str = "xla") -> CompiledStep:
    replicated = NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return compile_step(eval_step, (abstract_state, abstract_batch), (state_shardings, batch_sharding),
                        replicated, cpu_matmul=cpu_matmul)


Signature = tuple[tuple[str, tuple[int, ...], Any, Any], ...]


def batch_signature(batch: dict) -> Signature:
    """What decides whether a compiled step accepts a batch: each key's shape, dtype and sharding. (Taken on
    every step: the dtype stays an object, as its name would cost more than the rest together.)"""
    return tuple((key, tuple(value.shape), value.dtype, getattr(value, "sharding", None))
                 for key, value in sorted(batch.items()))


def explain_difference(old: Signature, new: Signature) -> str:
    """Which batch entries changed shape, dtype or sharding between two signatures."""
    before, after = {k: rest for k, *rest in old}, {k: rest for k, *rest in new}
    changes = [f"batch[{k!r}] added" for k in after.keys() - before.keys()]
    changes += [f"batch[{k!r}] removed" for k in before.keys() - after.keys()]
    for key in sorted(before.keys() & after.keys()):
        for label, a, b in zip(("shape", "dtype", "sharding"), before[key], after[key], strict=True):
            if a != b:
                changes.append(f"batch[{key!r}] {label} {_short(a)} -> {_short(b)}")
    return "; ".join(changes) or "same signature"


def _short(value: Any) -> str:
    return str(getattr(value, "spec", value))


FIRST_COMPILATION = "first compilation"


@dataclass(frozen=True)
class CompileRecord:
    step: str
    seconds: float
    cause: str


@dataclass
class CompileBook:
    """Every compilation of the run's steps, with its cause; raises past `budget` compilations."""

    budget: int | None = None
    records: list[CompileRecord] = field(default_factory=list)

    def add(self, record: CompileRecord) -> None:
        self.records.append(record)
        if self.budget is not None and len(self.records) > self.budget:
            raise CompileBudgetExceeded(
                f"trainer.compile_budget={self.budget} exceeded: the steps were compiled {len(self.records)} "
                f"times (the last for {self.records[-1].cause}); pad inputs to fewer shapes (data.buckets) or "
                "raise trainer.compile_budget (every cause: xlatrain report RUN_DIR)")


class CompileBudgetExceeded(UserError):
    """More step compilations than trainer.compile_budget allows."""


class StepExecutables:
    """One compiled executable per batch signature of a step. The first is compiled ahead of time for
    the nominal batch; any later one is a recompile, recorded with what changed."""

    def __init__(self, name: str, compile_for: Callable[[dict], CompiledStep], nominal_batch: dict,
                 book: CompileBook):
        self.name = name
        self._compile_for = compile_for
        self._book = book
        self._nominal = batch_signature(nominal_batch)
        self._by_signature: dict[Signature, CompiledStep] = {}
        self.executions = 0
        self.first = self._compile(self._nominal, nominal_batch, FIRST_COMPILATION)

    def __call__(self, state: Any, batch: dict) -> Any:
        signature = batch_signature(batch)
        executable = self._by_signature.get(signature)
        if executable is None:
            abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
            executable = self._compile(signature, abstract, explain_difference(self._nominal, signature))
        self.executions += 1
        return executable(state, batch)

    def _compile(self, signature: Signature, abstract_batch: dict, cause: str) -> CompiledStep:
        executable = self._compile_for(abstract_batch)
        self._by_signature[signature] = executable
        self._book.add(CompileRecord(self.name, executable.compile_seconds, cause))
        return executable
