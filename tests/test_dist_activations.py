"""Activation policies under ``dist=ddp|fsdp2`` (``hmt_core.activations.apply`` on a DDP-wrapped or
``fully_shard``-ed model) on CPU with gloo, two processes.

1. Full activation checkpointing (``activation=full_ckpt``: every decoder layer recomputed from its input in
   backward, non-reentrant ``torch.utils.checkpoint`` inside the layer's ``forward``, FSDP2's hooks outside it)
   gives the same weights after 3 steps as the same run with ``activation=none``: adamw under DDP and FSDP2, hmt
   (per-layer Mode A, basis refreshed at steps 0 and 2) under DDP and FSDP2; ``activation=selective`` (attention
   core recomputed) too for adamw under both and for fsdp2 + hmt; full_ckpt for galore-torch on FSDP2 shards
   (projection refreshed at steps 0 and 2).
2. The policy is in force on every rank and keeps, component by component, the same bytes under FSDP2 as under
   DDP — for the lossy ``activation=hmt`` preset (INT8 codecs) too: FSDP2's all-gathered weights, which a layer
   saves for backward (``F.linear`` saves ``weight.t()``), are recognized as parameters, never counted or encoded.
3. ``mode=dryrun`` under ``dist=fsdp2`` accepts a policy, skips the single-process probe and says why.

Why the tolerance is zero. Recomputation replays the same ops, in the same order, on the same inputs and (under
FSDP2) on the same all-gathered weights, so every recomputed tensor is bit-identical to the one the plain run saved
(CPU kernels are deterministic for equal shapes and strides); the backward graph is the same graph (non-reentrant
checkpointing substitutes the recomputed tensors through saved-tensor hooks), so gradients are accumulated in the
same order and the collectives (DDP buckets, FSDP2 reduce-scatter, HMT's all-reduces) see equal operands. Any
difference is a bug (a recompute on resharded or stale weights shows up at the size of the weights' update, ~lr).
The measured max|a − b| over all tensors is printed (``-s``) and reported on failure.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_distributed import _method, spawn_pair  # noqa: E402

STEPS = 3
HMT = {"name": "hmt", "rank": 8, "update_interval": 2}
CASES = {  # case -> (dist mode, method overrides, policies compared with none)
    "ddp-adamw": ("ddp", {"name": "adamw"}, ("full_ckpt", "selective", "hmt")),
    "fsdp2-adamw": ("fsdp2", {"name": "adamw"}, ("full_ckpt", "selective", "hmt")),
    "ddp-hmt": ("ddp", HMT, ("full_ckpt",)),
    "fsdp2-hmt": ("fsdp2", HMT, ("full_ckpt", "selective")),
    "fsdp2-galore": ("fsdp2", {"name": "galore", "rank": 8, "update_proj_gap": 2}, ("full_ckpt",)),
}
LOSSY = ("hmt",)  # INT8 codecs: compared for saved bytes, not for weights


def _run(ctx, overrides: dict, policy: str, data) -> tuple[dict, dict]:
    """``STEPS`` training steps from tiny_llama(seed=0) with ``policy``: full weights after, saved bytes by
    component of the last forward (empty without a policy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from experiments.dist import parallel as distributed
    from experiments.loop import train_step
    from helpers import tiny_llama
    from hmt_core.activations import apply_policy
    from hmt_core.activations.policy import PRESETS

    model = distributed.shard_model(tiny_llama(seed=0), ctx)
    method = _method(overrides["name"], overrides, model)
    forward = distributed.wrap_for_forward(model, method, ctx)
    handle = apply_policy(model, PRESETS[policy]) if policy != "none" else None
    rows = data[0].shape[0] // ctx.world_size
    for x in data:
        train_step(forward, method, [x[ctx.rank * rows:(ctx.rank + 1) * rows]], meter=None,
                   autocast=contextlib.nullcontext, skip_nonfinite=True)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    saved = handle.saved_bytes() if handle is not None else {}
    return {k: v.detach().clone() for k, v in weights.items()}, saved


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from experiments.dist.parallel import DistContext

    from helpers import join_gloo, seeded_token_batches

    join_gloo(rank, world, port)
    try:
        data = seeded_token_batches(STEPS)
        results = {}
        for case, (mode, overrides, policies) in CASES.items():
            ctx = DistContext(mode=mode, rank=rank, world_size=world, local_rank=rank, backend="gloo",
                              device=torch.device("cpu"))
            plain, _ = _run(ctx, overrides, "none", data)
            for policy in policies:
                got, saved = _run(ctx, overrides, policy, data)
                diffs = {k: float((got[k].double() - v.double()).abs().max()) for k, v in plain.items()}
                moved = max(float((v.double() - w.double()).abs().max())
                            for v, w in zip(plain.values(), _initial().values()))
                results[f"{case}/{policy}"] = {"diffs": diffs, "saved_bytes": saved, "moved": moved}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _initial() -> dict:
    from helpers import tiny_llama

    return tiny_llama(seed=0).state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("dist_activations"))


KEYS = [f"{case}/{policy}" for case, (_, _, policies) in CASES.items() for policy in policies]


@pytest.mark.parametrize("key", [k for k in KEYS if k.split("/")[1] not in LOSSY])
def test_recompute_under_dist_gives_the_weights_of_the_plain_run(runs, key):
    worst = {rank: max(res[key]["diffs"].values()) for rank, res in runs.items()}
    print(f"{key}: max|a-b| over all weights after {STEPS} steps: "
          + ", ".join(f"rank {r} {w:.3e}" for r, w in worst.items()))
    for rank, res in runs.items():
        assert res[key]["moved"] > 1e-4, f"{key}: the weights did not move"
        bad = {k: d for k, d in res[key]["diffs"].items() if d != 0.0}
        table = "\n".join(f"  {k}: max|a-b| {d:.3e}" for k, d in bad.items())
        assert not bad, f"{key}, rank {rank}: weights differ from activation=none:\n{table}"


def test_the_policy_is_in_force_on_every_rank(runs):
    for rank, res in runs.items():
        total = {key: sum(res[key]["saved_bytes"].values()) for key in KEYS}
        assert all(total.values()), (rank, total)
        # full_ckpt keeps only the layer inputs (and what runs outside the layers): less than selective
        assert total["fsdp2-hmt/full_ckpt"] < total["fsdp2-hmt/selective"], total
        for policy in ("full_ckpt", "selective", "hmt"):
            ddp, fsdp = res[f"ddp-adamw/{policy}"], res[f"fsdp2-adamw/{policy}"]
            assert fsdp["saved_bytes"] == ddp["saved_bytes"], (rank, policy, fsdp["saved_bytes"], ddp["saved_bytes"])
        # lossy but bounded: Adam moves each weight by ≤ ~lr per step whatever its gradient, so two runs from the
        # same start differ by at most twice what one moved
        lossy = res["fsdp2-adamw/hmt"]
        assert lossy["moved"] > 1e-4 and 0 < max(lossy["diffs"].values()) < 2 * lossy["moved"], lossy["moved"]


def test_dryrun_under_fsdp2_applies_the_policy_and_skips_the_probe(tmp_path, capsys):
    from hydra import compose, initialize_config_dir

    from experiments.config import register_configs
    from experiments.execute import main_with_config

    register_configs()
    conf = str(Path(__file__).resolve().parent.parent / "experiments" / "conf")
    overrides = ["mode=dryrun", "dist=fsdp2", "dist.world_size=2", "method=hmt", "method.rank=8",
                 "activation=full_ckpt", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
                 "model.intermediate_size=176", "model.vocab_size=512", "train.seq_len=32", "train.batch_size=2",
                 "dryrun.steps=1", f"results_dir={tmp_path}", "run_id=fsdp2-ckpt"]
    with initialize_config_dir(config_dir=conf, version_base=None):
        summary = main_with_config(compose("run", overrides=overrides))
    act = summary["activation_summary"]
    assert act["probe_peak_bytes"] is None and "single-process" in act["probe_skipped"], act
    assert act["saved_bytes"] and act["policy"]["layer_recompute"] is True, act
    assert "activation probe      : skipped" in capsys.readouterr().out
