"""Default run ids are stable: an option added later (``experiments.config.ADDED_WITH_DEFAULT``) does not rename
existing runs at its default, nor make their checkpoints refuse to resume; another value is another run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf

from experiments.checkpoint.manager import config_differences
from experiments.config import register_configs, to_plain_dict, to_run_config
from experiments.runs import default_run_id, run_id_of

CAMPAIGN = Path(__file__).resolve().parent.parent / "results" / "campaign"


def _recorded(d: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(d / "config.yaml"))


def _recorded_runs() -> list[Path]:
    return sorted(p for p in CAMPAIGN.iterdir() if (p / "config.yaml").exists())


def test_every_committed_campaign_run_recomputes_its_own_id():
    """From the configuration each run recorded (fine-tuning runs name a base model that is not committed, so the
    recorded dicts are hashed as they are, not rebuilt into a validated RunConfig)."""
    runs = _recorded_runs()
    assert len(runs) >= 40, runs
    wrong = {d.name: run_id_of(_recorded(d)) for d in runs if run_id_of(_recorded(d)) != d.name}
    assert not wrong, f"{len(wrong)} of {len(runs)} committed runs would be renamed: {wrong}"


def test_an_added_option_changes_the_id_and_the_resume_check_only_away_from_its_default():
    register_configs()
    # a pretraining run recorded before dist.refresh existed (runs added since, e.g. Adafactor's, record it)
    d = next(p for p in _recorded_runs()
             if not _recorded(p)["model"].get("path") and "refresh" not in _recorded(p)["dist"])
    recorded = _recorded(d)
    run = to_run_config(OmegaConf.load(d / "config.yaml"))
    assert run.dist.refresh == "gather"
    assert default_run_id(run) == run_id_of(recorded) == d.name
    assert config_differences(recorded, to_plain_dict(run)) == []
    sketch = replace(run, dist=replace(run.dist, refresh="sketch"))
    assert default_run_id(sketch) != d.name
    assert config_differences(recorded, to_plain_dict(sketch)) == ["dist.refresh: '(unset)' -> 'sketch'"]


def test_a_sweep_finds_a_run_recorded_under_the_id_it_had_before_a_key_was_added(tmp_path):
    """A run folder named by an earlier id (hashed while a key, since added with its default, was still hashed)
    is found by the id its recorded configuration has today; a different configuration under the same prefix is
    not."""
    import yaml

    from experiments.sweeps.sweep import compose_run_config, run_ref_for, validated_run_config

    job = ["mode=train", "model=tiny", "method=hmt", "seed=1", f"results_dir={tmp_path}"]
    config = to_plain_dict(validated_run_config(compose_run_config(job)))
    today = run_id_of(config)
    assert run_ref_for(job).run_id == today  # nothing recorded: today's id
    other = tmp_path / (today.rsplit("-", 1)[0] + "-00000000")  # the same prefix, another learning rate
    other.mkdir()
    (other / "config.yaml").write_text(yaml.safe_dump({**config, "method": {**config["method"], "lr": 0.5}}))
    assert run_ref_for(job).run_id == today
    earlier = tmp_path / (today.rsplit("-", 1)[0] + "-7b248476")
    earlier.mkdir()
    (earlier / "config.yaml").write_text(yaml.safe_dump(config))
    assert run_ref_for(job).run_id == earlier.name
    (tmp_path / today).mkdir()  # a folder under today's id wins
    assert run_ref_for(job).run_id == today
