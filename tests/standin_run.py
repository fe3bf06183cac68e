"""A stand-in for ``python -m experiments.run`` in the sweep tests: the same Hydra config (``experiments/conf/run.yaml``
with its cluster group and sweeper), the same run ids and the same results layout (``experiments.results.RunDir``),
but no training, so a sweep of it takes seconds. ``seed=666`` makes a run fail (recording it itself);
``seed=667`` makes it exit before writing anything. Its ``val_loss`` is a parabola in log10(``method.lr``) with its
minimum at ``STANDIN_BEST_LR`` (a learning-rate search has a known answer), and a rate ≥ ``STANDIN_DIVERGES_LR``
fails like a diverged run. Every run that starts appends its
run id to ``<results_dir>/launched.txt``, so a test can count what was (re)launched.

    python tests/standin_run.py -m hydra.sweeper.file=<sweep> results_dir=<dir> [cluster=slurm ...]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from experiments import execute  # noqa: E402,F401  (registers every config, the cluster group included)
from experiments.config import to_plain_dict, to_run_config  # noqa: E402
from experiments.results import RunDir, read_status  # noqa: E402
from experiments.runs import default_run_id  # noqa: E402

FAILING_SEED = 666  # fails like a crash during training: the run writes status failed itself
DIES_BEFORE_START_SEED = 667  # exits before writing anything, like the runner's config/device errors
STANDIN_BEST_LR, STANDIN_DIVERGES_LR = 3e-3, 0.1


@hydra.main(version_base=None, config_path=str(REPO / "experiments" / "conf"), config_name="run")
def main(cfg: DictConfig) -> None:
    run = to_run_config(cfg)
    run_id = run.run_id or default_run_id(run)
    run_dir = RunDir(Path(run.results_dir), run_id)
    if read_status(run_dir.path) == "completed" and not run.force:
        return
    with open(Path(run.results_dir) / "launched.txt", "a") as f:
        f.write(run_id + "\n")
    if run.seed == DIES_BEFORE_START_SEED:
        raise SystemExit("error: stand-in run died before starting")
    run_dir.start(to_plain_dict(run))
    if run.seed == FAILING_SEED:
        run_dir.fail("RuntimeError: stand-in run made to fail\n")
        raise RuntimeError("stand-in run made to fail")
    if run.method.lr >= STANDIN_DIVERGES_LR:
        run_dir.fail("stand-in run diverged\n")
        raise RuntimeError("stand-in run diverged")
    val_loss = 1.0 + (math.log10(run.method.lr) - math.log10(STANDIN_BEST_LR)) ** 2 + 1e-3 * run.seed
    run_dir.log({"step": 0, "loss/train": 1.0})
    run_dir.finish({"run_id": run_id, "method": run.method.name, "model": run.model.name, "mode": run.mode,
                    "seed": run.seed, "steps": 1, "val_loss": val_loss, "memory": {"peak_bytes": 1, "source": "fake"}})


if __name__ == "__main__":
    main()
