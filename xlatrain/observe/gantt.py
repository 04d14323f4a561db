"""A schedule as a Gantt chart (PNG): one row per stage, forwards and backwards as labelled bars."""

from __future__ import annotations

from pathlib import Path

from xlatrain.observe.plot import save_figure
from xlatrain.pipeline.schedule import Schedule, Timeline, simulate

_COLOURS = {"F": ("#4c78a8", "#9ecae9"), "B": ("#e45756", "#ff9d98"), "W": ("#54a24b", "#88d27a")}
"""Per kind, the colours of even and odd virtual-stage rounds."""


def draw(schedule: Schedule, path: Path, timeline: Timeline | None = None, time_unit: str = "time slots") -> Path:
    """Write the chart; without a timeline, each action takes one slot (the table as it stands)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = schedule.stages * schedule.virtual_stages
    ones = [1.0] * chunks
    timeline = timeline or simulate(schedule, ones, ones, ones if schedule.splits_backward else None)
    figure, axes = plt.subplots(figsize=(max(6.0, 0.35 * timeline.step_time + 2), 0.6 * schedule.stages + 1.4))
    for action, begin in timeline.start.items():
        stage, round_ = schedule.stage_of(action.chunk), action.chunk // schedule.stages
        width = timeline.finish[action] - begin
        axes.barh(stage, width, left=begin, color=_COLOURS[action.kind][round_ % 2], edgecolor="white")
        label = f"{action.kind}{action.microbatch}" + (f".{round_}" if schedule.virtual_stages > 1 else "")
        axes.text(begin + width / 2, stage, label, ha="center", va="center", fontsize=7)
    axes.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    axes.invert_yaxis()
    axes.set_xlabel(time_unit)
    v = f", v={schedule.virtual_stages}" if schedule.virtual_stages > 1 else ""
    axes.set_title(f"{schedule.name}: p={schedule.stages}, m={schedule.microbatches}{v}; bubble "
                   f"{timeline.bubble():.1%} (theory {schedule.theoretical_bubble():.1%})")
    figure.tight_layout()
    path = Path(path)
    save_figure(figure, path)
    plt.close(figure)
    return path
