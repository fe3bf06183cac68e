"""``train.deterministic``: how ``auto|true|false`` resolves per device, what switching it on for CUDA sets
(``CUBLAS_WORKSPACE_CONFIG``, without a GPU: ``torch.device("cuda")`` is only a name here), how the Hydra override
is read, and that at its default it leaves committed run ids alone (``ADDED_WITH_DEFAULT``)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.config import TrainConfig, register_configs, to_plain_dict, to_run_config
from experiments.runs import default_run_id, run_id_of
from experiments.train import deterministic_algorithms, set_deterministic
from test_bad_inputs import assert_one_line_error, results  # noqa: F401  (the fixture: an earlier run)

CONF = str(Path(__file__).resolve().parent.parent / "experiments" / "conf")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def restore_determinism(monkeypatch):
    """Whatever a test switches, the process's deterministic mode and environment are as before afterwards."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("setting, device, on", [
    ("auto", CPU, True), ("auto", CUDA, False),  # auto: what CPU runs always did; off where it costs on a GPU
    ("true", CPU, True), ("true", CUDA, True), ("false", CPU, False), ("false", CUDA, False),
])
def test_the_setting_resolves_per_device(setting, device, on):
    assert deterministic_algorithms(setting, device) is on


@pytest.mark.parametrize("setting, device, on, cublas", [
    ("auto", CPU, True, None), ("true", CUDA, True, ":4096:8"), ("auto", CUDA, False, None),
    ("false", CPU, False, None),
])
def test_switching_it_sets_torch_and_cublas(restore_determinism, setting, device, on, cublas):
    set_deterministic(setting, device)
    assert torch.are_deterministic_algorithms_enabled() is on
    assert not on or torch.is_deterministic_algorithms_warn_only_enabled()  # ops without one warn, never fail
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == cublas


def test_a_workspace_config_the_user_set_is_kept(restore_determinism, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    set_deterministic("true", CUDA)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def _train(*overrides: str) -> TrainConfig:
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_run_config(compose("run", overrides=["method=adamw", "model=tiny", *overrides])).train


def test_the_override_is_read_in_any_case_and_the_default_keeps_the_run_id():
    assert _train().deterministic == "auto"
    assert _train("train.deterministic=true").deterministic == "true"  # Hydra hands it over as "True"
    assert _train("train.deterministic=False").deterministic == "false"
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        run = to_run_config(compose("run", overrides=["method=adamw", "model=tiny"]))
    before = to_plain_dict(run)  # the configuration as recorded before the key existed
    del before["train"]["deterministic"]
    other = replace(run, train=replace(run.train, deterministic="false"))
    assert default_run_id(run) == run_id_of(before) != default_run_id(other), (run_id_of(before), default_run_id(other))


def test_a_bad_value_is_one_line(capsys, results):  # noqa: F811
    assert_one_line_error(capsys, results, ["train.deterministic=sometimes"], "train.deterministic",
                          "auto, true or false", "sometimes")
