"""Pipeline schedules as data: a table of time slot x stage -> action, built, checked and measured.

An action is the forward (F) or backward (B) pass of one microbatch through one virtual stage; a zero-bubble
schedule splits the backward into B, the input gradient the previous stage waits for, and W, the weight
gradients, which wait until they fill what would be a bubble (Zero Bubble, arXiv 2401.10241). With
`v` virtual stages per device, the model's blocks form p * v chunks. They are placed on the devices in a
loop (Megatron's interleaving: chunk c runs on device c % p) or, for ZB-V, in a V (two chunks per device:
device i holds chunks i and 2p - 1 - i, so the first and the last chunk share device 0); either way a
microbatch visits every device v times. Each action takes one time slot of 1/v of a device's share of the
model, so tables of different v are comparable: the bubble is the fraction of device-slots left idle,
which theory puts at (p - 1) / (v * m + p - 1) (v = 1 for GPipe and 1F1B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B", "W"]
Placement = Literal["loop", "v"]


def stage_of(chunk: int, stages: int, placement: Placement = "loop") -> int:
    """The device that runs a chunk."""
    if placement == "loop":
        return chunk % stages
    return chunk if chunk < stages else 2 * stages - 1 - chunk


def chunk_at(round_: int, stage: int, stages: int, placement: Placement = "loop") -> int:
    """The chunk a device runs in its round'th place (the inverse of `stage_of`)."""
    if placement == "loop" or round_ % 2 == 0:
        return round_ * stages + stage
    return (round_ + 1) * stages - 1 - stage


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int
    """The virtual stage (model chunk), 0 .. p * v - 1; it runs on device `stage_of(chunk)`."""


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    table: tuple[tuple[Action | None, ...], ...]
    """table[slot][stage]: what each device does in each time slot (None: idle)."""
    placement: Placement = "loop"

    def stage_of(self, chunk: int) -> int:
        return stage_of(chunk, self.stages, self.placement)

    @property
    def slots(self) -> int:
        return len(self.table)

    @property
    def forward_only(self) -> bool:
        """An evaluation pass: forwards and no backward."""
        return all(action is None or action.kind == "F" for row in self.table for action in row)

    @property
    def splits_backward(self) -> bool:
        """Whether the backward runs as B and W actions."""
        return any(action is not None and action.kind == "W" for row in self.table for action in row)

    def bubble(self) -> float:
        busy = sum(action is not None for row in self.table for action in row)
        return 1 - busy / (self.slots * self.stages)

    def theoretical_bubble(self) -> float:
        """In slots of one action each: (p - 1) / (v * m + p - 1) for GPipe, 1F1B and interleaved (a slot per
        F and per B); ZB-H1's idle time is (p - 1)(F + B - W), one slot per device when F = B = W, against
        3m busy slots; ZB-V's is (p - 1) slots of half a device's share against 6m (its warm-up sends a
        microbatch down and back up the V before the first backward)."""
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        if self.splits_backward:
            return (p - 1) / (3 * v * m + p - 1)
        return (p - 1) / (v * m + p - 1)

    def peak_in_flight(self) -> list[int]:
        """Per device, the most microbatch-chunks whose forward ran and whose backward has not finished (its
        W, when split): the activations it must hold at once."""
        release = "W" if self.splits_backward else "B"
        live, peak = [0] * self.stages, [0] * self.stages
        for row in self.table:
            for stage, action in enumerate(row):
                if action is not None and action.kind in ("F", release):
                    live[stage] += 1 if action.kind == "F" else -1
                    peak[stage] = max(peak[stage], live[stage])
        return peak


class ScheduleError(ValueError):
    """A schedule that cannot be built (too few microbatches, ...) or that breaks a dependency."""


def gpipe(stages: int, microbatches: int) -> Schedule:
    """Every forward, then every backward (the "simple" schedule): m microbatches of activations live."""
    p, m = stages, microbatches
    orders = [[Action("F", j, s) for j in range(m)] + [Action("B", j, s) for j in reversed(range(m))]
              for s in range(p)]
    return _place("gpipe", p, m, 1, orders)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: p - 1 - s warm-up forwards on stage s, then alternate forward and backward, then drain.
    Same bubble as GPipe; at most p microbatches of activations live per stage."""
    p, m = stages, microbatches
    orders = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        order = [Action("F", j, s) for j in range(warmup)]
        for j in range(m - warmup):
            order += [Action("F", warmup + j, s), Action("B", j, s)]
        order += [Action("B", j, s) for j in range(m - warmup, m)]
        orders.append(order)
    return _place("1f1b", p, m, 1, orders)


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into B and W, stage s deferring up to s of its W's. The deferred
    W's fill the cool-down, where 1F1B's stages wait for gradients; a stage never holds more than p
    microbatches (1F1B's first stage's peak), and the idle time is (p - 1)(F + B - W) per device."""
    p, m = stages, microbatches
    orders = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        order, deferred = [Action("F", j, s) for j in range(warmup)], []

        def backward(j: int) -> None:
            order.append(Action("B", j, s))
            deferred.append(j)
            if len(deferred) > s:
                order.append(Action("W", deferred.pop(0), s))

        for j in range(m - warmup):
            order.append(Action("F", warmup + j, s))
            backward(j)
        for j in range(m - warmup, m):
            backward(j)
        orders.append(order + [Action("W", j, s) for j in deferred])
    return _place("zb1p", p, m, 1, orders)


def zero_bubble_v(stages: int, microbatches: int) -> Schedule:
    """ZB-V: two chunks per device placed in a V, the backward split into B and W. Built slot by slot: a device
    runs a ready B first (its first chunk's, which ends a microbatch's backward, before its second's), else a
    ready F while it holds fewer than 2p chunk-activations (its second chunk's first, which takes a
    microbatch on towards the loss instead of starting a new one), else its oldest deferred W. That keeps
    1F1B's memory (2p half-size chunks) and leaves (p - 1) half-slots idle per device when F = B = W."""
    p, m, chunks = stages, microbatches, 2 * stages
    done: set[Action] = set()
    next_forward = [0] * chunks
    """Per chunk, the next microbatch its F takes (microbatches go through every chunk in order)."""
    next_backward = [0] * chunks
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    kept = [0] * p
    rows: list[tuple[Action | None, ...]] = []

    def ready(action: Action) -> bool:
        return all(need in done for need in _needs(action, chunks))

    def choose(s: int) -> Action | None:
        down, up = s, chunks - 1 - s
        backwards = [Action("B", next_backward[c], c) for c in (down, up) if next_backward[c] < m]
        forwards = [Action("F", next_forward[c], c) for c in (up, down) if next_forward[c] < m]
        for action in backwards:
            if ready(action):
                return action
        if kept[s] < 2 * p:
            for action in forwards:
                if ready(action):
                    return action
        return pending_w[s][0] if pending_w[s] else None

    while len(done) < 3 * m * chunks:
        row = tuple(choose(s) for s in range(p))
        if not any(row):
            raise ScheduleError(f"zbv with p={p}, m={m} cannot make progress")
        for s, action in enumerate(row):
            if action is None:
                continue
            done.add(action)
            if action.kind == "F":
                next_forward[action.chunk] += 1
                kept[s] += 1
            elif action.kind == "B":
                next_backward[action.chunk] += 1
                pending_w[s].append(Action("W", action.microbatch, action.chunk))
            else:
                pending_w[s].pop(0)
                kept[s] -= 1
        rows.append(row)
    return Schedule("zbv", p, m, 2, tuple(rows), placement="v")


def interleaved(stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B (Megatron): v chunks per device, microbatches in groups of p through each chunk;
    the bubble shrinks by v. Needs m to be a multiple of p."""
    p, m, v = stages, microbatches, virtual_stages
    if v < 2:
        raise ScheduleError(f"interleaved needs virtual_stages >= 2 (got {v}); use 1f1b for one chunk per stage")
    if m % p:
        raise ScheduleError(f"interleaved needs microbatches to be a multiple of the stages: m={m}, p={p}")
    total = m * v

    def forward_unit(s: int, k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk_round, lane = divmod(within, p)
        return Action("F", group * p + lane, chunk_round * p + s)

    def backward_unit(s: int, k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk_round, lane = divmod(within, p)
        return Action("B", group * p + lane, (v - 1 - chunk_round) * p + s)

    orders = []
    for s in range(p):
        warmup = min((p - 1 - s) * 2 + (v - 1) * p, total)
        order = [forward_unit(s, k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward_unit(s, warmup + k), backward_unit(s, k)]
        order += [backward_unit(s, k) for k in range(total - warmup, total)]
        orders.append(order)
    return _place("interleaved", p, m, v, orders)


def build(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"a pipeline needs stages >= 1 and microbatches >= 1 (got p={stages}, m={microbatches})")
    if name == "interleaved":
        return interleaved(stages, microbatches, virtual_stages)
    if name == "zbv":
        if virtual_stages != 2:
            raise ScheduleError(f"zbv places exactly 2 chunks per stage in a V, not virtual_stages={virtual_stages}")
        return zero_bubble_v(stages, microbatches)
    if virtual_stages != 1:
        raise ScheduleError(f"virtual_stages={virtual_stages} applies to the interleaved schedule only, not {name}")
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb1p": zero_bubble_h1}
    if name not in builders:
        raise ScheduleError(f"unknown schedule {name!r}: use gpipe, 1f1b, interleaved, zb1p or zbv")
    return builders[name](stages, microbatches)


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, each device keeping their order, each placed as early as it can run:
    the pass of an evaluation through the stages."""
    orders = [[row[s] for row in schedule.table if row[s] is not None and row[s].kind == "F"]
              for s in range(schedule.stages)]
    return _place(f"{schedule.name} (forward only)", schedule.stages, schedule.microbatches,
                  schedule.virtual_stages, orders, schedule.placement)


def dependency_problems(schedule: Schedule) -> list[str]:
    """Empty when every action runs once, on its chunk's device, after what it needs: F(c, j) after
    F(c - 1, j); B(c, j) after F(c, j) and B(c + 1, j); W(c, j) after B(c, j). A forward-only schedule has no
    B to run; one that splits the backward runs a W for every B."""
    chunks = schedule.stages * schedule.virtual_stages
    when: dict[Action, int] = {}
    problems = []
    for slot, row in enumerate(schedule.table):
        for stage, action in enumerate(row):
            if action is None:
                continue
            if action in when:
                problems.append(f"{action} runs twice")
            if schedule.stage_of(action.chunk) != stage:
                problems.append(f"{action} runs on stage {stage}, not {schedule.stage_of(action.chunk)}")
            when[action] = slot
    for j in range(schedule.microbatches):
        for c in range(chunks):
            kinds = ("F",) if schedule.forward_only else ("F", "B", "W") if schedule.splits_backward else ("F", "B")
            for kind in kinds:
                if Action(kind, j, c) not in when:
                    problems.append(f"{Action(kind, j, c)} never runs")
    for action, slot in when.items():
        for need in _needs(action, chunks):
            if need in when and when[need] >= slot:
                problems.append(f"{action} at slot {slot} runs before {need} (slot {when[need]}) finishes")
    return problems


def _place(name: str, p: int, m: int, v: int, orders: list[list[Action]], placement: Placement = "loop") -> Schedule:
    """Run each device's actions in its order, each as early as its dependencies allow (one slot each)."""
    chunks = p * v
    done: dict[Action, int] = {}
    position = [0] * p
    rows: list[list[Action | None]] = []
    while any(position[s] < len(orders[s]) for s in range(p)):
        row: list[Action | None] = [None] * p
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            action = orders[s][position[s]]
            if _ready(action, done, chunks):
                row[s] = action
        if not any(row):
            raise ScheduleError(f"{name} with p={p}, m={m}, v={v} cannot make progress (its order deadlocks)")
        slot = len(rows)
        for s, action in enumerate(row):
            if action is not None:
                done[action] = slot
                position[s] += 1
        rows.append(row)
    return Schedule(name, p, m, v, tuple(tuple(row) for row in rows), placement)


def _ready(action: Action, done: dict[Action, int], chunks: int) -> bool:
    """Whether everything the action needs finished in an earlier slot."""
    return all(need in done for need in _needs(action, chunks))


@dataclass(frozen=True)
class Timeline:
    """When each action ran, in time units of the given costs."""

    start: dict[Action, float]
    finish: dict[Action, float]
    step_time: float
    busy: list[float]
    """Per device, the time it spent computing."""

    def bubble(self) -> float:
        return 1 - sum(self.busy) / (self.step_time * len(self.busy))


def simulate(schedule: Schedule, forward: list[float], backward: list[float],
             weight: list[float] | None = None) -> Timeline:
    """Replay each device's actions in the table's order with per-chunk costs (forward[c], backward[c]
    for chunk c, and weight[c] for a W when the schedule splits the backward: then backward[c] is B's
    part alone), each starting when its device is free and its dependencies have finished."""
    chunks = schedule.stages * schedule.virtual_stages
    if len(forward) != chunks or len(backward) != chunks:
        raise ScheduleError(f"need a forward and a backward cost per chunk ({chunks}); got {len(forward)} and "
                            f"{len(backward)}")
    if schedule.splits_backward and (weight is None or len(weight) != chunks):
        raise ScheduleError(f"{schedule.name} splits the backward: it needs a W cost per chunk ({chunks})")
    costs = {"F": forward, "B": backward, "W": weight}
    orders = [[row[s] for row in schedule.table if row[s] is not None] for s in range(schedule.stages)]
    start: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    free, position, busy = [0.0] * schedule.stages, [0] * schedule.stages, [0.0] * schedule.stages
    while any(position[s] < len(orders[s]) for s in range(schedule.stages)):
        progressed = False
        for s in range(schedule.stages):
            if position[s] == len(orders[s]):
                continue
            action = orders[s][position[s]]
            needs = _needs(action, chunks)
            if any(need not in finish for need in needs):
                continue
            cost = costs[action.kind][action.chunk]
            start[action] = max([free[s], *(finish[need] for need in needs)])
            finish[action] = free[s] = start[action] + cost
            busy[s] += cost
            position[s] += 1
            progressed = True
        if not progressed:
            raise ScheduleError(f"{schedule.name}: the table's order deadlocks")
    return Timeline(start, finish, max(free), busy)


def lockstep_time(schedule: Schedule, forward: list[float], backward: list[float],
                  weight: list[float] | None = None) -> float:
    """The step time when every slot lasts as long as its slowest action, as xlatrain's SPMD step runs a table
    (all stages run a slot, then exchange): the costs as in `simulate`."""
    costs = {"F": forward, "B": backward, "W": weight}
    return sum(max((costs[a.kind][a.chunk] for a in row if a is not None), default=0.0) for row in schedule.table)


def _needs(action: Action, chunks: int) -> list[Action]:
    if action.kind == "W":
        return [Action("B", action.microbatch, action.chunk)]
    if action.kind == "F":
        return [Action("F", action.microbatch, action.chunk - 1)] if action.chunk else []
    needs = [Action("F", action.microbatch, action.chunk)]
    if action.chunk + 1 < chunks:
        needs.append(Action("B", action.microbatch, action.chunk + 1))
    return needs
