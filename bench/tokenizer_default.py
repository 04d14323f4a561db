"""Should the default run tokenize? The default GPT (`xlatrain train`: 4 x 128, seq 64, batch 16, 300 steps on the
standard library's sources) on bytes against the same run with a byte-level BPE trained on its training split
(`data.tokenizer.train.vocab_size`, 1,024 and 4,096 ids).

Losses of different tokenizers compare per byte of text, not per token: held-out loss per byte = eval_loss (nats
per token) / the corpus's bytes per token. Reported: each run's held-out loss per byte at every evaluation,
its time per step, and the time each BPE run takes to reach the loss per byte the bytes run ends at.

    python3 -m bench.tokenizer_default     # writes bench/results/tokenizer_default.json
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax

from bench.common import write_results
from xlatrain.config import load_config
from xlatrain.data.sources import default_text_dir, open_dataset, read_text_files
from xlatrain.run.metrics import read_metrics
from xlatrain.trainer import train

STEPS = 300
RUNS = {"bytes": [], "bpe-1024": ["data.tokenizer.train.vocab_size=1024"],
        "bpe-4096": ["data.tokenizer.train.vocab_size=4096"]}


def bytes_per_token(config, run_dir: Path) -> float:
    """Bytes of text per token over the corpus (its files and the separator after each), with the tokenizer the
    run trained (saved in its run directory)."""
    if config.data.tokenizer == "bytes":
        return 1.0
    files = read_text_files(default_text_dir(), config.data.glob, config.data.max_bytes)
    tokens = open_dataset(config.data, run_dir=run_dir).train.tokens
    return sum(len(data) + 1 for _, data in files) / len(tokens)


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, overrides in RUNS.items():
            run_dir = Path(scratch) / name
            config = load_config(None, [*overrides, f"trainer.steps={STEPS}", "trainer.eval_every=25",
                                        "trainer.progress=false", "mesh.data=1", f"trainer.run_dir={run_dir}"])
            result = train(config, devices=jax.devices()[:1], echo=lambda _: None)
            per_token = bytes_per_token(config, run_dir)
            evals = {r["step"]: r["eval_loss"] / per_token
                     for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r}
            seconds_per_step = result.summary.wall_seconds / STEPS
            results[name] = {"bytes_per_token": round(per_token, 3),
                             "ms_per_step": round(1e3 * seconds_per_step, 1),
                             "eval_loss_per_byte": {s: round(v, 4) for s, v in sorted(evals.items())}}
    target = results["bytes"]["eval_loss_per_byte"][STEPS]
    for name, run in results.items():
        reached = [s for s, v in run["eval_loss_per_byte"].items() if v <= target]
        run["seconds_to_bytes_final_loss"] = (round(min(reached) * run["ms_per_step"] / 1e3, 1) if reached else None)
        print(f"{name}: {run['bytes_per_token']} bytes/token, {run['ms_per_step']} ms/step, held-out loss per byte "
              f"{run['eval_loss_per_byte'][STEPS]} at step {STEPS}; reaches bytes' final {target}: "
              f"{run['seconds_to_bytes_final_loss']} s")
    write_results("tokenizer_default", "python3 -m bench.tokenizer_default", {"runs": results})


if __name__ == "__main__":
    main()
