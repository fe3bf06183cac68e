"""The ``hmt`` method: dynamic low-rank gradient projection with Mode A (GaLore-style low-rank AdamW, Zhao et al.
2024, Alg. 2) or Mode B (APOLLO-style gradient scaling, Zhu et al. 2024, Alg. 1), updated per layer inside backward.

HMT design (shared/seeds/000_hmt_design.txt), "Dynamic Low-Rank Gradient Projection": ``Ĝ_l = P_lᵀ G_l Q_l``
(two-sided) or GaLore's one-sided rule, bases from exact SVD, randomized SVD or a seeded Gaussian, refreshed every
``update_interval`` steps, rank by spectral energy ``E(r) ≥ τ`` under a state budget. ``HMTMethod`` chooses the
projected weights (``target_patterns``: ``hmt_core.selection``), builds the optimizer's slots and its per-layer
engine. Configuration: ``hmt_core.hmt_config``; design notes (precision, INT8 weights, layout of non-square
weights): docs/design/hmt.md."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hmt_core import host_weights, int8_weights, streaming
from hmt_core.basis_cache import BasisCache, basis_bytes
from hmt_core.hmt_config import Config, optimizer_settings
from hmt_core.optim import sharded as sh
from hmt_core.optim.head_update import install_head_update
from hmt_core.optim.hooks import PerLayerEngine
from hmt_core.optim.optimizer import LowRankOptimizer, Slot
from hmt_core.optim.row_adam import RowAdamConfig
from hmt_core.parallel import ParallelContext, is_replicated, mark_replicated
from hmt_core.selection import (projectable_modules, projected_elements, projected_weight_names,
                                require_projected_weights)
from hmt_core.sparse_embedding import SparseEmbeddingUpdate
from hmt_core.sparse_embedding import install as install_sparse_embedding
from hmt_core.state_bytes import state_bytes_summary

__all__ = ["Config", "HMTMethod", "make", "projectable_modules", "projected_elements", "projected_weight_names",
           "require_projected_weights"]


class HMTMethod:
    name = "hmt"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.opt: LowRankOptimizer | None = None
        self.engine: PerLayerEngine | None = None
        self.max_grad_norm: float | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.device: torch.device | None = None  # the training device (the model's at attach)
        self.rows: SparseEmbeddingUpdate | None = None  # method.embedding_update != dense
        self.streamer: streaming.WeightStreamer | None = None  # method.weight_offload=host

    def prepare(self, model: nn.Module, *, device: torch.device | None = None,
                materialize: int8_weights.Materialize | None = None) -> nn.Module:
        """``weight_dtype="int8"``: the projected weights (but the LM head) become ``Int8Linear`` layers;
        ``embedding_dtype="int8"``: the input embedding and the LM head become ``Int8Embedding`` / ``Int8Linear``.
        Those and a row-updated embedding (``embedding_update != "dense"``) are marked to be held whole on every
        rank (``hmt_core.parallel.mark_replicated``: FSDP2 leaves them out of its shards). ``weight_offload="host"``:
        the decoder layers' projected weights get host copies and freed device storages (``hmt_core.host_weights``).
        ``device``: each quantized or streamed
        module is quantized there, then the rest of the model moved (a model built elsewhere, whose full-precision
        weights need not fit the device: ``shrinks_weights``); ``materialize``: a model built on meta has each module
        made and initialised there just before it is read (``hmt_core.int8_weights.Materialize``)."""
        c = self.config
        if c.embedding_dtype == "int8":
            int8_weights.quantize_vocab(model, backend=c.kernels, device=device, materialize=materialize)
        streamed = self._streamed_targets(model) if c.weight_offload == "host" else set()
        if c.weight_dtype == "int8":
            int8_weights.quantize_linears(model, self._int8_targets(model) - streamed, backend=c.kernels,
                                          device=device, materialize=materialize)
        for name in sorted(streamed):  # a host copy each, one module at a time: never whole on the device
            if c.weight_dtype == "int8":  # quantized on the device, then its codes and scales placed on the host
                int8_weights.quantize_linears(model, {name}, backend=c.kernels, device=device, materialize=materialize)
            stored = {f"{name.removesuffix('weight')}{n}" for n in self._stored_names(model, name)}
            host_weights.place_on_host(model, stored, device=device, materialize=materialize,
                                       resize=streaming.resize_storage)
        if device is not None:
            int8_weights.place_on(model, device, materialize)  # the rest: norms, biases, bf16 tables, buffers
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if emb is not None and (c.embedding_dtype == "int8" or c.embedding_update != "dense"):
            mark_replicated(*emb.parameters())
        if isinstance(head, int8_weights.Int8Linear) and c.embedding_dtype == "int8":
            mark_replicated(*head.parameters())
        return model

    @property
    def shrinks_weights(self) -> bool:
        """``prepare`` stores weights in INT8 or streams them from the host (``weight_offload=host``): a model
        whose full-precision weights exceed the device is built elsewhere (meta, or the host when loaded from
        weights) and reaches the device through ``prepare(model, device=...)``."""
        c = self.config
        return c.weight_dtype == "int8" or c.embedding_dtype == "int8" or c.weight_offload == "host"

    def _int8_targets(self, model: nn.Module) -> set[str]:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return {n for n in require_projected_weights(model, self.config.target_patterns)
                if head is None or model.get_submodule(n.removesuffix(".weight")) is not head}

    def _streamed_targets(self, model: nn.Module) -> set[str]:
        """The projected weights inside the decoder layers: what ``weight_offload=host`` streams."""
        in_layers = {id(p) for layer in streaming.decoder_layers(model) for p in layer.parameters()}
        return {n for n in projected_weight_names(model, self.config.target_patterns)
                if id(model.get_parameter(n)) in in_layers}

    @staticmethod
    def _weight_name(model: nn.Module, module: nn.Module | None) -> str | None:
        """The parameter name ``<module>.weight`` of the first module holding ``module``'s weight (a tied LM head: the
        input embedding's name, the name its slot has), or None."""
        weight = getattr(module, "weight", None)
        if weight is None:
            return None
        return next((f"{n}.weight" for n, m in model.named_modules() if getattr(m, "weight", None) is weight), None)

    def _lr_scales(self, model: nn.Module) -> dict[str, float]:
        """{parameter name: its rate's scale} for the input embedding and an untied LM head (``Slot.lr_scale``)."""
        c = self.config
        embedding, head = (self._weight_name(model, getattr(model, get, lambda: None)())
                           for get in ("get_input_embeddings", "get_output_embeddings"))
        if c.head_lr_scale != 1 and (head is None or head == embedding):
            why = "it is tied to the input embedding: method.embedding_lr_scale sets its rate" if head else "none found"
            raise ValueError(f"method.head_lr_scale={c.head_lr_scale:g}: the model has no separate LM head ({why})")
        scales = {head: c.head_lr_scale} if head else {}
        return {**scales, **({embedding: c.embedding_lr_scale} if embedding else {})}

    @staticmethod
    def _stored_names(model: nn.Module, name: str) -> tuple[str, ...]:
        """The names, within its module, of the tensors holding weight ``name``'s values (what streaming moves)."""
        module = model.get_submodule(name.removesuffix(".weight"))
        return ("weight_codes", "weight_scales") if isinstance(module, int8_weights.Int8Linear) else ("weight",)

    def attach(self, model: nn.Module, *, max_grad_norm: float | None) -> None:
        c = self.config
        targets = require_projected_weights(model, c.target_patterns)
        if c.weight_dtype == "int8":
            plain = sorted(n for n in self._int8_targets(model) if not int8_weights.is_phantom(model.get_parameter(n)))
            if plain:
                raise ValueError(f"method.weight_dtype=int8: {plain[0]} (and {len(plain) - 1} more) is not INT8; "
                                 "call prepare(model) before attach")
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        sharded = any(sh.is_sharded(p) for _, p in trainable)  # FSDP2: row-sharded DTensors (but the replicated)
        if sharded and (sh.sharded_config_error(c) or not all(sh.is_sharded(p) or is_replicated(p)
                                                                for _, p in trainable)):
            raise ValueError(sh.sharded_config_error(c) or "sharded HMT needs every trainable parameter sharded")
        slots, scales = [], self._lr_scales(model)
        for index, (name, p) in enumerate(trainable, 1):
            make = sh.sharded_slot if sh.is_sharded(p) else Slot  # a replicated one: whole on every rank
            if int8_weights.is_phantom(p):  # the optimizer updates an INT8 weight through its handle
                p = model.get_submodule(name.removesuffix(".weight")).handle
            projected = name in targets
            if projected and c.rank is not None and c.sides != "identity" and c.rank > min(p.shape):
                raise ValueError(f"method.rank={c.rank} exceeds min(out, in)={min(p.shape)} of {name} "
                                 f"{tuple(p.shape)}")
            slots.append(make(name=name, param=p, index=index, projected=projected,
                              candidates=c.rank_candidates_for(name),
                              lr_scale=scales.get(name, c.vector_lr_scale if p.dim() == 1 else 1.0)))
        self.opt = LowRankOptimizer(slots, optimizer_settings(c))
        self.device = trainable[0][1].device if trainable else None
        self.max_grad_norm = max_grad_norm
        if self.engine is not None:
            self.engine.remove()
        cache = None
        if c.offload_bases and slots:
            cache = BasisCache(slots[0].param.device, c.basis_cache_mib * 2**20)
        if sharded:
            self.engine = sh.ShardedEngine(self.opt, max_grad_norm=max_grad_norm)
        else:
            self.engine = PerLayerEngine(self.opt, max_grad_norm=max_grad_norm, cache=cache) if c.per_layer else None
        install_head_update(model, self.engine, c, sharded=sharded)
        self.rows = None
        if c.embedding_update != "dense":
            self.rows = install_sparse_embedding(model, self.opt, self.engine, RowAdamConfig(
                variant=c.embedding_update, beta1=c.beta1, beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay,
                style=c.adam_style))
        self._stream_weights(model, sharded)

    def _stream_weights(self, model: nn.Module, sharded: bool) -> None:
        """``method.weight_offload=host``: installed last, so its hooks run after the updates (hmt_core.streaming)."""
        if self.streamer is not None:
            self.streamer.remove()
        self.streamer = None
        if self.config.weight_offload == "host":
            if sharded:
                raise ValueError("method.weight_offload=host is single-process for now (not with dist=fsdp2)")
            self.streamer = streaming.install(model, self.opt)

    def set_parallel(self, context: ParallelContext) -> bool:  # hmt_core.method; the engine's part: sh.take_parallel
        if self.streamer is not None and context.distributed:
            raise ValueError("method.weight_offload=host is single-process for now (not with dist=ddp or fsdp2)")
        return sh.take_parallel(self.engine, self.opt, context)

    def start_micro_batch(self, index: int, count: int) -> None:
        if self.engine is not None:
            self.engine.start_micro_batch(index, count)

    def step(self) -> torch.Tensor | None:  # () fp32 on the device, NaN for a step skipped on the device
        self.last_grad_norm = (self.engine.finish_step() if self.engine is not None
                               else self.opt.step_all(self.max_grad_norm))
        return self.last_grad_norm

    def zero_grad(self) -> None:
        for s in self.opt.slots:
            s.grad_holder.grad = None
            s.pending = None
        if self.engine is not None:
            self.engine.discard_step()
        if self.rows is not None:
            self.rows.discard()

    def materialize_weights(self) -> None:
        """The weights dense AdamW would hold now (``embedding_update=lazy_exact`` catches rows up when read; an
        exported model must have every row current). A no-op for every other setting."""
        if self.rows is not None:
            self.rows.materialize()

    def set_lr_scale(self, scale: float) -> None:
        self.opt.set_lr(self.config.lr * scale)

    def torch_optimizer(self) -> None:
        return None  # its state is its slots' (``state_dict``), not a torch.optim.Optimizer's

    @property
    def prepare_reads_values(self) -> bool:
        """``embedding_dtype="int8"``: ``prepare`` quantizes the tables from the weights' values, which a model
        started on meta does not have (``hmt_core.method.Method``)."""
        return self.config.embedding_dtype == "int8"

    def row_shard_slots(self) -> list:
        """Its slots: on FSDP2's shards their moments are row shards of the parameters (``hmt_core.method.Method``,
        ``hmt_core.optim.sharded_state``)."""
        return self.opt.slots

    @property
    def slots(self) -> list:
        """One ``hmt_core.optim`` slot per trained parameter: its moments, basis and settings (a distributed
        checkpoint splits FSDP2's row-sharded moments by them, ``hmt_core.optim.sharded_state``)."""
        return self.opt.slots

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.opt.state_tensors()  # the embedding's row moments are its slot's m, v
        if self.rows is not None:
            moments = (self.rows.state.m, self.rows.state.v)
            yield from (t for t in self.rows.state.tensors() if not any(t is x for x in moments))

    def metrics(self) -> dict[str, float]:
        self.opt.reconcile()  # the host reads values here anyway (a logging step)
        out = dict(self.opt.history.metrics())
        out["optim/basis_refreshes"] = float(self.opt.refreshes)
        out["optim/basis_fallbacks"] = float(self.opt.fallbacks)
        if self.last_grad_norm is not None:
            out["optim/grad_norm"] = float(self.last_grad_norm)
        out.update(self.cache_stats())
        out.update(self.opt.budget_metrics())
        out.update(self.streamer.stats() if self.streamer is not None else {})
        return out

    def cache_stats(self) -> dict[str, float]:
        cache = self.engine.cache if self.engine is not None else None
        return {} if cache is None else cache.stats(sum(basis_bytes(s.basis) for s in self.opt.slots))

    def summary(self) -> dict[str, Any]:
        out = self.opt.history.summary()
        out.update(state_bytes_summary(self.state_tensors(), self.device))  # host: parked bases (offload_bases)
        out.update({k: int(v) for k, v in self.opt.budget_metrics().items()})
        out["optim/projected_params"] = sum(1 for s in self.opt.slots if s.projected)  # tensors
        out["projected_params"] = projected_elements(s.param for s in self.opt.slots if s.projected)  # elements
        out["optim/basis_fallbacks"] = self.opt.fallbacks
        if self.config.master_weights:
            out["optim/master_bytes"] = sum(s.master.numel() * 4 for s in self.opt.slots if s.master is not None)
        quantized = [s.param for s in self.opt.slots if isinstance(s.param, int8_weights.Int8Weight)]
        if quantized:
            out["int8/weights"] = len(quantized)
            out["int8/weight_bytes"] = sum(q.nbytes() for q in quantized)  # codes + scales
        out.update(self.cache_stats())
        out.update(self.streamer.stats() if self.streamer is not None else {})
        return out

    def state_dict(self) -> dict[str, Any]:
        state = self.opt.state_dict()
        state["lagged_clip_coef"] = self.engine.lagged_coef if self.engine is not None else None
        if self.rows is not None:
            state["embedding_rows"] = {k: v for k, v in self.rows.state.state_dict().items() if k not in ("m", "v")}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state)
        if self.engine is not None:
            self.engine.lagged_coef = state.get("lagged_clip_coef")
        if self.rows is not None:  # the moments came back as the slot's m, v
            self.rows.state.load_state_dict(state.get("embedding_rows", {}))
            self.rows.state.m, self.rows.state.v = self.rows.slot.m, self.rows.slot.v


def make(config: Config) -> HMTMethod:
    return HMTMethod(config)
