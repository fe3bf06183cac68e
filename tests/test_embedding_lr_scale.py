"""``method.embedding_lr_scale``: the input embedding (a tied table too) is updated at ``lr × scale``, every other
parameter at ``lr`` (μP's width-independent input rate; experiments.planner.recipe). One step from the same state
against two plain HMT runs: the table equals the run at ``lr × scale``, the rest the run at ``lr``, bit for bit, on
every path the table's update can take (dense, row-chunked, grouped under clipping, bitsandbytes 8-bit, row-sparse,
INT8 codes). ``method.vector_lr_scale`` likewise for the one-dimensional parameters (norm gains), and
``method.head_lr_scale`` for an untied LM head."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import batches
from hmt_core import hmt, int8_weights

LR, SCALE = 2e-3, 8.0
BASE = dict(mode="A", rank=4, basis="random", seed=3)
CASES = {
    "dense": dict(),
    "dense, not per layer": dict(per_layer=False),
    "dense, clipped (grouped AdamW)": dict(),
    "dense 8-bit (bitsandbytes)": dict(dense_8bit=True),
    "lazy_exact rows": dict(embedding_update="lazy_exact"),
    "INT8 table, 8-bit moments": dict(mode="B", embedding_dtype="int8", dense_8bit=True, scaling="tensor", rank=1),
    "tied table": dict(),
}


def _model(tied: bool, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).to(dtype)


def _one_step(cfg: hmt.Config, *, tied: bool, clip: float | None) -> dict[str, torch.Tensor]:
    dtype = torch.bfloat16 if cfg.embedding_dtype == "int8" else torch.float32
    model = _model(tied, dtype)
    method = hmt.make(cfg)
    method.prepare(model)
    method.attach(model, max_grad_norm=clip)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    method.step()
    emb = model.get_input_embeddings()
    table = {id(t) for t in [*emb.parameters(), *emb.buffers()]}
    return {("table:" if id(t) in table else "") + n: t.detach().clone()  # an INT8 weight's values: its codes
            for n, t in [*model.named_parameters(), *model.named_buffers()] if not int8_weights.is_phantom(t)}


def _mismatches(case: str, key: str) -> list[str]:
    """One step with ``method.<key>=SCALE`` against the runs at ``lr`` and ``lr × SCALE``: what breaks the rule that
    the scaled parameters (the table, the one-dimensional ones, or the head) equal the latter bit for bit and the
    rest the former, with the numbers (empty: it holds)."""
    cfg = hmt.Config(**{**BASE, **CASES[case]}, lr=LR)
    tied, clip = case == "tied table", (1e-3 if "clipped" in case else None)
    scaled = _one_step(dataclasses.replace(cfg, **{key: SCALE}), tied=tied, clip=clip)
    at_lr = _one_step(cfg, tied=tied, clip=clip)
    at_scaled_lr = _one_step(dataclasses.replace(cfg, lr=LR * SCALE), tied=tied, clip=clip)
    start = _one_step(dataclasses.replace(cfg, lr=1e-30), tied=tied, clip=clip)  # (a step that moves nothing)
    scaled_here = {"embedding_lr_scale": lambda n: n.startswith("table:"),
                   "vector_lr_scale": lambda n: scaled[n].dim() == 1 and not n.startswith("table:"),
                   "head_lr_scale": lambda n: n.startswith("lm_head.")}[key]
    tables = [n for n in scaled if scaled_here(n)]
    if not tables or len(tables) == len(scaled):
        return [f"{key} selects {len(tables)} of {sorted(scaled)}"]
    wrong = []
    for name, value in scaled.items():
        expected = (at_scaled_lr if name in tables else at_lr)[name]
        other = (at_lr if name in tables else at_scaled_lr)[name]
        if not torch.equal(value, expected):
            wrong.append(f"{name}: max diff {float((value.float() - expected.float()).abs().max())}")
        # the two references differ wherever a step moved the tensor: the comparison can tell the rates apart
        elif not torch.equal(start[name], expected) and torch.equal(value, other):
            wrong.append(f"{name}: the runs at lr and lr x scale are equal here")
    if all(torch.equal(start[n], scaled[n]) for n in tables):
        wrong.append(f"no parameter {key} scales moved")
    return wrong


@pytest.mark.parametrize("case", list(CASES))
def test_the_table_moves_at_lr_times_scale_and_the_rest_at_lr(case):
    wrong = _mismatches(case, "embedding_lr_scale")
    assert not wrong, (case, wrong)


@pytest.mark.parametrize("case", ["dense", "dense, not per layer", "dense, clipped (grouped AdamW)",
                                  "dense 8-bit (bitsandbytes)"])
def test_norm_gains_move_at_lr_times_vector_scale_and_the_rest_at_lr(case):
    wrong = _mismatches(case, "vector_lr_scale")
    assert not wrong, (case, wrong)


@pytest.mark.parametrize("case", ["dense", "dense, clipped (grouped AdamW)", "dense 8-bit (bitsandbytes)",
                                  "INT8 table, 8-bit moments"])
def test_an_untied_head_moves_at_lr_times_head_scale_and_the_rest_at_lr(case):
    wrong = _mismatches(case, "head_lr_scale")
    assert not wrong, (case, wrong)


def test_a_head_scale_on_a_tied_head_is_refused_in_one_line():
    method = hmt.make(hmt.Config(**BASE, head_lr_scale=0.5))
    model = _model(True, torch.float32)
    method.prepare(model)
    with pytest.raises(ValueError, match=r"head_lr_scale=0.5: the model has no separate LM head \(it is tied to "
                                         r"the input embedding: method.embedding_lr_scale sets its rate\)"):
        method.attach(model, max_grad_norm=None)


def test_a_bad_scale_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"method.embedding_lr_scale must be > 0, got 0"):
        hmt.Config(embedding_lr_scale=0)
    with pytest.raises(ValueError, match=r"method.vector_lr_scale must be > 0, got -1"):
        hmt.Config(vector_lr_scale=-1)
