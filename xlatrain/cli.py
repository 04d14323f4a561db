"""The `xlatrain` command line: `train | config | lower | parity | pipeline | profile | plot | report | export |
sample | eval | launch | data prepare`, each parsed here and run by its body (train's is the trainer, plot's and
report's observe/'s, the others' xlatrain/commands/). Every user error is one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn

from xlatrain.errors import (
    NonFiniteLoss,
    UserError,
    file_system_refusals_named,
    make_writable_directory,
)

USAGE_EXAMPLES = """examples:
  xlatrain train                                  the built-in default: a byte-level GPT on Python's stdlib
  xlatrain train examples/configs/digits_mlp.yaml trainer.steps=200
  xlatrain config examples/configs/digits_mlp.yaml batch.global_size=128
  xlatrain lower --json parallel.strategy=fsdp
  xlatrain parity examples/configs/digits_mlp.yaml --a mesh.data=1 --b parallel.strategy=fsdp --steps 20
  xlatrain report runs/gpt-stdlib
  xlatrain pipeline mesh.stage=4 parallel.pipeline.schedule=interleaved model.layers=8
  xlatrain parity examples/configs/torch_gpt.yaml --against torch --steps 10
  xlatrain export runs/torch-gpt --torch gpt.pt
  xlatrain export runs/llama-stdlib --hf llama-hf/
  xlatrain sample runs/gpt-stdlib --prompt 'def ' --max-new-tokens 50 --temperature 0.8 --top-k 40
  xlatrain train model.init_from=hf:llama-hf/ trainer.steps=100
  xlatrain launch --nproc 2 --devices-per-proc 4 examples/configs/digits_mlp.yaml
  xlatrain data prepare corpus/ --glob '**/*.txt' --train-tokenizer 4096 --out shards/
"""

PIPELINE_EXAMPLES = """examples (8 CPU devices: export XLA_FLAGS=--xla_force_host_platform_device_count=8 first):
  xlatrain pipeline mesh.stage=4
  xlatrain pipeline mesh.stage=4 parallel.pipeline.schedule=interleaved model.layers=8 --out interleaved.png
  xlatrain pipeline mesh.stage=2 parallel.pipeline.schedule=gpipe parallel.pipeline.microbatches=4
"""


def run() -> int:
    """The `xlatrain` command: malloc is tuned before anything starts a thread, then main()."""
    from xlatrain.runtime.malloc import tune_malloc

    try:
        tune_malloc()
    except UserError as err:
        print(f"xlatrain: error: {err}", file=sys.stderr)
        return err.exit_code
    return main()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = _parse_intermixed(parser, argv)
    config_path, overrides = _split_config_and_overrides(args.args)
    try:
        with file_system_refusals_named():
            return args.command(config_path, overrides, args)
    except UserError as err:
        print(f"xlatrain: error: {err}", file=sys.stderr)
        return _leave(err.exit_code)
    except KeyboardInterrupt:  # Ctrl-C in a command that trains nothing (train and parity stop on their own)
        print("xlatrain: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


class _OneLineParser(argparse.ArgumentParser):
    """A command-line mistake is one line and exit 2, like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parse_intermixed(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line, where a command that takes [CONFIG] [key=value ...] takes them between its options too
    (`lower A=1 --target h100 B=2`): argparse leaves what follows an option unrecognised, and argparse's own
    intermixed parsing does not work with subcommands."""
    args, rest = parser.parse_known_args(argv)
    if rest and (not getattr(args, "intermixed", False) or any(item.startswith("-") for item in rest)):
        flag = next((item for item in rest if item.startswith("--")), None)
        meant = _key_meant(flag, sys.argv[1:] if argv is None else argv)
        parser.error(f"unrecognized arguments: {' '.join(rest)}{meant}")
    args.args = [*args.args, *rest]
    return args


def _key_meant(flag: str | None, argv: list[str]) -> str:
    """"; did you mean trainer.steps=50?" for `--steps 50` (or `--steps=50`): the config key whose last part the
    unrecognised option names, when exactly one does; "" otherwise."""
    if flag is None:
        return ""
    name, _, value = flag[2:].partition("=")
    following = argv[argv.index(flag) + 1:argv.index(flag) + 2]
    if not value and following and not following[0].startswith("-"):
        value = following[0]
    from xlatrain.config import Config, flatten

    wanted = name.replace("-", "_")
    keys = [key for key in flatten(Config().model_dump(mode="json")) if key.rsplit(".", 1)[-1] == wanted]
    return f"; did you mean {keys[0]}={value or '...'}?" if len(keys) == 1 else ""


def _config_arguments(sub: argparse.ArgumentParser, help_text: str) -> None:
    sub.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]", help=help_text)
    sub.set_defaults(intermixed=True)


KEYS_EPILOG = """config sections: name, seed, model, data, batch, optimizer, mesh, parallel, precision, collectives,
trainer, distributed, runtime (model.name, data.source and optimizer.name choose a kind, with keys of its own).
Every key of a config, with its value and meaning: xlatrain config [CONFIG] [key=value ...] --keys [SECTION]
(the whole reference, with defaults: docs/configuration.md)."""

PARITY_RTOL = 1e-4
"""Two xlatrain runs: the same kernels, so what parts them is the configs' difference (docs/getting-started.md)."""
PARITY_RTOL_AGAINST_TORCH = 2e-3
"""xlatrain against PyTorch or torch_xla: over 20 steps of examples/configs/torch_cnn.yaml (BatchNorm) the two sides
part by 5e-5 to 1.1e-3 (batch 64 and 16); docs/models.md says why, and why a real mismatch shows more."""


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="xlatrain", description="Config-driven JAX/XLA training.",
                                     epilog=USAGE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    for name, func, help_text in (("train", _train, "train (or resume) a run"),
                                  ("config", _config, "print the resolved config and derived values"),
                                  ("lower", _lower, "compile the train step and report FLOPs, memory, collectives")):
        sub = commands.add_parser(name, help=help_text, epilog=KEYS_EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        _config_arguments(sub, "optional YAML file, then dotted overrides such as trainer.steps=100")
        sub.set_defaults(command=func)
        if name == "config":
            sub.add_argument("--keys", nargs="?", const="", metavar="SECTION", help="list every key (of SECTION, "
                             "e.g. model or trainer) with its value and what it means, instead of the config")
        if name == "lower":
            sub.add_argument("--json", action="store_true", help="print one JSON object")
            sub.add_argument("--dump", type=_path, metavar="DIR", help="write StableHLO and optimised HLO text")
            sub.add_argument("--target", metavar="GPU", help="compile for GPUs this host need not have: "
                             "h100, h200, a100, l4, or a GPU target config file (needs jax's CUDA plugin)")
            sub.add_argument("--devices", type=int, metavar="N", help="with --target: how many GPUs (default: "
                             "mesh.data x mesh.stage; mesh.data=-1 counts one data replica)")
    parity = commands.add_parser("parity", help="train two configs side by side and report where they diverge")
    parity.add_argument("configs", nargs="*", metavar="CONFIG", help="none (the default), one for both sides, "
                        "or CONFIG_A CONFIG_B")
    parity.add_argument("--a", nargs="+", default=[], metavar="key=value", help="overrides for side A")
    parity.add_argument("--b", nargs="+", default=[], metavar="key=value", help="overrides for side B")
    parity.add_argument("--steps", type=int, default=20, help="steps to compare (default 20)")
    parity.add_argument("--rtol", type=float, help=f"relative tolerance (default {PARITY_RTOL:g}; with --against, "
                        f"{PARITY_RTOL_AGAINST_TORCH:g}: two frameworks' float32 kernels round differently)")
    parity.add_argument("--plot", type=_path, metavar="PNG", help="also draw both sides' curves into this PNG")
    parity.add_argument("--against", choices=("torch", "torch_xla"), help="compare a torch model (model.name=torch) "
                        "trained by xlatrain (side A, with --a overrides) with PyTorch eager or torch_xla (side B)")
    parity.add_argument("--python", metavar="PATH", help="with --against torch_xla: the Python of a virtual "
                        "environment that has torch_xla (default: $XLATRAIN_TORCH_XLA_PYTHON)")
    parity.set_defaults(command=_parity, args=[])
    pipeline = commands.add_parser("pipeline", help="print a pipeline's schedule table, partition and bubble, and "
                                   "draw its Gantt chart", epilog=PIPELINE_EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_arguments(pipeline, "optional YAML file, then dotted overrides such as mesh.stage=4")
    pipeline.add_argument("--out", type=_path, default=Path("pipeline_schedule.png"), metavar="PATH",
                          help="where to write the chart; its suffix picks the format (default: pipeline_schedule.png)")
    pipeline.set_defaults(command=_pipeline)
    profile = commands.add_parser("profile", help="train the first steps of a config into a fresh run directory "
                                  "and write a jax.profiler trace of steps A..B (RUN_DIR/profile)")
    _config_arguments(profile, "what `xlatrain train` takes")
    profile.add_argument("--steps", type=_step_window, default=(3, 5), metavar="A:B",
                         help="the steps to trace, numbered from 1 (default 3:5: after the compilation and the "
                         "first steps' warm-up)")
    profile.set_defaults(command=_profile)
    plot = commands.add_parser("plot", help="draw runs' loss, accuracy, learning rate, loss scale, throughput and "
                               "MFU against step, evaluations marked (several runs overlaid)")
    plot.add_argument("run_dirs", nargs="+", type=_path, metavar="RUN_DIR")
    plot.add_argument("--out", type=_path, default=Path("metrics.png"), metavar="PNG",
                      help="where to write the chart (default: metrics.png)")
    plot.add_argument("--metrics", type=_names, metavar="A,B", help="the panels to draw, by metric (e.g. "
                      "loss,grad_norm,mfu; any metric metrics.jsonl holds); default: loss, accuracy, learning rate, "
                      "loss scale, samples/s and MFU, those the runs log")
    plot.set_defaults(command=_plot, args=[])
    report = commands.add_parser("report", help="print the run summaries (compilations, executions, transfers)")
    report.add_argument("run_dir", type=_path, metavar="RUN_DIR")
    report.set_defaults(command=_report, args=[])
    export = commands.add_parser("export", help="write a run's trained weights as a torch state_dict or a Hugging "
                                 "Face checkpoint")
    export.add_argument("run_dir", type=_path, metavar="RUN_DIR")
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--torch", type=_path, metavar="OUT.pt", help="a torch run: where to write the state_dict")
    target.add_argument("--hf", type=_path, metavar="OUT", help="a gpt or llama run: the directory to write "
                        "(config.json, safetensors, the tokenizer) for transformers' from_pretrained; LoRA's "
                        "adapters merged into their weights")
    target.add_argument("--peft", type=_path, metavar="OUT", help="a llama run with model.lora: its adapters as a "
                        "PEFT adapter directory for peft.PeftModel.from_pretrained(base, OUT)")
    export.add_argument("--step", type=_non_negative, help="which checkpoint (default: the latest)")
    export.set_defaults(command=_export, args=[])
    sample = commands.add_parser("sample", help="continue a prompt with a gpt or llama run's weights, or a Hugging "
                                 "Face checkpoint's")
    sample.add_argument("source", metavar="RUN_DIR|hf:DIR")
    given = sample.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", metavar="TEXT", help="the text to continue (again for more "
                       "prompts, continued together in one batch)")
    given.add_argument("--chat", action="append", metavar="MESSAGE", help="a user's message, rendered with the "
                       "tokenizer's chat template and its generation prompt; the answer ends at an end-of-turn id "
                       "(the tokenizer's eos_token, generation_config.json's eos_token_id); again for more")
    sample.add_argument("--max-new-tokens", type=_positive, metavar="N", help="at most N tokens (default 64, or "
                        "what the model's context leaves after the prompt); the end-of-text token ends sooner")
    sample.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end a continuation before this "
                        "text (again for more)")
    sample.add_argument("--temperature", type=_non_negative_float, default=1.0, metavar="T",
                        help="softmax temperature; 0: greedy (default 1.0)")
    sample.add_argument("--top-k", type=_positive, metavar="K", help="choose among the K most likely tokens")
    sample.add_argument("--top-p", type=_probability, default=1.0, metavar="P",
                        help="choose among the fewest tokens whose probabilities reach P (default 1.0: all)")
    sample.add_argument("--seed", type=_seed, default=0, metavar="S", help="sampling seed (default 0)")
    sample.add_argument("--step", type=_non_negative, help="a run's checkpoint (default: the latest)")
    sample.set_defaults(command=_sample, args=[])
    evaluation = commands.add_parser("eval", help="score a gpt or llama run's weights, or a Hugging Face "
                                     "checkpoint's, on multiple-choice tasks (JSONL: context, choices, gold)")
    evaluation.add_argument("source", metavar="RUN_DIR|hf:DIR")
    evaluation.add_argument("--tasks", type=_task_files, required=True, metavar="TASK[,TASK]",
                            help="multiple-choice files (*.jsonl) and lm-evaluation-harness task names, "
                            "comma-separated (docs/evaluation.md)")
    evaluation.add_argument("--include-path", action="append", default=[], metavar="DIR",
                            help="a directory of lm-evaluation-harness task YAMLs (again for more)")
    evaluation.add_argument("--limit", type=_positive, metavar="N", help="the first N questions of each task")
    evaluation.add_argument("--batch-size", type=_positive, default=16, metavar="B",
                            help="sequences scored together (default 16)")
    evaluation.add_argument("--output", metavar="FILE", help="also write the scores to this new JSON file")
    evaluation.add_argument("--step", type=_non_negative, help="a run's checkpoint (default: the latest)")
    evaluation.set_defaults(command=_evaluate, args=[])
    launch = commands.add_parser("launch", help="train with N local processes joined through jax.distributed")
    launch.add_argument("--nproc", type=_positive, required=True, metavar="N", help="how many processes")
    launch.add_argument("--devices-per-proc", type=_positive, metavar="K",
                        help="CPU devices of each process (on a GPU host: K GPUs each); default: as the environment "
                        "gives them")
    _config_arguments(launch, "what `xlatrain train` takes; distributed.* is set for each process")
    launch.set_defaults(command=_launch)
    data = commands.add_parser("data", help="prepare training data").add_subparsers(required=True, metavar="ACTION")
    prepare = data.add_parser("prepare", help="tokenize text files, JSONL or Parquet into token shards for "
                              "data.source=tokens (docs/data.md)")
    prepare.add_argument("inputs", nargs="+", type=_path, metavar="INPUT", help="files (.txt and others: one document "
                         "each; .jsonl: one per line; .parquet: one per row) or directories of them")
    prepare.add_argument("--out", type=_path, required=True, metavar="DIR", help="where the shards and manifest go")
    which = prepare.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", default="bytes", metavar="T", help="bytes (default), a tokenizer.json, a "
                       "sentencepiece .model, or a directory holding one")
    which.add_argument("--train-tokenizer", type=_positive, metavar="VOCAB", help="train a byte-level BPE of VOCAB "
                       "ids on the training documents (saved as DIR/tokenizer.json)")
    prepare.add_argument("--glob", default="**/*", help="which files under an INPUT directory (default **/*)")
    prepare.add_argument("--field", help="read every JSONL line or Parquet row as a text document, its text in this "
                         "field (default: the records' fields tell TRL's format: text, prompt and completion, or "
                         "messages; docs/finetuning.md)")
    prepare.add_argument("--loss-on", default="auto", choices=("auto", "completion", "assistant", "all"),
                         help="which tokens of fine-tuning examples the loss counts (default auto: a completion "
                         "after its prompt, a conversation's assistant turns)")
    prepare.add_argument("--holdout", type=float, default=0.01, help="fraction of documents held out for "
                         "evaluation, every k-th (default 0.01)")
    prepare.add_argument("--shard-tokens", type=_positive, default=1 << 28, metavar="N",
                         help="tokens per shard file, about (default 2**28)")
    prepare.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                         help="begin every document with the tokenizer's BOS token, or not (default: as the "
                         "tokenizer's add_bos_token says: Llama's and Gemma's do, bytes and trained BPEs do not)")
    prepare.set_defaults(command=_prepare, args=[])
    return parser


def _version() -> str:
    """xlatrain's version and the jax it runs on, read from the installed distributions (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"xlatrain {of('xlatrain')} (jax {of('jax')}, jaxlib {of('jaxlib')}, Python {sys.version.split()[0]})"


def _step_window(text: str) -> tuple[int, int]:
    first, _, last = text.partition(":")
    try:
        window = (int(first), int(last))
    except ValueError:
        window = (0, 0)
    if not 1 <= window[0] <= window[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B with 1 <= A <= B, e.g. 3:5")
    return window


def _bounded(convert: Callable[[str], Any], accepts: Callable[[Any], bool], says: str) -> Callable[[str], Any]:
    """An argparse type: `convert(text)` where `accepts` it, else an error saying what the value must be."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {says}")
        return value

    return parse


def _path(text: str) -> Path:
    """A path argument, `~` and $VARIABLES expanded also where the shell did not (--out=~/x, a quoted one)."""
    from xlatrain.config.base import expanded

    return Path(expanded(text))


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; give names separated by commas, e.g. loss,mfu")
    return names


_positive = _bounded(int, lambda value: value >= 1, "a positive whole number")
_non_negative = _bounded(int, lambda value: value >= 0, "a whole number >= 0")
_seed = _bounded(int, lambda value: 0 <= value < 2**32, "a seed from 0 to 2**32 - 1")
_non_negative_float = _bounded(float, lambda value: 0 <= value < float("inf"), "a number >= 0")
_probability = _bounded(float, lambda value: 0 < value <= 1, "a probability in (0, 1]")


def _task_files(value: str) -> tuple[str, ...]:
    files = tuple(part.strip() for part in value.split(","))
    if not all(files):
        raise argparse.ArgumentTypeError(f"{value!r} names an empty task; give tasks separated by commas")
    return files


def _split_config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _train(config_path: str | None, overrides: list[str], _args: argparse.Namespace,
           once_joined: Callable[[], list[str]] = list) -> int:
    """`once_joined()`: more overrides, found after this process joined the others (if any)."""
    from xlatrain.runtime.signals import (
        STOPPED_BEFORE_FIRST_STEP,
        StoppedBeforeFirstStep,
        stop_signals,
    )

    with stop_signals():
        try:
            from xlatrain.config import load_config
            from xlatrain.runtime.distributed import initialize
            from xlatrain.trainer import train

            config = _config_with_cpu_devices(config_path, overrides)
            initialize(config.distributed)
            more = once_joined()
            if more:
                config = load_config(config_path, [*overrides, *more])
            with file_system_refusals_named(config.run_dir()):
                train(config)
        except StoppedBeforeFirstStep as stop:
            print(f"xlatrain: {stop}: {STOPPED_BEFORE_FIRST_STEP}", flush=True)
        except NonFiniteLoss as err:
            print(f"xlatrain: stopped: {err}", file=sys.stderr)
            return _leave(1)
        except UserError as err:
            print(f"xlatrain: error: {err}", file=sys.stderr)
            return _leave(err.exit_code)
        except Exception:
            if _in_multi_process_run():
                traceback.print_exc()
                _leave(1)
            raise
    return 0


def _in_multi_process_run() -> bool:
    if "jax" not in sys.modules:
        return False
    from xlatrain.compat.multihost import distributed_client

    return distributed_client() is not None


def _leave(code: int) -> int:
    """A failing process of a multi-process run exits at once: jax.distributed's orderly shutdown would wait at
    a barrier for the other processes, which this failure stops (their watchdogs see it)."""
    if _in_multi_process_run():
        from xlatrain.runtime.watchdog import leave_now

        leave_now(code)
    return code


def _config_with_cpu_devices(config_path: str | None, overrides: list[str]):
    """The config, with mesh.cpu_devices applied before JAX starts (xlatrain/runtime/cpu_devices.py)."""
    from xlatrain.config import load_config
    from xlatrain.program import apply_cpu_devices

    config = load_config(config_path, overrides)
    apply_cpu_devices(config)
    return config


def _prepare(_config_path: str | None, _overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.commands.prepare import Request, prepare

    prepare(Request(tuple(args.inputs), args.out, args.tokenizer, args.train_tokenizer, args.field, args.glob,
                    args.holdout, args.shard_tokens, args.bos, args.loss_on))
    return 0


def _launch(config_path: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.commands.launch import launch

    return launch(args.nproc, args.devices_per_proc, config_path, overrides)


def _config(config_path: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    if args.keys is not None:
        return _config_keys(config_path, overrides, args.keys)
    import jax

    from xlatrain.config import config_and_derived_to_yaml, derive
    from xlatrain.runtime import cpu_devices, malloc

    config = _config_with_cpu_devices(config_path, overrides)
    derived = derive(config, jax.devices())
    print(config_and_derived_to_yaml(config, derived.as_dict()), end="")
    if jax.default_backend() == "cpu":
        print(f"# CPU devices: {cpu_devices.applied.describe()}")
    print(f"# malloc: {malloc.applied or 'as the system allocates (set by the xlatrain command only)'}")
    return 0


def _config_keys(config_path: str | None, overrides: list[str], section: str) -> int:
    """`xlatrain config --keys [SECTION]`: the keys of this config (those of its model, data source and optimizer
    kinds)."""
    from xlatrain.config import load_config
    from xlatrain.config.reference import described_keys

    keys = described_keys(load_config(config_path, overrides))
    chosen = [key for key in keys if not section or key[0] == section or key[0].startswith(f"{section}.")]
    if not chosen:
        sections = sorted({key.split(".", 1)[0] for key, _, _ in keys})
        raise UserError(f"config --keys {section}: no such key or section; the sections: {', '.join(sections)}")
    width = max(len(f"{key}={value}") for key, value, _ in chosen)
    for key, value, meaning in chosen:
        print(f"{f'{key}={value}':{width}}  {meaning}")
    return 0


def _lower(config_path: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.commands.lower import gpu_target, lower

    if args.devices is not None and not args.target:
        raise UserError("lower: --devices counts the GPUs of --target; without --target the devices are this host's")
    if args.dump:  # made before the compile whose text goes there, so that a bad one fails at once
        make_writable_directory(args.dump, "lower: --dump")
    config, target, devices = (gpu_target(config_path, overrides, args.target, args.devices) if args.target
                               else (_config_with_cpu_devices(config_path, overrides), None, None))
    lower(config, target, devices, args.dump, args.json)
    return 0


PARITY_STOPPED = "parity stopped before its comparison ended; nothing compared"


def _parity(_config_path: str | None, _overrides: list[str], args: argparse.Namespace) -> int:
    """A stop signal ends parity at the next step boundary of the side training (at once before its first
    step), with no verdict: the exit status is the shell's for a process the signal ended, never 0 or 1."""
    from xlatrain.runtime.signals import StoppedBeforeFirstStep, stop_signals

    with stop_signals(PARITY_STOPPED, stopped_code=None) as stop:
        try:
            code = _compare_sides(args)
        except (Exception, StoppedBeforeFirstStep):
            if not stop.requested:
                raise
    if not stop.requested:
        return code
    signum = stop.received[0]
    print(f"xlatrain: {signal.Signals(signum).name}: {PARITY_STOPPED}", file=sys.stderr)
    return 128 + signum


def _compare_sides(args: argparse.Namespace) -> int:
    from xlatrain.commands.parity import run_parity
    from xlatrain.config import load_config
    from xlatrain.program import apply_cpu_devices

    if len(args.configs) > 2:
        raise UserError(f"parity takes at most two configs, got {len(args.configs)}: {args.configs}")
    if args.rtol is None:
        args.rtol = PARITY_RTOL_AGAINST_TORCH if args.against else PARITY_RTOL
    if args.steps < 1 or not args.rtol >= 0:
        raise UserError("parity: --steps must be at least 1 and --rtol non-negative")
    if args.against:
        if args.plot:
            raise UserError("parity --plot draws two xlatrain runs; with --against, side B is not one: drop --plot")
        return _parity_against_torch(args)
    if args.plot:
        from xlatrain.observe.plot import figure_path

        args.plot = figure_path("parity", "--plot", args.plot)
    paths = (args.configs or [None]) * (2 if len(args.configs) < 2 else 1)
    config_a, config_b = load_config(paths[0], args.a), load_config(paths[1], args.b)
    apply_cpu_devices(config_a, config_b)
    report = run_parity(config_a, config_b, args.steps, args.rtol, args.plot)
    print(report.summary())
    if args.plot:
        print(f"wrote {args.plot}")
    return 0 if report.first is None else 1


def _parity_against_torch(args: argparse.Namespace) -> int:
    from xlatrain.commands.torch_parity import run_torch_parity

    if len(args.configs) > 1 or args.b:
        raise UserError(f"parity --against {args.against} compares one config (side A, --a overrides) with "
                        f"{args.against}; drop the second config and --b")
    config = _config_with_cpu_devices(args.configs[0] if args.configs else None, args.a)
    print(f"parity: A = xlatrain, B = {'PyTorch eager' if args.against == 'torch' else 'torch_xla'}")
    report = run_torch_parity(config, args.against, args.steps, args.rtol, args.python)
    print(report.summary())
    return 0 if report.first is None else 1


def _export(_config_path: str | None, _overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.commands.export import export_hugging_face, export_peft, export_torch_state_dict

    if args.hf is not None:
        path, step = export_hugging_face(args.run_dir, args.hf, args.step)
    elif args.peft is not None:
        path, step = export_peft(args.run_dir, args.peft, args.step)
    else:
        path, step = export_torch_state_dict(args.run_dir, args.torch, args.step)
    print(f"wrote {path} (step {step})")
    return 0


def _sample(_config_path: str | None, _overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.commands.sample import Request, sample

    prompts = tuple(args.chat or args.prompt)
    continued = sample(Request(args.source, prompts, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                               args.seed, args.step, chat=args.chat is not None, stop=tuple(args.stop)))
    print("\n\n".join(text if args.chat else prompt + text for prompt, (text, _) in zip(prompts, continued)))
    return 0


def _evaluate(_config_path: str | None, _overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.commands.evaluate import Request, evaluate
    from xlatrain.config import DistributedConfig
    from xlatrain.runtime.distributed import initialize, is_primary

    initialize(DistributedConfig())  # joins the other processes under srun, mpirun or a Kubernetes Job
    scores = evaluate(Request(args.source, args.tasks, tuple(args.include_path), args.limit, args.batch_size,
                              args.output, args.step))
    for task, found in scores.items() if is_primary() else ():
        print(f"{task:<24} " + "  ".join(f"{metric} {value:.4g}" for metric, value in found.items()))
    return 0


def _pipeline(config_path: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.commands.pipeline import show_pipeline

    show_pipeline(_config_with_cpu_devices(config_path, overrides), args.out)
    return 0


def _profile(config_path: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.commands.profile import profile

    return profile(config_path, overrides, args.steps,
                   lambda path, more, once_joined: _train(path, more, args, once_joined))


def _plot(_config_path: str | None, _overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.observe.plot import figure_path, plot_runs

    out = figure_path("plot", "--out", args.out)
    panels = plot_runs(args.run_dirs, out, args.metrics)
    print(f"wrote {out} ({', '.join(panels)} against step, {len(args.run_dirs)} run(s))")
    return 0


def _report(_config_path: str | None, _overrides: list[str], args: argparse.Namespace) -> int:
    from xlatrain.observe.summary import format_report

    print(format_report(args.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(run())
