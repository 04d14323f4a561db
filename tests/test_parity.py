"""`xlatrain parity`: identical computations agree, a changed hyperparameter is caught at its first step."""

from conftest import DIGITS_MLP

from xlatrain.cli import main
from xlatrain.parity import compare


def test_one_device_and_eight_devices_fsdp_agree(capsys, devices):
    code = main(["parity", "examples/configs/digits_mlp.yaml", "--a", "mesh.data=1", "--b",
                 "parallel.strategy=fsdp", "--steps", "10"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no divergence over 10 steps" in out


def test_a_different_learning_rate_diverges_at_step_one_and_both_curves_are_drawn(capsys, tmp_path):
    chart = tmp_path / "parity.png"
    code = main(["parity", "--a", *DIGITS_MLP, "--b", *DIGITS_MLP, "optimizer.lr=0.01", "--steps", "5",
                 "--plot", str(chart)])
    out = capsys.readouterr().out
    assert code == 1
    assert "first divergence at step 1: param_norm" in out and f"wrote {chart}" in out
    from PIL import Image

    with Image.open(chart) as image:
        assert image.format == "PNG"


def test_compare_reports_the_first_step_beyond_tolerance():
    a = {s: {"loss": 1.0, "param_norm": 2.0} for s in (1, 2, 3)}
    b = {1: {"loss": 1.0, "param_norm": 2.0}, 2: {"loss": 1.00001, "param_norm": 2.0},
         3: {"loss": float("nan"), "param_norm": 2.0}}
    report = compare(a, b, 3, rtol=1e-4)
    assert report.first.step == 3 and report.first.metric == "loss"
    assert compare(a, a, 3, rtol=0.0).first is None


def test_too_many_configs_is_a_user_error(capsys):
    assert main(["parity", "a.yaml", "b.yaml", "c.yaml"]) == 2
    assert "at most two configs" in capsys.readouterr().err
