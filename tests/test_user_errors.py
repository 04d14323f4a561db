"""Every ordinary user mistake, through the real CLI: exit 2 and one line on stderr that names the field or file,
found before anything expensive runs; never a traceback or library noise."""

import os

import numpy as np
import pytest
from conftest import DIGITS_MLP, REPO, run_cli

from xlatrain.sizes import readable_bytes

CUSTOM = ["examples/custom_model/custom_model.yaml", "trainer.steps=2", "trainer.progress=false"]


def assert_one_line_error(result, *expected: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xlatrain"), result.stderr[-2000:]
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "malformed.yaml").write_text("model:\n  name: mlp\n  hidden: [1, 2\n")
    (tmp_path / "tabs.yaml").write_text("model:\n\tname: mlp\n")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "duplicate.yaml").write_text("seed: 1\ntrainer:\n  steps: 2\nseed: 2\n")
    (tmp_path / "a_directory").mkdir()
    (tmp_path / "a_file").write_text("not a directory")
    return tmp_path


@pytest.mark.parametrize("args, expected", [
    (["malformed.yaml"], ["malformed.yaml:4:1:", "expected ',' or ']'"]),
    (["tabs.yaml"], ["tabs.yaml:2:1:", "not tabs"]),
    (["binary.yaml"], ["binary.yaml is not a UTF-8 text file"]),
    (["latin1.yaml"], ["latin1.yaml is not a UTF-8 text file"]),
    (["list.yaml"], ["list.yaml must hold a mapping", "not a list"]),
    (["a_directory"], ["'a_directory' is a directory"]),
    (["duplicate.yaml"], ["duplicate.yaml:4:1: duplicate key 'seed' (first at line 1)"]),
    (["optimizer=[]"], ["optimizer must be a mapping"]),
    (["trainer.steps"], ["'trainer.steps' is neither a YAML file nor key=value", "trainer.steps=VALUE"]),
    (["missing.yaml"], ["file 'missing.yaml' not found"]),
    (["data.glob="], ["data.glob"]),
    (["data.glob=/etc/*.py"], ["data.glob='/etc/*.py' must be a non-empty pattern relative to data.path"]),
    (["seed=4294967296"], ["seed", "4294967295"]),
    (["seed=-1"], ["seed"]),
    (["batch.global_size=99999999999999999999999"], ["batch.global_size", "2147483647"]),
    (["model.width=10000000000000000000", "model.heads=1"], ["model.width"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["parallel.mode=jit", "mesh.stage=2"], ["mesh.stage=2 runs a pipeline", "parallel.mode=auto or shard_map"]),
])
def test_config_mistakes(files, args, expected):
    assert_one_line_error(run_cli("config", *args, cwd=files, env={"PYTHONPATH": str(REPO)}), *expected)


@pytest.mark.parametrize("run_dir, expected", [
    ("a_file", "is a file, not a directory"),
    ("a_file/run", "lies under"),
    ("/proc/xlatrain-run", "cannot be created"),
])
def test_unusable_run_dir(files, run_dir, expected):
    path = run_dir if run_dir.startswith("/") else str(files / run_dir)
    result = run_cli("train", *DIGITS_MLP, "trainer.steps=2", f"trainer.run_dir={path}")
    assert_one_line_error(result, "trainer.run_dir", expected)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: permissions cannot make a directory "
                    "unwritable for this test")
def test_unwritable_run_dir(files):
    locked = files / "locked"
    locked.mkdir(mode=0o500)
    result = run_cli("train", *DIGITS_MLP, "trainer.steps=2", f"trainer.run_dir={locked / 'run'}")
    assert_one_line_error(result, "trainer.run_dir", "is not writable")


def _arrays(path, inputs, targets):
    np.savez(path, inputs=inputs, targets=targets)
    return path


@pytest.mark.parametrize("name, make, loss, expected", [
    ("float_labels", lambda x: _float(x), "cross_entropy", ["targets has dtype float32", "integer class labels"]),
    ("bool_labels", lambda x: np.ones(len(x), bool), "cross_entropy", ["targets has dtype bool"]),
    ("negative", lambda x: np.where(np.arange(len(x)) == 5, -3, 1), "cross_entropy", ["targets[5] holds the label -3"]),
    ("int32_max", lambda x: np.where(np.arange(len(x)) == 7, 2**31 - 1, 1), "cross_entropy",
     ["targets[7] holds the label 2147483647", "2147483648 classes", "remap them"]),
    ("nan_targets", lambda x: np.where(np.arange(len(x)) == 2, np.nan, 1.0), "mse", ["targets holds NaN or inf"]),
])
def test_bad_arrays_are_named(tmp_path, name, make, loss, expected):
    inputs = np.random.default_rng(0).normal(size=(40, 8, 8)).astype(np.float32)
    path = _arrays(tmp_path / f"{name}.npz", inputs, make(inputs))
    result = run_cli("train", *DIGITS_MLP, "data.source=arrays", f"data.path={path}", f"model.loss={loss}",
                     "trainer.steps=2", f"trainer.run_dir={tmp_path / 'run'}")
    assert_one_line_error(result, f"data.path='{path}'", *expected)
    assert not (tmp_path / "run" / "config.yaml").exists()


def _float(x):
    return np.linspace(0, 1, len(x)).astype(np.float32)


def test_unreadable_arrays(tmp_path):
    inputs = np.zeros((40, 8, 8), np.float32)
    good = _arrays(tmp_path / "good.npz", inputs, np.arange(40) % 10)
    cases = {"truncated.npz": good.read_bytes()[:300], "text.npz": b"hello", "empty_rows.npz": None,
             "nan_inputs.npz": None, "one.npy": None}
    (tmp_path / "truncated.npz").write_bytes(cases["truncated.npz"])
    (tmp_path / "text.npz").write_bytes(cases["text.npz"])
    _arrays(tmp_path / "empty_rows.npz", inputs[:0], np.zeros(0, np.int64))
    _arrays(tmp_path / "nan_inputs.npz", np.where(np.arange(40)[:, None, None] == 7, np.nan, inputs),
            np.arange(40) % 10)
    np.save(tmp_path / "one.npy", inputs)
    expected = {"truncated.npz": "could not be read as numpy arrays", "text.npz": "could not be read as numpy arrays",
                "empty_rows.npz": "inputs is empty", "nan_inputs.npz": "inputs[7] holds NaN or inf",
                "one.npy": "holds one array"}
    for name in cases:
        result = run_cli("train", *DIGITS_MLP, "data.source=arrays", f"data.path={tmp_path / name}",
                         "trainer.steps=2", f"trainer.run_dir={tmp_path / 'run'}")
        assert_one_line_error(result, name, expected[name])


@pytest.mark.parametrize("override, expected", [
    ("model.kwargs.widht=3", ["model.kwargs.widht is not an argument", "it accepts in_features, width, depth"]),
    ("model.kwargs.width=abc", ["raised TypeError when built with model.kwargs"]),
    ("model.kwargs.classes=5", ["has labels up to 9 (10 classes), more than its 5 outputs"]),
    ("model.target=residual_mlp:Missing", ["has no 'Missing'"]),
    ("model.target=no_such_module:Net", ["cannot import 'no_such_module'"]),
])
def test_user_model_mistakes(tmp_path, override, expected):
    result = run_cli("train", *CUSTOM, override, f"trainer.run_dir={tmp_path / 'run'}",
                     env={"PYTHONPATH": "examples/custom_model"})
    assert_one_line_error(result, *expected)


def test_model_whose_import_raises(tmp_path):
    (tmp_path / "broken_model.py").write_text("import math\nraise RuntimeError('no GPU here')\n")
    (tmp_path / "syntax_model.py").write_text("def f(:\n")
    for module, expected in (("broken_model", "RuntimeError: no GPU here"), ("syntax_model", "SyntaxError")):
        result = run_cli("train", *CUSTOM, f"model.target={module}:Net", f"trainer.run_dir={tmp_path / 'run'}",
                         env={"PYTHONPATH": str(tmp_path)})
        assert_one_line_error(result, f"importing {module!r} raised", expected)


def test_a_model_too_large_for_memory_is_refused_before_allocating(tmp_path):
    result = run_cli("train", "model.width=60000", "model.heads=1", f"trainer.run_dir={tmp_path / 'run'}")
    assert_one_line_error(result, "the train state (params and optimizer state) needs", "GiB", "model.* sizes")


@pytest.mark.parametrize("count, text", [(0, "0 B"), (1023, "1023 B"), (64 * 2**10, "64.0 KiB"),
                                         (912_017, "890.6 KiB"), (1_880_553, "1.8 MiB"), (3159507968, "2.9 GiB"),
                                         (5 * 2**40, "5.0 TiB"), (2**60, "1048576.0 TiB")])
def test_sizes_in_messages_are_in_the_unit_that_keeps_a_digit_before_the_point(count, text):
    """Not "needs 0.0 GiB" for a state of a few KiB."""
    assert readable_bytes(count) == text


def test_a_step_too_large_for_memory_is_refused_before_the_run_directory_holds_anything(tmp_path):
    """XLA's memory analysis of the compiled step (here the activations of 128 rows of 32768 tokens, hundreds of GiB
    per device) against a device's memory: the step would have run into an out-of-memory kill. Refused before
    config.yaml is written, so that a corrected config can start in the same run directory."""
    run_dir = tmp_path / "run"
    result = run_cli("train", "data.seq_len=32768", "batch.global_size=128", f"trainer.run_dir={run_dir}")
    assert_one_line_error(result, "config: the train_step needs", "GiB per device by XLA's memory analysis",
                          "raise batch.microbatches")
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()


MISFITS = '''
import jax.numpy as jnp
from flax import nnx


class Out(nnx.Module):
    """A model whose output does not fit the loss, in the way `kind` names."""

    def __init__(self, kind: str, *, rngs: nnx.Rngs):
        self.kind = kind
        self.linear = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        logits = self.linear(x.reshape(x.shape[0], -1))
        return {"rows": logits[:, 0], "extra_axis": jnp.stack([logits, logits], -1), "broadcast": logits[:1],
                "integer": logits.astype(jnp.int32), "complex": logits.astype(jnp.complex64),
                "three_features": logits[:, :3]}[self.kind]
'''


@pytest.mark.parametrize("kind, loss, expected", [
    ("rows", "cross_entropy", "returns [2] float32"),
    ("extra_axis", "cross_entropy", "needs logits shaped [*targets, classes]"),
    ("broadcast", "cross_entropy", "returns [1, 10] float32"),
    ("integer", "cross_entropy", "needs floating-point outputs"),
    ("complex", "cross_entropy", "needs floating-point outputs"),
    ("three_features", "mse", "model.loss=mse needs outputs shaped like the targets [2, 2]"),
])
def test_a_user_models_output_that_does_not_fit_the_loss(tmp_path, kind, loss, expected):
    (tmp_path / "misfits.py").write_text(MISFITS)
    data = ["data.source=digits"]
    if loss == "mse":
        rng = np.random.default_rng(0)
        path = _arrays(tmp_path / "pairs.npz", rng.normal(size=(40, 8, 8)).astype(np.float32),
                       rng.normal(size=(40, 2)).astype(np.float32))
        data = ["data.source=arrays", f"data.path={path}"]
    result = run_cli("train", "model.name=custom", "model.target=misfits:Out", f"model.kwargs.kind={kind}",
                     f"model.loss={loss}", *data, "trainer.steps=2", f"trainer.run_dir={tmp_path / 'run'}",
                     env={"PYTHONPATH": str(tmp_path)})
    assert_one_line_error(result, "model: model.target='misfits:Out' returns", expected)
