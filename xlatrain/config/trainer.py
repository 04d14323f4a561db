"""The `trainer` section: the loop's length, boundaries, logging, checkpoints and compile options."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import field_validator, model_validator

from xlatrain.config.base import PathText, PositiveInt, Strict, positive_ints

Logger = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
TRACKER_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
"""The loggers that need a package of their own: (module, the package that installs it)."""


WANDB_PROJECT_REFUSES = "/\\#?%:"
"""Characters W&B refuses in a project name (as wandb's own settings check them), with names over 128 characters."""


class WandbConfig(Strict):
    project: str = "xlatrain"
    """The W&B project the run goes to (at most 128 characters, none of / \\ # ? % :)."""
    entity: str | None = None
    """The W&B team or user; null: wandb's default (the API key's)."""

    @field_validator("project")
    @classmethod
    def _a_name_wandb_takes(cls, project: str) -> str:
        refused = sorted({char for char in project if char in WANDB_PROJECT_REFUSES})
        if not project or len(project) > 128 or refused:
            found = f" (it has {' '.join(refused)})" if refused else ""
            raise ValueError(f"not a W&B project name{found}: give 1 to 128 characters, none of "
                             f"{' '.join(WANDB_PROJECT_REFUSES)}")
        return project


class MlflowConfig(Strict):
    tracking_uri: str | None = None
    """Where MLflow keeps the run: any tracking URI (http://host:5000, sqlite:///mlflow.db, ...); null:
    MLFLOW_TRACKING_URI where it is set, else a local file store in RUN_DIR/mlruns (it opens a run in 0.03 s and
    logs a step in 0.8 ms, where MLflow 3's preferred SQLite store takes 1.1 s and 5.2 ms: bench.trackers)."""
    experiment: str | None = None
    """The MLflow experiment; null: the config's name."""


class TrainerConfig(Strict):
    """The loop: its length, what happens at step boundaries (logs, evaluation, checkpoints) and compile
    options. Only this section (with the device and process counts and optimizer.decay_steps) may change when a
    run resumes (docs/run-directory.md)."""

    steps: PositiveInt = 300
    """Optimizer steps in total."""
    run_dir: PathText | None = None
    """Default: runs/<name>. An existing run directory is resumed from its latest checkpoint."""
    init_from: str | None = None
    """RUN_DIR or RUN_DIR@STEP: a new run directory starts where another run's checkpoint (its newest, or STEP's)
    left off: params, optimizer state, step and data position, the schedule going on from that step (a WSD
    cooldown from a checkpoint of the stable phase: docs/training-step.md). Read while this run has no checkpoint
    of its own; once it has, it resumes from its own."""
    log_every: PositiveInt = 10
    """Steps between metrics.jsonl records."""
    eval_every: PositiveInt = 100
    """Steps between evaluations (and one at the end)."""
    eval_batches: PositiveInt = 4
    """Held-out batches per evaluation."""
    eval_tasks: tuple[str, ...] = ()
    """Downstream tasks scored during training (a built-in decoder's; docs/evaluation.md): xlatrain's
    multiple-choice files (*.jsonl) and lm-evaluation-harness task names under trainer.eval_include_path; the scores
    are logged as eval/<task>/<metric>."""
    eval_tasks_every: PositiveInt | None = None
    """Steps between task evaluations (and one at the end); null: trainer.eval_every."""
    eval_tasks_limit: PositiveInt | None = None
    """The first N documents of each task; null: all."""
    eval_include_path: tuple[str, ...] = ()
    """Directories of lm-evaluation-harness task YAMLs (local data_files: nothing is downloaded)."""
    checkpoint_every: PositiveInt = 100
    """Steps between checkpoints (and one at the end)."""
    keep_checkpoints: PositiveInt = 3
    """Checkpoints kept; older ones are removed."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """On an inf/NaN loss or gradient: stop the run, or skip that update."""
    progress: Literal["auto"] | bool = "auto"
    """true: a progress bar on stderr (step, loss, samples/s, tokens/s, ETA). false: instead, a plain line on stdout
    every trainer.log_every steps (step, loss, lr, tokens/s or samples/s, MFU, ETA), as a cluster job's log wants.
    auto: the bar where stderr is a terminal, the lines elsewhere."""

    loggers: tuple[Logger, ...] = ("jsonl", "tensorboard")
    """Where each logged step's metrics go beside RUN_DIR/metrics.jsonl (flat keys), which is always written, listed
    (jsonl) or not: it is the run's own record, which a resume, `plot` and `report` read. tensorboard
    (RUN_DIR/tensorboard), wandb (Weights & Biases), mlflow (MLflow). The trackers get the same scalars under
    train/, eval/ and perf/, and the resolved config as hyperparameters; a resumed run goes on in the same tracker
    run, and never gets a step twice. Only process 0 logs."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases, with trainer.loggers: [..., wandb]; wandb reads its own environment (WANDB_MODE=offline
    logs with no network, WANDB_API_KEY, ...)."""
    mlflow: MlflowConfig = MlflowConfig()
    """MLflow, with trainer.loggers: [..., mlflow]."""
    steps_per_sync: PositiveInt = 1
    """Optimizer steps fused into one executable (a step boundary every k steps); host work such as
    logging, eval and checkpoints happens only at boundaries."""
    compile_budget: PositiveInt | None = None
    """Stop the run, with the recompile report, once the steps have been compiled more than this often."""
    profile_steps: tuple[PositiveInt, PositiveInt] | None = None
    """[a, b]: a jax.profiler trace of steps a..b (numbered from 1) in RUN_DIR/profile."""
    compile_cache: PathText = "auto"
    """JAX's persistent compilation cache: auto (JAX_COMPILATION_CACHE_DIR, else ~/.cache/xlatrain/jax), a
    directory, or off."""

    @field_validator("compile_cache", mode="before")
    @classmethod
    def _yaml_switches(cls, value: Any) -> Any:
        """YAML reads a bare off/no/false as False (and on/yes/true as True)."""
        if value is False or value is None:
            return "off"
        return "auto" if value is True else value

    @field_validator("init_from", mode="after")
    @classmethod
    def _init_from_is_a_run_and_a_step(cls, value: str | None) -> str | None:
        if value is not None:
            directory, step = _run_and_step(value)
            if not directory or (step and not (step.isdigit() and int(step) > 0)):
                raise ValueError(f"{value!r} must be RUN_DIR or RUN_DIR@STEP (a run directory, and one of its "
                                 "checkpoints' steps, e.g. runs/base@2000)")
        return value

    def init_from_step(self) -> tuple[str, int | None]:
        """trainer.init_from as (its run directory, its step; None: the newest)."""
        directory, step = _run_and_step(self.init_from)
        return directory, int(step) if step else None

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _profile_steps_are_two_steps(cls, value: Any) -> Any:
        if value is not None and not (positive_ints(value) and len(value) == 2):
            raise ValueError("must be [first, last]: two step numbers from 1 (e.g. [3, 5]), or null for no trace")
        return value

    @field_validator("loggers", mode="after")
    @classmethod
    def _loggers_once_each_and_installed(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(repeated)} more than once; give each logger once")
        for name in value:
            module, package = TRACKER_PACKAGES.get(name, (None, None))
            if module is not None and importlib.util.find_spec(module) is None:
                raise ValueError(f"{name} needs the {package} package: pip install {package} (or the [{name}] "
                                 "extra of xlatrain)")
        return value

    def shows_bar(self, stderr_is_a_terminal: bool) -> bool:
        return self.progress is True or (self.progress == "auto" and stderr_is_a_terminal)

    @model_validator(mode="after")
    def _task_options_with_tasks(self) -> TrainerConfig:
        for key in ("eval_tasks_every", "eval_tasks_limit", "eval_include_path"):
            if getattr(self, key) and not self.eval_tasks:
                raise ValueError(f"trainer.{key} applies to trainer.eval_tasks, and there are none: give the tasks "
                                 f"(trainer.eval_tasks=[my_task.jsonl]), or drop trainer.{key}")
        return self

    @model_validator(mode="after")
    def _steps_fill_boundaries(self) -> TrainerConfig:
        if self.steps % self.steps_per_sync:
            raise ValueError(f"trainer.steps={self.steps} must be a multiple of trainer.steps_per_sync="
                             f"{self.steps_per_sync} (steps run in fused groups)")
        if self.profile_steps is not None:
            a, b = self.profile_steps
            if not a <= b <= self.steps:
                raise ValueError(f"trainer.profile_steps=[{a}, {b}] must be [first, last] with first <= last <= "
                                 f"trainer.steps={self.steps}")
        return self


def _run_and_step(init_from: str) -> tuple[str, str]:
    directory, _, step = init_from.rpartition("@") if "@" in init_from else (init_from, "", "")
    return directory, step
