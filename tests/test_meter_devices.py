"""The memory meter counts the training device and the host apart: exact byte counts on a program whose
tensors are known, real tensors (``meta`` standing in for the accelerator) vs FakeTensorMode (fake CUDA tensors,
as a dry run on a CUDA target makes them), and a CPU run unchanged by the split."""

import math

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.memory.meter import CATEGORIES, MemoryMeter

W, X, H, B, U = (64, 32), (16, 64), (16, 32), (32, 8), (16, 8)  # weight, input, hidden, basis, update shapes


def _nbytes(shape) -> int:
    return 4 * math.prod(shape)  # fp32


def _program(dev: str, meter: MemoryMeter):
    """A weight and a forward on ``dev``; a basis parked on the host and brought to ``dev`` for the optimizer
    step; a saved activation offloaded to the host. Host->device copies are stood in for by allocations on the
    target (a meta tensor holds no data to copy, and a CPU build cannot copy into a fake CUDA tensor)."""
    w = torch.randn(W, device=dev)
    meter.track([w], "params")
    with meter:
        parked = torch.randn(B)  # host
        meter.mark([parked], "optimizer")
        with meter.phase("forward"):
            x = torch.randn(X, device=dev)
            h = x @ w
            offloaded = torch.empty(H)  # host copy of a saved activation
        with meter.phase("optimizer"):
            basis = torch.empty(B, device=dev)  # the parked basis fetched to the device
            update = h @ basis
            del basis, update
        del offloaded
    return meter.report(), (w, x, h, parked)


def _figures(rep) -> dict:
    return {k: v for k, v in rep.to_dict().items() if k not in ("source", "device")}


def test_device_and_host_bytes_are_counted_apart_exactly():
    rep, _ = _program("meta", MemoryMeter(device="meta"))
    print(rep)
    # device: weight + what forward saved (x, h) + the fetched basis and the update, alive together in the step
    assert rep.peak_bytes == _nbytes(W) + _nbytes(X) + _nbytes(H) + _nbytes(B) + _nbytes(U)
    assert rep.peak_by_category_bytes == {**dict.fromkeys(CATEGORIES, 0), "params": _nbytes(W),
                                          "activations": _nbytes(X) + _nbytes(H), "temp": _nbytes(B) + _nbytes(U)}
    # host: the parked basis + the offloaded activation, both alive from forward into the optimizer phase
    assert rep.host_peak_bytes == _nbytes(B) + _nbytes(H)
    assert rep.host_peak_by_category_bytes == {**dict.fromkeys(CATEGORIES, 0), "optimizer": _nbytes(B),
                                               "activations": _nbytes(H)}
    assert rep.host_peak_by_phase_bytes == {"forward": _nbytes(B) + _nbytes(H), "backward": 0,
                                            "optimizer": _nbytes(B) + _nbytes(H)}
    assert rep.host_current_by_category_bytes["optimizer"] == _nbytes(B)  # the offloaded copy was freed
    assert rep.host_current_by_category_bytes["activations"] == 0
    assert rep.current_by_category_bytes["temp"] == 0 and rep.device == "meta"


def test_fake_cuda_splits_as_real_tensors_do():
    real, _ = _program("meta", MemoryMeter(device="meta"))
    with FakeTensorMode():
        fake, _ = _program("cuda", MemoryMeter(device="cuda", source="fake"))
        # a fake tensor's storage is a meta storage: the split must follow the tensor's (fake) device
        indexed, _ = _program("cuda", MemoryMeter(device="cuda:0", source="fake"))
        other, _ = _program("cuda", MemoryMeter(device="cuda:1", source="fake"))
    print("real", _figures(real), "\nfake", _figures(fake))
    assert _figures(fake) == _figures(real)  # same ops, same ticks: every figure, averages included
    assert _figures(indexed) == _figures(real) and fake.device == "cuda"
    # negative control: with another training device, nothing of this program is on it
    assert other.peak_bytes == 0 and other.host_peak_bytes == real.peak_bytes + real.host_peak_bytes


def test_cpu_run_counts_everything_as_device():
    torch.manual_seed(0)
    split, _ = _program("cpu", MemoryMeter(device="cpu"))
    torch.manual_seed(0)
    unsplit, _ = _program("cpu", MemoryMeter())
    print(split)
    assert _figures(split) == _figures(unsplit)
    assert split.host_peak_bytes == split.host_avg_bytes == 0
    assert split.peak_bytes == _nbytes(W) + _nbytes(X) + _nbytes(H) + _nbytes(B) + _nbytes(U) + _nbytes(B) \
        + _nbytes(H)  # as the split run's device + host
