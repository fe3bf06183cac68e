"""Hybrid activation memory: per-component keep / recompute / compress of what autograd saves.

Runner entry points::

    handle = apply_policy(model, ActivationPolicy.from_dict(cfg_activation))  # after method.prepare(model)
    handle.metrics()   # per step: act/<component>/saved(bytes), act/total/saved(bytes) of the last forward
    probe(model_without_policy, policy, loss_fn)  # once: + rel_err and grad_cos against keep
    handle.remove()
"""

from hmt_core.activations.apply import ActivationHandle, apply_policy
from hmt_core.activations.probe import probe
from hmt_core.activations.policy import ACTIONS, COMPONENTS, PRESETS, ActivationPolicy

__all__ = ["ACTIONS", "COMPONENTS", "PRESETS", "ActivationHandle", "ActivationPolicy", "apply_policy", "probe"]
