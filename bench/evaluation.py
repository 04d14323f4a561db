"""`xlatrain eval`'s lm-evaluation-harness LM against the harness's own HFLM on CPU, and what an evaluation inside
the training loop costs:

1. requests per second: 200 log-likelihood requests of a local multiple-choice task (50 questions of 4 choices
   from the standard library's sources), batch 16 on both sides, xlatrain's `LM` (one XLA:CPU device) against
   `HFLM(device="cpu")` on the same weights (the Llama of llama_stdlib.yaml with the end-of-text in its
   vocabulary, trained 20 steps and exported): target >= 1.0x; xlatrain's compilations timed apart;
2. one in-loop evaluation of that task (trainer.eval_tasks) against one train step of the same run.

    python3 -m bench.evaluation    # writes bench/results/evaluation.json
"""

from __future__ import annotations

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX or torch start a thread

import json  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from bench.common import interleaved_medians, train_runner, write_results  # noqa: E402
from xlatrain.commands.evaluate import text_model  # noqa: E402
from xlatrain.commands.export import export_hugging_face  # noqa: E402
from xlatrain.commands.trained import from_run  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.evaluation.devices import evaluation_mesh, placed_weights  # noqa: E402
from xlatrain.evaluation.harness import XlatrainLM  # noqa: E402
from xlatrain.evaluation.in_loop import InLoopTasks  # noqa: E402
from xlatrain.evaluation.scoring import Scorer  # noqa: E402
from xlatrain.program import build_program  # noqa: E402
from xlatrain.trainer import train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LLAMA = [str(REPO / "examples" / "configs" / "llama_stdlib.yaml"), "model.vocab=320", "mesh.data=1"]
QUESTIONS, CHOICES, BATCH = 50, 4, 16


def questions(path: Path) -> list[dict]:
    """Contexts of 40-120 characters of the standard library, the true next 12 characters among 3 drawn elsewhere."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    text = "".join(source.read_text(errors="ignore") for source in sources)
    rng = np.random.default_rng(0)
    found = []
    for _ in range(QUESTIONS):
        at, size = int(rng.integers(0, len(text) - 200)), int(rng.integers(40, 120))
        others = [text[o:o + 12] for o in rng.integers(0, len(text) - 20, CHOICES - 1)]
        found.append({"context": text[at:at + size], "choices": [text[at + size:at + size + 12], *others], "gold": 0})
    path.write_text("".join(json.dumps(q) + "\n" for q in found))
    return found


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-evaluation-"))
    run = scratch / "run"
    config = load_config(LLAMA[0], [*LLAMA[1:], "trainer.steps=20", "trainer.progress=false",
                                    f"trainer.run_dir={run}"])
    train(config, devices=jax.devices()[:1], echo=lambda _: None)
    export_hugging_face(run, scratch / "hf", None)
    task = scratch / "code.jsonl"
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=(q["context"], " " + choice), idx=0)
                for q in questions(task) for choice in q["choices"]]
    trained = from_run(run, None, "eval")[0]
    graphdef, mesh = trained.module()[0], evaluation_mesh()
    ours = XlatrainLM(text_model(trained, graphdef), Scorer(graphdef, trained.model.max_len, BATCH, mesh),
                      placed_weights(trained.model, trained.params, trained.model_state, mesh, None))
    theirs = HFLM(pretrained=str(scratch / "hf"), batch_size=BATCH, device="cpu", max_length=trained.model.max_len)
    began = time.perf_counter()
    ours.loglikelihood(requests, disable_tqdm=True)
    first_call = time.perf_counter() - began
    medians = interleaved_medians({"xlatrain": lambda: ours.loglikelihood(requests, disable_tqdm=True),
                                   "hflm": lambda: theirs.loglikelihood(requests, disable_tqdm=True)},
                                  rounds=3, steps_per_round=1, warmup=0)
    agree = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(ours.loglikelihood(requests, disable_tqdm=True),
                                                             theirs.loglikelihood(requests, disable_tqdm=True)))
    per_second = {name: len(requests) / seconds for name, seconds in medians.items()}
    ratio = per_second["xlatrain"] / per_second["hflm"]
    print(f"{len(requests)} log-likelihood requests, batch {BATCH}: xlatrain {per_second['xlatrain']:.1f}/s, HFLM "
          f"{per_second['hflm']:.1f}/s: {ratio:.2f}x; xlatrain's first call {first_call:.2f} s (compilation "
          f"{first_call - medians['xlatrain']:.2f} s); largest relative difference {agree:.1e}")

    in_loop = load_config(LLAMA[0], [*LLAMA[1:], f"trainer.eval_tasks=[{task}]", f"trainer.run_dir={scratch / 'r2'}"])
    program = build_program(in_loop, jax.devices()[:1])
    tasks = InLoopTasks(in_loop, program.abstract_state.params, program.dataset.spec, None)
    state = program.create_state()
    tasks(state)  # compiles
    step = train_runner(program)
    times = interleaved_medians({"evaluation": lambda: tasks(state), "train_step": step}, rounds=3, steps_per_round=3,
                                warmup=1)
    print(f"one in-loop evaluation ({QUESTIONS} questions) {times['evaluation'] * 1e3:.1f} ms, one train step "
          f"{times['train_step'] * 1e3:.1f} ms: {times['evaluation'] / times['train_step']:.1f} steps")
    path = write_results("evaluation", "python3 -m bench.evaluation", {
        "targets": {"requests_per_second": "xlatrain's LM / HFLM >= 1.0", "in_loop": "reported"},
        "malloc": MALLOC, "torch_threads": torch.get_num_threads(), "requests": len(requests), "batch": BATCH,
        "requests_per_second": per_second, "xlatrain_over_hflm": ratio, "first_call_seconds": first_call,
        "largest_relative_difference": agree, "in_loop_seconds": times,
        "in_loop_over_train_step": times["evaluation"] / times["train_step"]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
