"""Pipeline schedules as data: every built table (and its forward-only evaluation pass) keeps its
dependencies, its bubble equals theory, 1F1B (and ZB-H1, ZB-V) holds at most p microbatches of activations,
and impossible schedules are clear errors."""

import dataclasses

import pytest

from xlatrain.observe.gantt import draw
from xlatrain.pipeline.schedule import (
    Action,
    ScheduleError,
    build,
    dependency_problems,
    forward_only,
    lockstep_time,
    simulate,
    stage_of,
)
from xlatrain.pipeline.slots import Branch, slot_program

CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b") for p in (2, 4) for m in (p, 2 * p, p + 1, 1)]
CASES += [("interleaved", p, m, 2) for p in (2, 4) for m in (p, 2 * p)] + [("interleaved", 2, 4, 3)]
CASES += [("zb1p", p, m, 1) for p in (2, 4, 8) for m in (p, 2 * p, p + 1)]
CASES += [("zbv", p, m, 2) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)] + [("zbv", 2, 3, 2), ("zbv", 4, 5, 2)]


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_schedules_keep_dependencies_and_meet_the_theoretical_bubble(name, p, m, v):
    schedule = build(name, p, m, v)
    assert dependency_problems(schedule) == []
    actions_per_microbatch = 3 * v if name in ("zb1p", "zbv") else v  # F, B and W each take a slot
    assert schedule.bubble() == pytest.approx((p - 1) / (actions_per_microbatch * m + p - 1))
    assert schedule.bubble() == pytest.approx(schedule.theoretical_bubble())
    assert all(len(row) == p for row in schedule.table)


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_an_evaluation_runs_the_forwards_alone_in_v_m_plus_p_minus_1_slots(name, p, m, v):
    """In a V a microbatch crosses the stages twice (down and back up), so the fill takes 2(p - 1) slots."""
    evaluation = forward_only(build(name, p, m, v))
    assert evaluation.forward_only and dependency_problems(evaluation) == []
    assert evaluation.slots == v * m + (2 if name == "zbv" else 1) * (p - 1)
    program = slot_program(evaluation)
    assert program.cotangent_buffers == program.residual_buffers == 0
    assert set(program.branch.ravel()) <= {Branch.IDLE, Branch.FORWARD_FIRST, Branch.FORWARD, Branch.FORWARD_LAST}


@pytest.mark.parametrize("p,m", [(4, 8), (4, 5), (2, 6)])
def test_1f1b_holds_at_most_p_microbatches_where_gpipe_holds_m(p, m):
    assert max(build("1f1b", p, m).peak_in_flight()) == min(p, m)
    assert build("gpipe", p, m).peak_in_flight() == [m] * p


@pytest.mark.parametrize("p,m", [(4, 8), (4, 5), (2, 6), (8, 16)])
def test_zb1p_holds_what_1f1b_holds(p, m):
    assert max(build("zb1p", p, m).peak_in_flight()) == max(build("1f1b", p, m).peak_in_flight()) == min(p, m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.4, 0.7)])
def test_zb1p_idles_p_minus_1_times_f_plus_b_minus_w_where_1f1b_idles_p_minus_1_times_f_plus_b(p, m, f, b, w):
    """The simulator with F, B and W costs: ZB-H1's step is m(F + B + W) + (p - 1)(F + B - W) (the paper's
    bound); 1F1B running B and W back to back as one backward of cost B + W idles (p - 1)(F + B + W)."""
    zb = simulate(build("zb1p", p, m), [f] * p, [b] * p, [w] * p)
    assert zb.step_time == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))
    plain = simulate(build("1f1b", p, m), [f] * p, [b + w] * p)
    assert plain.step_time == pytest.approx(m * (f + b + w) + (p - 1) * (f + b + w))
    with pytest.raises(ScheduleError, match="needs a W cost per chunk"):
        simulate(build("zb1p", p, m), [f] * p, [b] * p)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 5), (8, 16)])
def test_zbv_places_chunks_in_a_v_and_holds_what_1f1b_holds(p, m):
    """Stage i runs chunks i and 2p - 1 - i; at most 2p half-size chunk activations (1F1B's p microbatches of a
    whole stage) are kept from F to W, and the slot program needs no more residual buffers than that; the
    stage inputs add at most the two that arrive while the stage's oldest are still being read."""
    schedule = build("zbv", p, m, 2)
    assert schedule.placement == "v"
    assert {stage_of(c, p, "v") for c in (0, 2 * p - 1)} == {0} and stage_of(p - 1, p, "v") == stage_of(p, p, "v")
    program = slot_program(schedule)
    assert program.residual_buffers == max(schedule.peak_in_flight()) == 2 * p
    assert program.activation_buffers <= 2 * p + 2
    assert not program.ring


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 5), (8, 16)])
def test_zbv_idles_half_a_slot_per_stage_and_beats_zb1p_in_lockstep(p, m):
    """With each chunk half a stage (F = B = W = 1/2) ZB-V's step is 3m + (p - 1)/2 against ZB-H1's 3m + (p - 1).
    xlatrain runs a table in lockstep (each slot as long as its slowest action): there ZB-V stays ahead of
    ZB-H1 when B and W differ too."""
    half = [0.5] * (2 * p)
    assert simulate(build("zbv", p, m, 2), half, half, half).step_time == pytest.approx(3 * m + (p - 1) / 2)
    for f, b, w in [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.4, 0.7)]:
        zbv = lockstep_time(build("zbv", p, m, 2), [f / 2] * 2 * p, [b / 2] * 2 * p, [w / 2] * 2 * p)
        assert zbv < lockstep_time(build("zb1p", p, m), [f] * p, [b] * p, [w] * p)


def test_interleaving_shrinks_the_bubble_by_v():
    plain, interleaved = build("1f1b", 4, 8), build("interleaved", 4, 8, 2)
    assert plain.bubble() == pytest.approx(3 / 11) and interleaved.bubble() == pytest.approx(3 / 19)


def test_a_table_that_breaks_a_dependency_is_caught():
    schedule = build("1f1b", 2, 2)
    rows = [list(row) for row in schedule.table]
    first_backward = next(i for i, row in enumerate(rows) if any(a is not None and a.kind == "B" for a in row))
    rows[0], rows[first_backward] = rows[first_backward], rows[0]
    broken = dataclasses.replace(schedule, table=tuple(tuple(row) for row in rows))
    assert any("runs before" in problem for problem in dependency_problems(broken))
    missing = dataclasses.replace(schedule, table=schedule.table[:-1])
    assert f"{Action('B', 1, 0)} never runs" in dependency_problems(missing) or \
        f"{Action('B', 0, 0)} never runs" in dependency_problems(missing)


@pytest.mark.parametrize("args,message", [
    (("interleaved", 4, 6, 2), "multiple of the stages"),
    (("interleaved", 4, 8, 1), "virtual_stages >= 2"),
    (("gpipe", 4, 8, 2), "interleaved schedule only"),
    (("zigzag", 4, 8, 1), "unknown schedule"),
    (("zbv", 4, 8, 3), "exactly 2 chunks per stage"),
    (("1f1b", 0, 8, 1), "stages >= 1"),
])
def test_impossible_schedules_are_clear_errors(args, message):
    with pytest.raises(ScheduleError, match=message):
        build(*args)


def test_simulated_step_time_follows_the_costs_and_the_bubble():
    timeline = simulate(build("1f1b", 4, 8), forward=[1.0] * 4, backward=[2.0] * 4)
    assert timeline.step_time == pytest.approx((8 + 4 - 1) * 3.0)
    assert timeline.bubble() == pytest.approx(3 / 11)
    slow_last = simulate(build("1f1b", 4, 8), forward=[1.0, 1.0, 1.0, 2.0], backward=[2.0, 2.0, 2.0, 4.0])
    assert slow_last.step_time > timeline.step_time and slow_last.busy[3] == pytest.approx(8 * 6.0)
    with pytest.raises(ScheduleError, match="a forward and a backward cost per chunk"):
        simulate(build("interleaved", 2, 4, 2), forward=[1.0] * 2, backward=[1.0] * 2)


def test_gantt_chart_is_written(tmp_path):
    from PIL import Image

    for name, v in (("interleaved", 2), ("zbv", 2)):
        path = draw(build(name, 4, 8, v), tmp_path / f"{name}.png")
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 600
