"""Multi-process training (``experiments.dist.parallel``, ``experiments.checkpoint.dcp``) on CPU with gloo.

1. DDP equals the single-process run on the same global batch, one step at a time from the same state (teacher
   forcing), for adamw, galore, apollo and hmt (per-layer Mode A and B, and ``per_layer=false``; INT8 weights with
   both), fp32, clipping on;
   FSDP2 equals it for adamw. Two processes via ``torch.multiprocessing.spawn``, one spawn for every case.
2. End to end with ``torchrun``: a DCP checkpoint written by 2 ranks resumes and the run continues exactly as the
   uninterrupted one; killing one rank fails the job with one ``error:`` line, keeps what was written, and the
   same command resumes; SIGTERM ends the run ``preempted`` with one line and exit 75 on every rank; a refused
   combination is said once.
3. Bad launches fail with one line before anything is written.

Why the tolerance is zero. The reference evaluates the global batch's mean loss as the mean of its two halves'
mean losses in one backward (the same function: the halves hold equal token counts), so every per-row operation
is the same computation, on the same shapes, as on the rank that owns the half. The ranks' gradients then differ
from the reference's only in where the 2-term mean ``(a + b)/2`` is formed: the reference's autograd adds
``a/2 + b/2`` (the 1/2 enters through the upstream gradient), DDP and HMT's own hook divide by 2 and all-reduce
a sum. Scaling by 1/2 is exact in fp32 (no subnormals here) and a 2-term sum rounds identically in either order,
so ``fl(a/2 + b/2) == fl(a + b)/2`` bit for bit: the updates, bases and weights must be equal, and any difference
is a bug (a missed all-reduce shows up as differences of the order of the update, ~lr). FSDP2 reduce-scatters
the same 2-term sum and AdamW's per-element formula is the same on a shard; clipping is off in that case because
the norm of a sharded gradient is a different summation order (it rounds differently, by design).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import free_port  # noqa: E402

STEPS = 3  # basis refreshes at steps 0 and 2 (update interval 2)
CASES = {
    "adamw": {},
    "galore": {"rank": 8, "update_proj_gap": 2},
    "apollo": {"rank": 8, "update_proj_gap": 2},
    "hmt": {"rank": 8, "update_interval": 2},  # per-layer Mode A, randomized SVD: HMT's hook all-reduces
    "hmt-B": {"name": "hmt", "mode": "B", "rank": 8, "update_interval": 2},  # per-layer Mode B, random bases
    "hmt-not-per-layer": {"name": "hmt", "rank": 8, "update_interval": 2, "per_layer": False},  # DDP wrapper
    # INT8 weights (codes + scales broadcast at start, not the one-element phantom): tolerance zero as above, since
    # equal fp32 updates requantized with the same stochastic-rounding draws (the generator's state is part of the
    # method state each step starts from) give the same codes
    "hmt-int8": {"name": "hmt", "rank": 8, "update_interval": 2, "weight_dtype": "int8"},
    "hmt-int8-not-per-layer": {"name": "hmt", "rank": 8, "update_interval": 2, "weight_dtype": "int8",
                               "per_layer": False},
    # INT8 embedding and LM head (the embedding dense, its moments 8-bit; the head Mode B): the same argument
    "hmt-int8-emb": {"name": "hmt", "mode": "B", "rank": 8, "update_interval": 2, "weight_dtype": "int8",
                     "embedding_dtype": "int8", "dense_8bit": True, "target_patterns": ["attn", "mlp", "lm_head"]},
}


# ---------------------------------------------------------------------------------- spawned worker (2 ranks)
def _state_bytes(method) -> bytes:
    buf = io.BytesIO()
    torch.save(method.state_dict(), buf)
    return buf.getvalue()


def _method(name: str, overrides: dict, model):
    """The method, attached to ``model`` after its ``prepare`` (in place: INT8 layers for ``weight_dtype=int8``)."""
    from experiments import methods

    cfg = methods.make_config({"name": overrides.get("name", name), **{k: v for k, v in overrides.items()
                                                                        if k != "name"}})
    method = methods.make_method(cfg)
    assert method.prepare(model) is model
    method.attach(model, max_grad_norm=None if name == "fsdp2-adamw" else 1.0)
    method.set_lr_scale(1.0)
    return method


def micro_rows(rank: int, world: int, rows: int, micro: int) -> list[list[int]]:
    """The global rows of each of ``micro`` micro-batches of ``rank`` (its rows [rank·rows, (rank+1)·rows))."""
    per = rows // micro
    return [list(range(rank * rows + i * per, rank * rows + (i + 1) * per)) for i in range(micro)]


def _reference(name: str, overrides: dict, data: list[torch.Tensor], micro: int = 1) -> list[dict]:
    """Single process, global batch: the state before each step and the weights after it. Micro-batch i of
    ``micro`` is the union of the 2 ranks' micro-batches i, its loss the mean of their means (the arithmetic of the
    ranks' averaged gradient; with ``micro=1``, ``(loss(first half) + loss(second half)) / 2``)."""
    from experiments.loop import lm_loss
    from helpers import tiny_llama

    model = tiny_llama()
    method = _method(name, overrides, model)
    snaps = []
    for x in data:
        snap = {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "method": _state_bytes(method)}
        parts = [micro_rows(r, 2, x.shape[0] // 2, micro) for r in range(2)]
        for i in range(micro):
            method.start_micro_batch(i, micro)
            loss = sum(lm_loss(model, x[parts[r][i]]) / micro for r in range(2)) / 2
            loss.backward()
        method.step()
        method.zero_grad()
        snap["after"] = {k: v.clone() for k, v in model.state_dict().items()}
        snaps.append(snap)
    return snaps


def _diffs(after: dict, expected: dict) -> dict[str, tuple[float, float]]:
    """name -> (max |difference|, max |expected|) for every tensor that differs."""
    out = {}
    for k, v in expected.items():
        d = (after[k].double() - v.double()).abs().max().item()
        if d != 0.0:
            out[k] = (d, v.abs().max().item())
    return out


def _ddp_case(ctx, name: str, overrides: dict, data, snaps) -> list[dict]:
    from experiments.dist import parallel as distributed
    from experiments.loop import train_step
    from helpers import tiny_llama

    model = tiny_llama(seed=1 + ctx.rank)  # other weights on each rank: the start must broadcast rank 0's
    method = _method(name, overrides, model)
    forward = distributed.wrap_for_forward(model, method, ctx)
    rank0 = tiny_llama(seed=1)
    _method(name, overrides, rank0)  # prepared alike (INT8 codes and scales)
    start = {f"initial broadcast: {k}": v for k, v in _diffs(model.state_dict(), rank0.state_dict()).items()}
    rows = data[0].shape[0] // ctx.world_size
    out = [start]  # then one entry per step, each from the reference's state (the snapshot overwrites the start)
    for x, snap in zip(data, snaps):
        model.load_state_dict(snap["weights"])
        method.load_state_dict(torch.load(io.BytesIO(snap["method"]), weights_only=False))
        shard = x[ctx.rank * rows:(ctx.rank + 1) * rows]
        train_step(forward, method, [shard], meter=None, autocast=contextlib.nullcontext, skip_nonfinite=True)
        out.append(_diffs(model.state_dict(), snap["after"]))
    out[1].update(out.pop(0))  # reported with step 0
    return out


def _fsdp2_case(ctx, data, snaps) -> list[dict]:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    from experiments.dist import parallel as distributed
    from experiments.loop import train_step
    from helpers import tiny_llama

    model = distributed.shard_model(tiny_llama(seed=1), ctx)
    method = _method("fsdp2-adamw", {"name": "adamw"}, model)
    full = StateDictOptions(full_state_dict=True)
    rows = data[0].shape[0] // ctx.world_size
    out = []
    for x, snap in zip(data, snaps):
        set_model_state_dict(model, snap["weights"], options=full)
        if snap.get("optim") is not None:
            set_optimizer_state_dict(model, method.driver.optimizer, snap["optim"], options=full)
        train_step(model, method, [x[ctx.rank * rows:(ctx.rank + 1) * rows]], meter=None,
                   autocast=contextlib.nullcontext, skip_nonfinite=True)
        out.append(_diffs(get_model_state_dict(model, options=full), snap["after"]))
    return out


def _fsdp2_reference(data) -> list[dict]:
    """Single-process adamw without clipping; optimizer state in the FQN form FSDP2 loads."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from experiments.loop import lm_loss
    from helpers import tiny_llama

    model = tiny_llama()
    method = _method("fsdp2-adamw", {"name": "adamw"}, model)
    snaps = []
    for k, x in enumerate(data):
        opt = method.driver.optimizer
        snap = {"weights": {n: v.clone() for n, v in model.state_dict().items()},
                "optim": copy.deepcopy(get_optimizer_state_dict(model, opt, options=StateDictOptions(
                    full_state_dict=True))) if k else None}  # a copy: the next step updates the moments in place
        loss = (lm_loss(model, x[:2]) + lm_loss(model, x[2:])) / 2
        loss.backward()
        method.step()
        method.zero_grad()
        snap["after"] = {n: v.clone() for n, v in model.state_dict().items()}
        snaps.append(snap)
    return snaps


def _resume_case(ctx, name: str, overrides: dict, data, root: Path) -> dict:
    """A DCP checkpoint written by both ranks after step 1, restored into a model and method built from other
    weights, continues with the same step 2 as the uninterrupted run (bit for bit: same ops, same order)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from experiments.dist import parallel as distributed
    from experiments.checkpoint.manager import LoopState, ResumePoint
    from experiments.checkpoint.dcp import DistCheckpointer
    from experiments.loop import train_step
    from helpers import tiny_llama
    from experiments.checkpoint import store as ck

    rows = data[0].shape[0] // ctx.world_size

    def build(seed: int):
        model = distributed.shard_model(tiny_llama(seed=seed), ctx)
        method = _method(name, overrides, model)
        ckpt = DistCheckpointer(root, every=1, keep=1, model=model, method=method, meta={}, ctx=ctx)
        return model, method, distributed.wrap_for_forward(model, method, ctx), ckpt

    def step(forward, method, x) -> None:
        train_step(forward, method, [x[ctx.rank * rows:(ctx.rank + 1) * rows]], meter=None,
                   autocast=contextlib.nullcontext, skip_nonfinite=True)

    full = StateDictOptions(full_state_dict=True)
    model, method, forward, ckpt = build(0)
    step(forward, method, data[0])
    saved = ckpt.save(LoopState(next_step=1, last_loss=1.5))
    step(forward, method, data[1])
    expected = get_model_state_dict(model, options=full)
    model, method, forward, ckpt = build(1)
    state = ckpt.restore(ResumePoint(saved.path, ck.verify(saved.path), []), torch.device("cpu"))
    assert state.next_step == 1 and state.last_loss == 1.5, state
    step(forward, method, data[1])
    return _diffs(get_model_state_dict(model, options=full), expected)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from experiments.dist.parallel import DistContext

    from helpers import join_gloo, seeded_token_batches

    join_gloo(rank, world, port)
    try:
        data = seeded_token_batches(STEPS)
        results = {}
        ddp = DistContext(mode="ddp", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                          device=torch.device("cpu"))
        for name, overrides in CASES.items():
            results[name] = _ddp_case(ddp, name, overrides, data, _reference(name, overrides, data))
        fsdp = DistContext(mode="fsdp2", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                           device=torch.device("cpu"))
        results["fsdp2-adamw"] = _fsdp2_case(fsdp, data, _fsdp2_reference(data))
        for ctx, name in ((ddp, "hmt"), (ddp, "adamw"), (ddp, "galore"), (fsdp, "fsdp2-adamw")):
            root = Path(out, f"ckpt-{name}")
            results[f"resume-{name}"] = [_resume_case(ctx, name, CASES.get(name, {"name": "adamw"}), data, root)]
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def spawn_pair(worker, out: Path) -> dict:
    """``worker(rank, 2, port, out)`` in two spawned processes; each writes ``<out>/rank<r>.json``: {rank: result}."""
    from helpers import spawn_gloo

    spawn_gloo(worker, (2, free_port(), str(out)), nprocs=2)
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("equivalence"))


@pytest.mark.parametrize("case", [*CASES, "fsdp2-adamw"])
def test_one_step_from_the_same_state_equals_the_single_process_global_batch(equivalence, case):
    for rank, results in equivalence.items():
        for step, diffs in enumerate(results[case]):
            table = "\n".join(f"  {k}: max|diff| {d:.3e} (max|expected| {m:.3e})" for k, (d, m) in diffs.items())
            assert not diffs, f"{case}, rank {rank}, step {step}: weights differ from the reference:\n{table}"


@pytest.mark.parametrize("case", ["hmt", "adamw", "galore", "fsdp2-adamw"])
def test_a_dcp_checkpoint_written_by_two_ranks_resumes_and_continues_identically(equivalence, case):
    for rank, results in equivalence.items():
        (diffs,) = results[f"resume-{case}"]
        table = "\n".join(f"  {k}: max|diff| {d:.3e} (max|expected| {m:.3e})" for k, (d, m) in diffs.items())
        assert not diffs, f"{case}, rank {rank}: the resumed step differs from the uninterrupted one:\n{table}"


# ------------------------------------------------------------------------------------ end to end with torchrun
E2E = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.intermediate_size=128",
       "train.seq_len=32", "train.batch_size=4", "train.steps=4", "train.warmup_steps=0", "train.eval_every=2",
       "train.eval_batches=1", "train.log_every=1", "train.progress=false", "train.checkpoint_every=2",
       "method=hmt", "method.rank=8", "method.update_interval=2"]


def torchrun(results: Path, run_id: str, pause_s: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HMT_DIST_CHECKPOINT_PAUSE_S": str(pause_s)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "experiments.run", "dist=ddp", f"results_dir={results}", f"run_id={run_id}", *E2E]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker process with RANK=rank (a child of the launcher)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_killed_rank_fails_the_job_with_one_line_and_the_same_command_resumes(tmp_path):
    results = tmp_path / "results"
    earlier = results / "earlier"  # a completed run that the failure must leave alone
    earlier.mkdir(parents=True)
    (earlier / "status").write_text("completed\n")
    (earlier / "summary.json").write_text('{"val_loss": 1.0}')
    untouched = {p: p.read_bytes() for p in earlier.iterdir()}

    # the same run, rank 1 killed while both ranks pause after the step-2 checkpoint is complete
    job = torchrun(results, "killed", pause_s=4)
    manifest = results / "killed" / "checkpoints" / "step-00000002" / "manifest.json"
    deadline = time.monotonic() + 240
    while not manifest.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = worker_pid(job.pid, 1)
    assert manifest.exists() and pid is not None, job.stderr.read() if job.poll() is not None else "timeout"
    os.kill(pid, signal.SIGKILL)
    out, err = job.communicate(timeout=120)
    assert job.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 0 of 2" in errors[0] and "step-00000002" in errors[0], err
    assert not re.search(r'File "[^"]*/(experiments|hmt_core)/', err), err  # no worker traceback (torchrun's own stays)
    run_dir = results / "killed"
    assert (run_dir / "status").read_text().strip() == "failed"
    assert sorted(metrics(run_dir)) == [0, 1], metrics(run_dir)  # what was written before the kill is kept
    assert {p: p.read_bytes() for p in earlier.iterdir()} == untouched
    killed_rows = metrics(run_dir)

    # the same command resumes from the DCP checkpoint (exactness: test_a_dcp_checkpoint_written_by_two_ranks...)
    again = torchrun(results, "killed")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "resuming killed at step 2" in err, err
    resumed = metrics(run_dir)
    assert sorted(resumed) == [0, 1, 2, 3] and all(resumed[s] == killed_rows[s] for s in (0, 1)), resumed
    assert (run_dir / "status").read_text().strip() == "completed"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dist"]["world_size"] == 2 and len(summary["dist"]["peak_bytes_by_rank"]) == 2
    assert "memory/peak_max(GiB)" in resumed[3] and "memory/peak_mean(GiB)" in resumed[3]


def _launch(results: Path, run_id: str, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "experiments.run", f"results_dir={results}", f"run_id={run_id}", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_under_torchrun_ends_preempted_with_one_line_and_the_requeue_code(tmp_path):
    """SIGTERM to both ranks (what Slurm sends every process of a job step): each finishes its step, the DCP
    checkpoint is written, the run ends ``preempted`` (no error.txt), rank 0 says so in one line, every rank exits
    75 (torchrun's report names each worker's exit code: torchrun itself turns any non-zero worker exit into its
    report and exit 1, see docs/gpu_runs.md), and the same command resumes and completes."""
    from experiments.checkpoint.manager import PREEMPTED_EXIT_CODE

    results, config = tmp_path / "results", [*E2E, "dist=ddp", "train.steps=12", "train.checkpoint_every=0"]
    job = _launch(results, "p", *config)
    run_dir = results / "p"
    deadline = time.monotonic() + 240
    while job.poll() is None and time.monotonic() < deadline and not (
            (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 2):
        time.sleep(0.05)
    pids = [worker_pid(job.pid, rank) for rank in (0, 1)]
    assert job.poll() is None and None not in pids, job.stderr.read() if job.poll() is not None else "timeout"
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    said = [line for line in err.splitlines() if "preempted by" in line]
    assert len(said) == 1 and said[0].startswith("preempted by SIGTERM after step "), err
    assert not [line for line in err.splitlines() if line.startswith("error:")], err
    assert not re.search(r'File "[^"]*/(experiments|hmt_core)/', err), err  # no worker traceback
    # every rank exits 75 after the status is written; torchrun stops a rank still tearing down when the other has
    # exited (SIGTERM, -15): which one is first depends on the machine's load
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert str(PREEMPTED_EXIT_CODE) in codes and set(codes) <= {str(PREEMPTED_EXIT_CODE), "-15"}, (codes, err)
    assert job.returncode != 0, err
    assert (run_dir / "status").read_text().strip() == "preempted" and not (run_dir / "error.txt").exists()
    stopped = int(said[0].split("after step ")[1].split(";")[0])
    assert (run_dir / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").exists(), said[0]

    again = _launch(results, "p", *config)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"resuming p at step {stopped}" in err, err
    assert (run_dir / "status").read_text().strip() == "completed" and sorted(metrics(run_dir)) == list(range(12))


def test_a_refusal_under_torchrun_is_said_once(tmp_path):
    """Bad input is refused alike on every rank; rank 0 alone prints the ``error:`` line, the others exit with the
    same code quietly (torchrun then adds its own failure report, which it prints for any non-zero exit)."""
    job = _launch(tmp_path, "r", *E2E, "dist=fsdp2", "method.weight_dtype=int8")
    out, err = job.communicate(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert job.returncode != 0 and len(errors) == 1, err
    assert "method.weight_dtype=int8 is not supported with sharded weights (dist=fsdp2)" in errors[0], err
    # the first rank to refuse exits 2 (the bad-input code); torchrun then stops the other, which may already have
    # exited 2 itself or be ended by torchrun's SIGTERM (-15) first: a race that depends on the machine's load
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert "2" in codes and set(codes) <= {"2", "-15"}, (codes, err)
    assert not (tmp_path / "r").exists()


def test_qlora_under_ddp_equals_the_single_process_run(tmp_path: Path) -> None:
    """``dist=ddp method=qlora`` (LoRA gradients all-reduced by DDP, the NF4 base quantized on every rank) through
    torchrun equals the single-process run that takes the same rows in the same shapes: ``train.batch_size=2
    train.grad_accum=2``, whose micro-batch k is rank k's half of the global batch of 4 (``PackedTokens.batch``).

    Why not the single run of the global batch of 4: its backward sums each LoRA gradient over 128 tokens in one
    matmul, DDP over 64 on each rank and then across ranks — reordered fp32 sums, ~1e-7 relative. AdamW divides
    every element by its own RMS, so an element whose gradient is within rounding of 0 moves by up to 2·lr with
    the rounding alone; the validation losses then differ by ~1e-5 (measured with ATEN_CPU_CAPABILITY=default),
    the order of what 4 steps of training move them at the default lr, and no useful a-priori bound exists.

    With the same rows and shapes, the module docstring's argument applies: each rank's gradient is its half's
    (the reference's micro-batch gradient with the upstream 1/2, exact), DDP forms fl(a/2 + b/2) as autograd's
    accumulation does, so the weights after every step are equal, and what is compared is exact up to the one
    rounding each side's logging adds:
    - train loss: DDP logs (a + b)/2 of the ranks' fp32 losses in float64 (exact), the reference the fp32
      accumulation a/2 + b/2 = fl32((a + b)/2): |difference| ≤ u·|loss|, u = 2⁻²⁴ (half an fp32 ulp). It is
      checked at every step, so it checks the weights every step: a missed all-reduce or a differing base moves
      it by ≫ 1e-4 (training on half the rows: ~1e-2 at this lr).
    - validation loss: DDP evaluates the 4 validation rows as one batch, the reference as two of 2 rows and takes
      the mean of the two means. Both are means of the same 128 per-token losses ℓ ≈ 8.3 (row-wise forward on
      equal weights) summed in different orders; a sum of n positive terms in any order is within γ_{n-1}·Σℓ of
      the exact one (Higham §4.2), so they differ by ≤ 2·γ_128·mean ℓ ≈ 1.3e-4. lr=1e-2 (not the default 2e-4)
      makes 4 steps move the validation loss by ~3e-2 and half-the-rows training by ~9e-3, ≫ the bound.
    """
    cfg = [*E2E[:-3], "method=qlora", "method.lora_r=4", "method.lr=1e-2", "model.dtype=fp32",
           "train.autocast=false", "train.checkpoint_every=0", f"results_dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), "-m", "experiments.run", "dist=ddp", "run_id=ddp", *cfg],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    same_rows = [o for o in cfg if not o.startswith(("train.batch_size=", "train.eval_batches="))]
    one = subprocess.run([sys.executable, "-m", "experiments.run", "run_id=single", *same_rows, "train.batch_size=2",
                          "train.grad_accum=2", "train.eval_batches=2"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0 and one.returncode == 0, (two.stderr[-2000:], one.stderr[-2000:])
    losses = {name: {s: {k: v for k, v in row.items() if k.startswith("loss/")}
                     for s, row in metrics(tmp_path / name).items()} for name in ("ddp", "single")}
    assert sorted(losses["ddp"]) == sorted(losses["single"]) == [0, 1, 2, 3], losses
    u, n_val = 2.0 ** -24, 4 * 32  # fp32 unit roundoff; validation tokens (4 rows of train.seq_len=32)
    gamma = n_val * u / (1 - n_val * u)
    for s in range(4):
        a, b = losses["ddp"][s]["loss/train"], losses["single"][s]["loss/train"]
        assert abs(a - b) <= u * abs(a), f"step {s}: train loss ddp {a!r} vs single {b!r}: |diff| {abs(a - b):.3e}"
    vals = [(s, losses["ddp"][s]["loss/val"], losses["single"][s]["loss/val"]) for s in range(4)
            if "loss/val" in losses["ddp"][s] or "loss/val" in losses["single"][s]]
    assert [s for s, _, _ in vals] == [1, 3], vals  # train.eval_every=2: after steps 1 and 3
    for s, a, b in vals:
        assert abs(a - b) <= 2 * gamma * abs(b), f"step {s}: val loss ddp {a!r} vs single {b!r}: |diff| " \
            f"{abs(a - b):.3e} > bound {2 * gamma * abs(b):.3e}"
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["dist"]["world_size"] == 2, summary["dist"]


# ------------------------------------------------------------------------------------------------ bad launches
from test_bad_inputs import assert_one_line_error, results  # noqa: E402,F401  (the fixture: an earlier run)

TORCHRUN_2 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize("env, overrides, fragments", [
    ({}, ["dist=ddp"], ["dist=ddp needs torchrun's environment", "RANK", "torchrun --nproc_per_node"]),
    (TORCHRUN_2, [], ["WORLD_SIZE=2", "dist=none"]),
    (TORCHRUN_2, ["dist=ddp", "train.batch_size=3"], ["train.batch_size=3", "WORLD_SIZE=2"]),
    (TORCHRUN_2, ["dist=fsdp2", "method=qlora"], ["dist=fsdp2 supports method=adamw", "method=qlora"]),
    (TORCHRUN_2, ["dist=ddp", "dist.backend=nccl", "device=cpu"], ["dist.backend=nccl needs CUDA"]),
    (TORCHRUN_2, ["dist=fsdp2", "method=hmt", "method.weight_dtype=int8"],
     ["method.weight_dtype=int8 is not supported with sharded weights (dist=fsdp2)"]),
    (TORCHRUN_2, ["dist=fsdp2", "method=hmt", "method.embedding_dtype=int8", "method.dense_8bit=true"],
     ["method.dense_8bit=True is not supported with sharded weights (dist=fsdp2)"]),
])
def test_bad_launches_fail_with_one_line_before_anything_is_written(capsys, monkeypatch, results, env, overrides,
                                                                    fragments):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert_one_line_error(capsys, results, overrides, *fragments)
