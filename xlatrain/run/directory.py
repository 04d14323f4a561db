"""The run directory: held by one run at a time, checked before anything expensive runs, and the resolved config
saved there only once the run has started (its state created or restored); a second run into it must be a resume."""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from xlatrain.compat.multihost import barrier
from xlatrain.config import (
    DERIVED_SECTION,
    Config,
    config_and_derived_to_yaml,
    flatten,
    parse_yaml,
    upgraded_saved_config,
    validate_config,
    without_derived,
)
from xlatrain.config.runtime import CPU_KERNELS
from xlatrain.errors import UserError, first_line, warn
from xlatrain.run.atomic import replace_file
from xlatrain.runtime.distributed import as_primary_has_it, host_name, is_primary

CONFIG_FILE = "config.yaml"
RESUMABLE_KEYS = ("trainer.", "derived.", "distributed.", "optimizer.decay_steps", "mesh.data", "mesh.cpu_devices",
                  "mesh.tensor", "mesh.context", "mesh.expert", "parallel.sequence_parallel",
                  "parallel.context_attention", "model.init_from", "model.moe.formulation", "runtime.")
"""Keys that may differ between a run and its resumption (more steps, other devices or processes and so another
data-parallel size, however the CPU devices were counted; the same model split over another tensor, context or
expert axis, its experts' matmuls formulated otherwise, its dense layers on other CPU kernels; a new learning-rate
horizon given on purpose; the weights a run started from: read only when its state was created, so that a resumed
run no longer needs them)."""
LOGS_DIR = "logs"
"""Where `xlatrain launch` writes each process's output; it may exist before the run's first start."""
CHECKPOINTS_DIR = "checkpoints"
LOCK_FILE = ".lock"
"""Locked (flock) by process 0 of the run that trains into the directory, and naming that process."""
SHARD_SCANS_FILE = "shard-scans.json"
"""The largest ids of token shards whose manifest does not record them, scanned once (xlatrain/data/shards.py)."""


@dataclass
class RunDirHold:
    """A start's hold on its run directory: the directories it made for it (the run directory first, then the
    parents it made), and whether its run exists there yet (save_run_config has written its config.yaml)."""

    made: list[Path]
    run_exists: bool = False


@contextlib.contextmanager
def exclusive_run_dir(run_dir: Path) -> Iterator[RunDirHold]:
    """Held while a run trains into `run_dir`: process 0 locks RUN_DIR/.lock, and a second run into the same
    directory is refused on every one of its processes before it reads or writes anything there (the two would
    write the same checkpoints and logs). The kernel drops the lock when its process ends, however it ends, so a
    run killed with -9 resumes at once. A start that ends before its run exists (a mistake in the config found
    while the step is built, a signal while it compiles) removes the directories it made, so that it leaves no
    empty run directory behind."""
    hold = RunDirHold(check_writable(run_dir))
    held, refusal = _lock(run_dir / LOCK_FILE) if is_primary() else (None, "")
    refusal = as_primary_has_it("run-dir-lock", refusal)
    if refusal:
        raise UserError(refusal)
    try:
        yield hold
    finally:
        if held is not None:
            os.close(held)
            if not hold.run_exists and hold.made:
                _remove_unstarted(run_dir, hold.made)


def _remove_unstarted(run_dir: Path, made: list[Path]) -> None:
    """Remove the directories `made` (`run_dir` first, then the parents made for it) for a run that never started,
    while `run_dir` still holds nothing of a run; anything else found in them keeps them."""
    if not _holds_no_run_yet(run_dir):
        return
    with contextlib.suppress(OSError):
        (run_dir / LOCK_FILE).unlink(missing_ok=True)
        (run_dir / SHARD_SCANS_FILE).unlink(missing_ok=True)
        if (run_dir / CHECKPOINTS_DIR).is_dir():
            (run_dir / CHECKPOINTS_DIR).rmdir()
        for directory in made:
            directory.rmdir()


def _lock(path: Path) -> tuple[int | None, str]:
    """The descriptor that holds `path`'s lock (None when the file system cannot lock), or why it is refused."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        return None, f"{path} cannot be opened to lock the run directory ({err.strerror}); remove it or choose " \
            "another trainer.run_dir"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        os.close(fd)
        return None, (f"trainer.run_dir={str(path.parent)!r} is in use by another run"
                      + (f" (xlatrain {holder})" if holder else "") + f", which holds {path.name}; wait for it to "
                      "end or stop it, or choose another trainer.run_dir")
    except OSError as err:
        os.close(fd)
        warn(f"{path} cannot be locked ({err.strerror}): nothing stops a second run from training into "
             f"{path.parent} at the same time as this one")
        return None, ""
    with contextlib.suppress(OSError):  # naming the holder is a courtesy; a full disk must not stop the run here
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {host_name()}\n".encode(), 0)
    return fd, ""


def check_run_dir(config: Config) -> Config | None:
    """The config of the run trainer.run_dir holds (None: none yet), refusing a directory that holds something else
    or another config's run. It writes nothing, so that a start refused here leaves the directory as it was: called
    before exclusive_run_dir locks it, and again under the lock (open_run_dir)."""
    run_dir = config.run_dir()
    if not run_dir.is_dir() or _holds_no_run_yet(run_dir):
        return None
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        raise UserError(f"trainer.run_dir={str(run_dir)!r} exists and is not an xlatrain run directory "
                        f"(no {CONFIG_FILE}); choose another trainer.run_dir so nothing there is overwritten")
    saved = _read_saved(saved_path)
    _check_same_run(kept_choices(config, saved), saved, saved_path)
    return saved


def open_run_dir(config: Config, echo: Callable[[str], None]) -> Config:
    """Check trainer.run_dir (held with exclusive_run_dir) before anything expensive runs: when it holds a run,
    that run has this config. Returns the config to train with: the learning-rate schedule's horizon
    (optimizer.decay_steps) fixed when the run was created, unless this config sets it."""
    saved = check_run_dir(config)
    barrier("xlatrain-run-dir-checked")
    if saved is None:
        return _with_horizon(config, config.optimizer.decay_steps or config.trainer.steps)
    config = kept_choices(config, saved)
    kept = saved.optimizer.decay_steps or saved.trainer.steps
    wanted = config.optimizer.decay_steps
    if wanted is None or wanted == kept:
        if config.trainer.steps > kept:
            echo(f"  learning-rate schedule: keeping this run's horizon of {kept} steps (set "
                 "optimizer.decay_steps to stretch it to the new trainer.steps)")
        return _with_horizon(config, kept)
    echo(f"  learning-rate schedule: horizon changed from {kept} to {wanted} steps (optimizer.decay_steps)")
    return config


def _holds_no_run_yet(run_dir: Path) -> bool:
    """Whether run_dir holds only what a start leaves before its run exists: launch's logs, the lock, the scan of
    its token shards, and an empty checkpoints directory (a first start stopped while it compiled)."""
    return all(path.name in (LOGS_DIR, LOCK_FILE) or path.name.startswith(SHARD_SCANS_FILE)
               or (path.name == CHECKPOINTS_DIR and path.is_dir() and not any(path.iterdir()))
               for path in run_dir.iterdir())


def save_run_config(config: Config, derived: dict[str, Any], hold: RunDirHold) -> None:
    """Process 0 writes config.yaml (atomically) with its derived section; called once the run's state exists, so
    a run that fails to start or restore leaves the saved config as it was. From then on the run exists in the
    directory `hold`s."""
    if is_primary():
        saved_path = config.run_dir() / CONFIG_FILE
        text = config_and_derived_to_yaml(config, derived)
        replace_file(saved_path, lambda partial: partial.write_text(text))
    hold.run_exists = True
    barrier("xlatrain-run-dir-ready")


def directory_identity(run_dir: Path) -> tuple[int, int]:
    """(device, inode) of the run directory once its run has started: a directory removed and made again, or
    another moved into its place, has another."""
    info = run_dir.stat()
    return info.st_dev, info.st_ino


def check_still_there(run_dir: Path, identity: tuple[int, int], step: int, *, agreed: bool = True) -> None:
    """Before a checkpoint is written: the run directory is still the one the run started in and still holds its
    config.yaml; otherwise the run stops here, so that nothing is written into a directory that is no longer this
    run's (orbax would make a new one and fill it with checkpoints of no run). `agreed`: process 0 looks and every
    process follows it; without, this process looks for itself (after a failure of its own)."""
    gone = run_dir_gone(run_dir, identity) if is_primary() or not agreed else ""
    if agreed:
        gone = as_primary_has_it("run-dir-still-there", gone)
    if gone:
        raise UserError(f"trainer.run_dir={str(run_dir)!r} {gone} while the run trained; the run stops without "
                        f"writing checkpoint {step}: restore the directory to resume the run, or start it over")


def run_dir_gone(run_dir: Path, identity: tuple[int, int]) -> str:
    """How the run directory stopped being the one of `identity` holding its run ("" while it still is)."""
    try:
        if directory_identity(run_dir) != identity:
            return "was replaced by another directory"
        return "" if (run_dir / CONFIG_FILE).is_file() else f"lost its {CONFIG_FILE}"
    except FileNotFoundError:
        return "was removed"


def kept_choices(config: Config, saved: Config) -> Config:
    """`config` with what it leaves to a run's first start taken from the run's saved config: data.add_bos (null
    follows the tokenizer; a run started before the key existed saved false)."""
    data, then = config.data, saved.data
    if getattr(data, "add_bos", True) is None and getattr(then, "add_bos", None) is not None:
        return config.model_copy(update={"data": data.model_copy(update={"add_bos": then.add_bos})})
    return config


def _with_horizon(config: Config, steps: int) -> Config:
    return config.model_copy(update={"optimizer": config.optimizer.model_copy(update={"decay_steps": steps})})


def check_writable(run_dir: Path) -> list[Path]:
    """Make `run_dir` (and its missing parents) unless it cannot be: returns the directories made, `run_dir` first
    (the order they can be removed in)."""
    existing, missing = run_dir, []
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if existing != run_dir and not existing.is_dir():
        raise UserError(f"trainer.run_dir={str(run_dir)!r} lies under {str(existing)!r}, which is a file; choose a "
                        "directory path")
    if existing == run_dir and not run_dir.is_dir():
        raise UserError(f"trainer.run_dir={str(run_dir)!r} is a file, not a directory; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"trainer.run_dir={str(run_dir)!r} is not writable ({str(existing)!r} does not allow "
                        "this user to write); choose another path")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"trainer.run_dir={str(run_dir)!r} cannot be created ({err.strerror or first_line(err)}); "
                        "choose another path") from None
    return missing


def _check_same_run(config: Config, saved: Config, saved_path: Path) -> None:
    before, now = flatten(saved.model_dump(mode="json")), flatten(config.model_dump(mode="json"))
    changed = sorted(key for key in set(before) | set(now)
                     if before.get(key) != now.get(key) and not key.startswith(RESUMABLE_KEYS))
    if changed:
        raise UserError(f"trainer.run_dir={str(saved_path.parent)!r} holds a run with a different config "
                        f"({', '.join(changed)} differ); resume it with the same settings or choose a new "
                        "trainer.run_dir")


def read_run_config(run_dir: Path) -> Config:
    """The config a run directory was created with (its saved `config.yaml`)."""
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        raise UserError(f"{str(run_dir)!r} is not an xlatrain run directory (no {CONFIG_FILE})")
    return _read_saved(saved_path)


def pinned_partition(run_dir: Path) -> tuple[int, ...] | None:
    """The block partition a pipelined run chose at its first start (config.yaml's derived.pipeline_partition),
    so that its checkpoints are read back into the same stages whatever `partition: auto` would choose now;
    None for a new run or one that is not pipelined."""
    partition = saved_derived(run_dir).get("pipeline_partition")
    if partition is None:
        return None
    if not (isinstance(partition, list) and partition
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in partition)):
        raise UserError(f"{run_dir / CONFIG_FILE}: derived.pipeline_partition={partition!r} is not a list of block "
                        "counts; restore the file from the run's first start, or move the run directory aside")
    return tuple(partition)


def pinned_cpu_matmul(run_dir: Path) -> str | None:
    """The dense layers' CPU kernels a run chose at its first start (config.yaml's derived.cpu_matmul; XLA's for a
    run started before the choice existed), so that runtime.cpu_matmul=auto resumes it on the same kernels; None
    for a new run."""
    if not (run_dir / CONFIG_FILE).is_file():
        return None
    chosen = saved_derived(run_dir).get("cpu_matmul", "xla")
    if chosen not in CPU_KERNELS:
        raise UserError(f"{run_dir / CONFIG_FILE}: derived.cpu_matmul={chosen!r} is not one of "
                        f"{', '.join(CPU_KERNELS)}; restore the file from the run's first start, or move the run "
                        "directory aside")
    return chosen


def saved_derived(run_dir: Path) -> dict:
    """The derived values config.yaml holds ({} for a new run): what the run was when it was last started."""
    saved_path = run_dir / CONFIG_FILE
    derived = _read_mapping(saved_path).get(DERIVED_SECTION) if saved_path.is_file() else None
    return derived if isinstance(derived, dict) else {}


MOVE_IT_ASIDE = "move the run directory aside or choose another trainer.run_dir"


def _read_mapping(saved_path: Path) -> dict:
    try:
        saved = parse_yaml(saved_path.read_text(encoding="utf-8"), str(saved_path))
    except UnicodeDecodeError as err:
        raise UserError(f"{saved_path} is not a UTF-8 text file ({first_line(err)}); {MOVE_IT_ASIDE}") from None
    except UserError as err:  # YAML that does not parse, named by file, line and column
        raise UserError(f"{err}; {MOVE_IT_ASIDE}") from None
    if not isinstance(saved, dict):
        raise UserError(f"{saved_path} does not hold an xlatrain config (a mapping of keys); {MOVE_IT_ASIDE}")
    return saved


def _read_saved(saved_path: Path) -> Config:
    saved = _read_mapping(saved_path)
    try:
        return validate_config(upgraded_saved_config(without_derived(saved)))
    except UserError as err:
        raise UserError(f"{saved_path} is not a valid xlatrain config ({err}); {MOVE_IT_ASIDE}") from None
