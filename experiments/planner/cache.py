"""The planner's cost table: dry-run trace samples stored by what changes them, committed and cached per trace.

A *group* is everything a trace's bytes depend on except the sample's own choices: the model's shape (the
``model`` node without its name and depth, or a ``model.path`` model's Hugging Face config without its depth),
``train``'s step settings (sequence length, autocast, fused loss), the dry run's steps and traced device
(``dryrun.device``, when not cpu), the run's other nodes that reach the step, plus ``METER_VERSION`` — never package
versions. Within a group an *entry* is one traced
point: decoder layers L, micro-batch b and the hash of the (method, activation) nodes it ran with; a few entries hold
what the model's shape alone gives (``weights:…``: parameter counts and bytes of the 1- and 2-layer models;
``flops``: forward FLOPs per region), so a planner answering from the table builds no model at all.

Two places hold groups, one JSON file each (``<model>-s<seq>-<group>.json``):
  ``results/plan/costs/``        the committed table (named models at the documented sequence lengths), read only
                                 by the planner; ``python -m experiments.plan <overrides> --table`` regenerates it
                                 and ``tests/test_plan_cache.py`` re-traces a sample of it (stale → fails)
  ``<results_dir>/plan_costs/``  the user's cache: every trace is written as soon as it is measured (atomically:
                                 a planner killed mid-way keeps its traces)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from experiments.config import RunConfig, to_plain_dict, without_added_defaults
from experiments.models import load_hf_config
from experiments.planner.recipe import RATE_KEYS
from experiments.results import atomic_write_text

SCHEMA = "hmt-plan-table/1"
# Bump when the meter, the dry-run step or a method changes the bytes a trace measures (the staleness test,
# tests/test_plan_cache.py, fails until the committed table is regenerated and this is bumped with it).
METER_VERSION = 5  # 5: traces of this version are 4 B larger in the optimizer phase (Mode B limiter and skip flag)
TABLE_DIR = Path(__file__).resolve().parents[2] / "results" / "plan" / "costs"
USER_DIR = "plan_costs"  # under results_dir
_RUN_DROP = ("mode", "results_dir", "run_id", "force", "wandb", "profile", "seed", "device", "data", "dist", "method",
             "activation")
_TRAIN_DROP = ("batch_size", "steps", "warmup_steps", "eval_every", "eval_batches", "log_every", "progress",
               "save_model", "checkpoint_every", "keep_checkpoints", "checkpoint_dir", "resume", "min_lr_ratio",
               "max_bad_steps", "deterministic", "confirm")
_HF_DROP = ("num_hidden_layers", "_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype")


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_shape(run: RunConfig) -> dict:
    """The model node as far as it shapes a trace: no name, no depth; a ``model.path`` or card model by its config."""
    node = without_added_defaults({"model": dataclasses.asdict(run.model)})["model"]
    for key in ("name", "num_layers", "path", "card"):
        node.pop(key, None)
    if run.model.hf_dir:  # a model.path folder or a model card's
        hf = load_hf_config(run.model.hf_dir).to_dict()
        node["hf_config"] = {k: v for k, v in hf.items() if k not in _HF_DROP}
    return node


def group_of(run: RunConfig) -> dict:
    """Everything but the sample's choices (module docstring) as plain data; options added later that hold their
    default (``experiments.config.ADDED_WITH_DEFAULT``) are left out, so adding one keeps the table valid."""
    plain = without_added_defaults(to_plain_dict(run))
    for key in _RUN_DROP:
        plain.pop(key, None)
    for key in _TRAIN_DROP:
        plain["train"].pop(key, None)
    plain["model"] = model_shape(run)
    # the traced device decides chunk sizes and kernels (``experiments.dryrun_device``): a cuda trace's bytes are
    # not a cpu trace's; the default (cpu) stays out of the key, so the tables made before it was keyed stay valid
    plain["dryrun"] = {"steps": run.dryrun.steps, **({"device": run.dryrun.device} if run.dryrun.device != "cpu"
                                                      else {})}
    return {"schema": SCHEMA, "meter_version": METER_VERSION, "run": plain}


def group_key(run: RunConfig) -> str:
    return _hash(group_of(run))


# ``RATE_KEYS`` change no byte a trace measures: keyed at their defaults, so any rate answers from the table


def at_default_rate(method):
    """``method`` with ``RATE_KEYS`` at its Config's defaults (the key of a plan whose recipe or user set a rate)."""
    defaults = {f.name: f.default for f in dataclasses.fields(method) if f.name in RATE_KEYS}
    return dataclasses.replace(method, **defaults) if defaults else method


def entry_key(layers: int, batch: int, method, policy) -> str:
    """One traced point of a group: depth, micro-batch and the (method, activation policy) it ran with (its rate
    at the default: ``at_default_rate``)."""
    node = without_added_defaults({"method": dataclasses.asdict(at_default_rate(method))})["method"]  # keys added
    # later, at default
    return f"L{layers}b{batch}:" + _hash({"method": node, "activation": policy.to_dict()})


def file_name(label: str, run: RunConfig, key: str) -> str:
    return f"{label}-s{run.train.seq_len}-{key}.json"


class Table:
    """The entries of one group from the committed table and the user's cache; ``put`` writes the user's file."""

    def __init__(self, run: RunConfig, label: str, user_dir: Path | None, overrides: list[str] | None = None) -> None:
        self.key = group_key(run)
        self.name = file_name(label, run, self.key)
        self.user_path = user_dir / self.name if user_dir is not None else None
        self.header = {"schema": SCHEMA, "group": self.key, "model": label, "seq_len": run.train.seq_len,
                       "overrides": list(overrides or []), "meter_version": METER_VERSION}
        self.committed = _entries(TABLE_DIR / self.name, self.key)
        self.user = _entries(self.user_path, self.key) if self.user_path is not None else {}

    def clear(self) -> None:
        """Measure everything again (``refresh_costs``, ``--table``)."""
        self.user, self.committed = {}, {}

    def get(self, key: str) -> dict | None:
        return self.user.get(key, self.committed.get(key))

    def memo(self, key: str, compute):
        """A value derived from the model's shape alone (weights, FLOPs), from the table or computed and cached."""
        hit = self.get(key)
        if hit is None:
            hit = {"value": json.loads(json.dumps(compute()))}
            self.put(key, hit, {"name": key})
        return hit["value"]

    def put(self, key: str, sample: dict, meta: dict) -> None:
        self.user[key] = {**sample, "sample": meta}
        if self.user_path is not None:
            write_entries(self.user_path, self.header, self.user)


def _entries(path: Path | None, key: str) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # a torn or foreign file: its traces are measured again
    if data.get("schema") != SCHEMA or data.get("group") != key:
        return {}
    return data.get("entries", {})


def write_entries(path: Path, header: dict, entries: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({**header, "entries": entries}, indent=1, sort_keys=True))


def committed_files() -> list[Path]:
    return sorted(TABLE_DIR.glob("*.json"))
