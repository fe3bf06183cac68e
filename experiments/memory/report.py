"""What the memory meter (``experiments.memory.meter``) keeps and reports: one record per live storage, the peak
windows and running averages of a memory space (the training device, the host), and the ``MemoryReport``."""

from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = ("params", "grads", "optimizer", "activations", "temp", "other")
PHASES = ("forward", "backward", "optimizer")
SPACES = ("device", "host")  # the training device; every other device (the host)


@dataclass(eq=False)
class Record:
    """One storage's life: its bytes, category (reassigned after the fact by ``mark``), birth and death ticks."""

    nbytes: int
    category: str
    born: int  # op tick at allocation
    phase: str | None
    space: str  # one of SPACES
    died: int | None = None
    serial: int = 0  # the storage's key in the event log
    device: str = ""


@dataclass
class PeakWindow:
    """The peak of total live bytes within one phase (or overall), and the records alive at that moment."""

    bytes: int = -1
    tick: int = -1
    died_after_peak: list[Record] = field(default_factory=list)  # records alive at the peak, freed since


@dataclass
class Space:
    """Live total, peak windows (overall and per phase) and released bytes x ticks of one memory space."""

    total: int = 0
    windows: dict[str, PeakWindow] = field(default_factory=lambda: {k: PeakWindow() for k in ("all", *PHASES)})
    avg_accum: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Un-prefixed figures: the training device (``device``; all memory when it is None). ``host_*``: storages
    on every other device (the host), measured the same way."""

    source: str
    device: str | None
    peak_bytes: int
    avg_bytes: int
    peak_by_category_bytes: dict[str, int]
    avg_by_category_bytes: dict[str, int]
    peak_by_phase_bytes: dict[str, int]
    peak_by_phase_category_bytes: dict[str, dict[str, int]]
    current_by_category_bytes: dict[str, int]
    host_device_bytes: int  # bytes copied between devices (traffic, not residency)
    host_peak_bytes: int
    host_avg_bytes: int
    host_peak_by_category_bytes: dict[str, int]
    host_avg_by_category_bytes: dict[str, int]
    host_peak_by_phase_bytes: dict[str, int]
    host_current_by_category_bytes: dict[str, int]

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "avg_bytes": self.avg_bytes,
            "peak_by_category_bytes": dict(self.peak_by_category_bytes),
            "avg_by_category_bytes": dict(self.avg_by_category_bytes),
            "peak_by_phase_bytes": dict(self.peak_by_phase_bytes),
            "peak_by_phase_category_bytes": {k: dict(v) for k, v in self.peak_by_phase_category_bytes.items()},
            "host_device_bytes": self.host_device_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "host_avg_bytes": self.host_avg_bytes,
            "host_peak_by_category_bytes": dict(self.host_peak_by_category_bytes),
            "host_avg_by_category_bytes": dict(self.host_avg_by_category_bytes),
            "host_peak_by_phase_bytes": dict(self.host_peak_by_phase_bytes),
        }
