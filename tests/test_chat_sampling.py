"""The decode loop's batches and stops, shared by chat sampling and evaluation: prompts of different lengths
left-padded into one batch continue as each alone, a continuation ends at a stop id or before a stop string, and
`xlatrain sample --chat` renders the chat template and stops at the end-of-turn ids as transformers' generate."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import VOCAB, hugging_face_model, saved
from test_finetuning_data import chat_tokenizer

from xlatrain.cli import main
from xlatrain.commands.sample import Request, sample
from xlatrain.commands.trained import from_hugging_face
from xlatrain.models.sampling import Sampling, generate, generate_until

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["llama", "gemma2", "gpt2"])
def checkpoint(request, tmp_path_factory):
    """A tiny checkpoint (Gemma 2's with a sliding window of 4 on its first layer and soft caps), as transformers'
    model and as xlatrain's decoder."""
    reference = hugging_face_model(request.param)
    return reference, from_hugging_face(saved(reference, tmp_path_factory.mktemp(request.param)), "test")


def alone(trained, prompt, sampling):
    graphdef, params = trained.module()
    tokens, made = generate(graphdef, params, jnp.asarray(prompt[None], jnp.int32), jax.random.PRNGKey(0), sampling)
    return np.asarray(tokens)[0, :int(made)]


def test_left_padded_prompts_continue_each_as_it_would_alone(checkpoint):
    """Each row at its own positions (RoPE, or GPT-2's learned ones), its padding never attended, a window counted
    from its own tokens."""
    _, trained = checkpoint
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n) for n in (3, 9, 6)]
    sampling = Sampling(12, temperature=0.0, vocab_used=VOCAB)
    graphdef, params = trained.module()
    batched = generate_until(graphdef, params, prompts, jax.random.PRNGKey(0), sampling, str)
    for prompt, (_, ids) in zip(prompts, batched):
        np.testing.assert_array_equal(ids, alone(trained, prompt, sampling))
    model = nnx.merge(graphdef, params)
    padded = np.zeros((3, 9), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, 9 - len(prompt):] = prompt
    logits, _ = model.decode(jnp.asarray(padded), model.empty_cache(3, 9, jnp.float32), jnp.int32(0),
                             jnp.asarray([9 - len(p) for p in prompts], jnp.int32))
    for row, prompt in enumerate(prompts):
        own, _ = model.decode(jnp.asarray(prompt[None], jnp.int32), model.empty_cache(1, len(prompt), jnp.float32),
                              jnp.int32(0))
        np.testing.assert_allclose(np.asarray(logits[row, 9 - len(prompt):]), np.asarray(own[0]), rtol=1e-5,
                                   atol=1e-5)


def test_a_continuation_ends_at_a_stop_id_or_before_a_stop_string(checkpoint):
    _, trained = checkpoint
    graphdef, params = trained.module()
    prompts = [np.arange(5) + 7, np.arange(2) + 40]
    free = generate_until(graphdef, params, prompts, jax.random.PRNGKey(0), Sampling(16, temperature=0.0), str)
    stop = int(free[0][1][6])
    stopped = generate_until(graphdef, params, prompts, jax.random.PRNGKey(0),
                             Sampling(16, temperature=0.0, stop_ids=(stop,)), str)
    first = int(np.flatnonzero(free[0][1] == stop)[0])
    np.testing.assert_array_equal(stopped[0][1], free[0][1][:first])
    row = free[1][1]
    ends = stopped[1][1]
    assert len(ends) == 16 if stop not in row else np.array_equal(ends, row[:np.flatnonzero(row == stop)[0]])

    def text_of(ids):
        return " ".join(str(i) for i in ids)

    marker = f" {int(free[1][1][9])} "  # ends the second row's text where it first appears, the first's if there
    cut = generate_until(graphdef, params, prompts, jax.random.PRNGKey(0), Sampling(16, temperature=0.0), text_of,
                         stop_strings=(marker,), check_every=4)
    for (text, _), (_, ids) in zip(cut, free):
        whole = text_of(ids)
        assert text == whole[:whole.find(marker)] if marker in whole else text == whole


def test_chat_sampling_renders_the_template_and_stops_at_the_end_of_turn_ids(tmp_path, capsys):
    """Qwen's format: <|im_end|> is the tokenizer's eos_token, and generation_config.json names another end id too;
    the answer is transformers' greedy generate from apply_chat_template's ids, up to the first of them."""
    import torch
    from transformers import PreTrainedTokenizerFast

    reference = hugging_face_model("qwen2")
    directory = chat_tokenizer(saved(reference, tmp_path / "qwen"), "qwen")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "say one two"}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        free = reference.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].numpy()
    ends = sorted({int(free[4]), tokenizer.eos_token_id})  # a token it does choose ends it, as the config says
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [int(free[4])]}))
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=ends,
                                      pad_token_id=0)[0, len(ids):].numpy()
    expected = expected[:np.flatnonzero(np.isin(expected, ends))[0]] if np.isin(expected, ends).any() else expected
    (text, new), = sample(Request(f"hf:{directory}", ("say one two",), max_new_tokens=20, temperature=0.0,
                                  chat=True))
    np.testing.assert_array_equal(new, expected)
    assert len(new) <= 4
    assert main(["sample", f"hf:{directory}", "--chat", "say one two", "--max-new-tokens", "20",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_a_run_on_chat_shards_samples_chats_and_exports_its_template(tmp_path, devices):
    """The shards keep the tokenizer's chat template beside its tokenizer.json; `sample RUN --chat` renders with
    it, and `export --hf` writes it with the end of a turn among config.json's eos ids: the exported checkpoint
    renders and answers alike."""
    from test_finetuning_data import conversation, write_records
    from transformers import PreTrainedTokenizerFast

    from xlatrain.commands.prepare import Request as Prepare
    from xlatrain.commands.prepare import prepare
    from xlatrain.config import load_config
    from xlatrain.trainer import train

    tokenizer = chat_tokenizer(tmp_path / "tokenizer", "qwen")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    rng = np.random.default_rng(0)
    records = write_records(tmp_path / "chats.jsonl", [conversation(rng, n) for n in range(16)])
    prepare(Prepare((records,), tmp_path / "shards", str(tokenizer), holdout=0.25))
    run = tmp_path / "run"
    train(load_config(None, ["model.name=llama", "model.layers=1", "model.width=32", "model.heads=2",
                             "model.kv_heads=1", "data.source=tokens", f"data.path={tmp_path / 'shards'}",
                             "data.packing=true", "data.seq_len=64", "batch.global_size=4", "trainer.steps=2",
                             f"trainer.run_dir={run}"]), devices=devices[:1], echo=lambda _: None)
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    messages = [{"role": "user", "content": "say one"}]
    exported = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "hf"))
    assert exported.apply_chat_template(messages, add_generation_prompt=True) == PreTrainedTokenizerFast.\
        from_pretrained(str(tokenizer)).apply_chat_template(messages, add_generation_prompt=True)
    end_of_turn = exported.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]
    answers = [sample(Request(source, ("say one",), max_new_tokens=12, temperature=0.0, chat=True))[0][1]
               for source in (str(run), f"hf:{tmp_path / 'hf'}")]
    np.testing.assert_array_equal(*answers)
