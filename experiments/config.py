"""Structured run configuration: frozen keyword-only dataclasses validated at composition time.

Hydra composes ``experiments/conf/run.yaml`` against mutable twins of these dataclasses (OmegaConf cannot merge
command-line overrides into a frozen node), so a typo'd key or a wrongly typed value fails at composition; then
``to_run_config`` builds the frozen objects, whose ``__post_init__`` checks values (non-positive steps, ...)
before any compute starts. Each error names the offending key.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments import cluster, methods
from experiments.config_checks import check_folder, one_of, positive
from experiments.model_cards import card_fields, card_names
from experiments.model_config import MODEL_PHASES, ModelConfig
from hmt_core.activations.policy import PRESETS, ActivationPolicy
from hmt_core.method import MethodConfig

RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._=+-]{0,199}")  # one directory below results_dir, never ".."
MODES = ("train", "dryrun")
RESERVE_MODES = ("modeled", "flat")
GPU_ARCHS = ("ampere", "ada", "hopper", "blackwell")  # experiments.memory.gpu_allowance
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("disabled", "offline", "online")
DIST_MODES = ("none", "ddp", "fsdp2")
DIST_BACKENDS = ("auto", "gloo", "nccl")
DIST_REFRESH = ("gather", "sketch")
OOM_POLICIES = ("fail", "replan")
SPIKE_POLICIES = ("fail", "lower_lr")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    name: str = "sotu"
    path: str | None = None  # local .txt / .jsonl / .parquet file or directory; None = built-in corpus
    text_field: str = "text"
    val_fraction: float = 0.05
    chunk_chars: int = 16_000  # local documents longer than this are cut at paragraph boundaries (0: never)
    min_year: int | None = None  # built-in corpus only: keep addresses from these years
    max_year: int | None = None
    cache_dir: str = "~/.cache/hmt"

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.chunk_chars < 0:
            raise ValueError(f"data.chunk_chars must be >= 0 (0: never cut documents), got {self.chunk_chars}")
        if self.path is not None:
            if not Path(self.path).expanduser().exists():
                raise FileNotFoundError(f"data.path does not exist: {self.path}")
        check_folder("data.cache_dir", self.cache_dir)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    seq_len: int = 128
    batch_size: int = 8
    grad_accum: int = 1
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    # the rate after warm-up: "cosine" to min_lr_ratio at `steps`, or "wsd" (warmup-stable-decay, Hägele et al.
    # 2024): constant, then linear to min_lr_ratio over the last `cooldown_frac` of the steps (experiments.loop)
    schedule: str = "cosine"
    cooldown_frac: float = 0.2
    max_grad_norm: float = 1.0  # 0 disables clipping
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    autocast: bool = True  # BF16 autocast where the device supports it
    progress: bool = True
    save_model: bool = False  # save the final model (Hugging Face format) + tokenizer to <run dir>/model
    checkpoint_every: int = 0  # steps between checkpoints (plus one at the end); 0: only on SIGTERM/SIGUSR1
    keep_checkpoints: int = 2  # newest checkpoints kept; 0 keeps all
    checkpoint_dir: str | None = None  # default <results_dir>/<run_id>/checkpoints
    resume: str = "auto"  # "auto" (newest good checkpoint, if any) | "never" | a checkpoint path
    max_bad_steps: int = 10  # consecutive steps with non-finite loss/gradient (each skipped) before the run fails
    fused_ce: bool = True  # loss from hidden states + lm_head in token chunks, logits never whole (hmt_core.fused_ce)
    ce_chunk_tokens: int = 1024  # tokens per chunk of the fused loss (logits held: ce_chunk_tokens x vocab)
    deterministic: str = "auto"  # torch deterministic algorithms: "auto" (on for CPU, off on CUDA) | "true" | "false"
    # out of memory (torch.OutOfMemoryError): "fail" | "replan" (experiments.replan: keep what was written, step down
    # to a leaner plan, resume from the last checkpoint; at most max_replans times)
    on_oom: str = "fail"
    max_replans: int = 3
    memory_cap_gib: float | None = None  # live device bytes the memory meter allows (it raises torch.OutOfMemoryError)
    # divergence (experiments.step_tally, docs/command_line.md): a step breaks a rule when, after warm-up, its loss
    # is above the step-0 loss + spike_loss_margin (nats) or its grad norm above spike_grad_factor x the norm's
    # running level, or (any step) its grad norm is exactly 0; max_spike_steps such steps in a row (0: no check) end
    # the run, status "diverged" (on_spike="fail"), or halve method.lr and resume from the last checkpoint
    # ("lower_lr", at most max_lr_drops times; experiments.replan)
    max_spike_steps: int = 5
    spike_loss_margin: float = 1.0
    spike_grad_factor: float = 100.0
    on_spike: str = "fail"
    max_lr_drops: int = 3
    confirm: bool = False  # train on a CPU even when the time model says a step takes > experiments.step_time.CONFIRM_S

    def __post_init__(self) -> None:
        positive("train", self, "steps", "seq_len", "batch_size", "grad_accum", "eval_every", "eval_batches",
                  "log_every", "ce_chunk_tokens")
        if self.seq_len < 2:
            raise ValueError(f"train.seq_len={self.seq_len} must be >= 2: the next-token loss needs at least one "
                             "input token and the token after it (with 1 every loss is NaN and every step skipped)")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        one_of("train", "schedule", self.schedule, SCHEDULES)
        if not 0 < self.cooldown_frac <= 1:
            raise ValueError(f"train.cooldown_frac must be in (0, 1] (the share of the steps the wsd schedule "
                             f"decays over), got {self.cooldown_frac}")
        if self.schedule == "wsd" and self.warmup_steps > self.steps - cooldown_steps(self.steps, self.cooldown_frac):
            raise ValueError(f"train.warmup_steps={self.warmup_steps} runs into the wsd cool-down, which starts at "
                             f"step {self.steps - cooldown_steps(self.steps, self.cooldown_frac)} of {self.steps}")
        if self.max_grad_norm < 0:
            raise ValueError(f"train.max_grad_norm must be >= 0, got {self.max_grad_norm}")
        for name in ("checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        positive("train", self, "max_bad_steps")
        if not self.resume:
            raise ValueError("train.resume must be 'auto', 'never' or a checkpoint path")
        deterministic = str(self.deterministic).lower()  # Hydra hands `train.deterministic=true` over as "True"
        if deterministic not in ("auto", "true", "false"):
            raise ValueError(f"train.deterministic must be auto, true or false, got {self.deterministic}")
        object.__setattr__(self, "deterministic", deterministic)
        one_of("train", "on_oom", self.on_oom, OOM_POLICIES)
        if self.max_replans < 0:
            raise ValueError(f"train.max_replans must be >= 0, got {self.max_replans}")
        if self.memory_cap_gib is not None and not self.memory_cap_gib > 0:
            raise ValueError(f"train.memory_cap_gib must be > 0 (GiB) or null, got {self.memory_cap_gib}")
        self._check_spike_rules()

    def _check_spike_rules(self) -> None:
        for name in ("max_spike_steps", "max_lr_drops"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.spike_loss_margin < float("inf"):
            raise ValueError(f"train.spike_loss_margin must be >= 0 (nats above the step-0 loss), got "
                             f"{self.spike_loss_margin}")
        if not 1 < self.spike_grad_factor < float("inf"):
            raise ValueError(f"train.spike_grad_factor must be > 1 (a multiple of the grad norm's running level), "
                             f"got {self.spike_grad_factor}")
        one_of("train", "on_spike", self.on_spike, SPIKE_POLICIES)
        if self.on_spike == "lower_lr" and self.max_spike_steps == 0:
            raise ValueError("train.on_spike=lower_lr needs train.max_spike_steps > 0 (0 turns the divergence "
                             "check off)")


SCHEDULES = ("cosine", "wsd")


def cooldown_steps(steps: int, cooldown_frac: float) -> int:
    """Steps of the wsd schedule's linear decay: ``cooldown_frac`` of ``steps``, rounded, at least 1."""
    return max(1, round(steps * cooldown_frac))


# Keys that never change a run's trajectory, left out of the default run_id so that a restart with
# e.g. train.resume=... lands in the same results directory.
RUN_ID_IGNORED_TRAIN_KEYS = ("progress", "checkpoint_every", "keep_checkpoints", "checkpoint_dir", "resume",
                             "max_bad_steps", "on_oom", "max_replans", "confirm", "max_spike_steps",
                             "spike_loss_margin", "spike_grad_factor", "on_spike", "max_lr_drops")

# Options added after results were recorded, with the default that computes what runs without them computed: at
# that default they are left out of the run id and of the resume check, so existing runs keep their ids and
# checkpoints (a configuration with another value is a different run, as usual).
# (dryrun.reserve, gpu_arch and expandable_segments only change how a dry run judges "fits", never a training
# trajectory.)
# ``method.impl`` (AdamW's kernels): runs recorded without it used torch's implicit choice (single-tensor on CPU,
# multi-tensor on CUDA); fused AdamW is the same formula with another rounding order (docs/dryrun-cuda.md).
# ``dryrun.device``: dry runs recorded without it traced fake CPU tensors (CPU kernels and CPU autocast).
# ``dist.bucket_mb``: ddp + per-layer hmt runs recorded without it all-reduced each gradient on its own (divided by W
# first); the buckets sum in fp32 and divide after, the same values for W = 2 and fp32 gradients.
# ``train.on_oom``, ``train.max_replans``, ``train.memory_cap_gib``: runs recorded without them failed on an OOM and
# had no meter-enforced cap.
# ``model.card``: runs recorded without it built the model from its phase shape or ``model.path``.
# ``method.dense_lr_scale`` (adamw): runs recorded without it had one learning rate for every parameter.
# ``train.max_spike_steps``, ``spike_loss_margin``, ``spike_grad_factor``, ``on_spike``, ``max_lr_drops``: runs
# recorded without them had no divergence check (the check only stops a run; a completed run computed the same).
# ``train.schedule``, ``train.cooldown_frac``: runs recorded without them used the cosine schedule.
# ``method.embedding_lr_scale`` (hmt): runs recorded without it updated the input embedding at ``method.lr``.
# ``method.vector_lr_scale``, ``method.head_lr_scale`` (hmt): runs recorded without them updated norm gains, biases
# and the LM head at ``method.lr``.
ADDED_WITH_DEFAULT = {("dist", "refresh"): "gather", ("dist", "bucket_mb"): 25.0,
                      ("train", "deterministic"): "auto",
                      ("dryrun", "reserve"): "modeled", ("dryrun", "gpu_arch"): "hopper",
                      ("dryrun", "expandable_segments"): False, ("method", "impl"): "fused",
                      ("dryrun", "device"): "cpu", ("train", "on_oom"): "fail", ("train", "max_replans"): 3,
                      ("train", "memory_cap_gib"): None, ("model", "card"): None,
                      ("method", "embedding_dtype"): "bf16", ("method", "embedding_update"): "dense",
                      ("method", "dense_lr_scale"): 1.0, ("method", "head_update"): "dense",
                      ("train", "max_spike_steps"): 5, ("train", "spike_loss_margin"): 1.0,
                      ("train", "spike_grad_factor"): 100.0, ("train", "on_spike"): "fail",
                      ("train", "max_lr_drops"): 3, ("train", "schedule"): "cosine",
                      ("train", "cooldown_frac"): 0.2, ("method", "weight_offload"): "none",
                      ("method", "embedding_lr_scale"): 1.0, ("method", "vector_lr_scale"): 1.0,
                      ("method", "head_lr_scale"): 1.0}


def without_added_defaults(plain: dict) -> dict:
    """``plain`` (a run config as nested dicts) without the ``ADDED_WITH_DEFAULT`` keys that hold their default."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in plain.items()}
    for (section, key), default in ADDED_WITH_DEFAULT.items():
        if isinstance(out.get(section), dict) and out[section].get(key, default) == default:
            out[section].pop(key, None)
    return out


@dataclass(frozen=True, kw_only=True)
class DryrunConfig:
    steps: int = 2  # optimizer steps traced; >= 2 puts lazily created state and a second step in the window
    # how "fits on an N GiB GPU" is judged: "modeled" = the caching allocator's predicted reserved bytes + the GPU
    # allowance lines (experiments.memory.gpu_allowance) for a gpu_arch GPU; "flat" = live peak + cuda_context_gib
    reserve: str = "modeled"
    gpu_arch: str = "hopper"
    expandable_segments: bool = False  # the replay as under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    cuda_context_gib: float = 1.0  # reserve=flat only: GiB for the CUDA context + allocator slack
    gpu_sizes_gib: tuple[int, ...] = (16, 24, 40, 80)
    top_modules: int = 10
    device: str = "cpu"  # target whose dispatch is traced: cuda | cpu (experiments.dryrun_device)

    def __post_init__(self) -> None:
        positive("dryrun", self, "steps", "top_modules")
        one_of("dryrun", "reserve", self.reserve, RESERVE_MODES)
        one_of("dryrun", "gpu_arch", self.gpu_arch, GPU_ARCHS)
        one_of("dryrun", "device", self.device, ("cuda", "cpu"))
        if self.cuda_context_gib < 0:
            raise ValueError(f"dryrun.cuda_context_gib must be >= 0, got {self.cuda_context_gib}")
        object.__setattr__(self, "gpu_sizes_gib", tuple(self.gpu_sizes_gib))
        if any(size <= 0 for size in self.gpu_sizes_gib):
            raise ValueError(f"dryrun.gpu_sizes_gib={list(self.gpu_sizes_gib)} must hold GPU memory sizes > 0 (GiB)")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    mode: str = "disabled"
    project: str = "hmt"
    entity: str | None = None

    def __post_init__(self) -> None:
        one_of("wandb", "mode", self.mode, WANDB_MODES)


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """Multi-process training launched by torchrun (``experiments.dist.parallel``); ``train.batch_size`` is global."""

    mode: str = "none"  # "none" | "ddp" (DistributedDataParallel) | "fsdp2" (fully_shard per decoder layer + root)
    backend: str = "auto"  # "auto": nccl on CUDA, gloo on CPU
    timeout_s: int = 600  # collective timeout: a hung peer fails the job after this long
    lowrank_comm: bool = False  # per-layer hmt Mode A under ddp: all-reduce Ĝ = Pᵀ G between refreshes, not G
    world_size: int | None = None  # mode=dryrun only: trace rank 0 of this many (fake process group, one process)
    refresh: str = "gather"  # fsdp2 + hmt basis refresh: "gather" the gradient (exact) | "sketch" (distributed rsvd)
    bucket_mb: float = 25.0  # ddp + per-layer hmt: fp32 gradient bucket size (MiB) of its async all-reduces (DDP's)

    def __post_init__(self) -> None:
        one_of("dist", "mode", self.mode, DIST_MODES)
        one_of("dist", "backend", self.backend, DIST_BACKENDS)
        one_of("dist", "refresh", self.refresh, DIST_REFRESH)
        positive("dist", self, "timeout_s")
        if not self.bucket_mb >= 0:
            raise ValueError(f"dist.bucket_mb must be >= 0 (0: one all-reduce per gradient), got {self.bucket_mb}")
        if self.world_size is not None:
            positive("dist", self, "world_size")
            if self.mode == "none":
                raise ValueError(f"dist.world_size={self.world_size} needs dist=ddp or dist=fsdp2")
        if self.lowrank_comm and self.mode != "ddp":
            raise ValueError(f"dist.lowrank_comm=true needs dist=ddp (got dist={self.mode})")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    method: MethodConfig  # the selected method's own frozen Config
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    wandb: WandbConfig
    dryrun: DryrunConfig
    activation: Any  # hmt_core.activations.ActivationPolicy
    seed: int = 0
    mode: str = "train"
    device: str = "auto"
    results_dir: str = "results"
    run_id: str | None = None  # default: <method>-<model>-<mode>-<hash of the config>
    force: bool = False  # re-run even if results/<run_id> is completed
    profile: bool = False
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        one_of("run", "mode", self.mode, MODES)
        one_of("run", "device", self.device, DEVICES)
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not self.results_dir.strip():
            raise ValueError(f"results_dir={self.results_dir!r} is empty: it would write the run into the current "
                             "directory; name a folder (default: results_dir=results)")
        if self.train.on_oom == "replan" and self.dist.mode != "none":
            raise ValueError(f"train.on_oom=replan needs dist=none (got dist={self.dist.mode}): one rank's "
                             "out-of-memory error is not agreed across ranks, so the others would wait in a collective")
        self.method.check(self)  # the method's settings against the rest of the run
        if self.run_id is not None and not RUN_ID.fullmatch(self.run_id):
            raise ValueError(f"run_id={self.run_id!r} must be one folder name: letters, digits and . _ = + - "
                             "(no '/', no leading '.' or '-', at most 200 characters)")


# ---- Hydra registration --------------------------------------------------------------------------------------
@functools.cache
def mutable_twin(cls: type) -> type:
    """A non-frozen dataclass with the same fields and defaults, for Hydra's ConfigStore."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        else:
            default = field(default="???")
        fields.append((f.name, _optional(hints[f.name]), default))
    return dataclasses.make_dataclass(cls.__name__, fields)


def _optional(tp: Any) -> Any:
    """``X | None`` -> ``typing.Optional[X]`` (the spelling OmegaConf understands)."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return typing.Optional[rest[0]] if len(rest) == 1 else Any
    return tp


def _instance_twin(obj: Any) -> Any:
    twin = mutable_twin(type(obj))
    return twin(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cluster.register(cs)
    schema = dataclasses.make_dataclass("RunSchema", [
        ("method", Any, field(default="???")),
        ("model", mutable_twin(ModelConfig), field(default="???")),
        ("data", mutable_twin(DataConfig), field(default="???")),
        ("train", mutable_twin(TrainConfig), field(default_factory=mutable_twin(TrainConfig))),
        ("wandb", mutable_twin(WandbConfig), field(default_factory=mutable_twin(WandbConfig))),
        ("dryrun", mutable_twin(DryrunConfig), field(default_factory=mutable_twin(DryrunConfig))),
        ("activation", Any, field(default="???")),
        ("dist", mutable_twin(DistConfig), field(default_factory=mutable_twin(DistConfig))),
        *[(f.name, _optional(typing.get_type_hints(RunConfig)[f.name]), field(default=f.default))
          for f in dataclasses.fields(RunConfig)
          if f.name not in ("method", "model", "data", "train", "wandb", "dryrun", "activation", "dist")],
    ])
    cs.store(name="run_schema", node=schema)
    for name, config_cls in methods.CONFIGS.items():
        cs.store(group="method", name=name, node=mutable_twin(config_cls))
    for name, phase in MODEL_PHASES.items():
        cs.store(group="model", name=name, node=_instance_twin(phase))
    for card in card_names():  # model=llama3.1-8b: a config-only folder under experiments/model_cards
        cs.store(group="model", name=card, node=_instance_twin(ModelConfig(**card_fields(card))))
    cs.store(group="data", name="sotu", node=mutable_twin(DataConfig))
    for name, policy in PRESETS.items():  # every key present, so `activation.attn_out=fp8` overrides one action
        cs.store(group="activation", name=name, node={"preset": name, **policy.to_dict()})
    for name in DIST_MODES:  # dist=ddp selects the mode; dist.backend=gloo overrides one key
        cs.store(group="dist", name=name, node=_instance_twin(DistConfig(mode=name)))


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Build (and so validate) the frozen run configuration from a composed Hydra config."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("hydra", None)
    method_raw = dict(raw.pop("method"))
    method_cfg = methods.make_config(method_raw)
    return RunConfig(method=method_cfg, model=ModelConfig(**raw.pop("model")), data=DataConfig(**raw.pop("data")),
                     train=TrainConfig(**raw.pop("train")), wandb=WandbConfig(**raw.pop("wandb")),
                     dryrun=DryrunConfig(**raw.pop("dryrun")), dist=DistConfig(**raw.pop("dist", {})),
                     activation=ActivationPolicy.from_dict(raw.pop("activation")), **raw)


def to_plain_dict(run: RunConfig) -> dict:
    return dataclasses.asdict(run)
