"""Multi-process runs through JAX's own runtime (jax.distributed); process 0 owns the run directory."""

from __future__ import annotations

import jax

from xlatrain import compat
from xlatrain.config import DistributedConfig
from xlatrain.errors import UserError, first_line


def initialize(config: DistributedConfig) -> None:
    """Join the other processes before any device is touched; a no-op for single-process runs."""
    if config.coordinator is None:
        return
    compat.use_gloo_for_cpu_collectives()
    try:
        jax.distributed.initialize(coordinator_address=config.coordinator, num_processes=config.num_processes,
                                   process_id=config.process_id)
    except Exception as err:  # connection and timeout errors come from deep inside the runtime
        raise UserError(f"distributed: could not join distributed.coordinator={config.coordinator} as process "
                        f"{config.process_id} of {config.num_processes} ({type(err).__name__}: "
                        f"{first_line(err)}); start every process with the same "
                        "coordinator and num_processes, and a distinct process_id") from None


def is_primary() -> bool:
    return jax.process_index() == 0
