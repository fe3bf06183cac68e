"""What the validation runs, in which order, and under which time budget.

Order (most important first, so a short device lease still yields the memory comparison):

0. the CUDA smoke tests (core): ``pytest -m cuda`` (tests/test_cuda_smoke.py: one real step per method and
   activation preset on a micro model, the meter's peak against the allocator's), in a subprocess;
1. every method at 125M (core): one training run through the normal runner, then the dry run of the same
   settings; checks ``run``, ``tracker_vs_allocated`` (≤ 3 %), ``dryrun_vs_allocated`` (≤ 5 %);
2. Triton kernels vs the PyTorch references, and their timings (optional);
3. the ``hmt`` activation policy's step time vs ``full_ckpt`` (≤ 1×; optional, not with ``--quick``);
4. PCIe / host↔device traffic with HMT's bases offloaded to the host (optional);
5. rSVD vs SVD basis refresh on a 4096×11008 matrix (optional, not with ``--quick``);
6. every method at 1B (optional, ``--with-1b``).

Time budget: a check is skipped — recorded ``SKIPPED`` with the reason — when the budget is spent (core checks)
or when it would likely not finish inside the budget (optional checks; the estimate is the last measured
duration of a check of the same cost class, else ``DEFAULT_ESTIMATES_S``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MEMORY_MINIMAL = ("method=hmt", "method.mode=B", "method.basis=random", "method.scaling=tensor", "method.rank=1",
                  "method.scale=128", "method.target_patterns=[attn,mlp,lm_head]", "method.state_dtype=bf16",
                  "method.dense_8bit=true", "activation=full_ckpt", "train.max_grad_norm=0")


@dataclass(frozen=True)
class MethodSpec:
    """A method setting under validation: a short label and the ``experiments.run`` overrides that select it."""

    label: str
    overrides: tuple[str, ...]
    dryrun_unavailable: str | None = None  # why FakeTensorMode cannot trace it (the dry-run check is N/A)


METHODS: tuple[MethodSpec, ...] = (
    MethodSpec("adamw", ("method=adamw",)),
    MethodSpec("adamw-8bit", ("method=adamw", "method.eight_bit=true")),
    MethodSpec("qlora", ("method=qlora",)),
    MethodSpec("galore", ("method=galore",)),
    MethodSpec("galore-8bit", ("method=galore", "method.eight_bit=true"),
               dryrun_unavailable="GaLoreAdamW8bit needs CUDA tensors; a dry run builds fake CPU tensors"),
    MethodSpec("apollo", ("method=apollo",)),
    MethodSpec("hmt", ("method=hmt",)),
    MethodSpec("hmt-act", ("method=hmt", "activation=hmt")),
    MethodSpec("hmt-min", MEMORY_MINIMAL),
)
QUICK_METHODS = ("adamw", "hmt", "hmt-min")
# Extra runs that other checks need (not rows of the method table).
FULL_CKPT = MethodSpec("hmt-full-ckpt", ("method=hmt", "activation=full_ckpt"))
OFFLOAD = MethodSpec("hmt-offload", ("method=hmt", "method.offload_bases=true", "method.per_layer=true"))
METHOD_LABELS = tuple(m.label for m in METHODS)
CORE_MODEL, LARGE_MODEL = "125m", "1b"
SMOKE_CHECK = "cuda_smoke_tests"

DEFAULT_ESTIMATES_S = {"smoke": 240.0, "method@125m": 45.0, "method@1b": 150.0, "run@125m": 35.0, "kernels": 60.0, "rsvd": 40.0}


@dataclass(frozen=True)
class Options:
    results_dir: Path = Path("results")
    methods: tuple[str, ...] = METHOD_LABELS
    with_1b: bool = False
    quick: bool = False
    seq_len: int = 1024
    batch_size: int = 8
    steps: int = 10
    budget_s: float = 540.0
    runner: str = "subprocess"

    def selected_methods(self) -> tuple[MethodSpec, ...]:
        wanted = set(QUICK_METHODS if self.quick and self.methods == METHOD_LABELS else self.methods)
        return tuple(m for m in METHODS if m.label in wanted)

    def to_dict(self) -> dict:
        return {"results_dir": str(self.results_dir), "methods": [m.label for m in self.selected_methods()],
                "models": [CORE_MODEL] + ([LARGE_MODEL] if self.with_1b else []), "quick": self.quick,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "steps": self.steps,
                "budget_s": self.budget_s, "runner": self.runner}


def short_cuda_run(steps: int) -> list[str]:
    """A few real steps on CUDA (the first 3 metered, the rest timed), one small evaluation at the end."""
    return ["device=cuda", f"train.steps={steps}", "train.warmup_steps=1", f"train.eval_every={steps}",
            "train.eval_batches=1", "train.log_every=1", "train.progress=false"]


def train_overrides(spec: MethodSpec, model: str, opts: Options) -> list[str]:
    """Overrides of the training run (``short_cuda_run``)."""
    return [*spec.overrides, f"model={model}", f"train.seq_len={opts.seq_len}", f"train.batch_size={opts.batch_size}",
            *short_cuda_run(opts.steps), "seed=0"]


def dryrun_overrides(spec: MethodSpec, model: str, opts: Options) -> list[str]:
    """The same settings traced under FakeTensorMode (``mode=dryrun``)."""
    return [*train_overrides(spec, model, opts), "mode=dryrun"]


@dataclass(frozen=True)
class PlannedCheck:
    """One step of the plan; ``kind`` selects the orchestrator's handler, ``cost_key`` its time estimate."""

    name: str
    kind: str  # "smoke_tests" | "method" | "kernels" | "activation_policy" | "pcie" | "rsvd_vs_svd"
    cost_key: str
    optional: bool
    spec: MethodSpec | None = None
    model: str | None = None
    skip_reason: str | None = None  # set: recorded SKIPPED without running (e.g. left out by --quick)


def build_plan(opts: Options) -> list[PlannedCheck]:
    quick = "left out by --quick" if opts.quick else None
    plan = [PlannedCheck(SMOKE_CHECK, "smoke_tests", "smoke", False)]
    plan += [PlannedCheck(f"method/{s.label}/{CORE_MODEL}", "method", f"method@{CORE_MODEL}", False, s, CORE_MODEL)
            for s in opts.selected_methods()]
    plan += [PlannedCheck("kernels", "kernels", "kernels", True),
             PlannedCheck("activation_policy/hmt_vs_full_ckpt", "activation_policy", f"run@{CORE_MODEL}", True,
                          model=CORE_MODEL, skip_reason=quick),
             PlannedCheck("pcie/offload_bases", "pcie", f"run@{CORE_MODEL}", True, OFFLOAD, CORE_MODEL),
             PlannedCheck("rsvd_vs_svd", "rsvd_vs_svd", "rsvd", True, skip_reason=quick)]
    if opts.with_1b:
        plan += [PlannedCheck(f"method/{s.label}/{LARGE_MODEL}", "method", f"method@{LARGE_MODEL}", True, s,
                              LARGE_MODEL) for s in opts.selected_methods()]
    return plan


class Budget:
    """Wall-clock budget of the whole validation, on an injectable clock (tests pass a fake one)."""

    def __init__(self, total_s: float, clock) -> None:
        self.total_s = float(total_s)
        self.clock = clock
        self.start = clock()
        self.observed: dict[str, float] = {}

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float:
        return self.total_s - self.elapsed()

    def estimate(self, cost_key: str) -> float:
        return self.observed.get(cost_key, DEFAULT_ESTIMATES_S.get(cost_key, 60.0))

    def observe(self, cost_key: str, wall_s: float) -> None:
        self.observed[cost_key] = wall_s

    def skip_reason(self, check: PlannedCheck) -> str | None:
        """Why ``check`` must not start now, or None."""
        left = self.remaining()
        if left <= 0:
            return f"time budget spent ({self.elapsed():.0f} s of {self.total_s:.0f} s)"
        estimate = self.estimate(check.cost_key)
        if check.optional and estimate > left:
            return (f"time budget near: {left:.0f} s of {self.total_s:.0f} s left, this check takes about "
                    f"{estimate:.0f} s")
        return None
