"""The runner as a library: validate a composed config and run it end to end (``main_with_config``), as the command
(``experiments.run``), the planner's verification runs and the tests call it. Importing it registers the structured
configs with Hydra's ConfigStore (``experiments.config.register_configs``)."""

from __future__ import annotations

import contextlib
import os

import torch
from omegaconf import DictConfig

from experiments import methods
from experiments.checkpoint.manager import INTERRUPTED_EXIT_CODE, TooManyBadSteps, config_differences
from experiments.checkpoint.store import CheckpointError
from experiments.config import RunConfig, register_configs, to_plain_dict, to_run_config
from experiments.dist.parallel import release_process_groups
from experiments.dryrun import execute_dryrun
from experiments.errors import UserError, exit_with_error, one_line_errors, says_errors
from experiments.models import with_config_name
from experiments.replan import OutOfMemoryGiveUp
from experiments.results import RunDir, RunLock, check_writable, read_recorded_config, read_status, recorded
from experiments.runs import default_run_id, preflight, resolve_device
from experiments.step_tally import Diverged
from experiments.step_time import check_step_time
from experiments.train import execute_train


def check_completed(run_dir: RunDir, config_dict: dict) -> None:
    """A completed run of ``run_dir``'s id under another configuration is refused, naming the keys that differ:
    skipping it would pass off its results as this configuration's."""
    saved = read_recorded_config(run_dir.path)
    differences = config_differences(saved, recorded(config_dict)) if saved is not None else []
    if differences:
        shown = "; ".join(differences[:6]) + (f"; … {len(differences) - 6} more" if len(differences) > 6 else "")
        raise UserError(f"run_id={run_dir.run_id} already completed in {run_dir.path} with a different "
                        f"configuration ({shown}); force=true replaces its results with this configuration's, "
                        "or choose another run_id to keep them")


def run_lock(run: RunConfig, run_dir: RunDir):
    """The run folder's lock, taken by the process that writes it (under torchrun: rank 0)."""
    if run.dist.mode != "none" and not says_errors():  # rank 0 (or one process) writes, so it locks
        return contextlib.nullcontext()
    return RunLock(run_dir.path)


def execute(run: RunConfig, config_dict: dict) -> dict | None:
    """Run ``run`` end to end; returns the summary (None when skipped as already completed)."""
    preflight(run)
    root = check_writable(run.results_dir)
    device = resolve_device(run.device)
    check_step_time(run, device.type)  # a CPU run of many minutes per step asks first
    method = methods.make_method(run.method)
    run_id = run.run_id or default_run_id(run)
    run_dir = RunDir(root, run_id)
    with run_lock(run, run_dir):  # held until the run ends: a second process with this run_id is refused
        if read_status(run_dir.path) == "completed" and not run.force:
            check_completed(run_dir, config_dict)
            print(f"{run_id}: already completed in {run_dir.path} (force=true re-runs it)")
            return None
        if run.mode == "dryrun":
            return execute_dryrun(run, config_dict, method, run_dir, device)
        try:
            return execute_train(run, config_dict, method, run_dir, device)
        finally:  # the run's models and wrappers, which hold the process group, went with execute_train's frame
            release_process_groups()


def main_with_config(cfg: DictConfig) -> dict | None:
    """Validate, then execute; bad input and Ctrl-C end in one ``error:`` line (no traceback unless
    ``HYDRA_FULL_ERROR=1``) and a non-zero exit."""
    run = one_line_errors(lambda: with_config_name(to_run_config(cfg)), ValueError, TypeError, FileNotFoundError)
    try:
        return one_line_errors(lambda: execute(run, to_plain_dict(run)), PermissionError, FileNotFoundError,
                               CheckpointError)
    except (TooManyBadSteps, OutOfMemoryGiveUp) as e:  # status failed (diverged), error.txt and checkpoints kept
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        exit_with_error(f"training {'diverged' if isinstance(e, Diverged) else 'failed'}: {e}", code=1)
    except torch.OutOfMemoryError as e:  # train.on_oom=fail: status failed, error.txt and its checkpoints are kept
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        exit_with_error(f"training failed: out of memory ({(str(e).strip().splitlines() or ['no message'])[0]}); "
                        "train.on_oom=replan steps down to a leaner plan and resumes from the last checkpoint", code=1)
    except KeyboardInterrupt:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        exit_with_error("interrupted (Ctrl-C); checkpoints already written are kept", INTERRUPTED_EXIT_CODE)


register_configs()
