"""Verdicts, tolerances and arithmetic of the GPU validation — pure Python, no CUDA, unit-tested on CPU.

A check is one record (``CheckRecord``): a name, what was measured (keys carry their unit, e.g.
``cuda_max_allocated(bytes)``), the target it is judged against, and a verdict:

- ``PASS`` / ``MISS``: measured and judged against a target (a miss is reported, never hidden);
- ``INFO``: measured, no target (tokens/s, rSVD vs SVD time);
- ``N/A``: cannot be measured for this method (a dry run of QLoRA: bitsandbytes cannot wrap a fake tensor);
- ``SKIPPED``: not run, with the reason (time budget, ``--quick``, a run it depends on crashed);
- ``ERROR``: the check crashed; the only verdict that makes the command exit non-zero.

MFU follows Kaplan et al. (2020) / PaLM (Chowdhery et al. 2022, App. B): 6·N FLOPs per trained token
(forward 2N, backward 4N; attention FLOPs left out), divided by the device's dense BF16 tensor-core peak.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from experiments.memory.gpu_allowance import GpuTarget, allowance_for

PASS, MISS, INFO, NOT_APPLICABLE, SKIPPED, ERROR = "PASS", "MISS", "INFO", "N/A", "SKIPPED", "ERROR"
VERDICTS = (PASS, MISS, INFO, NOT_APPLICABLE, SKIPPED, ERROR)
_SEVERITY = {NOT_APPLICABLE: 0, INFO: 1, PASS: 2, SKIPPED: 3, MISS: 4, ERROR: 5}

TRACKER_TOLERANCE = 0.03  # the meter's live-tensor peak vs torch.cuda.max_memory_allocated
DRYRUN_TOLERANCE = 0.05  # the FakeTensorMode prediction vs torch.cuda.max_memory_allocated
# step time with activation=hmt / with activation=full_ckpt: no slower than recomputing whole layers. The FLOP ratio
# alone is (3F + recomputed) / (3F + all layers' forward) = 0.86 at 125M, seq 1024 (docs/gpu_validation.md), so the
# earlier 0.8 could not be met by any implementation.
ACTIVATION_TIME_TARGET = 1.0
GIB = 2**30

# Dense BF16 tensor-core peak (TFLOP/s, no sparsity) from NVIDIA's datasheets, matched on the words of
# torch.cuda.get_device_name(): every word of a key must appear; the first matching row wins (specific first).
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float, str], ...] = (
    (("H100", "PCIE"), 756.0, "H100 PCIe"),
    (("H100", "NVL"), 835.0, "H100 NVL"),
    (("H200", "NVL"), 835.0, "H200 NVL"),
    (("GH200",), 989.0, "GH200"),
    (("H200",), 989.0, "H200 SXM"),
    (("H100",), 989.0, "H100 SXM"),
    (("A100",), 312.0, "A100"),
    (("L40S",), 362.0, "L40S"),
    (("L4",), 121.0, "L4"),
)


def smoke_verdict(raw: dict) -> tuple[str, str | None]:
    """The smoke tests' verdict: PASS when every one passed; MISS when some failed (a finding: the failing tests
    are named); ERROR when pytest itself did not finish (no report, timeout, collection error, nothing ran)."""
    failed, errors, passed = raw.get("failed") or 0, raw.get("errors") or 0, raw.get("passed") or 0
    if raw.get("error"):
        return ERROR, str(raw["error"])
    names = ", ".join(raw.get("failed_tests") or [])
    if errors:
        return ERROR, f"{errors} test(s) errored: {names}"
    if failed:
        return MISS, f"{failed} test(s) failed: {names}"
    if raw.get("returncode") != 0 or not passed:
        return ERROR, f"pytest exited {raw.get('returncode')} with {passed} passed (a CUDA device must run them)"
    return PASS, None


@dataclass
class CheckRecord:
    """One check of the validation; ``to_dict`` is its JSON form (``gpu_validate.json`` ``checks[]``)."""

    name: str
    kind: str
    verdict: str
    measured: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] | None = None
    note: str | None = None
    method: str | None = None
    model: str | None = None
    wall_s: float | None = None
    run_dir: str | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; expected one of {VERDICTS}")

    def to_dict(self) -> dict:
        return asdict(self)


def worst(verdicts) -> str:
    """The most severe verdict (ERROR > MISS > SKIPPED > PASS > INFO > N/A); N/A for none."""
    return max(verdicts, key=_SEVERITY.__getitem__, default=NOT_APPLICABLE)


def ratio_verdict(measured: float | None, reference: float | None,
                  tolerance: float) -> tuple[str, float | None, str | None]:
    """(verdict, measured / reference, note): PASS when |ratio − 1| ≤ tolerance, else MISS; N/A without both."""
    if measured is None or reference is None:
        missing = "measured value" if measured is None else "reference value"
        return NOT_APPLICABLE, None, f"no {missing}"
    if reference <= 0:
        return NOT_APPLICABLE, None, f"reference value {reference} is not positive"
    ratio = measured / reference
    return (PASS if abs(ratio - 1.0) <= tolerance + 1e-9 else MISS), ratio, None


def at_most_verdict(measured: float | None, limit: float) -> str:
    if measured is None:
        return NOT_APPLICABLE
    return PASS if measured <= limit + 1e-12 else MISS


def peak_bf16_flops(device_name: str) -> tuple[float | None, str]:
    """(peak FLOP/s, note) for a CUDA device name; (None, why) when the table has no row for it."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for keys, tflops, label in PEAK_BF16_TFLOPS:
        if all(k in words for k in keys):
            return tflops * 1e12, f"{label}: {tflops:g} TFLOP/s dense BF16 (datasheet)"
    return None, f"unknown device {device_name!r}: no dense BF16 peak in the table, MFU left null"


def mfu(params: int | None, tokens_per_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization: 6 · N · tokens/s / peak FLOP/s; None when any input is missing or not positive."""
    if not params or not tokens_per_s or not peak_flops or tokens_per_s != tokens_per_s:  # NaN != NaN
        return None
    if params <= 0 or tokens_per_s <= 0 or peak_flops <= 0:
        return None
    return 6.0 * params * tokens_per_s / peak_flops


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (a folder name)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


# Device-name patterns of each GPU generation the allowance model knows (experiments.memory.gpu_allowance).
_ARCH_PATTERNS = (("ada", r"\bl4\b|\bl40|rtx 40\d\d|ada generation"),
                  ("blackwell", r"\bg?b\d00\b|rtx pro \d000|rtx 50\d\d"),
                  ("hopper", r"\bg?h\d00\b|\bh20\b"),
                  ("ampere", r"\ba\d{2,3}g?\b|rtx 30\d\d|rtx a\d{4}"))


def gpu_arch(device_name: str) -> str | None:
    """The GPU generation of a device name ('NVIDIA H200' -> 'hopper'), or None when the name is not recognised."""
    name = device_name.lower()
    return next((arch for arch, pattern in _ARCH_PATTERNS if re.search(pattern, name)), None)


def modeled_workspace_bytes(device_name: str) -> int:
    """The cuBLAS and cuBLASLt workspaces a training step allocates through the caching allocator — one each for
    the main thread and autograd's device thread (``experiments.memory.gpu_allowance``): in
    ``torch.cuda.max_memory_allocated`` but in no tensor the meter or the dry run counts. 0 for an unknown device."""
    arch = gpu_arch(device_name)
    return 0 if arch is None else allowance_for(GpuTarget(arch=arch)).replayed_bytes


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / GIB


def finite_or_none(value: Any) -> float | None:
    """A summary number, or None when absent or NaN (JSON writes NaN as null)."""
    if value is None:
        return None
    value = float(value)
    return value if value == value and value not in (float("inf"), float("-inf")) else None


# ------------------------------------------------------------------------------------------------ kernel checks
# Tolerances of the Triton kernels vs their references (as tests/test_kernels.py on CPU): codecs must be bit
# identical; the bf16 fused update within the error of fp32 arithmetic rounded once to bf16
# (``kernel_checks.fp32_then_bf16_bound``); the bf16 projection is compared with the PyTorch fallback relative to its
# largest value; fp32 ops to fp32 summation-order slack.
KERNEL_TARGETS: dict[str, tuple[str, float]] = {
    "fused_update/bf16": ("max_err(fp32 bound)", 1.0),
    "fused_update/fp32": ("max_rel_err", 1e-5),
    "projection/bf16": ("max_rel_err", 2.0**-7),
    "adam/fp32": ("max_rel_err", 1e-5),
}


def kernel_record(raw: dict) -> CheckRecord:
    """Judge one kernel measurement from the CUDA worker (``kernel_checks.run_kernel_checks``)."""
    name = str(raw.get("name", "?"))
    measured = {k: v for k, v in raw.items() if k not in ("name", "error")}
    kernel_ms, fallback_ms = raw.get("kernel(ms)"), raw.get("fallback(ms)")
    if kernel_ms and fallback_ms:
        measured["speedup(x)"] = fallback_ms / kernel_ms
    if raw.get("error"):
        return CheckRecord(f"kernel/{name}", "kernel", ERROR, measured, None, str(raw["error"]))
    if name.startswith("codec/"):
        identical = raw.get("bit_identical")
        verdict = NOT_APPLICABLE if identical is None else (PASS if identical else MISS)
        return CheckRecord(f"kernel/{name}", "kernel", verdict, measured, {"bit_identical": True},
                           None if identical else "codes, scales or dequantized values differ from the PyTorch codec")
    if name in KERNEL_TARGETS:
        key, limit = KERNEL_TARGETS[name]
        verdict = at_most_verdict(finite_or_none(raw.get(key)), limit)
        return CheckRecord(f"kernel/{name}", "kernel", verdict, measured, {key: f"<= {limit:g}"})
    return CheckRecord(f"kernel/{name}", "kernel", INFO, measured, None, "no tolerance defined for this kernel")
