"""The INT8 embedding updated by rows (``method.embedding_dtype=int8`` with ``method.embedding_update=lazy_exact|
sparse_adam``; ``hmt_core.int8_weights.embedding.Int8Rows``, ``hmt_core.optim.row_adam``): teacher-forced, one step
at a time from the same state, against "dequantize everything → the fp32 row rule with fp32 moments → requantize",
no host synchronization, and the method end to end (no (V, d) gradient, checkpoints)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from experiments.dispatch_counter import DispatchCounter
from hmt_core.hmt import Config, HMTMethod
from hmt_core.int8_weights.codec import quantize
from hmt_core.int8_weights.embedding import Int8Embedding, Int8Rows
from hmt_core.optim.moments8 import Moments8, encode
from hmt_core.optim.row_adam import RowAdamConfig, RowAdamState, segment_rows
from hmt_core.precision import random_halfwords

VOCAB, D, TOKENS = 40, 300, 24  # d = 300: one whole block of 256 and a short one of 44 per row


def _batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: ids from a sliding half of the vocabulary (rows skip steps, ids repeat) and their gradient."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        low = (t % 3) * VOCAB // 4
        out.append((torch.randint(low, low + VOCAB // 2, (TOKENS,), generator=gen),
                    torch.randn(TOKENS, D, generator=gen) * 0.1))
    return out


def _fp32_copy(state: RowAdamState) -> RowAdamState:
    """The same rule's state with fp32 moments holding the (decoded) values of ``state``'s."""
    ref = RowAdamState(state.cfg, (VOCAB, D), dtype=torch.float32, device=torch.device("cpu"))
    every = torch.arange(VOCAB)
    ref.m, ref.v = (x.clone() for x in state.moments(every))
    for key in ("last", "lr_table", "log_decay"):
        if getattr(state, key) is not None:
            setattr(ref, key, getattr(state, key).clone())
    return ref


def _requantize(table: torch.Tensor, ids_sorted: torch.Tensor, state: RowAdamState,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(distinct touched rows, their codes, scales): each chunk of positions draws (n, D) halfwords, and the k-th row
    whose run of ids starts in the chunk rounds with the k-th of them (``Int8Rows.write``'s contract)."""
    first = torch.ones_like(ids_sorted, dtype=torch.bool)
    first[1:] = ids_sorted[1:] != ids_sorted[:-1]
    rows, noise = [], []
    for a, b in state._chunks(ids_sorted.numel(), D):
        drawn = random_halfwords((b - a, D), gen, device=table.device)
        starts = [p for p in range(a, b) if first[p]]
        rows += [int(ids_sorted[p]) for p in starts]
        noise.append(drawn[:len(starts)])
    rows_t = torch.tensor(rows)
    codes, scales = quantize(table[rows_t], 256, stochastic=True, noise=torch.cat(noise))
    return rows_t, codes, scales


@pytest.mark.parametrize("variant,eight_bit,window", [("lazy_exact", True, 256), ("lazy_exact", False, 4096),
                                                      ("sparse_adam", True, 4096), ("sparse_adam", False, 256)])
def test_int8_row_step_equals_dequantize_update_requantize(variant: str, eight_bit: bool, window: int) -> None:
    """Each step from the INT8 run's own state: the lookup's rows equal the fp32 rule's caught-up rows of the
    dequantized table (bit for bit: the same fp32 operations on the same values), and after the step the stored
    codes, scales (and 8-bit moment codes) equal the fp32 rule's result requantized — by stochastic rounding with
    the same draws for the weight, round-to-nearest on the dynamic map for the moments — bit for bit; untouched rows
    keep their codes. Window 4096: 16-position chunks, so runs of equal ids cross chunk boundaries."""
    emb = Int8Embedding.from_module(nn.Embedding(VOCAB, D, _weight=torch.randn(VOCAB, D) * 0.05), backend="torch")
    gen = torch.Generator().manual_seed(7)
    rows = Int8Rows(emb, lambda device: gen)
    cfg = RowAdamConfig(variant=variant, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, style="torch",
                        window=window)
    state = RowAdamState(cfg, (VOCAB, D), dtype=torch.float32, device=torch.device("cpu"), eight_bit=eight_bit)
    moved = 0
    for t, (ids, g) in enumerate(_batches(5), start=1):
        lr = 1e-2 * 0.8 ** t
        table = emb.dequantized(torch.float32)  # the state's values in fp32
        ref = _fp32_copy(state)
        read = state.caught_up(rows, ids, t)
        ref_read = copy.deepcopy(ref)
        ref_table = table.clone()
        ref_read.catch_up_(ref_table, ids, t)
        assert torch.equal(read, ref_table[ids]), (t, (read - ref_table[ids]).abs().max().item())

        ids_sorted, grad_rows, _ = segment_rows(ids, g)
        codes_before = emb.weight_codes.clone()
        ref_gen = torch.Generator().manual_seed(0)
        ref_gen.set_state(gen.get_state())
        state.step_rows_(rows, ids_sorted, grad_rows, t, lr)
        ref.step_rows_(table, ids_sorted, grad_rows, t, lr)  # fp32 table, fp32 moments
        touched, codes, scales = _requantize(table, ids_sorted, state, ref_gen)
        assert torch.equal(emb.weight_codes[touched], codes), (t, (emb.weight_codes[touched] != codes).sum().item())
        assert torch.equal(emb.weight_scales[touched], scales), t
        others = torch.ones(VOCAB, dtype=torch.bool)
        others[touched] = False
        assert torch.equal(emb.weight_codes[others], codes_before[others]), t
        moved += (codes != codes_before[touched]).sum().item()
        if eight_bit:
            for k, (mine, exp) in enumerate(((state.m, ref.m), (state.v, ref.v))):
                want, absmax = encode(exp[touched], state.bounds[k], 256)
                assert torch.equal(mine[touched], want), (t, k, (mine[touched] != want).sum().item())
                assert torch.equal((state.m_absmax, state.v_absmax)[k][touched], absmax), (t, k)
        else:
            assert torch.equal(state.m, ref.m) and torch.equal(state.v, ref.v), t
    assert moved > 0  # the steps change codes: the comparison can fail


def test_eight_bit_row_moments_are_moments8s_format() -> None:
    """The row moments' codes and absmax for some rows equal what the dense INT8 embedding's ``Moments8`` stores
    for the same values (one format: bitsandbytes' maps, 256-element blocks of a row), and decode the same."""
    x = torch.randn(6, D) * torch.logspace(-6, 0, 6)[:, None]
    eight = Moments8((6, D), torch.device("cpu"))
    eight.write(slice(0, 6), x, x.abs())
    cfg = RowAdamConfig(variant="sparse_adam", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, style="hf")
    state = RowAdamState(cfg, (VOCAB, D), dtype=torch.float32, device=torch.device("cpu"), eight_bit=True)
    ids = torch.tensor([3, 17, 0, 39, 8, 21])
    state._store_moments(ids, x, x.abs(), None)
    assert torch.equal(state.m[ids], eight.codes[0]) and torch.equal(state.v[ids], eight.codes[1])
    assert torch.equal(state.m_absmax[ids], eight.absmax[0]) and torch.equal(state.v_absmax[ids], eight.absmax[1])
    m, v = state.moments(ids)
    m8, v8 = eight.read(slice(0, 6))
    assert torch.equal(m, m8) and torch.equal(v, v8)
    # the map's resolution: within 1/2 code gap of the largest |x| of a block (~8% near 1, finer near 0)
    err = (m - x).abs().max().item()
    assert 0 < err <= 0.05 * x.abs().max().item(), err


def test_skipped_int8_row_step_changes_nothing_and_has_no_host_sync() -> None:
    """A step skipped on the device (``skip`` True): codes, scales, 8-bit moments and clock stay; the step (lookup
    and update) makes no host synchronization."""
    emb = Int8Embedding.from_module(nn.Embedding(VOCAB, D), backend="torch")
    gen = torch.Generator().manual_seed(1)
    rows = Int8Rows(emb, lambda device: gen)
    cfg = RowAdamConfig(variant="lazy_exact", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, style="torch")
    state = RowAdamState(cfg, (VOCAB, D), dtype=torch.float32, device=torch.device("cpu"), eight_bit=True)
    (ids1, g1), (ids2, g2) = _batches(2)
    state.step_rows_(rows, *segment_rows(ids1, g1)[:2], 1, 1e-2)
    before = [t.clone() for t in (emb.weight_codes, emb.weight_scales, *state.tensors())]
    skip = torch.tensor(True)  # the engine's device flag
    counter = DispatchCounter()
    with counter:
        state.caught_up(rows, ids2, 2)
        state.step_rows_(rows, *segment_rows(ids2, g2)[:2], 2, 1e-2, skip=skip)
    assert counter.report().host_syncs == 0, counter.report().sync_sites
    after = [emb.weight_codes, emb.weight_scales, *state.tensors()]
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if not (a.shape == b.shape and torch.equal(a, b))]
    assert changed == [7, 8], changed  # only the lr tables change (record_step: the lr of step 2 is known)


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mlp = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.embed = module

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def set_output_embeddings(self, module: nn.Module) -> None:
        self.head = module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mlp(self.embed(ids))))


@pytest.mark.parametrize("update", ["lazy_exact", "sparse_adam"])
def test_hmt_int8_embedding_by_rows_end_to_end(update: str) -> None:
    """HMT with the INT8 embedding and 8-bit row moments: the embedding never gets a ``.grad``, rows 16.. (never
    looked up) keep their codes under sparse_adam and decay under lazy_exact once materialized, and a checkpoint
    restored into a fresh method continues bit for bit."""
    def make():
        torch.manual_seed(0)
        model = _TinyLM()
        method = HMTMethod(Config(rank=4, basis="svd", embedding_dtype="int8", embedding_update=update,
                                  dense_8bit=True, weight_decay=0.1, lr=1e-2, kernels="torch"))
        model = method.prepare(model)
        method.attach(model, max_grad_norm=None)
        return model, method

    def step(model, method, ids):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1).flatten())
        loss.backward()
        method.step()
        method.zero_grad()

    model, method = make()
    codes0 = model.embed.weight_codes.clone()
    table0 = model.embed.dequantized(torch.float32)
    gen = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 16, (2, 6), generator=gen) for _ in range(5)]
    for ids in data[:3]:
        step(model, method, ids)
        assert model.embed.weight.grad is None
    assert not torch.equal(model.embed.weight_codes[:16], codes0[:16])
    assert torch.equal(model.embed.weight_codes[16:], codes0[16:])  # not read, not written (yet)
    saved = copy.deepcopy((model.state_dict(), method.state_dict()))
    for ids in data[3:]:
        step(model, method, ids)
    model2, method2 = make()
    model2.load_state_dict(saved[0])
    method2.load_state_dict(saved[1])
    for ids in data[3:]:
        step(model2, method2, ids)
    assert torch.equal(model.embed.weight_codes, model2.embed.weight_codes)
    assert torch.equal(model.embed.weight_scales, model2.embed.weight_scales)
    method.materialize_weights()
    untouched_moved = not torch.equal(model.embed.dequantized(torch.float32)[16:], table0[16:])
    assert untouched_moved == (update == "lazy_exact")  # weight decay 0.1 moves every row in dense AdamW (scales)


def test_int8_row_update_refusals() -> None:
    """What stays refused with the INT8 embedding, one line each."""
    for bad, key in (({"master_weights": True}, "master_weights"), ({"per_layer": False}, "per_layer")):
        with pytest.raises(ValueError, match=key) as err:
            Config(embedding_dtype="int8", embedding_update="lazy_exact", **bad)
        assert "\n" not in str(err.value)
    model = _TinyLM()
    model.head.weight = model.embed.weight
    method = HMTMethod(Config(rank=4, embedding_dtype="int8", embedding_update="sparse_adam"))
    with pytest.raises(ValueError, match="tied"):
        method.prepare(model)
