"""Row-sparse embedding updates (hmt_core.optim.row_adam, hmt_core.sparse_embedding): the lazy exact rule against
dense AdamW teacher-forced (same state, same gradients, step by step), the SparseAdam-style rule against
torch.optim.SparseAdam, and the HMT method's path (no (V, d) gradient, dense HMT's update on the touched rows)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hmt_core.hmt import Config, HMTMethod
from hmt_core.optim.row_adam import RowAdamConfig, RowAdamState, segment_rows

EPS32 = 2.0**-24  # fp32 unit roundoff


def _batches(steps: int, vocab: int, tokens: int, d: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: token ids (tokens,) drawn from half the vocabulary at a time (rows skip steps, some never appear,
    ids repeat) and the lookup's output gradient (tokens, d)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        low = (t % 3) * vocab // 4  # a sliding half of the vocabulary: each row is touched in some steps only
        ids = torch.randint(low, low + vocab // 2, (tokens,), generator=gen)
        out.append((ids, torch.randn(tokens, d, generator=gen) * 0.1))
    return out


def _lr(t: int) -> float:  # a varying schedule (warm-up then decay): the catch-up must follow each step's lr
    return 1e-2 * min(1.0, t / 4) * (0.9 ** max(0, t - 4))


def test_segment_rows_sums_duplicates_without_dense_buffer() -> None:
    ids = torch.tensor([5, 2, 5, 9, 2, 5])
    grad = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    ids_sorted, rows, sums = segment_rows(ids, grad)
    dense = torch.zeros(10, 2).index_add_(0, ids, grad)
    assert ids_sorted.tolist() == [2, 2, 5, 5, 5, 9]
    assert torch.equal(rows, dense[ids_sorted]), (rows, dense[ids_sorted])  # integers in fp32: exact
    assert torch.equal(sums[:3], dense[[2, 5, 9]]) and not sums[3:].any()


# window 4096: 16-row chunks (RowAdamState._chunks), so a step's 20 tokens span two chunks and runs of equal ids cross
# a chunk boundary
@pytest.mark.parametrize("style,eps,wd,window", [("torch", 1e-8, 0.1, 4096), ("hf", 1e-8, 0.1, 256),
                                                 ("torch", 1e-3, 0.0, 256), ("hf", 1e-3, 0.05, 4096)])
def test_lazy_exact_matches_dense_adamw_teacher_forced(style: str, eps: float, wd: float, window: int) -> None:
    """Dense AdamW (every row moves every step; untouched rows with a zero gradient) against the lazy rule, step by
    step from the same state: the rows a step reads (caught up first) and, at the end, every row. Tolerance: the
    documented ε-bound of each catch-up (``catch_up_bound``, summed per row over its catch-ups: errors in the weight
    add up, the moments' catch-up β^k is exact) plus fp32 rounding: each implementation rounds a row's weight once per
    step it writes and its update to a few ulps, so 16 ulps of (|W| + |update|) per step bounds their difference."""
    torch.manual_seed(0)
    vocab, d, tokens, steps = 48, 8, 20, 14
    cfg = RowAdamConfig(variant="lazy_exact", beta1=0.9, beta2=0.999, eps=eps, weight_decay=wd, style=style,
                        window=window)
    w0 = torch.randn(vocab, d)
    dense = nn.Parameter(w0.clone())
    ref = _reference(dense, eps=eps, wd=wd, style=style)
    lazy = w0.clone()
    state = RowAdamState(cfg, (vocab, d), dtype=torch.float32, device=torch.device("cpu"))
    bound = torch.zeros(vocab, d)
    moved = torch.zeros(())
    for t, (ids, g) in enumerate(_batches(steps, vocab, tokens, d), start=1):
        uniq = torch.unique(ids)
        bound[uniq] += state.catch_up_bound(uniq, t) if t > 1 else 0.0
        state.catch_up_(lazy, ids, t)  # what the forward reads
        slack = 16 * EPS32 * t * (dense.detach().abs() + 1e-2)  # 1e-2: the largest |lr · Adam update| per step
        err = (lazy[uniq] - dense.detach()[uniq]).abs()
        assert (err <= bound[uniq] + slack[uniq]).all(), (t, err.max().item(), bound[uniq].max().item())
        moved = torch.maximum(moved, (dense.detach() - w0).abs().max())
        ids_sorted, rows, _ = segment_rows(ids, g)
        state.step_rows_(lazy, ids_sorted, rows, t, _lr(t))
        dense.grad = torch.zeros(vocab, d).index_add_(0, ids, g)
        ref.param_groups[0]["lr"] = _lr(t)
        ref.step()
    every = torch.arange(vocab)
    bound += state.catch_up_bound(every, steps + 1)
    state.catch_up_(lazy, every, steps + 1)
    slack = 16 * EPS32 * steps * (dense.detach().abs() + 1e-2)
    err = (lazy - dense.detach()).abs()
    assert (err <= bound + slack).all(), (err.max().item(), bound.max().item(), slack.max().item())
    # the check can fail: the bound is well below how far dense AdamW moves the rows (ε = 1e-3 makes the ε-term
    # visible: ~3% of the movement; at ε = 1e-8 it is ~1e-9 of it)
    assert bound.max() < 0.05 * moved, (bound.max().item(), moved.item())


def _reference(p: nn.Parameter, *, eps: float, wd: float, style: str):
    """Dense AdamW in the style's arithmetic: torch.optim.AdamW, or the hf formula through hmt_core.adam."""
    if style == "torch":
        return torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=eps, weight_decay=wd, foreach=False)
    return _HFAdamW(p, eps=eps, wd=wd)


class _HFAdamW:
    def __init__(self, p: nn.Parameter, *, eps: float, wd: float) -> None:
        from hmt_core.adam import adam_moments_, adam_step, apply_update_

        self.p, self.eps, self.wd, self.t = p, eps, wd, 0
        self.m, self.v = torch.zeros_like(p), torch.zeros_like(p)
        self.fns = (adam_moments_, adam_step, apply_update_)
        self.param_groups = [{"lr": 1e-2}]

    @torch.no_grad()
    def step(self) -> None:
        moments, adam_step, apply = self.fns
        self.t += 1
        lr = self.param_groups[0]["lr"]
        moments(self.m, self.v, self.p.grad, 0.9, 0.999, "hf")
        d, size = adam_step(self.m, self.v, self.t, lr=lr, beta1=0.9, beta2=0.999, eps=self.eps, style="hf")
        apply(self.p.data, d, step_size=size, lr=lr, weight_decay=self.wd, style="hf")


def test_sparse_adam_matches_torch_sparse_adam() -> None:
    """``sparse_adam`` with the hf formula (ε outside the bias correction, as torch.optim.SparseAdam has it) against
    SparseAdam on the same sparse gradients, step by step. Tolerance: both round each touched row's fp32 update once
    per step in a different operation order: 16 ulps of (|W| + lr) per step."""
    vocab, d, tokens, steps = 40, 6, 16, 10
    w0 = torch.randn(vocab, d, generator=torch.Generator().manual_seed(1))
    p = nn.Parameter(w0.clone())
    ref = torch.optim.SparseAdam([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    cfg = RowAdamConfig(variant="sparse_adam", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, style="hf")
    state = RowAdamState(cfg, (vocab, d), dtype=torch.float32, device=torch.device("cpu"))
    rows_w = w0.clone()
    for t, (ids, g) in enumerate(_batches(steps, vocab, tokens, d, seed=3), start=1):
        ids_sorted, rows, sums = segment_rows(ids, g)
        state.step_rows_(rows_w, ids_sorted, rows, t, 1e-2)
        p.grad = torch.sparse_coo_tensor(ids[None], g, (vocab, d)).coalesce()
        ref.step()
        err = (rows_w - p.detach()).abs()
        tol = 16 * EPS32 * t * (p.detach().abs() + 1e-2)
        assert (err <= tol).all(), (t, err.max().item(), tol.min().item())
    assert not torch.equal(rows_w, w0)


class _TinyLM(nn.Module):
    """An embedding (untied), one projected linear and a head: HMT's slots for the three kinds."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mlp = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mlp(self.embed(ids))))


def _hmt_run(update: str, steps: int, *, clip: float | None) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """(the embedding's weight after ``steps`` steps, brought up to date; the shapes of every gradient autograd
    computed for it)."""
    torch.manual_seed(0)
    model = _TinyLM()
    method = HMTMethod(Config(rank=4, basis="svd", embedding_update=update, weight_decay=0.01, lr=1e-2))
    method.attach(model, max_grad_norm=clip)
    grads: list[tuple[int, ...]] = []
    model.embed.weight.register_hook(lambda g: grads.append(tuple(g.shape)) if g is not None else None)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        ids = torch.randint(0, 16, (2, 6), generator=gen)  # rows 16.. are never touched
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1).flatten())
        loss.backward()
        method.step()
        method.zero_grad()
    if method.rows is not None:
        method.rows.materialize()
    return model.embed.weight.detach().clone(), grads


@pytest.mark.parametrize("clip", [None, 0.5])
def test_hmt_lazy_exact_embedding_equals_dense_path(clip: float | None) -> None:
    """The method end to end: the embedding never gets a (V, d) ``.grad``, and after 4 steps (rows caught up) its
    weight equals the dense path's. Same model, data and order; the only differences are the gradient's summation
    (segment sums of the same tokens vs embedding_backward's) and the closed-form catch-up (fp32 rounding: 64 ulps of
    the weights' scale; the ε-term is exact here since each untouched row misses zero-gradient steps whose
    √v ≫ ε = 1e-8 — the bound's min(1, ε/(a√v)) factor is ~1e-6)."""
    dense, dense_grad = _hmt_run("dense", 4, clip=clip)
    lazy, lazy_grad = _hmt_run("lazy_exact", 4, clip=clip)
    assert dense_grad == [(32, 16)] * 4 and lazy_grad == [], (dense_grad, lazy_grad)
    err = (lazy - dense).abs().max().item()
    assert err <= 64 * EPS32 * dense.abs().max().item(), err


def test_embedding_update_refusals() -> None:
    with pytest.raises(ValueError, match="embedding_update"):
        Config(embedding_update="rows")
    with pytest.raises(ValueError, match="stochastic_rounding"):
        Config(embedding_update="lazy_exact", stochastic_rounding=True)
    with pytest.raises(ValueError, match="per_layer"):
        Config(embedding_update="sparse_adam", per_layer=False)
    model = _TinyLM()
    model.head.weight = model.embed.weight  # tied: the gradient is dense
    with pytest.raises(ValueError, match="tied"):
        HMTMethod(Config(rank=4, embedding_update="lazy_exact")).attach(model, max_grad_norm=None)


def test_fsdp2_takes_the_row_sparse_embedding_and_refuses_8bit_row_moments_in_one_line() -> None:
    """dist=fsdp2 checks this before any process starts (``experiments.dist.checks.check_fsdp2_hmt``); the table is
    left whole on every rank there (tests/test_fsdp2_rows.py), but ``dense_8bit`` stays refused under FSDP2."""
    from hmt_core.optim.sharded import sharded_config_error

    assert sharded_config_error(Config()) is None
    for variant in ("lazy_exact", "sparse_adam"):
        assert sharded_config_error(Config(embedding_update=variant)) is None
        assert sharded_config_error(Config(embedding_update=variant, embedding_dtype="int8")) is None
    why = sharded_config_error(Config(embedding_update="sparse_adam", dense_8bit=True))
    assert why is not None and why.startswith("method.dense_8bit=True") and "\n" not in why, why
