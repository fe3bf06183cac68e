"""Model cards (``model=<card>``, experiments/model_cards): each card builds with transformers to the parameter
count its shapes give, a 2-layer cut of each traces in a dry run for every method with exactly that many parameter
bytes, a full card runs through the CLI's dry run under its own name, shape overrides of a card are refused, and a
``model.path`` run is named after its config and counted as pretraining unless weights were loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from analysis.load import run_row
from analysis.rundirs import RunFiles
from experiments import methods
from experiments.config import register_configs, to_run_config
from experiments.dryrun import trace_steps
from experiments.model_cards import card_config, card_dir, card_names, card_params, docs_block, render_cards
from experiments.models import architecture_name, build_model, load_hf_config, with_config_name
from experiments.planner.capacity import load_results, readme_block, render_table
from experiments.planner.costs import layer_variants
from experiments.execute import main_with_config

ROOT = Path(__file__).resolve().parent.parent
CONF = str(ROOT / "experiments" / "conf")
CARDS = card_names()
METHODS = {"adamw": ["method=adamw"], "adamw8bit": ["method=adamw", "method.eight_bit=true"],
           "galore": ["method=galore"], "apollo": ["method=apollo"], "hmt": ["method=hmt"]}
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
        "gemma2": "Gemma2ForCausalLM"}


def compose_run(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_run_config(compose(config_name="run", overrides=list(overrides)))


def test_the_published_cards_are_there_and_cite_their_repository():
    assert len(CARDS) == 10, CARDS
    for card in CARDS:
        repo = card_config(card)["_name_or_path"]
        assert repo.split("/")[0] in ("meta-llama", "Qwen", "mistralai", "google"), (card, repo)


@pytest.mark.parametrize("card", CARDS)
def test_card_builds_with_transformers_to_its_shape_count(card):
    """transformers builds the card (on the meta device: shapes, no memory) as its own architecture, with the
    parameters ``card_params`` counts from the shapes (an independent count: one formula vs the library's modules;
    tied heads are one tensor, counted once)."""
    config = load_hf_config(card_dir(card))
    assert architecture_name(config) == ARCH[config.model_type], (card, architecture_name(config))
    with torch.device("meta"):
        model = build_model(compose_run(f"model={card}").model, device="meta")
    counted = sum(p.numel() for p in model.parameters())
    assert counted == card_params(card_config(card)), (card, counted, card_params(card_config(card)))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("card", CARDS)
def test_two_layer_cut_of_each_card_traces_with_its_parameter_bytes(card, method):
    """A dry-run step of the card cut to 2 decoder layers (full width and vocabulary, as the planner's small
    traces): its bf16 parameters hold exactly 2 bytes per parameter the card's shapes give (integers: no
    tolerance), and the step has a backward and optimizer peak."""
    run = compose_run(f"model={card}", *METHODS[method], "mode=dryrun", "train.seq_len=32", "train.batch_size=1",
                      "dryrun.steps=1")
    with layer_variants(run) as with_layers:
        cut = with_layers(2)
        traced = trace_steps(cut, methods.make_method(cut.method))
    report = traced["report"]
    params_bytes = int(report.current_by_category_bytes["params"])
    expected = 2 * card_params(card_config(card), layers=2)
    assert params_bytes == expected, f"{card} {method}: params {params_bytes:,} B, shapes give {expected:,} B"
    assert report.peak_by_phase_bytes["backward"] > params_bytes, report.peak_by_phase_bytes


def test_a_card_runs_through_the_cli_dry_run_under_its_name(tmp_path):
    """``python -m experiments.run mode=dryrun model=llama3.2-1b``: the full card, its run id and summary carry the
    card's name, built from its config (random init), with the parameters its shapes give."""
    cmd = [sys.executable, "-m", "experiments.run", "mode=dryrun", "model=llama3.2-1b", "method=adamw",
           "train.seq_len=64", "train.batch_size=1", f"results_dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("adamw-llama3.2-1b-dryrun-s0-"), run_dir.name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["model"], summary["model_source"]) == ("llama3.2-1b", "config"), summary["model"]
    assert summary["params_total"] == card_params(card_config("llama3.2-1b")), summary["params_total"]


@pytest.mark.parametrize("override, culprit", [
    ("model.num_layers=2", "model.num_layers=2 differs from card llama3.1-8b's num_hidden_layers=32"),
    ("model.path=experiments/model_cards/qwen2.5-7b", "both name the model"),
    ("model.card=llama9-1t", "'llama9-1t' is not a model card"),
])
def test_a_card_shape_override_is_refused_naming_the_key(override, culprit):
    """A card's shape is its config.json: overriding one of its fields would be silently ignored. The
    ValueError is what the runner prints as its one ``error:`` line (``one_line_errors``)."""
    with pytest.raises(ValueError) as e:
        compose_run("mode=dryrun", "model=llama3.1-8b", override)
    assert culprit in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_model_path_run_is_named_after_its_config(tmp_path):
    """``model.path=`` under the default phase (``tiny``) takes the config's architecture and size, in its run id
    and summary; a name given with ``model.name`` and a card's name are kept."""
    folder = tmp_path / "q"
    folder.mkdir()
    config = {**card_config("qwen2.5-0.5b"), "num_hidden_layers": 2}  # 2 layers: a fast dry run
    (folder / "config.json").write_text(json.dumps(config))
    expected = f"qwen2-{round(card_params(config) / 1e6)}m"
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="run", overrides=[f"model.path={folder}", "mode=dryrun", "method=adamw",
                                                    "train.seq_len=32", "train.batch_size=1",
                                                    f"results_dir={tmp_path / 'runs'}"])
    assert to_run_config(cfg).model.name == "tiny"
    summary = main_with_config(cfg)
    assert summary["model"] == expected and summary["run_id"].startswith(f"adamw-{expected}-dryrun-"), summary
    run = compose_run(f"model.path={folder}")
    big = replace(run, model=replace(run.model, path=str(card_dir("llama3.1-8b"))))
    assert with_config_name(big).model.name == "llama-8.0b"  # 8,030,261,248 parameters
    named = compose_run(f"model.path={folder}", "model.name=mine")
    assert with_config_name(named).model.name == "mine"
    card = compose_run("model=gemma2-2b")
    assert with_config_name(card) == card


@pytest.mark.parametrize("source, task", [("config", "pretraining"), ("weights", "fine-tuning")])
def test_a_model_path_run_is_fine_tuning_only_when_weights_were_loaded(tmp_path, source, task):
    files = RunFiles(path=tmp_path, status="completed", config={"model": {"name": "qwen2-494m", "path": "/m"}},
                     summary={"run_id": "r", "method": "adamw", "model": "qwen2-494m", "model_source": source})
    assert run_row(files)["task"] == task


def test_docs_page_tables_are_what_the_cards_and_committed_capacity_results_render():
    """docs/model_cards.md: the cards table renders the committed config.json files, the capacity table the
    committed results/model_cards/capacity/*.json (at least one: the table is measured, not typed)."""
    page = ROOT / "docs" / "model_cards.md"
    assert docs_block(page.read_text(encoding="utf-8")) == render_cards()
    results = load_results(ROOT / "results" / "model_cards" / "capacity")
    assert results and {r["model"] for r in results} <= set(CARDS), [r["model"] for r in results]
    assert readme_block(page) == render_table(results)


def test_capacity_search_resumes_keeping_the_cells_already_measured(tmp_path, monkeypatch):
    """A rerun of ``--capacity`` searches only the (method, GPU size) cells missing from its JSON; a file written
    under another GPU allowance is not reused."""
    from experiments.planner import capacity as plan_capacity
    from experiments.memory.gpu_allowance import reserve_bytes, reserve_label
    from experiments.planner.costs import GIB

    run = compose_run("model=qwen2.5-0.5b", f"results_dir={tmp_path}", "dryrun.gpu_sizes_gib=[16,24]")
    cell = {"fits": True, "tokens": 2048, "batch_size": 1, "seq_len": 2048, "exact": True}
    path = tmp_path / "capacity" / f"qwen2.5-0.5b-s{run.train.seq_len}.json"
    path.parent.mkdir()
    old = {"schema": plan_capacity.SCHEMA, "model": "qwen2.5-0.5b", "seq_len": run.train.seq_len,
           "reserve": reserve_label(run), "reserve_gib": reserve_bytes(run) / GIB, "gpu_sizes_gib": [16, 24],
           "methods": {"adamw": {"settings": "s", "sizes": {"16": cell, "24": cell}},
                       "galore": {"settings": "s", "sizes": {"16": cell}}}}
    path.write_text(json.dumps(old))
    searched = []

    def fake_search(r, sizes, *, log):
        searched.append((r.method.name, tuple(sizes)))
        return {str(s): {**cell, "tokens": 4096, "batch_size": 2} for s in sizes}

    monkeypatch.setattr(plan_capacity, "baseline_capacity", fake_search)
    result = plan_capacity.capacity(run, {"methods": ["adamw", "galore"]}, [], log=lambda _: None)
    assert searched == [("galore", (24,))], searched
    assert json.loads(path.read_text())["methods"] == result["methods"]
    assert result["methods"]["galore"]["sizes"] == {"16": cell, "24": {**cell, "tokens": 4096, "batch_size": 2}}
    assert result["methods"]["adamw"]["sizes"] == {"16": cell, "24": cell}
    path.write_text(json.dumps({**old, "reserve_gib": old["reserve_gib"] + 1}))  # another allowance: all again
    searched.clear()
    plan_capacity.capacity(run, {"methods": ["adamw"]}, [], log=lambda _: None)
    assert searched == [("adamw", (16, 24))], searched
