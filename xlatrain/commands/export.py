"""`xlatrain export RUN_DIR --torch OUT.pt`: a run's trained weights as the torch module's state_dict."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from xlatrain.config import TorchModelConfig
from xlatrain.errors import UserError
from xlatrain.program import build_program
from xlatrain.run.atomic import replace_file
from xlatrain.run.checkpoints import Checkpoints, CorruptCheckpoint
from xlatrain.run.directory import CHECKPOINTS_DIR, pinned_partition, read_run_config
from xlatrain.state import with_shardings


def export_torch_state_dict(run_dir: Path, out: Path, step: int | None = None) -> tuple[Path, int]:
    """Write the checkpoint at `step` (default: the latest) to `out`; returns (out, step). The file loads with
    `module.load_state_dict(torch.load(out), strict=True)`."""
    import torch

    config = read_run_config(run_dir)
    if not isinstance(config.model, TorchModelConfig):
        raise UserError(f"export --torch: {str(run_dir)!r} trained model.name={config.model.name}, not a torch module "
                        "(model.name=torch)")
    if out.exists():
        raise UserError(f"export --torch: {str(out)!r} exists; choose a new path (nothing is overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"export --torch: {str(out)!r} is in a directory that does not exist")
    # Restore onto the devices present, whatever data-parallel size the run trained with.
    config = config.model_copy(update={"mesh": config.mesh.model_copy(update={"data": -1})})
    program = build_program(config, pinned_partition=pinned_partition(run_dir))
    checkpoints = Checkpoints(run_dir / CHECKPOINTS_DIR, config.trainer.keep_checkpoints)
    try:
        available = checkpoints.all_steps()
        step = available[-1] if step is None and available else step
        if step not in available:
            raise UserError(f"export --torch: {str(run_dir)!r} has no checkpoint at step {step}; it has "
                            f"{available or 'none'}")
        state = checkpoints.restore(step, with_shardings(program.abstract_state, program.specs, program.mesh)).state
    except CorruptCheckpoint as err:
        raise UserError(f"export --torch: checkpoint {checkpoints.directory / str(step)} is unusable ({err}); "
                        f"export another one with --step (this run has {available})") from None
    finally:
        checkpoints.close()
    params = state.params if program.pipeline is None else program.pipeline.layout.layer_params(state.params)
    host = jax.tree.map(np.asarray, (params, state.model_state))
    state_dict = program.model.torch.state_dict(*host)
    replace_file(out, lambda partial: torch.save(state_dict, partial))
    return out, step
