"""The attention function a model runs a :class:`~testbed.policies.cache.PolicyCache` under.

:func:`policy_attention` switches a model to :data:`ATTN_NAME` for a block: SDPA, registered through
transformers' ``AttentionInterface``, that applies what a policy layer's update left for it
(:mod:`testbed.policies.handoff`): an eviction mask, attention read from the packed codes
(:mod:`testbed.policies.packed_attention`), a prefill whose sink or bits are chosen from its
attention, an observer of every call (:func:`testbed.policies.selection.observe_concentration`).
Its forward pre-hooks capture each layer's rotary ``(cos, sin)`` for a layer that stores pre-RoPE
keys (:func:`capture_rope` does the same outside it) and refuse, at the first forward, a cache whose
layer kinds are not the model's (:func:`check_cache_kinds`) or a pre-RoPE cache on a model whose
rotary embedding cannot be obtained (:func:`check_pre_rope`).
"""

from __future__ import annotations

import contextlib

import torch

from . import packed_attention as pa
from .cache import PolicyCache, layer_kinds
from .handoff import ACTIVE, DIRECT, OBSERVER, PENDING, ROPE, SELECT
from .layers import PolicyLayer, SlidingLayer

__all__ = ["ATTN_NAME", "policy_attention", "attention_modules", "check_pre_rope", "capture_rope",
           "check_cache_kinds"]

ATTN_NAME = "testbed_policy"


def _masked_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if OBSERVER[0] is not None:
        OBSERVER[0](getattr(module, "layer_idx", None), query, key,
                     float(query.shape[-1] ** -0.5 if scaling is None else scaling))
    select = SELECT.pop(getattr(module, "layer_idx", None), None)
    if select is not None:
        out = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
        select.observe_prefill(query, key, float(query.shape[-1] ** -0.5 if scaling is None else scaling))
        return out
    direct = DIRECT.pop(getattr(module, "layer_idx", None), None)
    if direct is not None:
        layer, new, packed = direct  # the middle as it was when update returned (a flush may follow it)
        scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
        out = pa.attend(query, layer, key, value, scale, packed, new)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    pending = PENDING.pop(getattr(module, "layer_idx", None), None)
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
    PENDING.clear()
    DIRECT.clear()
    SELECT.clear()
    ROPE.clear()
    ACTIVE[0] += 1
    hook = model.register_forward_pre_hook(_refuse_mismatched_cache, with_kwargs=True)
    rope_hooks = _rope_hooks(model, ROPE)
    try:
        yield model
    finally:
        for h in rope_hooks:
            h.remove()
        ROPE.clear()
        hook.remove()
        ACTIVE[0] -= 1
        PENDING.clear()
        DIRECT.clear()
        SELECT.clear()
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
