"""What the memory planner may choose (``Space``, the planner keys of the same names) and one optimizer setting of
``method=hmt`` among them (``OptChoice``, with its vocabulary-memory settings ``Vocab``): the options the integer
program (``experiments.planner.milp``) picks one of, and the optimizer settings whose bytes are traced
(``opt_pieces``; the vocabulary settings' samples: ``experiments.planner.vocab``). Design: docs/planner.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MINI = {"mode": "B", "basis": "random", "scaling": "tensor", "rank": 1, "scale": 128.0}  # APOLLO-Mini (docs/dryrun.md)
CODECS = ("int8", "fp8", "int8_outlier", "int4_outlier")  # hmt_core.activations.codecs


@dataclass(frozen=True, kw_only=True)
class Space:
    """What the planner may choose (top-level planner keys of the same names). The vocabulary keys: the input
    embedding's and LM head's storage (``method.embedding_dtype``), the embedding's update
    (``method.embedding_update``; ``sparse_adam`` is another optimizer, offered only when listed), the head's update
    (``method.head_update``; ``in_loss`` only where Mode B projects the head); ``layer_inputs``: how full layer
    recomputation stores each layer's input (``activation.residual`` under ``layer_recompute``; ``int4_outlier``
    only when listed)."""

    modes: tuple[str, ...] = ("A", "B")  # "B" = APOLLO-Mini scaling (rank 1, tensor, scale 128)
    state_budgets: tuple[float, ...] = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4)  # Mode A: fractions of AdamW's state
    state_dtypes: tuple[str, ...] = ("fp32", "bf16")
    weight_dtypes: tuple[str, ...] = ("bf16", "int8")  # projected weights (method.weight_dtype)
    dense_8bit: tuple[bool, ...] = (False, True)
    project_head: tuple[bool, ...] = (False, True)
    actions: tuple[str, ...] = ("keep", "recompute", "int8")
    layer_recompute: tuple[bool, ...] = (False, True)
    embedding_dtypes: tuple[str, ...] = ("bf16", "int8")
    embedding_updates: tuple[str, ...] = ("dense", "lazy_exact")
    head_updates: tuple[str, ...] = ("dense", "in_loss")
    layer_inputs: tuple[str, ...] = ("keep", "int8")
    # method.weight_offload: "host" streams the decoder layers' weights (BF16, or INT8 codes and scales;
    # experiments.planner.streaming)
    weight_offloads: tuple[str, ...] = ("none",)
    max_batch_size: int = 1024
    # Mode B (APOLLO-Mini's tensor scale) on a projected lm_head: not offered unless asked for (``learns_at_scale``)
    mode_b_head: bool = False

    ALLOWED = {"modes": ("A", "B"), "state_dtypes": ("fp32", "bf16"), "weight_dtypes": ("bf16", "int8"),
               "dense_8bit": (False, True), "project_head": (False, True), "layer_recompute": (False, True),
               "actions": ("keep", "recompute", *CODECS), "embedding_dtypes": ("bf16", "int8"),
               "embedding_updates": ("dense", "lazy_exact", "sparse_adam"), "head_updates": ("dense", "in_loss"),
               "layer_inputs": ("keep", *CODECS), "weight_offloads": ("none", "host")}

    def __post_init__(self) -> None:
        for name in ("state_budgets", *self.ALLOWED):
            value = tuple(dict.fromkeys(getattr(self, name)))
            if not value:
                raise ValueError(f"{name} must list at least one choice")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "state_budgets", tuple(sorted(float(x) for x in self.state_budgets)))
        if not all(0 < x <= 1 for x in self.state_budgets):
            raise ValueError(f"state_budgets={list(self.state_budgets)}: fractions of AdamW's state in (0, 1]")
        for key, allowed in self.ALLOWED.items():
            bad = [v for v in getattr(self, key) if v not in allowed or isinstance(v, bool) != (allowed[0] is False)]
            if bad:
                raise ValueError(f"{key}={list(getattr(self, key))}: {bad[0]!r} is not one of {list(allowed)}"
                                 + (" (offload_cpu is not offered: a CPU dry run cannot verify device bytes moved "
                                    "to the host)" if bad[0] == "offload_cpu" else ""))
        if "keep" not in self.actions:
            raise ValueError(f"actions={list(self.actions)} must include keep")
        if not isinstance(self.mode_b_head, bool):
            raise ValueError(f"mode_b_head must be true or false, got {self.mode_b_head!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")


@dataclass(frozen=True, order=True)
class Vocab:
    """The vocabulary matrices' settings (docs/embedding_memory.md): storage of the input embedding and LM head,
    the embedding's update, the head's update."""

    embedding_dtype: str = "bf16"
    embedding_update: str = "dense"
    head_update: str = "dense"

    @property
    def key(self) -> str:
        return f"{self.embedding_dtype}:{self.embedding_update}:{self.head_update}"

    @property
    def lossy(self) -> int:
        """INT8 tables (stochastic rounding) and SparseAdam's rule change the loss; ``lazy_exact`` and the in-loss
        head update compute the same update as the dense path."""
        return int(self.embedding_dtype == "int8") + int(self.embedding_update == "sparse_adam")

    def method_changes(self) -> dict:
        return dataclasses.asdict(self)

    def label(self) -> str:
        parts = (["INT8 embedding and lm_head"] if self.embedding_dtype == "int8" else []) \
            + ([f"embedding rows {self.embedding_update}"] if self.embedding_update != "dense" else []) \
            + (["lm_head updated in the loss"] if self.head_update == "in_loss" else [])
        return ", ".join(parts)


DEFAULT_VOCAB = Vocab()


@dataclass(frozen=True, order=True)
class OptChoice:
    """One optimizer setting of ``method=hmt``: mode, state dtype, the projected state's budget (Mode A: a fraction
    of AdamW's state, within which HMT's allocator picks per-layer ranks; Mode B: APOLLO-Mini's fixed rank 1, no
    budget), whether ``lm_head`` is projected, bitsandbytes 8-bit AdamW for the dense weights, weight dtype, and the
    vocabulary matrices' settings."""

    mode: str
    dtype: str
    budget: float  # 0 for Mode B
    head: bool
    dense_8bit: bool
    weights: str
    vocab: Vocab = field(default=DEFAULT_VOCAB)
    offload: str = "none"  # method.weight_offload

    def method_changes(self, method) -> dict:
        targets = (method.attn_pattern, method.mlp_pattern) + (("lm_head",) if self.head else ())
        out = {"state_dtype": self.dtype, "dense_8bit": self.dense_8bit, "target_patterns": targets,
               "weight_dtype": self.weights, **self.vocab.method_changes(),
               **({"weight_offload": self.offload} if self.offload != "none" else {})}
        if self.mode == "B":
            return {**out, **MINI, "state_budget": None}
        return {**out, "mode": "A", "rank": None, "state_budget": repr(self.budget)}

    def label(self) -> str:
        state = "rank 1 (APOLLO-Mini)" if self.mode == "B" else f"state budget {self.budget:g} of AdamW's"
        vocab = self.vocab.label()
        return (f"Mode {self.mode}, {state}, lm_head {'projected' if self.head else 'dense'}, {self.dtype} state"
                + (", dense 8-bit" if self.dense_8bit else "") + (", INT8 weights" if self.weights == "int8" else "")
                + (f", {vocab}" if vocab else "")
                + (", weights streamed from the host" if self.offload == "host" else ""))


def families(space: Space) -> list[tuple[str, str]]:
    return [(m, d) for m in space.modes for d in space.state_dtypes]


def base_choice(mode: str, dtype: str, space: Space) -> OptChoice:
    return OptChoice(mode, dtype, 0.0 if mode == "B" else space.state_budgets[0], False, False, "bf16")


def opt_pieces(space: Space) -> dict[str, OptChoice]:
    """The optimizer settings to trace, per family (mode, state dtype): every (budget, head) pair, INT8 weights at
    every budget (head dense, with the head-dense sample it is measured against), and 8-bit dense state (head dense
    and projected) at the family's first budget."""
    out: dict[str, OptChoice] = {}
    for mode, dtype in families(space):
        base = base_choice(mode, dtype, space)
        for budget in (space.state_budgets if mode == "A" else (0.0,)):
            for head in space.project_head:
                out[f"opt:{mode}:{dtype}:{budget:g}:{'head' if head else 'dense'}"] = \
                    dataclasses.replace(base, budget=budget, head=head)
        if True in space.dense_8bit:
            for head in space.project_head:
                out[f"opt:{mode}:{dtype}:8bit:{'head' if head else 'dense'}"] = \
                    dataclasses.replace(base, head=head, dense_8bit=True)
        if "int8" in space.weight_dtypes:  # per budget: the budget is a fraction of the weights' own AdamW state
            for budget in (space.state_budgets if mode == "A" else (0.0,)):
                out[f"opt:{mode}:{dtype}:{budget:g}:int8"] = dataclasses.replace(base, budget=budget, weights="int8")
                # the INT8 delta is taken against the dense-head sample, also where the space projects the head only
                out.setdefault(f"opt:{mode}:{dtype}:{budget:g}:dense", dataclasses.replace(base, budget=budget))
    return out


def opt_key(choice: OptChoice, *, budget: float | None = None, head: bool | None = None) -> str:
    b = choice.budget if budget is None else budget
    h = choice.head if head is None else head
    return f"opt:{choice.mode}:{choice.dtype}:{b:g}:{'head' if h else 'dense'}"


def learns_at_scale(mode: str, head: bool, space: Space) -> bool:
    """Whether a (mode, projected head) pair is offered. Mode B's tensor scale on a projected ``lm_head`` puts the
    whole update norm ``√α·√V`` on the rows of the batch's tokens and raised an 8B proxy's loss 12.55 → 15.07 in one
    step (docs/head_update.md); APOLLO-Mini's published recipe leaves the head to AdamW, and so does the planner
    unless ``mode_b_head=true`` (a run that already has it, re-planned after an out-of-memory error, keeps it)."""
    return space.mode_b_head or not (mode == "B" and head)


def all_options(space: Space, vocab: dict[tuple[str, bool, bool], tuple[Vocab, ...]] | None = None) -> list[OptChoice]:
    """Every option of ``space``; ``vocab``: the vocabulary settings each (mode, projected head, 8-bit dense state)
    may take (``experiments.planner.vocab.admissible``: those of the space the app accepts for the run; None: the
    default only)."""
    out = []
    for mode, dtype in families(space):
        for budget in (space.state_budgets if mode == "A" else (0.0,)):
            for head in space.project_head:
                for eight in space.dense_8bit:
                    for weights in space.weight_dtypes:
                        if not learns_at_scale(mode, head, space):
                            continue
                        for v in ((DEFAULT_VOCAB,) if vocab is None else vocab.get((mode, head, eight), ())):
                            out += [OptChoice(mode, dtype, budget, head, eight, weights, v, offload)
                                    for offload in space.weight_offloads]
    return out
