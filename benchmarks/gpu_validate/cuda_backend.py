"""The CUDA side of the validation: the only module that launches GPU work.

Training runs go through the normal runner, ``experiments.run``, and come back through the results store
(``summary.json``, ``metrics.jsonl``) — never from console output, which only goes to ``logs/<run_id>.log`` for
people to read:

- ``runner="subprocess"`` (default): one ``python -m experiments.run ...`` per run. A fresh process per method
  makes each run's allocator peaks, reserved bytes and NVML "used" (which counts every CUDA context on the device)
  that method's own, keeps one method's fragmentation or leaked references out of the next, and contains a crash:
  a CUDA OOM, or worse a sticky CUDA error (illegal address from a kernel, device-side assert) that poisons the
  CUDA context of the process it happens in, ends that run only. It costs a few seconds of start-up per run.
- ``runner="inprocess"``: ``experiments.execute.main_with_config`` on a Hydra ``compose`` (as ``tests/test_runner.py``
  does), the CUDA caching allocator emptied between runs — faster start-up, weaker isolation.

The CUDA smoke tests (``pytest -m cuda tests/test_cuda_smoke.py``) always run in a subprocess, first; their
outcome is read from pytest's JUnit XML report (``logs/cuda_smoke_tests.xml``), not from its console output.

Dry runs always run in this process: they trace on FakeTensorMode's CPU shape-only tensors and never touch the GPU.
Kernel checks and rSVD vs SVD run in a worker (``python -m benchmarks.gpu_validate.kernel_checks``) in subprocess
mode, so this process never creates a CUDA context of its own (it would add to the runs' NVML figures).

``TRITON_INTERPRET`` and ``HMT_KERNELS`` are removed from the children's environment: the runs and the kernel
checks exercise the default path (compiled Triton kernels on CUDA), whatever the calling shell set.
While a subprocess runs, NVML's PCIe throughput is polled beside it (``PcieSampler``), independently of what the
runner itself logs, so a PCIe counter check can tell "no traffic" from "sampled at an idle moment".
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from benchmarks.gpu_validate.orchestrate import RunFailed, RunResult
from experiments.memory.gpu_stats import first_visible_gpu_handle

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "experiments" / "conf"
STRIPPED_ENV = ("TRITON_INTERPRET", "HMT_KERNELS")
SMOKE_TESTS = REPO_ROOT / "tests" / "test_cuda_smoke.py"


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _nvml():
    """(pynvml, handle of the first visible GPU, from ``CUDA_VISIBLE_DEVICES``: masking is respected and CUDA is
    not initialised in this orchestrating process) or (None, None)."""
    return first_visible_gpu_handle()


class NvmlPoller:
    """Polls the first visible GPU through NVML every ``interval_s`` in a thread while a child process runs (this
    process never creates a CUDA context); a subclass reads what it needs in ``sample``."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml, self._handle = None, None

    def sample(self, nvml, handle) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample(self._nvml, self._handle)
            except Exception:  # counter not supported on this device/driver: stop sampling
                return

    def __enter__(self):
        self._nvml, self._handle = _nvml()
        if self._handle is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class PcieSampler(NvmlPoller):
    """NVML's PCIe TX/RX throughput (KB/s over NVML's ~20 ms window) while a run executes."""

    def __init__(self, interval_s: float = 0.05) -> None:
        super().__init__(interval_s)
        self.tx: list[float] = []
        self.rx: list[float] = []

    def sample(self, nvml, handle) -> None:
        self.tx.append(float(nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES)))
        self.rx.append(float(nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES)))

    def result(self) -> dict | None:
        if self._handle is None or not self.tx:
            return None
        n = min(len(self.tx), len(self.rx))
        return {"samples": n, "max_tx(KB/s)": max(self.tx[:n]), "max_rx(KB/s)": max(self.rx[:n]),
                "mean_tx(KB/s)": sum(self.tx[:n]) / n, "mean_rx(KB/s)": sum(self.rx[:n]) / n}


@contextlib.contextmanager
def _output_to(log_path: Path):
    """stdout and stderr of in-process work go to ``log_path`` (the console shows one line per check)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield


def read_junit(path: Path) -> dict:
    """Counts and failing test names from a pytest JUnit XML report."""
    suites = ET.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites.iter("testsuite"))
    counts = {key: sum(int(x.get(key, 0)) for x in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('name')}" for x in suites for case in x.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "failed_tests": failed}


def _compose_and_run(overrides: list[str]) -> dict | None:
    from hydra import compose, initialize_config_dir

    from experiments.execute import main_with_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("run", overrides=overrides)
    try:
        return main_with_config(cfg)
    except SystemExit as e:  # experiments.errors.ErrorExit: a one-line "error: ..." (bad setting, untraceable)
        raise RunFailed(str(e) or f"exit {e.code}") from None


def _failure(run_dir: Path | None, log_path: Path, what: str) -> RunFailed:
    """Why a run has no summary: the last line of its ``error.txt`` (traceback), else of its log, and where the log
    is."""
    why = ""
    # for the note only: no figure is ever read from a log
    for source in ([run_dir / "error.txt"] if run_dir is not None else []) + [log_path]:
        if source.exists():
            lines = [ln for ln in source.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
            if lines:
                why = f": {lines[-1].strip()[:300]}"
                break
    return RunFailed(f"{what}{why} (log: {log_path})")


class CudaBackend:
    def __init__(self, runner: str = "subprocess") -> None:
        if runner not in ("subprocess", "inprocess"):
            raise ValueError(f"runner must be 'subprocess' or 'inprocess', got {runner!r}")
        self.runner = runner

    # ---- device -----------------------------------------------------------------------------------------------
    def device_name(self) -> str:
        nvml, handle = _nvml()  # NVML first: no CUDA context in this process
        if handle is not None:
            name = nvml.nvmlDeviceGetName(handle)
            return name.decode() if isinstance(name, bytes) else str(name)
        import torch

        return torch.cuda.get_device_name(0)

    def device_info(self) -> dict:
        import torch

        info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device_count": torch.cuda.device_count(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        try:
            from importlib.metadata import version

            info["triton"] = version("triton")
        except Exception:
            info["triton"] = None
        nvml, handle = _nvml()
        if handle is not None:
            info["total_memory(bytes)"] = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            driver = nvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        return info

    # ---- runs -------------------------------------------------------------------------------------------------
    def run_method(self, overrides: list[str], *, results_dir: Path, run_id: str, log_path: Path,
                   timeout_s: float) -> RunResult:
        from experiments.results import read_metrics

        args = [*overrides, f"results_dir={results_dir}", f"run_id={run_id}", "force=true"]
        run_dir = Path(results_dir) / run_id
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with PcieSampler() as sampler:
            if self.runner == "subprocess":
                self._subprocess([sys.executable, "-m", "experiments.run", *args], log_path, timeout_s,
                                 run_dir=run_dir, what="experiments.run")
            else:
                try:
                    with _output_to(log_path):
                        _compose_and_run(args)
                finally:
                    import torch

                    torch.cuda.empty_cache()
        summary_path = run_dir / "summary.json"
        if not summary_path.exists():
            raise _failure(run_dir, log_path, "the run wrote no summary.json")
        return RunResult(json.loads(summary_path.read_text(encoding="utf-8")), read_metrics(run_dir),
                         sampler.result(), str(run_dir))

    def dryrun(self, overrides: list[str], *, results_dir: Path, run_id: str, log_path: Path) -> dict:
        args = [*overrides, f"results_dir={results_dir}", f"run_id={run_id}", "force=true"]
        with _output_to(log_path):
            summary = _compose_and_run(args)
        if summary is None:
            raise RunFailed(f"the dry run returned no summary (log: {log_path})")
        return summary

    @staticmethod
    def _subprocess(cmd: list[str], log_path: Path, timeout_s: float, *, run_dir: Path | None, what: str) -> None:
        with open(log_path, "w", encoding="utf-8") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=child_env(),
                                      timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise RunFailed(f"{what} timed out after {timeout_s:.0f} s (log: {log_path})") from None
        if proc.returncode != 0:
            raise _failure(run_dir, log_path, f"{what} exited {proc.returncode}")

    # ---- smoke tests, kernels, rSVD ---------------------------------------------------------------------------
    def smoke_tests(self, *, work_dir: Path, timeout_s: float) -> dict:
        if not SMOKE_TESTS.exists():
            return {"error": f"{SMOKE_TESTS} not found (run from a checkout of the repository)"}
        work_dir.mkdir(parents=True, exist_ok=True)
        junit, log_path = work_dir / "cuda_smoke_tests.xml", work_dir / "cuda_smoke_tests.log"
        junit.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", str(SMOKE_TESTS), "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}"]
        start = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, timeout=timeout_s,
                                      env={**child_env(), "TRITON_INTERPRET": "0"})  # conftest defaults it to 1
            except subprocess.TimeoutExpired:
                return {"error": f"pytest timed out after {timeout_s:.0f} s (log: {log_path})",
                        "wall_s": time.monotonic() - start}
        raw = {"returncode": proc.returncode, "wall_s": time.monotonic() - start, "junit": str(junit),
               "log": str(log_path)}
        if not junit.exists():
            return {**raw, "error": f"pytest exited {proc.returncode} without a report (log: {log_path})"}
        return {**raw, **read_junit(junit)}

    def _worker(self, what: str, work_dir: Path):
        if self.runner == "inprocess":
            from benchmarks.gpu_validate import kernel_checks

            with _output_to(work_dir / f"worker-{what}.log"):
                return kernel_checks.run_kernel_checks() if what == "kernels" else kernel_checks.rsvd_vs_svd()
        work_dir.mkdir(parents=True, exist_ok=True)
        out = work_dir / f"worker-{what}.json"
        out.unlink(missing_ok=True)
        self._subprocess([sys.executable, "-m", "benchmarks.gpu_validate.kernel_checks", what, "--out", str(out)],
                         work_dir / f"worker-{what}.log", 300, run_dir=None, what=f"the {what} worker")
        if not out.exists():
            raise RunFailed(f"the {what} worker wrote no {out.name} (log: {work_dir / f'worker-{what}.log'})")
        return json.loads(out.read_text(encoding="utf-8"))

    def kernel_checks(self, *, work_dir: Path) -> list[dict]:
        return self._worker("kernels", work_dir)

    def rsvd_vs_svd(self, *, work_dir: Path) -> dict:
        return self._worker("rsvd", work_dir)
