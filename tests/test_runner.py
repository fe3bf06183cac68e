"""The Hydra runner end to end on a micro model: results files, bad input, skip/force, determinism, QLoRA."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.results import read_metrics
from experiments.execute import main_with_config

CONF = str(Path(__file__).resolve().parent.parent / "experiments" / "conf")
MICRO = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=176",
         "model.vocab_size=512", "train.seq_len=64", "train.batch_size=4", "train.eval_batches=2",
         "train.progress=false", "train.log_every=1"]


def run(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("run", overrides=[f"results_dir={tmp_path}", *MICRO, *overrides])
    return main_with_config(cfg)


def test_adamw_writes_results_and_loss_falls(tmp_path):
    summary = run(tmp_path, "method=adamw", "train.steps=40", "train.warmup_steps=5", "train.eval_every=20",
                  "method.lr=3e-3", "run_id=a")
    d = tmp_path / "a"
    assert (d / "status").read_text().strip() == "completed"
    assert json.loads((d / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (d / "config.yaml").read_text().startswith("method:")
    rows = read_metrics(d)
    assert [r["step"] for r in rows] == list(range(40))
    first, last = rows[0]["loss/train"], sum(r["loss/train"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)
    for key in ("run_id", "method", "model", "mode", "device", "params_total", "params_trainable", "steps", "tokens",
                "tokens_per_s", "step_time_s", "train_loss", "val_loss", "cpu_rss_peak_bytes", "host_device_bytes",
                "git_sha", "versions"):
        assert key in summary, key
    mem = summary["memory"]
    assert set(mem["peak_by_category_bytes"]) == {"params", "grads", "optimizer", "activations", "temp", "other"}
    assert mem["source"] == "tracker" and mem["peak_bytes"] >= sum(mem["peak_by_category_bytes"].values()) > 0
    # bf16 weights, bf16 Adam moments (torch keeps moments in the parameter dtype), plus one step tensor each
    n = summary["params_trainable"]
    assert mem["peak_by_category_bytes"]["params"] == 2 * n
    n_tensors = 2 + 2 * 9 + 1  # embed + lm_head, 9 per layer (7 linears + 2 norms), final norm
    assert mem["peak_by_category_bytes"]["optimizer"] == 2 * 2 * n + 4 * n_tensors
    assert summary["host_device_bytes"] == 0 and summary["val_loss"] is not None


def test_same_seed_same_trajectory(tmp_path):
    a = run(tmp_path, "train.steps=4", "run_id=x")
    b = run(tmp_path, "train.steps=4", "run_id=y")
    assert [r["loss/train"] for r in read_metrics(tmp_path / "x")] == [r["loss/train"] for r in read_metrics(tmp_path / "y")]
    assert a["memory"]["peak_by_category_bytes"] == b["memory"]["peak_by_category_bytes"]


def test_completed_run_is_skipped_unless_forced(tmp_path):
    assert run(tmp_path, "train.steps=2") is not None
    assert run(tmp_path, "train.steps=2") is None
    assert run(tmp_path, "train.steps=2", "force=true") is not None


def test_qlora_trains_adapters_only_with_far_less_optimizer_state(tmp_path):
    full = run(tmp_path, "method=adamw", "train.steps=3")
    q = run(tmp_path, "method=qlora", "method.lora_r=4", "train.steps=20", "method.lr=3e-3", "train.warmup_steps=2")
    assert q["params_total"] == full["params_total"] + q["params_trainable"]  # base (4-bit, frozen) + adapters
    assert q["params_trainable"] < 0.25 * full["params_trainable"]
    assert q["memory"]["peak_by_category_bytes"]["optimizer"] < 0.5 * full["memory"]["peak_by_category_bytes"]["optimizer"]
    rows = read_metrics(tmp_path / q["run_id"])
    assert rows[-1]["loss/train"] < rows[0]["loss/train"]


@pytest.mark.parametrize("override, message", [
    ("train.steps=0", "train.steps must be > 0"),
    ("train.seq_len=-1", "train.seq_len must be > 0"),
    ("method.lr=0", "method.lr must be > 0"),
    ("data.path=/nonexistent/corpus", "data.path does not exist"),
])
def test_bad_values_fail_before_anything_is_written(tmp_path, override, message):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit, match=message):
        run(tmp_path, override)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert (tmp_path / "old" / "summary.json").read_text() == "{}"


def test_unwritable_results_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit, match="results_dir=.* is not writable"):
        run(blocker / "sub")
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("args, message", [
    (["method=nosuch"], "method"),
    (["model=nosuch"], "model"),
    (["train.stepz=3"], "stepz"),
    (["train.steps=abc"], "train.steps"),
])
def test_cli_rejects_unknown_names_and_bad_types(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "experiments.run", f"results_dir={tmp_path}", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_mirror_lives_inside_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = run(tmp_path, "method=adamw", "train.steps=2", "wandb.mode=offline", "run_id=w")
    runs = list((tmp_path / "w" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), runs
    assert (tmp_path / "w" / "status").read_text().strip() == "completed" and summary["steps"] == 2
