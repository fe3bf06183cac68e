"""The planner's vocabulary-memory choices (docs/embedding_memory.md): INT8 input embedding and LM head
(``method.embedding_dtype=int8``), the embedding updated by the rows a batch touched (``method.embedding_update=
lazy_exact|sparse_adam``), the LM head updated inside the fused loss (``method.head_update=in_loss``).

Which of them a run may take (``admissible``): those the app accepts, decided by the app's own checks — HMT's
``Config`` and the run's ``RunConfig`` are built with the choice (their ``__post_init__`` refuse what the app
refuses: Mode B with a fixed-rank random basis for ``in_loss``, no gradient accumulation, one process, the fused
loss, per-layer updates, no master weights …) — and the model's facts the app checks when it attaches the method
(``model_facts``: tied input embedding and LM head, modules that are not a plain ``nn.Embedding`` / ``nn.Linear``,
a head narrower than its vocabulary).

Their bytes (``sample_name``, ``vocab_delta``): each admissible setting v is traced with the optimizer setting it
is conditioned on — mode, projected head, 8-bit dense state, at the family's first state dtype and budget, BF16
projected weights — at 1 and 2 layers and the main micro-batch, and differenced against the same setting with the
default vocabulary (a sample the planner traces anyway). The settings are traced jointly, not one at a time: the
step's peak moves between the fused loss (the head's gradient), the embedding's dense update and a decoder layer's
backward as they are switched on (docs/embedding_memory.md measured −0.52 GiB for the row update on top of the
in-loss head where each alone moves less), so their deltas do not add up; the state dtype, the state budget and
INT8 projected weights touch other tensors and stay additive (``experiments.planner.costs.option_cost``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.config import RunConfig
from experiments.models import build_model
from experiments.planner.space import DEFAULT_VOCAB, OptChoice, Space, Vocab, opt_key
from hmt_core.int8_weights.embedding import plain_embedding_error
from hmt_core.projection import which_sides

Combo = tuple[str, bool, bool]  # (mode, lm_head projected, 8-bit dense state): what a vocabulary delta depends on


def sample_name(mode: str, head: bool, eight: bool, v: Vocab) -> str:
    return f"vocab:{mode}:{'head' if head else 'dense'}:{'8bit' if eight else 'bf16'}:{v.key}"


def variants(space: Space) -> list[Vocab]:
    return [Vocab(*v) for v in itertools.product(space.embedding_dtypes, space.embedding_updates, space.head_updates)]


def model_facts(run: RunConfig, with_layers) -> dict:
    """What the app checks of the model itself when it attaches the vocabulary settings, from a 1-layer model on
    fake tensors (``with_layers``: ``experiments.planner.costs.layer_variants``)."""
    with contextlib.redirect_stderr(io.StringIO()), FakeTensorMode():
        model = build_model(with_layers(1).model, device="cpu")
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and getattr(head, "weight", None) is getattr(emb, "weight", None)
    plain = isinstance(emb, nn.Embedding) and emb.max_norm is None and not emb.sparse  # sparse_embedding.install
    rows = (None if plain
            else f"the input embedding is {type(emb).__name__} with max_norm or sparse gradients")
    return {"tied": tied, "int8_embedding": plain_embedding_error(emb, "input embedding"),
            "int8_head": None if head is None else plain_embedding_error(head, "LM head"), "rows": rows,
            "head_shape": None if head is None else list(head.weight.shape)}


def refusal(run: RunConfig, choice: OptChoice, facts: dict) -> str | None:
    """Why the app refuses ``choice`` for ``run`` (one line), or None: the model's facts, then HMT's ``Config`` and
    the ``RunConfig`` built with it (their own checks)."""
    v = choice.vocab
    tied = "the model ties its input embedding and LM head (one matrix)"
    if choice.head and facts["tied"]:  # HMT updates the shared table as the input embedding: a projected head
        return f"lm_head in method.target_patterns: {tied}, updated as the embedding"  # would be a label only
    if v.embedding_dtype == "int8" and (facts["tied"] or facts["int8_embedding"] or facts["int8_head"]):
        why = tied if facts["tied"] else facts["int8_embedding"] or facts["int8_head"]
        return f"method.embedding_dtype=int8: {why}"
    if v.embedding_update != "dense" and (facts["tied"] or facts["rows"]):
        return f"method.embedding_update={v.embedding_update}: {tied if facts['tied'] else facts['rows']}"
    if v.head_update == "in_loss":
        shape = facts["head_shape"]
        why = (tied if facts["tied"] else "there is no LM head" if shape is None
               else "the LM head must be projected (lm_head in method.target_patterns)" if not choice.head
               else f"it needs a vocabulary >= the hidden size, the head is {tuple(shape)}"
               if which_sides(tuple(shape), "one_sided") != (False, True) else None)
        if why:
            return f"method.head_update=in_loss: {why}"
    try:
        method = dataclasses.replace(run.method, **choice.method_changes(run.method))
        dataclasses.replace(run, method=method)
    except ValueError as e:
        return str(e)
    return None


def admissible(space: Space, run: RunConfig, facts: dict) -> dict[Combo, tuple[Vocab, ...]]:
    """Per (mode, projected head, 8-bit dense state) of ``space``: its vocabulary settings the app accepts for
    ``run`` (the default one included when the space lists it)."""
    out = {}
    for mode, head, eight in itertools.product(space.modes, space.project_head, space.dense_8bit):
        keep = []
        for v in variants(space):
            if v.head_update == "in_loss" and (mode != "B" or not head):
                continue  # needs Mode B's fixed-rank random basis on a projected head: not offered elsewhere
            if refusal(run, sample_choice(mode, head, eight, v, space), facts) is None:
                keep.append(v)
        out[(mode, head, eight)] = tuple(keep)
    return out


def first_refusal(space: Space, run: RunConfig, facts: dict) -> str | None:
    """Why the app refuses the first vocabulary setting of ``space`` it refuses (for an error message)."""
    for mode, head, eight in itertools.product(space.modes, space.project_head, space.dense_8bit):
        for v in variants(space):
            why = refusal(run, sample_choice(mode, head, eight, v, space), facts)
            if why:
                return why
    return None


def sample_choice(mode: str, head: bool, eight: bool, v: Vocab, space: Space) -> OptChoice:
    """The optimizer setting a vocabulary setting is traced with (the module docstring)."""
    return OptChoice(mode, space.state_dtypes[0], 0.0 if mode == "B" else space.state_budgets[0], head, eight,
                     "bf16", v)


def vocab_pieces(space: Space, vocab: dict[Combo, tuple[Vocab, ...]]) -> dict[str, OptChoice]:
    """The vocabulary samples to trace: each admissible setting but the default, per combination."""
    return {sample_name(*combo, v): sample_choice(*combo, v, space)
            for combo, vs in vocab.items() for v in vs if v != DEFAULT_VOCAB}


def base_name(choice: OptChoice) -> str:
    """The optimizer sample a vocabulary sample is differenced against: the same setting, default vocabulary."""
    if choice.dense_8bit:
        return f"opt:{choice.mode}:{choice.dtype}:8bit:{'head' if choice.head else 'dense'}"
    return opt_key(choice)


def vocab_delta(opt: dict[str, dict[str, float]], choice: OptChoice, space: Space) -> dict[str, float] | None:
    """GiB per phase that ``choice``'s vocabulary setting adds (``opt``: ``Derived.opt``), None for the default."""
    if choice.vocab == DEFAULT_VOCAB:
        return None
    traced = sample_choice(choice.mode, choice.head, choice.dense_8bit, choice.vocab, space)
    sample, base = opt[sample_name(choice.mode, choice.head, choice.dense_8bit, choice.vocab)], opt[base_name(traced)]
    return {p: sample[p] - base[p] for p in sample}


def to_record(vocab: dict[Combo, tuple[Vocab, ...]]) -> dict[str, list[str]]:
    """JSON form (the planner's record): ``{"B:head:8bit": ["int8:lazy_exact:in_loss", ...]}``."""
    return {f"{m}:{'head' if h else 'dense'}:{'8bit' if e else 'bf16'}": [v.key for v in vs]
            for (m, h, e), vs in vocab.items()}


def from_record(record: dict) -> dict[Combo, tuple[Vocab, ...]] | None:
    """``to_record``'s inverse (None for a record made before the vocabulary choices: the default only)."""
    if "vocab" not in record:
        return None
    return {(m, h == "head", e == "8bit"): tuple(Vocab(*k.split(":")) for k in keys)
            for (m, h, e), keys in ((name.split(":"), keys) for name, keys in record["vocab"].items())}
