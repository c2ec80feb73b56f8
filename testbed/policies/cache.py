"""A transformers KV cache that runs a :class:`~testbed.policies.policy.Policy` inside the model.

:class:`PolicyLayer` is a ``DynamicLayer`` subclass (``transformers.cache_utils``), so
``Cache(layers=[PolicyLayer(policy) for _ in range(n_layers)])`` works with any causal LM that
takes a cache. Each ``update(k, v)`` receives the layer's post-RoPE keys and values of the new
tokens ``[B, H_kv, t, D]`` and returns what attention sees: the float32 sink, the middle decoded
from its stored bytes (never a float copy of it), the float32 window and the new tokens. Then the
new tokens are committed: tokens that aged out of the window move into the middle in whole groups
(quantized once, appended as parts of the code / scale arrays; nothing already packed is
re-quantized) or are dropped.

``stored_bytes()`` sums the stored tensors' bytes (the used part of each buffer), per sequence;
it equals :meth:`Policy.layer_bytes` at every step (tested against the closed form).

The first update is the prefill: its tokens attend each other causally in float32, as they would
with no cache, and the policy applies to what it stores afterwards (quantization or eviction).
After it, an evicting policy can take many tokens in one forward only if each of them is kept from the
window keys it would already have evicted one token at a time: the layer then leaves a boolean
mask (query × returned key: ``key position < S`` or ``query − W <= key position <= query``) for
the attention function :data:`ATTN_NAME`, registered through transformers' ``AttentionInterface``
and wrapping SDPA (:func:`policy_attention` switches a model to it for a block). An update that
needs the mask (or the direct path) outside such a block is refused at once, and a mask that no
attention call consumed is an error at the layer's next update.

A sink chosen from attention (``Policy.sink_select == "mass"``) is chosen by the same attention
function: the prefill's update returns its keys and leaves the commit to the attention call right
after it, which computes the prefill's attention shares (:func:`sink_scores`, on top of the SDPA
call the model makes anyway), picks the sink per sequence and KV head (:func:`choose_sink`) and
commits the prefill with those tokens in the float32 sink.

For a model whose layers differ, :meth:`PolicyCache.for_model` reads the layer kinds from its
config (:func:`layer_kinds`): full-attention layers get a :class:`PolicyLayer`, sliding-window
layers a :class:`SlidingLayer` that keeps what the model's own ``DynamicCache`` keeps there (the
policy applies to full layers only); anything else is refused before any forward.

A mixed policy (``Policy.low``: per-head bits) measures each KV head's prefill concentration the
same way (:func:`concentration`), keeps the prefill's aged-out tokens float32 until the whole
model has been seen, and then :meth:`PolicyCache.finish_prefill` allocates the bits over every
(layer, KV head) pair of each sequence (:func:`allocate`) and flushes; from then on each layer's
middle is two packed spans, one per bit width, over the (sequence, head) rows that have it.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..metrics import effective_support
from ..quant import Packed
from ..quant.base import make_header
from . import packed_attention as pa
from . import scorers
from .causal import causal_softmax_blocks, accumulated_attention
from .policy import HEADER_BYTES, Policy, sink_candidates
from .rope import rotary, rotate_half
from .scored import ScoredLayer

__all__ = ["PolicyLayer", "PolicyCache", "SlidingLayer", "layer_kinds", "GrowBuffer", "ATTN_NAME",
           "policy_attention", "sink_scores", "choose_sink", "concentration", "allocation_keys", "allocate",
           "capture_rope", "attention_modules", "check_pre_rope", "rope_rotate", "rope_unrotate",
           "observe_concentration", "Observed", "OBSERVE_SECONDS", "accumulated_attention", "choose_heavy"]

ATTN_NAME = "testbed_policy"
# layer index -> (the layer, the boolean mask its last update left for the attention call after it)
_PENDING: dict[int, tuple] = {}
# layer index -> (the layer, new tokens): its update returned only the float32 keys; attention reads
# the packed middle from its codes (testbed.policies.packed_attention)
_DIRECT: dict[int, tuple] = {}
# layer index -> the layer whose prefill waits for the attention call to choose its sink
_SELECT: dict[int, object] = {}
# a function (layer index, query, key, scale) that every attention call inside policy_attention
# reports to (observe_concentration: the oracle's float32 pass over a whole segment)
_OBSERVER: list = [None]
# seconds spent measuring attention for policies that decide from it (sinks, allocations): their cost
OBSERVE_SECONDS = [0.0]
# how many policy_attention blocks are open: an update that needs the mask or the direct path
# outside one is refused before attention can run with transformers' own (wrong) mask
_ACTIVE = [0]
# layer index -> (position_embeddings, the attention module's class name): what each decoder layer's
# attention module was called with in the current forward, captured by policy_attention's forward
# pre-hooks (the rotary cos / sin of the new tokens) for a layer that stores pre-RoPE keys
_ROPE: dict[int, tuple] = {}


def _require_active(what: str, layer_idx) -> None:
    if not _ACTIVE[0]:
        raise RuntimeError(f"layer {layer_idx}: {what} needs the model to run inside "
                           "testbed.policies.cache.policy_attention(model); refused rather than attending wrongly")


def _masked_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _OBSERVER[0] is not None:
        _OBSERVER[0](getattr(module, "layer_idx", None), query, key,
                     float(query.shape[-1] ** -0.5 if scaling is None else scaling))
    select = _SELECT.pop(getattr(module, "layer_idx", None), None)
    if select is not None:
        out = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
        select.observe_prefill(query, key, float(query.shape[-1] ** -0.5 if scaling is None else scaling))
        return out
    direct = _DIRECT.pop(getattr(module, "layer_idx", None), None)
    if direct is not None:
        layer, new, packed = direct  # the middle as it was when update returned (a flush may follow it)
        scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
        out = pa.attend(query, layer, key, value, scale, packed, new)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    pending = _PENDING.pop(getattr(module, "layer_idx", None), None)
    if pending is not None:
        mask = pending[1].to(query.device)
        if mask.dim() == 4:  # per (sequence, KV head): an adaptive scored layer's heads hold different counts
            attention_mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
        else:
            attention_mask = mask[None, None].expand(query.shape[0], 1, *mask.shape)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                          **kwargs)


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """Layer index -> the module of ``model`` that computes that decoder layer's attention: the
    innermost module carrying an integer ``layer_idx`` (Llama's ``LlamaAttention``, Gemma-3's
    ``Gemma3Attention``: its decoder layer, where it carries the index too, holds it)."""
    out: dict[int, torch.nn.Module] = {}
    for mod in model.modules():
        idx = getattr(mod, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool):
            out[idx] = mod  # modules() goes parent first: an inner module of the same index replaces it
    return out


def _takes_rope(mod) -> bool:
    """The module is called with its rotary embedding (a ``position_embeddings`` argument) and its
    modeling file rotates by transformers' ``rotate_half`` / ``apply_rotary_pos_emb``."""
    import inspect
    import sys

    where = sys.modules.get(type(mod).__module__)
    return ("position_embeddings" in inspect.signature(mod.forward).parameters
            and callable(getattr(where, "rotate_half", None)) and callable(getattr(where, "apply_rotary_pos_emb", None)))


def check_pre_rope(cache, model) -> None:
    """Refuse (``ValueError`` naming the layer index and its attention module's class) a cache that
    stores pre-RoPE keys on a model where a policy layer's pre-RoPE key cannot be obtained: no
    attention module of that index, or one not called with a standard rotary embedding (no
    ``position_embeddings`` argument, or a modeling file without ``rotate_half`` /
    ``apply_rotary_pos_emb``: absolute or learned positions, ALiBi, interleaved rotations)."""
    mods = attention_modules(model)
    for i, layer in enumerate(cache.layers):
        if not (isinstance(layer, PolicyLayer) and layer.pre_rope):
            continue
        mod = mods.get(i)
        if mod is None:
            raise ValueError(f"layer {i}: no attention module of layer_idx {i} was found in {type(model).__name__}; "
                             "key_rope 'pre' needs each layer's rotary embedding")
        if not _takes_rope(mod):
            raise ValueError(f"layer {i} ({type(mod).__name__}): its attention is not called with a standard rotary "
                             "embedding (a position_embeddings (cos, sin) argument applied by rotate_half), so its "
                             "pre-RoPE key cannot be obtained; key_rope 'pre' is refused for this model")


def _rope_hook(idx: int, mod, into: dict):
    """A forward pre-hook that leaves in ``into[idx]`` what layer ``idx``'s attention module is called
    with as ``position_embeddings`` (by keyword, or by its place in the signature), and its class name."""
    import inspect

    at = list(inspect.signature(mod.forward).parameters).index("position_embeddings")
    name = type(mod).__name__

    def hook(_mod, args, kwargs):
        into[idx] = (kwargs.get("position_embeddings", args[at] if len(args) > at else None), name)
    return hook


def _rope_hooks(model, into: dict) -> list:
    """:func:`_rope_hook` registered on every attention module of ``model`` that takes its rotary
    embedding; the handles, to remove."""
    return [mod.register_forward_pre_hook(_rope_hook(i, mod, into), with_kwargs=True)
            for i, mod in attention_modules(model).items() if _takes_rope(mod)]


@contextlib.contextmanager
def capture_rope(model):
    """Yield a dict that every forward inside the block fills: layer index -> the ``(cos, sin)``
    its attention module was last called with (layers with a standard rotary embedding only,
    :func:`check_pre_rope`): what a prefill computed elsewhere hands a pre-RoPE layer's
    :meth:`PolicyLayer.load_prefill`."""
    seen: dict = {}
    got: dict = {}
    hooks = _rope_hooks(model, seen)
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()
        got.update({i: pe for i, (pe, _) in seen.items()})


def rope_rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``k [B, H, t, D]`` rotated by the rotary embedding ``cos``, ``sin`` ``[B, t, D]`` as
    transformers' ``apply_rotary_pos_emb`` rotates it (``k cos + rotate_half(k) sin``), in float32."""
    c, s = cos.to(torch.float32)[:, None], sin.to(torch.float32)[:, None]
    return k * c + rotate_half(k) * s


def rope_unrotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rope_rotate` with the same ``cos``, ``sin``: each channel pair (i, i + D/2)
    was multiplied by ``[[c, -s], [s, c]]``, whose inverse is ``[[c, s], [-s, c]] / (c² + s²)``
    (c² + s² is 1 for RoPE up to rounding, a rope type's attention scaling squared otherwise), so the
    pre-RoPE key comes back exactly up to float32 rounding."""
    c, s = cos.to(torch.float32)[:, None], sin.to(torch.float32)[:, None]
    return (k * c - rotate_half(k) * s) / (c * c + s * s)


@contextlib.contextmanager
def policy_attention(model):
    """Run ``model`` with SDPA behind :data:`ATTN_NAME` (which applies a policy layer's eviction
    mask) for the duration of the block. A :class:`PolicyCache` whose layer kinds are not the
    model's is refused at its first forward (:func:`check_cache_kinds`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _masked_sdpa)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    if previous != "sdpa":
        raise ValueError(f"policy_attention wraps SDPA; the model runs {previous!r} attention")
    model.set_attn_implementation(ATTN_NAME)
    _PENDING.clear()
    _DIRECT.clear()
    _SELECT.clear()
    _ROPE.clear()
    _ACTIVE[0] += 1
    hook = model.register_forward_pre_hook(_refuse_mismatched_cache, with_kwargs=True)
    rope_hooks = _rope_hooks(model, _ROPE)
    try:
        yield model
    finally:
        for h in rope_hooks:
            h.remove()
        _ROPE.clear()
        hook.remove()
        _ACTIVE[0] -= 1
        _PENDING.clear()
        _DIRECT.clear()
        _SELECT.clear()
        model.set_attn_implementation(previous)


def _refuse_mismatched_cache(model, args, kwargs):
    """Forward pre-hook of :func:`policy_attention`: every :class:`PolicyCache` the forward is given
    checked once against the model's layer kinds."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, PolicyCache) and not getattr(value, "_kinds_checked", False):
            check_cache_kinds(value, model.config)
            check_pre_rope(value, model)
            value._kinds_checked = True


def check_cache_kinds(cache, config) -> None:
    """Refuse (``ValueError`` naming the first mismatched layer) a :class:`PolicyCache` whose layers
    are not the kinds :func:`layer_kinds` reads from the model's ``config``: ``PolicyCache(policy,
    num_layers)`` serves every layer as full attention, which on a model with sliding layers keeps
    tokens those layers never read again and gives chunked and one-token feeding different
    log-probabilities; :meth:`PolicyCache.for_model` builds the right one."""
    want = layer_kinds(config)
    fix = "build the cache with PolicyCache.for_model(policy, model.config), which reads the layer kinds"
    if len(cache.layers) != len(want):
        raise ValueError(f"the cache has {len(cache.layers)} layers, the model {len(want)}: {fix}")
    for i, ((kind, window), layer) in enumerate(zip(want, cache.layers)):
        have = cache.kinds[i] if i < len(cache.kinds) else "?"
        if isinstance(layer, SlidingLayer):
            have = f"sliding_attention (window {layer.sliding_window})"
        wanted = kind if window is None else f"{kind} (window {window})"
        if have != wanted or isinstance(layer, SlidingLayer) != (kind == "sliding_attention"):
            raise ValueError(f"layer {i}: the cache serves it as {have}, the model's config makes it {wanted}: {fix}")


def sink_scores(query: torch.Tensor, key: torch.Tensor, scale: float, candidates: int, block: int = 256) -> torch.Tensor:
    """``[B, H_kv, candidates]``: for each of the first ``candidates`` keys of a causal prefill, the
    mean share of attention it receives over the queries that see it (query positions >= its own)
    and the KV head's query heads. ``query [B, H_q, t, D]``, ``key [B, H_kv, t, D]`` (the prefill's
    own keys, in order); float32, queries in blocks of ``block`` (memory ``B H_q block t``)."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    total = torch.zeros(b, hkv, candidates, dtype=torch.float32, device=query.device)
    for p, _ in causal_softmax_blocks(query, key, scale, block, torch.float32):
        total += p[..., :candidates].sum(dim=(2, 3))
    seen_by = (t - torch.arange(candidates, device=query.device)).to(torch.float32) * g
    return total / seen_by


def concentration(query: torch.Tensor, key: torch.Tensor, scale: float, block: int = 256,
                  total: bool = False) -> torch.Tensor:
    """``[B, H_kv]`` float64: the mean effective support (exp(entropy) / visible keys, the
    observation metrics' definition) of a causal pass's attention rows, over its queries and the
    KV head's query heads; low is concentrated, 1 is uniform (``total``: the sum instead of the
    mean). ``query [B, H_q, t, D]`` are the last t of the ``key [B, H_kv, n, D]`` positions (the
    pass's keys in order, a cache's history first); float32 scores, queries in blocks."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    acc = torch.zeros(b, hkv, dtype=torch.float64, device=query.device)
    for p, qpos in causal_softmax_blocks(query, key, scale, block, torch.float32):
        acc += effective_support(p, qpos + 1).sum(dim=(2, 3))
    return acc if total else acc / (hq // hkv * t)


def choose_heavy(index: torch.Tensor, score: torch.Tensor, count: int) -> torch.Tensor:
    """``[B, H, min(count, m)]`` positions into the last axis of ``index`` / ``score [B, H, m]`` (the
    candidates, ``index`` ascending): the ``count`` largest scores, ties to the lower token index,
    returned in ascending token order."""
    order = torch.sort(-score.to(torch.float64), dim=-1, stable=True).indices[..., :count]
    return order.sort(dim=-1).values


def allocation_keys(policy: Policy, scores: torch.Tensor) -> torch.Tensor:
    """``[B, L, H]`` float64 sort keys of a mixed policy's rule: the pairs with the smallest keys
    get the low bits. ``scores [B, L, H]``: the measured concentration (concentrated: the score;
    diffuse: minus it); ``late``: minus the layer index; ``random``: SHA-256 of ``"layer:head"``
    (its first 8 bytes, big-endian, ÷ 2^64) -- content-blind, the same for every sequence."""
    b, n_layers, h = scores.shape
    if policy.alloc == "concentrated":
        return scores.to(torch.float64)
    if policy.alloc == "diffuse":
        return -scores.to(torch.float64)
    if policy.alloc == "late":
        return -torch.arange(n_layers, dtype=torch.float64)[None, :, None].expand(b, n_layers, h).clone()
    import hashlib

    keys = [[int.from_bytes(hashlib.sha256(f"{li}:{hi}".encode()).digest()[:8], "big") / 2.0 ** 64 for hi in range(h)]
            for li in range(n_layers)]
    return torch.tensor(keys, dtype=torch.float64)[None].expand(b, n_layers, h).clone()


def allocate(policy: Policy, scores: torch.Tensor) -> torch.Tensor:
    """``[B, L, H]`` bool, True where the pair gets the low bits: per sequence, the
    ``policy.low_count(L·H)`` pairs with the smallest :func:`allocation_keys` (ties to the lower
    flat index ``layer·H + head``)."""
    keys = allocation_keys(policy, scores)
    b, n_layers, h = keys.shape
    order = torch.sort(keys.reshape(b, -1), dim=-1, stable=True).indices[:, :policy.low_count(n_layers * h)]
    low = torch.zeros(b, n_layers * h, dtype=torch.bool)
    low.scatter_(1, order, True)
    return low.reshape(b, n_layers, h)


class Observed:
    """What :func:`observe_concentration` saw: per layer the summed effective support and the rows
    it is summed over (one pass over a sequence may come in several forward calls: a prefill, then
    chunks through a cache), and ``record_layer``'s queries (per call) and keys (the last call's:
    every key) of batch row 0."""

    def __init__(self):
        self.sums: dict = {}
        self.rows: dict = {}
        self.received: dict = {}  # per layer [B, H_kv, n] float64: each key's accumulated attention
        self.q: list = []
        self.k = None

    def scores(self, n_layers: int) -> torch.Tensor:
        """``[B, n_layers, H_kv]`` float64: each layer's mean effective support over everything seen."""
        missing = [i for i in range(n_layers) if i not in self.sums]
        if missing:
            raise RuntimeError(f"layers {missing[:4]}: no attention call was observed")
        return torch.stack([self.sums[i].cpu() / self.rows[i] for i in range(n_layers)], dim=1)

    def accumulated(self, n_layers: int) -> list[torch.Tensor]:
        """Per layer ``[B, H_kv, n]`` float64: the attention each key received over everything seen
        (:func:`accumulated_attention` summed over the pass's calls), when observed with ``received``."""
        missing = [i for i in range(n_layers) if i not in self.received]
        if missing:
            raise RuntimeError(f"layers {missing[:4]}: no accumulated attention was observed")
        return [self.received[i].cpu() for i in range(n_layers)]


@contextlib.contextmanager
def observe_concentration(model, record_layer: int | None = None, *, concentration_too: bool = True,
                          received: bool = False):
    """Inside :func:`policy_attention`: every attention call's :func:`concentration` is summed
    into the yielded :class:`Observed` (unless ``concentration_too`` is False) and, with ``received``,
    its :func:`accumulated_attention` (the heavy-hitter oracle's whole-segment score)."""
    seen = Observed()

    def observe(layer_idx, query, key, scale):
        t0 = time.perf_counter()
        if concentration_too:
            total = concentration(query, key, scale, total=True)
            seen.sums[layer_idx] = seen.sums.get(layer_idx, 0) + total
            seen.rows[layer_idx] = seen.rows.get(layer_idx, 0) + query.shape[1] * query.shape[2] // key.shape[1]
        if received:
            got = accumulated_attention(query, key, scale)
            old = seen.received.get(layer_idx)
            if old is not None and old.shape[-1] > got.shape[-1]:
                raise RuntimeError(f"layer {layer_idx}: attention over {got.shape[-1]} keys after {old.shape[-1]}: "
                                   "the whole segment's accumulated attention needs every key kept (no sliding window)")
            if old is not None:  # the keys of earlier calls are the first ones of this call's
                got[..., :old.shape[-1]] += old
            seen.received[layer_idx] = got
        if layer_idx == record_layer:
            seen.q.append(query[0].detach().float().clone())
            seen.k = key[0].detach().float().clone()
        OBSERVE_SECONDS[0] += time.perf_counter() - t0

    if _OBSERVER[0] is not None:
        raise RuntimeError("observe_concentration blocks do not nest")
    _OBSERVER[0] = observe
    try:
        yield seen
    finally:
        _OBSERVER[0] = None


def choose_sink(scores: torch.Tensor, sink: int) -> torch.Tensor:
    """``[..., min(sink, C)]`` int64: the indices of the ``sink`` largest scores along the last axis,
    ties to the lower index, in ascending order."""
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :sink]
    return order.sort(dim=-1).values


class GrowBuffer:
    """A stored array that grows along dim -2 by appended parts (one per flush), held as one tensor.

    An append copies what is held and the new part into one tensor (the old one is freed), so the
    object holds exactly the accounted bytes (no spare capacity) and a read is the tensor itself:
    a decode step reads its packed history without copying it; the copy is paid once per flush
    (every G tokens), not on every read (before: one concatenation per read and layer)."""

    def __init__(self):
        self.data: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return 0 if self.data is None else self.data.shape[-2]

    def append(self, x: torch.Tensor) -> None:
        x = x.contiguous()
        self.data = x if self.data is None else torch.cat([self.data, x], dim=-2)

    def view(self) -> torch.Tensor | None:
        return self.data

    def used_bytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


class _PackedSpan:
    """The quantized middle of K or V: one buffer per stored array, appended group by group."""

    def __init__(self, quantizer, label: str):
        self.q = quantizer
        self.label = label
        self.buffers: dict[str, GrowBuffer] = {}
        self.tokens = 0
        self.shape_lead: tuple = ()
        self.dim = 0
        self.dtype = torch.float32

    def append(self, x: torch.Tensor) -> None:
        p = self.q.quantize(x.contiguous(), name=self.label)
        self.shape_lead, self.dim, self.dtype = tuple(x.shape[:-2]), x.shape[-1], x.dtype
        for name, t in p.tensors.items():
            if name == "header":
                continue
            self.buffers.setdefault(name, GrowBuffer()).append(t)
        self.tokens += x.shape[-2]

    def packed(self, tokens: int | None = None) -> Packed:
        """The stored arrays as a `Packed` (of the first ``tokens`` packed tokens: buffers only grow)."""
        n = self.tokens if tokens is None else tokens
        tensors = {name: buf.view()[..., :buf.rows * n // self.tokens, :].contiguous()
                   for name, buf in self.buffers.items()}
        tensors["header"] = make_header(n, self.dim, next(iter(tensors.values())).device)
        return Packed(self.q.name, (*self.shape_lead, n, self.dim), self.dtype, tensors, self.q.config())

    def arrays(self) -> dict[str, torch.Tensor]:
        """The stored arrays themselves (every packed token; no copy), for readers that take a
        token count (:func:`testbed.policies.packed_attention.packed_part`)."""
        return {name: buf.view() for name, buf in self.buffers.items()}

    def decode(self) -> torch.Tensor:
        return self.q.dequantize(self.packed())

    def used_bytes(self) -> int:
        return sum(b.used_bytes() for b in self.buffers.values())


class _MixedMiddle:
    """A mixed policy's middle of K and V in one layer: two packed spans per tensor, one per bit
    width, over the flattened (sequence, KV head) rows that have it (``low [B, H]`` bool)."""

    def __init__(self, policy: Policy, low: torch.Tensor):
        self.low = low
        self.bits = torch.where(low, int(policy.low[3:]), int(policy.middle[3:])).to(torch.uint8)
        hq, lq = policy.quantizers(), policy.low_quantizers()
        self.spans = {"high": (_PackedSpan(hq[0], "k"), _PackedSpan(hq[1], "v")),
                      "low": (_PackedSpan(lq[0], "k"), _PackedSpan(lq[1], "v"))}
        self.masks = {"high": ~low, "low": low}
        self.tokens = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for which, (sk, sv) in self.spans.items():
            m = self.masks[which]
            if m.any():
                sk.append(k[m])
                sv.append(v[m])
        self.tokens += k.shape[-2]

    def decode(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, H, tokens, D]`` decoded from both spans (``like``: dtype and device)."""
        b, h, _, d = like.shape
        out_k = torch.empty(b, h, self.tokens, d, dtype=torch.float32, device=like.device)
        out_v = torch.empty_like(out_k)
        for which, (sk, sv) in self.spans.items():
            m = self.masks[which]
            if m.any():
                out_k[m] = sk.decode()
                out_v[m] = sv.decode()
        return out_k, out_v

    def used_bytes(self) -> int:
        """The packed spans' bytes and one byte of bits per (sequence, KV head) row."""
        return (sum(sk.used_bytes() + sv.used_bytes() for sk, sv in self.spans.values())
                + self.bits.numel() * self.bits.element_size())

    def evidence(self) -> dict[str, torch.Tensor]:
        """Batch row 0's stored arrays, ``{scheme}.key.*`` / ``{scheme}.value.*`` over its heads of
        that bit width (in head order), and ``alloc.bits [H]``."""
        out = {"alloc.bits": self.bits[0]}
        for which, (sk, sv) in self.spans.items():
            m = self.masks[which]
            n0 = int(m[0].sum())
            if not n0 or not sk.tokens:
                continue
            scheme = f"int{sk.q.bits}"
            for label, span in (("key", sk), ("value", sv)):
                for name, buf in span.buffers.items():
                    out[f"{scheme}.{label}.{name}"] = buf.view()[:n0]
        return out


class PolicyLayer(DynamicLayer):
    """One layer's cache under ``policy``. ``record=True`` keeps a float32 copy of every K/V
    appended for batch row 0 (evidence: the audit re-encodes the packed middle from it).

    Pre-RoPE keys (``policy.key_rope == "pre"``): ``update`` receives post-RoPE keys (transformers
    hands a cache no cos / sin), so :func:`policy_attention` hooks each decoder layer's attention
    module (Llama-style ``LlamaAttention``, ``Gemma3Attention``: :func:`attention_modules`) and
    records the ``position_embeddings = (cos, sin)`` the model calls it with -- the layer's own
    rotary embedding (Gemma-3: global on full layers, local on sliding ones) at the new tokens'
    positions. The layer un-rotates the new keys with them (:func:`rope_unrotate`: the exact inverse
    of the orthogonal pair rotation, up to float32 rounding), stores those in every region, keeps
    the cos / sin rows by arrival index, and at every read rotates the held keys with the rows of
    their original positions (:func:`rope_rotate`, ``apply_rotary_pos_emb``'s formula; after an
    eviction, the first S and the newest W arrival indices); the new tokens attend as given. This
    was chosen over hooking before ``apply_rotary_pos_emb`` (a patch of each modeling file, or a
    recomputation of ``k_proj`` and Gemma-3's ``k_norm``): it reuses the very cos / sin the model
    used and needs nothing model-specific. A model whose layer cannot give them is refused naming
    the layer and its class (:func:`check_pre_rope`, at the first forward; :meth:`_rope_of`, per
    call: no (cos, sin) pair, a partial or interleaved rotary embedding)."""

    is_croppable = False

    def __init__(self, policy: Policy, record: bool = False, layer_idx: int | None = None, direct: bool = False):
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        if direct:
            if not pa.supported(policy):
                raise ValueError(f"policy {policy.name}: direct attention over codes needs an int2, int4 or int8 "
                                 "middle (whole codes per byte) with K per channel")
            if layer_idx is None:
                raise ValueError("direct attention needs the layer's index")
        self.direct = direct
        self.pre_rope = policy.key_rope == "pre"
        if self.pre_rope and (direct or layer_idx is None):
            raise ValueError(f"policy {policy.name}: pre-RoPE keys need the layer's index (its rotary embedding) and "
                             "are rotated after decoding (direct attention over codes reads post-RoPE codes)")
        self.rope_cos = self.rope_sin = None  # pre-RoPE keys: [B, tokens seen, D] float32, by arrival order
        self._given_rope = None  # (cos, sin) of a prefill handed to load_prefill
        self.record = record
        self.recorded_k: list[torch.Tensor] = []
        self.recorded_v: list[torch.Tensor] = []
        self.recorded_pre: list[tuple] = []  # pre-RoPE keys: (key as stored, cos, sin) of batch row 0
        self.seen = 0
        self.sink_k = self.sink_v = None
        self.tail_k = self.tail_v = None
        qs = policy.quantizers() if not policy.mixed else None
        self.mid_k = _PackedSpan(qs[0], "k") if qs else None
        self.mid_v = _PackedSpan(qs[1], "v") if qs else None
        self.mixed: _MixedMiddle | None = None  # a mixed policy's middle, once its bits are allocated
        self.alloc_score = None  # [B, H] float64: a mixed policy's measured prefill concentration
        self._prefill = None  # (k, v) of a prefill waiting for its sink to be chosen by attention
        self.sink_index = self.sink_score = self.recorded_q = None
        # heavy hitters: [B, H, c] token indices (int64 in memory, counted as int32) and float32
        # scores, [B, H, c, D] float32 K/V; float32 scores of the window's tokens; the tokens the
        # last flush moved into the middle, waiting for the attention call to score them
        self.hh_index = self.hh_score = self.hh_k = self.hh_v = self.tail_score = None
        self._hh_moved = None
        self._hh_waiting = False
        self.oracle_received = None  # [B, H, N] float64: a heavy-hitter oracle's whole-segment score
        if policy.observes and layer_idx is None:
            raise ValueError("a policy that decides from attention needs the layer's index")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        empty = key_states[..., :0, :].to(torch.float32)
        self.sink_k = self.sink_v = self.tail_k = self.tail_v = empty
        self.keys = self.values = empty  # transformers reads these for dtype/device only
        if self.pre_rope:
            self.rope_cos = self.rope_sin = empty[:1, 0]
        if self.policy.heavy:
            self.hh_k = self.hh_v = empty
            self.hh_score = self.tail_score = empty[..., 0]
            self.hh_index = torch.zeros(empty.shape[:2] + (0,), dtype=torch.int64, device=empty.device)
        self.is_initialized = True

    # -- the transformers API ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        stale = _PENDING.get(self.layer_idx)
        if stale is not None and stale[0] is not self:
            del _PENDING[self.layer_idx]  # left by another cache whose forward did not finish
        elif stale is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the eviction mask of the previous update was never applied; "
                               f"run the model inside testbed.policies.cache.policy_attention(model)")
        if self._prefill is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the prefill's sink was never chosen (its attention call did not "
                               "run through testbed.policies.cache.policy_attention(model))")
        if self._hh_waiting:
            raise RuntimeError(f"layer {self.layer_idx}: the previous update's attention call never reported its "
                               "attention (a heavy-hitter policy accumulates it; run the model inside "
                               "testbed.policies.cache.policy_attention(model))")
        if self.policy.mixed and self.seen > 0 and self.mixed is None:
            raise RuntimeError(f"layer {self.layer_idx}: a mixed policy's bits are allocated after the prefill "
                               "(PolicyCache.finish_prefill) before any further token")
        t = key_states.shape[-2]
        if self.policy.evicts and t > 1 and self.seen > 0:  # the prefill attends itself causally, as for
            self._leave_mask(t)                               # every policy; the policy applies after it
        k_new = key_states.to(torch.float32)
        v_new = value_states.to(torch.float32)
        k_store = k_new  # the keys as the layer stores them
        if self.pre_rope:
            cos, sin = self._rope_of(t, k_new)
            k_store = rope_unrotate(k_new, cos, sin)
        if self.record:
            self.recorded_k.append(k_new[0].detach().clone())
            self.recorded_v.append(v_new[0].detach().clone())
            if self.pre_rope:
                self.recorded_pre.append((k_store[0].detach().clone(), cos[0].clone(), sin[0].clone()))
        parts_k, parts_v = [self.sink_k], [self.sink_v]
        if self.direct and self.mid_k.tokens:
            _require_active("direct attention over codes", self.layer_idx)
            if self.layer_idx in _DIRECT:
                raise RuntimeError(f"layer {self.layer_idx}: direct attention of the previous update never ran; "
                                   "run the model inside testbed.policies.cache.policy_attention(model)")
            _DIRECT[self.layer_idx] = (self, t, self.mid_k.tokens)  # attention reads these codes
        elif self.mid_k is not None and self.mid_k.tokens:
            mk, mv = self.mid_k.decode(), self.mid_v.decode()
            if self.hh_index is not None and self.hh_index.shape[-1]:  # the heavy hitters read as float32
                at = self.hh_index[..., None].expand(-1, -1, -1, mk.shape[-1])
                mk, mv = mk.scatter(2, at, self.hh_k), mv.scatter(2, at, self.hh_v)
            parts_k.append(mk)
            parts_v.append(mv)
        elif self.mixed is not None and self.mixed.tokens:
            mk, mv = self.mixed.decode(self.tail_k)
            parts_k.append(mk)
            parts_v.append(mv)
        parts_k.append(self.tail_k)
        if self.pre_rope:  # every held key rotated with its own position's cos / sin; the new ones as given
            held = torch.cat(parts_k, dim=-2)
            at = self._held_positions()
            parts_k = [rope_rotate(held, self.rope_cos[:, at], self.rope_sin[:, at])]
            rows = max(cos.shape[0], self.rope_cos.shape[0]) if self.seen else cos.shape[0]
            self.rope_cos = torch.cat([self.rope_cos.expand(rows, -1, -1), cos.expand(rows, -1, -1)], dim=1)
            self.rope_sin = torch.cat([self.rope_sin.expand(rows, -1, -1), sin.expand(rows, -1, -1)], dim=1)
        parts_k.append(k_new)
        parts_v += [self.tail_v, v_new]
        keys = torch.cat(parts_k, dim=-2).to(key_states.dtype)
        values = torch.cat(parts_v, dim=-2).to(value_states.dtype)
        if self.policy.heavy:  # every attention call reports what each key received
            _require_active("a heavy-hitter policy", self.layer_idx)
            _SELECT[self.layer_idx] = self
            self._commit(k_store, v_new)
            self._hh_waiting = True
            return keys, values
        if self.policy.observes and self.seen == 0:
            _require_active("a policy that decides from attention", self.layer_idx)
            _SELECT[self.layer_idx] = self  # the attention call measures the prefill's attention
            if self.policy.sink_select == "mass":
                self._prefill = (k_store, v_new)  # ... chooses the sink, then commits
                return keys, values
        self._commit(k_store, v_new)
        return keys, values

    def _rope_of(self, t: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``cos``, ``sin`` ``[B, t, D]`` (float32) the model rotated the ``t`` new keys
        ``like [B, H, t, D]`` with: handed to :meth:`load_prefill`, or captured from this layer's
        attention module in the current forward (:func:`policy_attention`). ``ValueError`` naming the
        layer and the module's class where they are not a whole-head rotate-half rotary embedding."""
        if self._given_rope is not None:
            pe, cls = self._given_rope, "load_prefill"
            self._given_rope = None
        else:
            got = _ROPE.pop(self.layer_idx, None)
            if got is None:
                _require_active("a pre-RoPE key (the layer's rotary embedding)", self.layer_idx)
                raise RuntimeError(f"layer {self.layer_idx}: no rotary embedding reached the layer's attention module "
                                   "before its cache update; key_rope 'pre' cannot un-rotate its keys")
            pe, cls = got
        if not (isinstance(pe, (tuple, list)) and len(pe) == 2 and all(isinstance(x, torch.Tensor) for x in pe)):
            raise ValueError(f"layer {self.layer_idx} ({cls}): position_embeddings is {type(pe).__name__}, not a "
                             "(cos, sin) pair; the pre-RoPE key cannot be obtained")
        cos, sin = pe
        b, _, _, d = like.shape
        if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, b) or tuple(cos.shape[1:]) != (t, d):
            raise ValueError(f"layer {self.layer_idx} ({cls}): cos / sin {list(cos.shape)} / {list(sin.shape)} do not "
                             f"rotate whole keys [{b}, H, {t}, {d}] (a partial rotary embedding?); the pre-RoPE key "
                             "cannot be obtained")
        h = d // 2
        if d % 2 or not (torch.equal(cos[..., :h], cos[..., h:]) and torch.equal(sin[..., :h], sin[..., h:])):
            raise ValueError(f"layer {self.layer_idx} ({cls}): cos / sin are not rotate_half's layout (one frequency on "
                             "channels i and i + D/2); the pre-RoPE key cannot be obtained")
        return cos.to(torch.float32), sin.to(torch.float32)  # [1 or B, t, D]: one row serves the batch

    def _held_positions(self) -> torch.Tensor:
        """Arrival indices of the held keys, in the order the layer returns them (sink, middle,
        window): every token in order, or, when the layer evicts, the first S and the newest W."""
        n_sink, n_tail = self.sink_k.shape[-2], self.tail_k.shape[-2]
        if self.policy.evicts:
            at = torch.cat([torch.arange(n_sink), torch.arange(self.seen - n_tail, self.seen)])
        else:
            if self.held_tokens() != self.seen:
                raise RuntimeError(f"layer {self.layer_idx}: {self.held_tokens()} keys held of {self.seen} seen")
            at = torch.arange(self.seen)
        return at.to(self.tail_k.device)

    def observe_prefill(self, query: torch.Tensor, key: torch.Tensor, scale: float) -> None:
        """Called by the attention function with the prefill's queries and keys: a mixed policy
        measures its heads' :func:`concentration`; a ``"mass"`` sink is chosen (:func:`sink_scores`,
        :func:`choose_sink`) and the prefill committed."""
        t0 = time.perf_counter()
        if self.policy.heavy:
            if key.shape[-2] != self.seen:
                raise RuntimeError(f"layer {self.layer_idx}: attention over {key.shape[-2]} keys, the cache holds "
                                   f"{self.seen} tokens")
            self._hh_waiting = False
            self.take_attention(accumulated_attention(query, key, scale))
            OBSERVE_SECONDS[0] += time.perf_counter() - t0
            return
        if self.record:
            self.recorded_q = query[0].detach().float().clone()
        if self.policy.mixed:
            self.alloc_score = concentration(query, key, scale)
        if self.policy.sink_select == "mass":
            k_new, v_new = self._prefill
            self._prefill = None
            p, t = self.policy, k_new.shape[-2]
            scores = sink_scores(query, key, scale, sink_candidates(t, p.sink, p.window))
            self._commit_chosen(k_new, v_new, scores, query[0] if self.record else None)
        OBSERVE_SECONDS[0] += time.perf_counter() - t0

    choose_sink_from = observe_prefill  # the name before mixed policies measured the prefill too

    def take_attention(self, received: torch.Tensor) -> None:
        """A heavy-hitter policy: add ``received [B, H, n]`` (:func:`accumulated_attention` of every
        token held, in order) to the scores of the candidates -- the float32 window, the held heavy
        hitters and the tokens the last flush moved into the middle -- then keep as heavy hitters
        the ``heavy`` candidates of largest score among the held ones and the moved ones
        (:func:`choose_heavy`; ``heavy_rule == "first"``: the oldest, whatever their score). The
        other packed tokens' scores are no longer kept: their float32
        values are gone, so they can never become heavy hitters."""
        n = received.shape[-1]
        if n != self.seen:
            raise RuntimeError(f"layer {self.layer_idx}: attention received by {n} keys, {self.seen} held")
        add = lambda score, at: (score.to(torch.float64) + torch.gather(received, 2, at)).to(torch.float32)  # noqa: E731
        b, h = received.shape[:2]
        tail = self.tail_k.shape[-2]
        tail_at = torch.arange(n - tail, n, device=received.device).expand(b, h, tail)
        self.tail_score = add(self.tail_score, tail_at)
        if self.hh_index.shape[-1]:
            self.hh_score = add(self.hh_score, self.hh_index)
        if self._hh_moved is None:
            return
        idx, k, v, score = self._hh_moved
        self._hh_moved = None
        score = add(score, idx)
        cand_i = torch.cat([self.hh_index, idx], dim=-1)  # held ones are older: ascending
        cand_s = torch.cat([self.hh_score, score], dim=-1)
        rule = self.policy.heavy_rule
        if rule == "attention":
            rank = cand_s
        elif rule == "first":  # the oldest
            rank = -cand_i.to(torch.float32)
        else:  # "oracle": the whole segment's accumulated attention, given in advance
            if self.oracle_received is None or self.oracle_received.shape[:2] != cand_i.shape[:2] \
                    or self.oracle_received.shape[-1] < self.seen:
                raise RuntimeError(f"layer {self.layer_idx}: policy {self.policy.name} ranks by the whole segment's "
                                   "accumulated attention, which was not given for the tokens held (oracle_received "
                                   f"{None if self.oracle_received is None else list(self.oracle_received.shape)}, "
                                   f"{self.seen} tokens)")
            rank = torch.gather(self.oracle_received.to(cand_i.device), 2, cand_i)
        keep = choose_heavy(cand_i, rank, self.policy.heavy)
        at = keep[..., None].expand(-1, -1, -1, k.shape[-1])
        self.hh_k = torch.gather(torch.cat([self.hh_k, k], dim=2), 2, at)
        self.hh_v = torch.gather(torch.cat([self.hh_v, v], dim=2), 2, at)
        self.hh_index = torch.gather(cand_i, 2, keep)
        self.hh_score = torch.gather(cand_s, 2, keep)

    def _commit_chosen(self, k_new, v_new, scores: torch.Tensor, query0: torch.Tensor | None) -> None:
        index = choose_sink(scores, self.policy.sink)
        if self.record and query0 is not None:
            self.recorded_q = query0.detach().float().clone()
        self.sink_index, self.sink_score = index, scores
        self._commit(k_new, v_new, index)

    def assign_bits(self, low: torch.Tensor) -> None:
        """A mixed policy's allocation for this layer (``low [B, H]`` bool: the pairs at ``low``'s
        bits), then the flush the prefill deferred."""
        if not self.policy.mixed or self.mixed is not None:
            raise RuntimeError(f"layer {self.layer_idx}: bits are assigned once, to a mixed policy's layer")
        self.mixed = _MixedMiddle(self.policy, low.to(torch.bool).to(self.tail_k.device))
        self._flush()

    def load_prefill(self, key_states: torch.Tensor, value_states: torch.Tensor, scores: torch.Tensor | None = None,
                     query0: torch.Tensor | None = None, alloc_score: torch.Tensor | None = None,
                     received: torch.Tensor | None = None, rope: tuple | None = None) -> None:
        """Take a prefill computed elsewhere (a shared float32 prefill: its post-RoPE K/V
        ``[B, H_kv, P, D]``) into an empty layer, leaving the state the model's own prefill through
        this layer would leave. A sink chosen from attention needs the prefill's ``scores``
        (:func:`sink_scores` over exactly the policy's candidates, :func:`sink_candidates`) and, when
        recording, ``query0``, the prefill's queries of batch row 0 ``[H_q, P, D]``; a mixed policy
        whose rule reads the prefill's attention needs ``alloc_score`` (:func:`concentration`
        ``[B, H_kv]``) and, when recording, ``query0``; a layer of pre-RoPE keys needs ``rope``, the
        prefill's rotary ``(cos, sin)`` as the layer's attention module was called with them."""
        if self.is_initialized and self.seen:
            raise RuntimeError(f"layer {self.layer_idx}: load_prefill needs an empty layer ({self.seen} tokens held)")
        if self.pre_rope:
            if rope is None:
                raise ValueError(f"layer {self.layer_idx}: policy {self.policy.name} stores pre-RoPE keys; load_prefill "
                                 "needs the prefill's rotary cos / sin (rope=(cos, sin), each [B, P, D])")
            self._given_rope = tuple(rope)
        p, t = self.policy, key_states.shape[-2]
        if p.heavy:
            if received is None or tuple(received.shape) != tuple(key_states.shape[:3]):
                raise ValueError(f"layer {self.layer_idx}: policy {p.name} keeps heavy hitters from the attention keys "
                                 f"receive; load_prefill needs the prefill's accumulated attention {list(key_states.shape[:3])}")
            self.lazy_initialization(key_states, value_states)
            k_new, v_new = key_states.to(torch.float32), value_states.to(torch.float32)
            if self.record:
                self.recorded_k.append(k_new[0].detach().clone())
                self.recorded_v.append(v_new[0].detach().clone())
            self._commit(k_new, v_new)
            self.take_attention(received.to(torch.float64))
            return
        if p.mixed and p.observes:
            if alloc_score is None or tuple(alloc_score.shape) != tuple(key_states.shape[:2]):
                raise ValueError(f"layer {self.layer_idx}: policy {p.name} allocates its bits from the prefill's "
                                 f"attention; load_prefill needs its concentration [B, H_kv] = {list(key_states.shape[:2])}")
            k_new, v_new = self._first_prefill(key_states, value_states, query0)
            if self.record:
                self.recorded_q = query0.detach().float().clone()
            self.alloc_score = alloc_score.to(torch.float64)
            self._commit(k_new, v_new)
            return
        if p.sink_select != "mass":
            self.update(key_states, value_states)
            return
        c = sink_candidates(t, p.sink, p.window)
        if scores is None or scores.shape[-1] != c:
            raise ValueError(f"layer {self.layer_idx}: policy {p.name} chooses its sink from the prefill's attention; "
                             f"load_prefill needs its scores over exactly the first {c} tokens")
        k_new, v_new = self._first_prefill(key_states, value_states, query0)
        self._commit_chosen(k_new, v_new, scores, query0)

    def _first_prefill(self, key_states, value_states, query0):
        """Initialize the layer with the prefill's K/V as float32, recording batch row 0's when this is
        the evidence layer (which also needs the prefill's queries)."""
        if self.record and query0 is None:
            raise ValueError(f"layer {self.layer_idx}: a recording layer of {self.policy.name} needs the prefill's queries")
        self.lazy_initialization(key_states, value_states)
        k_new, v_new = key_states.to(torch.float32), value_states.to(torch.float32)
        if self.record:
            self.recorded_k.append(k_new[0].detach().clone())
            self.recorded_v.append(v_new[0].detach().clone())
        return k_new, v_new

    def _leave_mask(self, t: int) -> None:
        """The mask that gives each of ``t`` new tokens exactly what one token per forward sees."""
        p = self.policy
        s, w = self.sink_k.shape[-2], self.tail_k.shape[-2]
        held = torch.cat([torch.arange(s), torch.arange(self.seen - w, self.seen)])
        keys = torch.cat([held, torch.arange(self.seen, self.seen + t)])
        queries = torch.arange(self.seen, self.seen + t)[:, None]
        causal = keys[None] <= queries
        visible = causal & ((keys[None] < p.sink) | (keys[None] >= queries - p.window))
        if s + w == self.seen and torch.equal(visible, causal):
            return  # nothing evicted yet, nothing to hide: transformers' causal mask is this one
        if self.layer_idx is None:
            raise RuntimeError("an evicting PolicyLayer needs its layer_idx to take several tokens per forward")
        _require_active("an eviction mask", self.layer_idx)
        _PENDING[self.layer_idx] = (self, visible)

    def get_seq_length(self) -> int:
        return self.seen  # positions continue from here, also after an eviction

    def held_tokens(self) -> int:
        if not self.is_initialized:
            return 0
        mid = self.mid_k.tokens if self.mid_k is not None else self.mixed.tokens if self.mixed is not None else 0
        return self.sink_k.shape[-2] + mid + self.tail_k.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The keys returned by update are the held ones plus the query's own; every held key is
        # older than every query, so a causal mask over them is right for an evicting cache too.
        return self.held_tokens() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("PolicyLayer cannot be reset; make a new cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PolicyLayer cannot be cropped")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("PolicyLayer does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PolicyLayer does not support batch expansion")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("PolicyLayer does not support batch selection")

    # -- the policy ------------------------------------------------------------------------------
    def _commit(self, k_new: torch.Tensor, v_new: torch.Tensor, index: torch.Tensor | None = None) -> None:
        p = self.policy
        t = k_new.shape[-2]
        if index is not None:  # a chosen sink ([B, H, S'] token indices of this prefill): it, then the rest in order
            b, h, _, d = k_new.shape
            at = index[..., None].expand(-1, -1, -1, d)
            rest = torch.ones(b, h, t, dtype=torch.bool, device=k_new.device)
            rest.scatter_(-1, index, False)
            left = t - index.shape[-1]
            self.sink_k, self.sink_v = torch.gather(k_new, 2, at), torch.gather(v_new, 2, at)
            k_new, v_new = k_new[rest].view(b, h, left, d), v_new[rest].view(b, h, left, d)
            t, take = left, 0
        else:  # fill the sink first
            room = max(0, p.sink - self.sink_k.shape[-2])
            take = min(room, t)
        if take:
            self.sink_k = torch.cat([self.sink_k, k_new[..., :take, :]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, v_new[..., :take, :]], dim=-2)
        if take < t:
            self.tail_k = torch.cat([self.tail_k, k_new[..., take:, :]], dim=-2)
            self.tail_v = torch.cat([self.tail_v, v_new[..., take:, :]], dim=-2)
            if self.tail_score is not None:  # a new token has received no attention yet
                self.tail_score = torch.cat([self.tail_score, self.tail_score.new_zeros(*k_new.shape[:2], t - take)], -1)
        self.seen += t + (0 if index is None else index.shape[-1])
        self._flush()

    def _flush(self) -> None:
        """Evict past the window, or move whole groups that aged out of it into the middle (a
        mixed policy's wait in float32 until its bits are allocated)."""
        p = self.policy
        n_tail = self.tail_k.shape[-2]
        if p.evicts and n_tail > p.window:
            self.tail_k = self.tail_k[..., n_tail - p.window:, :].contiguous()
            self.tail_v = self.tail_v[..., n_tail - p.window:, :].contiguous()
        elif p.quantized and n_tail - p.window >= p.group and (not p.mixed or self.mixed is not None):
            m = p.group * ((n_tail - p.window) // p.group)
            if p.mixed:
                self.mixed.append(self.tail_k[..., :m, :], self.tail_v[..., :m, :])
            else:
                start = self.mid_k.tokens + self.sink_k.shape[-2]
                self.mid_k.append(self.tail_k[..., :m, :])
                self.mid_v.append(self.tail_v[..., :m, :])
                if p.heavy:  # candidates until the attention call has scored them (take_attention)
                    if self._hh_moved is not None:
                        raise RuntimeError(f"layer {self.layer_idx}: two flushes without an attention call between")
                    b, h = self.tail_k.shape[:2]
                    idx = torch.arange(start, start + m, device=self.tail_k.device).expand(b, h, m)
                    self._hh_moved = (idx, self.tail_k[..., :m, :].contiguous(), self.tail_v[..., :m, :].contiguous(),
                                      self.tail_score[..., :m])
                    self.tail_score = self.tail_score[..., m:].contiguous()
            self.tail_k = self.tail_k[..., m:, :].contiguous()
            self.tail_v = self.tail_v[..., m:, :].contiguous()

    # -- accounting and evidence -----------------------------------------------------------------
    def stored_bytes(self) -> int:
        """Bytes this layer stores for one sequence: float32 sink and tail, packed middle, header
        (a mixed policy's sequences differ per layer: :meth:`PolicyCache.stored_bytes`)."""
        if not self.is_initialized:
            return 0
        return self.batch_bytes() // self.sink_k.shape[0] + HEADER_BYTES

    def batch_bytes(self) -> int:
        """Bytes this layer stores for the whole batch, headers not counted."""
        if not self.is_initialized:
            return 0
        total = sum(x.numel() * x.element_size() for x in (self.sink_k, self.sink_v, self.tail_k, self.tail_v))
        if self.mid_k is not None:
            total += self.mid_k.used_bytes() + self.mid_v.used_bytes()
        if self.mixed is not None:
            total += self.mixed.used_bytes()
        if self.hh_index is not None:  # heavy hitters' K/V and scores, indices as int32, the window's scores
            total += sum(x.numel() * x.element_size() for x in (self.hh_k, self.hh_v, self.hh_score, self.tail_score))
            total += self.hh_index.numel() * 4
        return total

    def evidence(self) -> dict[str, torch.Tensor]:
        """Every stored array of batch row 0 (``sink.k``, ``key.codes``, ``float.v``, ...) and, when
        recording, ``input.k`` / ``input.v``: the float32 K/V of every token appended."""
        out = {"sink.k": self.sink_k[0], "sink.v": self.sink_v[0], "float.k": self.tail_k[0], "float.v": self.tail_v[0]}
        if self.mid_k is not None and self.mid_k.tokens:
            for label, span in (("key", self.mid_k), ("value", self.mid_v)):
                for name, buf in span.buffers.items():
                    out[f"{label}.{name}"] = buf.view()[0]
        if self.mixed is not None:
            out.update(self.mixed.evidence())
        if self.hh_index is not None:
            out.update({"hh.index": self.hh_index[0].to(torch.int32), "hh.score": self.hh_score[0], "hh.k": self.hh_k[0],
                        "hh.v": self.hh_v[0], "float.score": self.tail_score[0]})
        if self.alloc_score is not None:
            out["alloc.score"] = self.alloc_score[0]
        if self.sink_index is not None:  # the chosen sink: which prefill tokens, from which scores
            out["sink.index"] = self.sink_index[0].to(torch.int32)
            out["sink.score"] = self.sink_score[0]
        if self.record:
            out["input.k"] = torch.cat(self.recorded_k, dim=-2)
            out["input.v"] = torch.cat(self.recorded_v, dim=-2)
            if self.recorded_q is not None:
                out["input.q"] = self.recorded_q
            if self.recorded_pre:  # pre-RoPE keys: the keys as stored and the rotation that gives input.k
                out["input.k_pre"] = torch.cat([x[0] for x in self.recorded_pre], dim=-2)
                out["input.rope_cos"] = torch.cat([x[1] for x in self.recorded_pre], dim=-2)
                out["input.rope_sin"] = torch.cat([x[2] for x in self.recorded_pre], dim=-2)
        return {k: v.detach().contiguous().cpu() for k, v in out.items()}


class SlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-attention layer's cache as the model's own ``DynamicCache`` keeps it: transformers'
    ``DynamicSlidingWindowLayer`` (the newest ``sliding_window - 1`` tokens, in the model's dtype;
    the query's own token makes the window), with :meth:`stored_bytes` counted like
    :meth:`PolicyLayer.stored_bytes` (per sequence) but with no header: it stores no packed array,
    so its bytes are exactly the tensors ``DynamicCache`` holds on that layer."""

    def __init__(self, sliding_window: int, layer_idx: int | None = None):
        super().__init__(sliding_window=sliding_window)
        self.layer_idx = layer_idx

    def held_tokens(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else int(self.keys.shape[-2])

    def stored_bytes(self) -> int:
        """Bytes of the held K and V for one sequence."""
        if not self.is_initialized or self.keys.numel() == 0:
            return 0
        batch = self.keys.shape[0]
        return (self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()) // batch


# config attributes that make layers read another layer's K/V (Gemma-3n's num_kv_shared_layers,
# transformers' kv_sharing_modes): a policy applied to the producing layer would silently change
# the consumers too, and the consumers hold no cache of their own to account
_SHARING_ATTRIBUTES = ("num_kv_shared_layers", "kv_sharing_modes", "shared_kv_layers", "kv_shared_layer_index")
LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_kinds(config) -> list[tuple[str, int | None]]:
    """``[(kind, sliding_window or None), ...]``, one per decoder layer of a model ``config``: the
    kind is ``"full_attention"`` or ``"sliding_attention"`` (from ``config.layer_types``; without
    it, every layer is sliding when ``config.sliding_window`` is set, as ``DynamicCache`` reads it).
    Raises ``ValueError`` naming the layer and its kind for anything else: another layer type
    (chunked, linear, hybrid, MLP-only ...), layers that share a KV cache, a sliding window below 2."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = int(text.num_hidden_layers)
    named = getattr(text, "layer_types", None)
    for attr in _SHARING_ATTRIBUTES:
        value = getattr(text, attr, None)
        if attr == "kv_sharing_modes" and value is not None:
            value = list(value)
            for i, mode in enumerate(value):  # "store" (a producer) counts only when some layer reuses
                if mode == "reuse" or (mode is not None and "reuse" in value):
                    kind = named[i] if named is not None and i < len(named) else "?"
                    raise ValueError(f"layer {i} ({kind}): kv_sharing_modes[{i}] = {mode!r}: layers that share a KV "
                                     "cache are refused (a policy on the producer would change what the consumers read)")
        elif value not in (None, 0, False, [], ()):
            shared = range(n - value, n) if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= n \
                else range(n)
            i = shared[0]
            kind = named[i] if named is not None and i < len(named) else "?"
            raise ValueError(f"layer {i} ({kind}): the config sets {attr} = {value!r}: layers that share a KV cache are "
                             "refused (a policy on the producer would change what the consumers read)")
    if named is not None:  # every name checked before transformers reads the kinds' own attributes
        if len(named) != n:
            raise ValueError(f"the config names {len(named)} layer types for {n} layers")
        for i, kind in enumerate(named):
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer {i} ({kind}): layer type {kind!r} is not served by PolicyCache (it serves "
                                 f"{' and '.join(LAYER_KINDS)})")
    types, kwargs = get_layer_types_and_kwargs(text)
    if len(types) != n:
        raise ValueError(f"the config names {len(types)} layer types for {n} layers")
    out = []
    for i, (kind, kw) in enumerate(zip(types, kwargs)):
        shown = named[i] if named is not None and i < len(named) else kind
        if kind not in LAYER_KINDS or shown not in LAYER_KINDS:
            raise ValueError(f"layer {i} ({shown}): layer type {shown!r} is not served by PolicyCache (it serves "
                             f"{' and '.join(LAYER_KINDS)})")
        window = kw.get("sliding_window") if kind == "sliding_attention" else None
        if kind == "sliding_attention" and (not isinstance(window, int) or window < 2):
            raise ValueError(f"layer {i} ({kind}): sliding_window {window!r} is not an integer >= 2")
        out.append((kind, window))
    return out


def _full_layer(policy: Policy, record: bool, layer_idx: int, direct: bool, scorer_base=None):
    """A full-attention layer running ``policy``: a :class:`ScoredLayer` for a scored selection
    (its scorer from :mod:`testbed.policies.scorers`; a user's file relative to ``scorer_base``),
    else a :class:`PolicyLayer`."""
    if policy.scored:
        if direct:
            raise ValueError(f"policy {policy.name}: direct attention over codes needs a quantized middle")
        scorer = scorers.get(policy.scorer, policy.seed, scorer_base)
        if policy.scorer_mode not in getattr(scorer, "MODES", scorers.MODES):
            raise ValueError(f"policy {policy.name}: scorer {policy.scorer} decides {' or '.join(scorer.MODES)}, "
                             f"not {policy.scorer_mode!r}")
        return ScoredLayer(policy, scorer, record=record, layer_idx=layer_idx, mask_hook=_scored_mask,
                           select_hook=_scored_select, storage=PolicyLayer)
    return PolicyLayer(policy, record=record, layer_idx=layer_idx, direct=direct)


def _scored_select(layer) -> None:
    """A scored layer whose scorer reads attention: the attention call that follows reports to it."""
    _require_active("a scorer of attention", layer.layer_idx)
    _SELECT[layer.layer_idx] = layer


def _scored_mask(layer, visible: torch.Tensor) -> None:
    """A scored layer's chunk after an eviction: its mask, applied by the attention call that follows."""
    _require_active("a chunk after a scored eviction", layer.layer_idx)
    _PENDING[layer.layer_idx] = (layer, visible)


class PolicyCache(Cache):
    """``Cache(layers=[PolicyLayer(policy), ...])`` for a model of ``num_layers`` layers;
    ``record_layer`` records its float32 inputs (see :meth:`PolicyLayer.evidence`); ``direct``:
    attention reads the packed middle from its codes (:mod:`testbed.policies.packed_attention`;
    needs :func:`policy_attention`) instead of decoding it on every update.

    That constructor treats every layer as full attention; :meth:`for_model` reads the model's
    layer kinds (sliding windows) and is the one to use for a model that has any."""

    def __init__(self, policy: Policy, num_layers: int, record_layer: int | None = None, direct: bool = False, *,
                 layers: list | None = None, kinds: list[str] | None = None, scores: torch.Tensor | None = None,
                 received: list[torch.Tensor] | None = None, scorer_base=None):
        if layers is None:
            layers = [_full_layer(policy, i == record_layer, i, direct, scorer_base) for i in range(num_layers)]
        elif len(layers) != num_layers:
            raise ValueError(f"{len(layers)} layers given for num_layers={num_layers}")
        if policy.per_layer and len(policy.layer_keep) != num_layers:
            raise ValueError(f"policy {policy.name}: its per-layer schedule was derived for {len(policy.layer_keep)} "
                             f"layers; the model has {num_layers}")
        super().__init__(layers=layers)
        self.policy = policy
        self.kinds = list(kinds) if kinds is not None else ["full_attention"] * num_layers
        if policy.mixed and policy.alloc_from == "oracle" and scores is None:
            raise ValueError(f"policy {policy.name}: an oracle allocation needs its scores ([B, layers, KV heads])")
        if policy.heavy_oracle:
            if received is None or len(received) != num_layers:
                raise ValueError(f"policy {policy.name}: an oracle heavy-hitter choice needs the whole segment's "
                                 f"accumulated attention, one [B, KV heads, tokens] tensor per layer ({num_layers})")
            for layer, got in zip(layers, received):
                if isinstance(layer, PolicyLayer):
                    layer.oracle_received = got.to(torch.float64)
        self.given_scores = scores
        self.alloc_low = self.alloc_score = None  # [B, L, H] after finish_prefill

    @classmethod
    def for_model(cls, policy: Policy, config, record_layer: int | None = None, direct: bool = False,
                  sliding: str = "native", scores: torch.Tensor | None = None,
                  received: list[torch.Tensor] | None = None, scorer_base=None) -> "PolicyCache":
        """The cache for a model of ``config`` (a transformers config), one layer per decoder layer:

        - a ``"full_attention"`` layer gets a :class:`PolicyLayer` running ``policy``;
        - a ``"sliding_attention"`` layer (``sliding="native"``, the default and the only choice)
          gets a :class:`SlidingLayer`: exactly what the model's own ``DynamicCache`` keeps there
          (its newest ``sliding_window - 1`` tokens, uncompressed). Such a layer already bounds its
          memory at the window; the policy's regions (a float32 window R, a middle, a sink) are
          defined over the whole history, which that layer never reads again past its window, so
          ``sliding="policy"`` is refused: a ``PolicyLayer`` there would keep every token (more
          bytes than the native window, the bug this replaces), and its eviction mask, its sink
          chosen from causal attention and its direct path ignore the sliding mask.

        Refused (``ValueError``, naming the layer index and kind) before any forward: every case of
        :func:`layer_kinds`; ``record_layer`` on a sliding layer (nothing of the policy is stored
        there); a policy other than ``float32`` on a model with no full-attention layer (it would
        apply nowhere); ``direct`` with a policy its path does not serve (as :class:`PolicyLayer`)."""
        if sliding != "native":
            raise ValueError(f"sliding={sliding!r}: only 'native' is served (a sliding layer keeps what DynamicCache "
                             "keeps there); a policy on sliding layers would keep tokens the layer never reads again, "
                             "and its eviction mask, attention-chosen sink and direct path ignore the sliding mask")
        kinds = layer_kinds(config)
        n = len(kinds)
        if record_layer is not None:
            if not 0 <= record_layer < n:
                raise ValueError(f"record_layer {record_layer}: the model has layers 0..{n - 1}")
            if kinds[record_layer][0] != "full_attention":
                raise ValueError(f"record_layer {record_layer} ({kinds[record_layer][0]}): the policy is applied to "
                                 "full-attention layers only; a sliding layer has no policy evidence to record")
        if policy.mixed and any(k != "full_attention" for k, _ in kinds):
            i = next(i for i, (k, _) in enumerate(kinds) if k != "full_attention")
            raise ValueError(f"layer {i} ({kinds[i][0]}): policy {policy.name} allocates bits over every layer's KV "
                             "heads; a model with sliding layers is not served by a mixed policy")
        if policy.middle != "float32" and not any(k == "full_attention" for k, _ in kinds):
            raise ValueError(f"policy {policy.name}: layers 0..{n - 1} are all {kinds[0][0]}; the policy applies to "
                             "full-attention layers only, so it would apply nowhere")
        layers = [_full_layer(policy, i == record_layer, i, direct, scorer_base)
                  if kind == "full_attention" else SlidingLayer(window, layer_idx=i)
                  for i, (kind, window) in enumerate(kinds)]
        needs_rope = [x for x in layers if isinstance(x, ScoredLayer) and getattr(x.scorer, "ROPE", False)]
        if needs_rope:  # a scorer that models future queries reads the layer's rotary embedding
            try:
                rope = rotary(config, "full_attention")
            except ValueError as e:
                raise ValueError(f"layer {needs_rope[0].layer_idx}: scorer {policy.scorer} needs the layer's rotary "
                                 f"embedding: {e}") from None
            for x in needs_rope:
                x.scorer.bind_rope(rope)
        return cls(policy, n, record_layer, direct, layers=layers, kinds=[k for k, _ in kinds], scores=scores,
                   received=received)

    def finish_prefill(self) -> None:
        """A mixed policy, once the prefill has gone through every layer: allocate the bits over all
        (layer, KV head) pairs of each sequence (:func:`allocate`) from the prefill's measured
        concentration, or the oracle's ``scores``, and flush what the prefill aged out. Nothing for
        other policies."""
        p = self.policy
        if not p.mixed:
            return
        layer0 = self.layers[0]
        b, h = layer0.tail_k.shape[0], layer0.tail_k.shape[1]
        if self.given_scores is not None:
            scores = self.given_scores.to(torch.float64)
        elif p.observes:
            missing = [i for i, layer in enumerate(self.layers) if layer.alloc_score is None]
            if missing:
                raise RuntimeError(f"layers {missing[:4]}: no prefill attention was measured (run the model inside "
                                   "testbed.policies.cache.policy_attention(model))")
            scores = torch.stack([layer.alloc_score.cpu() for layer in self.layers], dim=1)
        else:
            scores = torch.zeros(b, len(self.layers), h, dtype=torch.float64)
        if scores.shape != (b, len(self.layers), h):
            raise ValueError(f"allocation scores {list(scores.shape)}, expected [{b}, {len(self.layers)}, {h}]")
        low = allocate(p, scores)
        for i, layer in enumerate(self.layers):
            layer.assign_bits(low[:, i])
            layer.alloc_score = scores[:, i]
        self.alloc_low, self.alloc_score = low, scores

    def alloc_bits(self) -> torch.Tensor:
        """``[B, L, H]`` uint8: each pair's bits (after :meth:`finish_prefill`)."""
        return torch.stack([layer.mixed.bits.cpu() for layer in self.layers], dim=1)

    def stored_bytes(self) -> int:
        """Bytes of every layer's cache for one sequence."""
        if self.policy.mixed:  # the layers differ per sequence, their sum does not
            batch = next((layer.sink_k.shape[0] for layer in self.layers if layer.is_initialized), 1)
            total = sum(layer.batch_bytes() for layer in self.layers)
            if total % batch:
                raise RuntimeError(f"{total} bytes over a batch of {batch} sequences: the allocation differs in size")
            return total // batch + HEADER_BYTES * sum(1 for layer in self.layers if layer.is_initialized)
        return sum(layer.stored_bytes() for layer in self.layers)

    def stored_bytes_by_kind(self) -> dict[str, int]:
        """Bytes for one sequence summed per layer kind (``"full_attention"``, ``"sliding_attention"``)."""
        out: dict[str, int] = {}
        for kind, layer in zip(self.kinds, self.layers):
            out[kind] = out.get(kind, 0) + layer.stored_bytes()
        return out
