"""GPU-side memory and traffic figures: the CUDA caching allocator's peaks and NVML's device view.

Everything here is a no-op on CPU (returns empty dicts), so the loop calls it unconditionally.
NVML (``nvidia-ml-py``, imported as ``pynvml``) reports device-level used memory — including the CUDA context and
other processes — and PCIe throughput counters (KB/s samples, not byte totals).
"""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _nvml_handle(device: torch.device):
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except Exception:  # no NVML library / no permission: NVML figures are simply absent
        return None, None


def step_metrics(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    out = {
        "memory/cuda_max_allocated(GiB)": torch.cuda.max_memory_allocated(device) / 2**30,
        "memory/cuda_max_reserved(GiB)": torch.cuda.max_memory_reserved(device) / 2**30,
    }
    nvml, handle = _nvml_handle(device)
    if handle is not None:
        out["memory/nvml_used(GiB)"] = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
        out["pcie/tx(KB/s)"] = float(nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES))
        out["pcie/rx(KB/s)"] = float(nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES))
    return out


def summary(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    out = {
        "cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }
    nvml, handle = _nvml_handle(device)
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
