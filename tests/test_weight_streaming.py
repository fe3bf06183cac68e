"""Weight streaming (``method.weight_offload=host``, hmt_core.streaming) on the CPU, where host and device copies are
two CPU tensors: a streamed run equals the resident run bit for bit (losses and every weight, Mode A with clipping
deferred to ``finish_step`` and gradient accumulation, Mode A updated in its hooks, Mode B), the streamed weights
hold no storage between steps and at most two layers' worth during one, a checkpoint of a streamed run resumes to
the resident trajectory, and the combinations it does not support are refused with one line naming the key."""

import pytest
import torch

from experiments import methods
from experiments.checkpoint import store as ck
from experiments.checkpoint.manager import Checkpointer, LoopState, ResumePoint
from experiments.loop import evaluate, train_step
from hmt_core.parallel import ParallelContext

MODE_A = {"name": "hmt", "rank_candidates": (8, 16), "update_interval": 2}
MODE_B = {"name": "hmt", "mode": "B", "rank_candidates": (8,), "update_interval": 2}
CASES = {  # (method keys, micro-batches per step, max_grad_norm)
    "mode_a_clipped_accum": (MODE_A, 2, 1.0),  # updates deferred to finish_step: fetched again there
    "mode_a_in_hooks": (MODE_A, 1, None),
    "mode_b": (MODE_B, 1, 1.0),  # lagged clipping: updates in the hooks
    "mode_b_accum": (MODE_B, 2, 1.0),
    # INT8 weights (codes + scales streamed; stochastic rounding in the update): deferred, and in the hooks
    "mode_a_int8_clipped_accum": ({**MODE_A, "weight_dtype": "int8"}, 2, 1.0),
    "mode_b_int8": ({**MODE_B, "weight_dtype": "int8"}, 1, 1.0),
}
AUTOCAST = (lambda: torch.autocast("cpu", torch.bfloat16))


def _config(layers: int = 3):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, use_cache=False)


def _build(raw: dict, clip: float | None, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config())
    method = methods.make_method(methods.make_config(dict(raw)))
    model = method.prepare(model)  # INT8 weights: Int8Linear layers
    method.attach(model, max_grad_norm=clip)
    return model, method


def _steps(model, method, batches, start: int, stop: int, accum: int, watch=None) -> list[float]:
    out = []
    for step in range(start, stop):
        method.set_lr_scale(0.5 + 0.1 * step)
        loss, _ = train_step(model, method, batches[step * accum:(step + 1) * accum], meter=None, autocast=AUTOCAST,
                             skip_nonfinite=True)
        out.append(float(loss))
        if watch is not None:
            watch()
    return out


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (2, 16), generator=g) for _ in range(n)]


def _layer_bytes(method) -> list[int]:
    return [sum(w.nbytes for w in layer) for layer in method.streamer.layers]


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_run_equals_resident_run_bit_for_bit(case):
    raw, accum, clip = CASES[case]
    batches = _batches(4 * accum)
    resident_model, resident = _build(raw, clip)
    expected = _steps(resident_model, resident, batches, 0, 4, accum)
    model, method = _build({**raw, "weight_offload": "host"}, clip)
    streamer = method.streamer
    streamed = [w.param for w in streamer.weights()]

    def released():  # between steps no streamed weight has device storage; its host copy has the values
        assert all(p.untyped_storage().nbytes() == 0 for p in streamed) and streamer.resident_bytes == 0

    got = _steps(model, method, batches, 0, 4, accum, watch=released)
    assert got == expected
    per_weight = 2 if raw.get("weight_dtype") == "int8" else 1  # an INT8 weight's codes and scales
    count = len(streamed)  # (a list of released parameters must not reach pytest's repr)
    assert count == 3 * 7 * per_weight, count  # q, k, v, o, gate, up, down of each of the 3 layers
    final = model.state_dict()  # the state_dict hook reads the host copies of the released weights
    assert all(torch.equal(t, final[n]) for n, t in resident_model.state_dict().items())
    # at most the working layers: layer i and the one prefetched (i + 1 in forward, i - 1 in backward)
    pair = max(a + b for a, b in zip(_layer_bytes(method), _layer_bytes(method)[1:]))
    assert 0 < streamer.peak_resident_bytes <= pair < streamer.host_bytes()
    stats = method.metrics()
    assert stats["stream/host_bytes"] == sum(_layer_bytes(method)) and stats["stream/d2h_bytes"] > 0
    assert method.summary()["stream/device_bytes_peak"] == streamer.peak_resident_bytes


def test_evaluation_forward_streams_and_releases_every_layer():
    model, method = _build({**MODE_B, "weight_offload": "host"}, 1.0)
    before = method.streamer.h2d_bytes
    loss = evaluate(model, _batches(1), torch.device("cpu"), AUTOCAST)
    assert loss == loss and method.streamer.resident_bytes == 0  # no graph: the last layer is released too
    assert method.streamer.h2d_bytes - before == method.streamer.host_bytes()  # each weight fetched once


def test_layer_recompute_streams_in_the_recompute_too():
    """Full activation checkpointing (every decoder layer recomputed in backward): the recompute finds its layer
    fetched by the pre-backward hook, and the trajectory is still the resident one's."""
    from hmt_core.activations import PRESETS, apply_policy

    runs = []
    for offload in ("none", "host"):
        model, method = _build({**MODE_A, "weight_offload": offload}, None)
        handle = apply_policy(model, PRESETS["full_ckpt"])
        runs.append((_steps(model, method, _batches(3), 0, 3, 1), model.state_dict()))
        handle.remove()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(t, runs[1][1][n]) for n, t in runs[0][1].items())


@pytest.mark.parametrize("case", ["mode_a_clipped_accum", "mode_b", "mode_a_int8_clipped_accum"])
def test_checkpoint_of_a_streamed_run_resumes_to_the_resident_trajectory(tmp_path, case):
    raw, accum, clip = CASES[case]
    batches = _batches(4 * accum)
    model, method = _build(raw, clip)
    straight = _steps(model, method, batches, 0, 4, accum)

    streamed = {**raw, "weight_offload": "host"}
    model, method = _build(streamed, clip)
    first = _steps(model, method, batches, 0, 2, accum)
    saved = Checkpointer(tmp_path, every=2, keep=1, model=model, method=method, meta={}).save(
        LoopState(next_step=2, last_loss=first[-1]))
    _, payload = ck.load_checkpoint(saved.path)
    resident_model, resident = _build(raw, clip)  # the same two steps, resident: the saved weights are theirs
    _steps(resident_model, resident, batches, 0, 2, accum)
    resident_params, saved_params = dict(resident_model.named_parameters()), payload["model"]["params"]
    assert len(saved_params) >= 3 * 7  # every stored weight (an INT8 one's codes and scales, not its phantom)
    assert all(torch.equal(t, resident_params[n]) for n, t in saved_params.items())
    del model, method

    model, method = _build(streamed, clip, seed=999)  # different init: everything must come from disk
    Checkpointer(tmp_path, every=2, keep=1, model=model, method=method, meta={}).restore(
        ResumePoint(saved.path, ck.verify(saved.path), []), torch.device("cpu"))
    assert first + _steps(model, method, batches, 2, 4, accum) == straight


@pytest.mark.parametrize("keys, message", [
    ({"per_layer": False}, "method.per_layer=false"),
    ({"master_weights": True}, "method.master_weights=true"),
    ({"weight_offload": "disk"}, "method.weight_offload must be one of"),
])
def test_unsupported_combinations_are_refused_in_one_line(keys, message):
    with pytest.raises(ValueError, match=message) as err:
        methods.make_config({"weight_offload": "host", **MODE_A, **keys})
    assert "\n" not in str(err.value)


def test_multi_process_training_is_refused():
    model, method = _build({**MODE_A, "weight_offload": "host"}, 1.0)
    with pytest.raises(ValueError, match="weight_offload=host is single-process"):
        method.set_parallel(ParallelContext(world_size=2))


def test_remove_brings_every_weight_back():
    model, method = _build({**MODE_B, "weight_offload": "host"}, 1.0)
    _steps(model, method, _batches(2), 0, 2, 1)
    expected = {n: t.clone() for n, t in model.state_dict().items()}
    method.streamer.remove()
    assert all(torch.equal(t, expected[n]) for n, t in model.state_dict().items())
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())


def _metered(raw: dict, steps: int = 2):
    from transformers import LlamaForCausalLM

    from experiments.memory.meter import MemoryMeter

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    meter = MemoryMeter(device=torch.device("cpu"))
    meter.track_model(model)  # before attach, as experiments.train.build_model does
    meter.watch_grads(model.parameters())
    method = methods.make_method(methods.make_config(dict(raw)))
    method.attach(model, max_grad_norm=1.0)
    for ids in _batches(steps):
        with meter:
            train_step(model, method, [ids], meter=meter, autocast=AUTOCAST)
    return meter.report(), method


def test_meter_counts_host_copies_as_host_and_streamed_weights_only_while_fetched():
    plain, _ = _metered(MODE_B)
    streamed, method = _metered({**MODE_B, "weight_offload": "host"})
    host = method.streamer.host_bytes()
    pair = max(a + b for a, b in zip(_layer_bytes(method), _layer_bytes(method)[1:]))
    assert plain.host_peak_by_category_bytes["params"] == 0
    assert streamed.host_peak_by_category_bytes["params"] == host  # the host copies, exactly
    params = {phase: (plain.peak_by_phase_category_bytes[phase]["params"],
                      streamed.peak_by_phase_category_bytes[phase]["params"]) for phase in ("forward", "optimizer")}
    assert params["optimizer"][1] == params["optimizer"][0] - host, params  # every streamed weight released
    assert params["forward"][0] - host < params["forward"][1] <= params["forward"][0] - host + pair, params
    assert streamed.peak_bytes < plain.peak_bytes


def test_a_backward_without_accumulation_leaves_no_weight_on_the_device():
    """``torch.autograd.grad`` (the activation probe's) fires no post-accumulate-grad hook: the weights its backward
    fetched are freed at its end, unchanged."""
    model, method = _build({**MODE_A, "weight_offload": "host"}, 1.0)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    loss = model(input_ids=_batches(1)[0], labels=_batches(1)[0]).loss
    torch.autograd.grad(loss, [model.model.layers[0].mlp.down_proj.weight])
    assert method.streamer.resident_bytes == 0 and method.streamer.d2h_bytes == 0
    pair = max(a + b for a, b in zip(_layer_bytes(method), _layer_bytes(method)[1:]))
    assert method.streamer.peak_resident_bytes <= pair  # a layer is freed once backward has passed it
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
