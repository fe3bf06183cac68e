"""``hydra/launcher=hmt_slurm``: hydra-submitit-launcher's Slurm launcher that need not block, and that records
failures in the run's own ``status``.

* ``wait=false`` (default): submit the sweep as one Slurm job array and return at once; follow it with
  ``python -m experiments.sweep status ...``. ``wait=true`` is submitit's behaviour: block until every job
  ends and raise the first failure (submitit polls ``sacct``; without Slurm accounting it warns on every poll
  and relies on its result files, which works for jobs that end normally).
* On the node, if the task raises before the runner wrote a final status (an error before the run started, an
  import error, ``SystemExit``), the run is marked ``failed`` with the traceback in ``error.txt``, so the failure
  is visible in results/ whatever Slurm reports for the job (rank 0 of a multi-process run alone records it).
* Multi-process runs (``nodes`` × ``tasks_per_node`` > 1, ``dist=ddp|fsdp2``): Slurm starts every task (srun, one
  per GPU) with the same job; before the runner starts, each exports torch.distributed's environment
  (``MASTER_ADDR`` = the first node, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) from Slurm's with
  ``submitit.helpers.TorchDistributedEnvironment``, so the runner's torchrun path (``experiments.dist.parallel``)
  takes over; rank 0 alone writes results. ``check_run`` refuses, before anything is submitted, a task count
  that the run's ``dist`` cannot use (``dist=none`` with more than one task, a global batch not divisible by
  it, more tasks per node than GPUs).
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class HMTSlurmLauncher(SlurmLauncher):
    def __init__(self, wait: bool = False, **params: Any) -> None:
        super().__init__(**params)
        self.wait = wait

    # ---- before submitting (every job of the sweep, composed) ----------------------------------------------
    def check_run(self, cfg: DictConfig) -> None:
        """One-line ``UserError`` when the run cannot use ``nodes`` × ``tasks_per_node`` processes."""
        from experiments.dist.checks import check_combination
        from experiments.errors import UserError
        from experiments.sweeps.sweep import validated_run_config

        run = validated_run_config(cfg)
        nodes, per_node = int(self.params.get("nodes") or 1), int(self.params.get("tasks_per_node") or 1)
        tasks, mode = nodes * per_node, run.dist.mode
        shape = f"hydra.launcher.nodes={nodes} × tasks_per_node={per_node} = {tasks} tasks per run"
        if tasks > 1 and mode == "none":
            raise UserError(f"{shape} but dist=none: every task would train the same model alone and write the "
                            "same results; add dist=ddp or dist=fsdp2, or use one task")
        if tasks > 1 and run.mode != "train":
            raise UserError(f"{shape} with mode={run.mode}: multi-process runs train only (a dry run is one "
                            "process: dist.world_size=N with one task)")
        gpus = self.params.get("gpus_per_node")
        if gpus and per_node > int(gpus):
            raise UserError(f"hydra.launcher.tasks_per_node={per_node} > gpus_per_node={gpus}: each task trains "
                            "on its own GPU (cuda:LOCAL_RANK); use tasks_per_node=gpus_per_node")
        if mode != "none" and run.mode == "train":
            check_combination(run, tasks)  # the global batch split, the method under this dist

    # ---- on the node (every task) ---------------------------------------------------------------------------
    def __call__(self, sweep_overrides: List[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: Dict[type, Singleton]) -> JobReturn:
        Singleton.set_state(singleton_state)  # as the parent class does first: the config loader needs it
        rank = export_torch_distributed_env(self._multi_process(sweep_overrides))
        try:
            ret = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        except BaseException as e:
            if rank == 0:
                self._record_failure(sweep_overrides, "".join(traceback.format_exception(e)))
            raise
        if ret.status == JobStatus.FAILED and rank == 0:
            self._record_failure(sweep_overrides, "".join(traceback.format_exception(ret._return_value)))
        return ret

    def _multi_process(self, overrides: List[str]) -> bool:
        """Whether this run trains under ``dist=ddp|fsdp2`` (then even one task gets torch.distributed's env)."""
        try:
            assert self.hydra_context is not None and self.config is not None
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            return str(cfg.dist.mode) != "none" and str(cfg.mode) == "train"
        except Exception:  # a config that fails here fails again, and is recorded, in the job itself
            return False

    def _record_failure(self, overrides: List[str], message: str) -> None:
        from experiments.config import to_plain_dict
        from experiments.sweeps.sweep import mark_failed, run_ref_from_config, validated_run_config

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


def export_torch_distributed_env(distributed: bool) -> int:
    """In a Slurm job of more than one task, or of one task of a ``dist=ddp|fsdp2`` run (``distributed``): set
    torch.distributed's ``env://`` variables from Slurm's (``submitit.helpers.TorchDistributedEnvironment``: the
    master is the first node, the port derived from the job id unless ``MASTER_PORT`` is set) and return this
    task's global rank; otherwise 0, nothing set (a ``dist=none`` run or dry run stays a plain process).
    ``CUDA_VISIBLE_DEVICES`` is left alone: the runner puts rank r on ``cuda:LOCAL_RANK`` of the node's GPUs."""
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks <= 1 and not distributed:
        return 0
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    print(f"torch.distributed from Slurm: task {env.rank} of {env.world_size} (local rank {env.local_rank}), "
          f"master {env.master_addr}:{env.master_port}", file=sys.stderr, flush=True)  # before logging is set up
    return env.rank
