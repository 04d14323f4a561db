"""Profiles: trainer.profile_steps and `xlatrain profile` write a jax.profiler trace whose device ops carry the
step's phases."""

import gzip
import json

import pytest
from conftest import DIGITS_MLP, run_cli

from xlatrain.commands.profile import claim_profile_dir
from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.observe.profiling import LONG_WINDOW, ProfileWindow


def test_xlatrain_profile_traces_the_steps_in_a_fresh_run_directory(tmp_path):
    own = tmp_path / "run"
    result = run_cli("profile", *DIGITS_MLP, f"trainer.run_dir={own}", "--steps", "2:3")
    assert result.returncode == 0, result.stderr
    assert not own.exists()  # the config's own run is never written by a profile
    [run_dir] = tmp_path.glob("run-profile-*")
    assert f"profile of steps 2..3 written to {run_dir / 'profile'}" in result.stdout
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line] == [1, 2, 3]
    [xplane] = (run_dir / "profile" / "plugins" / "profile").glob("*/*.xplane.pb")
    trace = xplane.read_bytes()
    for scope in (b"jvp(forward)", b"transpose(jvp(forward))", b"/sync/", b"/clip/", b"/update/"):
        assert scope in trace, scope
    [perfetto] = xplane.parent.glob("perfetto_trace.json.gz")
    assert json.loads(gzip.decompress(perfetto.read_bytes()))


def test_profiles_started_in_the_same_second_get_their_own_directories(tmp_path):
    run_dir = tmp_path / "runs" / "gpt"
    first, second = (claim_profile_dir(run_dir, "20261126-105624") for _ in range(2))
    assert (first.name, second.name) == ("gpt-profile-20261126-105624", "gpt-profile-20261126-105624-2")
    assert first.is_dir() and second.is_dir() and not run_dir.exists()


@pytest.mark.parametrize("window,message", [
    ("[3,2]", r"profile_steps=\[3, 2\] must be \[first, last\] with first <= last <= trainer.steps=5"),
    ("[2,9]", r"profile_steps=\[2, 9\] must be \[first, last\] with first <= last <= trainer.steps=5"),
    ("[3]", r"profile_steps: must be \[first, last\]: two step numbers from 1 .* \(got \[3\]\)"),
    ("[0,2]", r"profile_steps: must be \[first, last\]: two step numbers from 1 .* \(got \[0, 2\]\)")])
def test_a_window_outside_the_run_is_a_config_error(window, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [*DIGITS_MLP, "trainer.steps=5", f"trainer.profile_steps={window}"])


def test_a_malformed_step_window_is_one_line():
    result = run_cli("profile", *DIGITS_MLP, "--steps", "0:2")
    assert result.returncode == 2 and "'0:2' is not A:B with 1 <= A <= B" in result.stderr, result.stderr


def test_a_trace_the_file_system_refuses_is_a_warning_and_leaves_no_partial_trace(tmp_path, monkeypatch, capsys):
    import jax

    from xlatrain.observe.profiling import TRACE_SESSIONS, ProfileWindow

    sessions = tmp_path / "profile" / TRACE_SESSIONS
    (sessions / "2026_11_27_10_00_00").mkdir(parents=True)  # an earlier session's trace: kept
    failures = iter([jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: {sessions}/2026_11_28_10_00_00/vm.xplane.pb; "
                                                "No space left on device"),
                     jax.errors.JaxRuntimeError("INTERNAL: a profiler bug")])

    def stop_trace():
        (sessions / "2026_11_28_10_00_00").mkdir(exist_ok=True)
        (sessions / "2026_11_28_10_00_00" / "vm.xplane.pb").write_bytes(b"trunc")
        raise next(failures)

    monkeypatch.setattr(jax.profiler, "start_trace", lambda *args, **kwargs: None)
    monkeypatch.setattr(jax.profiler, "stop_trace", stop_trace)
    said = []
    window = ProfileWindow((2, 3), tmp_path, said.append)
    window.before_dispatch(2, 2)
    window.close()
    assert capsys.readouterr().err.splitlines() == [
        f"xlatrain: warning: the profile of steps 2..3 could not be written to {tmp_path / 'profile'} (No space left "
        "on device); its partial trace is removed, the training is not affected: make room, then trace again with "
        "`xlatrain profile`"]
    assert [p.name for p in sessions.iterdir()] == ["2026_11_27_10_00_00"] and said == []

    window = ProfileWindow((2, 3), tmp_path, said.append)
    window.before_dispatch(1, 2)
    with pytest.raises(jax.errors.JaxRuntimeError, match="a profiler bug"):
        window.close()


def test_a_session_resumed_inside_the_window_says_which_steps_it_traced(tmp_path, monkeypatch):
    import jax

    from xlatrain.observe.profiling import ProfileWindow

    monkeypatch.setattr(jax.profiler, "start_trace", lambda *args, **kwargs: None)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    said = []
    window = ProfileWindow((2, 5), tmp_path, said.append)
    window.before_dispatch(4, 4)  # resumed from the checkpoint of step 3
    window.after_boundary(5, state=None)
    assert said[0].startswith(f"  profile of steps 4..5 written to {tmp_path / 'profile'}:"), said


@pytest.mark.parametrize("signalled", [False, True])
def test_xlatrain_profile_that_wrote_no_trace_fails_unless_a_stop_signal_ended_it(tmp_path, monkeypatch, capsys,
                                                                                   signalled):
    import signal

    from xlatrain import cli
    from xlatrain.runtime import signals as stop

    def train_without_tracing(_config_path, _overrides, _args, once_joined):
        once_joined()  # claims the directory
        if signalled:
            stop._current.received.append(signal.SIGTERM)  # stopped before the first step
        return 0

    monkeypatch.setattr(cli, "_train", train_without_tracing)
    code = cli.main(["profile", *DIGITS_MLP, f"trainer.run_dir={tmp_path / 'run'}", "--steps", "2:3"])
    error = capsys.readouterr().err
    if signalled:
        assert code == 0 and error == ""
    else:
        [run_dir] = tmp_path.glob("run-profile-*")
        assert code == 2 and error == (f"xlatrain: error: profile: no trace was written to {run_dir / 'profile'} "
                                       "(the warning above says why)\n")


@pytest.mark.parametrize(("steps", "warned"), [((3, 5), False), ((1, LONG_WINDOW), False),
                                               ((1, LONG_WINDOW + 1), True), ((1, 100_000), True)])
def test_a_window_long_enough_to_fill_host_memory_is_warned_about(tmp_path, capsys, steps, warned):
    ProfileWindow(steps, tmp_path, print)
    err = capsys.readouterr().err
    assert ("host memory until the last one" in err) == warned
    if warned:
        assert f"traces {steps[1]:,} steps" in err and "e.g. [1, 3]" in err


GPU_TRACE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 6000000000 }
    events { metadata_id: 2 offset_ps: 7000000000 duration_ps: 2000000000 }
    events { metadata_id: 3 offset_ps: 9000000000 duration_ps: 1000000000 }
    events { metadata_id: 4 offset_ps: 10000000000 duration_ps: 500000000 }
    events { metadata_id: 1 offset_ps: 11000000000 duration_ps: 6000000000 } }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 1000 events { metadata_id: 1 offset_ps: 0 duration_ps: 6000000000 } }
  event_metadata { key: 1 value { id: 1 name: "gemm_fusion_dot_48" } }
  event_metadata { key: 2 value { id: 2 name: "cudnn_generated_fort_native_sdpa_sm90_flash_fprop" } }
  event_metadata { key: 3 value { id: 3 name: "loop_dynamic_update_slice_fusion_3" } }
  event_metadata { key: 4 value { id: 4 name: "input_add_reduce_fusion_1" } }
}
planes { id: 2 name: "/host:CPU" lines { id: 1 name: "python3" events { metadata_id: 1 duration_ps: 99000000000 } }
  event_metadata { key: 1 value { id: 1 name: "gemm_on_the_host" } } }
"""


def test_a_gpu_traces_kernels_are_split_by_what_they_do_per_step():
    """Only the GPU's streams count: the XLA Ops line repeats their kernels, and the host's events are no kernels."""
    from jax.profiler import ProfileData

    from xlatrain.observe.trace_kernels import split_of

    split = split_of(ProfileData.from_text_proto(GPU_TRACE), steps=2)
    assert split == {"ms_per_step": 7.75, "kernels_per_step": 2.5,
                     "by_class": {"matmul": {"ms": 6.0, "kernels": 1.0}, "attention": {"ms": 1.0, "kernels": 0.5},
                                  "scan slices": {"ms": 0.5, "kernels": 0.5},
                                  "reduction": {"ms": 0.25, "kernels": 0.5}}}
