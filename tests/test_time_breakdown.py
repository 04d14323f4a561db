"""Where the loop's time goes (xlatrain/observe/time_breakdown.py) and the bottleneck rules
(xlatrain/observe/bottlenecks.py)."""

import json
import re
import time

import pytest
from conftest import DIGITS_MLP, TINY_GPT

from xlatrain.observe.bottlenecks import (
    INTERVAL_RULES,
    BottleneckRules,
    Interval,
    Knobs,
    stage_imbalance,
)
from xlatrain.observe.summary import format_report
from xlatrain.observe.time_breakdown import CATEGORIES, TimeBreakdown, fractions
from xlatrain.pipeline.partition import Balance
from xlatrain.run.metrics import read_metrics


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_parts_of_an_interval_add_up_to_its_wall_time_and_inner_spans_count_once():
    clock = FakeClock()
    breakdown = TimeBreakdown(clock)
    with breakdown.spending("data"):
        clock.now += 1.0
    with breakdown.spending("eval"):
        clock.now += 2.0
        breakdown.claim("compile", 0.5)  # a recompilation inside evaluation's dispatch
        with breakdown.spending("device"):
            clock.now += 0.25
    clock.now += 0.75  # host work
    spent = breakdown.cut()
    assert spent == {"data": 1.0, "compile": 0.5, "device": 0.25, "eval": 1.5, "checkpoint": 0.0, "host": 0.75}
    clock.now += 3.0
    assert breakdown.cut() == {**dict.fromkeys(CATEGORIES, 0.0), "host": 3.0}
    assert breakdown.session == {"data": 1.0, "compile": 0.5, "device": 0.25, "eval": 1.5, "checkpoint": 0.0,
                                 "host": 3.75}
    assert sum(fractions(spent).values()) == pytest.approx(1.0)


KNOBS = Knobs(prefetch=2, steps_per_sync=1, rows_per_device=4, policy="fp32",
              balancing="aux_loss_weight=0.001, bias_rate=None")


def _interval(mfu=None, recompilations=(), expert_load=None, **seconds):
    return Interval(11, 30, {**dict.fromkeys(CATEGORIES, 0.0), **seconds}, mfu, list(recompilations),
                    expert_load or {})


RULE_CASES = {
    # rule: (an interval that fires it, one just under its threshold, words its message must hold)
    "data-bound": (_interval(data=0.2, device=0.8), _interval(data=0.04, device=0.96),
                   ["20%", "data.prefetch (now 2)"]),
    "host-bound": (_interval(host=0.9, device=0.05, data=0.05), _interval(host=0.85, device=0.15),
                   ["90%", "5%", "trainer.steps_per_sync (now 1)"]),
    "recompile-storm": (_interval(compile=0.5, device=0.5, recompilations=[("train_step", "batch['x'] shape")]),
                        _interval(compile=0.1, device=0.9, recompilations=[("train_step", "batch['x'] shape")]),
                        ["50%", "1 recompilation", "batch['x'] shape", "data.buckets", "trainer.compile_budget"]),
    "low-mfu": (_interval(device=1.0, mfu=0.05), _interval(device=1.0, mfu=0.4),
                ["5.00%", "rows per device (now 4)", "precision.policy=bf16", "xlatrain profile"]),
    "expert-imbalance": (_interval(device=1.0, expert_load={0: (1.2, 0.1), 1: (3.5, 1.4)}),
                         _interval(device=1.0, expert_load={0: (1.9, 0.5), 1: (1.2, 0.1)}),
                         ["MoE layer 1's busiest expert got 3.50x", "variation 1.40",
                          "model.moe.aux_loss_weight", "(now aux_loss_weight=0.001, bias_rate=None)"]),
}


@pytest.mark.parametrize("rule", RULE_CASES)
def test_each_rule_fires_with_its_numbers_and_fix_only_past_its_threshold(rule):
    firing, quiet, words = RULE_CASES[rule]
    message = INTERVAL_RULES[rule](firing, KNOBS)
    assert message is not None and all(w in message for w in words), message
    assert "steps 11..30" in message
    assert INTERVAL_RULES[rule](quiet, KNOBS) is None
    assert [r for r, judge in INTERVAL_RULES.items() if judge(firing, KNOBS)] == [rule]


def test_stage_imbalance_names_the_slowest_stage_and_the_partition_to_change():
    message = stage_imbalance(Balance([1.0, 3.0], [1.0, 1.0]), "explicit")
    assert "stage 1 does 1.50x" in message and "wait about 33%" in message
    assert "parallel.pipeline.partition: auto" in message
    assert "interleaved" in stage_imbalance(Balance([1.0, 3.0], [1.0, 1.0]), "auto")
    assert stage_imbalance(Balance([1.0, 1.05], [1.0, 1.0]), "explicit") is None


def test_stage_imbalance_under_auto_says_whether_the_blocks_or_the_models_ends_make_it():
    """Blocks of 2 FLOPs: 3 blocks over 2 stages do not divide; one block each beside a head worth 1.5 blocks
    cannot be offset by moving whole blocks."""
    uneven = stage_imbalance(Balance([4.0, 2.0], [1.0, 1.0], [2, 1], 2.0), "auto")
    assert "the blocks do not split evenly: choose model.layers a multiple of the pipeline's chunks" in uneven
    ends = stage_imbalance(Balance([2.0, 5.0], [1.0, 1.0], [1, 1], 2.0), "auto")
    assert "stage 1 does 1.43x" in ends and "it runs 1 block(s) and the model's ends" in ends
    assert "worth 1.5 block(s)" in ends and "more blocks per stage (model.layers, or fewer mesh.stage)" in ends


def test_rules_skip_the_warm_up_join_short_intervals_and_speak_once():
    said = []
    rules = BottleneckRules(KNOBS, said.append)
    data_bound = {**dict.fromkeys(CATEGORIES, 0.0), "data": 0.3, "device": 0.1}
    for first in range(1, 60, 5):  # intervals of 5 steps and 0.4 s
        rules.check(Interval(first, first + 4, dict(data_bound), None, []))
    assert [(f.rule, f.step) for f in said] == [("data-bound", 15)]  # steps 1..5 are the warm-up; 6..15 joined
    assert "steps 6..15" in said[0].message and rules.as_records()[0]["rule"] == "data-bound"


def test_an_interval_the_profiler_traced_is_not_judged():
    """On an H200 the profiled steps 11..20 of GPT-2 small ran at 9% MFU against 22% around them: a tracer's cost,
    not the run's."""
    said = []
    rules = BottleneckRules(KNOBS, said.append)
    seconds = {**dict.fromkeys(CATEGORIES, 0.0), "device": 1.0}
    rules.check(Interval(1, 10, dict(seconds), 0.3, []))  # the warm-up
    rules.check(Interval(11, 20, dict(seconds), 0.05, []), traced=True)
    assert said == []
    rules.check(Interval(21, 30, dict(seconds), 0.05, []))
    assert [(f.rule, f.step) for f in said] == [("low-mfu", 30)] and "steps 21..30" in said[0].message


def _train(tmp_path, overrides, hooks=()):
    from xlatrain.config import load_config
    from xlatrain.trainer import train

    config = load_config(None, [*overrides, f"trainer.run_dir={tmp_path / 'run'}"])
    lines = []
    result = train(config, hooks=hooks, echo=lines.append)
    return result, lines


def _slow_batches(monkeypatch):
    """The device loader's thread takes 30 ms to lay out each batch: slower than the tiny MLP's step."""
    from xlatrain.data import loader

    make_global = loader.make_global

    def slowly(*args, **kwargs):
        time.sleep(0.03)
        return make_global(*args, **kwargs)

    monkeypatch.setattr(loader, "make_global", slowly)


@pytest.mark.parametrize("slow, rule, category", [("data", "data-bound", "time_data"),
                                                  ("hook", "host-bound", "time_host")])
def test_a_run_splits_each_logged_interval_and_names_its_bottleneck(tmp_path, monkeypatch, slow, rule, category):
    if slow == "data":
        _slow_batches(monkeypatch)
    hooks = [lambda boundary: time.sleep(0.08)] if slow == "hook" else []  # longer than a step on a busy host
    result, lines = _train(tmp_path, [*DIGITS_MLP, "trainer.steps=40", "trainer.log_every=10",
                                      "trainer.eval_every=20", "trainer.checkpoint_every=1000"], hooks)
    run = tmp_path / "run"
    timing = [r for r in read_metrics(run / "metrics.jsonl") if "interval_seconds" in r]
    assert [r["step"] for r in timing] == [10, 20, 30, 40]
    for record in timing:
        assert sum(record[f"time_{c}"] for c in CATEGORIES) == pytest.approx(1.0, abs=1e-3)
    assert all(r[category] > 0.5 for r in timing[1:3]), timing  # past the warm-up, before the final checkpoint
    assert timing[1]["time_eval"] > 0 and timing[2]["time_eval"] == 0, timing
    assert timing[3]["time_checkpoint"] > 0 and not any(r["time_checkpoint"] for r in timing[:3]), timing

    summary = json.loads((run / "summary.jsonl").read_text().splitlines()[-1])
    assert sum(summary["time_breakdown"].values()) == pytest.approx(summary["wall_seconds"], rel=0.02)
    assert sum(r["interval_seconds"] for r in timing) <= summary["wall_seconds"]
    fired = [f["rule"] for f in summary["findings"]]
    assert rule in fired and ({"data-bound", "host-bound"} - {rule}).isdisjoint(fired), summary["findings"]
    said = [line for line in lines if line.strip().startswith(f"bottleneck {rule} at step ")]
    assert len(said) == 1, lines  # when it fires; the closing summary names it without saying it again
    step = int(re.search(r"at step (\d+)", said[0]).group(1))
    named = [line for line in lines if line.strip().startswith("bottlenecks (said above): ")]
    assert len(named) == 1 and f"{rule} at step {step}" in named[0], lines
    report = format_report(run)  # read later, it says each in full
    assert "time: data " in report and said[0].strip() in report


@pytest.mark.slow
def test_a_pipeline_with_an_uneven_explicit_partition_is_called_imbalanced_before_the_first_step(tmp_path):
    result, lines = _train(tmp_path, [*TINY_GPT, "parallel.mode=shard_map", "mesh.stage=2", "model.layers=4",
                                      "parallel.pipeline.partition=[3,1]", "model.width=16", "data.seq_len=16",
                                      "batch.global_size=32", "trainer.steps=1"])
    said = [line for line in lines if "bottleneck stage-imbalance before the first step" in line]
    balance = next(line for line in lines if line.strip().startswith("balance"))
    ratio = re.search(r"compute per stage .*? max/mean (\d\.\d\d)", balance).group(1)
    assert float(ratio) > 1.1 and f"stage 0 does {ratio}x the mean stage's FLOPs" in said[0], lines
    assert len(said) == 1 and "partition: auto" in said[0], lines
    named = "bottlenecks (said above): stage-imbalance before the first step"
    assert any(line.strip() == named for line in lines), lines
    assert result.summary.findings[0]["rule"] == "stage-imbalance"
