"""The README stays true: every config key is documented, and its commands are the ones CI runs."""

import shlex
import typing

from conftest import REPO, run_cli
from pydantic import BaseModel

from xlatrain.config import Config

README = (REPO / "README.md").read_text()


def config_keys(cls: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in cls.model_fields.items():
        options = typing.get_args(field.annotation) or (field.annotation,)
        models = [c for c in options if isinstance(c, type) and issubclass(c, BaseModel)]
        if models:
            for model in models:
                keys |= config_keys(model, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_every_config_key_is_in_the_reference():
    keys = config_keys(Config)
    assert "model.layers" in keys and "optimizer.nesterov" in keys and "data.glob" in keys
    missing = sorted(k for k in keys if f"`{k}`" not in README and f"`{k}`," not in README)
    assert not missing, f"README config reference lacks {missing}"


def test_ci_runs_the_readme_test_command():
    test_command = ("python3 -m pip install torch==2.13.0 && python3 -m pip install -e '.[test,torch]' && "
                    "python3 -m pytest")
    assert test_command in README
    assert test_command in (REPO / ".ci/run").read_text()


def _block_after(marker: str, language: str) -> str:
    start = README.index(f"```{language}\n", README.index(marker)) + len(language) + 4
    return README[start:README.index("```", start)]


def test_the_bring_your_own_model_snippet_runs_as_written(tmp_path):
    (tmp_path / "my_model.py").write_text(_block_after("A complete model in a file of its own", "python"))
    command = shlex.split(_block_after("trains on the digits from the directory that holds it", "bash"))
    assert command[:2] == ["PYTHONPATH=.", "xlatrain"]
    result = run_cli(*command[2:], "trainer.steps=3", "trainer.progress=false", f"trainer.run_dir={tmp_path / 'run'}",
                     env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "finished at step 3" in result.stdout


def test_the_pipeline_help_examples_run_as_written(tmp_path, capsys, devices):
    """In this process, whose 8 CPU devices are the ones the examples ask for."""
    from xlatrain.cli import PIPELINE_EXAMPLES, main

    lines = [line.strip() for line in PIPELINE_EXAMPLES.splitlines() if line.strip().startswith("xlatrain pipeline")]
    assert len(lines) == 3
    for line in lines:
        args = shlex.split(line)[2:]
        out = [a for a in args if a.endswith(".png")]
        args = [str(tmp_path / a) if a in out else a for a in args]
        returncode = main(["pipeline", *args, *([] if out else ["--out", str(tmp_path / "chart.png")])])
        printed = capsys.readouterr()
        assert returncode == 0, (line, printed.err[-2000:])
        assert "bubble" in printed.out
