"""``python -m benchmarks.gpu_validate [--quick] [--with-1b] [--methods a,b] [--results-dir DIR] ...``

Without a CUDA device it prints one line and exits 0. Otherwise it runs the plan (``plan``), writes
``<results-dir>/gpu/<device slug>-<date>/gpu_validate.{json,md}`` after every check, prints the method table and
exits 1 only if a check crashed (a MISS is a finding, reported in the table and the files, exit 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import date, datetime, timezone
from pathlib import Path

from benchmarks.gpu_validate.plan import METHOD_LABELS, Options

NO_GPU_LINE = "gpu_validate: no CUDA device (torch.cuda.is_available() is False); nothing to validate here"


def parse_args(argv: list[str] | None = None) -> Options:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_validate",
                                 description="Prove the GPU path: memory figures, Triton kernels, throughput, PCIe.")
    ap.add_argument("--results-dir", type=Path, default=Path("results"),
                    help="results root; writes <dir>/gpu/<device-slug>-<date>/ (default: results)")
    ap.add_argument("--quick", action="store_true",
                    help="adamw, hmt, hmt-min only; no activation-policy or rSVD check")
    ap.add_argument("--with-1b", action="store_true", help="also run every method at model=1b (optional checks, last)")
    ap.add_argument("--methods", default=None,
                    help=f"comma-separated subset of: {','.join(METHOD_LABELS)} (default: all; --quick: 3)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="training steps per run: 3 metered, the rest timed")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall-clock budget; optional checks that would not fit are SKIPPED (default 540)")
    ap.add_argument("--runner", choices=("subprocess", "inprocess"), default="subprocess",
                    help="one process per training run (default, isolates OOM / CUDA errors) or this process")
    a = ap.parse_args(argv)
    methods = METHOD_LABELS
    if a.methods:
        methods = tuple(m.strip() for m in a.methods.split(",") if m.strip())
        unknown = sorted(set(methods) - set(METHOD_LABELS))
        if unknown:
            ap.error(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(METHOD_LABELS)}")
    if a.steps <= 3:
        ap.error("--steps must be > 3: the first 3 steps are metered and never timed")
    for name in ("seq_len", "batch_size", "budget_s"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    return Options(results_dir=a.results_dir, methods=methods, with_1b=a.with_1b, quick=a.quick, seq_len=a.seq_len,
                   batch_size=a.batch_size, steps=a.steps, budget_s=a.budget_s, runner=a.runner)


def git_sha() -> str | None:
    from experiments.runs import git_sha as runner_git_sha  # lazy: the no-GPU path stays a one-liner

    return runner_git_sha()


def run_validation(backend, opts: Options, *, clock: Callable[[], float] = time.monotonic, day: date | None = None,
                   say: Callable[[str], None] = print) -> int:
    """Validate through ``backend`` (``CudaBackend`` on a GPU, a fake one in the tests); returns the exit code."""
    from benchmarks.gpu_validate import checks as C
    from benchmarks.gpu_validate import report
    from benchmarks.gpu_validate.orchestrate import Session, Validation

    name = backend.device_name()
    day = day or datetime.now(timezone.utc).date()
    session = Session.create(opts.results_dir, name, day)
    peak, note = C.peak_bf16_flops(name)
    try:
        info = backend.device_info()
    except Exception as e:  # versions and totals are context, not a check: note the failure and go on
        info = {"device_info_error": f"{type(e).__name__}: {e}"}
    device = {**info, "name": name, "slug": C.device_slug(name),
              "peak_bf16_tflops": None if peak is None else peak / 1e12, "peak_note": note}
    started_at, start, sha = datetime.now(timezone.utc).isoformat(timespec="seconds"), clock(), git_sha()

    def write(records, complete: bool = False) -> dict:
        document = report.build_document(device=device, options=opts.to_dict(), records=records,
                                         day=day.isoformat(), started_at=started_at, wall_s=clock() - start,
                                         git_sha=sha, session_dir=session.dir, complete=complete)
        report.write_outputs(session.dir, document, records)
        return document

    say(f"gpu_validate: {name}; writing {session.dir}")
    validation = Validation(backend, opts, session, clock=clock, on_update=write, say=say)
    try:
        records = validation.run()
    except KeyboardInterrupt:
        write(validation.records)
        say(f"gpu_validate: interrupted; what was measured is in {session.dir}")
        return 130
    document = write(records, complete=True)
    say("")
    say(report.method_table_text(document["method_table"]))
    say("")
    say(report.checks_table_text(records))
    counts = ", ".join(f"{v} {n}" for v, n in document["counts"].items() if n)
    say(f"\ngpu_validate: {counts}; wrote {session.dir / report.JSON_NAME} and {report.MARKDOWN_NAME}")
    return document["exit_code"]


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU_LINE)
        return 0
    from benchmarks.gpu_validate.cuda_backend import CudaBackend

    return run_validation(CudaBackend(runner=opts.runner), opts)


if __name__ == "__main__":
    sys.exit(main())
