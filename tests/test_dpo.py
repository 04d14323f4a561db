"""DPO (model.dpo) on preference pairs: `data prepare` keeps each pair's two documents side by side, the loss of a
batch equals TRL's formula in torch on transformers' log-probabilities of the same weights, pairs stay whole
across replicas and microbatches, a resumed run reads the reference its start computed, and misfits are one
line."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import REPO, run_cli
from hf_models import hugging_face_model, saved
from test_finetuning_data import chat_tokenizer, say, write_records

from xlatrain.commands.prepare import Request, prepare
from xlatrain.config import load_config
from xlatrain.data.loader import make_global
from xlatrain.data.shards import open_shards
from xlatrain.errors import UserError
from xlatrain.hf.names import naming_of
from xlatrain.hf.writing import checkpoint_tensors, write_checkpoint
from xlatrain.mesh import train_batch_sharding
from xlatrain.models.lora import merged
from xlatrain.program import build_program
from xlatrain.run.metrics import read_metrics
from xlatrain.trainer import train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BETA = 0.1
LORA = ["model.lora.rank=2", "model.lora.alpha=2", "model.lora.targets=[q,k,v,o,gate,up,down]"]
"""alpha = rank: the adapters' scale is 1."""


def preference_records(count, seed=0, messages=False):
    rng = np.random.default_rng(seed)
    if messages:  # TRL's conversational form with the prompt implicit in both answers
        return [{"chosen": [{"role": "user", "content": say(rng)}, {"role": "assistant", "content": say(rng)}],
                 "rejected": [{"role": "user", "content": "same"}, {"role": "assistant", "content": say(rng)}]}
                for _ in range(count)]
    return [{"prompt": say(rng), "chosen": " " + say(rng), "rejected": " " + say(rng)} for _ in range(count)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A tiny Llama checkpoint and preference shards in a tokenizer whose ids it covers."""
    root = tmp_path_factory.mktemp("dpo")
    saved(hugging_face_model("llama"), root / "base")
    tokenizer = chat_tokenizer(root / "tokenizer", "qwen")
    prepare(Request((write_records(root / "pairs.jsonl", preference_records(40)),), root / "shards", str(tokenizer),
                    holdout=0.25))
    return root


def dpo_run(root, *overrides):
    return ["model.name=llama", f"model.init_from=hf:{root / 'base'}", f"model.dpo.beta={BETA}", "data.source=tokens",
            f"data.path={root / 'shards'}", "data.seq_len=32", "batch.global_size=4", "optimizer.lr=1e-2",
            "trainer.log_every=1", "trainer.eval_every=1000", "trainer.progress=false", *overrides]


def test_a_pairs_two_documents_sit_side_by_side_weighted_on_their_answers(pairs, tmp_path):
    """The prompt with the chosen answer, then with the rejected one; and an implicit prompt (conversations that
    begin alike) taken as TRL's extract_prompt takes it."""
    shards = open_shards(pairs / "shards")
    assert shards.pairs and all(len(s.bounds) % 2 == 1 for s in (*shards.train, *shards.eval))
    shard = shards.train[0]
    first, second = (np.asarray(shard.tokens[a:b]) for a, b in zip(shard.bounds[:2], shard.bounds[1:3]))
    answers = [np.flatnonzero(np.asarray(shard.weights[a:b])) for a, b in zip(shard.bounds[:2], shard.bounds[1:3])]
    assert answers[0][0] == answers[1][0] and np.array_equal(first[:answers[0][0]], second[:answers[1][0]])
    records = preference_records(4, messages=True)
    records[0]["rejected"][0]["content"] = records[0]["chosen"][0]["content"]
    out = tmp_path / "implicit"
    prepare(Request((write_records(tmp_path / "chats.jsonl", records[:1] * 4),), out,
                    str(pairs / "tokenizer"), holdout=0.5))
    shard = open_shards(out).train[0]
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(pairs / "tokenizer"))
    weighted = [np.asarray(shard.tokens[a:b])[np.asarray(shard.weights[a:b]) == 1]
                for a, b in zip(shard.bounds[:2], shard.bounds[1:3])]
    assert [reference.decode(w.tolist()) for w in weighted] == [
        records[0][side][1]["content"] + "<|im_end|>\n" for side in ("chosen", "rejected")]


@pytest.mark.parametrize("loss, adapters", [("sigmoid", []), ("ipo", []), ("sigmoid", LORA)],
                         ids=["sigmoid", "ipo", "sigmoid-lora"])
def test_a_batchs_loss_equals_trls_formula_on_transformers_log_probs(loss, adapters, pairs, tmp_path):
    """After two steps (the policy away from the reference), the train step's loss on a fixed batch, against TRL's
    sigmoid (and IPO) loss written in torch, the policy's and the reference's log-probabilities from transformers'
    models of the same weights (with LoRA the policy's adapters merged, the reference the base)."""
    program = build_program(load_config(None, dpo_run(pairs, f"model.dpo.loss={loss}", "mesh.data=1", *adapters)),
                            jax.devices()[:1])
    state = program.create_state()
    program.use_reference(state, tmp_path)
    rows = [program.dataset.train[i] for i in range(4)]
    batch = {k: np.stack([r[k] for r in rows])[None] for k in rows[0]}
    placed = make_global(batch, train_batch_sharding(program.mesh), 1, 1)
    for _ in range(2):
        state, _ = program.train_step(state, placed)
    _, sums = jax.device_get(program.gradients(state, placed))
    ours = float(sums["loss"] / sums["weight"])
    base = pairs / "base"
    write_checkpoint(tmp_path / "policy", json.loads((base / "config.json").read_text()),
                     checkpoint_tensors(naming_of(program.config.model), merged(jax.device_get(state.params), 1.0)),
                     {})

    def log_probs(directory):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        inputs, targets, mask = (torch.tensor(batch[k][0]).reshape(8, -1) for k in ("inputs", "targets", "mask"))
        with torch.no_grad():
            token = torch.log_softmax(model(inputs.long()).logits, -1).gather(-1, targets.long()[..., None])[..., 0]
        summed = (token * mask).sum(-1)
        return (summed / mask.sum(-1) if loss == "ipo" else summed).reshape(4, 2)

    policy, reference = log_probs(tmp_path / "policy"), log_probs(base)
    logits = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    trl = (-torch.nn.functional.logsigmoid(BETA * logits) if loss == "sigmoid" else (logits - 1 / (2 * BETA)) ** 2)
    np.testing.assert_allclose(ours, trl.mean().item(), rtol=1e-5)
    assert abs(ours - (np.log(2) if loss == "sigmoid" else 1 / (2 * BETA) ** 2)) > 1e-3  # it moved


def test_pairs_stay_whole_over_replicas_and_microbatches_and_a_resume_reads_the_reference(pairs, tmp_path, devices):
    def losses(name, *overrides, count=1, steps=3):
        result = train(load_config(None, [*dpo_run(pairs, f"trainer.steps={steps}", "optimizer.schedule=constant"),
                                          *overrides, f"trainer.run_dir={tmp_path / name}"]),
                       devices=devices[:count], echo=lambda _: None)
        return np.array([result.losses[s] for s in sorted(result.losses)])

    one = losses("one", "mesh.data=1")
    np.testing.assert_allclose(losses("split", "mesh.data=2", "batch.microbatches=2", count=2), one, rtol=1e-5)
    losses("resumed", "mesh.data=1", steps=2)
    assert (tmp_path / "resumed" / "reference_log_probs.npz").is_file()
    np.testing.assert_array_equal(losses("resumed", "mesh.data=1")[-1:], one[-1:])


@pytest.mark.parametrize("case", ["no_pairs", "pairs_without_dpo", "packed_pairs", "pipeline", "reference_gone"])
def test_dpo_misfits_are_one_line(case, pairs, tmp_path):
    if case == "no_pairs":
        records = [{"prompt": "p", "completion": " c"}] * 8
        prepare(Request((write_records(tmp_path / "in.jsonl", records),), tmp_path / "sft",
                        str(pairs / "tokenizer"), holdout=0.25))
        overrides, expected = [f"data.path={tmp_path / 'sft'}", "data.packing=true"], "the data holds none"
    else:
        overrides, expected = {
            "pairs_without_dpo": (["model.dpo=null"], "holds preference pairs, which train with DPO: set model.dpo"),
            "packed_pairs": (["data.packing=true"], "preference pairs, each sequence a row of its own"),
            "pipeline": (["mesh.stage=2", "parallel.mode=shard_map"], "model.dpo is not built with mesh.stage"),
            "reference_gone": ([], "reference_log_probs.npz is missing")}[case]
    config = load_config(None, [*dpo_run(pairs), *overrides, f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match=expected):
        program = build_program(config, jax.devices()[:2] if case == "pipeline" else jax.devices()[:1])
        program.use_reference(None, tmp_path)


def test_the_example_config_trains_on_pairs(pairs, tmp_path):
    done = run_cli("train", str(REPO / "examples" / "configs" / "llama_dpo.yaml"),
                   f"model.init_from=hf:{pairs / 'base'}", f"data.path={pairs / 'shards'}", "data.seq_len=32",
                   "trainer.steps=3", "trainer.log_every=1",
                   f"trainer.run_dir={tmp_path / 'run'}", env={"XLA_FLAGS": os.environ["XLA_FLAGS"]})
    assert done.returncode == 0, done.stderr
    logged = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3] and abs(logged[0]["loss"] - np.log(2)) < 1e-5
    assert {"rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"} <= set(logged[0])
