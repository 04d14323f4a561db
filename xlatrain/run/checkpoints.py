"""orbax checkpoints of the train state and the data position: async, atomic, keep the last K, and verified.

Each checkpoint carries a fingerprint of every leaf of the state (computed on the devices). A restore checks
them; a checkpoint that cannot be read or does not match is moved aside (`<step>.corrupt`), never deleted, and
the newest one that verifies is used instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import jax
import orbax.checkpoint as ocp

from xlatrain.compat.multihost import barrier
from xlatrain.errors import UserError, drop_follow_up_errors, first_line
from xlatrain.run.directory import CHECKPOINTS_DIR
from xlatrain.run.fingerprints import tree_fingerprints
from xlatrain.runtime.distributed import is_primary
from xlatrain.sizes import readable_bytes

T = TypeVar("T")


class CorruptCheckpoint(Exception):
    """A checkpoint step that cannot be read, or whose arrays do not match their saved fingerprints."""


class CheckpointNotWritten(UserError):
    """A checkpoint that could not be written (a full disk, a file system gone read-only): the run stops, and
    the checkpoints written before it stay."""


_SLICE_BYTES_FOR_REPLICA_PARALLEL = 2**20
"""orbax splits the save of a replicated array among its replicas by slicing it, which compiles one small XLA
program per slice shape (96 for a 2-stage pipeline's small state); below this many bytes a slice is not worth
a compilation."""


@functools.cache
def _register_array_handler() -> None:
    handler = ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=_SLICE_BYTES_FOR_REPLICA_PARALLEL)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that it replaces its default handler: that is the point
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)


@functools.cache
def _drop_logged_failures(logger: str, is_dropped: Callable[[BaseException], bool]) -> None:
    """From now on, `logger`'s records whose exception `is_dropped` picks out are dropped; every other record is
    logged as before. Installed once per logger and rule."""
    def keep(record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] is not None and is_dropped(record.exc_info[1]))

    logging.getLogger(logger).addFilter(keep)


def _drop_orbax_logs_of_refused_writes() -> None:
    """orbax logs a failed background write as an ERROR with its traceback, from each thread it passes through,
    while the training goes on; xlatrain waits for every save it starts, and reports the ones the file system
    refused in one line (CheckpointNotWritten). Those records are dropped; any other failure is logged as before."""
    _drop_logged_failures("absl", _refused_write)


class Restored(NamedTuple):
    state: Any
    data: dict
    """The data position."""
    trained_on: dict
    """What `Checkpoints.save` was told of the data; {} for a checkpoint written before xlatrain recorded it."""


class Checkpoints:
    def __init__(self, directory: Path, keep: int):
        _register_array_handler()
        _drop_orbax_logs_of_refused_writes()
        self.directory = directory.resolve()
        _check_readable(self.directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._in_flight: int | None = None

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, trained_on: dict | None = None) -> None:
        """Starts an asynchronous save, once the one before it is written; orbax writes to a temporary directory
        and renames it when done. Raises CheckpointNotWritten when this save or the one before it failed.
        `trained_on` (JSON) says what data the state was trained on; `restore` reads it back."""
        self.wait_until_written()
        needed, free = sum(leaf.nbytes for leaf in jax.tree.leaves(state)), shutil.disk_usage(self.directory).free
        if free < needed:  # refused before orbax starts: a write that fails midway is hundreds of lines of its logs
            raise self._not_written(step, f"its {readable_bytes(needed)} do not fit in the {readable_bytes(free)} "
                                          "free there")
        integrity = {"fingerprints": tree_fingerprints(state), "data": trained_on or {}}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                                  integrity=ocp.args.JsonSave(integrity))
        with self._writing(step):
            self._manager.save(step, args=args, force=True)
        self._in_flight = step

    def wait_until_written(self) -> None:
        """Waits for the save in flight; raises CheckpointNotWritten when it failed."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            with self._writing(step):
                self._manager.wait_until_finished()

    def newest_written(self, wait_s: float = 0.0) -> int | None:
        """The newest checkpoint in the directory written whole (orbax renames a save's temporary directory when it
        is done), after waiting up to wait_s seconds for the save in flight to appear. It reads only the directory,
        so any thread may call it while another hangs in orbax's cross-process barriers."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                steps = ocp.utils.checkpoint_steps(self.directory)
            except OSError:
                return None
            if self._in_flight is None or self._in_flight in steps or time.monotonic() >= deadline:
                return max(steps, default=None)
            time.sleep(0.05)

    @contextlib.contextmanager
    def _writing(self, step: int) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            reason = _io_failure(err)
            if reason is None:
                raise
            _quiet_abandoned_io()
            raise self._not_written(step, reason) from None

    def _not_written(self, step: int, reason: str) -> CheckpointNotWritten:
        try:
            kept = self.all_steps()
        except OSError:  # the directory itself is gone
            kept = []
        return CheckpointNotWritten(
            f"checkpoint {step} could not be written to {self.directory} ({reason}); "
            + (f"the newest one written, {kept[-1]}, is kept" if kept else "none was written before it")
            + ": make room or repair the directory, then run the same command to resume")

    def restore_newest_verified(self, abstract_state: Any,
                                warn: Callable[[str], None]) -> tuple[Restored, int] | None:
        """What the newest checkpoint that restores and verifies holds, and its step; those newer that do
        not are moved aside with one warning each. None when there is no checkpoint; a UserError when none
        verifies."""
        moved = []
        for step in reversed(self.all_steps()):
            try:
                return self.restore(step, abstract_state), step
            except CorruptCheckpoint as err:
                destination = self._move_aside(step)
                moved.append(destination.name)
                warn(f"checkpoint {step} is unusable ({err}); moved it to {destination} and trying an earlier one")
        if moved:
            raise UserError(f"no checkpoint in {self.directory} restores and verifies (moved aside: "
                            f"{', '.join(moved)}); move one back to retry it, or set trainer.run_dir to a new "
                            "directory to start over")
        return None

    def _check_layout(self, step: int, abstract_state: Any) -> dict[str, tuple[int, ...]]:
        """A checkpoint whose arrays have other names or shapes than this run's state is not corrupt: the model
        changed since it was written (its code, or the data its shapes follow). Refused with the differences, and
        nothing is moved aside; arrays saved in an older layout of the same parameter (`_saved_merged`) are
        returned with their saved shapes, to be restored and reshaped. One whose metadata cannot be read is left to
        the restore, which calls it corrupt."""
        try:
            metadata = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
        except Exception:  # orbax raises many types; the restore reports the checkpoint as unusable
            return {}
        stored, wanted = _shapes(getattr(metadata, "item_metadata", metadata)), _shapes(abstract_state)
        older = {path: stored[path] for path in set(stored) & set(wanted)
                 if _saved_merged(path, stored[path], wanted[path])}
        params_first = functools.partial(sorted, key=lambda path: (not path.startswith("params/"), path))
        problems = [f"{path} of shape {stored[path]} where the run's state has {wanted[path]}"
                    for path in params_first(set(stored) & set(wanted)) if stored[path] != wanted[path]
                    and path not in older]
        problems += [f"no {path}" for path in params_first(set(wanted) - set(stored))]
        problems += [f"{path}, which the run's state has not" for path in params_first(set(stored) - set(wanted))]
        if problems:
            raise UserError(f"checkpoint {step} in {self.directory} holds " + "; ".join(problems[:3])
                            + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
                            + ": the model's shapes changed since the run was written (its code, or data they "
                            "follow, such as data.path's inputs); resume with those it was written with, or choose "
                            "a new trainer.run_dir. Nothing was moved aside")
        return older

    def restore(self, step: int, abstract_state: Any) -> Restored:
        """The state (placed in the shardings that `abstract_state` carries), verified against the saved
        fingerprints, with the data position and what data it was trained on."""
        _quiet_abandoned_io()  # first: reads abandoned on an unreadable file report while orbax's call still unwinds
        older = self._check_layout(step, abstract_state)
        as_saved = _with_saved_shapes(abstract_state, older)
        try:
            state, data, integrity = self._restore(step, as_saved)
            written = state
        except Exception as err:  # orbax raises many types; all mean this step cannot be used
            legacy = _without_model_state(as_saved)
            if legacy is None:
                raise CorruptCheckpoint(_unreadable(err)) from None
            try:
                written, data, integrity = self._restore(step, legacy)
            except Exception:
                raise CorruptCheckpoint(_unreadable(err)) from None
            state = as_saved.replace(**written, model_state={})
        if integrity:  # the fingerprints follow the tree as it was written
            _verify(written, integrity["fingerprints"])
        return Restored(_in_layout(state, abstract_state, older), data, integrity.get("data", {}))

    def restore_fields_on(self, step: int, sharding_of: Callable[[tuple[int, ...]], jax.sharding.Sharding],
                          fields: tuple[str, ...]) -> dict[str, Any]:
        """Some fields of the train state saved at `step` (params, model_state; {} for one the state has not), each
        array read where `sharding_of` its shape says (one device, or spread over several), whatever mesh wrote
        them (in their layout as saved: a pipeline's blocks in stages), verified against their fingerprints. Only
        those are read: the optimizer state beside them (twice the params' bytes with Adam) stays on disk."""
        _quiet_abandoned_io()
        try:
            metadata = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
            saved_fields = dict(getattr(metadata, "item_metadata", metadata))
            wanted = {field: jax.tree.map(
                lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding_of(tuple(leaf.shape))),
                saved_fields[field], is_leaf=lambda leaf: hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
                for field in fields if saved_fields.get(field)}
            restore_args = jax.tree.map(lambda leaf: ocp.ArrayRestoreArgs(sharding=leaf.sharding), wanted)
            restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                wanted, restore_args=restore_args, partial_restore=True)))
            found = {field: restored.state.get(field, {}) for field in fields}
            saved = self._integrity(step).get("fingerprints", {})
        except Exception as err:  # orbax raises many types; all mean this step cannot be used
            raise CorruptCheckpoint(_unreadable(err)) from None
        for field, values in found.items():  # the train state's fingerprints name a field's paths `.FIELD[...]`
            prefix = f".{field}"
            if saved and values:
                _verify(values, {path[len(prefix):]: value for path, value in saved.items()
                                 if path.startswith((prefix + "[", prefix + "."))})
        return found

    def _integrity(self, step: int) -> dict:
        if not (self.directory / str(step) / "integrity").is_dir():
            return {}
        return self._manager.restore(step, args=ocp.args.Composite(integrity=ocp.args.JsonRestore())).integrity

    def _restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        """The state, the data position, and the integrity record ({} for a checkpoint written before it)."""
        items = {"state": ocp.args.StandardRestore(abstract_state), "data": ocp.args.JsonRestore()}
        has_integrity = (self.directory / str(step) / "integrity").is_dir()
        if has_integrity:  # checkpoints written before fingerprints existed restore unverified
            items["integrity"] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return restored.state, restored.data, restored.integrity if has_integrity else {}

    def _move_aside(self, step: int) -> Path:
        barrier(f"xlatrain-checkpoint-{step}-moving-aside")
        source = self.directory / str(step)
        destination = source.with_name(f"{step}.corrupt")
        suffix = 1
        while destination.exists():
            suffix += 1
            destination = source.with_name(f"{step}.corrupt-{suffix}")
        if is_primary():
            source.rename(destination)
        barrier(f"xlatrain-checkpoint-{step}-moved-aside")
        self._manager.reload()
        return destination

    def close(self) -> None:
        try:
            self.wait_until_written()
        finally:
            self._manager.close()


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_FILE_GONE = re.compile(r"^NOT_FOUND: .* local file ")
"""TensorStore's status for a file of the checkpoint that was removed while orbax wrote it (it names no errno)."""


def _io_failure(err: Exception) -> str | None:
    """Why a save failed when the file system refused it (orbax reports TensorStore's errors as ValueError,
    naming the errno); None for any other failure, which keeps its traceback."""
    code = _OS_ERROR_CODE.search(str(err))
    if code is not None:
        return os.strerror(int(code.group(1)))
    if _FILE_GONE.match(str(err)):
        return os.strerror(errno.ENOENT)
    if isinstance(err, OSError):
        return err.strerror or first_line(err)
    return None


def _check_readable(directory: Path) -> None:
    """The checkpoints directory, each step's directory and what it holds at its top can be read by this user;
    otherwise one UserError naming the first that cannot (orbax would log a warning for it and go on, or fail with
    a traceback)."""
    def readable(path: Path) -> bool:
        return os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0))

    def entries(folder: Path) -> list[Path]:
        return sorted(folder.iterdir()) if readable(folder) else []

    if not directory.is_dir():
        return
    steps = [step for step in entries(directory) if step.is_dir()]
    for path in [directory, *steps, *(entry for step in steps for entry in entries(step))]:
        if not readable(path):
            raise UserError(f"{path} cannot be read by this user (permission denied); let it read the checkpoints "
                            f"(chmod -R u+rX {directory}), or run as their owner")


def _unreadable(err: Exception) -> str:
    """Why a checkpoint did not restore, without the TensorStore specs (kilobytes of JSON) its errors end with."""
    return f"{type(err).__name__}: {first_line(err).split(' [tensorstore_spec', 1)[0]}"


def _quiet_abandoned_io() -> None:
    """After orbax's restore or save raises on the first array it cannot read or write, the I/O still in flight
    ends later, each printing its own error with the whole TensorStore spec (hundreds of lines) as an unraisable
    exception or an asyncio task's unretrieved exception: the coroutine was left unawaited, or its result reached
    the event loop after it closed."""
    drop_follow_up_errors("orbax-abandoned-io", _from_abandoned_io)
    _drop_logged_failures("asyncio", _abandoned)


def _from_abandoned_io(unraisable: Any) -> bool:
    code = getattr(unraisable.object, "cr_code", None)
    return (code is not None and "orbax" in Path(code.co_filename).parts) or _abandoned(unraisable.exc_value)


def _refused_write(err: BaseException | None) -> bool:
    return isinstance(err, Exception) and _io_failure(err) is not None


def _abandoned(err: BaseException | None) -> bool:
    loop_closed = isinstance(err, RuntimeError) and str(err) == "Event loop is closed"
    return loop_closed or _refused_write(err)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{path/of/leaf: shape} of a state or of a checkpoint's metadata (a dataclass's fields and a dict's keys
    name alike)."""
    return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(leaf, "shape")}


OLDER_LAYOUTS = ("qkv/kernel", "qkv/bias")
"""Parameters (and their optimizer moments) whose layout changed, saved before with their last two dimensions
merged: the GPT's query, key and value kernel was [width, 3 x width] and is [width, 3, width], so that a split over
`tensor` takes whole heads of each."""


def _saved_merged(path: str, stored: tuple[int, ...], wanted: tuple[int, ...]) -> bool:
    return path.endswith(OLDER_LAYOUTS) and len(wanted) >= 2 and stored[:-1] == wanted[:-2] \
        and stored[-1:] == (wanted[-2] * wanted[-1],)


def _with_saved_shapes(abstract_state: Any, older: dict[str, tuple[int, ...]]) -> Any:
    """The abstract state with the leaves saved in an older layout as they were saved (replicated: they are
    placed in the run's shardings when reshaped)."""
    if not older:
        return abstract_state

    def as_saved(path, leaf):
        shape = older.get(jax.tree_util.keystr(path, simple=True, separator="/"))
        if shape is None:
            return leaf
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=jax.sharding.NamedSharding(
            leaf.sharding.mesh, jax.sharding.PartitionSpec()))

    return jax.tree_util.tree_map_with_path(as_saved, abstract_state)


def _in_layout(state: Any, abstract_state: Any, older: dict[str, tuple[int, ...]]) -> Any:
    """The restored state with the leaves saved in an older layout reshaped into the run's (and its shardings)."""
    if not older:
        return state

    def reshaped(path, leaf, wanted):
        if jax.tree_util.keystr(path, simple=True, separator="/") not in older:
            return leaf
        return jax.jit(lambda x: x.reshape(wanted.shape), out_shardings=wanted.sharding)(leaf)

    return jax.tree_util.tree_map_with_path(reshaped, state, abstract_state)


def in_current_layout(params: Any, abstract_params: Any) -> Any:
    """Params read as saved (`restore_fields_on`) with those saved in an older layout reshaped into the model's."""
    def reshaped(path, leaf, wanted):
        path = jax.tree_util.keystr(path, simple=True, separator="/")
        return leaf.reshape(wanted.shape) if _saved_merged(path, leaf.shape, wanted.shape) else leaf

    return jax.tree_util.tree_map_with_path(reshaped, params, abstract_params)


def _verify(state: Any, saved: dict[str, int]) -> None:
    """The paths compared by their keys alone: a field read on its own comes back as dicts and lists where the
    train state had named tuples (an optimizer's state) and tuples."""
    restored = {_keys_of(path): value for path, value in tree_fingerprints(state).items()}
    saved = {_keys_of(path): value for path, value in saved.items()}
    differ = [path for path, value in restored.items() if saved.get(path) != value]
    missing = sorted(set(saved) - set(restored))
    if differ or missing:
        named = differ or missing
        raise CorruptCheckpoint(f"{len(named)} array(s) do not match the fingerprints saved with it, e.g. "
                                f"{named[0]}")


def _keys_of(path: str) -> str:
    return "/".join(re.findall(r"\w+", path))


def _without_model_state(abstract_state: Any) -> dict | None:
    """A train state written before TrainState had `model_state` (always empty for those models): its other
    fields as a dict, to restore such a checkpoint; None when the state has model state to restore."""
    if not dataclasses.is_dataclass(abstract_state) or getattr(abstract_state, "model_state", None) != {}:
        return None
    return {f.name: getattr(abstract_state, f.name) for f in dataclasses.fields(abstract_state)
            if f.name != "model_state"}


def read_checkpoint(run_dir: Path, keep: int, step: int | None, command: str,
                    read: Callable[[Checkpoints, int], T]) -> tuple[T, int]:
    """(`read(checkpoints, step)`, step) of a run's checkpoint at `step` (None: the latest); a step the run does not
    have, or one that cannot be read, is one line naming the steps it has."""
    checkpoints = Checkpoints(run_dir / CHECKPOINTS_DIR, keep)
    try:
        available = checkpoints.all_steps()
        step = available[-1] if step is None and available else step
        if step not in available:
            raise UserError(f"{command}: {str(run_dir)!r} has no checkpoint at step {step}; it has "
                            f"{available or 'none yet'}")
        return read(checkpoints, step), step
    except CorruptCheckpoint as err:
        raise UserError(f"{command}: checkpoint {checkpoints.directory / str(step)} is unusable ({err}); choose "
                        f"another step (this run has {available})") from None
    finally:
        checkpoints.close()
