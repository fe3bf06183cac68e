"""``hydra/sweeper=hmt``: Hydra multirun over command-line grids and sweep files, skipping completed runs.

    python -m experiments.run -m method=adamw,qlora model=125m,350m            # grid from the command line
    python -m experiments.run -m hydra.sweeper.file=paper_main cluster=slurm   # a sweep file (experiments/sweeps/)
    python -m experiments.run -m hydra.sweeper.file=paper_main train.steps=3   # file x command-line overrides

Every job is composed and validated before anything is launched; its run (``results_dir/run_id``, computed
exactly as the runner does) is skipped when already ``completed`` unless ``force=true``. All remaining jobs go
to the launcher in one call, so with ``cluster=slurm`` one sweep is one Slurm job array.

Bad input (an unknown sweep file, a malformed one, a run whose overrides name an unknown key or a wrongly typed
value) stops the sweep before anything is launched with one line ``error: ...`` naming the file, the run and the
override, and exit status 2, as ``python -m experiments.sweep`` does (``HYDRA_FULL_ERROR=1``: the traceback).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from experiments.errors import one_line_errors
from experiments.sweeps.tuning import is_search_run
from experiments.sweeps.sweep import checked, run_lookup, run_ref_from_config, split_completed, sweep_jobs, sweep_label

log = logging.getLogger(__name__)


class HMTSweeper(Sweeper):
    def __init__(self, file: Optional[str] = None) -> None:
        self.file = file
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.launcher = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        return one_line_errors(lambda: self._sweep(arguments))

    def _plan(self, arguments: List[str]) -> tuple[list, list]:
        """(jobs, their runs): every job of the sweep, composed and validated, duplicates dropped."""
        loader, label = self.hydra_context.config_loader, sweep_label(self.file)

        check_run = getattr(self.launcher, "check_run", None)  # the launcher's own limits (Slurm: task count)

        def ref_of(job: list) -> Any:
            cfg = loader.load_sweep_config(self.config, job)
            if check_run is not None:
                check_run(cfg)
            return run_ref_from_config(cfg)

        jobs, refs, seen = [], [], set()
        for index, job in enumerate(sweep_jobs(self.file, arguments, loader, lookup=run_lookup(ref_of))):
            ref = checked(f"run {index} of {label}: {' '.join(job)}", lambda job=job: ref_of(job))
            if ref.path in seen:
                log.warning(f"duplicate run {ref.run_id} ({' '.join(job)}): launched once")
                continue
            seen.add(ref.path)
            jobs.append(job)
            refs.append(ref)
        return jobs, refs

    def _sweep(self, arguments: List[str]) -> Any:
        """Launch what is not completed; then, for a tuned sweep whose learning-rate search has just finished
        (the local launcher waits for its jobs), plan again and launch the final runs it now lists. With an
        asynchronous launcher (Slurm) the search is still queued, so the final runs are launched by running the
        sweep again once it has finished."""
        assert self.config is not None and self.hydra_context is not None and self.launcher is not None
        launched: set = set()
        batches: list = []
        planned = self._plan(arguments)  # every run validated before anything is written or launched
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        while True:
            jobs, refs = planned if planned is not None else self._plan(arguments)
            planned = None
            launch, skipped = split_completed(jobs, refs)
            paths = {ref.path for ref in refs}
            launch = [job for job, ref in zip(jobs, refs) if job in launch and ref.path not in launched]
            if not batches:
                for job in skipped:
                    log.info(f"skip (completed; force=true re-runs it): {' '.join(job)}")
                log.info(f"{len(jobs)} runs: {len(launch)} to launch, {len(skipped)} completed and skipped")
            elif launch:
                log.info(f"{len(launch)} more runs now that the learning-rate search has finished")
            if not launch:
                break
            launched |= {ref.path for job, ref in zip(jobs, refs) if job in launch} & paths
            results = self.launcher.launch(launch, initial_job_idx=sum(len(b) for b in batches))
            batches.append(results)
            failed = [r for r in results if r.status == JobStatus.FAILED]
            if failed:
                log.error(f"{len(failed)} of {len(results)} runs failed")
        for results in batches:
            for r in results:
                if r.status == JobStatus.FAILED and is_search_run(r.overrides or []):
                    log.warning(f"learning-rate search run failed (counted as +inf): {' '.join(r.overrides)}")
                    continue
                _ = r.return_value  # re-raises the first failure, as Hydra's basic sweeper does
        return batches
