"""Config parsing, overrides, derived values, and every user error through the CLI (exit 2, one line)."""

import pytest
import yaml
from conftest import REPO, run_cli

from xlatrain.cli import main
from xlatrain.config import Config, config_and_derived_to_yaml, derive, load_config
from xlatrain.errors import UserError


def cli_error(capsys, *args):
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("xlatrain: error: ") and "Traceback" not in err
    return err


def test_default_config_is_the_gpt_example():
    assert load_config(None) == load_config(REPO / "examples/configs/gpt_stdlib.yaml") == Config()


def test_yaml_and_overrides_merge(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "mlp", "hidden": [8]}, "data": {"source": "digits"},
                                    "trainer": {"steps": 5}}))
    config = load_config(path, ["trainer.steps=7", "model.hidden=[4,4]", "trainer.run_dir=/tmp/x"])
    assert config.trainer.steps == 7 and config.model.hidden == (4, 4) and str(config.run_dir()) == "/tmp/x"
    assert config.model.name == "mlp"


def test_override_of_default_model_keeps_its_kind():
    assert load_config(None, ["model.layers=2"]).model.name == "gpt"


def test_config_command_prints_derived_values(capsys, devices):
    assert main(["config", "examples/configs/digits_cnn.yaml", "batch.microbatches=2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["derived"] == {"devices": 8, "data_parallel": 8, "global_batch": 128, "per_replica_batch": 16,
                                  "microbatches": 2, "microbatch_size": 64, "lr_scale": 4.0, "stages": 1,
                                  "effective_lr": pytest.approx(0.2)}
    assert printed["optimizer"]["name"] == "sgd"


def test_per_replica_batch_and_sqrt_scaling(devices):
    config = load_config(None, ["batch.per_replica=4", "optimizer.lr_scaling=sqrt", "optimizer.base_batch_size=8",
                                "optimizer.lr=0.01"])
    derived = derive(config, devices)
    assert derived.global_batch == 32 and derived.per_replica_batch == 4
    assert derived.effective_lr == pytest.approx(0.02)


def test_a_runs_config_yaml_with_its_derived_values_is_a_config_to_start_from(tmp_path, devices, capsys):
    config = load_config(REPO / "examples/configs/digits_mlp.yaml", ["batch.global_size=32", "trainer.steps=9"])
    saved = tmp_path / "config.yaml"
    saved.write_text(config_and_derived_to_yaml(config, derive(config, devices).as_dict()))
    assert load_config(saved) == config
    assert "pass a YAML file (e.g. " in cli_error(capsys, "config", str(tmp_path))  # the file it names loads
    saved.write_text("derived: 3\n")  # not what xlatrain writes: an unknown key, as before
    assert "unknown key 'derived'" in cli_error(capsys, "config", str(saved))


def test_unknown_key_suggests_the_right_one(capsys):
    err = cli_error(capsys, "config", "trainer.stepz=3")
    assert "unknown key 'trainer.stepz'" in err and "did you mean 'steps'" in err


def test_unknown_key_inside_a_model_kind(capsys):
    err = cli_error(capsys, "config", "model.layerz=3")
    assert "unknown key 'model.layerz'" in err and "'layers'" in err


def test_wrong_type(capsys):
    err = cli_error(capsys, "config", "trainer.steps=abc")
    assert "trainer.steps" in err and "valid integer" in err


def test_out_of_range(capsys):
    err = cli_error(capsys, "config", "optimizer.lr=-1")
    assert "optimizer.lr" in err and "greater than 0" in err


@pytest.mark.parametrize("override", ["optimizer.lr=inf", "optimizer.lr=1e400", "optimizer.eps=.nan",
                                      "optimizer.weight_decay=inf", "optimizer.clip_norm=inf",
                                      "collectives.timeout_s=inf", "precision.loss_scale.growth_factor=inf"])
def test_a_number_that_is_not_finite_is_refused(capsys, override):
    """An infinite learning rate trained to a NaN loss at step 2 instead of failing here."""
    key = override.split("=")[0]
    assert f"config: {key}: Input should be a finite number (got " in cli_error(capsys, "config", override)


@pytest.mark.parametrize("partition", ["[0,4,2,2]", "abc", "[1.5,2]", "[true,1]"])
def test_a_malformed_partition_is_one_message(capsys, partition):
    err = cli_error(capsys, "config", "mesh.stage=2", f"parallel.pipeline.partition={partition}")
    assert err.count("\n") == 1 and ("parallel.pipeline.partition: must be auto or a list of block counts, each at "
                                     "least 1, one per pipeline chunk (got ") in err, err


def test_unknown_choice(capsys):
    err = cli_error(capsys, "config", "optimizer.name=adam9")
    assert "optimizer" in err and "'adamw'" in err


def test_batch_not_divisible(capsys, devices):
    err = cli_error(capsys, "config", "batch.global_size=20", "batch.microbatches=2")
    assert "batch.global_size=20 is not divisible by data-parallel size 8 x batch.microbatches 2 = 16" in err


def test_mesh_does_not_match_devices(capsys, devices):
    err = cli_error(capsys, "config", "mesh.data=4")
    assert "mesh.data=4 needs 4 devices but 8 cpu device(s) are present" in err
    assert "TFRT_CPU_0" in err or "cpu:0" in err or "CpuDevice" in err
    assert "--xla_force_host_platform_device_count=4" in err


def test_a_mesh_that_does_not_match_the_devices_of_several_processes_names_the_launch_not_cpu_devices():
    from types import SimpleNamespace

    from xlatrain.config import MeshConfig, resolve_data_parallel

    devices = [SimpleNamespace(platform="cpu", process_index=i, id=i) for i in range(3)]
    with pytest.raises(UserError) as refused:
        resolve_data_parallel(MeshConfig(data=2), devices)
    message = str(refused.value)
    assert "mesh.data=2 needs 2 devices but 3 cpu device(s) are present" in message
    assert "start 2 devices over the processes (3 now): with `xlatrain launch`, --nproc x --devices-per-proc" in message
    assert "mesh.cpu_devices" not in message


def test_logical_rules_merge_over_defaults_and_name_real_mesh_axes(capsys):
    rules = load_config(None, ["parallel.logical_rules.embed=null", "parallel.logical_rules.vocab=data",
                               "parallel.logical_rules.heads=[data,tensor]"]).parallel.logical_rules
    assert rules["embed"] == () and rules["mlp"] == ("tensor", "data")
    assert rules["vocab"] == ("data",) and rules["heads"] == ("data", "tensor")
    err = cli_error(capsys, "config", "parallel.logical_rules.embed=model")
    assert "parallel.logical_rules" in err and "['data', 'expert', 'tensor']" in err
    assert "twice" in cli_error(capsys, "config", "parallel.logical_rules.mlp=[data,data]")


def test_distributed_settings_must_agree(capsys):
    assert "process_id=2 must be below distributed.num_processes=2" in cli_error(
        capsys, "config", "distributed.coordinator=127.0.0.1:1234", "distributed.num_processes=2",
        "distributed.process_id=2")
    assert "needs distributed.coordinator" in cli_error(capsys, "train", "distributed.num_processes=2")


def test_missing_data_path(capsys, tmp_path):
    err = cli_error(capsys, "config", "data.source=arrays", f"data.path={tmp_path / 'nope.npz'}")
    assert "data.path=" in err and "does not exist" in err


def test_missing_config_file(capsys):
    err = cli_error(capsys, "train", "no_such_config.yaml")
    assert "'no_such_config.yaml' not found" in err


def test_model_and_data_must_fit(capsys):
    err = cli_error(capsys, "config", "model.name=mlp")
    assert "data.source=digits" in err


def test_errors_exit_2_in_a_real_process():
    result = run_cli("config", "mesh.data=3")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=3" in result.stderr


@pytest.mark.parametrize("overrides, mode", [
    ([], "jit"),
    (["parallel.strategy=fsdp"], "jit"),
    (["mesh.stage=2"], "shard_map"),
    (["collectives.impl=custom"], "shard_map"),
    (["collectives.impl=custom", "parallel.mode=pmap"], "pmap"),
])
def test_parallel_mode_auto_picks_the_program_the_run_needs(overrides, mode):
    assert load_config(None, overrides).parallel.mode == mode


def test_parallel_mode_auto_names_its_choice_when_the_strategy_cannot_follow():
    with pytest.raises(UserError, match=r"parallel.mode=shard_map \(chosen by parallel.mode=auto for "
                                        r"collectives.impl=custom\) supports parallel.strategy replicated or zero1"):
        load_config(None, ["collectives.impl=custom", "parallel.strategy=fsdp"])


@pytest.mark.parametrize("name, pointer", [
    ("dualpipev", "the nearest here is zbv, DualPipeV's V placement"), ("ScheduleZBVZeroBubble", "here it is zbv"),
    ("ZB-H1", "here it is zb1p"), ("Schedule1F1B", "here it is 1f1b"), ("Interleaved1F1B", "here it is interleaved"),
    ("ZBV", "here it is zbv")])
def test_a_schedule_named_as_elsewhere_points_to_xlatrains(name, pointer):
    with pytest.raises(UserError) as refused:
        load_config(None, ["mesh.stage=2", f"parallel.pipeline.schedule={name}"])
    said = str(refused.value)
    assert said.startswith(f"config: parallel.pipeline.schedule: not a schedule name of xlatrain's; {pointer}"), said
    assert said.endswith(f"(got {name!r})"), said
    with pytest.raises(UserError, match=r"Input should be 'gpipe', '1f1b', 'interleaved', 'zb1p' or 'zbv' \(got 'x'\)"):
        load_config(None, ["mesh.stage=2", "parallel.pipeline.schedule=x"])


def test_each_parity_side_gets_the_devices_of_its_whole_mesh():
    from xlatrain.commands.parity import side_devices

    assert len(side_devices(load_config(None, ["mesh.data=3", "mesh.stage=2"]))) == 6
    assert len(side_devices(load_config(None, ["mesh.data=2"]))) == 2
    assert len(side_devices(load_config(None, []))) == 8


def test_a_bad_interpolation_names_the_override_or_the_file_key_holding_it(capsys, tmp_path):
    err = cli_error(capsys, "config", "trainer.run_dir=${nope}")
    assert "override 'trainer.run_dir=${nope}': Interpolation key 'nope' not found" in err
    err = cli_error(capsys, "config", "name=${oc.decode:'[1'}")
    assert "override \"name=${oc.decode:'[1'}\": GrammarParseError" in err
    (tmp_path / "run.yaml").write_text("trainer:\n  run_dir: ${nope}\n")
    err = cli_error(capsys, "config", str(tmp_path / "run.yaml"))
    assert f"{tmp_path / 'run.yaml'}: trainer.run_dir: Interpolation key 'nope' not found" in err


def test_home_and_variables_in_paths_are_expanded(tmp_path, monkeypatch, capsys):
    """As a shell would: a shell leaves `~` alone inside key=value, and a YAML file always does."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XLATRAIN_TEST_DATA", str(tmp_path / "texts"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text to read " * 20)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "run.yaml").write_text("trainer:\n  run_dir: ~/runs/x\n")
    config = load_config("~/run.yaml", ["data.path=$XLATRAIN_TEST_DATA", "data.tokenizer=~/tokenizer.json",
                                        "trainer.compile_cache=$HOME/cache"])
    assert config.trainer.run_dir == str(tmp_path / "runs" / "x") and config.data.path == str(tmp_path / "texts")
    assert config.data.tokenizer == str(tmp_path / "tokenizer.json")
    assert config.trainer.compile_cache == str(tmp_path / "cache") and config.run_dir() == tmp_path / "runs" / "x"
    err = cli_error(capsys, "config", "model.init_from=hf:~/no_checkpoint")
    assert f"{tmp_path / 'no_checkpoint'}' holds no config.json" in err
    err = cli_error(capsys, "report", "~/no_run")
    assert f"{tmp_path / 'no_run' / 'summary.jsonl'} not found" in err


@pytest.mark.parametrize("override, expected", [
    ("data.glob='../*.py'", "data.glob='../*.py' must be a non-empty pattern relative to data.path, without `..`"),
    ("trainer.wandb.project='a/b c'", "trainer.wandb.project: not a W&B project name (it has /)"),
])
def test_a_glob_out_of_its_directory_and_a_project_wandb_refuses_are_config_errors(capsys, override, expected):
    """The glob read files outside data.path; W&B's refusal named trainer.loggers and advised logging in."""
    assert expected in cli_error(capsys, "config", override)


@pytest.mark.parametrize("overrides, expected", [
    (["model.layers=2", "model.layer_types=[full,sliding]"],
     "model.layer_types has sliding layers, and model.sliding_window is null"),
    (["model.sliding_window=8", "model.layer_types=[full]"], "model.layer_types names 1 layers, and model.layers=4"),
])
def test_layer_types_that_do_not_fit_the_layers_or_the_window_are_one_line(capsys, overrides, expected):
    assert expected in cli_error(capsys, "config", "model.name=llama", *overrides)
