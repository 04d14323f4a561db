"""Recompilation control: shape buckets with masked padding, every compile counted with its cause, a
compile budget, and the run summary behind `xlatrain report`."""

import re

import numpy as np
import pytest
from conftest import run_cli
from xlatrain.lowering.compile import CompileBudgetExceeded

from xlatrain.config import load_config
from xlatrain.data.loader import make_global, pad_to_bucket
from xlatrain.data.sources import paragraph_spans
from xlatrain.mesh import eval_batch_sharding
from xlatrain.program import build_program
from xlatrain.run.metrics import read_metrics
from xlatrain.trainer import train


def corpus(tmp_path):
    """200 short paragraphs (bucket 8), then 200 long ones (bucket 32)."""
    text = "\n\n".join(["short"] * 200 + ["a longer paragraph, 29 bytes"] * 200)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "text.txt").write_text(text)
    return ["model.layers=1", "model.width=32", "model.heads=2", "data.seq_len=32", "data.buckets=[8,16]",
            f"data.path={tmp_path / 'corpus'}", "data.glob='*.txt'", "data.shuffle=false", "trainer.progress=false",
            "trainer.eval_every=1000", "trainer.log_every=1"]


def test_paragraphs_become_variable_length_spans():
    tokens = np.frombuffer(b"ab\n\ncdef\n\n\n" + b"x" * 20, np.uint8)
    spans = paragraph_spans(tokens, max_len=8)
    assert [bytes(tokens[a:b]) for a, b in spans] == [b"ab\n", b"cdef\n", b"x" * 9, b"x" * 9, b"xxxx"]


def test_batches_are_padded_to_the_shortest_fitting_bucket_with_a_mask():
    examples = [{"inputs": np.arange(3), "targets": np.arange(1, 4)}, {"inputs": np.arange(6), "targets": np.arange(6)}]
    batch = pad_to_bucket(examples, buckets=(4, 8, 16))
    assert batch["inputs"].shape == batch["targets"].shape == batch["mask"].shape == (2, 8)
    np.testing.assert_array_equal(batch["mask"].sum(axis=1), [3, 6])
    np.testing.assert_array_equal(batch["targets"][0], [1, 2, 3, 0, 0, 0, 0, 0])


def test_padding_never_enters_the_loss(tmp_path):
    program = build_program(load_config(None, corpus(tmp_path)))
    state = program.create_state()
    examples = [program.dataset.train[i] for i in range(16)]
    losses = []
    for buckets in [(8,), (32,)]:
        batch = make_global(pad_to_bucket(examples, buckets), eval_batch_sharding(program.mesh), 0, 1)
        losses.append(float(program.eval_step(state, batch)["eval_loss"]))
    assert program.eval_step.executions == 2
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_every_recompile_is_counted_with_its_cause_and_summarised(tmp_path):
    result = train(load_config(None, [*corpus(tmp_path), "trainer.steps=14",
                                      f"trainer.run_dir={tmp_path / 'run'}"]), echo=lambda _: None)
    causes = [(c["step"], c["cause"]) for c in result.summary.step_compilations]
    assert causes == [("train_step", "first compilation"), ("eval_step", "first compilation"),
                      ("train_step", "batch['inputs'] shape (1, 16, 32) -> (1, 16, 8); "
                                     "batch['mask'] shape (1, 16, 32) -> (1, 16, 8); "
                                     "batch['targets'] shape (1, 16, 32) -> (1, 16, 8)")]
    assert result.compile_log.count("train_step") == 2
    summary = result.summary
    assert summary.executions == 14 + 1 and summary.boundaries == 14
    assert summary.host_to_device_bytes > 0 and summary.device_to_host_bytes > 0
    recompile_seconds = summary.step_compilations[2]["seconds"]
    assert summary.time_breakdown["compile"] == pytest.approx(recompile_seconds, rel=1e-3)
    compiling = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("time_compile")]
    assert len(compiling) == 1 and compiling[0]["time_compile"] > 0.5, compiling  # its step's interval
    assert compiling[0]["time_compile"] * compiling[0]["interval_seconds"] == pytest.approx(recompile_seconds,
                                                                                             rel=1e-2)

    report = run_cli("report", str(tmp_path / "run"))
    assert report.returncode == 0, report.stderr
    assert "compilations" in report.stdout and "batch['inputs'] shape (1, 16, 32) -> (1, 16, 8)" in report.stdout
    assert "waiting for data" in report.stdout and "host->device" in report.stdout
    assert re.search(r"time: data .*, compile \d+\.\d% \(\d+\.\d\ds\), device", report.stdout), report.stdout


def test_compile_budget_stops_the_run_with_the_report(tmp_path):
    config = load_config(None, [*corpus(tmp_path), "trainer.steps=4", "trainer.compile_budget=2",
                                f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(CompileBudgetExceeded, match=r"compile_budget=2 exceeded: the steps were compiled 3 times "
                       r"\(the last for batch\['inputs'\] shape \(1, 16, 32\) -> \(1, 16, 8\)"):
        train(config, echo=lambda _: None)


def test_compile_budget_is_one_line_and_the_causes_go_to_the_report(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", *corpus(tmp_path), "trainer.steps=4", "trainer.compile_budget=2",
                     f"trainer.run_dir={run_dir}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("xlatrain: error: trainer.compile_budget=2 exceeded: the steps were compiled 3 times "
                               "(the last for batch['inputs'] shape (1, 16, 32) -> (1, 16, 8);")
    assert lines[0].endswith("(every cause: xlatrain report RUN_DIR)")
    report = run_cli("report", str(run_dir))
    assert report.returncode == 0 and "train_step (" in report.stdout and "-> (1, 16, 8)" in report.stdout


def test_report_of_a_directory_without_a_summary_is_a_clear_error(tmp_path):
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2 and "summary.jsonl not found" in result.stderr
    (tmp_path / "summary.jsonl").write_text('{"session": ')  # torn by a kill: dropped
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"xlatrain: error: report: {tmp_path / 'summary.jsonl'} holds no session summary yet (a run writes one as "
        "each session ends)"]


def test_bucket_lengths_are_validated():
    from xlatrain.errors import UserError

    with pytest.raises(UserError, match=r"data.buckets=\[16, 8\] must be strictly increasing"):
        load_config(None, ["data.buckets=[16,8]"])
    with pytest.raises(UserError, match=r"no longer than data.seq_len=64"):
        load_config(None, ["data.buckets=[128]"])
