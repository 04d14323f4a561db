"""orbax checkpoints of the train state and the data position: async, atomic, keep the last K."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from xlatrain.errors import UserError, first_line


class Checkpoints:
    def __init__(self, directory: Path, keep: int):
        self.directory = directory.resolve()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Starts an asynchronous save; orbax writes to a temporary directory and renames it when done."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
        self._manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """The state (placed in the shardings that `abstract_state` carries) and the data position."""
        try:
            return self._restore(step, abstract_state)
        except Exception as err:  # orbax raises many types; all mean this step cannot be used
            legacy = _without_model_state(abstract_state)
            if legacy is not None:
                try:
                    state, data = self._restore(step, legacy)
                    return abstract_state.replace(**state, model_state={}), data
                except Exception:
                    pass
            raise UserError(
                f"checkpoint {self.directory / str(step)} could not be restored ({type(err).__name__}: "
                f"{first_line(err)}). It may be corrupt or from another model: "
                "move that step directory aside to resume from an earlier one, or set trainer.run_dir to a "
                "new directory") from None

    def _restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        return restored.state, restored.data

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _without_model_state(abstract_state: Any) -> dict | None:
    """A train state written before TrainState had `model_state` (always empty for those models): its other
    fields as a dict, to restore such a checkpoint; None when the state has model state to restore."""
    if not dataclasses.is_dataclass(abstract_state) or getattr(abstract_state, "model_state", None) != {}:
        return None
    return {f.name: getattr(abstract_state, f.name) for f in dataclasses.fields(abstract_state)
            if f.name != "model_state"}
