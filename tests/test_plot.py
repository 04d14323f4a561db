"""`xlatrain plot`: runs' curves from metrics.jsonl, overlaid; a killed run's torn last line is tolerated."""

import errno
import json
from pathlib import Path

from PIL import Image

from xlatrain.cli import main


def write_run(path, records, torn_tail=""):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + torn_tail)
    return path


def steps(n, **extra):
    return [{"step": s, "loss": 2.0 / s, "lr": 1e-3, "samples_per_sec": 100.0 + s, "skipped": False, **extra}
            for s in range(1, n + 1)]


def test_two_runs_are_drawn_on_the_panels_they_have(tmp_path, capsys):
    fp32 = write_run(tmp_path / "a" / "run", [*steps(20), {"step": 20, "eval_loss": 0.2}])
    fp16 = write_run(tmp_path / "b" / "run", steps(12, loss_scale=32768.0), torn_tail='{"step": 13, "lo')
    out = tmp_path / "curves.png"
    assert main(["plot", str(fp32), str(fp16), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (f"wrote {out} (loss, learning rate, loss scale, samples / s against "
                                               "step, 2 run(s))")
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[1] > image.size[0]  # one panel under another


def test_a_missing_or_corrupt_metrics_file_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "plot: " + str(tmp_path / "nowhere" / "metrics.jsonl") + " does not exist" in capsys.readouterr().err
    broken = write_run(tmp_path / "broken", steps(2))
    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\nnot json\n{"step": 2, "loss": 0.5}\n')
    assert main(["plot", str(broken), "--out", str(tmp_path / "x.png")]) == 2
    assert "metrics.jsonl:2 is not a JSON record" in capsys.readouterr().err
    assert main(["plot", str(broken), "--out", str(tmp_path / "no" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = write_run(tmp_path / "run", steps(2))
    assert main(["plot", str(run), str(tmp_path / "broken" / ".." / "run"), "--out", str(tmp_path / "x.png")]) == 2
    assert "are the same run; give each run directory once" in capsys.readouterr().err


def test_the_figure_path_is_a_file_matplotlib_can_write(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps(3))
    assert main(["plot", str(run), "--out", str(tmp_path)]) == 2
    assert f"--out '{tmp_path}' is a directory; give a file name" in capsys.readouterr().err
    assert main(["plot", str(run), "--out", str(tmp_path / "curves.xyz")]) == 2
    assert "matplotlib cannot write '.xyz' files; end the name with one of" in capsys.readouterr().err
    assert main(["plot", str(run), "--out", str(tmp_path / "curves")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'curves.png'} (")
    assert (tmp_path / "curves.png").is_file()
    assert main(["plot", str(run), "--out", str(tmp_path / "curves.svg")]) == 0
    assert (tmp_path / "curves.svg").read_text().lstrip().startswith("<?xml")


def test_a_figure_that_cannot_be_written_keeps_the_old_one(tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    run = write_run(tmp_path / "run", steps(3))
    out = tmp_path / "curves.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    before = out.read_bytes()

    def disk_full(figure, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", disk_full)
    assert main(["plot", str(run), "--out", str(out)]) == 2
    assert f"xlatrain: error: cannot write {out}: No space left on device" in capsys.readouterr().err
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "run"]


def test_accuracy_mfu_in_percent_marked_evaluations_integer_steps_a_title_and_chosen_panels(tmp_path, capsys,
                                                                                               monkeypatch):
    from xlatrain.observe import plot

    drawn = {}
    monkeypatch.setattr(plot, "save_figure", lambda figure, path: drawn.update(figure=figure))
    run = write_run(tmp_path / "digits", [*steps(7, accuracy=0.5, mfu=0.021), {"step": 7, "eval_loss": 0.4,
                                                                            "eval_accuracy": 0.9}])
    assert main(["plot", str(run), "--out", str(tmp_path / "a.png")]) == 0
    assert "(loss, accuracy, learning rate, samples / s, MFU (%) against step, 1 run(s))" in capsys.readouterr().out
    figure = drawn["figure"]
    assert figure._suptitle.get_text() == "digits: loss, accuracy, learning rate, samples / s, MFU (%) against step"
    loss, accuracy, *_, mfu = figure.axes
    train_line, eval_line = accuracy.get_lines()
    assert train_line.get_marker() == "." and eval_line.get_marker() == "o" and eval_line.get_linestyle() == "--"
    assert list(eval_line.get_ydata()) == [0.9] and list(mfu.get_lines()[0].get_ydata()) == [2.1] * 7
    assert all(tick == int(tick) for tick in mfu.get_xticks())  # steps are whole numbers
    assert main(["plot", str(run), "--metrics", "grad_norm,eval_loss", "--out", str(tmp_path / "b.png")]) == 2
    assert "--metrics grad_norm: no run logs it; they log accuracy, eval_accuracy, eval_loss, loss, lr, mfu" \
        in capsys.readouterr().err
    assert main(["plot", str(run), "--metrics", "samples_per_sec,eval_loss", "--out", str(tmp_path / "b.png")]) == 0
    assert "(samples / s, loss against step" in capsys.readouterr().out
