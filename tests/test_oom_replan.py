"""``train.on_oom=replan`` end to end on CPU: the memory meter's cap (``train.memory_cap_gib``) raises
``torch.OutOfMemoryError`` like a smaller GPU would; the run asks the planner for the next plan
(``experiments.planner.oom``; ``method=hmt``, tests at the end of this file) or, where the planner cannot answer
(``method=adamw``), steps down the fixed ladder (``experiments.replan``), resumes from its last checkpoint and
completes with every step logged once; without enough steps down it fails in one line, keeping its checkpoints
and metrics.

The caps are not hard-coded figures: reference runs measure the per-step peaks of the plans (and the planner's
predictions), and each cap is put between them so that the first plan fails at step 0, the second at step 1
(after its step-0 checkpoint) and the third fits."""

from __future__ import annotations

import gc
import math
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from test_runner import CONF, MICRO

from transformers import PreTrainedModel

from experiments import replan
from experiments.planner import oom
from experiments.config import to_run_config
from experiments.replan import apply_overrides, ladder_plan
from experiments.results import read_metrics, read_recorded_config, read_status
from experiments.execute import main_with_config
from experiments.checkpoint import store as ck
from experiments.planner.cache import USER_DIR
from experiments.memory.gpu_allowance import outside_allocator_bytes, reserve_bytes

GIB = 2**30
# adamw on a 2-layer model, fp32 (no autocast) so that a different micro-batch split only reorders fp32 sums;
# a checkpoint after every step, all kept
BASE = [*MICRO, "method=adamw", "train.steps=4", "train.batch_size=8", "train.warmup_steps=0", "train.eval_every=2",
        "train.autocast=false", "train.checkpoint_every=1", "train.keep_checkpoints=0"]
RECOMPUTE = ["activation.layer_recompute=true"]
HALVED = [*RECOMPUTE, "train.batch_size=4", "train.grad_accum=2", "train.eval_batches=4"]


def run(results: Path, run_id: str, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("run", overrides=[f"results_dir={results}", f"run_id={run_id}", *BASE, *overrides])
    return main_with_config(cfg)


def step_peaks(results: Path, run_id: str) -> list[int]:
    """The meter's running peak after each step (bytes): the peak of step k where it rises."""
    return [round(r["memory/peak(GiB)"] * GIB) for r in read_metrics(results / run_id)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """Peaks of the three plans on the ladder, the loss curve of the plan as given (no cap), and the cap."""
    results = tmp_path_factory.mktemp("reference")
    run(results, "given")
    run(results, "recompute", "train.steps=2", *RECOMPUTE)
    run(results, "halved", "train.steps=2", *HALVED)
    given, recompute, halved = (step_peaks(results, r) for r in ("given", "recompute", "halved"))
    cap = (recompute[0] + recompute[1]) // 2
    # the ladder must be able to force two steps down: plan 1 over the cap at step 0, plan 2 under it at step 0
    # (its optimizer state does not exist yet) and over it at step 1, plan 3 under it from step 1 on
    assert given[0] > cap > recompute[0] and recompute[1] > cap > max(halved), (given, recompute, halved, cap)
    return {"cap_gib": cap / GIB, "losses": [r["loss/train"] for r in read_metrics(results / "given")],
            "peaks": (given, recompute, halved)}


def test_cap_forces_two_steps_down_and_the_loss_curve_continues(tmp_path, capsys, measured, monkeypatch) -> None:
    def models_alive() -> int:
        gc.collect()  # what only cycles hold is freed (as _release does)
        return sum(issubclass(type(o), PreTrainedModel) for o in gc.get_objects())  # type(): no proxy warnings

    before, alive_at_release = models_alive(), []  # a failed attempt's model left alive would hold its GPU memory

    def release(device, original=replan._release) -> None:
        original(device)
        alive_at_release.append(models_alive())

    monkeypatch.setattr(replan, "_release", release)
    summary = run(tmp_path, "oom", f"train.memory_cap_gib={measured['cap_gib']!r}", "train.on_oom=replan")
    assert alive_at_release == [before, before], (alive_at_release, before)
    err = capsys.readouterr().err
    print(err, measured["peaks"])
    replans = summary["replans"]
    assert [r["overrides"] for r in replans] == [
        {"activation.layer_recompute": True},
        {"train.batch_size": 4, "train.grad_accum": 2, "train.eval_batches": 4}], replans
    assert [r["resumed_step"] for r in replans] == [0, 1], replans  # no checkpoint yet, then the step-0 one
    assert all(r["peak_bytes"] > r["limit_bytes"] for r in replans), replans
    lines = [line for line in err.splitlines() if line.startswith("out of memory") and "replan " in line]
    assert len(lines) == 2 and all("ladder, as the planner cannot answer: the planner plans method=hmt only" in line
                                   for line in lines), err
    assert [r["source"] for r in replans] == ["ladder", "ladder"], replans
    run_dir = tmp_path / "oom"
    assert read_status(run_dir) == "completed"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3], rows  # every step once, counted on from the checkpoint
    # same sequences per step, fp32: the micro-batch split only reorders sums of 8 losses and of the gradients
    # (relative rounding ~1e-7 per add, a few steps of AdamW amplify it far less than 1e-4)
    for row, want in zip(rows, measured["losses"]):
        assert math.isclose(row["loss/train"], want, rel_tol=1e-4), (row["step"], row["loss/train"], want)
    # the checkpoint written before the second OOM is kept; later ones record the replanned settings
    steps = {step: path for step, path in ck.list_checkpoints(run_dir / "checkpoints")}
    assert sorted(steps) == [1, 2, 3, 4], steps
    assert ck.verify(steps[1])["meta"]["replan"] == {"activation.layer_recompute": True}
    assert ck.verify(steps[4])["meta"]["replan"]["train.batch_size"] == 4
    recorded = read_recorded_config(run_dir)  # the configuration as given: run id and resume check unchanged
    assert recorded["train"]["batch_size"] == 8 and recorded["activation"]["layer_recompute"] is False, recorded


def test_too_few_steps_down_fail_in_one_line_keeping_what_was_written(tmp_path, capsys, measured) -> None:
    command = (f"train.memory_cap_gib={measured['cap_gib']!r}", "train.on_oom=replan", "train.max_replans=1")
    with pytest.raises(SystemExit) as exc:
        run(tmp_path, "oom", *command)
    assert exc.value.code == 1, exc.value.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "out of memory" in lines[0] and "train.max_replans=1" in lines[0], err
    assert "Traceback" not in err, err
    run_dir = tmp_path / "oom"
    assert read_status(run_dir) == "failed"
    assert [r["step"] for r in read_metrics(run_dir)] == [0], read_metrics(run_dir)
    assert [step for step, _ in ck.list_checkpoints(run_dir / "checkpoints")] == [1]
    # the same command again resumes at step 1 on the plan its checkpoint records (layer recomputation), so its
    # one step down is the micro-batch, and it completes; from the plan as given it would need two again
    summary = run(tmp_path, "oom", *command)
    err = capsys.readouterr().err
    assert "resuming with the checkpoint's replanned settings: activation.layer_recompute=true" in err, err
    assert [r["overrides"] for r in summary["replans"]] == [
        {"train.batch_size": 4, "train.grad_accum": 2, "train.eval_batches": 4}], summary["replans"]
    assert read_status(run_dir) == "completed"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3], rows
    for row, want in zip(rows, measured["losses"]):  # tolerance: see the test above
        assert math.isclose(row["loss/train"], want, rel_tol=1e-4), (row["step"], row["loss/train"], want)


def test_on_oom_fail_ends_in_one_line(tmp_path, capsys, measured) -> None:
    with pytest.raises(SystemExit) as exc:
        run(tmp_path, "oom", f"train.memory_cap_gib={measured['cap_gib']!r}")
    assert exc.value.code == 1, exc.value.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "memory cap exceeded" in lines[0] and "train.on_oom=replan" in lines[0], err
    assert read_status(tmp_path / "oom") == "failed"


def test_ladder_keeps_the_sequences_per_step() -> None:
    with initialize_config_dir(config_dir=CONF, version_base=None):
        run_cfg = to_run_config(compose("run", overrides=[*BASE, "train.batch_size=6", "activation=hmt"]))
    seen = []
    while (rung := ladder_plan(run_cfg)) is not None:
        run_cfg = apply_overrides(run_cfg, rung.overrides)
        seen.append((run_cfg.activation.layer_recompute, run_cfg.train.batch_size, run_cfg.train.grad_accum,
                     run_cfg.train.eval_batches))
    # recomputation first (the hmt preset's codecs give way to it), then the micro-batch by its largest divisor
    assert seen == [(True, 6, 1, 2), (True, 3, 2, 4), (True, 1, 6, 12)], seen
    assert run_cfg.activation.attn_out == "keep" and run_cfg.activation.mlp_intermediate == "keep"


def test_replan_under_torchrun_is_refused(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        run(tmp_path, "x", "train.on_oom=replan", "dist=ddp")
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] and "dist=none" in err, err


# ---- the planner's next plan (method=hmt) ------------------------------------------------------------------------
# Mode A at a quarter of AdamW's state: one of the planner's options (the default budget "galore" is not)
HMT = ["method=hmt", "method.state_budget=0.25"]
COSTS = Path(__file__).resolve().parent / "data" / "oom_plan_costs"  # the tiny model's planner cost table


def hmt_run_config(results: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_run_config(compose("run", overrides=[f"results_dir={results}", *BASE, *HMT, *overrides]))


def as_hydra(overrides: dict) -> list[str]:
    return [f"{k}={replan._show(v)}" for k, v in overrides.items()]


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict:
    """The plan as given (loss curve, peaks), the planner's first answer ``first`` under the plan as given's step-0
    peak (full layer recomputation at micro-batch 8: its forward phase is the peak), and a cap just above that
    answer's predicted peak plus the margin: the planner chooses ``first`` under it, which fits step 0 (no optimizer
    state yet) and runs over at step 1, so a second step down is forced. The results folder is shared; its planner
    cost cache (``plan_costs/``) starts from ``COSTS`` (the tiny model's traces, taken by ``python -m
    experiments.planner.plan``'s tracer; a stale file is ignored and traced again, about a minute)."""
    results = tmp_path_factory.mktemp("planned")
    (results / USER_DIR).mkdir()
    for table in COSTS.glob("*.json"):
        shutil.copy(table, results / USER_DIR / table.name)
    run(results, "given", *HMT)
    given = step_peaks(results, "given")
    first = oom.next_plan(hmt_run_config(results), peak_bytes=given[0], limit_bytes=given[0], device_type="cpu")
    run(results, "first", "train.steps=2", *HMT, *as_hydra(first.overrides))
    first_peaks = step_peaks(results, "first")
    cap = math.ceil(first.predicted_bytes / (1 - oom.MARGIN)) + 16  # bytes: over int() rounding of budget and cap
    # the plan as given runs over the cap; the planner's answer fits step 0 (its model now predicts this plan within
    # the margin, so the run may finish after one step down; the ladder tests above force two)
    assert given[0] > cap > first_peaks[0], (given, first_peaks, cap, first)
    return {"results": results, "cap_gib": cap / GIB, "first": first, "given": given, "first_peaks": first_peaks,
            "losses": [r["loss/train"] for r in read_metrics(results / "given")]}


def test_planner_steps_down_and_its_choices_are_used(capsys, planned) -> None:
    results = planned["results"]
    summary = run(results, "planned-oom", *HMT, f"train.memory_cap_gib={planned['cap_gib']!r}",
                  "train.on_oom=replan")
    err = capsys.readouterr().err
    print(err, planned["given"], planned["first_peaks"], planned["first"])
    replans = summary["replans"]
    assert len(replans) >= 1 and all(r["source"] == "planner" for r in replans), replans
    assert replans[0]["overrides"] == planned["first"].overrides, (replans[0], planned["first"])
    # each step down is what the planner answers for the configuration in force and the peak that was measured
    in_force: dict = {}
    for r in replans:
        want = oom.next_plan(apply_overrides(hmt_run_config(results), in_force), peak_bytes=r["peak_bytes"],
                             limit_bytes=r["limit_bytes"], device_type="cpu")
        assert (r["overrides"], r["predicted_bytes"], r["budget_bytes"]) == \
            (want.overrides, want.predicted_bytes, want.budget_bytes), (r, want)
        assert r["peak_bytes"] > r["limit_bytes"] and r["predicted_bytes"] <= r["budget_bytes"], r
        in_force = {**in_force, **r["overrides"]}
    assert all(r["correction_bytes"] > 0 for r in replans[1:]), replans  # a later step learnt the earlier miss
    assert replans[0]["resumed_step"] == 0, replans
    lines = [line for line in err.splitlines() if line.startswith("out of memory") and "replan " in line]
    assert len(lines) == len(replans) and all("(planner: " in line for line in lines), err
    run_dir = results / "planned-oom"
    assert read_status(run_dir) == "completed"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3], rows
    # same sequences per step; the micro-batch split reorders the sums into the model's bf16 gradients (2^-8
    # relative rounding per element), which moves the loss by a few 1e-4 relative after two updates (measured 5.4e-4
    # at step 2); 2e-3 is a few times that and still ~1/10 of one step's loss change (~0.05 of ~6), so a lost,
    # repeated or reordered step fails
    for row, want in zip(rows, planned["losses"]):
        assert math.isclose(row["loss/train"], want, rel_tol=2e-3), (row["step"], row["loss/train"], want)


def test_planner_with_nothing_left_fails_in_one_line(tmp_path, capsys, planned) -> None:
    cap = planned["first_peaks"][0] // 4  # bytes: below a quarter of what the leanest plan tried needs at step 0
    with pytest.raises(SystemExit) as exc:
        run(planned["results"], "too-small", *HMT, f"train.memory_cap_gib={cap / GIB!r}", "train.on_oom=replan")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "out of memory" in lines[0], err
    assert "Traceback" not in err, err
    assert read_status(planned["results"] / "too-small") == "failed"


def test_planner_refuses_what_it_cannot_plan() -> None:
    """The ladder is taken for a method or setting outside the planner's choices (the reason is in the line)."""
    with initialize_config_dir(config_dir=CONF, version_base=None):
        galore = to_run_config(compose("run", overrides=[*BASE, "method=hmt"]))
        adamw = to_run_config(compose("run", overrides=BASE))
    for cfg, why in ((galore, "method.state_budget=galore"), (adamw, "method=hmt only")):
        with pytest.raises(oom.Unanswered, match=why):
            oom.current_choice(cfg)
        rung, _ = replan.next_plan(cfg, peak_bytes=GIB, limit_bytes=GIB, device_type="cpu")
        assert rung.record["source"] == "ladder" and rung.overrides == ladder_plan(cfg).overrides, rung


def test_planner_answers_for_int8_weights_and_a_projected_head(planned) -> None:
    """INT8 weights' cost is measured against the head-dense sample of the same state budget; the resumable space
    (the head projected as in the run) must still trace it, or the step down fails on a missing cost sample."""
    cfg = hmt_run_config(planned["results"], "method.weight_dtype=int8",
                         "method.target_patterns=[attn,mlp,lm_head]", "activation.layer_recompute=true")
    peak = planned["given"][0]
    answer = oom.next_plan(cfg, peak_bytes=peak, limit_bytes=peak, device_type="cpu")
    assert answer.predicted_bytes <= answer.budget_bytes < peak, answer
    assert answer.overrides, answer  # a step down: a smaller micro-batch or more recomputation


def test_a_cuda_memory_fraction_is_the_limit_with_the_allowance_outside_the_allocator() -> None:
    """Under ``set_per_process_memory_fraction`` the allocator's cap is what the step must fit: the planner takes the
    whole GPU allowance off the limit, so the limit adds back the part the allocator never holds (context,
    libraries), and the step is held to the cap less the workspaces the allocator does hold."""
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = to_run_config(compose("run", overrides=[*BASE, *HMT]))
    total = 80 * GIB
    outside, reserve = outside_allocator_bytes(cfg), reserve_bytes(cfg)
    assert 0 < outside < reserve, (outside, reserve)  # modeled: the cuBLAS workspaces are allocator bytes
    assert replan.cuda_limit_bytes(cfg, total, 1.0) == total
    limit = replan.cuda_limit_bytes(cfg, total, 0.25)
    assert limit == 20 * GIB + outside, (limit, outside)
    budget = oom.step_budget_bytes(cfg, peak_bytes=None, limit_bytes=limit, device_type="cuda")
    assert budget == int((20 * GIB - (reserve - outside)) * (1 - oom.MARGIN)), (budget, reserve, outside)
    assert replan.cuda_limit_bytes(cfg, total, 0.999999) == total  # never above the device
