"""trainer.compile_cache: JAX's persistent compilation cache, so that a second start loads its executables."""

import re
from pathlib import Path

import pytest
from conftest import DIGITS_MLP, run_cli

from xlatrain.errors import UserError
from xlatrain.runtime.compile_cache import MIN_COMPILE_TIME_ENV, cache_dir, use_compile_cache


def test_auto_is_jaxs_own_directory_when_set_else_a_per_user_one(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("auto") == tmp_path / "xdg" / "xlatrain" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir("auto") == Path.home() / ".cache" / "xlatrain" / "jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert cache_dir("auto") == tmp_path / "jax"
    assert cache_dir("~/c") == Path.home() / "c" and cache_dir("off") is None


def test_a_directory_that_cannot_be_made_is_one_error_naming_the_field(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"trainer.compile_cache='.*file/cache': cannot create .* or set "
                                        r"trainer.compile_cache=off"):
        use_compile_cache(str(tmp_path / "file" / "cache"))


def _compilations(result) -> tuple[int, int]:
    """(compilations, of them loaded from the persistent cache), from the run summary."""
    assert result.returncode == 0, result.stderr
    found = re.search(r"compilations (\d+) \([\d.]+s, (\d+) loaded from the persistent cache\)", result.stdout)
    return int(found.group(1)), int(found.group(2))


def _loaded_from_cache(result) -> int:
    return _compilations(result)[1]


def _start(run_dir, setting, env=None):
    """A 1-step run of the tiny MLP in a fresh process with trainer.compile_cache=SETTING."""
    return run_cli("train", *DIGITS_MLP, "trainer.steps=1", f"trainer.run_dir={run_dir}",
                   f"trainer.compile_cache={setting}", env=env)


def test_a_second_start_loads_every_compilation_from_the_cache_and_off_writes_nothing(tmp_path):
    """Three 1-step runs of the same config in fresh processes. The tiny MLP's compilations all take less than
    JAX's default threshold of a second, under which JAX alone would keep none."""
    cache = tmp_path / "cache"

    def start(name, setting):
        return _start(tmp_path / name, setting)

    first = start("first", cache)
    assert f"compile cache {cache} (trainer.compile_cache)" in first.stdout
    assert _loaded_from_cache(first) == 0 and list(cache.glob("jit_train_step-*"))
    compiled, loaded = _compilations(start("second", cache))
    assert loaded == compiled >= 3, (compiled, loaded)  # init, the train step and the eval step at least
    entries = sorted(cache.iterdir())
    off = start("off", "off")
    assert "compile cache off" in off.stdout and _loaded_from_cache(off) == 0 and sorted(cache.iterdir()) == entries


def test_jaxs_own_threshold_decides_when_set(tmp_path):
    cache = tmp_path / "cache"
    done = _start(tmp_path / "run", cache, env={MIN_COMPILE_TIME_ENV: "1000"})
    assert _loaded_from_cache(done) == 0 and list(cache.iterdir()) == []


def test_an_entry_cut_short_is_replaced_instead_of_failing_every_later_start(tmp_path):
    """JAX writes an entry in place, so a kill or a full disk during the write leaves it short; JAX alone would
    warn and compile at every later start, and never write that entry again."""
    cache = tmp_path / "cache"

    def start(name):
        return _start(tmp_path / name, cache)

    assert _loaded_from_cache(start("first")) == 0
    [entry] = cache.glob("jit_train_step-*-cache")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    cut = start("second")
    assert _loaded_from_cache(cut) >= 2  # every entry but the cut one
    [warning] = [line for line in cut.stderr.splitlines() if "compile cache" in line]
    assert warning.startswith(f"xlatrain: warning: compile cache entry {entry} could not be read (")
    assert warning.endswith("); removed it, so this compilation is written there again")
    assert "UserWarning" not in cut.stderr and entry.stat().st_size > 0
    third = start("third")
    assert _loaded_from_cache(third) == _loaded_from_cache(cut) + 1 and "compile cache" not in third.stderr


def test_entries_swapped_between_programs_are_replaced_instead_of_failing_in_jax(tmp_path):
    """Two entries' files swapped (or one copied over another): JAX would load the eval step's executable for
    the train step and fail on an AssertionError deep inside it; each is dropped and compiled afresh instead."""
    cache = tmp_path / "cache"

    def start(name):
        return _start(tmp_path / name, cache)

    assert _loaded_from_cache(start("first")) == 0
    [train] = cache.glob("jit_train_step-*-cache")
    [evaluate] = cache.glob("jit_eval_step-*-cache")
    train_bytes = train.read_bytes()
    train.write_bytes(evaluate.read_bytes())
    evaluate.write_bytes(train_bytes)
    swapped = start("second")
    compiled, loaded = _compilations(swapped)
    assert loaded == compiled - 2, (compiled, loaded)
    warnings = sorted(line for line in swapped.stderr.splitlines() if "compile cache" in line)
    assert warnings == [f"xlatrain: warning: compile cache entry {evaluate} holds the executable of another program "
                        "(jit_train_step); removed it, so this compilation is written there again",
                        f"xlatrain: warning: compile cache entry {train} holds the executable of another program "
                        "(jit_eval_step); removed it, so this compilation is written there again"]
    third = start("third")
    assert _loaded_from_cache(third) == compiled and "compile cache" not in third.stderr


def test_entries_the_file_system_refuses_are_said_once_and_removed(tmp_path, monkeypatch):
    """JAX warns for every entry it cannot write (a full disk: each compilation of the run); xlatrain says it
    once, and removes what the refused write left."""
    import errno
    import os

    import jax
    from jax._src import compilation_cache

    from xlatrain.compat.persistent_cache import report_unwritable_cache_entries

    def full_disk(cache_key, *args):
        (tmp_path / f"{cache_key}-cache").write_bytes(b"cut sh")
        if cache_key == "other":
            raise ValueError("not the file system")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(compilation_cache, "put_executable_and_time", full_disk)
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    said = []
    try:
        report_unwritable_cache_entries(said.append)
        for key in ("jit_init-1", "jit_train_step-2"):
            compilation_cache.put_executable_and_time(key, "module", None, None, 1)
        with pytest.raises(ValueError, match="not the file system"):  # JAX's own warning reports it
            compilation_cache.put_executable_and_time("other", "module", None, None, 1)
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
    assert said == [f"compile cache {tmp_path}: entries cannot be written (No space left on device); compilations "
                    "are not cached until there is room (said once)"]
    assert [p.name for p in tmp_path.iterdir()] == ["other-cache"]
