"""xlatrain from Python: `import xlatrain` stays light, Trainer(config).fit() with callbacks and early stopping,
two runs in one process, and signals that never end the process a Trainer runs in."""

import json
import os
import subprocess
import sys

import pytest
from conftest import COMPILE_FASTER, DIGITS_MLP, REPO

import xlatrain


def test_import_xlatrain_loads_no_jax_and_exports_the_api_lazily():
    script = ("import sys, xlatrain; assert 'jax' not in sys.modules, 'jax imported'; "
              "print(xlatrain.Trainer.__module__, xlatrain.load_config.__module__, sorted(xlatrain.__all__))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["xlatrain.api", "xlatrain.config.loading"]
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        xlatrain.Trainr


class Recorder(xlatrain.Callback):
    def __init__(self):
        self.events = []

    def on_step(self, step, metrics):
        self.events.append(("step", step, round(metrics["loss"], 6)))

    def on_eval(self, step, metrics):
        self.events.append(("eval", step, sorted(metrics)))

    def on_checkpoint(self, step, directory):
        self.events.append(("checkpoint", step, directory.name))

    def on_end(self, result):
        self.events.append(("end", result.final_step, result.stopped_by))


@pytest.mark.parametrize("fused", [1, 4])
def test_a_trainer_from_a_mapping_calls_its_callbacks_in_order_and_returns_the_run(tmp_path, fused):
    mapping = {"model": {"name": "mlp", "hidden": [32]}, "data": {"source": "digits"}, "batch": {"global_size": 32},
               "trainer": {"steps": 8, "eval_every": 4, "checkpoint_every": 4, "log_every": 1,
                           "steps_per_sync": fused, "run_dir": str(tmp_path / "run")}}
    recorder = Recorder()
    result = xlatrain.Trainer(mapping, ["trainer.progress=false"], callbacks=[recorder], echo=None).fit()
    assert result.run_dir == tmp_path / "run" and result.final_step == 8 and result.stopped_by == ""
    logged = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert [e for e in recorder.events if e[0] == "step"] == [("step", s, round(logged[s]["loss"], 6))
                                                              for s in range(1, 9)]
    assert [e[:2] for e in recorder.events if e[0] != "step"] == [("eval", 4), ("checkpoint", 4), ("eval", 8),
                                                                  ("checkpoint", 8), ("end", 8)]
    assert ("eval", 4, ["eval_accuracy", "eval_loss"]) in recorder.events and recorder.events[-1] == ("end", 8, "")
    assert result.metrics["loss"] == logged[8]["loss"] and result.eval_metrics["step"] == 8
    again = xlatrain.Trainer(mapping, ["trainer.progress=false"], echo=None).fit()  # at its last step already
    assert again.final_step == 8 and again.metrics["loss"] == logged[8]["loss"] and again.eval_metrics["step"] == 8


@pytest.mark.parametrize("given, expected", [
    (object(), "Trainer(callbacks=...) takes a Callback or a list of them, not object"),
    ([Recorder(), print], "Trainer(callbacks=...)[1] is builtin_function_or_method, not a Callback: subclass "
                          "xlatrain.Callback"),
    ([Recorder], "Trainer(callbacks=...)[0] is Recorder (a class: pass an instance of it), not a Callback"),
])
def test_callbacks_that_are_not_callbacks_are_refused_before_the_run_and_one_is_taken_alone(given, expected):
    """They were accepted and failed after the first step inside trainer.py; one Callback not in a list failed with
    "'Callback' object is not iterable"."""
    with pytest.raises(xlatrain.UserError) as refused:
        xlatrain.Trainer(None, callbacks=given)
    assert str(refused.value).startswith(expected)
    recorder = Recorder()
    assert xlatrain.Trainer(None, callbacks=recorder).callbacks == [recorder]


def test_early_stopping_stops_with_a_checkpoint_and_the_run_resumes_from_it(tmp_path):
    common = [*DIGITS_MLP, "trainer.steps=60", "trainer.eval_every=2", "trainer.checkpoint_every=1000",
              f"trainer.run_dir={tmp_path / 'run'}"]
    stop = xlatrain.EarlyStopping(metric="eval_accuracy", mode="max", patience=1, min_delta=1.0)  # never improves
    result = xlatrain.Trainer(None, common, callbacks=[stop], echo=None).fit()
    assert result.interrupted and result.stopped_by.startswith("early stopping: eval_accuracy has not improved on ")
    assert result.final_step < 60 and stop.best_step == 2
    checkpoints = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert checkpoints == [result.final_step]
    lines = []
    resumed = xlatrain.Trainer(None, common, echo=lines.append).fit()
    assert resumed.start_step == result.final_step and resumed.final_step == 60 and resumed.stopped_by == ""
    assert lines[-1].startswith("  finished at step 60;")


TWO_RUNS = """import sys
import xlatrain

common = ["model.name=mlp", "data.source=digits", "model.hidden=[32]", "batch.global_size=32", "trainer.steps=3",
          "trainer.progress=false"]
first = xlatrain.train(None, [*common, "trainer.run_dir=" + sys.argv[1] + "/a"], echo=None)
second = xlatrain.train(None, [*common, "model.hidden=[16]", "trainer.run_dir=" + sys.argv[1] + "/b"], echo=None)
print(first.final_step, second.final_step)
try:
    xlatrain.train(None, [*common, "mesh.cpu_devices=2", "trainer.run_dir=" + sys.argv[1] + "/c"], echo=None)
except xlatrain.UserError as err:
    print(err)
"""


def test_two_runs_in_one_process_and_one_that_needs_other_devices_is_refused(tmp_path):
    """In a process of JAX's own CPU device count (no count in XLA_FLAGS), as a notebook's."""
    done = subprocess.run([sys.executable, "-c", TWO_RUNS, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "XLA_FLAGS": COMPILE_FASTER})
    assert done.returncode == 0, done.stderr[-2000:]
    steps, refused = done.stdout.splitlines()[-2:]
    assert steps == "3 3"
    assert refused.startswith("mesh.cpu_devices: this process started JAX with 1 CPU device(s) before the config "
                              "asked for 2")
    assert not (tmp_path / "c").exists()


SIGNALLED = """import os, signal, sys
import xlatrain

class Interrupt(xlatrain.Callback):
    def __init__(self, at, times):
        self.at, self.times = at, times

    def on_step(self, step, metrics):
        if step == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)

common = ["model.name=mlp", "data.source=digits", "model.hidden=[32]", "batch.global_size=32", "trainer.steps=1000",
          "trainer.eval_every=1000", "trainer.progress=false"]
result = xlatrain.Trainer(None, [*common, "trainer.run_dir=" + sys.argv[1] + "/once"], callbacks=[Interrupt(5, 1)],
                          echo=None).fit()
print("returned", result.stopped_by, result.final_step, sorted(os.listdir(sys.argv[1] + "/once/checkpoints")))
try:
    xlatrain.Trainer(None, [*common, "trainer.run_dir=" + sys.argv[1] + "/twice"], callbacks=[Interrupt(5, 2)],
                     echo=None).fit()
except KeyboardInterrupt as err:
    print("raised", err)
print("the process goes on")
"""


def test_a_trainers_signals_stop_with_a_checkpoint_or_raise_and_never_end_the_process(tmp_path):
    """A notebook's interrupt is SIGINT: the first stops the run with a checkpoint and fit() returns; a second
    raises KeyboardInterrupt, as Python's own handler would; the kernel (this process) lives on."""
    done = subprocess.run([sys.executable, "-c", SIGNALLED, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    returned, raised, goes_on = done.stdout.splitlines()[-3:]
    step = int(returned.split()[2])
    assert returned == f"returned signal {step} ['{step}']" and 5 <= step <= 7
    assert raised == "raised second SIGINT: stopped without saving" and goes_on == "the process goes on"
