"""Where runs execute: the ``cluster`` config group (``local`` | ``slurm``) and HMT's sweeper/launcher configs.

* ``cluster=local`` (default): Hydra's basic launcher, jobs one after another in this process.
* ``cluster=slurm``: ``hydra/launcher=hmt_slurm``, i.e. hydra-submitit-launcher's ``submitit_slurm`` plus
  ``wait`` (default false: submit and return) and failure recording on the node
  (``hydra_plugins/hmt_sweeper/slurm_launcher.py``). A multirun is submitted as one Slurm job array.
  Knobs, set on the command line as ``hydra.launcher.<knob>=...``: see ``SlurmSettings``; every other
  ``submitit_slurm`` field (qos, account, constraint, gres, additional_parameters, ...) works too.
* Multi-process runs: ``hydra.launcher.nodes=N hydra.launcher.tasks_per_node=T`` with ``dist=ddp|fsdp2`` runs
  each run as N × T Slurm tasks (srun, one per GPU) forming one torch.distributed job; each task takes its
  rank and rendezvous from Slurm (``submitit.helpers.TorchDistributedEnvironment``) before the runner starts.

The cluster options only touch ``hydra.*``, never the run's own config, so they never change a ``run_id``.

    python -m experiments.run -m hydra.sweeper.file=paper_main cluster=slurm \\
        hydra.launcher.partition=gpu hydra.launcher.timeout_min=600 \\
        'hydra.launcher.setup=[module load cuda/12.4, source .venv/bin/activate]'

``register(cs)`` stores: ``cluster/local``, ``cluster/slurm``, ``hydra/launcher/hmt_slurm``, ``hydra/sweeper/hmt``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf


@dataclass
class SlurmSettings:
    """Defaults of ``cluster=slurm`` (one training run per array task)."""

    partition: Optional[str] = None
    nodes: int = 1  # nodes × tasks_per_node > 1: one torch.distributed job of that many processes (dist=ddp|fsdp2)
    tasks_per_node: int = 1  # processes per node (srun), one per GPU: each trains on cuda:LOCAL_RANK
    gpus_per_node: Optional[int] = 1
    cpus_per_task: Optional[int] = 8
    mem_gb: Optional[int] = 64
    timeout_min: int = 240
    array_parallelism: int = 32  # at most this many array tasks run at once (sbatch --array=...%N)
    setup: List[str] = field(default_factory=list)  # shell lines run in the sbatch script before the job
    name: str = "hmt"
    wait: bool = False  # true: block until every job ends (submitit; without Slurm accounting it warns that
    #                     sacct fails on every poll but still collects results from its own result files)


@dataclass
class HMTSlurmLauncherConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.hmt_sweeper.slurm_launcher.HMTSlurmLauncher"
    wait: bool = False


@dataclass
class HMTSweeperConf:
    _target_: str = "hydra_plugins.hmt_sweeper.sweeper.HMTSweeper"
    file: Optional[str] = None  # sweep file: a path, or a name under experiments/sweeps/


def slurm_option() -> dict:
    return {
        "defaults": [{"override /hydra/launcher": "hmt_slurm"}],
        "hydra": {"launcher": dataclasses.asdict(SlurmSettings())},
    }


def register(cs: ConfigStore) -> None:
    cs.store(group="hydra/sweeper", name="hmt", node=HMTSweeperConf, provider="hmt")
    cs.store(group="hydra/launcher", name="hmt_slurm", node=HMTSlurmLauncherConf, provider="hmt")
    cs.store(group="cluster", name="local", node={}, package="_global_", provider="hmt")
    cs.store(group="cluster", name="slurm", node=slurm_option(), package="_global_", provider="hmt")
