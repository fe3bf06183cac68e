"""``benchmarks.host_device_fake_cuda`` on fake CUDA tensors: HMT's parked bases (``method.offload_bases=true``)
are counted as host bytes and not as device bytes, exactly, by the meter and by the optimizer-state summary; an
``offload_cpu`` activation is counted on the host. The expected bytes come from the parked bases' own shapes and
dtypes, and the device figures are compared with the same run without offloading (same model, same steps).

Needs the CUDA build of torch (the fake-CUDA tier, docs/testing.md); skipped on the CPU build."""

from __future__ import annotations

import pytest
import torch

if torch.version.cuda is None:
    pytest.skip("fake-CUDA tier: needs the CUDA build of torch (docs/testing.md)", allow_module_level=True)
pytestmark = pytest.mark.fake_cuda

from benchmarks import host_device_fake_cuda as hdfc  # noqa: E402

TINY = ["model=tiny", "train.seq_len=64", "train.batch_size=1", "method=hmt", "method.rank=8"]


def nbytes(tensors) -> int:
    """Bytes from shapes and dtypes (fake tensors have no storage to ask)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def test_parked_bases_are_host_bytes_not_device_bytes():
    plain = hdfc.measure(hdfc.compose(*TINY))
    parked = hdfc.measure(hdfc.compose(*TINY, "method.offload_bases=true"))
    bases = [t for b in parked.method.engine.cache.parked.values() for t in b if t is not None]
    expected = nbytes(bases)
    projected = sum(s.projected for s in parked.method.opt.slots)
    ms_plain, ms_parked = plain.summary["method_summary"], parked.summary["method_summary"]
    figures = {"bases_from_shapes": expected, "state_host": ms_parked["optim/state_host_bytes"],
               "state_device": (ms_plain["optim/state_device_bytes"], ms_parked["optim/state_device_bytes"]),
               "meter_host_optimizer_now": parked.report.host_current_by_category_bytes["optimizer"],
               "meter_device_optimizer_now": (plain.report.current_by_category_bytes["optimizer"],
                                              parked.report.current_by_category_bytes["optimizer"])}
    assert projected and len(bases) == projected and {t.device.type for t in bases} == {"cpu"}, figures
    assert expected > 0 and ms_parked["optim/state_host_bytes"] == expected, figures
    assert ms_plain["optim/state_host_bytes"] == 0 and plain.report.host_current_by_category_bytes["optimizer"] == 0
    # exact: the same model and steps, only the bases' placement differs, so the device loses exactly their bytes
    assert ms_plain["optim/state_device_bytes"] - ms_parked["optim/state_device_bytes"] == expected, figures
    assert parked.report.host_current_by_category_bytes["optimizer"] == expected, figures
    assert (plain.report.current_by_category_bytes["optimizer"]
            - parked.report.current_by_category_bytes["optimizer"]) == expected, figures
    assert parked.summary["host_device_bytes"] > plain.summary["host_device_bytes"], figures  # prefetch and park


def test_offloaded_activations_are_host_bytes():
    plain = hdfc.measure(hdfc.compose(*TINY))
    offload = hdfc.measure(hdfc.compose(*TINY, hdfc.hdm.OFFLOAD_ACT))
    host_act = offload.report.host_peak_by_category_bytes["activations"]
    # at the forward's peak (the tiny model's overall device peak is in the optimizer step, after the forward)
    device_act = tuple(r.report.peak_by_phase_category_bytes["forward"]["activations"] for r in (plain, offload))
    assert plain.report.host_peak_by_category_bytes["activations"] == 0, plain.report
    assert host_act > 0 and device_act[1] < device_act[0], (host_act, device_act)
    # the MLP intermediates moved: what left the device is at least what arrived on the host (the host copies
    # are the saved tensors themselves; the device also drops views that only the saved tensors kept alive)
    assert device_act[0] - device_act[1] >= host_act, (host_act, device_act)
