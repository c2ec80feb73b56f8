"""What a batch's arms share: one float32 prefill (:func:`shared_prefill`, its K/V and whatever
the policies read of its attention, :class:`SharedPrefill`), what the study's policies need of it
(:func:`scored_needs`, :func:`mass_candidates`, :func:`measures_concentration`), and the float32
passes over whole segments that oracle arms decide from (:func:`oracle_passes`)."""

from __future__ import annotations

import contextlib
import time

import torch

from ..policies import Policy
from ..policies.policy import sink_candidates
from .decode import chunk_schedule, forward
from .spec import policies_of


class SharedPrefill:
    """One float32 prefill of a batch, shared by every arm: the post-RoPE K/V of every layer
    ``[B, H_kv, P, D]`` (what the model's own prefill hands any cache's ``update``), and, when a
    policy chooses its sink from attention, the prefill's sink scores per layer over the first
    ``candidates`` tokens (:func:`testbed.policies.selection.sink_scores`); when a mixed policy
    allocates its bits from the prefill's attention, each layer's head concentration ``[B, H_kv]``
    (:func:`testbed.policies.selection.concentration`); in either case the queries of batch row 0 of
    the ``record_layer`` (the audit's evidence); when a policy keeps heavy hitters, each layer's
    accumulated attention ``[B, H_kv, P]`` (:func:`testbed.policies.causal.accumulated_attention`); when
    a scored selection reads the prefill's attention (:mod:`testbed.policies.scorers`), each layer's
    last ``query_tail`` queries ``[B, H_q, w, D]`` and attention scale; when asked (the retrieval
    study's question inside the prefill), the logits of the prefill's last position ``last`` [B, V]."""

    def __init__(self, keys, values, scores=None, query0=None, record_layer=None, seconds=0.0, concentration=None,
                 received=None, tails=None, scales=None, rope=None, last=None):
        self.keys, self.values, self.scores = keys, values, scores
        self.query0, self.record_layer = query0, record_layer
        self.seconds = seconds
        self.concentration = concentration
        self.received = received
        self.tails, self.scales = tails, scales
        self.rope = rope  # per layer the rotary (cos, sin) of the prefill, when an arm stores pre-RoPE keys
        self.last = last

    def _map(self, f) -> "SharedPrefill":
        return SharedPrefill([f(k) for k in self.keys], [f(v) for v in self.values],
                             None if self.scores is None else [None if s is None else f(s) for s in self.scores],
                             None if self.query0 is None else f(self.query0), self.record_layer, self.seconds,
                             None if self.concentration is None else [f(c) for c in self.concentration],
                             None if self.received is None else [f(r) for r in self.received],
                             None if self.tails is None else [f(q) for q in self.tails], self.scales,
                             None if self.rope is None else [r if r is None else (f(r[0]), f(r[1])) for r in self.rope],
                             None if self.last is None else f(self.last))

    def as_numpy(self) -> "SharedPrefill":
        """The same prefill with numpy arrays (handed between Ray tasks); :meth:`as_torch` undoes it."""
        return self._map(lambda t: t.numpy())

    def as_torch(self) -> "SharedPrefill":
        return self._map(lambda a: torch.from_numpy(a.copy()))

    def load_into(self, cache) -> None:
        """Give ``cache`` (any transformers cache, or a PolicyCache) the prefill through its own
        layers, as the model's prefill forward would (``update`` per layer; a policy layer whose
        sink is chosen from attention, or whose bits are, takes the recorded scores instead of an
        attention call); then a PolicyCache finishes its prefill (``finish_prefill``: a mixed policy
        allocates its bits, a selective one classes its pairs, over the whole model) before any later token."""
        from ..policies.layers import PolicyLayer
        from ..policies.scored import ScoredLayer

        with torch.no_grad():
            for i, (k, v) in enumerate(zip(self.keys, self.values)):
                layer = cache.layers[i] if hasattr(cache, "layers") and i < len(cache.layers) else None
                if isinstance(layer, ScoredLayer):
                    if getattr(layer.scorer, "ATTENTION", False) and self.tails is None:
                        raise ValueError(f"policy {layer.policy.name} scores tokens by the prefill's attention, but "
                                         "the shared prefill recorded no queries")
                    classes = layer.policy.selective and layer.policy.observes
                    if classes and self.concentration is None:
                        raise ValueError(f"policy {layer.policy.name} classes its pairs by the prefill's attention, "
                                         "but the shared prefill measured no concentration")
                    if classes and layer.record and i != self.record_layer:
                        raise ValueError(f"layer {i} records evidence; the shared prefill recorded the queries of "
                                         f"layer {self.record_layer}")
                    layer.load_prefill(k, v, None if self.tails is None else self.tails[i],
                                       None if self.scales is None else self.scales[i],
                                       None if self.received is None else self.received[i],
                                       self.concentration[i] if classes else None,
                                       self.query0 if classes and layer.record else None)
                elif isinstance(layer, PolicyLayer):
                    mass = layer.policy.sink_select == "mass"
                    measured = layer.policy.mixed and layer.policy.observes
                    if mass and self.scores is None:
                        raise ValueError(f"policy {layer.policy.name} chooses its sink from the prefill's attention, "
                                         "but the shared prefill recorded no scores")
                    if measured and self.concentration is None:
                        raise ValueError(f"policy {layer.policy.name} allocates its bits from the prefill's attention, "
                                         "but the shared prefill measured no concentration")
                    if (mass or measured) and layer.record and i != self.record_layer:
                        raise ValueError(f"layer {i} records evidence; the shared prefill recorded the queries of "
                                         f"layer {self.record_layer}")
                    if layer.policy.heavy and self.received is None:
                        raise ValueError(f"policy {layer.policy.name} keeps heavy hitters from the attention keys "
                                         "receive, but the shared prefill measured none")
                    layer.load_prefill(k, v, self.scores[i] if mass else None,
                                       self.query0 if (mass or measured) and layer.record else None,
                                       self.concentration[i] if measured else None,
                                       self.received[i] if layer.policy.heavy else None,
                                       self.rope[i] if layer.pre_rope and self.rope is not None else None)
                else:
                    cache.update(k, v, i)
            if hasattr(cache, "finish_prefill"):
                cache.finish_prefill()


def shared_prefill(model, kw, ids: torch.Tensor, candidates: int | None = None,
                   record_layer: int | None = None, concentration: bool = False,
                   heavy: bool = False, query_tail: int = 0, rope: bool = False,
                   last: bool = False) -> tuple[SharedPrefill, object]:
    """Run the prefill ``ids [B, P]`` once through a float32 ``DynamicCache`` with logits of the
    last position only; returns the :class:`SharedPrefill` and the DynamicCache (the reference
    continues from it). With ``candidates``, the attention function also computes every layer's
    sink scores over the first ``candidates`` tokens, from the prefill's own queries and keys;
    with ``concentration``, every layer's head concentration likewise; with ``heavy``, every layer's
    accumulated attention per key; with ``query_tail``, every layer's last ``query_tail`` queries and
    its attention scale; with ``rope``, every layer's rotary ``(cos, sin)`` (for pre-RoPE keys); with
    ``last``, the logits of the last position (float32 ``[B, V]``)."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..policies.causal import accumulated_attention
    from ..policies.hook import capture_rope
    from ..policies.selection import concentration as head_concentration
    from ..policies.selection import sink_scores

    n_layers = int(model.config.num_hidden_layers)
    scores: list = [None] * n_layers
    conc: list = [None] * n_layers
    received: list = [None] * n_layers
    keys: list = [None] * n_layers
    values: list = [None] * n_layers
    query0: list = [None]
    tails: list = [None] * n_layers
    scales: list = [None] * n_layers

    def observe(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
        i = module.layer_idx
        # the prefill's own K/V as the layer's cache returned them: all of them, also where the
        # cache keeps only a sliding window afterwards
        keys[i], values[i] = key, value
        scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
        if candidates is not None:
            scores[i] = sink_scores(query, key, scale, candidates)
        if concentration:
            conc[i] = head_concentration(query, key, scale)
        if heavy:
            received[i] = accumulated_attention(query, key, scale)
        if query_tail:
            tails[i], scales[i] = query[:, :, -query_tail:].detach().float().clone(), scale
        if (candidates is not None or concentration) and i == record_layer:
            query0[0] = query[0].detach().float().clone()
        return out

    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    previous = model.config._attn_implementation
    if previous != "sdpa":
        raise ValueError(f"the shared prefill records K/V from SDPA's attention calls; the model runs {previous!r}")
    with torch.no_grad():
        AttentionInterface.register("testbed_prefill", observe)
        AttentionMaskInterface.register("testbed_prefill", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        model.set_attn_implementation("testbed_prefill")
        try:
            with capture_rope(model) if rope else contextlib.nullcontext({}) as got:
                logits = forward(model, ids, cache, kw, last_only=True)
        finally:
            model.set_attn_implementation(previous)
    if any(k is None or k.shape[-2] != ids.shape[1] for k in keys):
        raise RuntimeError("the shared prefill did not see every layer's K/V of the whole prefill")
    shared = SharedPrefill(keys, values, None if candidates is None else scores, query0[0], record_layer,
                           time.perf_counter() - t0, conc if concentration else None, received if heavy else None,
                           tails if query_tail else None, scales if query_tail else None,
                           [got.get(i) for i in range(n_layers)] if rope else None,
                           logits[:, -1].float().clone() if last else None)
    return shared, cache


def oracle_schedule(pol: Policy, p: dict) -> tuple[int, ...]:
    """Tokens per forward of an oracle arm's float32 pass over the segment: the prefill, then the
    arm's own decode chunks (:func:`~testbed.live.decode.chunk_schedule`). Oracle arms of one
    schedule share one pass."""
    return (p["prefill"],) + tuple(chunk_schedule(pol, p["prefill"], p["steps"], p["mode"], p["reference_chunk"]))


class OraclePasses:
    """The float32 passes over a batch's whole segments that its oracle arms decide from, one per
    distinct forward schedule (:func:`oracle_schedule`), run once by the batch's reference unit
    (:func:`oracle_passes`) and handed to every oracle arm with the shared prefill. Per schedule:
    ``scores`` ``[B, L, H_kv]`` float64 (:meth:`Observed.scores`, when a mixed oracle arm reads
    it), ``received`` per layer ``[B, H_kv, n]`` float64 (:meth:`Observed.accumulated`, when a
    heavy-hitter oracle does), the record layer's queries ``q`` (per forward) and keys ``k`` of
    batch row 0, ``seconds`` and the ``arms`` it serves."""

    def __init__(self, passes: dict):
        self.passes = passes

    def _map(self, f) -> "OraclePasses":
        def one(x):
            return None if x is None else [f(t) for t in x] if isinstance(x, list) else f(x)

        return OraclePasses({s: {**e, **{k: one(e[k]) for k in ("scores", "received", "q", "k")}}
                             for s, e in self.passes.items()})

    def as_numpy(self) -> "OraclePasses":
        """The same passes with numpy arrays (handed between Ray tasks); :meth:`as_torch` undoes it."""
        return self._map(lambda t: t.numpy())

    def as_torch(self) -> "OraclePasses":
        return self._map(lambda a: torch.from_numpy(a.copy()))

    def of(self, pol: Policy, p: dict) -> dict:
        """The pass ``pol`` reads (its schedule's), tensors copied so no arm can change another's."""
        got = self.passes.get(oracle_schedule(pol, p))
        if got is None or got["arms"].count(pol.name) != 1:
            raise RuntimeError(f"oracle arm {pol.name}: the batch's reference ran no oracle pass for it (passes for "
                               f"{[e['arms'] for e in self.passes.values()]})")
        return OraclePasses({0: got})._map(lambda t: t.clone()).passes[0]


def oracle_passes(model, kw, ids: torch.Tensor, p: dict, record_layer: int | None) -> OraclePasses | None:
    """The float32 pass over the whole segments ``ids [B, P + steps + 1]`` that the study's oracle
    arms decide from, once per distinct schedule of theirs (in the arms' own forward calls, through
    a ``DynamicCache`` inside :func:`testbed.policies.hook.policy_attention`, as each arm ran its
    own before): the concentration when a mixed oracle arm reads it, the accumulated attention when
    a heavy-hitter oracle does (separate sums over the same attention calls), ``record_layer``'s
    queries and keys. None when the study has no oracle arm."""
    from transformers import DynamicCache

    from ..policies.hook import policy_attention
    from ..policies.selection import observe_concentration

    groups: dict = {}
    for pol in policies_of(p):
        if pol.oracle:
            groups.setdefault(oracle_schedule(pol, p), []).append(pol)
    if not groups:
        return None
    n_layers = int(model.config.num_hidden_layers)
    passes = {}
    with policy_attention(model):
        for schedule, pols in groups.items():
            conc = any(not pol.heavy_oracle for pol in pols)
            heavy = any(pol.heavy_oracle for pol in pols)
            t0 = time.perf_counter()
            with torch.no_grad(), observe_concentration(model, record_layer=record_layer, concentration_too=conc,
                                                        received=heavy) as seen:
                pre, pos = DynamicCache(config=model.config), 0
                for c in schedule:
                    forward(model, ids[:, pos:pos + c], pre, kw, last_only=True)
                    pos += c
                del pre
            passes[schedule] = {"scores": seen.scores(n_layers) if conc else None,
                                "received": seen.accumulated(n_layers) if heavy else None,
                                "q": list(seen.q), "k": seen.k, "arms": [pol.name for pol in pols],
                                "seconds": time.perf_counter() - t0}
    return OraclePasses(passes)


def scored_needs(p: dict) -> tuple[int, bool]:
    """What the study's scored selections read of the shared prefill: the most last queries any of
    them reads (0: none; the whole prefill for one that reads every query), and whether one reads
    every query's accumulated attention (``h2o``-like)."""
    from ..policies import scorers

    tail, received = 0, False
    for pol in policies_of(p):
        if not pol.scored:
            continue
        cls = scorers.SCORERS.get(pol.scorer)
        if cls is None or not cls.ATTENTION:  # a user's scorer reads keys only
            continue
        if cls.QUERIES:
            tail = max(tail, cls.QUERIES)
        elif getattr(cls, "RECEIVED", True):
            tail, received = max(tail, 1), True
        else:  # every query of the prefill (expected_attention's statistics)
            tail = max(tail, 1 << 30)  # a tail longer than any prefill: query[..., -tail:, :] is all of it
    return tail, received


def mass_candidates(p: dict) -> int | None:
    """The prefill tokens a sink chosen from attention is chosen from (one count for the study:
    every policy shares its sink and window), or None when no policy chooses so."""
    if not any(pol.sink_select == "mass" for pol in policies_of(p)):
        return None
    return sink_candidates(p["prefill"], p["sink"], p["window"])  # p: the view of one context


def measures_concentration(p: dict) -> bool:
    """Whether some policy of the study allocates per-head bits, or classes its pairs (the selective
    rule), from the prefill's attention."""
    return any((pol.mixed or pol.selective) and pol.observes for pol in policies_of(p))
