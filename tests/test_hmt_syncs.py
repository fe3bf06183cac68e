"""HMT's step waits for no device value (``experiments.dispatch_counter``: ``.item()``/``bool``/``float``,
``nonzero``, boolean-mask indexing, tensors built from host data): the non-finite decision is a device flag
(``hmt_core.optim.hooks``), the codecs encode non-finite blocks (``hmt_core.activations.codecs``), the norm comes back
as a device tensor. A non-finite gradient still skips the step: weights and state tensors unchanged, NaN norm, and
after the host reads the flags (a logging step) the run continues exactly as one that never saw the bad batch.

Each test counts one step that is not a basis refresh (``update_interval`` 100: the refresh at step 0 reads the
spectrum on the host by design) after a warm-up step; the site of any sync is printed on failure. The model's own
forward (transformers' packed-sequence check of the position ids, ``masking_utils``) synchronizes once; that one is
not HMT's and is left out (``_hmt_syncs``: sites whose innermost frame outside torch is not transformers').
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import batches, tiny_llama

from experiments.dispatch_counter import DispatchCounter
from hmt_core import hmt
from hmt_core.activations.apply import apply_policy
from hmt_core.activations.policy import PRESETS

CONFIGS = {  # (hmt.Config overrides, max_grad_norm, activation preset)
    "mode_a_clipped": ({}, 1.0, None),  # the default: every update deferred to finish_step
    "mode_a_unclipped": ({}, None, None),  # updates inside backward
    "mode_b_rank1": ({"mode": "B", "rank": 1, "basis": "random", "scaling": "tensor"}, 1.0, None),
    "codecs": ({}, 1.0, "hmt"),  # saved activations compressed (INT8 / INT4-outlier codecs)
    "int8_weights": ({"weight_dtype": "int8"}, 1.0, None),
    "ordinary_step": ({"per_layer": False}, 1.0, None),
    "weight_decay": ({"weight_decay": 0.1}, 1.0, None),  # a skipped step keeps the weight through torch.where
    "two_sided": ({"sides": "two_sided"}, 1.0, None),
    # the embedding's touched rows (hmt_core.sparse_embedding): sort + segment sums + index_copy_, no unique()
    "rows_lazy_exact": ({"embedding_update": "lazy_exact", "weight_decay": 0.1}, 1.0, None),
    "rows_sparse_adam_unclipped": ({"embedding_update": "sparse_adam"}, None, None),
    # the INT8 embedding's touched rows: dequantize, catch up, step, stochastic-round requantize (8-bit row moments
    # come with dense_8bit, whose bitsandbytes norms read the skip flag on the host: tests/test_int8_row_embedding.py)
    "rows_int8_lazy_exact": ({"embedding_dtype": "int8", "embedding_update": "lazy_exact", "weight_decay": 0.1},
                             1.0, None),
    "rows_int8_sparse_adam_unclipped": ({"embedding_dtype": "int8", "embedding_update": "sparse_adam"}, None, None),
}


def _method(overrides: dict, max_grad_norm: float | None, seed: int = 0):
    model = tiny_llama(seed)
    method = hmt.make(hmt.Config(**{"rank": 8, "update_interval": 100, "state_budget": None, **overrides}))
    model = method.prepare(model)
    method.attach(model, max_grad_norm=max_grad_norm)
    return model, method


def _nan_grad(out: torch.Tensor) -> None:
    out.register_hook(lambda g: g * math.nan)


def _step(model, method, ids: torch.Tensor, bad: bool = False) -> torch.Tensor:
    head = model.get_output_embeddings()  # bad: the logits' gradient NaN, so every parameter's gradient is
    hook = head.register_forward_hook(lambda m, i, out: _nan_grad(out)) if bad else None
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    if hook is not None:
        hook.remove()
    loss.backward()
    norm = method.step()
    method.zero_grad()
    return norm


def _hmt_syncs(counter: DispatchCounter) -> dict[str, int]:
    return {site: n for site, n in counter.report().sync_sites.items() if "<- transformers/" not in site}


def _state(model, method) -> dict[str, torch.Tensor]:
    out = {k: t.detach().clone() for k, t in model.state_dict().items()}
    out.update({f"state{i}": t.detach().clone() for i, t in enumerate(method.state_tensors())})
    return out


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_has_no_host_sync(name):
    overrides, max_grad_norm, preset = CONFIGS[name]
    model, method = _method(overrides, max_grad_norm)
    handle = apply_policy(model, PRESETS[preset]) if preset else None
    data = batches(2)
    _step(model, method, data[0])  # step 0: the basis refresh (host reads by design)
    counter = DispatchCounter()
    with counter:
        norm = _step(model, method, data[1])
    if handle is not None:
        handle.remove()
    assert not _hmt_syncs(counter), f"{name}: {counter.report().sync_sites}"
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and norm.dtype == torch.float32
    assert math.isfinite(float(norm)) and float(norm) > 0, float(norm)


@pytest.mark.parametrize("name", ["mode_a_clipped", "mode_a_unclipped", "mode_b_rank1", "int8_weights",
                                  "ordinary_step", "weight_decay", "rows_sparse_adam_unclipped",
                                  "rows_int8_sparse_adam_unclipped"])
def test_a_nonfinite_gradient_skips_the_step_on_the_device_as_before(name):
    """The bad step (counted: no host sync) leaves every weight and state tensor as it was and returns NaN; once the
    host has read the flags (``metrics``, as on a logging step) the counters are those of before the step, and the
    next steps equal, bit for bit, a run that never saw the bad batch (same operations on the same values). The
    logits' gradient is NaN, so the first gradient to arrive is already non-finite (an update inside backward issued
    before a non-finite gradient appears keeps its update, as before). INT8 weights:
    the skipped step's stochastic requantization still drew its random bits, so the next step's codes and scales
    round differently (everything else is equal; docs/host_syncs.md). ``lazy_exact`` embedding rows are not in the
    list: the bad step's forward still brings the rows it reads up to date (the same state, other tensors)."""
    overrides, max_grad_norm, _ = CONFIGS[name]
    data = batches(4)
    runs = []
    for with_bad in (True, False):
        model, method = _method(overrides, max_grad_norm)
        _step(model, method, data[0])
        _step(model, method, data[1])
        if with_bad:
            before = _state(model, method)
            counters = [(s.clock.step, s.clock.adam_t) for s in method.opt.slots]
            counter = DispatchCounter()
            with counter:
                norm = _step(model, method, data[2], bad=True)
            assert not _hmt_syncs(counter), counter.report().sync_sites
            assert math.isnan(float(norm)), float(norm)
            changed = _differ(before, _state(model, method))
            assert not changed, f"{name}: {changed} changed by a skipped step"
            method.metrics()  # a logging step: the host reads the flags
            assert [(s.clock.step, s.clock.adam_t) for s in method.opt.slots] == counters
        _step(model, method, data[3])
        runs.append(_state(model, method))
    diff = _differ(*runs)
    if "int8" in name:  # the INT8 layers' codes, scales and the weight that stands for them
        assert diff and all(k.rsplit(".", 1)[0] + ".weight_codes" in runs[0] for k in diff), diff
    else:
        assert not diff, f"{name}: {diff} differ from the run without the bad step"


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_driver_skips_a_nonfinite_step_on_the_device_where_the_optimizer_can(impl):
    """``OptimizerDriver`` (the baselines' torch.optim step): torch's fused AdamW takes ``found_inf`` and skips on
    the device (no host sync); one that cannot (foreach) reads the flag once. Either way a NaN gradient leaves the
    weights, moments and step counter as they were, the norm is NaN, and a finite step afterwards updates."""
    from baselines.driver import OptimizerDriver

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    driver = OptimizerDriver(torch.optim.AdamW([weight], lr=1e-2, **{impl: True}), max_grad_norm=1.0)
    weight.grad = torch.randn(8, 4)
    driver.step()
    before = [weight.detach().clone(), *(t.clone() for t in driver.state_tensors())]
    weight.grad = torch.randn(8, 4)
    weight.grad[3, 1] = math.nan
    counter = DispatchCounter()
    with counter:
        norm = driver.step()
    after = [weight.detach().clone(), *(t.clone() for t in driver.state_tensors())]
    assert math.isnan(float(norm)) and all(torch.equal(a, b) for a, b in zip(before, after)), (before, after)
    assert counter.report().host_syncs == (0 if impl == "fused" else 1), counter.report().sync_sites
    weight.grad = torch.randn(8, 4)
    assert math.isfinite(float(driver.step())) and not torch.equal(weight, before[0])
