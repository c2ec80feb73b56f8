"""The cache layers a :class:`~testbed.policies.cache.PolicyCache` is made of.

:class:`PolicyLayer` is a ``DynamicLayer`` subclass (``transformers.cache_utils``) running one
:class:`~testbed.policies.policy.Policy` on a full-attention layer. Each ``update(k, v)`` receives
the layer's post-RoPE keys and values of the new tokens ``[B, H_kv, t, D]`` and returns what
attention sees: the float32 sink, the middle decoded from its stored bytes (never a float copy of
it, :mod:`testbed.policies.storage`), the float32 window and the new tokens. Then the new tokens are
committed: tokens that aged out of the window move into the middle in whole groups (quantized once,
appended as parts of the code / scale arrays; nothing already packed is re-quantized) or are
dropped. What it leaves for the attention call right after it (an eviction mask, the direct path
over codes, a prefill waiting for its sink) goes through :mod:`testbed.policies.handoff`; what that
call measures is decided on by :mod:`testbed.policies.selection`.

:class:`SlidingLayer` is a sliding-window layer's cache as the model's own ``DynamicCache`` keeps it.
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from . import packed_attention as pa
from .causal import accumulated_attention
from .handoff import DIRECT, OBSERVE_SECONDS, PENDING, ROPE, SELECT, require_active
from .policy import HEADER_BYTES, Policy, sink_candidates
from .rope import rope_rotate, rope_unrotate
from .selection import choose_heavy, choose_sink, concentration, sink_scores
from .storage import MixedMiddle, PackedSpan

__all__ = ["PolicyLayer", "SlidingLayer"]


class PolicyLayer(DynamicLayer):
    """One layer's cache under ``policy``. ``record=True`` keeps a float32 copy of every K/V
    appended for batch row 0 (evidence: the audit re-encodes the packed middle from it).

    Pre-RoPE keys (``policy.key_rope == "pre"``): ``update`` receives post-RoPE keys (transformers
    hands a cache no cos / sin), so :func:`~testbed.policies.hook.policy_attention` hooks each decoder
    layer's attention module (Llama-style ``LlamaAttention``, ``Gemma3Attention``:
    :func:`~testbed.policies.hook.attention_modules`) and records the ``position_embeddings = (cos,
    sin)`` the model calls it with -- the layer's own
    rotary embedding (Gemma-3: global on full layers, local on sliding ones) at the new tokens'
    positions. The layer un-rotates the new keys with them (:func:`rope_unrotate`: the exact inverse
    of the orthogonal pair rotation, up to float32 rounding), stores those in every region, keeps
    the cos / sin rows by arrival index, and at every read rotates the held keys with the rows of
    their original positions (:func:`rope_rotate`, ``apply_rotary_pos_emb``'s formula; after an
    eviction, the first S and the newest W arrival indices); the new tokens attend as given. This
    was chosen over hooking before ``apply_rotary_pos_emb`` (a patch of each modeling file, or a
    recomputation of ``k_proj`` and Gemma-3's ``k_norm``): it reuses the very cos / sin the model
    used and needs nothing model-specific. A model whose layer cannot give them is refused naming
    the layer and its class (:func:`~testbed.policies.hook.check_pre_rope`, at the first forward;
    :meth:`_rope_of`, per call: no (cos, sin) pair, a partial or interleaved rotary embedding)."""

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
        qs = policy.quantizers(layer_idx) if not policy.mixed else None  # a calibrated codebook: this layer's
        per_group = policy.group if policy.middle == "codec" else None  # a codec: one payload per group
        self.mid_k = PackedSpan(qs[0], "k", per_group) if qs else None
        self.mid_v = PackedSpan(qs[1], "v", per_group) if qs else None
        self.mixed: MixedMiddle | None = None  # a mixed policy's middle, once its bits are allocated
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
        stale = PENDING.get(self.layer_idx)
        if stale is not None and stale[0] is not self:
            del PENDING[self.layer_idx]  # left by another cache whose forward did not finish
        elif stale is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the eviction mask of the previous update was never applied; "
                               f"run the model inside testbed.policies.hook.policy_attention(model)")
        if self._prefill is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the prefill's sink was never chosen (its attention call did not "
                               "run through testbed.policies.hook.policy_attention(model))")
        if self._hh_waiting:
            raise RuntimeError(f"layer {self.layer_idx}: the previous update's attention call never reported its "
                               "attention (a heavy-hitter policy accumulates it; run the model inside "
                               "testbed.policies.hook.policy_attention(model))")
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
            require_active("direct attention over codes", self.layer_idx)
            if self.layer_idx in DIRECT:
                raise RuntimeError(f"layer {self.layer_idx}: direct attention of the previous update never ran; "
                                   "run the model inside testbed.policies.hook.policy_attention(model)")
            DIRECT[self.layer_idx] = (self, t, self.mid_k.tokens)  # attention reads these codes
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
            require_active("a heavy-hitter policy", self.layer_idx)
            SELECT[self.layer_idx] = self
            self._commit(k_store, v_new)
            self._hh_waiting = True
            return keys, values
        if self.policy.observes and self.seen == 0:
            require_active("a policy that decides from attention", self.layer_idx)
            SELECT[self.layer_idx] = self  # the attention call measures the prefill's attention
            if self.policy.sink_select == "mass":
                self._prefill = (k_store, v_new)  # ... chooses the sink, then commits
                return keys, values
        self._commit(k_store, v_new)
        return keys, values

    def _rope_of(self, t: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``cos``, ``sin`` ``[B, t, D]`` (float32) the model rotated the ``t`` new keys
        ``like [B, H, t, D]`` with: handed to :meth:`load_prefill`, or captured from this layer's
        attention module in the current forward (:func:`~testbed.policies.hook.policy_attention`).
        ``ValueError`` naming the layer and the module's class where they are not a whole-head
        rotate-half rotary embedding."""
        if self._given_rope is not None:
            pe, cls = self._given_rope, "load_prefill"
            self._given_rope = None
        else:
            got = ROPE.pop(self.layer_idx, None)
            if got is None:
                require_active("a pre-RoPE key (the layer's rotary embedding)", self.layer_idx)
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
        self.mixed = MixedMiddle(self.policy, low.to(torch.bool).to(self.tail_k.device))
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
        require_active("an eviction mask", self.layer_idx)
        PENDING[self.layer_idx] = (self, visible)

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
        tables = self.policy.table_bytes(self.sink_k.shape[-1]) if self.policy.quantized else 0  # stored once
        return self.batch_bytes() // self.sink_k.shape[0] + HEADER_BYTES + tables

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
