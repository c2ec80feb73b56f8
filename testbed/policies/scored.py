"""The cache layer of a scored selection: each (sequence, KV head) keeps its top-``keep`` tokens
(under a per-layer schedule, ``layers="pyramid"``, the layer's own count: ``Policy.keep_of``; under
``heads="adaptive"``, Ada-KV, the layer's heads share ``keep x H_kv`` tokens unevenly, below).

A scorer (:mod:`testbed.policies.scorers`) gives every token a float32 score when it arrives; the
layer keeps the ``keep`` tokens of largest score, ties to the older token (:func:`keep_top`), and
always the newest ``window`` tokens seen (the policy's ``window``: H2O's recent tokens), as
float32 K and V in the order they arrived, each with its int32 position and float32 score (counted
in the bytes: the index is what the audit and any sparse kernel need, the score what an online
decision compares a new token with).

- ``scorer_mode="prefill"``: the prefill attends itself causally, as with every policy, then is
  cut to its top ``keep`` once (kvpress's compression); every later token is kept.
- ``scorer_mode="online"``: the same at the prefill, then each later token is scored on arrival,
  attends the held tokens and itself, and the lowest-scored of the held ones and it is dropped
  when more than ``keep`` are held (append-only: a dropped token never comes back). A chunk of
  tokens is exact up to and including the token whose append first exceeds ``keep``
  (:meth:`~testbed.policies.policy.Policy.next_change`); after that, one token per forward.

Kept keys keep the positions they were rotated with. Every held key is older than every new query,
but once tokens were dropped the model's causal mask (by position) no longer lines up with the held
keys: a chunk of several tokens then gets its own mask (held keys visible to all, new keys causal)
through :func:`testbed.policies.hook.policy_attention`.

Adaptive per-head budgets (``heads="adaptive"``, prefill mode only; Feng et al., 2024, "Ada-KV:
Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference"; kvpress
0.5.5's ``AdaKVPress``): at the prefill the layer keeps ``keep x H_kv`` tokens per sequence, each KV
head first its own top ``safeguard_count(keep, alpha)`` (``int(keep * alpha)``, at least 1 for
``alpha > 0``: kvpress's ``alpha_safeguard``, default 0.2), the rest the top of every head's
remaining scores together (:func:`~testbed.policies.scorers.keep_adaptive`; ties to the older token,
then the lower head). kvpress does not normalise the scores across heads: ``AdaKVPress`` ranks the
wrapped press's raw scores over the layer's heads, which for attention scorers (snapkv's window
attention, averaged over the window's queries and the KV head's query heads) are probabilities
whose rows each sum to one, so heads compare on one scale; a static score (knorm's negative key
norm) is compared as it is. This does the same, with the scorer's own scores. The tokens a scorer
always keeps (its :attr:`~testbed.policies.scorers.Scorer.KEPT_FIRST`: snapkv's window, tova's
newest, expected_attention's sink) kvpress scores at the tensor's largest plus one, above every
head's tokens; here they and the policy's ``window`` rank above every score, as there (testbed's
scorers give them the head's largest plus one, which for snapkv and tova is above every head's
too, probabilities being at most one). Heads then hold different counts: the layer stores them in a
dense ``[B, H, N]`` layout, N the largest count, each head's kept tokens first in arrival order and
the slots after its count empty (zero K and V, index -1, score 0), and every attention call after
the prefill gets a per-head mask that hides the empty slots (``mask_hook`` with a ``[B, H, t, N +
t]`` mask; :func:`testbed.policies.hook.policy_attention` spreads it over the query heads). The
bytes count only the held tokens, per (layer, KV head): their sum over heads is the uniform
arm's, so a budget derives the same ``keep``.

The seed's selective rule (``heads="selective"``, prefill mode only): each (layer, KV head) pair is
either sparse, keeping the scorer's top ``keep`` of the prefill as a uniform selection would, or
dense, keeping every token. The class is global over the model's pairs, so the prefill is held
whole until every layer has seen it: the cut waits for :meth:`ScoredLayer.cut_selective`, which
:meth:`testbed.policies.cache.PolicyCache.finish_prefill` calls with each pair's class once it has
ranked every pair (:func:`testbed.policies.selection.allocate`). The layer then stores Ada-KV's
masked layout (each head's held tokens first, the empty slots hidden); its bytes count every held
token's float32 K and V, an int32 index and a float32 score per held token of a sparse pair only
(a dense pair's positions are implied), and one class byte per pair
(:func:`~testbed.policies.policy.selective_bytes`). The prefill's concentration per KV head
(:func:`~testbed.policies.selection.concentration`), which the rule reads, comes from the shared
prefill (:meth:`ScoredLayer.load_prefill`'s ``concentration``) or from the prefill's own attention
call (:meth:`ScoredLayer.observe_prefill`). With ``Policy.dense`` the dense pairs are stored
quantized: from the cut on, every token of the layer's KV heads goes through one uniform storage
layer of :meth:`~testbed.policies.policy.Policy.dense_policy` (no sink, the float32 window
``dense_window``), a dense pair attends its tokens decoded from it, and the layer counts the
storage's bytes times the dense pairs' share (a storage's bytes are the same for every head) in
place of their float32 K and V (:func:`~testbed.policies.policy.dense_pair_bytes`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from .causal import accumulated_attention
from .policy import HEADER_BYTES, SCORED_TOKEN_EXTRA, SELECT_CLASS_BYTES, Policy, safeguard_count
from .scorers import Scorer, keep_adaptive, keep_blocks, keep_top
from .selection import concentration

__all__ = ["ScoredLayer", "held_first"]


def held_first(held: torch.Tensor, slots: int) -> torch.Tensor:
    """Indices along the last axis of ``held`` (bool, ``[..., N]``) that put each row's held slots
    first, in their order (a stable sort of "not held"), the first ``slots`` of them."""
    return torch.sort((~held).to(torch.int8), dim=-1, stable=True).indices[..., :slots]


class ScoredLayer(DynamicLayer):
    """One layer's cache under a scored ``policy`` with ``scorer``; ``record=True`` keeps a float32
    copy of every K/V appended for batch row 0 (the audit re-derives the kept set from it)."""

    is_croppable = False

    def __init__(self, policy: Policy, scorer: Scorer, record: bool = False, layer_idx: int | None = None,
                 mask_hook=None, select_hook=None, storage=None):
        super().__init__()
        # storage(policy): the uniform storage layer (testbed.policies.layers.PolicyLayer, handed in: cache
        # imports this module) that stores a kept set (policy.store) or the rest (policy.rest)
        if (policy.store is not None or policy.rest is not None or policy.dense is not None) and storage is None:
            raise ValueError(f"policy {policy.name}: a stored kept set, rest or dense class needs its storage layer class")
        self.storage = storage
        # select_hook(layer): the attention call that follows reports its queries (observe_prefill) to a
        # scorer of attention, which decides then
        self.select_hook = select_hook
        self._waiting = None  # (keys, values, index, previous scores) until the attention call reports
        self._loading = False
        self.recorded_q = None
        # mask_hook(layer, visible [t, held + t] bool): hands attention the mask of a chunk that follows
        # an eviction (testbed.policies.hook's policy_attention applies it)
        self.mask_hook = mask_hook
        if not policy.scored:
            raise ValueError(f"policy {policy.name} has no scorer")
        if layer_idx is None:
            raise ValueError("a scored layer needs its layer index (scorers may depend on it)")
        self.policy, self.scorer, self.record, self.layer_idx = policy, scorer, record, layer_idx
        # an adaptive layer's (first, last) prefill tokens ranked above every score: the scorer's KEPT_FIRST (a
        # user's class too) and the window; refused here, before any token, when keep cannot hold them
        self.always = policy.always_kept(getattr(scorer, "KEPT_FIRST", (0, 0))) if policy.adaptive else (0, 0)
        self.recorded_k: list[torch.Tensor] = []
        self.recorded_v: list[torch.Tensor] = []
        self.seen = 0
        self.kept_k = self.kept_v = self.kept_index = self.kept_score = None
        # a stored kept set (policy.store): after the prefill's cut, the kept K/V live in this uniform
        # storage layer (codes, a float32 window), fed the kept tokens as its own sequence, then each later one
        self.stored = None
        # a quantized rest (policy.rest, MiKV): the prefill tokens the cut does not keep, in arrival order,
        # stored by this uniform storage layer (no window) instead of dropped; read before the kept ones
        self.rest = None
        # [B, H, N] bool: which slots hold a kept token (an adaptive selection's heads hold different
        # counts); None while every slot does
        self.kept_valid = None
        # the selective rule: the prefill's concentration per (sequence, KV head) [B, H] float64 (None until
        # measured), the prefill held whole until the class is known (keys, values, index, scores, rank), and
        # each pair's class [B, H] bool (True: sparse) after cut_selective
        self.sel_score = None
        self.uncut = None
        self.sparse = None
        self.class_score = None
        self.input_q = None  # a recording selective layer's prefill queries (batch row 0), when the rule read them
        # a selective selection's stored dense class (policy.dense): every token of every KV head fed to this
        # uniform storage from the cut on; a dense pair attends its own tokens decoded from it, and only the dense
        # pairs' share of its bytes is counted (a storage's bytes are the same for every head)
        self.dense_store = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        empty = key_states[..., :0, :].to(torch.float32)
        self.kept_k = self.kept_v = self.keys = self.values = empty
        self.kept_index = torch.zeros(empty.shape[:3], dtype=torch.int64, device=empty.device)
        self.kept_score = torch.zeros(empty.shape[:3], dtype=torch.float32, device=empty.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._waiting is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the previous update's attention call never reported its "
                               "queries (a scorer of attention decides from them; run the model inside "
                               "testbed.policies.hook.policy_attention(model))")
        b, h, t, _ = key_states.shape
        k_new, v_new = key_states.to(torch.float32), value_states.to(torch.float32)
        if self.record:
            self.recorded_k.append(k_new[0].detach().clone())
            self.recorded_v.append(v_new[0].detach().clone())
        positions = torch.arange(self.seen, self.seen + t, device=k_new.device)
        attention = getattr(self.scorer, "ATTENTION", False)
        if attention:  # scored when the attention call reports; until then 0
            score = torch.zeros(b, h, t, dtype=torch.float32, device=k_new.device)
        else:
            score = self._checked(self.scorer.score(k_new, positions, self.layer_idx), (b, h, t))
        held = self.held_tokens()
        if (t > 1 and held < self.seen) or self.kept_valid is not None:
            # tokens were dropped: the causal mask by position would be wrong; heads of unequal counts: every
            # call hides each head's empty slots
            if self.mask_hook is None:
                raise RuntimeError(f"layer {self.layer_idx}: a chunk after an eviction needs its mask; run the model "
                                   "inside testbed.policies.hook.policy_attention(model)")
            visible = torch.ones(t, held + t, dtype=torch.bool)
            visible[:, held:] = torch.tril(torch.ones(t, t, dtype=torch.bool))
            if self.kept_valid is not None:  # [B, H, t, held + t]
                visible = visible.to(self.kept_valid.device).expand(b, h, t, held + t).clone()
                visible[..., :held] &= self.kept_valid[:, :, None, :]
            self.mask_hook(self, visible)
        if self.uncut is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the selective rule's prefill waits for its classes "
                               "(PolicyCache.finish_prefill) before any later token")
        if (self.policy.selective and self.seen == 0 and self.sel_score is None and not self._loading
                and self.policy.observes):  # the prefill's attention call measures its concentration
            if self.select_hook is None:
                raise RuntimeError(f"layer {self.layer_idx}: the selective rule measures the prefill's attention; run "
                                   "the model inside testbed.policies.hook.policy_attention(model)")
            self.select_hook(self)
        if self.stored is not None:  # the held tokens decoded from the storage, then the new ones (stored too)
            keys, values = self.stored.update(k_new, v_new)
            if self.rest is not None:  # the rest first
                rk, rv = self._rest_kv()
                keys, values = torch.cat([rk, keys], dim=-2), torch.cat([rv, values], dim=-2)
        elif self.rest is not None:  # the rest decoded from its storage, the kept tokens, the new ones
            rk, rv = self._rest_kv()
            keys = torch.cat([rk, self.kept_k, k_new], dim=-2)
            values = torch.cat([rv, self.kept_v, v_new], dim=-2)
        else:
            keys = torch.cat([self.kept_k, k_new], dim=-2)
            values = torch.cat([self.kept_v, v_new], dim=-2)
        out = keys.to(key_states.dtype), values.to(value_states.dtype)  # what this call's queries attend
        if self.dense_store is not None:  # a stored dense pair attends its tokens decoded from the storage
            dk, dv = self.dense_store.update(k_new, v_new)
            if dk.shape != keys.shape:
                raise RuntimeError(f"layer {self.layer_idx}: the dense storage holds {list(dk.shape)}, the layout "
                                   f"{list(keys.shape)}")
            on = ~self.sparse[:, :, None, None]
            out = (torch.where(on, dk, keys).to(key_states.dtype), torch.where(on, dv, values).to(value_states.dtype))
        index = torch.cat([self.kept_index, positions.expand(b, h, t)], dim=-1)
        scores = torch.cat([self.kept_score, score], dim=-1)
        first = self.seen == 0
        self.seen += t
        if not (first or self.policy.scorer_mode == "online"):  # after a prefill-only decision: keep all
            if self.stored is not None:  # the storage holds the K/V already
                self.kept_index, self.kept_score = index, scores
                return out
            if self.rest is not None:  # keys and values hold the rest too: the kept ones are the held and new ones
                keys, values = torch.cat([self.kept_k, k_new], dim=-2), torch.cat([self.kept_v, v_new], dim=-2)
            self.kept_k, self.kept_v, self.kept_index, self.kept_score = keys, values, index, scores
            if self.kept_valid is not None:
                self.kept_valid = torch.cat([self.kept_valid, self.kept_valid.new_ones(b, h, t)], dim=-1)
        elif attention:
            self._waiting = (keys, values, index, scores)
            if not self._loading:
                if self.select_hook is None or (t > 1 and held < self.seen - t):
                    raise RuntimeError(f"layer {self.layer_idx}: a scorer of attention needs the attention call's "
                                       "queries; run the model inside testbed.policies.hook.policy_attention(model)")
                self.select_hook(self)
        else:
            self._keep(keys, values, index, scores)
        return out

    def _checked(self, score: torch.Tensor, shape: tuple) -> torch.Tensor:
        if tuple(score.shape) != tuple(shape) or score.dtype != torch.float32 or not torch.isfinite(score).all():
            raise ValueError(f"layer {self.layer_idx}: scorer {self.policy.scorer} returned {score.dtype} "
                             f"{list(score.shape)}; a finite float32 {list(shape)} score per token was expected")
        return score

    def _keep(self, keys, values, index, scores) -> None:
        w = self.policy.window  # the newest w tokens seen are kept whatever their score
        rank = scores if not w else torch.where(index >= self.seen - w, torch.full_like(scores, float("inf")), scores)
        if self.policy.adaptive:
            self._keep_adaptive(keys, values, index, scores, rank)
            return
        if self.policy.selective:  # held whole until every layer's pairs are classed (cut_selective)
            self.uncut = (keys, values, index, scores, rank)
            self.kept_k, self.kept_v, self.kept_index, self.kept_score = keys, values, index, scores
            return
        if self.policy.block:  # the top keep / B blocks of B consecutive prefill tokens by summed score
            keep = keep_blocks(rank, self.policy.keep, self.policy.block)
        else:
            keep = keep_top(rank, self.policy.keep_of(self.layer_idx))  # a per-layer schedule's count of this layer
        at = keep[..., None].expand(-1, -1, -1, keys.shape[-1])
        self.kept_k, self.kept_v = torch.gather(keys, 2, at), torch.gather(values, 2, at)
        self.kept_index, self.kept_score = torch.gather(index, 2, keep), torch.gather(scores, 2, keep)
        if self.policy.rest is not None:  # the tokens not kept, in arrival order, as the rest storage's sequence
            b, h, n, d = keys.shape
            rest = torch.ones(b, h, n, dtype=torch.bool, device=keys.device)
            rest.scatter_(-1, keep, False)
            left = n - keep.shape[-1]
            self.rest = self.storage(self.policy.rest_policy())
            self.rest.update(keys[rest].view(b, h, left, d), values[rest].view(b, h, left, d))
        if self.policy.store is not None:  # the kept tokens, in arrival order, as the storage's own sequence
            # no layer index: the storage takes no mask of its own (it keeps every token it is given)
            self.stored = self.storage(self.policy.storage_policy())
            self.stored.update(self.kept_k, self.kept_v)
            self.kept_k = self.kept_v = None

    def _keep_adaptive(self, keys, values, index, scores, rank) -> None:
        """Ada-KV at the prefill (the module's docstring): the layer's ``keep x H`` tokens per sequence,
        stored per head in arrival order, the empty slots after each head's count zeroed and masked."""
        first, last = self.always
        n = rank.shape[-1]
        if first or last:  # kvpress scores them above every token of the layer
            pos = torch.arange(n, device=rank.device)
            rank = torch.where((pos < first) | (pos >= n - last), torch.full_like(rank, float("inf")), rank)
        keep = self.policy.keep_of(self.layer_idx)
        self._store_masked(keys, values, index, scores, keep_adaptive(rank, keep, safeguard_count(keep, self.policy.alpha)))

    def cut_selective(self, sparse: torch.Tensor, score: torch.Tensor) -> None:
        """The selective rule's cut of the held prefill: ``sparse [B, H]`` bool, True where the pair keeps
        the scorer's top ``keep`` (ties to the older token, as a uniform selection), else every token;
        ``score [B, H]`` float64, what the class was read from (kept as evidence)."""
        if self.uncut is None:
            raise RuntimeError(f"layer {self.layer_idx}: no prefill waits for its classes")
        keys, values, index, scores, rank = self.uncut
        b, h, n = rank.shape
        if tuple(sparse.shape) != (b, h) or sparse.dtype != torch.bool:
            raise ValueError(f"layer {self.layer_idx}: classes {sparse.dtype} {list(sparse.shape)}, expected bool [{b}, {h}]")
        self.uncut = None
        self.class_score = score.to(torch.float64)
        top = torch.zeros(b, h, n, dtype=torch.bool, device=rank.device)
        top.scatter_(-1, keep_top(rank, self.policy.keep), True)
        sparse = sparse.to(rank.device)
        self.sparse = sparse
        self._store_masked(keys, values, index, scores, torch.where(sparse[..., None], top, torch.ones_like(top)),
                           always_masked=True)
        if self.policy.dense is not None and not bool(sparse.all()):  # the dense pairs' tokens, stored
            self.dense_store = self.storage(self.policy.dense_policy())
            self.dense_store.update(keys, values)

    def _store_masked(self, keys, values, index, scores, kept: torch.Tensor, always_masked: bool = False) -> None:
        """Each head's ``kept [B, H, n]`` tokens in the dense masked layout (the module's docstring)."""
        count = kept.sum(dim=-1)  # [B, H]
        slots = int(count.max())
        at = held_first(kept, slots)  # each head's kept positions first, in arrival order
        valid = torch.arange(slots, device=scores.device) < count[..., None]
        kk = torch.gather(keys, 2, at[..., None].expand(-1, -1, -1, keys.shape[-1]))
        vv = torch.gather(values, 2, at[..., None].expand(-1, -1, -1, values.shape[-1]))
        self.kept_k = kk * valid[..., None]
        self.kept_v = vv * valid[..., None]
        self.kept_index = torch.where(valid, torch.gather(index, 2, at), torch.full_like(at, -1))
        self.kept_score = torch.where(valid, torch.gather(scores, 2, at), torch.zeros((), dtype=scores.dtype))
        self.kept_valid = None if bool(valid.all()) and not always_masked else valid

    def _rest_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest's K and V decoded from its stored bytes (packed groups, then the float32 remainder)."""
        r = self.rest
        if not r.mid_k.tokens:
            return r.tail_k, r.tail_v
        return torch.cat([r.mid_k.decode(), r.tail_k], dim=-2), torch.cat([r.mid_v.decode(), r.tail_v], dim=-2)

    def head_counts(self) -> torch.Tensor:
        """``[B, H]`` int64: the tokens each (sequence, KV head) holds."""
        if self.kept_valid is None:
            return torch.full(self.kept_index.shape[:2], self.kept_index.shape[-1], dtype=torch.int64)
        return self.kept_valid.sum(dim=-1).cpu()

    def observe_prefill(self, query: torch.Tensor, key: torch.Tensor, scale: float,
                        received: torch.Tensor | None = None) -> None:
        """The attention call's queries ``[B, H_q, t, D]`` (the last t of the keys it attended; or the
        scorer's last ``QUERIES`` of them) and keys ``[B, H_kv, n, D]``: a scorer of attention scores
        every held token and the newest, and the layer keeps its top ``keep``. ``received``: the
        accumulated attention of the call's queries, when the call was a shared prefill that measured it.
        A selective rule that reads the prefill's attention measures each KV head's concentration here."""
        if self.policy.selective and self.policy.observes and self.sel_score is None and not self._loading:
            self.sel_score = concentration(query, key, scale)
            if self.record:  # every prefill query of batch row 0: the audit re-derives the concentration
                self.input_q = query[0].detach().float().clone()
            if self._waiting is None:  # a static scorer decided in update; the class waits for finish_prefill
                return
        if self._waiting is None:
            raise RuntimeError(f"layer {self.layer_idx}: no update waits for its attention call")
        keys, values, index, previous = self._waiting
        self._waiting = None
        n = keys.shape[-2]
        if key.shape[-2] != n:
            raise RuntimeError(f"layer {self.layer_idx}: attention over {key.shape[-2]} keys, {n} held and new")
        want = self.scorer.QUERIES
        if want and query.shape[2] < want and query.shape[2] < n:
            raise ValueError(f"layer {self.layer_idx}: scorer {self.policy.scorer} reads the last {want} queries, "
                             f"got {query.shape[2]}")
        q = query if not want else query[:, :, -want:]
        reads_received = not want and getattr(self.scorer, "RECEIVED", True)
        if received is None and reads_received:
            received = accumulated_attention(query, key, scale)
        if self.record and self.recorded_q is None:  # the prefill decision's queries, for the audit
            self.recorded_q = q[0].detach().float().clone()
        extra = {"values": values.float()} if getattr(self.scorer, "VALUES", False) else {}
        score = self.scorer.attention_score(q.float(), key.float(), scale, previous,
                                            received if reads_received else None, **extra)
        self._keep(keys, values, index, self._checked(score, tuple(previous.shape)))

    def load_prefill(self, key_states: torch.Tensor, value_states: torch.Tensor, query: torch.Tensor | None = None,
                     scale: float | None = None, received: torch.Tensor | None = None,
                     concentration: torch.Tensor | None = None, query0: torch.Tensor | None = None) -> None:
        """A shared float32 prefill's post-RoPE K/V, taken as the model's own prefill would be; a
        scorer of attention also needs the prefill's last queries (``query``, at least the scorer's
        ``QUERIES``; all of them when it reads ``received``, which the shared prefill may hand instead)
        and the attention ``scale``; a selective rule that reads attention, the prefill's
        ``concentration [B, H_kv]`` (:func:`~testbed.policies.selection.concentration`) and, when the layer
        records, every prefill query of batch row 0 (``query0``) it was measured from."""
        if self.seen:
            raise RuntimeError(f"layer {self.layer_idx}: load_prefill needs an empty layer ({self.seen} tokens held)")
        if self.policy.selective and self.policy.observes:
            if concentration is None or tuple(concentration.shape) != tuple(key_states.shape[:2]):
                raise ValueError(f"layer {self.layer_idx}: policy {self.policy.name} classes its pairs by the prefill's "
                                 f"attention; load_prefill needs its concentration [B, H_kv] = {list(key_states.shape[:2])}")
            self.sel_score = concentration.to(torch.float64)
            if self.record:
                if query0 is None:
                    raise ValueError(f"layer {self.layer_idx} records evidence; load_prefill needs the prefill's queries "
                                     "the concentration was measured from (query0)")
                self.input_q = query0
        self._loading = True
        try:
            self.update(key_states, value_states)
        finally:
            self._loading = False
        if self._waiting is not None:
            reads_received = not self.scorer.QUERIES and getattr(self.scorer, "RECEIVED", True)
            if query is None or scale is None or (reads_received and received is None):
                self._waiting = None
                raise ValueError(f"layer {self.layer_idx}: scorer {self.policy.scorer} decides from the prefill's "
                                 "attention; load_prefill needs its last queries, the scale"
                                 + (" and the accumulated attention" if reads_received else ""))
            self.observe_prefill(query, self._waiting[0].to(query.dtype), scale, received)

    def get_seq_length(self) -> int:
        return self.seen  # positions continue from here, also after an eviction

    def held_tokens(self) -> int:
        rest = self.rest.held_tokens() if self.rest is not None else 0
        if self.stored is not None:
            return self.stored.held_tokens() + rest
        return 0 if not self.is_initialized else self.kept_k.shape[-2] + rest

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held_tokens() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("ScoredLayer cannot be reset; make a new cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ScoredLayer cannot be cropped")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("ScoredLayer does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("ScoredLayer does not support batch expansion")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("ScoredLayer does not support batch selection")

    def batch_bytes(self) -> int:
        """Bytes for the whole batch, header not counted: float32 K and V, int32 indices, float32 scores
        of every held token (an adaptive layer's empty slots are not held); a selective layer's dense
        pairs without index or score, and stored by their storage when ``Policy.dense`` is set."""
        if not self.is_initialized:
            return 0
        if self.uncut is not None:
            raise RuntimeError(f"layer {self.layer_idx}: the selective rule's prefill waits for its classes")
        if self.sparse is not None:  # a sparse pair's K/V, index and score; a dense pair's K/V; a class byte per pair
            per = self.kept_valid.sum(dim=-1)  # [B, H]
            d8 = 2 * self.kept_k.shape[-1] * 4
            dense = int(per[~self.sparse].sum()) * d8
            if self.dense_store is not None:  # the storage's bytes (its header not counted), the dense pairs' share
                total, pairs = self.dense_store.batch_bytes(), self.sparse.numel()
                if total % pairs:
                    raise RuntimeError(f"layer {self.layer_idx}: the dense storage's {total} bytes do not split over "
                                       f"{pairs} (sequence, KV head) pairs")
                dense = total // pairs * int((~self.sparse).sum())
            return (int(per[self.sparse].sum()) * (d8 + SCORED_TOKEN_EXTRA) + dense
                    + self.sparse.numel() * SELECT_CLASS_BYTES)
        if self.stored is not None:  # the storage's arrays (its header not counted), indices as int32, scores
            return (self.stored.batch_bytes() + self.kept_score.numel() * self.kept_score.element_size()
                    + self.kept_index.numel() * 4 + (self.rest.batch_bytes() if self.rest is not None else 0))
        if self.kept_valid is not None:
            return int(self.kept_valid.sum()) * (2 * self.kept_k.shape[-1] * 4 + SCORED_TOKEN_EXTRA)
        if self.policy.block:  # float32 K and V of every held token, an int32 index and a float32 score per block
            b, h, held = self.kept_index.shape
            return (sum(x.numel() * x.element_size() for x in (self.kept_k, self.kept_v))
                    + b * h * -(-held // self.policy.block) * SCORED_TOKEN_EXTRA)
        return (sum(x.numel() * x.element_size() for x in (self.kept_k, self.kept_v, self.kept_score))
                + self.kept_index.numel() * 4 + (self.rest.batch_bytes() if self.rest is not None else 0))

    def stored_bytes(self) -> int:
        """Bytes this layer stores for one sequence (every sequence holds the same count, summed over
        its heads)."""
        if not self.is_initialized:
            return 0
        if self.policy.selective:
            raise RuntimeError(f"layer {self.layer_idx}: a selective layer's bytes differ per sequence (its classes); "
                               "the cache's stored_bytes sums them over the layers")
        if self.kept_valid is not None:  # an adaptive layer: each sequence's heads share keep x H alike
            held = self.kept_valid.sum((1, 2))
            if bool((held != held[0]).any()):
                raise RuntimeError(f"layer {self.layer_idx}: the sequences hold {held.tolist()} tokens: their counts "
                                   "differ")
        total, batch = self.batch_bytes(), self.kept_index.shape[0]
        if total % batch:
            raise RuntimeError(f"layer {self.layer_idx}: {total} bytes over {batch} sequences: their counts differ")
        return total // batch + HEADER_BYTES

    def evidence(self) -> dict[str, torch.Tensor]:
        """Batch row 0's stored arrays (``float.k``, ``float.v``, ``kept.index`` int32, ``kept.score``)
        and, when recording, ``input.k`` / ``input.v``: the float32 K/V of every token appended; the
        queries a prefill decision read (``prefill.q``) and, for a scorer that reads the rotary
        embedding, its ``rope.inv_freq`` (float32). An adaptive selection's also ``kept.count`` (int32
        ``[H]``, the tokens each head holds); its arrays are ``[H, max count]``, each head's held tokens
        first and the slots after its count empty (zero K, V and score, index -1). A selective selection's
        likewise, with ``kept.sparse`` (uint8 ``[H]``, 1 where the pair is sparse) and ``select.score``
        (float64 ``[H]``, the concentration its class was read from; zero for a content-blind rule)."""
        if self.policy.adaptive or self.policy.selective:
            count = self.head_counts()[0]
            slots = int(count.max())
            out = {"float.k": self.kept_k[0, :, :slots], "float.v": self.kept_v[0, :, :slots],
                   "kept.index": self.kept_index[0, :, :slots].to(torch.int32), "kept.score": self.kept_score[0, :, :slots],
                   "kept.count": count.to(torch.int32)}
            if self.kept_valid is not None:  # each head's held slots first: the prefill's, then every later token
                order = held_first(self.kept_valid[0], slots)
                for key in ("float.k", "float.v"):
                    x = getattr(self, "kept_" + key[-1])[0]
                    out[key] = torch.gather(x, 1, order[..., None].expand(-1, -1, x.shape[-1]))
                out["kept.index"] = torch.gather(self.kept_index[0], 1, order).to(torch.int32)
                out["kept.score"] = torch.gather(self.kept_score[0], 1, order)
            if self.policy.selective:
                out["kept.sparse"] = self.sparse[0].to(torch.uint8)
                out["select.score"] = self.class_score[0]
            dense = torch.nonzero(~self.sparse[0]).flatten() if self.dense_store is not None else None
            if dense is not None and dense.numel():  # a stored dense pair's tokens: its dense.* arrays, not float32
                for key in ("float.k", "float.v"):
                    out[key] = out[key].clone()
                    out[key][dense] = 0
                out.update({"dense." + k: v[dense.to(v.device)] for k, v in self.dense_store.evidence().items()})
        elif self.stored is not None:  # the storage's arrays (sink.*, key.*, value.*, float.*), indices, scores
            out = {**self.stored.evidence(), "kept.index": self.kept_index[0].to(torch.int32),
                   "kept.score": self.kept_score[0]}
            if self.rest is not None:
                out.update({"rest." + k: v for k, v in self.rest.evidence().items()})
        else:
            out = {"float.k": self.kept_k[0], "float.v": self.kept_v[0],
                   "kept.index": self.kept_index[0].to(torch.int32), "kept.score": self.kept_score[0]}
            if self.rest is not None:  # the rest's stored arrays (rest.key.codes, rest.float.k, ...)
                out.update({"rest." + k: v for k, v in self.rest.evidence().items()})
        if self.record:
            out["input.k"] = torch.cat(self.recorded_k, dim=-2)
            out["input.v"] = torch.cat(self.recorded_v, dim=-2)
            if self.recorded_q is not None:
                out["prefill.q"] = self.recorded_q  # the last queries the prefill decision read
            if self.input_q is not None:
                out["input.q"] = self.input_q  # every prefill query the selective rule's concentration read
            rope = getattr(self.scorer, "rope", None)
            if getattr(self.scorer, "ROPE", False) and rope is not None:
                out["rope.inv_freq"] = rope.inv_freq  # the angles the decision rotated the queries back with
        return {k: v.detach().contiguous().cpu() for k, v in out.items()}
