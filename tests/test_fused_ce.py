"""Fused linear + cross-entropy (``hmt_core.fused_ce``) against the models' own ``labels=`` loss: loss and gradients
(hidden states, head weight, bias; tied embeddings) for every architecture the harness builds and the logit maps it
knows, in fp32 and under BF16 autocast, with ignored tokens and a chunk size that does not divide the token count;
every method sees the plain path's gradients (hooks fire as usual); the meter shows the logits gone from the step's
peak, and a FakeTensorMode dry run of the fused step equals the real one.

Tolerances (relative to the largest magnitude of the reference tensor, printed on failure):
* fp32: the two paths compute the same sums in other orders and blockings — a logit is an H-term dot product, the
  log-sum-exp a V-term sum, the mean an N-term sum, a hidden gradient a V-term sum (split into vocabulary blocks), a
  weight gradient an N-term sum — and a reordered n-term fp32 sum moves by at most n·u₃₂ of its terms' magnitudes
  (u₃₂ = 2⁻²⁴), so ``(H + V + N)·u₃₂``. Upstream of the head both paths run identical ops on those inputs.
* BF16 autocast: both paths round the logits and δ = ∂loss/∂logits to BF16 (u = 2⁻⁸) and round each gradient
  matmul's output to BF16; the fused path also rounds each of its ``nb`` vocabulary blocks' hidden-gradient
  partials to BF16 before summing them in fp32, so gradients agree to ``(nb + 2)·u``. A logit whose fp32
  accumulation lands on the other side of a BF16 rounding boundary in the two matmul shapes moves by one BF16 ulp
  (2⁻⁷·|z|), so the losses agree to ``2⁻⁷·max|z|`` plus the fp32 reordering term.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn

from experiments import methods
from experiments.config import ModelConfig, TrainConfig, register_configs, to_run_config
from experiments.dryrun import trace_steps
from experiments.errors import UserError
from experiments.loop import check_lm_loss, evaluate, lm_loss, train_step
from experiments.models import build_model
from hmt_core.fused_ce import causal_lm_loss, linear_cross_entropy, resolve_head

register_configs()
CONF = str(Path(__file__).resolve().parent.parent / "experiments" / "conf")
U32, UBF = 2.0**-24, 2.0**-8
B, T = 2, 37  # N = 74 tokens; chunks of 30 do not divide it (30, 30, 14)
CHUNK = 30


def _check(what: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """max |got − ref| ≤ tol · max |ref|, with the numbers in the message."""
    got, ref = got.detach().double(), ref.detach().double()
    diff, scale = float((got - ref).abs().max()), float(ref.abs().max())
    assert diff <= tol * scale, f"{what}: max|Δ| = {diff:.3e} > tol {tol:.3e} × max|ref| {scale:.3e} " \
                                f"(= {tol * scale:.3e}; relative {diff / max(scale, 1e-300):.3e})"


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, 5:9] = -100  # a run of ignored tokens, one at the very start of the second row, and the last
    labels[1, 0] = -100
    labels[1, -1] = -100
    return labels


def _blocks(n: int, v: int, chunk: int) -> int:
    width = min(v, -(-chunk * v // n))
    return -(-v // width)


# ------------------------------------------------------------------------------------- the function itself
PHI = {"identity": (1.0, None), "scale": (0.5, None), "softcap": (1.0, 3.0)}


def _reference_logits(hidden, weight, bias, scale, softcap):
    """What a *ForCausalLM does: lm_head, then its final map, in the head's output dtype."""
    z = F.linear(hidden, weight, bias)
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


@pytest.mark.parametrize("chunk", [CHUNK, 4096], ids=["chunked", "one_chunk"])
@pytest.mark.parametrize("phi", list(PHI))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_function_equals_transformers_loss(phi, bias, precision, chunk):
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    h_dim, vocab = 48, 500
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hidden = torch.randn(B, T, h_dim, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, h_dim, generator=gen) * 0.4).to(dtype).requires_grad_()  # logits of a few units
    b = (torch.randn(vocab, generator=gen) * 0.5).to(dtype).requires_grad_() if bias else None
    labels = _labels(torch.randint(0, vocab, (B, T), generator=gen))
    scale, softcap = PHI[phi]
    params = [hidden, weight] + ([b] if bias else [])
    autocast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        z = _reference_logits(hidden, weight, b, scale, softcap)
        ref = ForCausalLMLoss(z, labels, vocab_size=vocab)
    ref_grads = torch.autograd.grad(ref, params)
    with autocast:
        loss = linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=chunk, scale=scale, softcap=softcap)
    grads = torch.autograd.grad(loss, params)
    n = B * T
    if precision == "fp32":
        tol = (h_dim + vocab + n) * U32
        loss_tol = tol
    else:
        tol = (_blocks(n, vocab, chunk) + 2) * UBF
        loss_tol = 2.0**-7 * float(z.detach().float().abs().max()) / abs(float(ref.detach())) + (vocab + n) * U32
    _check("loss", loss, ref, loss_tol)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, r.dtype)
        _check(f"grad {name}", g, r, tol)
    # ignored positions get exactly no gradient (position t is scored against labels[t + 1])
    assert float(grads[0][0, 4:8].abs().max()) == 0.0 and float(grads[0][1, -2:].abs().max()) == 0.0


def test_the_equality_test_can_fail():
    """Unshifted labels, a missed ignore_index or a missed soft-cap land over 10x outside the fp32 tolerance."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(B, T, 48, generator=gen), torch.randn(500, 48, generator=gen) * 0.4
    labels = _labels(torch.randint(0, 500, (B, T), generator=gen))
    ref = float(ForCausalLMLoss(_reference_logits(hidden, weight, None, 1.0, 3.0), labels, vocab_size=500))
    tol = (48 + 500 + B * T) * U32 * abs(ref)
    wrong = {
        "no soft-cap": linear_cross_entropy(hidden, weight, None, labels),
        "labels not shifted": linear_cross_entropy(hidden, weight, None, F.pad(labels, (1, 0), value=-100)[:, :-1],
                                                   softcap=3.0),
        "ignore_index counted": linear_cross_entropy(hidden, weight, None, labels.clamp(min=0), softcap=3.0),
    }
    for what, loss in wrong.items():
        assert abs(float(loss) - ref) > 10 * tol, (what, float(loss), ref, tol)


# ------------------------------------------------------------------------------- whole models, every head
def _hf_model(arch: str, tied: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig

    from test_architectures import hf_config

    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=176, vocab_size=300, max_position_embeddings=128, bos_token_id=0,
                 eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied, use_cache=False)
    if arch == "gemma2":  # a soft-cap the random-init logits reach (the published 30 would be nearly the identity)
        config = Gemma2Config(**shape, head_dim=16, final_logit_softcapping=0.5, attn_implementation="eager")
    elif arch == "cohere":
        config = CohereConfig(**shape, logit_scale=4.0)
    elif arch == "granite":
        config = GraniteConfig(**shape, logits_scaling=0.25)
    else:
        config = hf_config(arch.removesuffix("+bias"), vocab=300)
        config.tie_word_embeddings, config.use_cache = tied, False
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):  # GPT-2: dropout off (two passes must agree)
            if hasattr(config, key):
                setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if arch.endswith("+bias"):  # no harness architecture has a head bias; the plain path applies lm_head as it is
        model.lm_head = nn.Linear(64, 300, bias=True)
        if tied:
            model.lm_head.weight = model.get_input_embeddings().weight
    return model


def _loss_and_grads(model: nn.Module, ids, labels, *, fused: bool, bf16: bool):
    """(loss, {name: grad} incl. 'hidden' = the LM head's input), and the plain logits' max |z|."""
    seen: dict = {}

    def keep_hidden(module, args):
        args[0].retain_grad()
        seen["hidden"] = args[0]

    model.zero_grad(set_to_none=True)
    handle = model.get_output_embeddings().register_forward_pre_hook(keep_hidden)  # before the fused loss's hook
    try:
        with torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext():
            if fused:
                loss = causal_lm_loss(model, ids, labels, chunk_tokens=CHUNK)
                zmax = None
            else:
                out = model(input_ids=ids, labels=labels)
                loss, zmax = out.loss, float(out.logits.detach().float().abs().max())
        loss.backward()
    finally:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["hidden"] = seen["hidden"].grad.clone()
    return loss.detach(), grads, zmax


ARCHS = ["llama", "mistral", "qwen2", "gpt2", "gemma2", "cohere", "granite", "llama+bias"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_model_loss_and_gradients_equal_its_own_loss(arch, tied, precision):
    model = _hf_model(arch, tied)
    head = model.get_output_embeddings()
    assert (head.weight is model.get_input_embeddings().weight) == tied
    ids = torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(1))
    labels = _labels(ids)
    bf16 = precision == "bf16"
    ref_loss, ref, zmax = _loss_and_grads(model, ids, labels, fused=False, bf16=bf16)
    loss, got, _ = _loss_and_grads(model, ids, labels, fused=True, bf16=bf16)
    n, vocab = B * T, 300
    assert set(got) == set(ref)
    if not bf16:
        tol = (64 + vocab + n) * U32
        _check("loss", loss, ref_loss, tol)
        for name in ref:  # every parameter: upstream of the head both paths run the same ops
            _check(f"grad {name}", got[name], ref[name], tol)
        return
    _check("loss", loss, ref_loss, 2.0**-7 * zmax / abs(float(ref_loss)) + (vocab + n) * U32)
    tol = (_blocks(n, vocab, CHUNK) + 2) * UBF
    head_names = [n_ for n_, p in model.named_parameters() if p is head.weight or p is head.bias]
    for name in ["hidden", *head_names]:  # a tied weight's grad adds the embedding lookup's, a linear image of
        _check(f"grad {name}", got[name], ref[name], tol)  # the hidden grad through the same BF16 ops


def test_eval_loss_equals_plain(tiny_llama_config):
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config)
    batches = [torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    autocast = contextlib.nullcontext
    fused = evaluate(model, batches, torch.device("cpu"), autocast, fused_ce=True, ce_chunk_tokens=CHUNK)
    plain = evaluate(model, batches, torch.device("cpu"), autocast, fused_ce=False)
    assert fused == pytest.approx(plain, rel=(64 + 256 + 66) * U32), (fused, plain)
    assert torch.equal(lm_loss(model, batches[0], fused_ce=False), model(input_ids=batches[0], labels=batches[0]).loss)


def test_activation_policy_sees_the_same_gradients(tiny_llama_config):
    """Full checkpointing wraps the decoder layers and the root forward; the fused loss runs inside it."""
    from transformers import LlamaForCausalLM

    from hmt_core.activations import apply_policy
    from hmt_core.activations.policy import PRESETS

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config)
    handle = apply_policy(model, PRESETS["full_ckpt"])
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(2))
    ref_loss, ref, _ = _loss_and_grads(model, ids, ids, fused=False, bf16=False)
    loss, got, _ = _loss_and_grads(model, ids, ids, fused=True, bf16=False)
    handle.remove()
    tol = (64 + 256 + B * T) * U32
    _check("loss", loss, ref_loss, tol)
    for name in ref:
        _check(f"grad {name}", got[name], ref[name], tol)


# --------------------------------------------------------------------------------------- every method
METHODS = {
    "adamw": {"name": "adamw"},
    "qlora": {"name": "qlora", "lora_r": 4, "compute_dtype": "fp32"},
    "galore": {"name": "galore", "rank": 8},
    "apollo": {"name": "apollo", "rank": 8},
    "hmt": {"name": "hmt", "rank_candidates": (8,)},
    "hmt-tied": {"name": "hmt", "rank_candidates": (8,), "target_patterns": ("attn", "mlp", "lm_head")},
}


def _method_step(raw: dict, *, fused: bool, tied: bool):
    """One train_step of a micro fp32 Llama through the method; the gradient of every trainable parameter as it is
    accumulated (a hook registered before the method's own, as the meter's is) and how often it fired."""
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=176, vocab_size=384,
                      dtype="fp32", tie_embeddings=tied)
    torch.manual_seed(0)
    model = build_model(cfg)
    method = methods.make_method(methods.make_config(dict(raw)))
    model = method.prepare(model)
    seen: dict[str, list[torch.Tensor]] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: seen.setdefault(names[id(q)], []).append(q.grad.clone()))
    method.attach(model, max_grad_norm=1.0)
    ids = torch.randint(0, 384, (B, T), generator=torch.Generator().manual_seed(3))
    loss, _ = train_step(model, method, [ids], meter=None, autocast=contextlib.nullcontext, fused_ce=fused,
                         ce_chunk_tokens=CHUNK)
    return float(loss), seen


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_gets_the_plain_gradients(name):
    tied = name == "hmt-tied"
    ref_loss, ref = _method_step(METHODS[name], fused=False, tied=tied)
    loss, got = _method_step(METHODS[name], fused=True, tied=tied)
    tol = (64 + 384 + B * T) * U32
    assert loss == pytest.approx(ref_loss, rel=tol), (loss, ref_loss)
    assert sorted(got) == sorted(ref) and got, (sorted(got), sorted(ref))
    for param, grads in ref.items():
        assert len(got[param]) == len(grads) == 1, (param, len(got[param]), len(grads))  # one summed grad (tied)
        _check(f"{name}: grad {param}", got[param][0], grads[0], tol)


# ------------------------------------------------------------------------------------ errors
def test_unknown_architecture_or_wrapped_head_is_refused_clearly(tiny_llama_config):
    from peft import LoraConfig, get_peft_model
    from transformers import GemmaConfig, GemmaForCausalLM, LlamaForCausalLM

    gemma = GemmaForCausalLM(GemmaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=64))
    with pytest.raises(ValueError, match=r"train.fused_ce=true: model type 'gemma' .* set train.fused_ce=false"):
        resolve_head(gemma)
    with pytest.raises(UserError, match="model type 'gemma'"):
        check_lm_loss(gemma, TrainConfig())
    check_lm_loss(gemma, TrainConfig(fused_ce=False))  # the model's own loss needs no check
    lora = get_peft_model(LlamaForCausalLM(tiny_llama_config), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ValueError, match=r"output embedding of LlamaForCausalLM is .*not a plain nn.Linear"):
        resolve_head(lora)
    peft_ok = get_peft_model(LlamaForCausalLM(tiny_llama_config), LoraConfig(r=2, target_modules=["q_proj"]))
    assert resolve_head(peft_ok).module is peft_ok.get_base_model().lm_head
    with pytest.raises(ValueError, match="ce_chunk_tokens must be > 0"):
        TrainConfig(ce_chunk_tokens=0)


def test_unknown_architecture_is_a_one_line_error_before_anything_is_written(tmp_path, capsys):
    from transformers import GemmaConfig

    from experiments.execute import main_with_config

    model_dir = tmp_path / "gemma"
    model_dir.mkdir()
    GemmaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                intermediate_size=64, vocab_size=64, max_position_embeddings=64).to_json_file(
        str(model_dir / "config.json"))
    results = tmp_path / "results"
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("run", overrides=["mode=dryrun", "method=adamw", f"model.path={model_dir}",
                                        "train.seq_len=16", "train.batch_size=1", f"results_dir={results}"])
    with pytest.raises(SystemExit) as exc:
        main_with_config(cfg)
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "model type 'gemma'" in lines[0] and "train.fused_ce=false" in lines[0], err
    assert "Traceback" not in err and not any(results.glob("*/status")), err


# ------------------------------------------------------------------------------------ memory
MEM = ["model.hidden_size=64", "model.num_layers=1", "model.num_heads=4", "model.intermediate_size=176",
       "model.vocab_size=8192", "train.seq_len=256", "train.batch_size=2", "method=adamw", "dryrun.steps=2"]
MEM_CHUNK = 100  # does not divide N = 512


def _mem_run(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_run_config(compose("run", overrides=["mode=dryrun", *MEM, *overrides]))


def _trace(run, fake: bool):
    return trace_steps(run, methods.make_method(run.method), fake=fake)


def test_fused_step_peak_is_lower_by_the_logits_as_the_shapes_say():
    """BF16 weights under autocast (the harness default), vocab 8192 ≫ hidden 64, N = 512 tokens, the harness's
    train_step (adamw) on real tensors under the meter. The plain step peaks in log_softmax's backward holding three
    (N x V) fp32 tensors: the saved log-probabilities, their incoming gradient and the input gradient (12·N·V
    bytes; nll_loss has released its labels by then). The fused step peaks in its backward holding the BF16 weight
    gradient it fills block by block (2·V·H), one block's BF16 logits and their fp32 copy (6·N·Vb, N·Vb ≤
    chunk·V), the fp32 hidden-gradient accumulator (4·N·H), the per-token gradient scale and the fp32 incoming
    gradient (4·N + 4), and what it saved: lse, shifted labels, count (4·N + 8·N + 8)."""
    plain = _trace(_mem_run("train.fused_ce=false"), fake=False)["report"]
    fused = _trace(_mem_run("train.fused_ce=true", f"train.ce_chunk_tokens={MEM_CHUNK}"), fake=False)["report"]
    n, v, h = 2 * 256, 8192, 64
    vb = min(v, -(-MEM_CHUNK * v // n))
    expected = 12 * n * v - (2 * v * h + 6 * n * vb + 4 * n * h + 4 * n + 4) - (4 * n + 8 * n + 8)
    saving = plain.peak_bytes - fused.peak_bytes
    logits_bytes = n * v * 4  # the fp32 logits the plain loss computes (its BF16 logits are half that)
    msg = (f"plain peak {plain.peak_bytes:,} B, fused {fused.peak_bytes:,} B: saving {saving:,} B; expected from "
           f"shapes {expected:,} B; fp32 logits {logits_bytes:,} B; plain by phase {plain.peak_by_phase_bytes}, "
           f"fused {fused.peak_by_phase_bytes}")
    assert saving >= logits_bytes, msg
    assert saving == pytest.approx(expected, rel=0.01), msg
    # the rest of the step is the same: parameters, optimizer state
    assert fused.peak_by_category_bytes["params"] == plain.peak_by_category_bytes["params"], msg


def test_fused_step_dry_run_equals_the_real_run():
    run = _mem_run("train.fused_ce=true", f"train.ce_chunk_tokens={MEM_CHUNK}")
    real, fake = _trace(run, fake=False)["report"], _trace(run, fake=True)["report"]
    assert fake.source == "fake"
    assert fake.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01), (fake.peak_bytes, real.peak_bytes)
    for phase, value in real.peak_by_phase_bytes.items():
        assert fake.peak_by_phase_bytes[phase] == pytest.approx(value, rel=0.01), phase
    for key, value in real.peak_by_category_bytes.items():
        assert fake.peak_by_category_bytes[key] == pytest.approx(value, rel=0.01, abs=64), key

