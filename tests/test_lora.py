"""LoRA (model.lora): a run from a Hugging Face checkpoint and a PEFT adapter trains as peft + transformers do, its
base frozen (no optimizer state, no gradient), and its adapters and merged weights go back to peft and
transformers with the run's logits."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, run_cli
from hf_models import VOCAB, hugging_face_model, logits_of, saved
from test_finetuning_data import chat_tokenizer, conversation, write_records

from xlatrain.cli import main
from xlatrain.commands.trained import from_run
from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.program import build_program
from xlatrain.trainer import train

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR, STEPS = 4, 8.0, 1e-3, 10
"""At lr 1e-2 the two sides part by 4e-5 after 7 steps: Adam divides float32 rounding in near-zero gradients by
their own size."""


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny Llama checkpoint, an adapter on all seven projections drawn by PEFT with B random too (so that every
    adapter matters from the first step), and 9 rows of token ids (8 train: the whole batch every step)."""
    root = tmp_path_factory.mktemp("lora")
    reference = hugging_face_model("llama")
    saved(reference, root / "base")
    torch.manual_seed(1)
    adapted = peft.get_peft_model(hugging_face_model("llama"), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=MODULES, lora_dropout=0.0, init_lora_weights=False))
    adapted.save_pretrained(root / "adapter")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (9, 17)).astype(np.int32)
    np.savez(root / "tokens.npz", inputs=tokens[:, :-1], targets=tokens[:, 1:])
    return root, tokens[:8]


def lora_run(root, *overrides):
    return ["model.name=llama", f"model.init_from=hf:{root / 'base'}", f"model.lora.rank={RANK}",
            f"model.lora.alpha={ALPHA}", f"model.lora.targets=[{','.join(TARGETS)}]",
            f"model.lora.init_from={root / 'adapter'}", "data.source=arrays", f"data.path={root / 'tokens.npz'}",
            "batch.global_size=8", "optimizer.schedule=constant", f"optimizer.lr={LR}", "optimizer.clip_norm=null",
            f"trainer.steps={STEPS}", "trainer.log_every=1", "trainer.eval_every=1000", "trainer.progress=false",
            *overrides]


@pytest.fixture(scope="module")
def trained_run(start, devices):
    root, _ = start
    run = root / "run"
    result = train(load_config(None, [*lora_run(root), f"trainer.run_dir={run}"]), devices=devices[:1],
                   echo=lambda _: None)
    return run, np.array([result.losses[s] for s in sorted(result.losses)])


def test_the_first_ten_losses_equal_peft_and_transformers(start, trained_run):
    root, rows = start
    model = peft.PeftModel.from_pretrained(hugging_face_model("llama"), root / "adapter", is_trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    inputs, targets = torch.tensor(rows[:, :-1]).long(), torch.tensor(rows[:, 1:]).long()
    expected = []
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(inputs).logits.reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    np.testing.assert_allclose(trained_run[1], expected, rtol=1e-5)


def test_the_base_is_frozen_without_optimizer_state_or_gradients(start, devices):
    """Optimizer state for the adapters alone, and no matmul in the compiled step that makes a frozen weight's
    shape (a weight gradient), where full fine-tuning's step has one per weight matrix."""
    root, _ = start
    adapted = build_program(load_config(None, lora_run(root)), devices[:1])
    full = build_program(load_config(None, [o for o in lora_run(root) if not o.startswith("model.lora")]),
                         devices[:1])
    moments = jax.tree_util.tree_flatten_with_path(adapted.abstract_state.opt_state)[0]
    assert {jax.tree_util.keystr(path).rsplit("'", 2)[-2] for path, leaf in moments if leaf.ndim} == {"lora_a",
                                                                                                       "lora_b"}
    kernels = {f"f32[{','.join(map(str, shape))}]" for leaf in jax.tree.leaves(full.abstract_state.params)
               if leaf.ndim >= 2 for shape in (leaf.shape[-2:], leaf.shape[-2:][::-1])}  # either side transposed

    def weight_gradients(program):
        lines = program.train_step.first.compiled.as_text().splitlines()
        return sum(1 for line in lines if re.search(r"= (f32\[[0-9,]+\])\{[0-9,]*\} dot\(", line) and
                   re.search(r"= (f32\[[0-9,]+\])", line).group(1) in kernels)

    assert weight_gradients(adapted) == 0 and weight_gradients(full) >= 7 * 2 + 1


def test_the_exported_adapter_and_merged_model_give_the_runs_logits(start, trained_run, tmp_path):
    import transformers

    root, _ = start
    run, _ = trained_run
    assert main(["export", str(run), "--peft", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    tokens = np.random.default_rng(5).integers(0, VOCAB, (2, 16))
    trained = from_run(run, None, "test")[0]
    graphdef, params = trained.module()
    from flax import nnx

    ours = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens, jnp.int32)))
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    missing = loaded.load_adapter(tmp_path / "adapter", adapter_name="again")
    assert not missing.missing_keys or all("lora" not in key for key in missing.missing_keys)
    loaded.set_adapter("default")
    np.testing.assert_allclose(logits_of(loaded.eval(), tokens), ours, rtol=1e-5, atol=1e-5)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(logits_of(merged.eval(), tokens), ours, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == RANK


@pytest.mark.parametrize("case", ["gpt", "no_targets", "experts_mlp", "rank", "targets", "no_adapters"])
def test_bad_lora_settings_are_one_line(case, start, tmp_path, capsys):
    root, _ = start
    expected = {"gpt": "model.lora adapts the separate q, k, v and MLP projections of model.name=llama",
                "no_targets": "model.lora.targets: names no projection",
                "experts_mlp": "gate, up and down name no projection of a model whose MLPs are experts",
                "rank": "the adapter's rank is 4, where model.lora's is 8",
                "targets": "the adapter's targets is",
                "no_adapters": "trained without model.lora"}[case]
    if case == "no_adapters":
        run = tmp_path / "plain"
        train(load_config(None, [o for o in lora_run(root, "trainer.steps=1") if not o.startswith("model.lora")]
                          + [f"trainer.run_dir={run}"]), devices=jax.devices()[:1], echo=lambda _: None)
        assert main(["export", str(run), "--peft", str(tmp_path / "out")]) == 2
        assert expected in capsys.readouterr().err
        return
    overrides = {"gpt": ["model.name=gpt", "model.lora.rank=4"], "no_targets": ["model.lora.targets=[]"],
                 "experts_mlp": ["model.moe.experts=4", "model.lora.targets=[q,up]"],
                 "rank": ["model.lora.rank=8"], "targets": ["model.lora.targets=[q,v]"]}[case]
    with pytest.raises(UserError, match=expected.replace("(", r"\(")):
        config = load_config(None, [*[o for o in lora_run(root) if case != "gpt" or "init_from" not in o],
                                    *overrides])
        build_program(config, jax.devices()[:1]).create_state()


SCRATCH = ["model.name=llama", "model.layers=2", "model.width=32", "model.heads=2", "model.kv_heads=1",
           "data.seq_len=16", "data.max_bytes=100000", "data.glob='*.py'", "batch.global_size=8", "trainer.steps=3",
           "trainer.log_every=1", "trainer.eval_every=1000", "trainer.progress=false", "model.lora.rank=2",
           f"model.lora.targets=[{','.join(TARGETS)}]", "optimizer.lr=1e-2", "optimizer.clip_norm=null",
           "optimizer.schedule=constant"]


def scratch_losses(run_dir, *overrides, devices):
    result = train(load_config(None, [*SCRATCH, *overrides, f"trainer.run_dir={run_dir}"]), devices=devices,
                   echo=lambda _: None)
    return np.array([result.losses[s] for s in sorted(result.losses)])


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory, devices):
    return scratch_losses(tmp_path_factory.mktemp("one") / "run", "mesh.data=1", devices=devices[:1])


@pytest.mark.parametrize("layout, count", [
    (["parallel.strategy=fsdp"], 2),
    (["mesh.tensor=2", "mesh.data=1", "parallel.mode=shard_map"], 2),
    (["mesh.stage=2", "mesh.tensor=2", "mesh.data=1", "parallel.mode=shard_map", "parallel.pipeline.microbatches=2",
      "parallel.pipeline.schedule=zb1p"], 4)], ids=["fsdp", "tensor-per-device", "pipeline-tensor-zb1p"])
def test_lora_sharded_or_pipelined_trains_as_on_one_device(layout, count, one_device_losses, tmp_path, devices):
    """Per device, an adapter held whole in a tensor group gets each device's part of its gradient, summed over the
    group (models/lora.py: RANK_AXIS)."""
    np.testing.assert_allclose(scratch_losses(tmp_path / "run", *layout, devices=devices[:count]),
                               one_device_losses, rtol=1e-6)


def test_a_resumed_lora_run_continues_exactly(one_device_losses, tmp_path, devices):
    run = tmp_path / "run"
    scratch_losses(run, "mesh.data=1", "trainer.steps=2", devices=devices[:1])
    resumed = train(load_config(None, [*SCRATCH, "mesh.data=1", f"trainer.run_dir={run}"]), devices=devices[:1],
                    echo=lambda _: None)
    assert resumed.losses[3] == one_device_losses[2]


def test_the_example_config_trains_adapters_and_exports_them(tmp_path):
    from xlatrain.commands.prepare import Request, prepare

    rng = np.random.default_rng(0)
    records = write_records(tmp_path / "chats.jsonl", [conversation(rng, n) for n in range(16)])
    prepare(Request((records,), tmp_path / "shards", str(chat_tokenizer(tmp_path / "tokenizer", "qwen")),
                    holdout=0.25))
    done = run_cli("train", str(REPO / "examples" / "configs" / "llama_lora.yaml"), f"data.path={tmp_path / 'shards'}",
                   "data.seq_len=64", "trainer.steps=3", "model.layers=1", "model.width=32", "model.lora.rank=2",
                   f"trainer.run_dir={tmp_path / 'run'}", env={"XLA_FLAGS": os.environ["XLA_FLAGS"]})
    assert done.returncode == 0, done.stderr
    assert main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], sorted(config["target_modules"])) == (2, sorted(MODULES))
