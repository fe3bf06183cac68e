"""The host basis cache (``method.offload_bases``): identical trajectories, bases really parked off the device
between uses, prefetch hits, byte accounting, the LRU/capacity rule and the subspace-drift measure."""

import pytest
import torch

from experiments import methods
from experiments.loop import train_step
from hmt_core.basis_cache import BasisCache, basis_bytes, subspace_drift
from hmt_core.projection import Basis


def _run(tiny_llama_config, raw: dict, steps: int = 5, grad_accum: int = 1):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config)
    method = methods.make_method(methods.make_config(dict(raw)))
    method.attach(model, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        micro = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(grad_accum)]
        loss, _ = train_step(model, method, micro, meter=None, autocast=lambda: torch.autocast("cpu", torch.bfloat16))
        losses.append(float(loss))
    return losses, model, method


@pytest.mark.parametrize("raw, accum", [
    ({"name": "hmt", "rank_candidates": (8, 16), "update_interval": 2}, 2),  # Mode A, clipping defers updates
    ({"name": "hmt", "mode": "B", "rank_candidates": (8,), "update_interval": 2}, 1),  # Mode B, updates in hooks
], ids=["mode_a_accum", "mode_b"])
def test_offloaded_bases_give_the_same_trajectory_with_fewer_device_bytes(tiny_llama_config, raw, accum):
    plain, model_p, _ = _run(tiny_llama_config, raw, grad_accum=accum)
    cached, model_c, method = _run(tiny_llama_config, {**raw, "offload_bases": True}, grad_accum=accum)
    assert cached == plain
    assert all(torch.equal(a, b) for a, b in zip(model_p.parameters(), model_c.parameters()))
    cache = method.engine.cache
    projected = [s for s in method.opt.slots if s.projected]
    for s in projected:  # between steps every basis is the parked host copy, not a device copy
        assert s.basis is cache.parked[s.name]
    stats = method.metrics()
    all_bytes = sum(basis_bytes(s.basis) for s in projected)
    assert stats["cache/device_bytes_without_cache"] == all_bytes
    largest = max(basis_bytes(s.basis) for s in projected)
    assert 0 < stats["cache/device_bytes_peak"] <= 2 * largest < all_bytes  # the one in use + one prefetched
    assert stats["cache/hits"] > 3 * stats["cache/misses"]  # after the first step, prefetch finds them ready
    assert stats["cache/h2d_bytes"] >= 4 * all_bytes  # at least one copy per use in steps 1..4
    assert stats["cache/d2h_bytes"] >= 3 * all_bytes  # refreshes at steps 0, 2, 4 go back to the host
    assert 0 <= stats["proj/subspace_drift_mean"] <= 1


def _more(model, method, steps: int, g: torch.Generator) -> list[float]:
    out = []
    for _ in range(steps):
        loss, _ = train_step(model, method, [torch.randint(0, 256, (2, 16), generator=g)], meter=None,
                             autocast=lambda: torch.autocast("cpu", torch.bfloat16))
        out.append(float(loss))
    return out


def test_lru_evicts_previous_bases_first_then_keeps_bases_on_the_device(tiny_llama_config):
    raw = {"name": "hmt", "rank_candidates": (8,), "update_interval": 2}
    _, model_p, method_p = _run(tiny_llama_config, raw)
    _, model_c, method = _run(tiny_llama_config, {**raw, "offload_bases": True})
    cache = method.engine.cache
    current = sum(basis_bytes(b) for b in cache.parked.values())
    assert cache.previous and cache.host_bytes() <= cache.capacity

    cache.capacity = current  # room for the current bases only: the previous ones must go
    expected = _more(model_p, method_p, 4, torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(6)
    got = _more(model_c, method, 2, g)
    assert not cache.previous and cache.host_bytes() <= cache.capacity
    cache.capacity = current // 2  # not even that: the overflow stays on the device, never dropped
    got += _more(model_c, method, 2, g)
    assert cache.resident and cache.host_bytes() <= cache.capacity
    assert got == expected  # eviction and residency never change the numbers


def test_subspace_drift():
    q = torch.linalg.qr(torch.randn(32, 8)).Q
    rot = torch.linalg.qr(torch.randn(8, 8)).Q
    assert subspace_drift(Basis(q, None), Basis(q @ rot, None)) == pytest.approx(0.0, abs=1e-5)
    e = torch.eye(32)
    assert subspace_drift(Basis(e[:, :8], None), Basis(e[:, 8:16], None)) == pytest.approx(1.0)
    assert subspace_drift(Basis(None, e[:4]), Basis(None, e[2:6])) == pytest.approx(0.5)


def test_cache_copies_are_real_copies():
    cache = BasisCache(torch.device("cpu"), capacity_bytes=1 << 20)
    b = Basis(torch.randn(16, 4), None)
    host = cache.park("w", b)  # first park: a refreshed basis goes to the host
    assert host is not b and torch.equal(host.left, b.left) and cache.d2h_bytes == basis_bytes(b)
    dev = cache.fetch("w", host)
    assert dev is not host and torch.equal(dev.left, host.left) and cache.misses == 1
    assert cache.park("w", dev) is host and cache.device_bytes == 0  # unchanged: device copy dropped
    cache.prefetch("w")
    assert cache.fetch("w", host) is not host and cache.hits == 1
