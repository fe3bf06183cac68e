"""Run the plan (``plan.build_plan``) against a backend and turn what it returns into check records.

Everything that touches CUDA goes through the backend object (``cuda_backend.CudaBackend`` on a GPU, a fake one in
``tests/test_gpu_validate.py``), with this interface:

- ``device_name() -> str`` and ``device_info() -> dict``;
- ``run_method(overrides, *, results_dir, run_id, log_path, timeout_s) -> RunResult``: a training run through the
  normal runner (``experiments.run``), its ``summary.json`` and ``metrics.jsonl`` read back from the results store;
- ``dryrun(overrides, *, results_dir, run_id, log_path) -> dict``: the dry run's ``summary.json``;
- ``kernel_checks(*, work_dir) -> list[dict]`` and ``rsvd_vs_svd(*, work_dir) -> dict``: raw measurements;
- ``smoke_tests(*, work_dir, timeout_s) -> dict``: the outcome of ``pytest -m cuda`` (``returncode``, the counts
  ``passed``/``failed``/``errors``/``skipped``, ``failed_tests``, ``junit``: where pytest's report is).

A backend raises (``RunFailed`` or anything else) when something crashes; the orchestrator records ``ERROR`` for
that check and goes on. Every record is handed to ``on_update`` as soon as it exists, so the results files are
rewritten after each check and a killed validation keeps what it measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from benchmarks.gpu_validate import checks as C
from benchmarks.gpu_validate.plan import (FULL_CKPT, METHODS, OFFLOAD, Budget, MethodSpec, Options, PlannedCheck,
                                          build_plan, dryrun_overrides, train_overrides)


class RunFailed(RuntimeError):
    """A run, dry run or CUDA worker ended without its results; the message says why and where its log is."""


@dataclass
class RunResult:
    summary: dict
    metrics: list[dict] = field(default_factory=list)
    pcie_sampled: dict | None = None  # NVML PCIe throughput polled beside the run (max/mean KB/s)
    run_dir: str | None = None


@dataclass(frozen=True)
class Session:
    """``<results_dir>/gpu/<device slug>-<date>/``: ``gpu_validate.json``, ``gpu_validate.md``, ``runs/<run_id>/``
    (normal run directories, which ``analysis.report`` reads), ``logs/`` (console output of each run)."""

    dir: Path
    name: str

    @classmethod
    def create(cls, results_dir: Path, device_name: str, day: date) -> Session:
        name = f"{C.device_slug(device_name)}-{day.isoformat()}"
        return cls(Path(results_dir).expanduser().resolve() / "gpu" / name, name)

    @property
    def runs_dir(self) -> Path:
        return self.dir / "runs"

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    def run_id(self, label: str, model: str, mode: str) -> str:
        return f"{self.name}-{label}-{model}-{mode}"


class Validation:
    def __init__(self, backend, opts: Options, session: Session, *, clock: Callable[[], float] = time.monotonic,
                 on_update: Callable[[list[C.CheckRecord]], None] | None = None,
                 say: Callable[[str], None] = print) -> None:
        self.backend, self.opts, self.session = backend, opts, session
        self.clock, self.on_update, self.say = clock, on_update, say
        self.budget = Budget(opts.budget_s, clock)
        self.device_name = backend.device_name()
        self.peak_flops, self.peak_note = C.peak_bf16_flops(self.device_name)
        self.workspace_bytes = C.modeled_workspace_bytes(self.device_name)  # added to the meter's and dry run's peaks
        self.records: list[C.CheckRecord] = []
        self._runs: dict[tuple[str, str], RunResult | Exception] = {}

    # ---- the plan ---------------------------------------------------------------------------------------------
    def run(self) -> list[C.CheckRecord]:
        handlers = {"smoke_tests": self._smoke, "method": self._method, "kernels": self._kernels, "activation_policy": self._activation,
                    "pcie": self._pcie, "rsvd_vs_svd": self._rsvd}
        for check in build_plan(self.opts):
            reason = check.skip_reason or self.budget.skip_reason(check)
            if reason:
                new = [self._skipped(check, reason)]
            else:
                start = self.clock()
                try:
                    new = handlers[check.kind](check)
                except Exception as e:  # a crash in the check itself: recorded, the validation goes on
                    new = [C.CheckRecord(check.name, check.kind, C.ERROR, note=f"{type(e).__name__}: {e}",
                                         method=check.spec.label if check.spec else None, model=check.model)]
                self.budget.observe(check.cost_key, self.clock() - start)
            self._add(new)
        return self.records

    def _add(self, new: list[C.CheckRecord]) -> None:
        self.records.extend(new)
        for r in new:
            self.say(f"[{self.budget.elapsed():6.0f} s] {r.verdict:<7} {r.name}" + (f"  ({r.note})" if r.note else ""))
        if self.on_update is not None:
            self.on_update(self.records)

    @staticmethod
    def _skipped(check: PlannedCheck, reason: str) -> C.CheckRecord:
        if check.kind == "method":  # the method table's row for it
            return C.CheckRecord(f"run/{check.spec.label}/{check.model}", "run", C.SKIPPED, note=reason,
                                 method=check.spec.label, model=check.model)
        return C.CheckRecord(check.name, check.kind, C.SKIPPED, note=reason, model=check.model)

    # ---- runs -------------------------------------------------------------------------------------------------
    def _train(self, spec: MethodSpec, model: str) -> RunResult:
        """The training run of ``spec`` at ``model`` (once per validation; a crash is remembered and re-raised)."""
        key = (spec.label, model)
        if key not in self._runs:
            run_id = self.session.run_id(spec.label, model, "train")
            try:
                self._runs[key] = self.backend.run_method(
                    train_overrides(spec, model, self.opts), results_dir=self.session.runs_dir, run_id=run_id,
                    log_path=self.session.logs_dir / f"{run_id}.log", timeout_s=max(self.budget.remaining(), 60) + 60)
            except Exception as e:
                self._runs[key] = e
        result = self._runs[key]
        if isinstance(result, Exception):
            raise result
        return result

    def _method(self, check: PlannedCheck) -> list[C.CheckRecord]:
        spec, model = check.spec, check.model
        base = dict(method=spec.label, model=model)
        start = self.clock()
        try:
            result = self._train(spec, model)
        except Exception as e:
            crashed = f"the training run crashed ({type(e).__name__})"
            return [C.CheckRecord(f"run/{spec.label}/{model}", "run", C.ERROR, note=f"{type(e).__name__}: {e}",
                                  wall_s=self.clock() - start, **base),
                    C.CheckRecord(f"tracker_vs_allocated/{spec.label}/{model}", "tracker_vs_allocated", C.SKIPPED,
                                  note=crashed, **base),
                    C.CheckRecord(f"dryrun_vs_allocated/{spec.label}/{model}", "dryrun_vs_allocated", C.SKIPPED,
                                  note=crashed, **base)]
        run_record = self._run_record(spec, model, result, self.clock() - start)
        memory = result.summary.get("memory") or {}
        allocated = memory.get("cuda_max_allocated_bytes")
        verdict, ratio, note = C.ratio_verdict(self._with_workspaces(memory.get("tracker_peak_bytes")), allocated,
                                               C.TRACKER_TOLERANCE)
        tracker = C.CheckRecord(
            f"tracker_vs_allocated/{spec.label}/{model}", "tracker_vs_allocated", verdict,
            {"tracker_peak(bytes)": memory.get("tracker_peak_bytes"), "modeled_workspaces(bytes)": self.workspace_bytes,
             "cuda_max_allocated(bytes)": allocated, "ratio": ratio},
            {"ratio": f"(tracker + workspaces) / allocated = 1 ± {C.TRACKER_TOLERANCE:g}"}, note,
            run_dir=run_record.run_dir, **base)
        return [run_record, tracker, self._dryrun_record(spec, model, result)]

    def _dryrun_record(self, spec: MethodSpec, model: str, result: RunResult) -> C.CheckRecord:
        name, base = f"dryrun_vs_allocated/{spec.label}/{model}", dict(method=spec.label, model=model)
        target = {"ratio": f"(dry run + workspaces) / allocated = 1 ± {C.DRYRUN_TOLERANCE:g}"}
        if spec.dryrun_unavailable:
            return C.CheckRecord(name, "dryrun_vs_allocated", C.NOT_APPLICABLE, target=target,
                                 note=spec.dryrun_unavailable, **base)
        run_id = self.session.run_id(spec.label, model, "dryrun")
        start = self.clock()
        try:
            dry = self.backend.dryrun(dryrun_overrides(spec, model, self.opts), results_dir=self.session.runs_dir,
                                      run_id=run_id, log_path=self.session.logs_dir / f"{run_id}.log")
        except Exception as e:
            return C.CheckRecord(name, "dryrun_vs_allocated", C.ERROR, target=target,
                                 note=f"{type(e).__name__}: {e}", wall_s=self.clock() - start, **base)
        predicted = (dry.get("memory") or {}).get("peak_bytes")
        allocated = (result.summary.get("memory") or {}).get("cuda_max_allocated_bytes")
        verdict, ratio, note = C.ratio_verdict(self._with_workspaces(predicted), allocated, C.DRYRUN_TOLERANCE)
        if dry.get("params_total") != result.summary.get("params_total"):
            note = "; ".join(filter(None, [note, f"the dry run traced {dry.get('params_total')} parameters, "
                                                 f"the run had {result.summary.get('params_total')}"]))
        # beside the verdict (not part of it): the allocator replay's reserved bytes vs the run's
        reserved = ((dry.get("dryrun") or {}).get("predicted") or {}).get("peak_reserved_bytes")
        real_reserved = (result.summary.get("memory") or {}).get("cuda_max_reserved_bytes")
        return C.CheckRecord(name, "dryrun_vs_allocated", verdict,
                             {"dryrun_peak(bytes)": predicted, "modeled_workspaces(bytes)": self.workspace_bytes,
                              "cuda_max_allocated(bytes)": allocated, "ratio": ratio,
                              "dryrun_reserved(bytes)": reserved, "cuda_max_reserved(bytes)": real_reserved,
                              "reserved_ratio": reserved / real_reserved if reserved and real_reserved else None,
                              "dryrun_wall(s)": (dry.get("dryrun") or {}).get("wall_s")},
                             target, note, wall_s=self.clock() - start, run_dir=self._rel(run_id), **base)

    def _run_record(self, spec: MethodSpec, model: str, result: RunResult, wall_s: float) -> C.CheckRecord:
        s = result.summary
        memory = s.get("memory") or {}
        tokens_per_s = C.finite_or_none(s.get("tokens_per_s"))
        step_time = C.finite_or_none(s.get("step_time_s"))
        notes = []
        utilization = C.mfu(s.get("params_total"), tokens_per_s, self.peak_flops)
        if self.peak_flops is None:
            notes.append(self.peak_note)
        if tokens_per_s is None:
            notes.append("no unmetered step was timed (raise --steps above 3)")
        adamw = self._runs.get(("adamw", model))
        adamw_step = C.finite_or_none(adamw.summary.get("step_time_s")) if isinstance(adamw, RunResult) else None
        ratio = step_time / adamw_step if step_time is not None and adamw_step else None
        if ratio is None and spec.label != "adamw":
            notes.append(f"no AdamW step time at {model} to compare with")
        sampled = result.pcie_sampled or {}
        measured = {
            "tracker_peak(bytes)": memory.get("tracker_peak_bytes"),
            "cuda_max_allocated(bytes)": memory.get("cuda_max_allocated_bytes"),
            "cuda_max_reserved(bytes)": memory.get("cuda_max_reserved_bytes"),
            "nvml_used(bytes)": memory.get("nvml_used_bytes"),
            "params_total": s.get("params_total"), "params_trainable": s.get("params_trainable"),
            "tokens_per_s(tok/s)": tokens_per_s, "step_time(s)": step_time,
            "step_time_median(s)": C.finite_or_none(s.get("step_time_median_s")), "mfu": utilization,
            "step_time/adamw": ratio, "host_device(bytes)": s.get("host_device_bytes"),
            "train_loss": C.finite_or_none(s.get("train_loss")),
            "sampled_pcie_max_tx(KB/s)": sampled.get("max_tx(KB/s)"),
            "sampled_pcie_max_rx(KB/s)": sampled.get("max_rx(KB/s)"),
        }
        return C.CheckRecord(f"run/{spec.label}/{model}", "run", C.PASS, measured, {"completes": True},
                             "; ".join(notes) or None, spec.label, model, wall_s,
                             self._rel(self.session.run_id(spec.label, model, "train")))

    def _with_workspaces(self, live_peak: int | None) -> int | None:
        """A peak of live tensors as the allocator sees it: plus the cuBLAS/cuBLASLt workspaces."""
        return None if live_peak is None else live_peak + self.workspace_bytes

    def _rel(self, run_id: str) -> str:
        return str(Path("runs") / run_id)

    # ---- the other checks -------------------------------------------------------------------------------------
    def _smoke(self, check: PlannedCheck) -> list[C.CheckRecord]:
        raw = self.backend.smoke_tests(work_dir=self.session.logs_dir, timeout_s=max(self.budget.remaining(), 60))
        verdict, note = C.smoke_verdict(raw)
        measured = {k: raw.get(k) for k in ("passed", "failed", "errors", "skipped", "returncode")}
        return [C.CheckRecord(check.name, check.kind, verdict, {**measured, "wall(s)": raw.get("wall_s")},
                              {"failed": 0, "errors": 0, "passed": "> 0"}, note)]

    def _kernels(self, check: PlannedCheck) -> list[C.CheckRecord]:
        raws = self.backend.kernel_checks(work_dir=self.session.logs_dir)
        if not raws:
            return [C.CheckRecord(check.name, "kernel", C.ERROR, note="the kernel worker returned no results")]
        return [C.kernel_record(raw) for raw in raws]

    def _activation(self, check: PlannedCheck) -> list[C.CheckRecord]:
        hmt_act = next(m for m in METHODS if m.label == "hmt-act")
        times, peaks = {}, {}
        for spec in (hmt_act, FULL_CKPT):
            try:
                result = self._train(spec, check.model)
            except Exception as e:
                return [C.CheckRecord(check.name, check.kind, C.ERROR, model=check.model,
                                      note=f"the {spec.label} run crashed: {type(e).__name__}: {e}")]
            times[spec.label] = C.finite_or_none(result.summary.get("step_time_s"))
            peaks[spec.label] = (result.summary.get("memory") or {}).get("cuda_max_allocated_bytes")
        ratio = (times["hmt-act"] / times["hmt-full-ckpt"]
                 if times["hmt-act"] is not None and times["hmt-full-ckpt"] else None)
        return [C.CheckRecord(
            check.name, check.kind, C.at_most_verdict(ratio, C.ACTIVATION_TIME_TARGET),
            {"step_time_hmt(s)": times["hmt-act"], "step_time_full_ckpt(s)": times["hmt-full-ckpt"], "ratio": ratio,
             "cuda_max_allocated_hmt(bytes)": peaks["hmt-act"],
             "cuda_max_allocated_full_ckpt(bytes)": peaks["hmt-full-ckpt"]},
            {"ratio": f"<= {C.ACTIVATION_TIME_TARGET:g}"}, None if ratio is not None else "no step time measured",
            "hmt", check.model)]

    def _pcie(self, check: PlannedCheck) -> list[C.CheckRecord]:
        result = self._train(OFFLOAD, check.model)
        run_dir = self._rel(self.session.run_id(OFFLOAD.label, check.model, "train"))
        moved = result.summary.get("host_device_bytes")
        base = dict(method=OFFLOAD.label, model=check.model, run_dir=run_dir)
        records = [C.CheckRecord("pcie/host_device_bytes", "pcie", C.NOT_APPLICABLE if moved is None else
                                 (C.PASS if moved > 0 else C.MISS), {"host_device(bytes)": moved},
                                 {"host_device(bytes)": "> 0"}, **base)]
        logged = {key: [row[key] for row in result.metrics if row.get(key) is not None]
                  for key in ("pcie/tx_max(MB/s)", "pcie/rx_max(MB/s)")}
        sampled = result.pcie_sampled or {}
        measured = {"logged_pcie_max_tx(MB/s)": max(logged["pcie/tx_max(MB/s)"], default=None),
                    "logged_pcie_max_rx(MB/s)": max(logged["pcie/rx_max(MB/s)"], default=None),
                    "logged_steps": len(logged["pcie/tx_max(MB/s)"]),
                    "sampled_pcie_max_tx(KB/s)": sampled.get("max_tx(KB/s)"),
                    "sampled_pcie_max_rx(KB/s)": sampled.get("max_rx(KB/s)"), "sampled_samples": sampled.get("samples")}
        if not logged["pcie/tx_max(MB/s)"]:
            verdict, note = C.NOT_APPLICABLE, "the run logged no NVML PCIe counters (NVML unavailable?)"
        else:
            total = (measured["logged_pcie_max_tx(MB/s)"] or 0) + (measured["logged_pcie_max_rx(MB/s)"] or 0)
            beside = ("NVML was not polled beside the run" if not sampled else
                      f"NVML polled beside the run saw at most tx {sampled.get('max_tx(KB/s)')} / rx "
                      f"{sampled.get('max_rx(KB/s)')} KB/s")
            verdict, note = (C.PASS, None) if total > 0 else (
                C.MISS, "every logged NVML PCIe sample is 0 (the runner polls NVML through each step); " + beside)
        records.append(C.CheckRecord("pcie/nvml_counters", "pcie", verdict, measured,
                                     {"logged pcie tx + rx (MB/s)": "> 0"}, note, **base))
        return records

    def _rsvd(self, check: PlannedCheck) -> list[C.CheckRecord]:
        raw = dict(self.backend.rsvd_vs_svd(work_dir=self.session.logs_dir))
        error = raw.pop("error", None)
        if error:
            return [C.CheckRecord(check.name, check.kind, C.ERROR, raw, note=str(error))]
        return [C.CheckRecord(check.name, check.kind, C.INFO, raw, None, "basis refresh time; no target")]
