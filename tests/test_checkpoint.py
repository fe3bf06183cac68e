"""Checkpoint format (manifest, checksums, atomic rename, keep-last-N), damage detection, and in-process resume
exactness for every method: train 4 steps straight vs 2 steps, checkpoint, rebuild everything, 2 more steps
(with a basis refresh at step 2, after the resume, for the projected methods)."""

import contextlib
import json
import random

import numpy as np
import pytest
import torch

from experiments import methods
from experiments.checkpoint.manager import Checkpointer, LoopState, ResumePoint
from experiments.loop import train_step
from experiments.checkpoint import store as ck


def test_save_writes_manifest_with_checksums_and_keeps_last_n(tmp_path):
    for step in (2, 4, 6):
        saved = ck.save_checkpoint(tmp_path, step, {"a": {"x": torch.arange(step)}, "b": [step]},
                                   meta={"note": "hi"}, keep=2)
        assert saved.path == tmp_path / f"step-{step:08d}" and saved.bytes_by_file["a.pt"] > 0
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [6, 4]
    manifest = json.loads((tmp_path / "step-00000006" / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["meta"] == {"note": "hi"}
    for name, info in manifest["files"].items():
        f = tmp_path / "step-00000006" / name
        assert info == {"bytes": f.stat().st_size, "sha256": ck.sha256_file(f)}
    _, payload = ck.load_checkpoint(tmp_path / "step-00000006")
    assert torch.equal(payload["a"]["x"], torch.arange(6)) and payload["b"] == [6]
    # a killed writer's temp directory and a half-pruned old one are invisible and cleaned by the next save
    (tmp_path / ".tmp-step-00000008-999").mkdir()
    (tmp_path / ".trash-step-00000002-999").mkdir()
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [6, 4]
    ck.save_checkpoint(tmp_path, 6, {"a": 1}, keep=0)  # the same step again replaces it whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]
    assert list(ck.load_checkpoint(tmp_path / "step-00000006")[1]) == ["a"]


@pytest.mark.parametrize("damage, message", [
    ("flip", "sha256 .* does not match"),
    ("truncate", "truncated"),
    ("remove_manifest", "incomplete"),
    ("remove_file", "missing file"),
])
def test_damaged_checkpoint_is_detected_and_the_previous_good_one_used(tmp_path, damage, message):
    for step in (2, 4):
        ck.save_checkpoint(tmp_path, step, {"w": torch.full((1000,), float(step))})
    newest = tmp_path / "step-00000004"
    f = newest / "w.pt"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "remove_manifest":
        (newest / "manifest.json").unlink()
    else:
        f.unlink()
    with pytest.raises(ck.CorruptCheckpoint, match=message):
        ck.verify(newest)
    path, manifest, problems = ck.find_latest_good(tmp_path)
    assert path == tmp_path / "step-00000002" and manifest["step"] == 2
    assert len(problems) == 1 and "step-00000004" in problems[0]
    assert torch.equal(ck.load_checkpoint(path)[1]["w"], torch.full((1000,), 2.0))


def test_rng_states_round_trip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = ck.rng_state()
    a = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    ck.set_rng_state(state)
    b = (random.random(), float(np.random.rand()), torch.rand(3))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


# ---------------------------------------------------------------------------------------- resume exactness
METHOD_CONFIGS = {
    "adamw": {"name": "adamw", "lr": 3e-3},
    "hmt_mode_a": {"name": "hmt", "rank_candidates": (8, 16), "update_interval": 2},
    "hmt_mode_b": {"name": "hmt", "mode": "B", "rank_candidates": (8,), "update_interval": 2, "basis": "random"},
    "hmt_ordinary_step": {"name": "hmt", "rank_candidates": (8,), "update_interval": 2, "per_layer": False},
    "hmt_offload": {"name": "hmt", "rank_candidates": (8, 16), "update_interval": 2, "offload_bases": True},
    "galore": {"name": "galore", "rank": 8, "update_proj_gap": 2},
    "apollo": {"name": "apollo", "rank": 8, "update_proj_gap": 2},
}


def _build(tiny_llama_config, raw: dict, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config)
    method = methods.make_method(methods.make_config(dict(raw)))
    model = method.prepare(model)
    method.attach(model, max_grad_norm=1.0)
    return model, method


def _steps(model, method, batches, start, stop, grad_accum):
    out = []
    for step in range(start, stop):
        method.set_lr_scale(0.5 + 0.1 * step)
        micro = batches[step * grad_accum:(step + 1) * grad_accum]
        loss, _ = train_step(model, method, micro, meter=None, autocast=lambda: torch.autocast("cpu", torch.bfloat16),
                             skip_nonfinite=True)
        out.append(float(loss))
        torch.rand(1)  # consume the global RNG, so a resume that forgot the RNG state would diverge below
    return out


@pytest.mark.parametrize("name", list(METHOD_CONFIGS))
def test_resume_in_process_equals_uninterrupted(tmp_path, tiny_llama_config, name):
    torch.manual_seed(123)
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(8)]
    raw = METHOD_CONFIGS[name]
    accum = 2 if name == "hmt_mode_a" else 1  # per-layer low-rank accumulation across micro-batches
    model, method = _build(tiny_llama_config, raw)
    straight = _steps(model, method, batches, 0, 4, accum)
    noise_after = torch.rand(2)

    model, method = _build(tiny_llama_config, raw)
    first = _steps(model, method, batches, 0, 2, accum)
    saver = Checkpointer(tmp_path, every=2, keep=1, model=model, method=method, meta={})
    saved = saver.save(LoopState(next_step=2, last_loss=first[-1]))
    del model, method, saver

    model, method = _build(tiny_llama_config, raw, seed=999)  # different init: everything must come from disk
    torch.manual_seed(999)
    loader = Checkpointer(tmp_path, every=2, keep=1, model=model, method=method, meta={})
    state = loader.restore(ResumePoint(saved.path, ck.verify(saved.path), []), torch.device("cpu"))
    assert state.next_step == 2 and state.last_loss == first[-1]
    second = _steps(model, method, batches, 2, 4, accum)
    assert first + second == straight
    assert torch.equal(torch.rand(2), noise_after)


def test_frozen_weights_are_fingerprinted_not_stored(tmp_path, tiny_llama_config):
    model, method = _build(tiny_llama_config, {"name": "adamw"})
    model.model.embed_tokens.weight.requires_grad_(False)
    model, method = model, methods.make_method(methods.make_config({"name": "adamw"}))
    method.attach(model, max_grad_norm=None)
    saver = Checkpointer(tmp_path, every=1, keep=1, model=model, method=method, meta={})
    saved = saver.save(LoopState(next_step=1))
    _, payload = ck.load_checkpoint(saved.path)
    assert "model.embed_tokens.weight" not in payload["model"]["params"]
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # the rebuilt frozen weights differ from the trained-on ones
    fresh = Checkpointer(tmp_path, every=1, keep=1, model=model, method=method, meta={})
    with pytest.raises(ck.CheckpointError, match="frozen"):
        fresh.restore(ResumePoint(saved.path, ck.verify(saved.path), []), torch.device("cpu"))


def test_memory_meter_does_not_change_numerics(tiny_llama_config):
    """A resumed run meters different steps than an uninterrupted one: metering must be numerically invisible."""
    from experiments.memory.meter import MemoryMeter

    torch.manual_seed(7)
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(3)]
    runs = []
    for metered in (False, True):
        model, method = _build(tiny_llama_config, METHOD_CONFIGS["hmt_mode_a"])
        meter = MemoryMeter()
        meter.watch_grads(model.parameters())
        losses = []
        for ids in batches:
            with meter if metered else contextlib.nullcontext():
                loss, _ = train_step(model, method, [ids], meter=meter if metered else None,
                                     autocast=lambda: torch.autocast("cpu", torch.bfloat16), skip_nonfinite=True)
            losses.append(float(loss))
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
