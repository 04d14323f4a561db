"""Hugging Face checkpoints out (`xlatrain export --hf`) and sampling (`xlatrain sample`): an exported run loads
into transformers with no missing or unexpected keys and the same logits, its tokenizer into AutoTokenizer;
greedy sampling equals transformers' generate token for token; runs trained pipelined or sharded sample on one
device; every bad checkpoint, prompt or output path is one line and exit 2."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_GPT, run_cli
from flax import nnx
from hf_models import VOCAB, hugging_face_model, logits_of, saved
from test_user_errors import assert_one_line_error

from xlatrain.cli import main
from xlatrain.commands.sample import Request, sample
from xlatrain.commands.trained import from_hugging_face, from_run
from xlatrain.config import load_config
from xlatrain.data.tokenizers import byte_tokenizer, load_tokenizer
from xlatrain.models import decoder
from xlatrain.models.sampling import Sampling, filtered_logits, generate
from xlatrain.trainer import train

TINY_RUN = [*TINY_GPT, "batch.global_size=8", "trainer.steps=3"]
LLAMA = ["model.name=llama", "model.kv_heads=1"]
QWEN3 = [*LLAMA, "model.qk_norm=head"]
WINDOWS = ["model.sliding_window=4", "model.layer_types=[full,sliding]"]
GEMMA2 = [*LLAMA, "model.norm_plus_one=true", "model.sandwich_norms=true", "model.embed_scale=true",
          "model.mlp_activation=gelu_tanh", "model.tie_embeddings=true", "model.score_scale_dim=24",
          "model.sliding_window=4", "model.layer_types=[sliding,full]", "model.attn_softcap=0.5",
          "model.logit_softcap=0.5"]
GEMMA3 = [*[o for o in GEMMA2 if "softcap" not in o], "model.qk_norm=head", "model.rope_theta_sliding=10000",
          "model.rope_theta=1000000"]
GPT2 = ["model.name=gpt", "model.tie_embeddings=true", "model.head_bias=false"]
"""The built-in GPT as GPT-2 has it: the embedding's transpose as the head, no bias."""


def trained_run(run_dir, *overrides, devices=None, model=tuple(LLAMA)):
    train(load_config(None, [*TINY_RUN, *model, f"trainer.run_dir={run_dir}", *overrides]), devices=devices,
          echo=lambda _: None)
    return run_dir


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, devices):
    return trained_run(tmp_path_factory.mktemp("runs") / "llama", devices=devices[:1])


def our_logits(trained, tokens):
    graphdef, params = trained.module()
    return np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens, jnp.int32)))


@pytest.mark.parametrize("model, architecture", [
    (LLAMA, "LlamaForCausalLM"), (QWEN3, "Qwen3ForCausalLM"), ([*QWEN3, *WINDOWS], "Qwen3ForCausalLM"),
    ([*LLAMA, "model.sliding_window=4"], "MistralForCausalLM"), (GEMMA2, "Gemma2ForCausalLM"),
    (GEMMA3, "Gemma3ForCausalLM"), (GPT2, "GPT2LMHeadModel")],
    ids=["llama", "qwen3", "qwen3-mixed-windows", "mistral-window", "gemma2", "gemma3", "gpt2"])
def test_an_exported_run_loads_into_transformers_with_its_logits_and_its_tokenizer(model, architecture, tmp_path,
                                                                                   devices):
    import transformers

    run_dir = trained_run(tmp_path / "run", devices=devices[:1], model=model)
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--hf", str(out)]) == 0
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not found for found in info.values()) and type(loaded).__name__ == architecture, info
    if "model.sliding_window=4" in model and architecture != "MistralForCausalLM":  # the layers keep their kinds
        assert loaded.config.layer_types == [{"full": "full_attention", "sliding": "sliding_attention"}[kind]
                                             for kind in load_config(None, [*TINY_RUN, *model]).model.layer_types]
        assert loaded.config.sliding_window == 4
    assert loaded.config.bos_token_id is None and loaded.config.eos_token_id is None  # bytes have no end of text
    assert load_tokenizer(str(out)).fingerprint == byte_tokenizer().fingerprint  # read back as the bytes they are
    tokens = np.random.default_rng(0).integers(0, 256, (2, 32))
    trained = from_run(run_dir, None, "test")[0]
    np.testing.assert_allclose(logits_of(loaded.eval(), tokens), our_logits(trained, tokens), rtol=1e-5, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "def main():\n    return 'ok'\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer(text)["input_ids"] == trained.tokenizer.encode_batch([text])[0].tolist()
    # and back in: the exported directory initialises a run with the same logits
    again = from_hugging_face(out, "test")
    np.testing.assert_allclose(our_logits(again, tokens), our_logits(trained, tokens), rtol=1e-6, atol=1e-6)


def test_the_gpt_with_a_head_bias_is_not_exported_as_gpt2(tmp_path, devices, capsys):
    run_dir = trained_run(tmp_path / "run", devices=devices[:1], model=["model.name=gpt"])
    assert main(["export", str(run_dir), "--hf", str(tmp_path / "hf")]) == 2
    assert "model.head_bias=true" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_windows_only_some_layers_of_a_model_without_qwens_marks_have_no_hugging_face_architecture():
    from xlatrain.config.hugging_face import hugging_face_config
    from xlatrain.errors import UserError

    model = load_config(None, [*LLAMA, "model.layers=2", *WINDOWS]).model
    with pytest.raises(UserError, match="sliding-window layers in a model without Qwen's q, k and v biases or q/k "
                                        "norms export as Mistral, which windows every layer"):
        hugging_face_config(model, 256, 32)
    with pytest.raises(UserError, match=r"Gemma 2 and 3 are the Hugging Face families with Gemma's layers, and they "
                                        r"have model.norm_plus_one=true, model.embed_scale=true too"):
        hugging_face_config(load_config(None, [*QWEN3, "model.sandwich_norms=true", "model.mlp_activation=gelu_tanh"]
                                        ).model, 256, 32)
    qwen2 = hugging_face_config(load_config(None, [*LLAMA, "model.layers=2", "model.qkv_bias=true", *WINDOWS]).model,
                                256, 32)
    assert (qwen2["model_type"], qwen2["layer_types"], qwen2["max_window_layers"], qwen2["use_sliding_window"]) == (
        "qwen2", ["full_attention", "sliding_attention"], 1, True)


def generated_by_transformers(model, prompt, new):
    """transformers' greedy tokens, and the smallest gap between the two largest logits at any step."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(prompt), max_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    top2 = np.stack([np.sort(score.numpy(), axis=-1)[:, -2:] for score in out.scores])
    return out.sequences[:, prompt.shape[1]:].numpy(), float(np.min(top2[..., 1] - top2[..., 0]))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral-window", "qwen3-window", "gemma2", "gemma3",
                                  "gpt2"])
def test_greedy_sampling_equals_transformers_generate(kind, tmp_path):
    reference = hugging_face_model(kind)
    trained = from_hugging_face(saved(reference, tmp_path / kind), "test")
    graphdef, params = trained.module()
    rng = np.random.default_rng(1)
    compared = 0
    for _ in range(8):
        prompt = rng.integers(0, VOCAB, (2, int(rng.integers(3, 12))))
        expected, margin = generated_by_transformers(reference, prompt, 24)
        if margin < 1e-4:  # fp32 rounding (logits within 1e-6 of transformers') could flip a near-tie
            continue
        tokens, made = generate(graphdef, params, jnp.asarray(prompt, jnp.int32), jax.random.PRNGKey(0),
                                Sampling(24, temperature=0.0, vocab_used=VOCAB))
        assert int(made) == 24
        np.testing.assert_array_equal(np.asarray(tokens), expected)
        compared += 1
    assert compared >= 3


def test_sampling_a_gemma_checkpoint_begins_the_prompt_with_its_tokenizers_bos(tmp_path):
    """Gemma's tokenizer adds <bos>: `sample` encodes --prompt as transformers' tokenizer does and continues it as
    transformers' generate does."""
    from test_tokens import bos_tokenizer, write_corpus
    from transformers import PreTrainedTokenizerFast

    reference = hugging_face_model("gemma3")
    directory, bos = bos_tokenizer(saved(reference, tmp_path / "gemma3"), write_corpus(tmp_path / "corpus", 40))
    prompt = "the model trains on data"
    ids = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))(prompt)["input_ids"]
    assert ids[0] == bos
    expected, margin = generated_by_transformers(reference, np.asarray([ids]), 8)
    assert margin > 1e-4
    _, new = sample(Request(f"hf:{directory}", (prompt,), max_new_tokens=8, temperature=0.0))[0]
    np.testing.assert_array_equal(new, expected[0][:len(new)])
    assert len(new) == 8 or expected[0][len(new)] == load_tokenizer(str(directory)).end_of_text


def test_the_decode_loop_is_traced_once_for_any_number_of_tokens(llama_run, monkeypatch):
    traced = []
    original = decoder.Decoder.decode

    def counted(self, tokens, cache, start, padding):
        traced.append(tokens.shape)
        return original(self, tokens, cache, start, padding)

    monkeypatch.setattr(decoder.Decoder, "decode", counted)
    _, ids = sample(Request(str(llama_run), ("import ",), max_new_tokens=20, temperature=0.8, seed=3))[0]
    assert len(ids) == 20 and traced == [(1, 7), (1, 1)]  # the prompt, then one token: a while loop


def test_sampling_filters_as_asked_and_a_seed_repeats_its_choices(llama_run):
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))

    def kept(**settings):
        return np.flatnonzero(np.isfinite(np.asarray(filtered_logits(logits, Sampling(8, **settings)))[0])).tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.8) == [0, 1, 2]  # the smallest set whose probability reaches 0.8
    assert kept(top_p=0.5) == [0]
    assert kept(vocab_used=3) == [0, 1, 2]
    hot = np.asarray(filtered_logits(logits, Sampling(8, temperature=2.0)))
    np.testing.assert_allclose(hot, np.asarray(logits) / 2, rtol=1e-6)
    request = Request(str(llama_run), ("def ",), max_new_tokens=16, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    first, again, other = (sample(r)[0] for r in (request, request, Request(**{**request.__dict__, "seed": 8})))
    assert first[0] == again[0] and not np.array_equal(first[1], other[1])


@pytest.mark.parametrize("layout", [["mesh.stage=2", "parallel.mode=shard_map", "parallel.pipeline.microbatches=2"],
                                    ["parallel.strategy=fsdp"]], ids=["pipelined", "fsdp"])
def test_a_run_trained_pipelined_or_sharded_samples_on_one_device(layout, llama_run, tmp_path, devices):
    run_dir = trained_run(tmp_path / "run", *layout, devices=devices)
    trained, plain = from_run(run_dir, None, "test")[0], from_run(llama_run, None, "test")[0]
    for ours, theirs in zip(jax.tree.leaves(trained.params), jax.tree.leaves(plain.params), strict=True):
        assert ours.shape == theirs.shape and len(ours.devices()) == 1
        # Adam moves an element whose gradient is near zero by up to the rate (3e-3) a step, whichever way a float32
        # sum in another order (another layout, another CPU's vector width) tips its sign.
        np.testing.assert_allclose(ours, theirs, rtol=2e-4, atol=5e-4)
    result = run_cli("sample", str(run_dir), "--prompt", "import ", "--max-new-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("import ")
    text, ids = sample(Request(str(run_dir), ("import ",), max_new_tokens=12, temperature=0.0))[0]
    assert result.stdout == f"import {text}\n" and len(ids) == 12


def test_a_trained_tokenizer_decodes_samples_to_text(tmp_path, devices):
    run_dir = trained_run(tmp_path / "run", "data.tokenizer.train.vocab_size=300", devices=devices[:1])
    text, ids = sample(Request(str(run_dir), ("import os\n",), max_new_tokens=10, temperature=0.0))[0]
    trained = from_run(run_dir, None, "test")[0]
    assert trained.model.vocab >= 300 and trained.tokenizer.name != "bytes"
    assert text == trained.tokenizer.decode(ids.tolist()) and len(ids) == 10 and text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return saved(hugging_face_model("llama"), tmp_path_factory.mktemp("llama"))


def broken_copy(source, target, edit_config=None, drop_tensor=None):
    """`source`'s checkpoint copied to `target`, its config.json edited and a tensor dropped as asked."""
    from safetensors.numpy import load_file, save_file

    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **(edit_config or {})}))
    tensors = load_file(source / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != drop_tensor}, target / "model.safetensors")
    return target


def error_line(capsys, *args: str) -> str:
    """`xlatrain ARGS` in this process: exit code 2 and one line naming the mistake."""
    assert main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xlatrain: error: "), lines
    return lines[0]


def test_bad_checkpoints_prompts_and_outputs_are_one_line(checkpoint, llama_run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((checkpoint / "config.json").read_text())
    (tmp_path / "not_json").mkdir()
    (tmp_path / "not_json" / "config.json").write_text("{not json")
    cases = {
        "empty": (tmp_path / "empty", ["holds no config.json"]),
        "no_weights": (tmp_path / "no_weights", ["holds no *.safetensors"]),
        "not_json": (tmp_path / "not_json", ["config.json' is not a JSON file"]),
        "missing_tensor": (broken_copy(checkpoint, tmp_path / "missing",
                                       drop_tensor="model.layers.1.mlp.up_proj.weight"),
                           ["no tensor 'model.layers.1.mlp.up_proj.weight'", "blocks.up.kernel"]),
        "shape": (broken_copy(checkpoint, tmp_path / "shape", edit_config={"intermediate_size": 128}),
                  ["tensor 'model.layers.0.mlp.down_proj.weight' is [64, 96]", "blocks.down.kernel needs [64, 128]"]),
        "architecture": (broken_copy(checkpoint, tmp_path / "bert", edit_config={"model_type": "bert"}),
                         ["model_type='bert'", "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, gpt2"]),
        "layer_types": (broken_copy(checkpoint, tmp_path / "qwen2",
                                    edit_config={"model_type": "qwen2", "use_sliding_window": True,
                                                 "sliding_window": 4, "layer_types": ["sliding_attention"]}),
                        ["layer_types (1 of them) must name each of its 2 layers"]),
    }
    damaged = broken_copy(checkpoint, tmp_path / "damaged")
    (damaged / "model.safetensors").write_bytes(b"not a safetensors file")
    cases["damaged"] = damaged, ["model.safetensors' is not a safetensors file"]
    for directory, expected in cases.values():
        line = error_line(capsys, "sample", f"hf:{directory}", "--prompt", "x")
        assert all(text in line for text in expected), line
    # the same checks at a run's start, in a process of its own: one line, nothing left behind
    assert_one_line_error(run_cli("train", f"model.init_from=hf:{cases['missing_tensor'][0]}", "trainer.steps=1",
                                  f"trainer.run_dir={tmp_path / 'never'}"), "no tensor")
    assert not (tmp_path / "never").exists()
    expected = {("config", f"model.init_from=hf:{checkpoint}", "model.heads=8"):
                ["model.heads=8 disagrees with model.init_from", "(4 there)"],
                ("config", "model.name=llama", "model.init_from=some/dir"): ["model.init_from: takes hf:DIR"],
                ("sample", str(llama_run), "--prompt", "x" * 40): ["--prompt is 40 tokens", "context is 32"],
                ("sample", str(llama_run), "--prompt", "x" * 20, "--max-new-tokens", "20"):
                ["lower --max-new-tokens to at most 12"],
                ("sample", str(llama_run), "--prompt", "x", "--step", "99"): ["no checkpoint at step 99"],
                ("sample", str(llama_run), "--prompt", "a\udcffb"):  # $'a\xffb' as Python's argv holds it
                ["--prompt is not UTF-8 text (byte 1: b'\\xff')"],
                ("export", str(llama_run), "--hf", str(tmp_path / "empty")): ["exists"],
                ("export", str(llama_run), "--hf", str(tmp_path / "nowhere" / "out")): ["does not exist"],
                ("export", str(llama_run), "--hf", "/proc/xlatrain-out"): ["cannot be written"]}
    for args, texts in expected.items():
        line = error_line(capsys, *args)
        assert all(text in line for text in texts), line
    for option, value in [("--top-p", "1.5"), ("--seed", str(2**64)), ("--temperature", "nan")]:
        assert_one_line_error(run_cli("sample", str(llama_run), "--prompt", "x", option, value), option)
    assert sorted(path.name for path in tmp_path.iterdir() if "partial" in path.name) == []


@pytest.mark.parametrize("unreadable", ["checkpoints", "checkpoints/3", "checkpoints/3/integrity"])
def test_an_unreadable_checkpoint_is_one_line_naming_it(unreadable, llama_run, tmp_path):
    """An unreadable checkpoint gave an absl warning before the line, or a traceback. Run as a user without the
    right to read it (root keeps CAP_DAC_OVERRIDE: capsh drops it)."""
    run = tmp_path / "run"
    shutil.copytree(llama_run, run)
    (run / unreadable).chmod(0)
    command = [sys.executable, "-m", "xlatrain.cli", "sample", str(run), "--prompt", "x", "--max-new-tokens", "2"]
    if os.geteuid() == 0:
        if shutil.which("capsh") is None:
            pytest.skip("running as root without capsh to drop the capability to read any file")
        command = ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", shlex.join(command)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        (run / unreadable).chmod(0o755)
    assert_one_line_error(done, f"{run / unreadable} cannot be read by this user (permission denied)")


def test_without_max_new_tokens_a_sample_runs_to_the_end_of_the_context(llama_run):
    text, ids = sample(Request(str(llama_run), ("x" * 20,), temperature=0.0))[0]
    assert len(ids) == 12  # the context is 32
