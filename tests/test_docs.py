"""The README and docs/ stay true: the documentation builds with no broken link and no page outside the nav, the
configuration reference is the schema's, and the commands and snippets the tests run are the ones written."""

import os
import shlex
import subprocess
import sys

from conftest import REPO, run_cli

from xlatrain.config.reference import reference, undescribed

README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"


def test_the_docs_build_strictly(tmp_path):
    """mkdocs.yml's validation makes a broken link or anchor, and a page missing from the nav, a warning; --strict
    fails on any warning."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_configuration_reference_is_the_schemas():
    """Every key has a description, and docs/configuration.md is what the schema generates: a key added, removed,
    renamed, or given another default or description fails here until the page is regenerated."""
    assert not undescribed(), f"config keys without a docstring: {undescribed()}"
    page = (DOCS / "configuration.md").read_text()
    assert page == reference(), ("docs/configuration.md is stale: regenerate it with "
                                 "python3 -m xlatrain.config.reference > docs/configuration.md")
    for key in ("model.layers", "optimizer.nesterov", "data.glob", "parallel.pipeline.remat",
                "distributed.stall_timeout.hook", "precision.loss_scale.min"):
        assert f"`{key}`" in page


def test_ci_runs_the_readme_commands():
    install_and_run = "python3 -m pip install -e . && xlatrain train"
    test_command = ("python3 -m pip install torch==2.13.0 && python3 -m pip install -e '.[test,torch]' && "
                    "python3 -m pytest")
    assert install_and_run in README and test_command in README
    assert test_command in (REPO / ".ci/run").read_text()


def _block_after(text: str, marker: str, language: str) -> str:
    start = text.index(f"```{language}\n", text.index(marker)) + len(language) + 4
    return text[start:text.index("```", start)]


def test_the_bring_your_own_model_snippet_runs_as_written(tmp_path):
    models = (DOCS / "models.md").read_text()
    (tmp_path / "my_model.py").write_text(_block_after(models, "A complete model in a file of its own", "python"))
    command = shlex.split(_block_after(models, "trains on the digits from the directory that holds it", "bash"))
    assert command[:2] == ["PYTHONPATH=.", "xlatrain"]
    result = run_cli(*command[2:], "trainer.steps=3", "trainer.progress=false", f"trainer.run_dir={tmp_path / 'run'}",
                     env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "finished at step 3" in result.stdout


def test_training_from_python_runs_as_written(tmp_path):
    """getting-started.md's script, in a directory of its own (its run goes to runs/digits-mlp there)."""
    script = _block_after((DOCS / "getting-started.md").read_text(), "## From Python", "python")
    script = script.replace('"examples/configs/digits_mlp.yaml"', repr(str(REPO / "examples/configs/digits_mlp.yaml")))
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=os.environ)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1].startswith("100 "), result.stdout[-2000:]
    assert (tmp_path / "runs" / "digits-mlp" / "checkpoints").is_dir()


def test_the_notebook_of_the_python_page_runs_as_written(tmp_path):
    """docs/python.md's cells, one after another in one interpreter, as a notebook runs them; then again (it
    resumes)."""
    page = (DOCS / "python.md").read_text()
    cells = [block.split("```", 1)[0] for block in page.split("```python\n")[1:]]
    script = "\n".join(cells).replace('"examples/configs/digits_mlp.yaml"',
                                       repr(str(REPO / "examples/configs/digits_mlp.yaml")))
    for attempt in ("first", "again"):
        result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, env=os.environ)
        assert result.returncode == 0, result.stderr[-2000:]
        lines = result.stdout.splitlines()
        assert lines[0].startswith("runs/notebook 200 finished") or "early stopping" in lines[0], lines
        assert lines[1].startswith("last loss") and "'eval_loss'" in lines[1], lines
    assert (tmp_path / "runs" / "notebook" / "checkpoints").is_dir()


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
