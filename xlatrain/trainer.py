"""The training loop: dispatch step N, then read step N-1's metrics; host work only at step boundaries."""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np
from tqdm import tqdm

from xlatrain.checkpoint import Checkpoints
from xlatrain.config import Config
from xlatrain.data.loader import DeviceLoader, eval_batches, make_global, split_microbatches, train_iterator
from xlatrain.distributed import is_primary
from xlatrain.lowering.compile import CompileLog
from xlatrain.mesh import eval_batch_sharding, train_batch_sharding
from xlatrain.metrics import DiscardedMetrics, MetricsWriter
from xlatrain.program import Program, build_program
from xlatrain.run_dir import prepare_run_dir
from xlatrain.state import with_shardings


class NonFiniteLoss(Exception):
    """The loss or gradient norm became inf/NaN with trainer.on_nonfinite=stop."""


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    interrupted: bool = False
    compile_log: CompileLog = field(default_factory=CompileLog)


def train(config: Config, *, devices: list | None = None, echo: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) a run. In a multi-process run only process 0 prints and writes logs."""
    if not is_primary():
        echo = _silent
    compile_log = CompileLog()
    with compile_log.listening():
        program = build_program(config, devices)
        run_dir = prepare_run_dir(config, program.derived)
        _describe(program, run_dir, echo)
        result = _Run(program, run_dir, echo, compile_log).execute()
    return result


def _silent(_: str) -> None:
    pass


def _describe(program: Program, run_dir: Path, echo: Callable[[str], None]) -> None:
    d = program.derived
    echo(f"xlatrain: {program.config.name} -> {run_dir}")
    echo(f"  devices {d.devices} ({jax.devices()[0].platform}), data-parallel {d.data_parallel}, "
         f"strategy {program.config.parallel.strategy}, params {program.param_count:,}")
    echo(f"  global batch {d.global_batch} = {d.data_parallel} replicas x {d.per_replica_batch}, "
         f"{d.microbatches} microbatch(es) of {d.microbatch_size}; effective lr {d.effective_lr:.3g} "
         f"({program.config.optimizer.lr_scaling} scaling x{d.lr_scale:.3g})")


@contextmanager
def _stop_signals() -> Iterator[list[int]]:
    """SIGTERM/SIGINT only set a flag; the loop saves a checkpoint at the next boundary and exits."""
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Run:
    def __init__(self, program: Program, run_dir: Path, echo: Callable[[str], None], compile_log: CompileLog):
        self.program = program
        self.config = program.config
        self.trainer = program.config.trainer
        self.echo = echo
        self.run_dir = run_dir
        self.checkpoints = Checkpoints(run_dir / "checkpoints", self.trainer.keep_checkpoints)
        self.compile_log = compile_log

    def execute(self) -> TrainResult:
        state, data_state, start = self._initial_state()
        result = TrainResult(self.run_dir, start, start, compile_log=self.compile_log)
        if start >= self.trainer.steps:
            self.echo(f"  already at step {start} of trainer.steps={self.trainer.steps}; nothing to do")
            self.checkpoints.close()
            return result
        loader = self._loader(data_state)
        metrics_writer = (MetricsWriter(self.run_dir, resume_step=start if start else None) if is_primary()
                          else DiscardedMetrics())
        evaluation = self._eval_batches()
        train_step, eval_step = self.program.train_step, self.program.eval_step
        self.echo(f"  compiled train step in {train_step.compile_seconds:.1f}s; training steps {start}..."
                  f"{self.trainer.steps}")
        bar = tqdm(total=self.trainer.steps, initial=start, disable=not (self.trainer.progress and is_primary()),
                   unit="step", dynamic_ncols=True)
        clock = _Throughput(self.program, start)
        step, pending, last_saved = start, None, start
        try:
            with _stop_signals() as stop:
                while step < self.trainer.steps and not stop:
                    batch = next(loader)
                    state, metrics = train_step(state, batch)
                    step += 1
                    if pending is not None:
                        self._record(*pending, result, metrics_writer, bar, clock)
                    pending = (step, metrics)
                    if step % self.trainer.eval_every == 0 or step == self.trainer.steps:
                        self._evaluate(step, state, eval_step, evaluation, result, metrics_writer)
                    if step % self.trainer.checkpoint_every == 0 or step == self.trainer.steps or stop:
                        # Check this step's loss first: a non-finite state must never become a checkpoint.
                        self._record(*pending, result, metrics_writer, bar, clock)
                        pending = None
                        self.checkpoints.save(step, state, loader.state())
                        last_saved = step
                if pending is not None:
                    self._record(*pending, result, metrics_writer, bar, clock)
                if stop and last_saved != step:
                    self.checkpoints.save(step, state, loader.state())
                result.interrupted = bool(stop)
        finally:
            bar.close()
            loader.close()
            metrics_writer.close()
            self.checkpoints.close()
        result.final_step = step
        self.echo(f"  {'stopped by signal' if result.interrupted else 'finished'} at step {step}; "
                  f"checkpoint and metrics in {self.run_dir}")
        return result

    def _initial_state(self) -> tuple[Any, dict | None, int]:
        latest = self.checkpoints.latest_step()
        if latest is None:
            return self.program.create_state(), None, 0
        abstract = with_shardings(self.program.abstract_state, self.program.specs, self.program.mesh)
        state, data_state = self.checkpoints.restore(latest, abstract)
        self.echo(f"  resuming from checkpoint at step {latest}")
        return state, data_state, latest

    def _loader(self, data_state: dict | None) -> DeviceLoader:
        d = self.program.derived
        host = train_iterator(self.program.dataset.train, seed=self.config.seed, shuffle=self.config.data.shuffle,
                              local_batch=d.global_batch // jax.process_count(),
                              process_index=jax.process_index(), process_count=jax.process_count())
        if data_state is not None:
            host.set_state(data_state)
        shapes = {k: v.shape for k, v in self.program.train_batch_shapes().items()}
        sharding = train_batch_sharding(self.program.mesh)
        to_device = lambda b: make_global(split_microbatches(b, d.microbatches), sharding, shapes)  # noqa: E731
        return DeviceLoader(host, to_device, self.config.data.prefetch)

    def _eval_batches(self) -> list[dict]:
        shapes = {k: v.shape for k, v in self.program.eval_batch_shapes().items()}
        sharding = eval_batch_sharding(self.program.mesh)
        host = eval_batches(self.program.dataset.eval, local_batch=self.program.derived.global_batch
                            // jax.process_count(), max_batches=self.trainer.eval_batches,
                            process_index=jax.process_index(), process_count=jax.process_count())
        return [make_global(b, sharding, shapes) for b in host]

    def _record(self, step: int, metrics: dict, result: TrainResult, writer: MetricsWriter | DiscardedMetrics,
                bar: tqdm, clock: _Throughput) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        finite = bool(values.pop("finite"))
        if not finite:
            if self.trainer.on_nonfinite == "stop":
                raise NonFiniteLoss(
                    f"non-finite loss at step {step} (loss={values['loss']}, grad_norm={values['grad_norm']}); "
                    "lower optimizer.lr, enable optimizer.clip_norm, or set trainer.on_nonfinite=skip to "
                    "skip such updates")
            self.echo(f"  step {step}: non-finite loss, update skipped (trainer.on_nonfinite=skip)")
        result.losses[step] = values["loss"]
        bar.set_postfix(loss=f"{values['loss']:.4f}", **clock.rates(step), refresh=False)
        bar.update(1)
        if step % self.trainer.log_every == 0 or step == self.trainer.steps:
            writer.write({"step": step, **values, **clock.rates(step, numeric=True), "skipped": not finite})

    def _evaluate(self, step: int, state: Any, eval_step: Any, batches: list[dict], result: TrainResult,
                  writer: MetricsWriter | DiscardedMetrics) -> None:
        if not batches:
            return
        outputs = jax.device_get([eval_step(state, b) for b in batches])
        record = {k: float(np.mean([o[k] for o in outputs])) for k in outputs[0]}
        result.eval_losses[step] = record["eval_loss"]
        writer.write({"step": step, **record})
        self.echo(f"  step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in record.items()))


class _Throughput:
    """Samples (and tokens) per second over the steps since the last report."""

    def __init__(self, program: Program, step: int):
        spec = program.dataset.spec
        self.samples = program.derived.global_batch
        self.tokens = self.samples * spec.input_shape[0] if spec.input_dtype.kind in "iu" else 0
        self.mark = (step, time.perf_counter())
        self.last: dict[str, float] = {}

    def rates(self, step: int, numeric: bool = False) -> dict[str, Any]:
        then_step, then = self.mark
        now = time.perf_counter()
        if step - then_step >= 5 or not self.last:
            seconds = max(now - then, 1e-9)
            self.last = {"samples_per_sec": self.samples * (step - then_step) / seconds}
            if self.tokens:
                self.last["tokens_per_sec"] = self.tokens * (step - then_step) / seconds
            self.mark = (step, now)
        if numeric:
            return {k: round(v, 2) for k, v in self.last.items()}
        return {k.replace("_per_sec", "/s"): f"{v:,.0f}" for k, v in self.last.items()}
