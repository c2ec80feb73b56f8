"""A transformers KV cache that runs a :class:`~testbed.policies.policy.Policy` inside the model.

:class:`PolicyCache` is a transformers ``Cache`` with one layer per decoder layer; the pieces are
one module each:

- :mod:`testbed.policies.layers`: :class:`~testbed.policies.layers.PolicyLayer` (a ``DynamicLayer``
  subclass: what a full-attention layer stores of the tokens it is given, and what attention sees)
  and :class:`~testbed.policies.layers.SlidingLayer` (a sliding-window layer, as ``DynamicCache``);
- :mod:`testbed.policies.storage`: the buffers of the packed middle;
- :mod:`testbed.policies.selection`: what decides which tokens and heads, from attention;
- :mod:`testbed.policies.hook`: :func:`~testbed.policies.hook.policy_attention`, the attention
  function a model runs a policy cache under (and the refusals of a cache or model it cannot serve);
- :mod:`testbed.policies.handoff`: what a layer's update leaves for the attention call after it.

``stored_bytes()`` sums the stored tensors' bytes (the used part of each buffer), per sequence;
it equals :meth:`Policy.layer_bytes` at every step (tested against the closed form).

The first update is the prefill: its tokens attend each other causally in float32, as they would
with no cache, and the policy applies to what it stores afterwards (quantization or eviction).
After it, an evicting policy can take many tokens in one forward only if each of them is kept from the
window keys it would already have evicted one token at a time: the layer then leaves a boolean
mask (query × returned key: ``key position < S`` or ``query − W <= key position <= query``) for
the attention function :data:`~testbed.policies.hook.ATTN_NAME`, registered through transformers'
``AttentionInterface`` and wrapping SDPA (:func:`~testbed.policies.hook.policy_attention` switches a
model to it for a block). An update that needs the mask (or the direct path) outside such a block is
refused at once, and a mask that no attention call consumed is an error at the layer's next update.

A sink chosen from attention (``Policy.sink_select == "mass"``) is chosen by the same attention
function: the prefill's update returns its keys and leaves the commit to the attention call right
after it, which computes the prefill's attention shares (:func:`~testbed.policies.selection.sink_scores`,
on top of the SDPA call the model makes anyway), picks the sink per sequence and KV head
(:func:`~testbed.policies.selection.choose_sink`) and commits the prefill with those tokens in the
float32 sink.

For a model whose layers differ, :meth:`PolicyCache.for_model` reads the layer kinds from its
config (:func:`layer_kinds`): full-attention layers get a ``PolicyLayer``, sliding-window
layers a ``SlidingLayer`` that keeps what the model's own ``DynamicCache`` keeps there (the
policy applies to full layers only); anything else is refused before any forward.

A mixed policy (``Policy.low``: per-head bits) measures each KV head's prefill concentration the
same way (:func:`~testbed.policies.selection.concentration`), keeps the prefill's aged-out tokens
float32 until the whole model has been seen, and then :meth:`PolicyCache.finish_prefill` allocates
the bits over every (layer, KV head) pair of each sequence (:func:`~testbed.policies.selection.allocate`)
and flushes; from then on each layer's middle is two packed spans, one per bit width, over the
(sequence, head) rows that have it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from . import scorers
from .handoff import PENDING, SELECT, require_active
from .layers import PolicyLayer, SlidingLayer
from .policy import HEADER_BYTES, Policy
from .rope import rotary
from .scored import ScoredLayer
from .selection import allocate

__all__ = ["PolicyCache", "layer_kinds", "LAYER_KINDS"]


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
    require_active("a scorer of attention", layer.layer_idx)
    SELECT[layer.layer_idx] = layer


def _scored_mask(layer, visible: torch.Tensor) -> None:
    """A scored layer's chunk after an eviction: its mask, applied by the attention call that follows."""
    require_active("a chunk after a scored eviction", layer.layer_idx)
    PENDING[layer.layer_idx] = (layer, visible)


class PolicyCache(Cache):
    """``Cache(layers=[PolicyLayer(policy), ...])`` for a model of ``num_layers`` layers;
    ``record_layer`` records its float32 inputs (see :meth:`PolicyLayer.evidence`); ``direct``:
    attention reads the packed middle from its codes (:mod:`testbed.policies.packed_attention`;
    needs :func:`~testbed.policies.hook.policy_attention`) instead of decoding it on every update.

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
        if (policy.mixed or policy.selective) and policy.alloc_from == "oracle" and scores is None:
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
        self.sel_sparse = self.sel_score = None  # [B, L, H] after a selective selection's finish_prefill

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
        if (policy.mixed or policy.selective) and any(k != "full_attention" for k, _ in kinds):
            i = next(i for i, (k, _) in enumerate(kinds) if k != "full_attention")
            raise ValueError(f"layer {i} ({kinds[i][0]}): policy {policy.name} allocates over every layer's KV "
                             "heads; a model with sliding layers is not served by a mixed or selective policy")
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
        if p.selective:
            self._finish_selective()
            return
        if not p.mixed:
            return
        layer0 = self.layers[0]
        b, h = layer0.tail_k.shape[0], layer0.tail_k.shape[1]
        scores = self._pair_scores("alloc_score", b, h, "allocation scores", "no prefill attention was measured (run "
                                   "the model inside testbed.policies.hook.policy_attention(model))")
        low = allocate(p, scores)
        for i, layer in enumerate(self.layers):
            layer.assign_bits(low[:, i])
            layer.alloc_score = scores[:, i]
        self.alloc_low, self.alloc_score = low, scores

    def _pair_scores(self, attr: str, b: int, h: int, what: str, missing_why: str) -> torch.Tensor:
        """``[B, L, H]`` float64 per-pair scores a per-pair rule reads: the oracle's (handed in), each
        layer's measured ``attr`` when the rule observes the prefill, else zeros (a content-blind rule)."""
        if self.given_scores is not None:
            scores = self.given_scores.to(torch.float64)
        elif self.policy.observes:
            missing = [i for i, layer in enumerate(self.layers) if getattr(layer, attr) is None]
            if missing:
                raise RuntimeError(f"layers {missing[:4]}: {missing_why}")
            scores = torch.stack([getattr(layer, attr).cpu() for layer in self.layers], dim=1)
        else:
            scores = torch.zeros(b, len(self.layers), h, dtype=torch.float64)
        if scores.shape != (b, len(self.layers), h):
            raise ValueError(f"{what} {list(scores.shape)}, expected [{b}, {len(self.layers)}, {h}]")
        return scores

    def _finish_selective(self) -> None:
        """The selective rule, once the prefill has gone through every layer: per sequence the
        ``sparse_count(L·H)`` pairs with the smallest :func:`~testbed.policies.selection.allocation_keys`
        of the prefill's measured concentration (or the oracle's ``scores``; zeros for a content-blind
        rule) are sparse (:func:`allocate`), and every layer cuts its held prefill (``cut_selective``)."""
        p = self.policy
        waiting = [layer for layer in self.layers if getattr(layer, "uncut", None) is not None]
        if len(waiting) != len(self.layers):
            raise RuntimeError(f"policy {p.name}: {len(self.layers) - len(waiting)} of {len(self.layers)} layers hold "
                               "no prefill waiting for its classes")
        b, h = waiting[0].uncut[4].shape[:2]
        scores = self._pair_scores("sel_score", b, h, "class scores", "no prefill concentration was measured (run the "
                                   "model inside testbed.policies.hook.policy_attention(model), or hand the shared "
                                   "prefill's)")
        sparse = allocate(p, scores, p.sparse_count(len(self.layers) * h))
        for i, layer in enumerate(self.layers):
            layer.cut_selective(sparse[:, i], scores[:, i])
        self.sel_sparse, self.sel_score = sparse, scores

    def held_counts(self) -> torch.Tensor:
        """``[B, L, H]`` int64: the tokens each (layer, KV head) pair holds (a selective selection's)."""
        return torch.stack([layer.head_counts() for layer in self.layers], dim=1)

    def alloc_bits(self) -> torch.Tensor:
        """``[B, L, H]`` uint8: each pair's bits (after :meth:`finish_prefill`)."""
        return torch.stack([layer.mixed.bits.cpu() for layer in self.layers], dim=1)

    def stored_bytes(self) -> int:
        """Bytes of every layer's cache for one sequence."""
        if self.policy.mixed or self.policy.selective:  # the layers differ per sequence, their sum does not
            batch = next(((layer.kept_index if self.policy.selective else layer.sink_k).shape[0]
                          for layer in self.layers if layer.is_initialized), 1)
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
