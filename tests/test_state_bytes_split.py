"""``optim/state_bytes`` split by device (``hmt_core.state_bytes.state_bytes_summary``): the training device's
bytes vs host copies such as HMT's parked bases (``method.offload_bases=true``)."""

import torch

from experiments import methods
from experiments.loop import train_step
from hmt_core.basis_cache import basis_bytes
from hmt_core.state_bytes import state_bytes_summary


def test_state_bytes_summary_splits_by_the_training_device():
    on_meta, on_cpu = torch.empty(10, device="meta"), torch.empty(3, dtype=torch.bfloat16)  # 40 B, 6 B
    split = state_bytes_summary([on_meta, on_cpu], torch.device("meta"))
    assert split == {"optim/state_bytes": 40, "optim/state_device_bytes": 40, "optim/state_host_bytes": 6}, split
    assert state_bytes_summary([on_meta, on_cpu], torch.device("cpu"))["optim/state_host_bytes"] == 40
    assert state_bytes_summary([on_meta, on_cpu], None)["optim/state_device_bytes"] == 46  # no split


def test_hmt_parked_bases_are_host_state(tiny_llama_config):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config)
    method = methods.make_method(methods.make_config({"name": "hmt", "rank_candidates": (8,), "offload_bases": True}))
    method.attach(model, max_grad_norm=1.0)
    train_step(model, method, [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))],
               meter=None, autocast=lambda: torch.autocast("cpu", torch.bfloat16))
    total = sum(t.numel() * t.element_size() for t in method.state_tensors())
    cpu = method.summary()
    print({k: v for k, v in cpu.items() if k.startswith("optim/state")}, "total", total)
    # a CPU run: host and device are one memory, so everything is device (the figures CPU results always had)
    assert cpu["optim/state_bytes"] == cpu["optim/state_device_bytes"] == total and cpu["optim/state_host_bytes"] == 0

    # what lives on the accelerator (moments, limiter, master copies) moved to a stand-in device; the parked
    # bases stay where the cache put them, in host memory
    parked = method.engine.cache.parked
    for s in method.opt.slots:
        for attr in ("m", "v", "limiter_prev", "master"):
            if getattr(s, attr) is not None:
                setattr(s, attr, getattr(s, attr).to("meta"))
    method.device = torch.device("meta")
    split = method.summary()
    host = sum(basis_bytes(b) for b in parked.values())
    print({k: v for k, v in split.items() if k.startswith("optim/state")}, "parked", host)
    assert host > 0 and all(s.basis is parked[s.name] for s in method.opt.slots if s.projected)
    assert split["optim/state_host_bytes"] == host
    assert split["optim/state_bytes"] == split["optim/state_device_bytes"] == total - host
