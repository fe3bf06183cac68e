"""``experiments.memory.gpu_stats`` against a stub NVML and stub CUDA device properties (no GPU needed): the NVML handle
is the GPU the CUDA ordinal runs on even when ``CUDA_VISIBLE_DEVICES`` masks devices, and ``PcieSampler``
integrates the PCIe counters over a step instead of reading one sample after it."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

from experiments.memory import gpu_stats

# four physical GPUs as NVML sees them (NVML index i), and their PCI bus ids / UUIDs
GPUS = [{"bus": (0, 0x18 + 0x20 * i, 0), "uuid": f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"} for i in range(4)]


def bus_id(gpu: dict) -> str:
    return "{:08X}:{:02X}:{:02X}.0".format(*gpu["bus"])


class StubNvml(types.ModuleType):
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    def __init__(self, tx_kbs: list[float] | None = None) -> None:
        super().__init__("pynvml")
        self.tx_kbs = list(tx_kbs or [])
        self.calls = 0
        self.exhausted, self.release = threading.Event(), threading.Event()

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"nvml-{i}"

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> str:
        return f"nvml-{[bus_id(g) for g in GPUS].index(bus)}"  # ValueError (an NVML error) if unknown

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return f"nvml-{[g['uuid'] for g in GPUS].index(uuid)}"

    def nvmlDeviceGetPcieThroughput(self, handle: str, counter: int) -> float:
        """The listed TX samples (RX is half of each), then blocks until released: a window still in flight."""
        k = self.calls // 2
        if k >= len(self.tx_kbs):
            self.exhausted.set()
            self.release.wait(5)
            k = len(self.tx_kbs) - 1
        self.calls += 1
        return self.tx_kbs[k] / (1 if counter == self.NVML_PCIE_UTIL_TX_BYTES else 2)


def masked(monkeypatch, visible: list[int], props: str, nvml: StubNvml) -> None:
    """CUDA sees physical GPUs ``visible`` as ordinals 0, 1, …; ``props``: which ids torch exposes."""
    def properties(ordinal: int):
        gpu = GPUS[visible[ordinal]]
        fields = {}
        if "pci" in props:
            fields.update(pci_domain_id=gpu["bus"][0], pci_bus_id=gpu["bus"][1], pci_device_id=gpu["bus"][2])
        if "uuid" in props:
            fields["uuid"] = gpu["uuid"].removeprefix("GPU-")  # torch prints the bare UUID
        return types.SimpleNamespace(**fields)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, visible)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_stats, "_HANDLES", {})


@pytest.mark.parametrize("props", ["pci+uuid", "pci", "uuid"])
def test_the_nvml_handle_is_the_gpu_the_cuda_ordinal_runs_on_under_masking(monkeypatch, props):
    masked(monkeypatch, [2, 3], props, StubNvml())
    got = [gpu_stats.nvml_handle(torch.device("cuda", i))[1] for i in (0, 1)]
    assert got == ["nvml-2", "nvml-3"], got  # by ordinal it would have been nvml-0, nvml-1: other GPUs


def test_without_ids_nvml_figures_are_absent_when_masked_and_by_ordinal_when_not(monkeypatch):
    masked(monkeypatch, [2, 3], "", StubNvml())
    assert gpu_stats.nvml_handle(torch.device("cuda", 1)) == (None, None)  # never another GPU's figures
    assert gpu_stats.PcieSampler.for_device(torch.device("cuda", 1)) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(gpu_stats, "_HANDLES", {})
    assert gpu_stats.nvml_handle(torch.device("cuda", 1))[1] == "nvml-1"  # unmasked: ordinal i is NVML's i
    assert gpu_stats.PcieSampler.for_device(torch.device("cpu")) is None


def test_the_pcie_sampler_integrates_the_counters_over_the_step(monkeypatch):
    """Samples 0, 2000, 4000, 6000 KB/s TX (RX half of each) during the step: mean 3 MB/s, max 6 MB/s — a single
    sample after the step (the bus idle again) would read 0. ``stop()`` returns without waiting for the sample
    still in flight, and the next window starts empty."""
    nvml = StubNvml([0.0, 2000.0, 4000.0, 6000.0])
    masked(monkeypatch, [1], "pci", nvml)
    sampler = gpu_stats.PcieSampler.for_device(torch.device("cuda", 0))
    sampler.start()
    assert nvml.exhausted.wait(5), "the sampler thread did not poll"
    got = sampler.stop()  # the 5th sample blocks in the stub: stop() must not wait for it
    nvml.release.set()
    expected = {"pcie/tx_mean(MB/s)": 3.0, "pcie/tx_max(MB/s)": 6.0, "pcie/rx_mean(MB/s)": 1.5,
                "pcie/rx_max(MB/s)": 3.0, "pcie/samples": 4.0}
    assert got == pytest.approx(expected), got
    nvml.tx_kbs, nvml.calls = [500.0], 0
    nvml.exhausted.clear()
    sampler.start()
    assert nvml.exhausted.wait(5)
    assert sampler.stop()["pcie/tx_max(MB/s)"] == pytest.approx(0.5)  # the earlier window's samples are gone


@pytest.mark.parametrize("mask, expected", [(None, "nvml-0"), ("2,3", "nvml-2"), (GPUS[3]["uuid"] + ",x", "nvml-3"),
                                            ("MIG-unknown", None)])
def test_the_orchestrators_handle_comes_from_the_mask_without_initialising_cuda(monkeypatch, mask, expected):
    """gpu_validate's orchestrating process names its GPU through NVML alone: the first entry of
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), and no ``torch.cuda`` call (which would initialise CUDA there)."""
    monkeypatch.setitem(sys.modules, "pynvml", StubNvml())
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)

    def no_cuda(*args, **kwargs):
        raise AssertionError("torch.cuda was called")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    nvml, handle = gpu_stats.first_visible_gpu_handle()
    assert handle == expected, (mask, handle)
