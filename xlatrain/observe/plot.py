"""`xlatrain plot RUN_DIR [RUN_DIR ...]`: a run's curves from its metrics.jsonl, several runs overlaid."""

from __future__ import annotations

from pathlib import Path

from xlatrain.errors import UserError
from xlatrain.run.atomic import replace_file
from xlatrain.run.metrics import read_metrics

PANELS = (("loss", ("loss", "eval_loss")), ("accuracy", ("accuracy", "eval_accuracy")), ("learning rate", ("lr",)),
          ("loss scale", ("loss_scale",)), ("samples / s", ("samples_per_sec",)), ("MFU (%)", ("mfu",)))
"""Each panel's title and the metrics it draws against step; a panel no run has is left out."""
PERCENT = ("mfu",)
"""Metrics logged as fractions and drawn in percent."""


def read_run_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"plot: {path} does not exist; give run directories written by `xlatrain train`")
    try:
        return read_metrics(path)
    except UserError as err:
        raise UserError(f"plot: {err}") from None


def figure_path(command: str, flag: str, path: Path) -> Path:
    """Where a figure given as `flag` is written: a file in an existing directory, in a format matplotlib
    writes (no suffix: PNG, as matplotlib itself would add)."""
    from matplotlib.backend_bases import FigureCanvasBase

    if path.is_dir():
        raise UserError(f"{command}: {flag} {str(path)!r} is a directory; give a file name, e.g. "
                        f"{path / 'figure.png'}")
    if not path.parent.is_dir():
        raise UserError(f"{command}: {flag} {str(path)!r}: directory {str(path.parent)!r} does not exist")
    if not path.suffix:
        return path.with_suffix(".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise UserError(f"{command}: {flag} {str(path)!r}: matplotlib cannot write {path.suffix!r} files; end the "
                        f"name with one of {', '.join('.' + f for f in sorted(formats))}")
    return path


def save_figure(figure, path: Path) -> None:
    """Writes beside `path` and renames it over: a kill or a full disk midway keeps the figure that was there."""
    file_format = path.suffix[1:].lower() or "png"
    try:
        replace_file(path, lambda partial: figure.savefig(partial, format=file_format, dpi=110))
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror}") from None


def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, or the path as given where two names would be the same."""
    resolved = [d.resolve() for d in run_dirs]
    repeated = [str(d) for d, r in zip(run_dirs, resolved, strict=True) if resolved.count(r) > 1]
    if repeated:
        raise UserError(f"plot: {' and '.join(repeated)} are the same run; give each run directory once")
    names = [d.name or str(d) for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs, strict=True)]


def curves(records: list[dict], metric: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[metric]) for r in records if isinstance(r.get("step"), int)
              and isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)]
    return [s for s, _ in points], [v for _, v in points]


def chosen_panels(runs: dict[str, list[dict]], wanted: list[str] | None) -> list[tuple[str, tuple[str, ...]]]:
    """The panels to draw: those of PANELS any run has, or one per metric in `wanted` (a metric of PANELS brings its
    panel, loss its eval_loss; any other metric the runs log gets a panel of its own), in that order."""
    if wanted is None:
        return [(title, metrics) for title, metrics in PANELS
                if any(curves(records, m)[0] for records in runs.values() for m in metrics)]
    logged = sorted({key for records in runs.values() for r in records for key, value in r.items()
                     if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)})
    panels: list[tuple[str, tuple[str, ...]]] = []
    for name in wanted:
        if name not in logged:
            raise UserError(f"plot: --metrics {name}: no run logs it; they log {', '.join(logged)}")
        panel = next(((title, metrics) for title, metrics in PANELS if name in metrics), (name, (name,)))
        if panel not in panels:
            panels.append(panel)
    return panels


def plot_runs(run_dirs: list[Path], out: Path, metrics: list[str] | None = None) -> list[str]:
    """Write the figure; returns the panels drawn. `metrics`: the panels to draw (--metrics), or None for every
    panel of PANELS the runs have."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = {name: read_run_metrics(d) for name, d in zip(run_names(run_dirs), run_dirs, strict=True)}
    panels = chosen_panels(runs, metrics)
    if not panels:
        raise UserError(f"plot: no step metrics in {', '.join(str(d / 'metrics.jsonl') for d in run_dirs)} yet")
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels) + 0.4), sharex=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (title, drawn), ax in zip(panels, axes[:, 0], strict=True):
        for index, (name, records) in enumerate(runs.items()):
            for metric in drawn:
                _draw(ax, records, metric, colours[index % len(colours)], f"{name} {metric}" if len(drawn) > 1
                      else name)
        ax.set_ylabel(title)
        if title == "loss scale":
            ax.set_yscale("log", base=2)  # it moves by factors of two
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(f"{', '.join(runs)}: {', '.join(title for title, _ in panels)} against step", fontsize=10)
    figure.tight_layout()
    save_figure(figure, out)
    plt.close(figure)
    return [title for title, _ in panels]


def _draw(ax, records: list[dict], metric: str, colour: str, label: str) -> None:
    """A training metric as a line; an evaluation's as dashed line between round markers, its points apart from
    the training curve it shares a panel with."""
    steps, values = curves(records, metric)
    if not steps:
        return
    if metric in PERCENT:
        values = [100 * v for v in values]
    evaluation = metric.startswith("eval_")
    ax.plot(steps, values, color=colour, linestyle="--" if evaluation else "-", label=label,
            marker="o" if evaluation else ("." if len(steps) < 30 else None), markersize=5 if evaluation else None,
            markerfacecolor="white" if evaluation else None)
