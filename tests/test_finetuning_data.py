"""Fine-tuning data: TRL's record formats read by `xlatrain data prepare`, conversations rendered by the tokenizer's
chat template as transformers renders them, loss weights on exactly the answers, examples packed whole, the loss
as the weighted mean over the global batch, and every bad record as one line."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import REPO, run_cli

from xlatrain.cli import main
from xlatrain.commands.prepare import Request, prepare
from xlatrain.config import load_config
from xlatrain.data.shards import MANIFEST, Shard, open_shards
from xlatrain.data.tokenizers import train_bpe
from xlatrain.data.tokens import PackedRows
from xlatrain.errors import UserError
from xlatrain.run.metrics import read_metrics
from xlatrain.trainer import train

transformers = pytest.importorskip("transformers")

WORDS = "the sky is blue what colour grass green say hello one two three four five yes no maybe".split()
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|eot_id|>' }}{% endgeneration %}"
          "{% else %}{{ m['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen": "<|im_end|>\n"}
"""What each template's assistant turn ends with, inside its answer: Llama 3's generation span holds it, and
without spans an answer is all its message adds."""


def chat_tokenizer(directory, template):
    """A byte-level BPE with the special tokens of Llama 3's and Qwen's chat formats, its chat template in a
    tokenizer_config.json (Llama 3's) or a chat_template.jinja (Qwen's) beside it."""
    from tokenizers import Tokenizer as HFTokenizer

    tokenizer = HFTokenizer.from_str(train_bpe([" ".join(WORDS)] * 20, 300).serialized)
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                  "<|im_start|>", "<|im_end|>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if template == "llama3":
        (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA3,
                                                                     "bos_token": "<|begin_of_text|>"}))
    else:
        (directory / "chat_template.jinja").write_text(QWEN)
    return directory


def say(rng, low=2, high=8):
    return " ".join(rng.choice(WORDS, size=int(rng.integers(low, high))))


def conversation(rng, number):
    messages = [{"role": "system", "content": say(rng)}] if number % 3 == 0 else []
    for _ in range(int(rng.integers(1, 4))):
        messages += [{"role": "user", "content": say(rng)}, {"role": "assistant", "content": say(rng)}]
    return {"messages": messages}


def write_records(path, records):
    """JSONL, or Parquet where the name says so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pyarrow = pytest.importorskip("pyarrow")
        import pyarrow.parquet as parquet

        parquet.write_table(pyarrow.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """Per template: its tokenizer directory, the conversations and their shards (one in two held out)."""
    root = tmp_path_factory.mktemp("chat")
    rng = np.random.default_rng(0)
    records = [conversation(rng, n) for n in range(40)]
    made = {}
    for template in ("llama3", "qwen"):
        tokenizer = chat_tokenizer(root / template, template)
        out = root / f"{template}-shards"
        prepare(Request((write_records(root / "chat.jsonl", records),), out, str(tokenizer), holdout=0.5))
        made[template] = tokenizer, records, out
    return made


def documents_of(shard):
    for start, stop in zip(shard.bounds[:-1], shard.bounds[1:]):
        yield np.asarray(shard.tokens[start:stop]), np.asarray(shard.weights[start:stop])


def weighted_runs(ids, weights, tokenizer):
    """The text of each run of consecutive weighted tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], weights, [0]])))
    return [tokenizer.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("template", ["llama3", "qwen"])
def test_conversations_are_transformers_ids_weighted_on_exactly_the_assistant_turns(template, chat_data):
    """Llama 3's template marks its answers with {% generation %}; Qwen's does not, and adds a default system
    message, so its answers come from renderings of the first messages."""
    from transformers import PreTrainedTokenizerFast

    directory, records, out = chat_data[template]
    shards = open_shards(out)
    reference = PreTrainedTokenizerFast.from_pretrained(str(directory))
    train_records = records[1::2]  # every second record is held out, the first among them
    documents = [d for shard in shards.train for d in documents_of(shard)]
    assert len(documents) == len(train_records)
    for (ids, weights), record in zip(documents, train_records):
        expected = reference.apply_chat_template(record["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert ids[:-1].tolist() == expected and ids[-1] == shards.manifest["tokenizer"]["end_of_text"]
        answers = [m["content"] + END_OF_TURN[template] for m in record["messages"] if m["role"] == "assistant"]
        assert weighted_runs(ids, weights, reference) == answers
    assert shards.manifest["version"] == 2
    assert shards.manifest["examples"] == {"format": "conversational", "loss_on": "assistant"}


def test_prompt_completion_records_weigh_the_completion_or_everything(chat_data, tmp_path):
    """Text: the completion and the end-of-text after it (TRL appends EOS to a completion); messages (from
    Parquet): what the completion's messages add after the prompt's generation prompt; --loss-on all: every
    token."""
    from transformers import PreTrainedTokenizerFast

    directory = chat_data["qwen"][0]
    reference = PreTrainedTokenizerFast.from_pretrained(str(directory))
    texts = [{"prompt": "say one two", "completion": " three four"}] * 4
    conversations = [{"prompt": [{"role": "user", "content": "say hello"}],
                      "completion": [{"role": "assistant", "content": "hello"}]}] * 4
    cases = [(texts, "auto", [" three four<|endoftext|>"], "jsonl"),
             (conversations, "auto", ["hello<|im_end|>\n"], "parquet"),
             (texts, "all", ["say one two three four<|endoftext|>"], "jsonl")]
    for number, (records, loss_on, answers, suffix) in enumerate(cases):
        out = tmp_path / f"out{number}"
        prepare(Request((write_records(tmp_path / f"in{number}" / f"pc.{suffix}", records),), out, str(directory),
                        holdout=0.5, loss_on=loss_on))
        (ids, weights), *_ = documents_of(open_shards(out).train[0])
        assert weighted_runs(ids, weights, reference) == answers, (loss_on, records[0])


def test_text_records_prepare_as_before_whatever_names_their_field(tmp_path):
    """Detected `text` records and --field text give the same version-1 shards, byte for byte, with no weights."""
    inputs = write_records(tmp_path / "in" / "docs.jsonl", [{"text": say(np.random.default_rng(n))}
                                                             for n in range(20)])
    prepare(Request((inputs,), tmp_path / "detected", holdout=0.2))
    prepare(Request((inputs,), tmp_path / "named", field="text", holdout=0.2))
    written = [{p.name: p.read_bytes() for p in (tmp_path / out).iterdir()} for out in ("detected", "named")]
    assert written[0] == written[1] and json.loads(written[0][MANIFEST])["version"] == 1
    assert not any(name.endswith(".weights.npy") for name in written[0])


def test_examples_are_packed_whole_cut_to_seq_len_and_skipped_with_nothing_to_train_on():
    """Five examples of 6, 12, 4, 10 and 3 tokens, seq_len 8: none split, the 12 and the 10 cut to their first 9
    tokens (keep_start), the one whose answer lies past that and the one with no answer skipped; the mask is each
    target's weight."""
    lengths, answers = [6, 12, 4, 10, 3], [(3, 6), (5, 12), (0, 0), (9, 10), (1, 3)]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    weights = np.zeros(bounds[-1], np.uint8)
    for start, (a, b) in zip(bounds, answers):
        weights[start + a:start + b] = 1
    tokens = np.arange(bounds[-1], dtype=np.uint16)
    rows = PackedRows((Shard(tokens, bounds, weights),), 8)
    assert (rows.skipped, rows.truncated) == (2, 1)
    kept = [rows[i] for i in range(len(rows))]
    pieces = [(row["inputs"][row["segment_ids"] == s], row["mask"][row["segment_ids"] == s])
              for row in kept for s in range(1, row["segment_ids"].max() + 1)]
    assert [inputs[0] for inputs, _ in pieces] == [0, 6, 32]  # the first, second and fifth examples begin pieces
    assert [len(inputs) for inputs, _ in pieces] == [5, 8, 2]
    for inputs, mask in pieces:
        np.testing.assert_array_equal(mask, weights[inputs + 1])


def test_the_loss_is_the_weighted_mean_over_the_global_batch_with_accumulation_and_replicas(chat_data, tmp_path):
    """Rows of the batch weigh different numbers of tokens: a mean per microbatch or per replica would differ."""
    shards = chat_data["llama3"][2]
    common = ["model.name=llama", "model.layers=2", "model.width=32", "model.heads=2", "model.kv_heads=1",
              "data.source=tokens", f"data.path={shards}",
              "data.packing=true", "data.seq_len=64", "batch.global_size=8", "trainer.steps=3",
              "trainer.progress=false", "trainer.log_every=1", "trainer.eval_every=1000"]

    def losses(name, *overrides, devices):
        config = load_config(None, [*common, *overrides, f"trainer.run_dir={tmp_path / name}"])
        result = train(config, devices=devices, echo=lambda _: None)
        return np.array([result.losses[s] for s in sorted(result.losses)])

    whole = losses("whole", "mesh.data=1", devices=jax.devices()[:1])
    np.testing.assert_allclose(losses("accumulated", "mesh.data=1", "batch.microbatches=2", devices=jax.devices()[:1]),
                               whole, rtol=1e-5)
    np.testing.assert_allclose(losses("replicas", "mesh.data=2", devices=jax.devices()[:2]), whole, rtol=1e-5)


@pytest.mark.parametrize("case", ["unknown_format", "unknown_role", "no_template", "two_formats", "preference",
                                  "loss_on_misfit", "field_and_loss_on", "trained_tokenizer"])
def test_bad_fine_tuning_records_are_one_line_naming_the_line(case, chat_data, tmp_path, capsys):
    qwen = str(chat_data["qwen"][0])
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}
    records, options, expected = {
        "unknown_format": ([{"question": "q", "answer": "a"}], ["--tokenizer", qwen],
                           "in.jsonl:1 is a record of no known format (its fields: question, answer)"),
        "unknown_role": ([{"messages": [user, {"role": "robot", "content": "x"}]}], ["--tokenizer", qwen],
                         "in.jsonl:1: `messages`[1] has the role 'robot'; give one of system, user, assistant, tool"),
        "no_template": ([{"messages": [user, answer]}], [], "--tokenizer='bytes' has no chat template"),
        "two_formats": ([{"messages": [user, answer]}, {"prompt": "p", "completion": "c"}], ["--tokenizer", qwen],
                        "in.jsonl:2 is a prompt-completion record in a file of conversational records"),
        "preference": ([{"chosen": "yes", "rejected": "no"}], ["--tokenizer", qwen],
                       "in.jsonl:1: `chosen` and `rejected` share no prompt to begin with"),
        "loss_on_misfit": ([{"messages": [user, answer]}], ["--tokenizer", qwen, "--loss-on", "completion"],
                           "--loss-on completion does not fit conversational records"),
        "field_and_loss_on": ([{"text": "t"}], ["--field", "text", "--loss-on", "all"],
                              "--loss-on weighs fine-tuning examples, and --field reads every record as text"),
        "trained_tokenizer": ([{"prompt": "p", "completion": "c"}], ["--train-tokenizer", "300"],
                              "give its tokenizer with --tokenizer, not --train-tokenizer"),
    }[case]
    inputs = write_records(tmp_path / "in.jsonl", records * 4)
    assert main(["data", "prepare", str(inputs), "--out", str(tmp_path / "out"), *options]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["windows", "all_cut_off"])
def test_weighted_shards_a_run_cannot_train_on_are_one_line(case, chat_data):
    path = chat_data["qwen"][2]
    overrides, expected = {"windows": (["data.packing=false"], "holds fine-tuning examples with loss weights, each "
                                                                "to be read whole: set data.packing=true"),
                           "all_cut_off": (["data.seq_len=4"], "none of its training examples has a token it trains "
                                                                "on within data.seq_len=4")}[case]
    config = load_config(None, ["model.name=llama", "model.layers=1", "model.width=32", "model.heads=2",
                                "data.source=tokens", f"data.path={path}", "data.packing=true", *overrides])
    with pytest.raises(UserError, match=expected):
        from xlatrain.data.sources import open_dataset

        open_dataset(config.data)


def test_the_example_config_fine_tunes_on_prepared_conversations(chat_data, tmp_path):
    done = run_cli("train", str(REPO / "examples" / "configs" / "llama_chat_sft.yaml"),
                   f"data.path={chat_data['qwen'][2]}", "data.seq_len=64", "trainer.steps=3", "trainer.log_every=1",
                   "model.layers=1", "model.width=32",
                   f"trainer.run_dir={tmp_path / 'run'}", env={"XLA_FLAGS": os.environ["XLA_FLAGS"]})
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
