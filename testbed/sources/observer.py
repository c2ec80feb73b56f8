"""The attention observer: an attention function registered through transformers'
``AttentionInterface`` that copies the post-RoPE Q and the cache-concatenated K/V of chosen layers,
forwards, KV heads and queries (`Observer`, `Record`), then delegates unchanged to the function the
model was using (see `testbed.sources.capture`'s docstring); and the `Case` a record becomes
(`llm_layout`, `case_from_record`)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..case import Case, Region

__all__ = ["ATTN_NAME", "DELEGATES", "Record", "Observer", "register", "llm_layout", "case_from_record"]

ATTN_NAME = "testbed_observer"


@dataclass
class Record:
    """One observed attention call, already reduced to the selected slices (float32, CPU).

    ``q [H_sel, Tq_sel, D]``, ``k, v [H_kv_sel, Tk, D]``; ``query_positions`` are key-axis
    indices; ``q_heads``/``kv_heads`` are the model's head indices that were kept.
    """

    layer: int
    forward: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_positions: torch.Tensor
    query_index: torch.Tensor
    causal: bool
    q_heads: list
    kv_heads: list
    scaling: float
    q_prescale: float
    output: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


_ACTIVE: list = []
# The observer delegates to the implementation the model was using: SDPA (the default) or the
# model's own eager function. Each gets its own registered name and its own mask builder.
DELEGATES = {"sdpa": ATTN_NAME, "eager": ATTN_NAME + "_eager"}


def _eager_of(module):
    import sys as _sys

    fn = getattr(_sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"observer: {type(module).__name__} has no module-level eager_attention_forward to delegate to")
    return fn


def _make_observed(kind: str):
    def observed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        delegate = ALL_ATTENTION_FUNCTIONS["sdpa"] if kind == "sdpa" else _eager_of(module)
        obs = _ACTIVE[-1] if _ACTIVE else None
        pending = None if obs is None else obs._observe(module, query, key, value, attention_mask, scaling, kwargs)
        out = delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if pending is not None and obs.keep_output:
            # Both kernels return [B, Tq, H, D]; keep the same rows and heads as the record.
            rec, b = pending
            o = out[0][b].detach().transpose(0, 1)
            rec.output = o[rec.q_heads][:, rec.query_index].to(torch.float32).cpu().clone()
        return out

    observed_attention.__name__ = f"observed_{kind}_attention"
    return observed_attention


_OBSERVED = {kind: _make_observed(kind) for kind in DELEGATES}


def register() -> dict:
    """Register the observer under one name per delegate (with that delegate's mask builder); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for kind, name in DELEGATES.items():
        AttentionInterface.register(name, _OBSERVED[kind])
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kind])
    return dict(DELEGATES)


class Observer:
    """Records post-RoPE Q/K/V at the attention boundary of chosen layers, then delegates to SDPA.

    ``layers``: layer indices to record (None: all). ``forwards``: top-level forward indices to
    record, counted from 0 after ``attach`` (None: all). ``kv_heads``: KV heads to keep, each with
    its whole group of query heads (None: all). ``queries``: None (every query of the call), an
    int n (n evenly spaced queries, always including the last) or a list of query indices (negative
    counts from the end). ``reduce``: if given, each record is passed to it and only its return
    value is kept (in ``reduced``). ``keep_output``: also keep the kernel's output rows (tests).

    Every call is counted per (forward, layer) in ``calls`` whether recorded or not; calls made
    outside a forward of the attached model count under forward -1.
    """

    def __init__(self, layers=None, forwards=None, kv_heads=None, queries=None, batch_index: int = 0,
                 reduce: Callable[[Record], Any] | None = None, keep_output: bool = False):
        self.layers = None if layers is None else {int(x) for x in layers}
        self.forwards = None if forwards is None else {int(x) for x in forwards}
        self.kv_heads = None if kv_heads is None else sorted({int(x) for x in kv_heads})
        self.queries = queries
        self.batch_index = int(batch_index)
        self.reduce = reduce
        self.keep_output = keep_output
        self.records: list[Record] = []
        self.reduced: list = []
        self.calls: dict[tuple[int, int], int] = {}
        self.forward_count = 0
        self._forward = -1

    # -- attaching ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def attach(self, model):
        """Route ``model``'s attention through the observer for the duration of the block."""
        register()
        previous = model.config._attn_implementation
        if previous not in DELEGATES:
            raise ValueError(f"observer: the model runs {previous!r} attention; it can observe 'sdpa' or 'eager' "
                             "(load the model with attn_implementation='sdpa')")
        model.set_attn_implementation(DELEGATES[previous])
        hooks = [model.register_forward_pre_hook(self._pre_hook), model.register_forward_hook(self._post_hook)]
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)
            for h in hooks:
                h.remove()
            model.set_attn_implementation(previous)

    def _pre_hook(self, module, args):
        self._forward = self.forward_count

    def _post_hook(self, module, args, out):
        self.forward_count += 1
        self._forward = -1

    # -- selection ---------------------------------------------------------------------------
    def _query_index(self, tq: int) -> torch.Tensor:
        sel = self.queries
        if sel is None:
            return torch.arange(tq)
        if isinstance(sel, int):
            n = min(int(sel), tq)
            if n <= 0:
                raise ValueError(f"observer: queries={sel} must be positive")
            # Evenly spaced from the end, so the last query (the newest token) is always kept.
            step = tq / n
            idx = sorted({tq - 1 - int(math.floor(j * step)) for j in range(n)})
            return torch.tensor(idx, dtype=torch.int64)
        idx = [i + tq if i < 0 else i for i in sel]
        if any(not 0 <= i < tq for i in idx):
            raise ValueError(f"observer: query indices {list(sel)} are outside a call with {tq} queries")
        return torch.tensor(sorted(set(idx)), dtype=torch.int64)

    def _observe(self, module, query, key, value, attention_mask, scaling, kwargs):
        layer = getattr(module, "layer_idx", None)
        layer = -1 if layer is None else int(layer)
        f = self._forward
        self.calls[(f, layer)] = self.calls.get((f, layer), 0) + 1
        if self.layers is not None and layer not in self.layers:
            return None
        if self.forwards is not None and f not in self.forwards:
            return None
        rec = self._record(module, query, key, value, attention_mask, scaling, kwargs, layer, f)
        if self.reduce is not None:
            self.reduced.append(self.reduce(rec))
            return None
        self.records.append(rec)
        return rec, self.batch_index

    def _record(self, module, query, key, value, attention_mask, scaling, kwargs, layer, f) -> Record:
        if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
            raise ValueError(f"observer: layer {layer} uses softcap or a position bias, which a Case cannot represent")
        b = self.batch_index
        if not 0 <= b < query.shape[0]:
            raise ValueError(f"observer: batch_index {b} is outside a batch of {query.shape[0]}")
        heads, tq, d = query.shape[1], query.shape[2], query.shape[3]
        hkv, tk = key.shape[1], key.shape[2]
        if heads % hkv:
            raise ValueError(f"observer: {heads} query heads are not a multiple of {hkv} KV heads")
        is_causal = kwargs.get("is_causal")
        is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        visible = _visible(attention_mask, b, tq, tk, is_causal)
        if attention_mask is None and is_causal and tq > 1 and tk > tq:
            # SDPA's causal flag is aligned upper-left: the kernel sees only the first tq keys.
            tk = tq
            visible = visible[:, :tq]
        qi = self._query_index(tq)
        vis = visible[qi]
        last = torch.where(vis, torch.arange(tk).expand_as(vis), torch.full_like(vis, -1, dtype=torch.int64)).amax(dim=1)
        if bool((last < 0).any()):
            raise ValueError(f"observer: layer {layer} has a query row that sees no key (padding?)")
        causal_rows = torch.arange(tk).unsqueeze(0) <= last.unsqueeze(1)
        if bool(vis.all()):
            causal, qpos = False, torch.arange(tk - tq, tk)[qi]
        elif torch.equal(vis, causal_rows):
            causal, qpos = True, last
        else:
            raise ValueError(f"observer: layer {layer}'s mask is neither causal over a key prefix nor full "
                             "(sliding window or padding); a Case cannot represent it")
        group = heads // hkv
        kv_sel = list(range(hkv)) if self.kv_heads is None else self.kv_heads
        if any(not 0 <= h < hkv for h in kv_sel):
            raise ValueError(f"observer: kv_heads {kv_sel} are outside the {hkv} KV heads of layer {layer}")
        q_sel = [h * group + j for h in kv_sel for j in range(group)]
        scale = float(d ** -0.5 if scaling is None else scaling)
        # A Case assumes softmax(q k^T / sqrt(D)); fold any other scale into q (exact when it is 1).
        prescale = scale * math.sqrt(d)
        if abs(prescale - 1.0) < 1e-6:
            prescale = 1.0
        q = query[b, q_sel][:, qi].detach().to(torch.float32).cpu()
        if prescale != 1.0:
            q = q * prescale
        return Record(
            layer=layer, forward=f,
            q=q.clone(),
            k=key[b, kv_sel, :tk].detach().to(torch.float32).cpu().clone(),
            v=value[b, kv_sel, :tk].detach().to(torch.float32).cpu().clone(),
            query_positions=qpos.to(torch.int64).clone(), query_index=qi, causal=causal,
            q_heads=q_sel, kv_heads=kv_sel, scaling=scale, q_prescale=prescale,
            extra={"queries_in_call": tq, "keys_in_call": int(key.shape[2]), "dtype": str(query.dtype).removeprefix("torch.")},
        )

    # -- gates -------------------------------------------------------------------------------
    def call_counts(self, forwards: int, layers: int) -> dict:
        """Observer calls against the expectation of one call per (forward, layer)."""
        cells = sum(1 for f in range(forwards) for layer in range(layers) if self.calls.get((f, layer), 0) == 1)
        return {"forwards": self.forward_count, "calls": sum(self.calls.values()), "cells_with_one_call": cells}


def _visible(mask, b: int, tq: int, tk: int, is_causal: bool) -> torch.Tensor:
    """``[Tq, Tk]`` boolean: which keys each query row may attend to, as the SDPA kernel will."""
    if mask is None:
        if is_causal and tq > 1:
            return torch.arange(tk).unsqueeze(0) <= torch.arange(tq).unsqueeze(1)
        return torch.ones(tq, tk, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"observer: unsupported attention mask {type(mask).__name__}; expected a 4-D tensor")
    m = mask[b if mask.shape[0] > 1 else 0]
    if m.shape[0] != 1:
        raise ValueError("observer: per-head masks are not supported")
    m = m[0, :, :tk].detach().cpu()
    if m.dtype == torch.bool:
        return m.expand(tq, tk).clone()
    return (m > torch.finfo(m.dtype).min).expand(tq, tk).clone()


# -- records to Cases -------------------------------------------------------------------------

def llm_layout(keys: int, current: int, recent: int, sink: int) -> tuple[Region, ...]:
    """``sink | middle | recent | current`` over ``keys`` keys; spans shrink when the cache is short."""
    current = min(current, keys)
    sink = min(sink, keys - current)
    recent = min(recent, keys - current - sink)
    a, c = sink, keys - current
    b = c - recent
    return (Region("sink", 0, a), Region("middle", a, b), Region("recent", b, c), Region("current", c, keys))


def case_from_record(rec: Record, case_id: str, layout, meta: dict | None = None, tokens_per_frame: int | None = None,
                     token_ids: torch.Tensor | None = None, archive_kv_heads: list[int] | None = None) -> Case:
    """A `Case` from one record; ``meta`` is merged over the record's own facts."""
    info = {"layer": rec.layer, "forward": rec.forward, "q_heads": list(rec.q_heads), "kv_heads": list(rec.kv_heads),
            "query_index": rec.query_index.tolist(), "scaling": rec.scaling, "q_prescale": rec.q_prescale, **rec.extra}
    info.update(meta or {})
    return Case(id=case_id, q=rec.q, k=rec.k, v=rec.v, query_positions=rec.query_positions, causal=rec.causal,
                layout=tuple(layout), tokens_per_frame=tokens_per_frame, meta=info, token_ids=token_ids,
                archive_kv_heads=archive_kv_heads)


# -- the model ----------------------------------------------------------------------------------
