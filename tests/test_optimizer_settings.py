"""``hmt_core.hmt_config.optimizer_settings``: the typed settings ``LowRankOptimizer`` reads carry, under the same
names, the values of the method's Config (docs/design/optimizer.md)."""

from dataclasses import fields

from hmt_core import hmt
from hmt_core.hmt_config import optimizer_settings


def test_every_setting_is_the_config_key_of_its_name():
    # every key off its default and distinct from the others of its type, so a swapped or defaulted field shows
    cfg = hmt.Config(mode="B", lr=0.003, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.1, adam_style="hf",
                     scale=2.0, scaling="tensor", norm_limiter=False, limiter_gamma=1.5, sides="two_sided",
                     basis="random", tau=0.9, rank_fallback="full", random_rank="spectrum", power_iters=3,
                     oversample=5, state_budget="0.25", update_interval=7, moment_policy="reset", state_dtype="bf16",
                     dense_state_dtype="fp32", stochastic_rounding=True, kernels="torch", seed=11)
    settings = optimizer_settings(cfg)
    groups = (settings.rule, settings.projection, settings.schedule, settings.precision)
    wrong = [(type(g).__name__, f.name, getattr(g, f.name), getattr(cfg, f.name))
             for g in groups for f in fields(g) if getattr(g, f.name) != getattr(cfg, f.name)]
    assert not wrong, f"(group, key, setting, config): {wrong}"
    assert settings.seed == cfg.seed
    read = {f.name for g in groups for f in fields(g)}
    assert len(read) == sum(len(fields(g)) for g in groups), "a key appears in two groups"
