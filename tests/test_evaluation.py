"""Downstream evaluation (`xlatrain eval`): continuations' log-likelihoods against transformers' on the exported
model, multiple-choice scores against ones computed from transformers' log-likelihoods, a few compilations for any
number of lengths, and what cannot be evaluated refused in one line."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import DIGITS_MLP, REPO
from jax.sharding import Mesh
from test_config import cli_error
from test_hugging_face import LLAMA, TINY_RUN, trained_run
from test_multiprocess import devices_env, free_slurm_job, slurm_env, succeed

from xlatrain.cli import main
from xlatrain.commands.export import export_hugging_face
from xlatrain.commands.trained import from_run
from xlatrain.config.parallel import DEFAULT_LOGICAL_RULES
from xlatrain.evaluation.devices import DATA, evaluation_mesh, placed_weights, spread_over
from xlatrain.evaluation.scoring import Scorer, bucket_length

QUESTIONS = [
    {"context": "def main(", "choices": ["):", "]]", "self, x):"], "gold": 0},
    {"context": "import os\nimport ", "choices": ["sys", "(((", "json"], "gold": 0},
    {"context": "for i in range(", "choices": ["10):", "10]:"], "gold": 0},
    {"context": "return ", "choices": ["None", "Nonee", "x +"], "gold": 2},
    {"context": "class Foo", "choices": ["(object):", "[object]:"], "gold": 0},
    {"context": "if x:\n  ", "choices": ["pass", "    pass"], "gold": 1},
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, devices):
    """A tiny Llama run (context 32 tokens of bytes, and the end-of-text id) and the same weights in transformers."""
    import transformers

    scratch = tmp_path_factory.mktemp("evaluation")
    run = trained_run(scratch / "run", "model.vocab=320", devices=devices[:1])  # the end-of-text (256) within it
    export_hugging_face(run, scratch / "hf", None)
    model = transformers.AutoModelForCausalLM.from_pretrained(scratch / "hf").eval()
    return run, model, transformers.AutoTokenizer.from_pretrained(scratch / "hf")


def scorer_and_weights(trained, batch_size, mesh=None, split=None):
    """A Scorer of the trained decoder over `mesh` (default: every device) and its weights placed there, split by
    `split`'s rules (default: as the run trained them)."""
    mesh = mesh or evaluation_mesh()
    weights = placed_weights(trained.model, trained.params, trained.model_state, mesh, split or trained.split)
    return Scorer(trained.module()[0], trained.model.max_len, batch_size, mesh), weights


def transformers_log_likelihood(model, context, continuation, length):
    """HFLM's: the last length + 1 tokens of context and continuation, the continuation's scored."""
    import torch

    whole = list(context) + list(continuation)
    whole = whole[-(length + 1):]
    with torch.no_grad():
        logits = model(torch.tensor([whole[:-1]])).logits[0].float()
    log_probs = torch.log_softmax(logits, -1)[-len(continuation):]
    targets = torch.tensor(whole[-len(continuation):])
    picked = log_probs[torch.arange(len(continuation)), targets]
    return float(picked.sum()), bool((logits[-len(continuation):].argmax(-1) == targets).all())


def test_every_log_likelihood_equals_transformers_on_the_exported_model(exported):
    """Contexts and continuations of many lengths, one longer than the model's context (cut from the left)."""
    run, model, _ = exported
    trained = from_run(run, None, "eval")[0]
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 256, size), rng.integers(0, 256, extra)) for size, extra in
             [(1, 1), (3, 2), (9, 1), (15, 4), (20, 12), (31, 1), (40, 5)]]
    scorer, weights = scorer_and_weights(trained, batch_size=3)
    scored = scorer.score(weights, pairs)
    for (context, continuation), ours in zip(pairs, scored, strict=True):
        log_likelihood, greedy = transformers_log_likelihood(model, context, continuation, trained.model.max_len)
        assert ours.log_likelihood == pytest.approx(log_likelihood, rel=1e-4)
        assert ours.greedy == greedy


def test_a_few_bucket_lengths_are_compiled_for_any_number_of_lengths(exported):
    trained = from_run(exported[0], None, "eval")[0]
    scorer, weights = scorer_and_weights(trained, batch_size=2)
    pairs = [(np.arange(size) % 256, np.asarray([7])) for size in range(1, 31)]
    scorer.score(weights, pairs)
    assert scorer._scores._cache_size() == len({bucket_length(size + 1, 32) for size in range(1, 31)}) == 2


def test_rows_over_every_device_and_weights_split_as_fsdp_score_as_one_device(exported):
    """As a run trained with parallel.strategy=fsdp is evaluated: its checkpoint read spread over the 8 devices,
    each batch's rows over them, the params split over them by the fsdp rules."""
    trained = from_run(exported[0], None, "eval")[0]
    spread = from_run(exported[0], None, "eval", spread_over(evaluation_mesh()))[0]
    embedding = spread.params["embed"]["embedding"]
    assert len(embedding.devices()) == 8 and not embedding.sharding.is_fully_replicated
    np.testing.assert_array_equal(embedding, trained.params["embed"]["embedding"])
    rng = np.random.default_rng(1)
    pairs = [(rng.integers(0, 256, size), rng.integers(0, 256, 3)) for size in (2, 7, 12, 20, 28, 30)]
    one, whole = scorer_and_weights(trained, 8, mesh=Mesh(np.asarray(jax.devices()[:1]), (DATA,)))
    every, split = scorer_and_weights(spread, 8, split=DEFAULT_LOGICAL_RULES)
    assert every.mesh.size == 8 and not split["embed"]["embedding"].sharding.is_fully_replicated
    expected = np.asarray([s.log_likelihood for s in one.score(whole, pairs)])
    np.testing.assert_allclose([s.log_likelihood for s in every.score(split, pairs)], expected, rtol=1e-5,
                               atol=1e-6 * np.abs(expected).max())


def test_multiple_choice_scores_equal_those_of_transformers_log_likelihoods(exported, tmp_path):
    """acc: the choice of the largest log-likelihood; acc_norm: per character of the choice; each pair encoded as
    the harness's HFLM encodes it (the context's trailing spaces moved to the continuation)."""
    run, model, tokenizer = exported
    task = tmp_path / "code.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    assert main(["eval", str(run), "--tasks", str(task), "--output", str(tmp_path / "scores.json")]) == 0
    ours = json.loads((tmp_path / "scores.json").read_text())["code"]
    right = {"acc": 0, "acc_norm": 0}
    for question in QUESTIONS:
        context = question["context"].rstrip()
        spaces = question["context"][len(context):]
        sums = []
        for choice in question["choices"]:
            head = tokenizer(context)["input_ids"]
            whole = tokenizer(context + spaces + " " + choice)["input_ids"]
            sums.append(transformers_log_likelihood(model, head or [tokenizer.eos_token_id], whole[len(head):],
                                                    32)[0])
        right["acc"] += int(np.argmax(sums)) == question["gold"]
        right["acc_norm"] += int(np.argmax(np.asarray(sums) / [len(c) for c in question["choices"]])) == question[
            "gold"]
    assert ours == {"acc": right["acc"] / 6, "acc_norm": right["acc_norm"] / 6, "questions": 6}


@pytest.mark.parametrize("lines, options, message", [
    (None, [], "is not a file (did you mean"),
    (['{"context": "a", "choices": ["b", "c"], "gold": 2}'], [], ":1's gold must index its 2 choices"),
    (['{"context": "a", "choices": ["b"], "gold": 0}'], [], "two or more non-empty text choices"),
    (["{not json"], [], ":1 does not parse"),
])
def test_a_task_that_cannot_be_scored_is_one_line(lines, options, message, exported, capsys, tmp_path):
    task = tmp_path / "task.jsonl"
    if lines is not None:
        task.write_text("\n".join(lines) + "\n")
    else:
        (tmp_path / "tasks.jsonl").write_text(json.dumps(QUESTIONS[0]) + "\n")
    assert message in cli_error(capsys, "eval", str(exported[0]), "--tasks", str(task), *options)


def test_a_limit_below_one_is_refused(exported, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        main(["eval", str(exported[0]), "--tasks", str(tmp_path / "task.jsonl"), "--limit", "0"])
    assert exited.value.code == 2 and "--limit: '0' is not a positive whole number" in capsys.readouterr().err


def test_a_harness_task_without_the_harness_names_the_extra(exported, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # as if lm-eval were not installed
    assert "'hellaswag' is an lm-evaluation-harness task (not a .jsonl file), and the harness is not installed: " \
           "pip install -e '.[eval]'" in cli_error(capsys, "eval", str(exported[0]), "--tasks", "hellaswag")


def test_a_model_that_cannot_score_text_is_one_line(capsys, tmp_path):
    main(["train", *DIGITS_MLP, "trainer.steps=1", f"trainer.run_dir={tmp_path / 'run'}"])
    (tmp_path / "task.jsonl").write_text(json.dumps(QUESTIONS[0]) + "\n")
    assert "not a built-in decoder" in cli_error(capsys, "eval", str(tmp_path / "run"), "--tasks",
                                                 str(tmp_path / "task.jsonl"))


MULTIPLE_CHOICE_YAML = """task: code_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GENERATION_YAML = """task: code_completion
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[gold]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def harness(exported, tmp_path_factory):
    """xlatrain's LM and the harness's HFLM on the same weights, and a directory of two local tasks."""
    from lm_eval.models.huggingface import HFLM

    from xlatrain.commands.evaluate import text_model
    from xlatrain.evaluation.harness import XlatrainLM

    run, model, tokenizer = exported
    tasks = tmp_path_factory.mktemp("tasks")
    (tasks / "code.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tasks / "choice.yaml").write_text(MULTIPLE_CHOICE_YAML.format(data=tasks / "code.jsonl"))
    (tasks / "completion.yaml").write_text(GENERATION_YAML.format(data=tasks / "code.jsonl"))
    trained = from_run(run, None, "eval")[0]
    scorer, weights = scorer_and_weights(trained, batch_size=4)
    ours = XlatrainLM(text_model(trained, trained.module()[0]), scorer, weights)
    theirs = HFLM(pretrained=model, tokenizer=tokenizer, max_length=32, batch_size=4, device="cpu")
    return ours, theirs, tasks


def requests_of(kind, arguments):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in arguments]


def test_the_harness_gets_hflms_log_likelihoods_and_generations(harness):
    """loglikelihood (a context longer than the model's cut from the left), loglikelihood_rolling (texts over
    several windows of the context) and greedy generate_until with a stop string."""
    ours, theirs, _ = harness
    pairs = [("def main(", "):"), ("import os\nimport ", "sys"), ("x" * 50, " = 1"), ("return", " None")]
    for (log_likelihood, greedy), (expected, expected_greedy) in zip(
            ours.loglikelihood(requests_of("loglikelihood", pairs)),
            theirs.loglikelihood(requests_of("loglikelihood", pairs)), strict=True):
        assert log_likelihood == pytest.approx(expected, rel=1e-4) and greedy == expected_greedy
    texts = [("def f(x):\n    return x + 1\n" * 3,), ("short",)]
    np.testing.assert_allclose(ours.loglikelihood_rolling(requests_of("loglikelihood_rolling", texts)),
                               theirs.loglikelihood_rolling(requests_of("loglikelihood_rolling", texts)), rtol=1e-4)
    prompts = [("def main(", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}),
               ("import os\nimport " * 4, {"until": [")"], "max_gen_toks": 5, "do_sample": False})]
    assert ours.generate_until(requests_of("generate_until", prompts)) == theirs.generate_until(
        requests_of("generate_until", prompts))


def test_two_local_tasks_score_as_with_hflm(harness, exported, tmp_path):
    """A multiple-choice task and a generation task from local YAMLs, through `xlatrain eval` and through the
    harness's simple_evaluate on HFLM; the same questions in xlatrain's own format."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _, theirs, tasks = harness
    assert main(["eval", str(exported[0]), "--tasks", f"{tasks / 'code.jsonl'},code_choice,code_completion",
                 "--include-path", str(tasks), "--output", str(tmp_path / "scores.json")]) == 0
    ours = json.loads((tmp_path / "scores.json").read_text())
    assert ours["code"]["acc"] == ours["code_choice"]["acc"] and ours["code"]["acc_norm"] == ours["code_choice"][
        "acc_norm"]  # xlatrain's own format scores as the harness's multiple choice
    expected = simple_evaluate(model=theirs, tasks=["code_choice", "code_completion"], bootstrap_iters=0,
                               task_manager=TaskManager(include_path=str(tasks), include_defaults=False))["results"]
    for metric in ("acc", "acc_norm"):
        assert ours["code_choice"][metric] == pytest.approx(expected["code_choice"][f"{metric},none"])
    assert ours["code_completion"]["exact_match"] == pytest.approx(expected["code_completion"]["exact_match,none"])


@pytest.mark.parametrize("task, message", [
    ("code_choise", "(did you mean 'code_choice'?)"),
    ("broken", "broken.yaml does not parse (line 2: expected ',' or ']'"),
])
def test_a_harness_task_that_is_not_there_is_one_line(task, message, harness, exported, capsys):
    (harness[2] / "broken.yaml").write_text("task: [broken\n")
    assert message in cli_error(capsys, "eval", str(exported[0]), "--tasks", task, "--include-path", str(harness[2]))


def test_tasks_in_the_loop_score_as_xlatrain_eval_and_change_no_loss(exported, tmp_path, devices):
    """The scores at the last step equal `xlatrain eval` of its checkpoint; the losses equal those of the same run
    without tasks (the fixture's), bit for bit."""
    from xlatrain.commands.evaluate import Request, evaluate
    from xlatrain.run.jsonl import read_records

    task = tmp_path / "code.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    run = trained_run(tmp_path / "run", "model.vocab=320", f"trainer.eval_tasks=[{task}]", "trainer.eval_tasks_every=2",
                      devices=devices[:1])
    records = read_records(run / "metrics.jsonl")
    scored = {r["step"]: r for r in records if "eval/code/acc" in r}
    assert sorted(scored) == [2, 3]
    expected = evaluate(Request(str(run), (str(task),)))["code"]
    assert {metric: scored[3][f"eval/code/{metric}"] for metric in expected} == expected

    def losses(directory):
        return {r["step"]: r["loss"] for r in read_records(directory / "metrics.jsonl") if "loss" in r}

    assert losses(run) == losses(exported[0])


def test_tasks_in_the_loop_are_checked_before_the_run_starts(capsys, tmp_path):
    assert "trainer.eval_tasks scores text with a built-in decoder" in cli_error(
        capsys, "train", *DIGITS_MLP, f"trainer.eval_tasks=[{tmp_path / 'x.jsonl'}]", f"trainer.run_dir={tmp_path}")
    assert "config: trainer.eval_tasks: task" in cli_error(
        capsys, "train", "model.name=llama", f"trainer.eval_tasks=[{tmp_path / 'x.jsonl'}]",
        f"trainer.run_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run" / "config.yaml").exists()


def tasks_of_every_kind(harness) -> tuple[str, str]:
    """(--tasks, the include path): xlatrain's JSONL, a harness multiple-choice task and a generation task."""
    tasks = harness[2]
    return f"{tasks / 'code.jsonl'},code_choice,code_completion", str(tasks)


@pytest.mark.slow
def test_tasks_in_the_loop_of_two_processes_score_as_one_process(harness, tmp_path):
    """Two processes of two devices, a pipeline of two stages over them: the stages' blocks gathered to every
    process, each scores its share of the batches, and process 0 logs what `xlatrain eval` of the same checkpoint
    in one process finds."""
    from xlatrain.commands.evaluate import Request, evaluate
    from xlatrain.run.jsonl import read_records

    tasks, include = tasks_of_every_kind(harness)
    run = tmp_path / "run"
    succeed([subprocess.Popen(
        [sys.executable, "-m", "xlatrain.cli", "launch", "--nproc", "2", "--devices-per-proc", "2", *TINY_RUN, *LLAMA,
         "model.vocab=320", "mesh.stage=2", "parallel.mode=shard_map", "parallel.pipeline.microbatches=2",
         f"trainer.run_dir={run}", f"trainer.eval_tasks=[{tasks}]",
         f"trainer.eval_include_path=[{include}]", "trainer.eval_tasks_limit=4"],
        cwd=REPO, env=devices_env(2), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)])
    logged = [r for r in read_records(run / "metrics.jsonl") if "eval/code/acc" in r]
    expected = evaluate(Request(str(run), tuple(tasks.split(",")), (include,), limit=4))
    assert logged[-1]["step"] == 3 and {key: value for key, value in logged[-1].items() if key != "step"} == {
        f"eval/{task}/{metric}": value for task, found in expected.items() for metric, value in found.items()}


@pytest.mark.slow
def test_xlatrain_eval_under_srun_scores_as_one_process(harness, exported, tmp_path):
    """`xlatrain eval` in two processes that join through SLURM's environment: process 0 writes what one process
    does."""
    tasks, include = tasks_of_every_kind(harness)
    command = ["eval", str(exported[0]), "--tasks", tasks, "--include-path", include, "--limit", "4", "--output"]
    assert main([*command, str(tmp_path / "one.json")]) == 0
    job = free_slurm_job()
    outputs = succeed([subprocess.Popen([sys.executable, "-m", "xlatrain.cli", *command, str(tmp_path / "two.json")],
                                        cwd=REPO, env=slurm_env(rank, job), text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE) for rank in range(2)])
    assert "code_choice" in outputs[0][1] and "code_choice" not in outputs[1][1]
    assert json.loads((tmp_path / "two.json").read_text()) == json.loads((tmp_path / "one.json").read_text())
