"""Rules that name a run's bottleneck from its time breakdown (xlatrain/observe/time_breakdown.py), with the numbers
that fired them and the setting that fixes them, in the spirit of SageMaker Debugger's rules.

Each rule is a pure function returning its message, or None when it does not fire. `BottleneckRules` runs them
over windows of at least MIN_WINDOW_STEPS steps and MIN_WINDOW_SECONDS (logged intervals joined until they are
that long, so that one noisy step decides nothing), skipping the session's first interval (it holds the
warm-up) and those the profiler traced, and lets each rule speak once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from xlatrain.pipeline.partition import Balance

DATA_BOUND_SHARE = 0.05
HOST_BOUND_SHARE = 0.5
DEVICE_HIDDEN_SHARE = 0.1
RECOMPILE_SHARE = 0.2
IMBALANCE_RATIO = 1.1
LOW_MFU = 0.2
EXPERT_IMBALANCE = 2.0
"""The busiest expert of an MoE layer taking this many times the mean expert's choices: half the layer's experts'
devices (or its padded batch) wait on one."""
MIN_WINDOW_STEPS = 10
MIN_WINDOW_SECONDS = 0.5


@dataclass(frozen=True)
class Knobs:
    """The settings the fixes name, with their current values."""

    prefetch: int
    steps_per_sync: int
    rows_per_device: int
    policy: str
    balancing: str | None = None
    """An MoE model's load balancing as set (model.moe's aux_loss_weight and bias_rate); None: no experts."""


@dataclass(frozen=True)
class Interval:
    first_step: int
    step: int
    spent: dict[str, float]
    """Seconds per category of the time breakdown."""
    mfu: float | None
    recompilations: Sequence[tuple[str, str]]
    """(step name, cause) of each compilation of the steps after their first, this session."""
    expert_load: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per MoE layer at the interval's last logged step: (the busiest expert's choices over the mean, the loads'
    coefficient of variation)."""

    def share(self, category: str) -> float:
        return self.spent[category] / (sum(self.spent.values()) or 1.0)

    @property
    def steps(self) -> str:
        return f"steps {self.first_step}..{self.step}"

    def then(self, later: Interval) -> Interval:
        """This interval and the one right after it, as one."""
        spent = {k: self.spent[k] + later.spent[k] for k in self.spent}
        return Interval(self.first_step, later.step, spent, later.mfu, later.recompilations, later.expert_load)

    @property
    def long_enough(self) -> bool:
        return self.step - self.first_step + 1 >= MIN_WINDOW_STEPS and sum(self.spent.values()) >= MIN_WINDOW_SECONDS


@dataclass(frozen=True)
class Finding:
    rule: str
    step: int
    """0: before the first step."""
    message: str

    def where(self) -> str:
        return "before the first step" if self.step == 0 else f"at step {self.step}"

    def line(self) -> str:
        return f"bottleneck {self.rule} {self.where()}: {self.message}"


def data_bound(interval: Interval, knobs: Knobs) -> str | None:
    share = interval.share("data")
    if share <= DATA_BOUND_SHARE:
        return None
    return (f"waiting for data took {share:.0%} of the time of {interval.steps} (over {DATA_BOUND_SHARE:.0%}): "
            f"the input pipeline is slower than the step; raise data.prefetch (now {knobs.prefetch}) when the "
            "waits come in bursts, else make each batch cheaper to produce")


def host_bound(interval: Interval, knobs: Knobs) -> str | None:
    host, device = interval.share("host"), interval.share("device")
    if host < HOST_BOUND_SHARE or device > DEVICE_HIDDEN_SHARE:
        return None
    return (f"host work (dispatch, hooks, closures, logging) took {host:.0%} of the time of {interval.steps} while "
            f"the host waited for the device {device:.0%} of it: the device sits idle between executables; raise "
            f"trainer.steps_per_sync (now {knobs.steps_per_sync}) to run several steps per executable")


def recompile_storm(interval: Interval, _knobs: Knobs) -> str | None:
    share = interval.share("compile")
    if share <= RECOMPILE_SHARE or not interval.recompilations:
        return None
    name, cause = interval.recompilations[-1]
    return (f"compiling took {share:.0%} of the time of {interval.steps}: {len(interval.recompilations)} "
            f"recompilation(s) of the steps so far, the last of the {name} step for {cause}; every new batch "
            "signature compiles the step again: pad inputs to fewer shapes (data.buckets), and set "
            "trainer.compile_budget to stop a run that keeps compiling")


def low_mfu(interval: Interval, knobs: Knobs) -> str | None:
    if interval.mfu is None or interval.mfu >= LOW_MFU:
        return None
    precision = "; compute in bf16 (precision.policy=bf16) on an accelerator" if knobs.policy == "fp32" else ""
    return (f"model FLOPs utilisation {interval.mfu:.2%} over {interval.steps} (under {LOW_MFU:.0%} of the "
            f"device's peak): raise the rows per device (now {knobs.rows_per_device}){precision}; `xlatrain "
            "profile` shows which operations take the time")


def expert_imbalance(interval: Interval, knobs: Knobs) -> str | None:
    if not interval.expert_load:
        return None
    layer, (ratio, cv) = max(interval.expert_load.items(), key=lambda item: item[1][0])
    if ratio <= EXPERT_IMBALANCE:
        return None
    return (f"MoE layer {layer}'s busiest expert got {ratio:.2f}x the mean expert's choices at the end of "
            f"{interval.steps} (over {EXPERT_IMBALANCE:.1f}x; the loads' coefficient of variation {cv:.2f}): its "
            f"experts are badly imbalanced, and the busiest one's device or padded batch holds the layer up; raise "
            f"model.moe.aux_loss_weight or set model.moe.bias_rate (now {knobs.balancing})")


INTERVAL_RULES: dict[str, Callable[[Interval, Knobs], str | None]] = {
    "data-bound": data_bound, "host-bound": host_bound, "recompile-storm": recompile_storm, "low-mfu": low_mfu,
    "expert-imbalance": expert_imbalance}


def stage_imbalance(balance: Balance, partition_source: str) -> str | None:
    """From the partition's costs, before the first step."""
    ratio = balance.compute_ratio
    if ratio <= IMBALANCE_RATIO:
        return None
    slowest = balance.stage_flops.index(max(balance.stage_flops))
    return (f"pipeline stage {slowest} does {ratio:.2f}x the mean stage's FLOPs per microbatch (over "
            f"{IMBALANCE_RATIO:.2f}x): the other stages wait about {1 - 1 / ratio:.0%} of every slot; "
            f"{_imbalance_fix(balance, slowest, partition_source)}")


def _imbalance_fix(balance: Balance, slowest: int, partition_source: str) -> str:
    if partition_source == "explicit":
        return "set parallel.pipeline.partition: auto to balance the stages by XLA's costs"
    finer = "or cut the model finer (parallel.pipeline.schedule=interleaved with virtual_stages)"
    ends = balance.ends_in_blocks(slowest)
    if ends < 0.1:
        return f"the blocks do not split evenly: choose model.layers a multiple of the pipeline's chunks, {finer}"
    return (f"it runs {balance.stage_blocks[slowest]} block(s) and the model's ends (embedding, or head and loss), "
            f"worth {ends:.1f} block(s), which auto's cut of whole blocks cannot offset: more blocks per stage "
            f"(model.layers, or fewer mesh.stage) let auto give that stage fewer, {finer}")


class BottleneckRules:
    def __init__(self, knobs: Knobs, say: Callable[[Finding], None]):
        self.knobs = knobs
        self.say = say
        self.findings: list[Finding] = []
        self._warm = False
        self._window: Interval | None = None

    def check_partition(self, balance: Balance, partition_source: str) -> None:
        self._fire("stage-imbalance", 0, stage_imbalance(balance, partition_source))

    def check(self, interval: Interval, traced: bool = False) -> None:
        """Judge the window this interval completes. A `traced` interval (the profiler ran in it, and slowed it)
        is judged by no rule, nor joined to the next."""
        if not self._warm or traced:
            self._warm, self._window = True, None
            return
        window = interval if self._window is None else self._window.then(interval)
        self._window = None if window.long_enough else window
        if window.long_enough:
            for rule, judge in INTERVAL_RULES.items():
                self._fire(rule, window.step, judge(window, self.knobs))

    def as_records(self) -> list[dict]:
        return [asdict(f) for f in self.findings]

    def _fire(self, rule: str, step: int, message: str | None) -> None:
        if message is None or any(f.rule == rule for f in self.findings):
            return
        finding = Finding(rule, step, message)
        self.findings.append(finding)
        self.say(finding)
