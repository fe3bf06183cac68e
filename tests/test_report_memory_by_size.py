"""``--memory-results``: the memory-by-model-size table from dry runs (``analysis.memory_by_size``), and the short
setting labels the report's tables use (``analysis.settings.compact_labels``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_analysis import write_fixture_results, write_run

from analysis import report
from analysis.settings import ACTIVATION_PRESETS, compact_labels, setting_of

GIB = 2**30


def dry_run(root: Path, run_id: str, method: str, model: str, peak_gib: float, state_gib: float | None,
            method_keys: dict | None = None, mode: str = "dryrun") -> None:
    run = write_run(root, run_id, method=method, model=model, seed=0, mode=mode, peak_gib=peak_gib, val=None,
                    extra={"method_summary": {} if state_gib is None else {"optim/state_bytes": int(state_gib * GIB)}})
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["method"].update(method_keys or {})
    config["model"].update(hidden_size={"125m": 768, "1b": 2048, "7b": 4096}[model])  # model keys differ by size
    (run / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture
def dry_runs(tmp_path: Path) -> tuple[Path, Path]:
    """Two folders, as two committed sweeps would be: 125m and 7b in one, 1b in the other."""
    first, second = tmp_path / "dry-a", tmp_path / "dry-b"
    for model, base in (("125m", 1.0), ("7b", 40.0)):
        dry_run(first, f"{model}-adamw", "adamw", model, base * 2, base)
        dry_run(first, f"{model}-adamw-8bit", "adamw", model, base * 1.5, base / 2, {"eight_bit": True})
        dry_run(first, f"{model}-hmt", "hmt", model, base * 0.5, None)
    dry_run(second, "1b-adamw", "adamw", "1b", 12.0, 6.0)
    dry_run(second, "1b-hmt", "hmt", "1b", 3.25, 0.125)
    dry_run(second, "1b-hmt-train", "hmt", "1b", 99.0, 99.0, mode="train")  # not a dry run: left out
    return first, second


def table_rows(path: Path) -> list[list[str]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[0:1] + lines[2:]]


def test_memory_by_size_table(dry_runs: tuple[Path, Path], tmp_path: Path) -> None:
    results = write_fixture_results(tmp_path / "results")
    out = tmp_path / "report"
    assert report.main([str(results), "--out", str(out), "--no-figures", "--memory-results", str(dry_runs[0]),
                        "--memory-results", str(dry_runs[1])]) == 0
    rows = table_rows(out / "tables" / "memory_by_size.md")
    assert rows == [["Method", "Setting", "125m", "1b", "7b"],
                    ["adamw", "default", "2.00 (1.00)", "12.00 (6.00)", "80.00 (40.00)"],  # short names
                    ["adamw", "8-bit", "1.50 (0.50)", "—", "60.00 (20.00)"],
                    ["hmt", "", "0.50", "3.25 (0.12)", "20.00"]], rows
    tex = (out / "tables" / "memory_by_size.tex").read_text()
    assert "\\toprule" in tex and "8-bit &" in tex, tex
    assert "\\input{memory_by_size.tex}" in (out / "tables" / "all_tables.tex").read_text()


def test_memory_results_without_dry_runs_is_an_error(tmp_path: Path, capsys) -> None:
    results = write_fixture_results(tmp_path / "results")
    (tmp_path / "empty").mkdir()
    for bad, culprit in ((tmp_path / "empty", "no completed dry run"), (tmp_path / "nope", "no such folder")):
        with pytest.raises(SystemExit) as exited:
            report.main([str(results), "--out", str(tmp_path / "report"), "--memory-results", str(bad)])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith(f"error: --memory-results {bad}: {culprit}"), err
        assert not (tmp_path / "report").exists()


# ---- short setting labels -----------------------------------------------------------------------------------------
HMT = {"method": {"name": "hmt", "lr": 0.01, "mode": "A", "rank": None, "state_dtype": "fp32"},
       "activation": {"attn_qkv": "keep", "attn_core": "keep", "attn_out": "keep", "mlp_intermediate": "keep",
                      "layer_recompute": False, "block_size": 128}, "train": {"max_grad_norm": 1.0}}


def variant(lr: float, **changes: dict) -> dict:
    config = json.loads(json.dumps(HMT))
    config["method"]["lr"] = lr
    for group, values in changes.items():
        config[group].update(values)
    return setting_of(config)


def test_labels_name_only_what_departs_from_the_common_setting() -> None:
    settings = {
        "default": variant(0.01), "act": variant(0.03, activation={"attn_qkv": "recompute", "attn_core": "recompute",
                                                                    "attn_out": "int8", "mlp_intermediate": "int8"}),
        "min": variant(0.03, method={"mode": "B", "rank": 1, "state_dtype": "bf16"},
                       activation={"layer_recompute": True}, train={"max_grad_norm": 0}),
        "bf16": variant(0.01, method={"state_dtype": "bf16"}), "noclip": variant(0.01, train={"max_grad_norm": 0}),
        "fp8": variant(0.01, activation={"attn_out": "fp8"}),  # not a preset: its key is shown
    }
    labels = compact_labels(settings, dict.fromkeys(settings, "g"))
    assert labels == {"default": "base", "act": "activation=hmt", "bf16": "method.state_dtype=bf16",
                      "noclip": "train.max_grad_norm=0", "fp8": "activation.attn_out=fp8",
                      "min": "activation=full_ckpt, method.mode=B, method.rank=1, method.state_dtype=bf16, "
                             "train.max_grad_norm=0"}, labels


def test_learning_rate_shows_only_to_tell_settings_apart() -> None:
    settings = {"a": variant(0.01), "b": variant(0.03), "c": variant(0.01, method={"rank": 8})}
    labels = compact_labels(settings, dict.fromkeys(settings, "g"))
    assert labels == {"a": "base", "b": "method.lr=0.03", "c": "method.rank=8"}, labels
    tie = {"a": variant(0.01), "b": variant(0.03)}  # no common value: both show it
    assert compact_labels(tie, dict.fromkeys(tie, "g")) == {"a": "method.lr=0.01", "b": "method.lr=0.03"}
    one = {"a": variant(0.01), "b": variant(0.01)}
    assert compact_labels(one, dict.fromkeys(one, "g")) == {"a": "", "b": ""}


def test_activation_presets_match_hmt_core() -> None:
    import dataclasses

    from hmt_core.activations.policy import PRESETS
    from analysis.settings import ACTIVATION_NONE_VALUE, render_value

    none = dataclasses.asdict(PRESETS["none"])
    derived = {name: {k: render_value(v) for k, v in dataclasses.asdict(policy).items() if v != none[k]}
               for name, policy in PRESETS.items() if name != "none"}
    assert derived == ACTIVATION_PRESETS, derived
    assert {k: render_value(v) for k, v in none.items() if k in ACTIVATION_NONE_VALUE} == ACTIVATION_NONE_VALUE
    components = {k for keys in ACTIVATION_PRESETS.values() for k in keys if k not in ACTIVATION_NONE_VALUE}
    assert all(none[k] == "keep" for k in components), none
