"""``hydra/launcher=hmt_slurm``: hydra-submitit-launcher's Slurm launcher that need not block, and that records
failures in the run's own ``status``.

* ``wait=false`` (default): submit the sweep as one Slurm job array and return at once; follow it with
  ``python -m experiments.sweep status ...``. ``wait=true`` is submitit's behaviour: block until every job
  ends and raise the first failure (submitit polls ``sacct``; without Slurm accounting it warns on every poll
  and relies on its result files, which works for jobs that end normally).
* On the node, if the task raises before the runner wrote a final status (an error before the run started, an
  import error, ``SystemExit``), the run is marked ``failed`` with the traceback in ``error.txt``, so the failure
  is visible in results/ whatever Slurm reports for the job.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any, Dict, List, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class HMTSlurmLauncher(SlurmLauncher):
    def __init__(self, wait: bool = False, **params: Any) -> None:
        super().__init__(**params)
        self.wait = wait

    def __call__(self, sweep_overrides: List[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: Dict[type, Singleton]) -> JobReturn:
        try:
            ret = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        except BaseException as e:
            self._record_failure(sweep_overrides, "".join(traceback.format_exception(e)))
            raise
        if ret.status == JobStatus.FAILED:
            self._record_failure(sweep_overrides, "".join(traceback.format_exception(ret._return_value)))
        return ret

    def _record_failure(self, overrides: List[str], message: str) -> None:
        from experiments.config import to_plain_dict
        from experiments.sweep import mark_failed, run_ref_from_config, validated_run_config

        try:
            assert self.hydra_context is not None and self.config is not None
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            mark_failed(run_ref_from_config(cfg), message, to_plain_dict(validated_run_config(cfg)))
        except Exception as e:  # the config itself may be what failed; the Slurm log still has the error
            log.error(f"could not record the failure in results/: {e}")

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if self.wait:
            return super().launch(job_overrides, initial_job_idx)
        import submitit

        assert self.config is not None
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=self.params["submitit_folder"],
                                         slurm_max_num_timeout=self.params["max_num_timeout"])
        base_keys = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{
            key if key in base_keys else f"{self._EXECUTOR}_{key}": value
            for key, value in self.params.items() if key not in ("submitit_folder", "max_num_timeout")})
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*job_params))
        array_id = jobs[0].job_id.split("_")[0] if jobs else "-"
        log.info(f"submitted {len(jobs)} runs as Slurm array {array_id}; not waiting (hydra.launcher.wait=true "
                 f"waits). Follow with: python -m experiments.sweep status <sweep file, or -> <the same overrides>")
        return [JobReturn(overrides=list(o), status=JobStatus.COMPLETED, _return_value=job.job_id)
                for o, job in zip(job_overrides, jobs)]
