"""Optimizer benchmark (one CPU run; not a test): state bytes, gradient peaks, step-time ratios, rSVD vs SVD,
and the moment-policy comparison on basis change.

    python benchmarks/optimizer_bench.py [--hidden 256 --layers 4 ...] [--svd-shape 4096x11008] [--skip-svd]

Sections:
1. optimizer-state bytes per method (``state_tensors()``, storages counted once) on a LLaMA-shaped model;
2. peak gradient bytes with and without HMT's per-layer updates: the largest sum of live ``.grad`` bytes seen by
   a post-accumulate hook (plus HMT's low-rank accumulators), and ``experiments.memory.meter.MemoryMeter``'s peak;
3. step time (forward + backward + update) of each method relative to AdamW, amortized over a refresh every
   ``--interval`` steps: ``(t_refresh + (T−1)·t_plain) / T``;
4. randomized SVD (HMT's, warm and cold) vs ``torch.linalg.svd`` on a large fp32 matrix with a power-law
   spectrum: time ratio and captured top-r energy;
5. moment handling on basis change (keep / project / reset): final loss of HMT Mode A on a learnable synthetic
   language (random sparse bigram chain) with frequent refreshes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baselines import adamw, apollo, galore  # noqa: E402
from hmt_core import hmt  # noqa: E402
from hmt_core import projection as proj  # noqa: E402


def build_model(a, seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.heads)
    return LlamaForCausalLM(cfg).float()


def methods(a, interval: int) -> dict:
    r = a.hidden // 4
    common = dict(rank=r, update_interval=interval)
    return {
        "adamw": adamw.make(adamw.Config(lr=1e-3)),
        "galore": galore.make(galore.Config(rank=r, update_proj_gap=interval)),
        "apollo": apollo.make(apollo.Config(variant="apollo", update_proj_gap=interval)),
        "apollo-mini": apollo.make(apollo.Config(variant="mini", update_proj_gap=interval)),
        "hmt-A-one-sided(svd)": hmt.make(hmt.Config(mode="A", sides="one_sided", basis="svd", **common)),
        "hmt-A-one-sided(rsvd)": hmt.make(hmt.Config(mode="A", sides="one_sided", basis="rsvd", **common)),
        "hmt-A-two-sided(rsvd)": hmt.make(hmt.Config(mode="A", sides="two_sided", basis="rsvd", **common)),
        "hmt-A-dynamic(rsvd)": hmt.make(hmt.Config(mode="A", basis="rsvd", rank=None, update_interval=interval,
                                                   rank_candidates=(r // 4, r // 2, r, 2 * r), tau=0.5)),
        "hmt-B(channel)": hmt.make(hmt.Config(mode="B", basis="random", scale=1.0, **common)),
        "hmt-B-mini": hmt.make(hmt.Config(mode="B", basis="random", scale=128.0, rank=1, scaling="tensor",
                                          update_interval=interval)),
    }


def state_bytes(method) -> int:
    seen, total = set(), 0
    for t in method.state_tensors():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def one_step(model, method, ids, micro=1) -> float:
    t0 = time.perf_counter()
    for i, chunk in enumerate(ids.chunk(micro)):
        method.start_micro_batch(i, micro)
        (model(input_ids=chunk, labels=chunk).loss / micro).backward()
    method.step()
    method.zero_grad()
    return time.perf_counter() - t0


def section_state_and_time(a) -> None:
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen) for _ in range(a.steps + 3)]
    n_params = sum(p.numel() for p in build_model(a).parameters())
    print(f"\n== 1+3. state bytes and step time: LLaMA h={a.hidden} ffn={a.inter} L={a.layers} V={a.vocab} "
          f"({n_params / 1e6:.2f} M params, fp32), batch {a.batch}x{a.seq}, rank d/4={a.hidden // 4}, "
          f"T={a.interval} (amortized), {a.steps} timed steps, {torch.get_num_threads()} thread(s)")
    rows = {}
    for name, method in methods(a, a.steps + 2).items():
        model = build_model(a)
        method.attach(model, max_grad_norm=1.0)
        one_step(model, method, data[0])  # step 0: first refresh + state allocation (warm-up, untimed)
        plain = [one_step(model, method, data[1 + i]) for i in range(a.steps)]
        one_step(model, method, data[a.steps + 1])
        refresh = one_step(model, method, data[a.steps + 2])  # step steps+2 refreshes (interval = steps+2)
        t_plain = statistics.median(plain)
        rows[name] = (state_bytes(method), t_plain, refresh, (refresh + (a.interval - 1) * t_plain) / a.interval)
    base_bytes, base_time = rows["adamw"][0], rows["adamw"][3]
    print(f"{'method':24s} {'state MiB':>10s} {'vs AdamW':>9s} {'plain step s':>13s} {'refresh step s':>15s} "
          f"{'amortized/AdamW':>16s}")
    for name, (nbytes, t_plain, t_ref, amort) in rows.items():
        print(f"{name:24s} {nbytes / 2**20:10.2f} {nbytes / base_bytes:9.3f} {t_plain:13.4f} {t_ref:15.4f} "
              f"{amort / base_time:16.3f}")


def section_grad_peak(a) -> None:
    from experiments.memory.meter import MemoryMeter

    print("\n== 2. peak gradient bytes (max_grad_norm=1.0; 1 and 2 micro-batches)")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
    print(f"{'config':34s} {'micro':>5s} {'live .grad peak MiB':>20s} {'meter peak MiB':>15s} "
          f"{'meter grads@peak MiB':>21s}")
    configs = {"adamw": lambda: adamw.make(adamw.Config()),
               "hmt-A rsvd ordinary step": lambda: hmt.make(hmt.Config(rank=a.hidden // 4, per_layer=False)),
               "hmt-A rsvd per-layer": lambda: hmt.make(hmt.Config(rank=a.hidden // 4, per_layer=True)),
               "hmt-B per-layer": lambda: hmt.make(hmt.Config(mode="B", basis="random", rank=a.hidden // 4))}
    for micro in (1, 2):
        for name, factory in configs.items():
            model, method = build_model(a), factory()
            params = [p for p in model.parameters() if p.requires_grad]
            peak = [0]

            def live_grads(_p):
                extra = sum(s.pending.numel() * 4 for s in getattr(getattr(method, "opt", None), "slots", [])
                            if s.pending is not None)
                peak[0] = max(peak[0], extra + sum(q.grad.numel() * q.grad.element_size()
                                                   for q in params if q.grad is not None))

            meter = MemoryMeter()
            meter.track(params, "params")
            meter.watch_grads(params)
            for p in params:  # registered before the method's hooks: sees each gradient before it is freed
                p.register_post_accumulate_grad_hook(live_grads)
            method.attach(model, max_grad_norm=1.0)
            one_step(model, method, ids, micro)  # warm-up: state allocated
            with meter:
                for i, chunk in enumerate(ids.chunk(micro)):
                    method.start_micro_batch(i, micro)
                    with meter.phase("forward"):
                        loss = model(input_ids=chunk, labels=chunk).loss / micro
                    with meter.phase("backward"):
                        loss.backward()
                    del loss
                with meter.phase("optimizer"):
                    method.step()
                meter.mark(method.state_tensors(), "optimizer")
                method.zero_grad()
            rep = meter.report()
            print(f"{name:34s} {micro:5d} {peak[0] / 2**20:20.2f} {rep.peak_bytes / 2**20:15.2f} "
                  f"{rep.peak_by_category_bytes['grads'] / 2**20:21.2f}")
            meter.remove_hooks()


def section_svd(a) -> None:
    out_dim, in_dim = (int(x) for x in a.svd_shape.split("x"))
    r = a.svd_rank
    print(f"\n== 4. randomized vs exact SVD: {out_dim}x{in_dim} fp32, rank {r}, power-law spectrum "
          f"σ_i = i^-{a.svd_decay} over {a.svd_components} components + 1e-4 noise")
    gen = torch.Generator().manual_seed(0)
    k = a.svd_components
    s = torch.arange(1, k + 1, dtype=torch.float32) ** -a.svd_decay
    g = (torch.randn(out_dim, k, generator=gen) * s) @ torch.randn(k, in_dim, generator=gen) / in_dim ** 0.5
    g += 1e-4 * torch.randn(out_dim, in_dim, generator=gen)

    t0 = time.perf_counter()
    exact = proj.exact_svd(g, r)
    t_exact = time.perf_counter() - t0
    top = float((exact.s.double() ** 2).sum())

    def run(**kw):
        t0 = time.perf_counter()
        f = proj.randomized_svd(g, r, generator=torch.Generator().manual_seed(1), **kw)
        dt = time.perf_counter() - t0
        captured = float(torch.linalg.vector_norm((g @ f.vh.t()).double()) ** 2)
        return dt, captured / top

    print(f"exact torch.linalg.svd: {t_exact:.2f} s; top-{r} energy fraction of ‖G‖²: "
          f"{top / exact.total_energy:.4f}")
    rows = [("rsvd q=2, p=8 (cold)", dict(power_iters=2, oversample=8)),
            ("rsvd q=1, p=8 (cold)", dict(power_iters=1, oversample=8)),
            ("rsvd q=0, p=8, warm from exact basis", dict(power_iters=0, oversample=8,
                                                          warm=proj.Basis(None, exact.vh))),
            ("torch.svd_lowrank q=r+8, niter=2", None)]
    for name, kw in rows:
        if kw is None:
            t0 = time.perf_counter()
            _, _, v = torch.svd_lowrank(g, q=r + 8, niter=2)
            dt = time.perf_counter() - t0
            ratio = float(torch.linalg.vector_norm((g @ v[:, :r]).double()) ** 2) / top
        else:
            dt, ratio = run(**kw)
        print(f"{name:40s} {dt:7.2f} s  speed-up {t_exact / dt:6.1f}x  captured/exact top-{r} energy {ratio:.4f}")


def bigram_data(vocab, n, batch, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, 4), generator=gen)  # each token has 4 possible successors
    out = []
    for _ in range(n):
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(1, seq):
            x[:, t] = nxt[x[:, t - 1], torch.randint(0, 4, (batch,), generator=gen)]
        out.append(x)
    return out


def section_moments(a) -> None:
    print(f"\n== 5. moment handling on basis change: HMT Mode A, svd rank 8, refresh every {a.moment_interval} "
          f"steps, {a.moment_steps} steps, tiny LLaMA (h=64), bigram language (ideal loss ln 4 = 1.386)")
    small = argparse.Namespace(vocab=256, hidden=64, inter=176, layers=2, heads=4)
    results = {}
    for policy in ("keep", "project", "reset"):
        finals = []
        for seed in range(a.moment_seeds):
            data = bigram_data(256, a.moment_steps + 4, 8, 32, seed)
            model = build_model(small, seed)
            method = hmt.make(hmt.Config(rank=8, basis="svd", update_interval=a.moment_interval,
                                         moment_policy=policy, lr=1e-2, scale=0.25))
            method.attach(model, max_grad_norm=1.0)
            for x in data[:a.moment_steps]:
                one_step(model, method, x)
            with torch.no_grad():
                finals.append(statistics.mean(float(model(input_ids=x, labels=x).loss)
                                              for x in data[a.moment_steps:]))
        results[policy] = finals
        print(f"{policy:8s} held-out loss per seed: {', '.join(f'{v:.4f}' for v in finals)}  "
              f"mean {statistics.mean(finals):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--interval", type=int, default=200)
    ap.add_argument("--svd-shape", default="4096x11008")
    ap.add_argument("--svd-rank", type=int, default=256)
    ap.add_argument("--svd-components", type=int, default=2048)
    ap.add_argument("--svd-decay", type=float, default=1.0)
    ap.add_argument("--skip-svd", action="store_true")
    ap.add_argument("--moment-steps", type=int, default=150)
    ap.add_argument("--moment-interval", type=int, default=10)
    ap.add_argument("--moment-seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    section_state_and_time(a)
    section_grad_peak(a)
    if not a.skip_svd:
        section_svd(a)
    section_moments(a)


if __name__ == "__main__":
    main()
