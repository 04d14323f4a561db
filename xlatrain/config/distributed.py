"""The `distributed` section: processes, the coordinator and the watchdog's timeouts."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from xlatrain.config.base import NonNegativeInt, PositiveInt, Strict

Seconds = Annotated[float, Field(gt=0, le=7 * 24 * 3600)]


class StallTimeouts(Strict):
    """How long a process may stay in one phase at one step before the watchdog stops the run (seconds).
    A single number sets every phase."""

    starting: Seconds = 600
    """Before compiling: joining, the config check, opening the run directory."""
    compiling: Seconds = 1800
    """Building the program, creating or restoring the state, compiling the steps."""
    loading_data: Seconds = 300
    """Waiting for the next batch."""
    training: Seconds = 180
    """Dispatching a step and reading its results."""
    hook: Seconds = 180
    """Inside a user's hook."""
    evaluating: Seconds = 600
    """The eval steps."""
    checkpointing: Seconds = 900
    """Saving a checkpoint."""

    @model_validator(mode="before")
    @classmethod
    def _one_for_all(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {phase: value for phase in cls.model_fields}
        return value


class DistributedConfig(Strict):
    """Several processes joined through jax.distributed, and the watchdog that stops a run whose process died or
    stalls (docs/multi-process.md); may differ between a run and its resumption."""

    coordinator: Annotated[str, Field(pattern=r"^[\w.\-\[\]:]+:\d+$")] | None = None
    """"host:port" of process 0. Unset: a single process, or the cluster's own values when run under SLURM,
    Open MPI's mpirun or Kubernetes (detected by jax.distributed); set keys win over detected ones."""
    num_processes: PositiveInt | None = None
    """Processes in the run; null: 1, or the cluster's."""
    process_id: NonNegativeInt | None = None
    """This process's index; null: 0, or the cluster's."""
    stall_timeout: StallTimeouts = StallTimeouts()
    """Seconds a process may stay at one step in one phase before the watchdog stops the run; a single number sets
    every phase."""
    heartbeat_timeout: Annotated[float, Field(ge=2, le=3600)] = 10.0
    """Seconds without a heartbeat from a process before the watchdog counts it as dead."""

    @model_validator(mode="after")
    def _consistent(self) -> DistributedConfig:
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise ValueError(f"distributed.process_id={self.process_id} must be below "
                             f"distributed.num_processes={self.num_processes}")
        return self
