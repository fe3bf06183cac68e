"""Faults, on CPU: a corrupted newest checkpoint, SIGTERM/SIGUSR1 preemption (checkpoint, exit 75, Slurm
requeue, status ``preempted``), non-finite loss/gradient (skipped and counted; too many in a row stops the run),
an unwritable checkpoint directory and a full disk (clear error, earlier checkpoints intact); a step's loss stays
on the model's device (a CPU accumulator breaks on a GPU)."""

import contextlib
import json
import resource
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from experiments import methods
from experiments.checkpoint.manager import PREEMPTED_EXIT_CODE, Checkpointer, TooManyBadSteps
from experiments.config import ModelConfig, TrainConfig
from experiments.data.corpus import build_corpus
from experiments.loop import run_training, train_step
from experiments.memory.meter import MemoryMeter
from experiments.models import build_model
from experiments.checkpoint import store as ck
from test_resume import ENV, finish, last_step, launch, losses, wait_for

# the subprocess runs are test_resume.MICRO's 10 steps: the uninterrupted one is conftest's session fixture
# ``micro_reference``, shared with test_resume

def test_corrupted_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, micro_reference):
    run_dir, ckdir = tmp_path / "r", tmp_path / "r" / "checkpoints"
    common = ("train.checkpoint_every=2", "train.keep_checkpoints=3")
    proc = launch(tmp_path, "r", *common)
    wait_for(lambda: (ckdir / "step-00000004" / "manifest.json").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (newest_step, newest), (previous_step, _) = ck.list_checkpoints(ckdir)[:2]
    f = newest / "method.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x01  # one flipped bit
    f.write_bytes(bytes(data))

    rc, out = finish(launch(tmp_path, "r", *common))
    assert rc == 0, out
    assert "skipping damaged checkpoint" in out and "method.pt sha256" in out and newest.name in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resume"]["from_step"] == previous_step < newest_step
    assert summary["resume"]["rejected_checkpoints"] and newest.name in summary["resume"]["rejected_checkpoints"][0]
    assert losses(run_dir) == losses(micro_reference)


def test_sigterm_and_sigusr1_checkpoint_then_exit_for_requeue(tmp_path, micro_reference):
    run_dir = tmp_path / "p"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "scontrol_calls"
    (fake_bin / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (fake_bin / "scontrol").chmod(0o755)
    slurm_env = {**ENV, "PATH": f"{fake_bin}:{ENV['PATH']}", "SLURM_JOB_ID": "1001", "SLURM_ARRAY_JOB_ID": "1000",
                 "SLURM_ARRAY_TASK_ID": "3"}
    for sig, after, env in ((signal.SIGTERM, 2, ENV), (signal.SIGUSR1, 5, slurm_env)):
        proc = launch(tmp_path, "p", env=env)  # no periodic checkpoints: only the preemption ones
        wait_for(lambda after=after: last_step(run_dir) >= after, proc)
        proc.send_signal(sig)
        rc, out = finish(proc)
        assert rc == PREEMPTED_EXIT_CODE, out
        stopped_after = last_step(run_dir) + 1
        said = [line for line in out.splitlines() if line.startswith("preempted by")]
        assert len(said) == 1 and f"preempted by {sig.name} after step {stopped_after}" in said[0], out
        assert (run_dir / "status").read_text().strip() == "preempted"  # resumable, not failed
        assert not (run_dir / "error.txt").exists()
        assert ck.list_checkpoints(run_dir / "checkpoints")[0][0] == stopped_after
    assert calls.read_text().split("\n")[0] == "requeue 1000_3"  # only the run under (fake) Slurm asked
    rc, out = finish(launch(tmp_path, "p"))
    assert rc == 0, out
    assert losses(run_dir) == losses(micro_reference)


# ------------------------------------------------------------------------------------------- in-process loop
MICRO_MODEL = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=176, vocab_size=512)


def _train(tmp_path, method_raw: dict, *, steps: int, nan_loss=(), nan_grad=(), **train_kw):
    """Real data, model, method and loop; NaN injected into the loss (the final norm's output) or one weight's gradient at
    chosen steps. Returns (result or raised exception, per-step snapshots of weights + optimizer state)."""
    torch.manual_seed(0)
    cfg = TrainConfig(**{"steps": steps, "seq_len": 32, "batch_size": 2, "warmup_steps": 1, "log_every": 1,
                         "eval_every": 100, "eval_batches": 1, "progress": False, **train_kw})
    corpus = build_corpus(path=None, text_field="text", val_fraction=0.05, vocab_size=512, seq_len=32, batch_size=2,
                          seed=0, cache_dir="~/.cache/hmt")
    model = build_model(MICRO_MODEL, vocab_size=corpus.vocab_size)
    method = methods.make_method(methods.make_config(dict(method_raw)))
    model = method.prepare(model)
    method.attach(model, max_grad_norm=1.0)
    current = {"step": 0}
    nan = float("nan")
    # the final norm's output feeds the loss whichever way it is computed (plain, or the fused linear + CE,
    # which reads lm_head's input and never its output)
    model.model.norm.register_forward_hook(lambda m, i, out: out * nan if current["step"] in nan_loss else out)
    weight = model.model.layers[0].mlp.down_proj.weight
    weight.register_hook(lambda g: g * nan if current["step"] in nan_grad else g)
    snapshots, rows = [], []
    set_lr_scale = method.set_lr_scale

    def step_starts(scale):  # called first in every step (logged or not): the step the hooks are in
        current["step"] = current.get("next", 0)
        current["next"] = current["step"] + 1
        set_lr_scale(scale)

    method.set_lr_scale = step_starts

    def log(record):
        rows.append(record)
        snapshots.append([t.detach().clone() for t in (*model.parameters(), *method.state_tensors())])

    checkpointer = Checkpointer(tmp_path / "ck", every=cfg.checkpoint_every, keep=0, model=model, method=method,
                                meta={})
    try:
        result = run_training(model, method, corpus, cfg, torch.device("cpu"), log=log, meter=MemoryMeter(),
                              checkpointer=checkpointer)
    except TooManyBadSteps as e:
        result = e
    return result, snapshots, rows


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("method_raw", [{"name": "hmt", "rank_candidates": (8,)}, {"name": "adamw"}],
                         ids=["hmt", "adamw"])
def test_nonfinite_loss_or_gradient_skips_the_step_and_counts_it(tmp_path, method_raw):
    result, snaps, rows = _train(tmp_path, method_raw, steps=6, nan_loss={2}, nan_grad={4})
    assert result.skipped_steps == 2
    assert [r.get("skipped", False) for r in rows] == [False, False, True, False, True, False]
    assert rows[-1]["skipped_steps"] == 2
    assert rows[2]["loss/train"] != rows[2]["loss/train"]  # NaN logged as such (null in metrics.jsonl)
    assert rows[4]["loss/train"] == rows[4]["loss/train"] and rows[4]["optim/grad_norm"] != rows[4]["optim/grad_norm"]
    assert _same(snaps[2], snaps[1]) and _same(snaps[4], snaps[3])  # skipped: weights and optimizer state as before
    assert not _same(snaps[3], snaps[2]) and not _same(snaps[5], snaps[4])  # the next good steps do update
    assert all(bool(torch.isfinite(t.float()).all()) for t in snaps[-1])
    assert result.train_loss == rows[-1]["loss/train"]


def test_too_many_bad_steps_in_a_row_stops_with_a_clear_error_keeping_the_checkpoint(tmp_path):
    err, snaps, rows = _train(tmp_path, {"name": "hmt", "rank_candidates": (8,)}, steps=10, nan_loss={3, 4, 5, 6},
                              max_bad_steps=3, checkpoint_every=2)
    assert isinstance(err, TooManyBadSteps)
    assert "3 consecutive steps with a non-finite loss or gradient (steps 3..5" in str(err)
    assert "step-00000004" in str(err) and len(rows) == 6
    path, manifest, problems = ck.find_latest_good(tmp_path / "ck")
    assert manifest["step"] == 4 and not problems
    _, payload = ck.load_checkpoint(path)
    saved = payload["model"]["params"]
    assert all(bool(torch.isfinite(t.float()).all()) for t in saved.values())


def test_unwritable_checkpoint_dir_is_a_clear_error_before_training(tmp_path):
    from test_runner import run

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit, match="error: checkpoint directory .*file/ck is not writable"):
        run(tmp_path, f"train.checkpoint_dir={blocker}/ck", "train.steps=2", "run_id=u")
    assert not (tmp_path / "u").exists()  # refused during set-up: nothing written


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    ck.save_checkpoint(tmp_path, 2, {"w": torch.zeros(1000)})
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(ck.CheckpointWriteError, match=r"step 4 .*File too large.*step-00000002"):
            ck.save_checkpoint(tmp_path, 4, {"w": torch.zeros(100_000)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]  # no temp directory left behind
    assert ck.verify(tmp_path / "step-00000002")["step"] == 2


class _TinyLM(nn.Module):
    """Embedding + head with the Hugging Face ``labels=`` interface, free of host syncs (a transformers Llama
    builds its attention mask with some, which a ``meta`` tensor cannot answer)."""

    def __init__(self, vocab: int, hidden: int, device: torch.device) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, device=device)
        self.head = nn.Linear(hidden, vocab, device=device)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        logits = self.head(self.embed(input_ids))  # (B, T, V)
        return SimpleNamespace(loss=F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))


class _NoUpdate:
    """A method that updates nothing: the test is about where ``train_step`` keeps the loss, not the update."""

    def start_micro_batch(self, index: int, count: int) -> None: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...


@pytest.mark.parametrize("skip_nonfinite", [False, True], ids=["plain", "skip-nonfinite"])
def test_train_step_keeps_the_loss_on_the_models_device(skip_nonfinite):
    """The step's loss (summed over micro-batches) stays on the device the loss was computed on: a CPU accumulator
    is a same-device error on a GPU and under fake CUDA. The ``meta`` device stands in for the GPU here (it runs on
    any CPU); a CPU accumulator would silently come back as a CPU tensor. With ``skip_nonfinite`` the finiteness of
    the loss is decided on that device too (a ``meta`` tensor has no value: a host read would raise)."""
    meta = torch.device("meta")
    ids = torch.zeros(2, 8, dtype=torch.long, device=meta)
    loss, norm = train_step(_TinyLM(16, 8, meta), _NoUpdate(), [ids, ids], meter=None, fused_ce=False,
                            autocast=contextlib.nullcontext, skip_nonfinite=skip_nonfinite)
    assert loss.device == meta and loss.shape == (), (loss.device, loss.shape)
    assert norm is None, norm  # the method's own answer, passed through
