"""`xlatrain train` for the multi-process tests, with one fault or delay injected into rank 1:
python tests/multiprocess_driver.py FAULT CONFIG [key=value ...], FAULT one of
  stuck-hook     rank 1 blocks in a hook at step 20
  stuck-loader   rank 1 blocks reading its batch after step 20
  slow-start     rank 1 compiles and checkpoints 6 s slower than rank 0 (no fault: the run must finish)
  small-host     rank 1's host has 64 KiB of RAM
  other-device   rank 1's devices measure a pipeline differently: its first piece 1000x the compute, its train step
                 64 MiB more memory (as another device kind's XLA might)
"""

import dataclasses
import sys
import time

import jax
from xlatrain.lowering.pipeline import parallel as pipeline_parallel

from xlatrain import program, trainer
from xlatrain.cli import main
from xlatrain.data.loader import DeviceLoader
from xlatrain.run import checkpoints as checkpoint
from xlatrain.runtime import device_memory

FOREVER_S = 3600


def on_rank_1(fn):
    def only_there(*args, **kwargs):
        if jax.process_index() == 1:
            fn(*args, **kwargs)

    return only_there


def stuck_hook() -> None:
    original = trainer.train

    def hook(boundary):
        if boundary.step == 20:
            time.sleep(FOREVER_S)

    trainer.train = lambda config, **kw: original(config, hooks=[on_rank_1(hook)], **kw)


def stuck_loader() -> None:
    original, calls = DeviceLoader.__next__, [0]

    def next_batch(self):
        calls[0] += 1
        if calls[0] > 20 and jax.process_index() == 1:
            time.sleep(FOREVER_S)
        return original(self)

    DeviceLoader.__next__ = next_batch


def slow_start() -> None:
    build, save = trainer.build_program, checkpoint.Checkpoints.save

    def slow_build(*args, **kwargs):
        on_rank_1(time.sleep)(6)
        return build(*args, **kwargs)

    def slow_save(self, *args):
        on_rank_1(time.sleep)(6)
        return save(self, *args)

    trainer.build_program, checkpoint.Checkpoints.save = slow_build, slow_save


def small_host() -> None:
    real = device_memory.host_memory

    def host_memory():
        return (64 * 2**10, "a host's 64 KiB of RAM") if jax.process_index() == 1 else real()

    device_memory.host_memory = host_memory


def other_device() -> None:
    measure, peak = pipeline_parallel.measure_block_costs, program.peak_memory_bytes

    def heavy_first_piece(*args, **kwargs):
        costs = measure(*args, **kwargs)
        return dataclasses.replace(costs, before=costs.before * 1000) if jax.process_index() == 1 else costs

    def larger_step(compiled):
        return peak(compiled) + (64 * 2**20 if jax.process_index() == 1 else 0)

    pipeline_parallel.measure_block_costs, program.peak_memory_bytes = heavy_first_piece, larger_step


if __name__ == "__main__":
    {"stuck-hook": stuck_hook, "stuck-loader": stuck_loader, "slow-start": slow_start,
     "small-host": small_host, "other-device": other_device}[sys.argv[1]]()
    sys.exit(main(["train", *sys.argv[2:]]))
