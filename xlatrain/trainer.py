"""The training loop: dispatch step N, then read step N-1's metrics; host work only at step boundaries."""

from __future__ import annotations

import contextlib
import datetime
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm import tqdm

from xlatrain.boundaries import Boundary, Hook, StepClosures, call_hook
from xlatrain.callbacks import Callback
from xlatrain.compat.transfers import allow_transfers, forbid_implicit_transfers
from xlatrain.config import DECODERS, Config
from xlatrain.data.identity import check_same_tokenizer, data_change, identity_record
from xlatrain.data.loader import DeviceLoader, device_eval_batches, device_train_loader
from xlatrain.errors import NonFiniteLoss, UserError, first_line, warn
from xlatrain.evaluation.in_loop import InLoopTasks
from xlatrain.lowering.compile import FIRST_COMPILATION, CompileLog
from xlatrain.models.attention import fused_attention_missing
from xlatrain.observe.bottlenecks import BottleneckRules, Finding, Interval, Knobs
from xlatrain.observe.peaks import peak_per_device
from xlatrain.observe.profiling import ProfileWindow
from xlatrain.observe.summary import SUMMARY_FILE, RunSummary
from xlatrain.observe.throughput import Throughput
from xlatrain.observe.time_breakdown import TimeBreakdown, fractions
from xlatrain.observe.trackers import hyperparameters_of, open_trackers
from xlatrain.phases import (
    CHECKPOINTING,
    COMPILING_STEPS,
    CREATING_STATE,
    EVALUATING,
    IN_A_HOOK,
    LOADING_DATA,
    SETTING_UP,
    TRAINING,
    WAITING_FOR_THE_DEVICE,
    Phases,
)
from xlatrain.program import Program, build_program
from xlatrain.run.checkpoints import CheckpointNotWritten, Checkpoints, Restored, read_checkpoint
from xlatrain.run.directory import (
    CHECKPOINTS_DIR,
    RunDirHold,
    check_run_dir,
    check_still_there,
    directory_identity,
    exclusive_run_dir,
    open_run_dir,
    pinned_cpu_matmul,
    pinned_partition,
    run_dir_gone,
    save_run_config,
)
from xlatrain.run.metrics import (
    METRICS_FILE,
    DiscardedMetrics,
    MetricsWriter,
    Tracker,
    last_logged,
)
from xlatrain.runtime import cpu_devices
from xlatrain.runtime.distributed import (
    StopAgreement,
    as_primary_has_it,
    check_processes_agree,
    host_name,
    is_primary,
)
from xlatrain.runtime.signals import StopSignals, stop_signals
from xlatrain.runtime.watchdog import watching
from xlatrain.state import with_shardings


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    interrupted: bool = False
    compile_log: CompileLog = field(default_factory=CompileLog)
    summary: RunSummary = field(default_factory=RunSummary)
    stopped_by: str = ""
    """What stopped the run before trainer.steps: "signal", a callback's reason; "" when it finished."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The last step's metrics (loss, accuracy, grad_norm, lr, ...)."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """The last evaluation's (eval_loss, eval_accuracy), with its step under "step"."""


def train(config: Config, *, devices: list | None = None, echo: Callable[[str], None] = print,
          hooks: Sequence[Hook] = (), callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Train (or resume) a run. In a multi-process run only process 0 prints and writes logs.

    Each hook is called with a `Boundary` right after every executable is dispatched; it reads values
    only through `boundary.add_step_closure` (see xlatrain/boundaries.py). Callbacks (xlatrain/callbacks.py) get
    the run's events as host values, and may stop it. A SIGTERM/SIGINT before the first step raises
    StoppedBeforeFirstStep; after it, the run saves a checkpoint and returns (xlatrain/runtime/signals.py)."""
    if not is_primary():
        echo = _silent
    compile_log = CompileLog()
    with stop_signals() as stop, compile_log.listening(), watching(config.distributed, host_name()) as progress:
        phases = Phases(progress, compile_log, TimeBreakdown())
        check_processes_agree(config)
        check_run_dir(config)  # a start refused here writes nothing into the directory, not even its lock
        with exclusive_run_dir(config.run_dir()) as hold:
            config = open_run_dir(config, echo)
            with phases.entered(SETTING_UP):
                program = build_program(config, devices, pinned_partition(config.run_dir()),
                                        pinned_cpu_matmul(config.run_dir()))
            _describe(program, echo)
            return _Run(program, echo, phases, hooks, stop, hold, callbacks).execute()


def _silent(_: str) -> None:
    pass


def _frozen(program: Program) -> str:
    """What of the params trains, where some are frozen (a torch module's requires_grad, LoRA's base)."""
    if program.model.frozen is None:
        return ""
    if program.model.torch is not None:
        return f" ({program.model.torch.describe_frozen()})"
    sizes = [leaf.size for leaf in jax.tree.leaves(program.abstract_state.params)]
    trained = sum(size for size, frozen in zip(sizes, jax.tree.leaves(program.model.frozen), strict=True)
                  if frozen is False)
    return f" ({trained:,} of them in the adapters, which train; the rest frozen)"


def _describe(program: Program, echo: Callable[[str], None]) -> None:
    d = program.derived
    echo(f"xlatrain: {program.config.name} -> {program.config.run_dir()}")
    tensor = program.config.mesh.tensor
    split = "" if tensor == 1 else f", tensor-parallel {tensor}" + (
        " (sequence parallel)" if program.config.parallel.sequence_parallel else "")
    echo(f"  devices {d.devices} ({jax.devices()[0].platform}), data-parallel {d.data_parallel}{split}, "
         f"strategy {program.config.parallel.strategy}, params {program.param_count:,}"
         + _frozen(program))
    missing = (fused_attention_missing(jax.devices()[0].platform, program.policy.compute)
               if isinstance(program.config.model, DECODERS) else None)
    if missing and is_primary():
        warn(missing)
    if cpu_devices.applied is not None and jax.devices()[0].platform == "cpu":
        echo(f"  CPU devices: {cpu_devices.applied.describe()}")
    echo(f"  precision {program.config.precision.policy}: {program.policy.describe()}")
    echo(f"  compile cache {program.compile_cache or 'off'} (trainer.compile_cache)")
    echo(f"  global batch {d.global_batch} = {d.data_parallel} replicas x {d.per_replica_batch}, "
         f"{d.microbatches} microbatch(es) of {d.microbatch_size}; effective lr {d.effective_lr:.3g} "
         f"({program.config.optimizer.lr_scaling} scaling x{d.lr_scale:.3g})")
    if program.pipeline is not None:
        echo(f"  pipeline: {d.stages} stages, each accumulation microbatch cut into {d.pipeline_microbatches} "
             f"pipeline microbatches of {d.pipeline_microbatch_size}")
        remat = program.remat if program.config.parallel.pipeline.remat != "auto" else "auto"
        for line in program.pipeline.summary(remat):
            echo(f"    {line}")


class _Run:
    def __init__(self, program: Program, echo: Callable[[str], None], phases: Phases, hooks: Sequence[Hook],
                 stop: StopSignals, hold: RunDirHold, callbacks: Sequence[Callback] = ()):
        self.program = program
        self.hold = hold
        self.config = program.config
        self.trainer = program.config.trainer
        self.echo = echo
        self.run_dir = program.config.run_dir()
        self.stop = stop
        self.stop_agreement = StopAgreement(stop)
        self.phases = phases
        self.progress = phases.progress
        self.checkpoints = Checkpoints(self.run_dir / CHECKPOINTS_DIR, self.trainer.keep_checkpoints)
        self.progress.newest_checkpoint = self.checkpoints.newest_written
        self.data_identity = identity_record(program.measured.data_examples, program.measured.data_digest,
                                             program.dataset.spec.tokenizer)
        self.compile_log = phases.compile_log
        self.hooks = hooks
        self.callbacks = callbacks
        self.breakdown = phases.breakdown
        self.dispatch_waits = cpu_devices.dispatch_waits_for_the_previous_step(list(program.mesh.devices.flat))
        self.closures = StepClosures(waiting=lambda: self.phases.entered(WAITING_FOR_THE_DEVICE))
        self.summary = RunSummary()
        self.rules = BottleneckRules(_knobs(program), self._say)
        self.lines_instead_of_bar = not self.trainer.shows_bar(sys.stderr.isatty())
        """trainer.progress: a plain line each trainer.log_every steps instead of the progress bar."""
        self._eta = Eta(0, self.trainer.steps, time.perf_counter())
        self._interval_first_step = 1
        self._expert_load: dict[int, tuple[float, float]] = {}
        self.host_to_device_bytes = 0
        self.tasks = None
        if self.trainer.eval_tasks:  # checked before the run starts in its directory
            program = self.program
            self.tasks = InLoopTasks(self.config, program.abstract_state.params, program.dataset.spec,
                                     None if program.pipeline is None else program.pipeline.layout.layer_params)

    def execute(self) -> TrainResult:
        try:
            result = self._execute()
        except BaseException:
            try:  # the error that stopped the run is the one to report; a save it left unfinished is said too
                self.checkpoints.close()
            except CheckpointNotWritten as err:
                warn(str(err))
            except Exception as err:
                warn(f"the checkpoint in flight when the run stopped was not written ({type(err).__name__}: "
                     f"{first_line(err)})")
            raise
        self.checkpoints.close()
        return result

    def _execute(self) -> TrainResult:
        # Before config.yaml is written, so that a refused start leaves no run behind: the trackers first (a server
        # that cannot be reached is said within seconds, not after a compilation), then the steps' memory.
        finished = (self.checkpoints.latest_step() or 0) >= self.trainer.steps
        trackers = [] if finished else self._open_trackers()
        try:
            with self.phases.entered(COMPILING_STEPS):
                self.program.check_steps_fit()
            with self.phases.entered(CREATING_STATE):
                state, data_state, start = self._initial_state()
            save_run_config(self.config, self.program.saved_derived(), self.hold)
            return self._train(state, data_state, start, trackers)
        finally:
            for tracker in trackers:
                tracker.close()

    def _train(self, state: Any, data_state: dict, start: int, trackers: list[Tracker]) -> TrainResult:
        self.run_dir_identity = directory_identity(self.run_dir)
        result = TrainResult(self.run_dir, start, start, compile_log=self.compile_log, summary=self.summary)
        result.metrics, result.eval_metrics = last_logged(self.run_dir / METRICS_FILE, start)  # where a resume begins
        self.summary.start_step = self.summary.final_step = start
        if start >= self.trainer.steps:
            self.echo(f"  already at step {start} of trainer.steps={self.trainer.steps}; nothing to do")
            return result
        loader = self._loader(data_state)
        metrics_writer = (MetricsWriter(self.run_dir, start, self.trainer.loggers, hyperparameters_of(self.config),
                                        trackers) if is_primary() else DiscardedMetrics())
        evaluation = self._eval_batches()
        with self.phases.entered(COMPILING_STEPS):
            train_step, eval_step = self.program.train_step, self.program.eval_step
        k = self.trainer.steps_per_sync
        self.echo(f"  compiled train step in {train_step.first.compile_seconds:.1f}s; training steps {start}..."
                  f"{self.trainer.steps}" + (f", {k} steps per executable" if k > 1 else ""))
        if self.program.remat is not None and self.config.parallel.pipeline.remat == "auto":
            self.echo(f"  pipeline remat {self.program.remat.describe()}")
        bar = tqdm(total=self.trainer.steps, initial=start, disable=self.lines_instead_of_bar or not is_primary(),
                   unit="step", dynamic_ncols=True)
        clock = _throughput(self.program, self._peak_flops(),
                            excluded=lambda: self.breakdown.within["eval"] + self.breakdown.within["checkpoint"])
        loop = _Loop(partial(self._record, result=result, writer=metrics_writer, bar=bar, clock=clock), clock,
                     ProfileWindow(self.trainer.profile_steps, self.run_dir, self.echo), train_step, eval_step,
                     evaluation, loader, metrics_writer, result)
        began = time.perf_counter()
        self._eta = Eta(start, self.trainer.steps, began)
        self.breakdown.start(began)
        self._interval_first_step = start + 1
        if self.program.pipeline is not None:
            self.rules.check_partition(self.program.pipeline.balance, self.program.pipeline.partition_source)
        step = start
        with self.phases.entered(TRAINING):
            try:
                self.stop.begin_loop()
                with forbid_implicit_transfers():
                    stopping = False
                    while step < self.trainer.steps and not stopping:
                        state, step, stopping = self._boundary(loop, state, step)
                    self.closures.run()
                    result.interrupted = stopping
            finally:
                loop.profile.close()
                bar.close()
                loader.close()
                metrics_writer.close()
                self._summarise(step, began)  # also when the run stops on an error: `xlatrain report` shows why
            self.checkpoints.wait_until_written()
        result.final_step = step
        result.stopped_by = self.stop.cause() if result.interrupted else ""
        for line in self.summary.lines(findings_said=True):
            self.echo(f"  {line}")
        self.echo(f"  {final_line(result, self.run_dir)}")
        for callback in self.callbacks:
            callback.on_end(result)
        return result

    def _boundary(self, loop: _Loop, state: Any, step: int) -> tuple[Any, int, bool]:
        """Dispatch the next executable (k fused steps), then the boundary's host work: hooks, the closures of the
        steps before, evaluation, checkpoint and timing where due. (state, its last step, whether to stop)."""
        k = self.trainer.steps_per_sync
        if self.closures.must_run_before_dispatch:
            self.closures.run()
        batch = self._next_batch(loop.loader)
        loop.clock.dispatching(step + 1)
        loop.profile.before_dispatch(step + 1, step + k)
        with self.phases.entered(WAITING_FOR_THE_DEVICE) if self.dispatch_waits else contextlib.nullcontext():
            state, metrics = self._dispatch(loop.train_step, state, batch)
        if self.dispatch_waits:  # the call returned when the step before finished and this one began
            loop.clock.dispatching(step + 1)
        self.closures.will_donate(state)
        first, step = step + 1, step + k
        self.progress.step = step
        boundary = Boundary(first, step, state, metrics, self.closures)
        boundary.add_step_closure(partial(loop.record, first), metrics)
        with self.phases.entered(IN_A_HOOK):
            for hook in self.hooks:
                call_hook(hook, boundary)
        self.closures.run(through_step=first - 1)
        loop.profile.after_boundary(step, state)
        self.summary.boundaries += 1
        stopping = self.stop_agreement.should_stop(self.summary.boundaries)
        last = step == self.trainer.steps
        if self._crossed(self.trainer.eval_every, first, step) or last:
            self._evaluate(step, state, loop.eval_step, loop.evaluation, loop.result, loop.metrics_writer)
        if self.tasks is not None and (self._crossed(self.trainer.eval_tasks_every or self.trainer.eval_every, first,
                                                     step) or last):
            self._evaluate_tasks(step, state, loop.metrics_writer)
        if self._crossed(self.trainer.checkpoint_every, first, step) or last or stopping:
            self.closures.run()  # this step's closures first: a non-finite state must never become a checkpoint
            self._save(step, state, loop.loader)
        if self._crossed(self.trainer.log_every, first, step) or last or stopping:
            self._time_interval(step, loop.metrics_writer, loop.clock,
                                traced=loop.profile.touches(self._interval_first_step, step))
        return state, step, stopping

    def _open_trackers(self) -> list[Tracker]:
        """The trackers of trainer.loggers (process 0's), opened before the run exists in its directory, so that one
        that refuses (a server that cannot be reached, a bad project) leaves the directory as it was; every process
        stops alike."""
        trackers, refusal = [], ""
        if is_primary():
            try:
                trackers = open_trackers(self.config, self.run_dir, hyperparameters_of(self.config))
            except UserError as err:
                refusal = str(err)
        refusal = as_primary_has_it("trackers", refusal)
        if refusal:
            raise UserError(refusal)
        return trackers

    def _peak_flops(self) -> float | None:
        """One device's peak for MFU; said once at the start, with the step's model FLOPs."""
        flops = self.program.measured.model_flops_per_step
        if flops is None:
            self.echo("  model FLOPs per step: not counted (a while loop hides its trip count); no MFU")
            return None
        peak, source = peak_per_device(list(self.program.mesh.devices.flat), self.program.policy.compute.name)
        self.echo(f"  model FLOPs per step {flops:.4g} (matmuls of the forward and backward, counted on the jaxpr); "
                  "peak per device " + (f"{peak / 1e12:.3g} TFLOP/s ({source})" if peak else f"unknown ({source}): "
                                         "no MFU"))
        return peak

    @staticmethod
    def _crossed(every: int, first: int, last: int) -> bool:
        """Whether a multiple of `every` lies in the steps first..last of one boundary."""
        return last // every > (first - 1) // every

    def _next_batch(self, loader: DeviceLoader) -> dict:
        started = time.perf_counter()
        with self.phases.entered(LOADING_DATA):
            batch = next(loader)
        self.summary.data_wait_seconds += time.perf_counter() - started
        return batch

    def _dispatch(self, executable: Any, state: Any, batch: Any) -> Any:
        records = self.program.compile_book.records
        compiled_before, started = len(records), time.perf_counter()
        out = executable(state, batch)
        self.summary.dispatch_seconds += time.perf_counter() - started
        if len(records) > compiled_before:  # a batch signature seen for the first time: compiled inside the call
            self.breakdown.claim("compile", sum(r.seconds for r in records[compiled_before:]))
        return out

    def _save(self, step: int, state: Any, loader: DeviceLoader) -> None:
        check_still_there(self.run_dir, self.run_dir_identity, step)
        # orbax copies the state to the host itself
        with allow_transfers(), self.phases.entered(CHECKPOINTING):
            try:
                self.checkpoints.save(step, state, loader.state(), self.data_identity)
            except CheckpointNotWritten:  # when the directory went away while it was written, that is the reason
                check_still_there(self.run_dir, self.run_dir_identity, step, agreed=False)
                raise
        for callback in self.callbacks:
            callback.on_checkpoint(step, self.checkpoints.directory / str(step))
        self.closures.device_to_host_bytes += sum(x.addressable_data(0).nbytes for x in jax.tree.leaves(state))

    def _summarise(self, step: int, began: float) -> None:
        s = self.summary
        s.final_step = step
        s.wall_seconds = time.perf_counter() - began
        s.compilations, s.compile_seconds = self.compile_log.count(), self.compile_log.seconds()
        s.compilations_by_phase = self.compile_log.by_phase()
        s.compile_cache_hits = self.compile_log.cache_hits
        s.step_compilations = [asdict(r) for r in self.program.compile_book.records]
        s.executions = self.program.train_step.executions + self.program.eval_step.executions
        s.result_wait_seconds = self.closures.wait_seconds
        s.host_to_device_bytes = self.host_to_device_bytes
        s.device_to_host_bytes = self.closures.device_to_host_bytes
        self.breakdown.cut()
        s.time_breakdown = {k: round(v, 4) for k, v in self.breakdown.session.items()}
        s.findings = self.rules.as_records()
        if is_primary() and not run_dir_gone(self.run_dir, self.run_dir_identity):  # else nothing is written there
            try:
                s.append_to(self.run_dir)
            except OSError as err:
                warn(f"{self.run_dir / SUMMARY_FILE} could not be written ({err.strerror or err}); this session's "
                     "summary is only printed")

    def _initial_state(self) -> tuple[Any, dict | None, int]:
        abstract = with_shardings(self.program.abstract_state, self.program.specs, self.program.mesh)
        restored = self.checkpoints.restore_newest_verified(abstract, warn=warn)
        if restored is None and self.trainer.init_from is not None:
            restored = self._from_another_run(abstract)
        elif restored is not None:
            self.echo(f"  resuming from checkpoint at step {restored[1]} (verified)")
        if restored is None:
            state = self.program.create_state()
            self.program.use_reference(state, self.run_dir)
            return state, None, 0
        (state, data_state, trained_on), step = restored
        self.program.use_reference(None, self.run_dir)
        check_same_tokenizer(self.config.data, trained_on, self.data_identity, step)
        change = data_change(self.config.data, trained_on, self.data_identity)
        if change and is_primary():
            warn(f"the data is not what checkpoint {step} was trained on ({change}): the run goes on from step {step} "
                 "on the data as it is now, so it does not continue exactly (the examples it reads next and its "
                 "held-out set may differ); to continue it exactly, put back the data it was trained on")
        return state, data_state, step

    def _from_another_run(self, abstract: Any) -> tuple[Restored, int]:
        """trainer.init_from's checkpoint, restored into this run's layout, for a run with none of its own."""
        directory, step = self.trainer.init_from_step()
        source, what = Path(directory), f"config: trainer.init_from={self.trainer.init_from!r}"
        if not (source / CHECKPOINTS_DIR).is_dir():
            raise UserError(f"{what} names no run directory with checkpoints ({source / CHECKPOINTS_DIR} is not a "
                            "directory): name a directory `xlatrain train` wrote")
        if source.resolve() == self.run_dir.resolve():
            raise UserError(f"{what} is this run's own directory, which resumes from its own checkpoints: drop "
                            "trainer.init_from, or give the new run another trainer.run_dir")
        if getattr(self.config.model, "dpo", None) is not None:
            raise UserError(f"{what}: a DPO run's reference is the policy it starts from, computed in its own run "
                            "directory: export the checkpoint (`xlatrain export RUN_DIR --hf DIR`) and start DPO from "
                            "it with model.init_from=hf:DIR")
        restored, step = read_checkpoint(source, self.trainer.keep_checkpoints, step, what,
                                         lambda checkpoints, step: checkpoints.restore(step, abstract))
        if step >= self.trainer.steps:
            raise UserError(f"{what} starts at step {step}, and trainer.steps={self.trainer.steps} ends there: set "
                            "trainer.steps beyond it")
        self.echo(f"  starting from {source} at its checkpoint of step {step} (verified)")
        return restored, step

    def _loader(self, data_state: dict | None) -> DeviceLoader:
        d = self.program.derived
        return device_train_loader(self.program.dataset, self.program.mesh, seed=self.config.seed,
                                   shuffle=self.config.data.shuffle, global_batch=d.global_batch,
                                   microbatches=d.microbatches, steps_per_sync=self.trainer.steps_per_sync,
                                   prefetch=self.config.data.prefetch, data_state=data_state, moved=self._moved)

    def _eval_batches(self) -> list[dict]:
        return device_eval_batches(self.program.dataset, self.program.mesh,
                                   global_batch=self.program.derived.global_batch,
                                   max_batches=self.trainer.eval_batches, moved=self._moved)

    def _moved(self, host_to_device_bytes: int) -> None:
        self.host_to_device_bytes += host_to_device_bytes

    def _record(self, first_step: int, metrics: dict, *, result: TrainResult,
                writer: MetricsWriter | DiscardedMetrics, bar: tqdm, clock: Throughput) -> None:
        """Step closure: the host values of the metrics of steps first_step.. (one boundary)."""
        k = self.trainer.steps_per_sync
        fused, last_step = k > 1, first_step + k - 1
        clock.boundary_done(first_step, k, self.closures.seen_finishing(last_step),
                            early=last_step == self.progress.step)
        for offset in range(k):
            values = {name: float(v[offset] if fused else v) for name, v in metrics.items()}
            self._record_step(first_step + offset, values, result, writer, bar, clock)

    def _record_step(self, step: int, values: dict[str, float], result: TrainResult,
                     writer: MetricsWriter | DiscardedMetrics, bar: tqdm, clock: Throughput) -> None:
        finite = bool(values.pop("finite"))
        if not finite:
            self._nonfinite(step, values)
        result.losses[step] = values["loss"]
        result.metrics = {**values, **clock.rates(numeric=True), "skipped": not finite}
        self._expert_load = expert_load(values)
        bar.set_postfix(loss=f"{values['loss']:.4f}", **clock.rates(), refresh=False)
        bar.update(1)
        if step % self.trainer.log_every == 0 or step == self.trainer.steps:
            writer.write({"step": step, **result.metrics})
            if self.lines_instead_of_bar:
                self.echo(f"  {self._progress_line(step, values, clock)}")
        for callback in self.callbacks:
            self._stop_if_asked(callback, callback.on_step(step, dict(result.metrics)))

    def _stop_if_asked(self, callback: Callback, answer: Any) -> None:
        """A callback's return value: a reason to stop (a string, or True) stops the loop as a signal does."""
        if answer:
            self.stop.ask(answer if isinstance(answer, str) else f"{type(callback).__name__} asked to stop")

    def _progress_line(self, step: int, values: dict[str, float], clock: Throughput) -> str:
        """A logged step as one plain line (trainer.progress: the bar's figures, and the learning rate)."""
        rates = clock.rates()
        shown = [f"{rates[unit]} {unit}" for unit in ("tokens/s" if "tokens/s" in rates else "samples/s", "MFU")
                 if unit in rates]
        return ", ".join([f"step {step}/{self.trainer.steps}: loss {values['loss']:.4f}", f"lr {values['lr']:.3g}",
                          *shown, f"ETA {self._eta.at(step)}"])

    def _time_interval(self, step: int, writer: MetricsWriter | DiscardedMetrics, clock: Throughput,
                       traced: bool) -> None:
        """End a logged interval in the loop itself, after its evaluation and checkpoint: its own line in
        metrics.jsonl, and the bottleneck rules (`traced`: the profiler ran in it)."""
        spent = self.breakdown.cut()
        writer.write({"step": step, **fractions(spent), "interval_seconds": round(sum(spent.values()), 4)})
        self.rules.check(Interval(self._interval_first_step, step, spent, clock.last.get("mfu"),
                                  self._recompilations(), self._expert_load), traced)
        self._interval_first_step = step + 1

    def _recompilations(self) -> list[tuple[str, str]]:
        return [(r.step, r.cause) for r in self.program.compile_book.records if r.cause != FIRST_COMPILATION]

    def _say(self, finding: Finding) -> None:
        self.echo(f"  {finding.line()}")

    def _nonfinite(self, step: int, values: dict[str, float]) -> None:
        scaling = self.program.policy.loss_scale
        if scaling is not None and values["loss_scale"] > scaling.min:
            return  # a loss-scale overflow: the step skipped its update and backed the scale off
        if self.trainer.on_nonfinite == "stop":
            at_min = f" with the loss scale at its minimum {scaling.min:g}" if scaling is not None else ""
            numbers = f"loss={values['loss']}, grad_norm={values['grad_norm']}"
            if step == 1 and not math.isfinite(values["loss"]):
                raise NonFiniteLoss(
                    f"non-finite loss at step 1, before any update ({numbers}), so the learning rate is not the "
                    f"cause: {self.program.dataset.spec.origin} holds NaN/inf inputs or labels outside the model's "
                    "classes, or the model's forward overflows")
            raise NonFiniteLoss(
                f"non-finite loss at step {step}{at_min} ({numbers}); lower optimizer.lr, enable "
                "optimizer.clip_norm, or set trainer.on_nonfinite=skip to skip such updates")
        self.echo(f"  step {step}: non-finite loss, update skipped (trainer.on_nonfinite=skip)")

    def _evaluate(self, step: int, state: Any, eval_step: Any, batches: list[dict], result: TrainResult,
                  writer: MetricsWriter | DiscardedMetrics) -> None:
        if not batches:
            return
        self.closures.run()  # the train step's own device time is not evaluation's
        with self.phases.entered(EVALUATING):
            outputs = jax.block_until_ready([self._dispatch(eval_step, state, b) for b in batches])

        def report(outputs: list[dict]) -> None:
            record = {k: float(np.mean([o[k] for o in outputs])) for k in outputs[0]}
            result.eval_losses[step] = record["eval_loss"]
            result.eval_metrics = {"step": step, **record}
            writer.write({"step": step, **record})
            self.echo(f"  step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in record.items()))
            for callback in self.callbacks:
                self._stop_if_asked(callback, callback.on_eval(step, dict(record)))

        self.closures.add(step, report, (outputs,))


    def _evaluate_tasks(self, step: int, state: Any, writer: MetricsWriter | DiscardedMetrics) -> None:
        self.closures.run()
        with allow_transfers(), self.phases.entered(EVALUATING):  # the params gathered to every process
            scores = self.tasks(state)
        writer.write({"step": step, **scores})
        self.echo(f"  step {step}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in scores.items()))


class Eta:
    """The time left to trainer.steps at the loop's pace so far (evaluation and checkpoints included)."""

    def __init__(self, start: int, steps: int, began: float, clock: Callable[[], float] = time.perf_counter):
        self.start, self.steps, self.began, self.clock = start, steps, began, clock

    def at(self, step: int) -> str:
        done = step - self.start
        if done <= 0:
            return "?"
        left = (self.clock() - self.began) / done * (self.steps - step)
        return str(datetime.timedelta(seconds=round(left)))


def final_line(result: TrainResult, run_dir: Path) -> str:
    """The run's last line: how it ended (a finished run and one a signal stopped, with its checkpoint, read apart
    at a glance in a job's log), where its outputs are, and its final train and eval loss."""
    step = result.final_step
    why = "by signal" if result.stopped_by in ("signal", "") else f"({result.stopped_by})"
    ended = (f"stopped {why} at step {step}; a checkpoint there resumes with the same command"
             if result.interrupted else f"finished at step {step}")
    losses = [f"train loss {result.losses[step]:.4f}"] if step in result.losses else []
    if result.eval_losses:
        last = max(result.eval_losses)
        losses.append(f"eval loss {result.eval_losses[last]:.4f}" + ("" if last == step else f" (step {last})"))
    return f"{ended}; checkpoint and metrics in {run_dir}" + (f"; {', '.join(losses)}" if losses else "")


def expert_load(values: dict[str, float]) -> dict[int, tuple[float, float]]:
    """Per MoE layer, (max over mean, coefficient of variation) of its experts' loads in a step's metrics."""
    prefix = "router_max_over_mean_layer"
    return {int(name[len(prefix):]): (value, values[f"router_cv_layer{name[len(prefix):]}"])
            for name, value in values.items() if name.startswith(prefix)}


def _knobs(program: Program) -> Knobs:
    config, d = program.config, program.derived
    moe = getattr(config.model, "moe", None)
    balancing = None if moe is None else f"aux_loss_weight={moe.aux_loss_weight}, bias_rate={moe.bias_rate}"
    return Knobs(prefetch=config.data.prefetch, steps_per_sync=config.trainer.steps_per_sync,
                 rows_per_device=d.global_batch // d.devices, policy=config.precision.policy, balancing=balancing)

def _throughput(program: Program, peak_flops: float | None, excluded: Callable[[], float]) -> Throughput:
    spec, d = program.dataset.spec, program.derived
    tokens = d.global_batch * spec.input_shape[0] if spec.input_dtype.kind in "iu" else 0
    return Throughput(d.global_batch, tokens, (program.measured.model_flops_per_step or 0.0) / d.devices, peak_flops,
                      excluded=excluded)


@dataclass(frozen=True)
class _Loop:
    """What the training loop's boundaries use, made once before the first."""

    record: Callable[[int, dict], None]
    """The step closure that records the metrics of a boundary's steps."""
    clock: Throughput
    profile: ProfileWindow
    train_step: Any
    eval_step: Any
    evaluation: list[dict]
    loader: DeviceLoader
    metrics_writer: MetricsWriter | DiscardedMetrics
    result: TrainResult
