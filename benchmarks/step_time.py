"""Step time of some ``benchmarks.step_profile`` rows, interleaved, on a shared machine: each row's model and method are
built once as the profile builds them, then ``ROUNDS`` rounds run ``STEPS`` steps of every row in turn
(``experiments.loop.train_step``, one thread). Reported per row: the median wall time and the median CPU time of the
main thread (``time.thread_time``: what the step itself computed, not the time other processes held the cores), and
the median over rounds of each round's CPU-time ratio to the first row. Docs: docs/step_profile.md.

    python -m benchmarks.step_time [--rows adamw-fused,hmt,hmt-act] [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks import step_profile as sp
from experiments import methods
from experiments.dist import parallel as distributed
from experiments.loop import train_step
from experiments.models import model_vocab_size
from experiments.train import seed_everything
from hmt_core.activations import apply_policy


def build(name: str):
    """(model, method, batch maker) of row ``name`` (a single-process row), as ``step_profile.profile`` builds it."""
    run = sp.compose(*sp.BASE, *sp.ROWS[name][2])
    seed_everything(run.seed)
    method = methods.make_method(run.method)
    vocab = model_vocab_size(run.model)
    model = distributed.build_sharded(run.model, method, None, vocab_size=vocab, device=torch.device("cpu"))
    model.train()
    method.attach(model, max_grad_norm=run.train.max_grad_norm or None)
    if not run.activation.is_identity():
        apply_policy(model, run.activation)
    gen = torch.Generator().manual_seed(run.seed)
    return model, method, lambda: [torch.randint(0, vocab, (run.train.batch_size, run.train.seq_len), generator=gen)]


def timed_step(model, method, batch) -> tuple[float, float]:  # (wall s, main-thread CPU s)
    method.set_lr_scale(1.0)
    wall, cpu = time.perf_counter(), time.thread_time()
    train_step(model, method, batch(), meter=None, autocast=contextlib.nullcontext)
    return time.perf_counter() - wall, time.thread_time() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="adamw-fused,hmt,hmt-act")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = args.rows.split(",")
    built = {name: build(name) for name in rows}
    for name in rows:  # warm-up: the first step refreshes the bases
        for _ in range(3):
            timed_step(*built[name])
    wall, cpu, ratio = ({n: [] for n in rows} for _ in range(3))
    for _ in range(args.rounds):
        medians = {}
        for name in rows:
            times = [timed_step(*built[name]) for _ in range(args.steps)]
            wall[name] += [w for w, _ in times]
            cpu[name] += [c for _, c in times]
            medians[name] = statistics.median(c for _, c in times)
        for name in rows:
            ratio[name].append(medians[name] / medians[rows[0]])
    for name in rows:
        print(f"{name:<20} wall {statistics.median(wall[name]) * 1e3:7.1f} ms"
              f"   cpu {statistics.median(cpu[name]) * 1e3:6.1f} ms"
              f"   cpu x {rows[0]}: {statistics.median(ratio[name]):.2f} (rounds {[round(r, 2) for r in ratio[name]]})")


if __name__ == "__main__":
    main()
