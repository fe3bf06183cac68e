"""HMT's Hydra plugins (Hydra only instantiates sweepers/launchers defined under the ``hydra_plugins`` package).

``sweeper.HMTSweeper`` (``hydra/sweeper=hmt``) and ``slurm_launcher.HMTSlurmLauncher`` (``hydra/launcher=hmt_slurm``,
chosen by ``cluster=slurm``). Their configs are registered by ``experiments.cluster.register``; the logic they
share with the CLI lives in ``experiments.sweeps.sweep``.
"""
