"""GPU-side memory and traffic figures: the CUDA caching allocator's peaks and NVML's device view.

Everything here is a no-op on CPU (returns empty dicts / ``None``), so the loop calls it unconditionally.
NVML (``nvidia-ml-py``, imported as ``pynvml``) reports device-level used memory — including the CUDA context and
other processes — and PCIe throughput counters (KB/s over NVML's ~20 ms window, not byte totals).

NVML numbers GPUs by itself and ignores ``CUDA_VISIBLE_DEVICES``, so CUDA ordinal ``i`` is not NVML index ``i``
under Slurm or torchrun masking; the handle is looked up by the device's PCI bus id (or UUID) instead. A sample of
the PCIe counters taken once after the step's ``synchronize`` sees an idle bus; ``PcieSampler`` polls them in a
thread for the whole step instead (docs/gpu_stats.md).
"""

from __future__ import annotations

import os
import threading

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def nvml_ids(index: int) -> list[tuple[str, str]]:
    """How NVML can find CUDA device ``index``: [("pci", "DDDDDDDD:BB:DD.0"), ("uuid", "GPU-…")], the ones torch
    exposes. Ordinals are left out on purpose: under masking they name another GPU."""
    props = torch.cuda.get_device_properties(index)
    ids = []
    bus = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if None not in bus:
        ids.append(("pci", f"{bus[0]:08X}:{bus[1]:02X}:{bus[2]:02X}.0"))
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:  # torch prints the bare UUID; NVML's strings carry the "GPU-" (or "MIG-") prefix
        ids.append(("uuid", uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"))
    return ids


def _lookup(nvml, index: int):
    for kind, value in nvml_ids(index):
        try:  # nvmlDeviceGetHandleByPciBusId calls NVML's _v2 entry point
            return (nvml.nvmlDeviceGetHandleByPciBusId(value) if kind == "pci"
                    else nvml.nvmlDeviceGetHandleByUUID(value))
        except Exception:
            continue
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):  # nothing masked: ordinal i is NVML's device i
        return nvml.nvmlDeviceGetHandleByIndex(index)
    return None


_HANDLES: dict[int, tuple] = {}


def first_visible_gpu_handle():
    """(pynvml, handle) of the first GPU this process may use, from ``CUDA_VISIBLE_DEVICES`` alone (a UUID or an
    NVML index; unset: NVML's device 0), without initialising CUDA in this process; (None, None) without NVML or
    for a mask NVML cannot resolve (e.g. a MIG identifier)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        import pynvml

        pynvml.nvmlInit()
        if first.isdigit():
            return pynvml, pynvml.nvmlDeviceGetHandleByIndex(int(first))
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(first)
    except Exception:
        return None, None


def nvml_handle(device: torch.device):
    """(pynvml, handle) of the GPU ``device`` runs on, or (None, None) where NVML is unavailable or the GPU cannot
    be identified (NVML figures are then absent, never another GPU's)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = _lookup(pynvml, index)
            _HANDLES[index] = (pynvml, handle) if handle is not None else (None, None)
        except Exception:  # no NVML library / no permission: NVML figures are simply absent
            _HANDLES[index] = (None, None)
    return _HANDLES[index]


class PcieSampler:
    """NVML's PCIe TX/RX throughput over one window (a training step): ``start()`` launches a thread that takes
    back-to-back samples (each blocks for NVML's ~20 ms window) until ``stop()``, which returns their mean and max
    in MB/s (NVML's KB = 1000 bytes). ``stop()`` does not wait for a sample in flight unless none has completed
    (a step shorter than one window), so a step costs the host at most one window; the GPU is never synchronized."""

    def __init__(self, nvml, handle) -> None:
        self._nvml, self._handle = nvml, handle
        self._window: tuple[threading.Event, list[tuple[float, float]], threading.Thread] | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> PcieSampler | None:
        if device.type != "cuda":
            return None
        nvml, handle = nvml_handle(device)
        return None if handle is None else cls(nvml, handle)

    def _poll(self, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
        nvml = self._nvml
        try:
            while True:  # at least one sample per window
                tx = nvml.nvmlDeviceGetPcieThroughput(self._handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
                rx = nvml.nvmlDeviceGetPcieThroughput(self._handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
                samples.append((float(tx), float(rx)))
                if stop.is_set():
                    return
        except Exception:  # counter not supported on this device/driver: the window has what it has
            return

    def start(self) -> None:
        stop, samples = threading.Event(), []  # a fresh list per window: a late sample lands in the old one
        thread = threading.Thread(target=self._poll, args=(stop, samples), daemon=True, name="pcie-sampler")
        self._window = (stop, samples, thread)
        thread.start()

    def stop(self) -> dict[str, float]:
        if self._window is None:
            return {}
        stop, samples, thread = self._window
        self._window = None
        stop.set()
        if not samples:
            thread.join(timeout=1.0)
        taken = list(samples)
        if not taken:
            return {}
        tx, rx = [s[0] / 1000 for s in taken], [s[1] / 1000 for s in taken]
        return {"pcie/tx_mean(MB/s)": sum(tx) / len(tx), "pcie/tx_max(MB/s)": max(tx),
                "pcie/rx_mean(MB/s)": sum(rx) / len(rx), "pcie/rx_max(MB/s)": max(rx),
                "pcie/samples": float(len(taken))}


def step_metrics(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    out = {
        "memory/cuda_max_allocated(GiB)": torch.cuda.max_memory_allocated(device) / 2**30,
        "memory/cuda_max_reserved(GiB)": torch.cuda.max_memory_reserved(device) / 2**30,
    }
    nvml, handle = nvml_handle(device)
    if handle is not None:
        out["memory/nvml_used(GiB)"] = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
    return out


def summary(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    out = {
        "cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }
    nvml, handle = nvml_handle(device)
    if handle is not None:
        out["nvml_used_bytes"] = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
    return out


def memory_snapshot(device: torch.device, path) -> bool:
    """Save the allocator's memory snapshot (pickle for pytorch.org/memory_viz); False on CPU."""
    if device.type != "cuda":
        return False
    import pickle

    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
    return True
