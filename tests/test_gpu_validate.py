"""``python -m benchmarks.gpu_validate`` on CPU: its verdicts, MFU arithmetic, tables, results layout, orchestration
order and time budget, driven through a fake backend (canned summaries, misses, a crash, a fake clock); the
no-GPU one-liner through the real CLI; and the CUDA backend's runner calls on a micro model on CPU."""

import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu_validate import checks as C  # noqa: E402
from benchmarks.gpu_validate import report  # noqa: E402
from benchmarks.gpu_validate.cli import NO_GPU_LINE, parse_args, run_validation  # noqa: E402
from benchmarks.gpu_validate.orchestrate import RunFailed, RunResult  # noqa: E402
from benchmarks.gpu_validate.plan import (METHODS, Budget, Options, PlannedCheck, build_plan,  # noqa: E402
                                          train_overrides)
from experiments.results import RunDir  # noqa: E402

GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
DAY = date(2025, 1, 2)
SESSION = "nvidia-h100-80gb-hbm3-2025-01-02"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def canned(label, *, tracker=4.0, allocated=4.0, tokens_per_s=80_000.0, step_time=0.1, params=134_000_000,
           host_device=0):
    return {"run_id": label, "method": label.split("-")[0], "model": "125m", "mode": "train", "device": "cuda",
            "seed": 0, "params_total": params, "params_trainable": params, "steps": 10, "tokens": 81920,
            "tokens_per_s": tokens_per_s, "step_time_s": step_time, "step_time_median_s": step_time,
            "train_loss": 9.0, "val_loss": 9.1, "host_device_bytes": host_device,
            "memory": {"source": "cuda", "peak_bytes": int(allocated * GIB), "tracker_peak_bytes": int(tracker * GIB),
                       "cuda_max_allocated_bytes": int(allocated * GIB),
                       "cuda_max_reserved_bytes": int(allocated * 1.1 * GIB),
                       "nvml_used_bytes": int(allocated * 1.2 * GIB)}}


def dry(peak_gib, params=134_000_000, reserved_gib=None):
    return {"mode": "dryrun", "params_total": params, "memory": {"peak_bytes": int(peak_gib * GIB)},
            "dryrun": {"wall_s": 3.0, **({"predicted": {"peak_reserved_bytes": int(reserved_gib * GIB)}}
                                         if reserved_gib is not None else {})}}


class FakeBackend:
    """Canned answers; every call advances the fake clock and is logged in ``calls``. Training runs are written
    through the real results store (``RunDir``), as the runner would."""

    def __init__(self, clock, runs=None, dryruns=None, kernels=None, rsvd=None, metrics=None, durations=None,
                 device=H100, smoke=None):
        self.clock, self.device = clock, device
        self.runs, self.dryruns = runs or {}, dryruns or {}
        self.kernels = kernels if kernels is not None else [
            {"name": "codec/int8", "bit_identical": True, "kernel(ms)": 1.0, "fallback(ms)": 4.0}]
        self.rsvd = rsvd or {"svd(s)": 3.0, "rsvd(s)": 0.3, "speedup(x)": 10.0}
        self.metrics = metrics or {}
        self.smoke = smoke or {"returncode": 0, "passed": 23, "failed": 0, "errors": 0, "skipped": 0,
                               "failed_tests": [], "wall_s": 40.0}
        self.durations = {"run": 30.0, "dryrun": 10.0, "kernels": 20.0, "rsvd": 5.0, "smoke": 40.0,
                          **(durations or {})}
        self.calls: list[tuple[str, str]] = []

    def device_name(self):
        return self.device

    def device_info(self):
        return {"torch": "fake", "total_memory(bytes)": 80 * GIB}

    @staticmethod
    def _label(run_id, mode):
        body = run_id.removeprefix(SESSION + "-").removesuffix(f"-{mode}")
        return body.rsplit("-", 1)[0]  # drop the model

    def _answer(self, table, label, default):
        value = table.get(label, default)
        if isinstance(value, Exception):
            raise value
        return value

    def run_method(self, overrides, *, results_dir, run_id, log_path, timeout_s):
        assert "device=cuda" in overrides and timeout_s > 0
        label = self._label(run_id, "train")
        self.calls.append(("run", label))
        self.clock.now += self.durations["run"]
        moved = 5_000_000 if label == "hmt-offload" else 0  # bases parked in host memory cross PCIe
        summary = dict(self._answer(self.runs, label, canned(label, host_device=moved)), run_id=run_id)
        run_dir = RunDir(results_dir, run_id)
        run_dir.start({"method": {"name": summary["method"], "label": label}, "model": {"name": "125m"},
                       "mode": "train", "seed": 0, "train": {"steps": 10}, "run_id": run_id})
        for row in self.metrics.get(label, []):
            run_dir.log(row)
        run_dir.finish(summary)
        return RunResult(summary, self.metrics.get(label, []), None, str(run_dir.path))

    def dryrun(self, overrides, *, results_dir, run_id, log_path):
        assert "mode=dryrun" in overrides
        label = self._label(run_id, "dryrun")
        self.calls.append(("dryrun", label))
        self.clock.now += self.durations["dryrun"]
        return self._answer(self.dryruns, label, dry(4.0))

    def kernel_checks(self, *, work_dir):
        self.calls.append(("kernels", ""))
        self.clock.now += self.durations["kernels"]
        if isinstance(self.kernels, Exception):
            raise self.kernels
        return self.kernels

    def rsvd_vs_svd(self, *, work_dir):
        self.calls.append(("rsvd", ""))
        self.clock.now += self.durations["rsvd"]
        return self.rsvd

    def smoke_tests(self, *, work_dir, timeout_s):
        assert timeout_s > 0
        self.calls.append(("smoke", ""))
        self.clock.now += self.durations["smoke"]
        return self.smoke


def validate(tmp_path, backend, clock, *args):
    said = []
    code = run_validation(backend, parse_args(["--results-dir", str(tmp_path), *args]), clock=clock, day=DAY,
                          say=said.append)
    session = tmp_path / "gpu" / SESSION
    return code, json.loads((session / "gpu_validate.json").read_text()), session, "\n".join(said)


# ---------------------------------------------------------------------------------------------- pure arithmetic
def test_tolerance_verdicts_and_severity():
    assert C.ratio_verdict(103, 100, 0.03)[0] == C.PASS and C.ratio_verdict(97, 100, 0.03)[0] == C.PASS
    assert C.ratio_verdict(103.1, 100, 0.03)[0] == C.MISS and C.ratio_verdict(96.9, 100, 0.03)[0] == C.MISS
    verdict, ratio, _ = C.ratio_verdict(95, 100, 0.05)
    assert verdict == C.PASS and ratio == pytest.approx(0.95)
    assert C.ratio_verdict(None, 100, 0.03)[0] == C.NOT_APPLICABLE
    assert C.ratio_verdict(5, 0, 0.03)[0] == C.NOT_APPLICABLE
    assert C.at_most_verdict(0.8, 0.8) == C.PASS and C.at_most_verdict(0.81, 0.8) == C.MISS
    assert C.worst([C.PASS, C.MISS, C.NOT_APPLICABLE]) == C.MISS and C.worst([C.SKIPPED, C.ERROR]) == C.ERROR
    assert C.worst([C.NOT_APPLICABLE, C.PASS]) == C.PASS and C.worst([]) == C.NOT_APPLICABLE
    with pytest.raises(ValueError, match="unknown verdict"):
        C.CheckRecord("x", "run", "OK")


@pytest.mark.parametrize("name, arch", [
    ("NVIDIA H200", "hopper"), (H100, "hopper"), ("NVIDIA GH200 480GB", "hopper"), ("NVIDIA A100-SXM4-80GB", "ampere"),
    ("NVIDIA A10G", "ampere"), ("NVIDIA GeForce RTX 3090", "ampere"), ("NVIDIA RTX A6000", "ampere"),
    ("NVIDIA L4", "ada"), ("NVIDIA L40S", "ada"), ("NVIDIA GeForce RTX 4090", "ada"),
    ("NVIDIA RTX 6000 Ada Generation", "ada"), ("NVIDIA B200", "blackwell"), ("Tesla T4", None),
])
def test_gpu_generation_by_device_name(name, arch):
    assert C.gpu_arch(name) == arch
    assert C.modeled_workspace_bytes(name) == {None: 0, "ampere": 2 * (8519680 + 2**20), "ada": 2 * (8519680 + 2**20),
                                               "hopper": 2 * (2**25 + 2**20), "blackwell": 2 * (2**25 + 2**20)}[arch]


@pytest.mark.parametrize("name, tflops", [
    (H100, 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA L40S", 362), ("NVIDIA L4", 121),
    ("NVIDIA GeForce RTX 4090", None), ("NVIDIA L40", None)])
def test_peak_table_by_device_name(name, tflops):
    peak, note = C.peak_bf16_flops(name)
    assert (peak is None) == (tflops is None)
    if tflops is None:
        assert "unknown device" in note and "MFU left null" in note
    else:
        assert peak == tflops * 1e12


def test_mfu_arithmetic_and_slug():
    assert C.mfu(1_000_000_000, 10_000.0, 989e12) == pytest.approx(6e13 / 989e12)
    assert C.mfu(134_000_000, 80_000.0, None) is None and C.mfu(134_000_000, float("nan"), 989e12) is None
    assert C.mfu(None, 1.0, 1.0) is None and C.mfu(10, 0.0, 1.0) is None
    assert C.device_slug(H100) == "nvidia-h100-80gb-hbm3" and C.device_slug("  ") == "unknown-device"


def test_kernel_records_judge_codecs_bitwise_and_updates_by_tolerance():
    ok = C.kernel_record({"name": "codec/e4m3", "bit_identical": True, "kernel(ms)": 2.0, "fallback(ms)": 5.0})
    assert ok.verdict == C.PASS and ok.measured["speedup(x)"] == 2.5 and ok.target == {"bit_identical": True}
    assert C.kernel_record({"name": "codec/int8", "bit_identical": False}).verdict == C.MISS
    assert C.kernel_record({"name": "fused_update/bf16", "max_err(fp32 bound)": 0.5}).verdict == C.PASS
    assert C.kernel_record({"name": "fused_update/bf16", "max_err(fp32 bound)": 1.5}).verdict == C.MISS
    assert C.kernel_record({"name": "adam/fp32", "max_rel_err": 2e-5}).verdict == C.MISS
    crashed = C.kernel_record({"name": "projection/bf16", "error": "CompilationError: boom"})
    assert crashed.verdict == C.ERROR and "boom" in crashed.note
    assert C.kernel_record({"name": "new/op"}).verdict == C.INFO


# ---------------------------------------------------------------------------------------------- plan and budget
def test_plan_order_quick_methods_and_1b():
    names = [c.name for c in build_plan(Options())]
    assert names[0] == "cuda_smoke_tests"  # first: the smoke tests gate everything after them
    names = names[1:]
    assert names[:len(METHODS)] == [f"method/{m.label}/125m" for m in METHODS]
    assert names[len(METHODS):] == ["kernels", "activation_policy/hmt_vs_full_ckpt", "pcie/offload_bases",
                                    "rsvd_vs_svd"]
    quick = build_plan(Options(quick=True))
    assert [c.spec.label for c in quick if c.kind == "method"] == ["adamw", "hmt", "hmt-min"]
    assert {c.name: c.skip_reason for c in quick if c.skip_reason} == {
        "activation_policy/hmt_vs_full_ckpt": "left out by --quick", "rsvd_vs_svd": "left out by --quick"}
    big = build_plan(Options(methods=("adamw", "hmt"), with_1b=True))
    assert [c.name for c in big if c.model == "1b"] == ["method/adamw/1b", "method/hmt/1b"]
    assert all(c.optional for c in big if c.model == "1b") and not any(c.optional for c in big if c.kind == "method"
                                                                          and c.model == "125m")
    minimal = train_overrides(next(m for m in METHODS if m.label == "hmt-min"), "125m", Options())
    assert "method.target_patterns=[attn,mlp,lm_head]" in minimal and "train.max_grad_norm=0" in minimal
    assert "train.seq_len=1024" in minimal and "device=cuda" in minimal


def test_budget_estimates_learn_and_skip_optional_checks_first():
    clock = FakeClock()
    budget = Budget(100, clock)
    core = PlannedCheck("m", "method", "method@125m", False)
    optional = PlannedCheck("k", "kernels", "kernels", True)
    assert budget.skip_reason(core) is None and budget.skip_reason(optional) is None  # default 60 s < 100 s
    clock.now += 50
    assert "time budget near" in budget.skip_reason(optional)  # 60 s > 50 s left
    budget.observe("kernels", 10.0)
    assert budget.estimate("kernels") == 10.0 and budget.skip_reason(optional) is None
    assert budget.skip_reason(core) is None  # core checks run while any time is left
    clock.now += 60
    assert "time budget spent" in budget.skip_reason(core)


# ---------------------------------------------------------------------------------------------- whole validation
def scenario(clock):
    runs = {"galore": canned("galore", tracker=3.5, allocated=4.0),  # tracker 12.5 % low: MISS
            "hmt-min": RunFailed("experiments.run exited 1: CUDA out of memory (log: x.log)"),
            "hmt-act": canned("hmt-act", step_time=0.07), "hmt-full-ckpt": canned("hmt-full-ckpt", step_time=0.1),
            "adamw": canned("adamw", step_time=0.1, tokens_per_s=81_920.0),
            "hmt": canned("hmt", step_time=0.15),
            "hmt-offload": canned("hmt-offload", host_device=5_000_000)}
    dryruns = {"apollo": dry(4.5), "adamw": dry(4.0, reserved_gib=4.62)}  # apollo 12.5 % above the allocator: MISS
    metrics = {"hmt-offload": [{"step": 0, "pcie/tx_max(MB/s)": 0.0, "pcie/rx_max(MB/s)": 0.0},
                               {"step": 1, "pcie/tx_max(MB/s)": 0.0, "pcie/rx_max(MB/s)": 0.0}]}
    kernels = [{"name": "codec/int8", "bit_identical": True, "kernel(ms)": 1.0, "fallback(ms)": 4.0},
               {"name": "fused_update/bf16", "max_err(fp32 bound)": 3.0}]
    return FakeBackend(clock, runs, dryruns, kernels, metrics=metrics)


def test_full_validation_records_misses_and_the_crash_and_writes_everything(tmp_path):
    clock = FakeClock()
    backend = scenario(clock)
    code, doc, session, said = validate(tmp_path, backend, clock)
    assert code == 1  # one run crashed; the misses alone would exit 0
    labels = [m.label for m in METHODS]
    expected = [("smoke", "")] + [call for label in labels for call in
                ([("run", label)] + ([] if label in ("galore-8bit", "hmt-min") else [("dryrun", label)]))]
    expected += [("kernels", ""), ("run", "hmt-full-ckpt"), ("run", "hmt-offload"), ("rsvd", "")]
    assert backend.calls == expected  # hmt-act's run is reused by the activation check, never repeated
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["tracker_vs_allocated/galore/125m"]["verdict"] == "MISS"
    workspaces = 2 * (32 + 1) * 2**20  # an H100's cuBLAS + cuBLASLt workspaces, main and autograd threads
    assert checks["tracker_vs_allocated/galore/125m"]["measured"]["ratio"] == pytest.approx((3.5 * GIB + workspaces)
                                                                                           / (4 * GIB))
    assert checks["dryrun_vs_allocated/apollo/125m"]["verdict"] == "MISS"
    # the allocator replay's reserved bytes are recorded beside the verdict: 4.62 predicted / 4.4 GiB (1.1 x 4.0)
    adamw = checks["dryrun_vs_allocated/adamw/125m"]["measured"]
    assert adamw["reserved_ratio"] == pytest.approx(1.05), adamw
    assert checks["dryrun_vs_allocated/apollo/125m"]["measured"]["reserved_ratio"] is None  # predates the replay
    assert checks["dryrun_vs_allocated/galore-8bit/125m"]["verdict"] == "N/A"
    assert "GaLoreAdamW8bit" in checks["dryrun_vs_allocated/galore-8bit/125m"]["note"]
    assert checks["run/hmt-min/125m"]["verdict"] == "ERROR" and "out of memory" in checks["run/hmt-min/125m"]["note"]
    assert checks["dryrun_vs_allocated/hmt-min/125m"]["verdict"] == "SKIPPED"
    assert checks["kernel/fused_update/bf16"]["verdict"] == "MISS" and checks["kernel/codec/int8"]["verdict"] == "PASS"
    act = checks["activation_policy/hmt_vs_full_ckpt"]
    assert act["verdict"] == "PASS" and act["measured"]["ratio"] == pytest.approx(0.7)
    assert checks["pcie/host_device_bytes"]["verdict"] == "PASS"
    assert checks["pcie/nvml_counters"]["verdict"] == "MISS" and "sample is 0" in checks["pcie/nvml_counters"]["note"]
    assert checks["rsvd_vs_svd"]["verdict"] == "INFO" and checks["rsvd_vs_svd"]["measured"]["speedup(x)"] == 10.0
    assert doc["checks"][0]["name"] == "cuda_smoke_tests" and doc["checks"][0]["verdict"] == "PASS"
    assert doc["checks"][0]["measured"]["passed"] == 23
    adamw = checks["run/adamw/125m"]["measured"]
    assert adamw["mfu"] == pytest.approx(6 * 134_000_000 * 81_920 / 989e12)
    assert adamw["step_time/adamw"] == pytest.approx(1.0)
    assert checks["run/hmt/125m"]["measured"]["step_time/adamw"] == pytest.approx(1.5)
    assert checks["run/adamw/125m"]["run_dir"] == f"runs/{SESSION}-adamw-125m-train"
    # the document
    assert doc["schema"] == report.SCHEMA and doc["complete"] is True and doc["exit_code"] == 1
    assert doc["device"]["name"] == H100 and doc["device"]["peak_bf16_tflops"] == 989
    assert doc["counts"]["ERROR"] == 1 and doc["counts"]["MISS"] == 4
    rows = {r["method"]: r for r in doc["method_table"]}
    assert list(rows) == labels
    assert rows["galore"]["verdict"] == "MISS" and rows["hmt-min"]["verdict"] == "ERROR"
    assert rows["adamw"]["verdict"] == "PASS" and rows["qlora"]["verdict"] == "PASS"
    assert rows["adamw"]["allocated(GiB)"] == pytest.approx(4.0) and rows["adamw"]["dryrun/allocated"] == (4 * GIB + workspaces) / (4 * GIB)
    for record in doc["checks"]:
        assert set(record) == {"name", "kind", "verdict", "measured", "target", "note", "method", "model", "wall_s",
                               "run_dir"}
    # the markdown and the console table
    md = (session / "gpu_validate.md").read_text()
    assert "| method " in md and "tracker/alloc" in md and "kernel/fused_update/bf16" in md
    assert "ERROR run/hmt-min/125m" in md
    header = next(line for line in said.splitlines() if line.startswith("| method"))
    assert [h.strip() for h in header.strip("|").split("|")] == [h for _, h in report.TABLE_COLUMNS]
    galore_row = next(line for line in said.splitlines() if line.startswith("| galore "))
    assert "0.891" in galore_row and "MISS" in galore_row  # (3.5 GiB + 66 MiB of workspaces) / 4 GiB


def test_only_misses_exit_0_and_a_raising_worker_is_an_error(tmp_path):
    clock = FakeClock()
    runs = {"adamw": canned("adamw", tracker=3.0)}
    code, doc, _, _ = validate(tmp_path, FakeBackend(clock, runs), clock, "--quick")
    assert code == 0 and doc["counts"]["MISS"] == 1 and doc["counts"]["ERROR"] == 0
    clock = FakeClock()
    code, doc, _, _ = validate(tmp_path, FakeBackend(clock, kernels=RuntimeError("no triton")), clock, "--quick")
    assert code == 1 and {c["name"]: c for c in doc["checks"]}["kernels"]["note"] == "RuntimeError: no triton"


def test_time_budget_skips_remaining_optional_checks_with_the_reason(tmp_path):
    clock = FakeClock()
    backend = FakeBackend(clock, durations={"run": 100.0, "dryrun": 20.0, "smoke": 0.0})
    # quick: 3 core method checks of 120 s each -> 360 s of a 400 s budget; kernels (about 60 s) no longer fit,
    # the offload run (estimated 35 s) starts, then the 1b checks find the budget spent
    code, doc, _, said = validate(tmp_path, backend, clock, "--quick", "--with-1b", "--budget-s", "400")
    checks = {c["name"]: c for c in doc["checks"]}
    assert code == 0
    assert checks["kernels"]["verdict"] == "SKIPPED" and "time budget near" in checks["kernels"]["note"]
    assert checks["pcie/host_device_bytes"]["verdict"] == "PASS"  # the offload run started with 40 s left
    assert checks["rsvd_vs_svd"]["note"] == "left out by --quick"
    assert checks["run/adamw/1b"]["verdict"] == "SKIPPED" and "time budget spent" in checks["run/adamw/1b"]["note"]
    assert ("kernels", "") not in backend.calls and not any(label.endswith("1b") for _, label in backend.calls)
    assert [r["method"] for r in doc["method_table"]] == ["adamw", "hmt", "hmt-min"] * 2
    assert "SKIPPED run/adamw/1b" in said


def test_results_are_written_atomically_after_every_check(tmp_path, monkeypatch):
    seen = []
    real = report.atomic_write_text

    def spy(path, text):
        real(path, text)
        if path.name == report.JSON_NAME:
            seen.append(json.loads(path.read_text())["complete"])
        assert path.parent == tmp_path / "gpu" / SESSION

    monkeypatch.setattr(report, "atomic_write_text", spy)
    clock = FakeClock()
    validate(tmp_path, FakeBackend(clock), clock, "--quick")
    checks = len(build_plan(Options(quick=True)))
    assert len(seen) == checks + 1 and seen[-1] is True and not any(seen[:-1])  # after each check, then final
    session = tmp_path / "gpu" / SESSION
    assert sorted(p.name for p in session.iterdir()) == ["gpu_validate.json", "gpu_validate.md", "runs"]


def test_session_dir_is_not_a_run_and_its_runs_load_in_analysis(tmp_path):
    from analysis.load import load_results
    from analysis.rundirs import find_run_dirs

    clock = FakeClock()
    validate(tmp_path, FakeBackend(clock), clock, "--quick")
    found = find_run_dirs(tmp_path)
    assert found and all(p.parent == tmp_path / "gpu" / SESSION / "runs" for p in found)
    results = load_results(tmp_path)
    assert set(results.runs["device"]) == {"cuda"} and len(results.runs) == len(found)


def test_bf16_update_bound_admits_fp32_arithmetic_and_refuses_bf16_arithmetic():
    """Where W(1 − d) and c·A B nearly cancel, one fp32 evaluation rounded to bf16 is many bf16 ulps of the small
    result (the H200 measured 11 for the Triton kernel) yet within the fp32 bound; bf16 arithmetic is not."""
    import torch

    from benchmarks.gpu_validate import kernel_checks as K

    gen = torch.Generator().manual_seed(3)
    a = torch.randn(256, 64, generator=gen).bfloat16()  # (out, k)
    b = (torch.randn(64, 512, generator=gen) / 8).bfloat16()  # (k, in)
    decay, coef = 1e-3, 7.5e-3
    ab = a.double() @ b.double()
    w0 = (coef * ab / (1 - decay) * (1 + 1e-3 * torch.randn(256, 512, generator=gen).double())).bfloat16()
    ref = w0.double() * (1 - decay) - coef * ab
    allowed = K.fp32_then_bf16_bound(w0, a, b, ref, decay=decay, coef=coef)
    in_fp32 = (w0.float() * (1 - decay) - coef * (a.float() @ b.float())).bfloat16().double()
    in_bf16 = (w0 * (1 - decay) - (a @ b) * coef).double()
    ulp_err = float(((in_fp32 - ref).abs() / K._bf16_ulp(ref.abs())).max())
    fp32_ratio, bf16_ratio = (float(((x - ref).abs() / allowed).max()) for x in (in_fp32, in_bf16))
    assert ulp_err > 1, f"no cancellation in this case (fp32: {ulp_err:.3g} bf16 ulps)"
    assert fp32_ratio <= 1, f"fp32 arithmetic outside its own bound: {fp32_ratio:.3g}"
    assert bf16_ratio > 1, f"bf16 arithmetic within the fp32 bound ({bf16_ratio:.3g}): the bound is too loose"


def test_kernel_worker_comparisons_run_in_the_triton_interpreter_on_cpu():
    import torch

    from benchmarks.gpu_validate import kernel_checks as K

    small = dict(device="cpu", timings=False)
    raws = [K.codec_check(fmt, rows=2, cols=300, **small) for fmt in ("int8", "e4m3", "e5m2")]
    raws += [K.fused_update_check(dtype, shape=(37, 29, 5), **small) for dtype in (torch.bfloat16, torch.float32)]
    raws += [K.projection_check(shape=(37, 29, 5), **small), K.adam_check(shape=(33, 17), **small)]
    assert [r["name"] for r in raws] == [
        "codec/int8", "codec/e4m3", "codec/e5m2", "fused_update/bf16", "fused_update/fp32", "projection/bf16",
        "adam/fp32"]
    assert all(C.kernel_record(r).verdict == C.PASS for r in raws), raws
    refused = K.run_kernel_checks()  # TRITON_INTERPRET=1 here: never reported as a compiled-kernel pass
    assert len(refused) == 7 and all(C.kernel_record(r).verdict == C.ERROR for r in refused)
    rsvd = K.rsvd_vs_svd(64, 96, rank=8, components=32, repeats=1, device="cpu")
    assert "error" not in rsvd and rsvd["captured/exact_top_r_energy"] > 0.9 and rsvd["svd(s)"] > 0


# ---------------------------------------------------------------------------------------------- the real CLI / backend
def test_cli_without_a_gpu_prints_one_line_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_validate", "--results-dir", str(tmp_path / "r")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [NO_GPU_LINE] and proc.stderr == ""
    assert not (tmp_path / "r").exists()


MICRO = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=176",
         "model.vocab_size=512"]


def test_every_planned_setting_composes_into_a_valid_run_config():
    from hydra import compose, initialize_config_dir

    from benchmarks.gpu_validate.cuda_backend import CONF_DIR
    import importlib
    from benchmarks.gpu_validate.plan import FULL_CKPT, OFFLOAD, dryrun_overrides
    from experiments.config import to_run_config

    importlib.import_module("experiments.run")  # registers the config schemas with Hydra
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for spec in (*METHODS, FULL_CKPT, OFFLOAD):
            for overrides in (train_overrides(spec, "1b", Options()), dryrun_overrides(spec, "125m", Options())):
                run = to_run_config(compose("run", overrides=overrides))
                assert run.device == "cuda" and run.train.seq_len == 1024 and run.train.steps == 10
    assert run.mode == "dryrun" and run.method.offload_bases and run.method.per_layer


@pytest.mark.parametrize("runner", ["subprocess", "inprocess"])
def test_cuda_backend_runs_and_dry_runs_through_the_results_store_on_cpu(tmp_path, runner):
    from benchmarks.gpu_validate.cuda_backend import CudaBackend

    backend = CudaBackend(runner=runner)
    opts = Options(seq_len=32, batch_size=2, steps=4)
    spec = next(m for m in METHODS if m.label == "adamw")
    overrides = [o for o in train_overrides(spec, "tiny", opts) if o != "device=cuda"] + MICRO + ["device=cpu"]
    result = backend.run_method(overrides, results_dir=tmp_path, run_id="r", log_path=tmp_path / "logs" / "r.log",
                                timeout_s=300)
    assert result.summary["steps"] == 4 and result.summary["run_id"] == "r" and result.pcie_sampled is None
    assert [row["step"] for row in result.metrics] == [0, 1, 2, 3]
    if runner == "inprocess":
        summary = backend.dryrun(overrides + ["mode=dryrun"], results_dir=tmp_path, run_id="d",
                                 log_path=tmp_path / "logs" / "d.log")
        assert summary["memory"]["source"] == "fake" and summary["params_total"] == result.summary["params_total"]
    with pytest.raises(RunFailed, match="train.steps must be > 0"):
        backend.run_method(overrides + ["train.steps=0"], results_dir=tmp_path, run_id="bad",
                           log_path=tmp_path / "logs" / "bad.log", timeout_s=300)


def test_smoke_test_verdicts_and_the_junit_report(tmp_path):
    from benchmarks.gpu_validate.cuda_backend import read_junit

    ok = {"returncode": 0, "passed": 5, "failed": 0, "errors": 0}
    assert C.smoke_verdict(ok) == (C.PASS, None)
    verdict, note = C.smoke_verdict({**ok, "returncode": 1, "failed": 2, "failed_tests": ["a[x]", "b"]})
    assert verdict == C.MISS and note == "2 test(s) failed: a[x], b"
    assert C.smoke_verdict({**ok, "returncode": 1, "errors": 1, "failed_tests": ["c"]})[0] == C.ERROR
    assert C.smoke_verdict({"error": "pytest timed out after 60 s"}) == (C.ERROR, "pytest timed out after 60 s")
    assert C.smoke_verdict({**ok, "passed": 0, "skipped": 5})[0] == C.ERROR  # a GPU box that ran nothing
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
                   '<testcase name="t_ok"/><testcase name="t_bad[adamw]"><failure message="x"/></testcase>'
                   '<testcase name="t_skip"><skipped/></testcase><testcase name="t_ok2"/></testsuite></testsuites>')
    assert read_junit(xml) == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1, "failed_tests": ["t_bad[adamw]"]}


def test_failing_smoke_tests_are_a_miss_and_the_validation_goes_on(tmp_path):
    clock = FakeClock()
    smoke = {"returncode": 1, "passed": 20, "failed": 1, "errors": 0, "skipped": 0,
             "failed_tests": ["test_one_training_step_per_method[qlora]"], "wall_s": 30.0}
    code, doc, _, said = validate(tmp_path, FakeBackend(clock, smoke=smoke), clock, "--quick")
    first = doc["checks"][0]
    assert code == 0 and first["name"] == "cuda_smoke_tests" and first["verdict"] == "MISS"
    assert "test_one_training_step_per_method[qlora]" in first["note"] and first["measured"]["failed"] == 1
    assert {c["name"] for c in doc["checks"]} >= {"run/adamw/125m", "kernel/codec/int8"}
