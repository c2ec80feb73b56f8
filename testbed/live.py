"""The live quality study: cache policies inside a real model, judged by the model's predictions.

For each corpus segment the model reads a prefill of P tokens, then T teacher-forced decode
steps (the true next token is fed, one scored prediction per step) through the cache under test.
Per step: the log-probability of the true token, KL(p_float32 || p_policy) against the same model
with transformers' ``DynamicCache`` (the float32 reference), and whether the top-1 token agrees
with the reference's. The cache's stored bytes are measured after every forward call.

Arms of one study: the reference (``dynamic_cache``), every policy of the protocol
(:mod:`testbed.policies`, run through :class:`~testbed.policies.cache.PolicyCache`) and the peers
users know, transformers' ``QuantizedCache`` with the quanto backend at 2 and 4 bits (which
re-quantizes its whole history each time its float residual fills; it runs one token per forward,
on its own schedule).

Modes (protocol key ``mode``): ``"chunked"`` feeds the tokens between two changes of a policy's
stored state (:meth:`~testbed.policies.policy.Policy.next_change`: a flush of a group for a
quantized middle) as one forward call, which is exact — each of those tokens attends the same
stored history plus the float32 tokens before it, as it would one token per forward; an evicting
policy takes any chunk, its cache handing attention a per-token mask that hides from each token
what it would already have evicted; ``"step"`` feeds one token per forward for every arm. The reference is exact in
any chunking and runs in chunks of ``reference_chunk`` tokens.

Units are segments: every per-token array is stored, rows are per (segment, arm), and the report's
intervals are bootstraps over segments, never over tokens.

Corpus: Python's own ``pydoc_data.topics`` (the help topics of the standard library, ~465k
characters of technical English, no download) or text files named in the protocol (paths relative
to the protocol file). Segments are disjoint, evenly spaced over the token stream, and their token
ids are stored and hashed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .policies import PRESETS, Policy
from .policies.compose import check_scored_prefill, policies_from
from .policies.policy import equal_bytes_budget, equal_bytes_versus, heavy_count, sink_candidates
from .schema import Key, ProtocolError, Spec, check_value
from .sources.capture import (INSTALL_HINT, INSTALL_HINTS, MODELS, CaptureUnavailable, _forward_kwargs,
                              _hardware, _software, estimate_dims, load_checked, load_model)

__all__ = ["validate", "plan", "batch_units", "run_unit", "report", "policies_of", "scored_needs", "corpus_text",
           "segment_starts", "chunk_schedule", "quanto_bytes", "REFERENCE", "comparator", "equal_bytes"]

REFERENCE = "dynamic_cache"
PEER = Spec("live peer", "A cache users know, run as one more arm: transformers' QuantizedCache.", {
    "backend": Key(("choice", ("quanto",)), "the QuantizedCache backend (optimum-quanto)"),
    "bits": Key(("choice", (2, 4)), "bits per element"),
})
CORPUS = Spec("live corpus", "The text the segments are cut from.", {
    "builtin": Key((str, type(None)), "a built-in corpus: \"pydoc_topics\" (Python's pydoc_data.topics); null with "
                                      "files", "pydoc_topics"),
    "files": Key((list, type(None)), "UTF-8 text files instead (non-empty list of paths relative to the protocol "
                                     "file); give builtin null with them", None),
}, rules=("exactly one of builtin and files is given",))
SPEC = Spec("live", "Cache policies inside a causal LM in float32 (SmolLM2-135M-Instruct, Gemma-3-270M or your "
            "own), judged by its teacher-forced predictions against "
            "DynamicCache: per step log-probability, KL, top-1 agreement, stored bytes. Protocol key \"live\" of a "
            "protocol with \"kind\": \"live\".", {
    "model": Key(str, f"the model: a known name ({', '.join(MODELS)}) or a path, relative to the protocol file, "
                      "to a GGUF file (dequantized to float32 once) or a Hugging Face model folder (config.json and "
                      "weights, loaded in float32)"),
    "corpus": Key(dict, "the corpus", see=CORPUS),
    "segments": Key(("range", int, 1, 4096), "disjoint segments, evenly spaced over the token stream"),
    "prefill": Key((int, type(None)), "prefill tokens per segment (1..8190); null with contexts", None),
    "contexts": Key((list, type(None)), "several contexts in one study instead of one prefill: each a segment's "
                                        "tokens, prefill + steps (steps+1..8191), ascending; segments of one "
                                        "context are disjoint, contexts may share text; null with prefill", None),
    "steps": Key(("range", int, 1, 8192), "teacher-forced decode steps per segment (each one scored)"),
    "policies": Key(("list", (str, dict), 1), "cache policies, one arm each: a preset's name (one of "
                    f"{', '.join(PRESETS)}) or a policy declared by its fields, an object {{\"name\", \"selection\", "
                    "\"storage\", \"description\"}} (docs/live.md, testbed.policies.compose)"),
    "batch": Key(("range", int, 1, 256), "segments decoded together", 4),
    "mode": Key(("choice", ("chunked", "step")), "chunked: tokens between two changes of a policy's state in one "
                                                "forward (exact); step: one token per forward", "chunked"),
    "window": Key(("range", int, 0, 8192), "float32 recent window R of the policies (and quanto's residual length)",
                  128),
    "group": Key(("choice", (2, 4, 8, 16, 32, 64, 128, 256)), "quantization group size G of the policies", 32),
    "sink": Key(("range", int, 0, 1024), "float32 sink tokens of the policies that keep a sink", 4),
    "evict_window": Key(("range", int, 1, 8192), "newest tokens kept by the evicting policies", 256),
    "budget_tolerance": Key(("range", float, 0.0, 0.5), "how far below its budget a declared policy's derived kept "
                                                        "count may land at the end of a segment (a fraction)", 0.01),
    "peers": Key(("list", dict, 0), "QuantizedCache arms", [], see=PEER),
    "peer_group": Key(("choice", (32, 64)), "quanto's q_group_size", 64),
    "reference_chunk": Key(("range", int, 1, 8192), "tokens per forward of the reference", 256),
    "evidence_layer": Key((int, type(None)), "layer whose packed cache and float32 inputs of the first batch of each "
                                             "context are stored for the audit to re-encode; null: none (a long "
                                             "context's inputs would outweigh the rest of the evidence)", 0),
    "shared_prefill": Key(bool, "one float32 prefill per batch of segments, its K/V handed to every arm's cache "
                                "(exact: every policy applies to what it stores after the prefill); false: each arm "
                                "runs its own prefill", True),
}, rules=("exactly one of prefill and contexts is given", "prefill + steps + 1 <= 8192 (the model's positions)",
          "evidence_layer is below the model's layer count",
          "every policy can be built with window, group, sink and evict_window"))


def validate(params, where: str) -> dict:
    p = SPEC.check(params, where)
    corpus = CORPUS.check(p["corpus"], f"{where}.corpus")
    if corpus["files"] is not None:
        check_value(corpus["files"], ("list", str, 1), f"{where}.corpus.files")
    if corpus["builtin"] is not None:
        check_value(corpus["builtin"], ("choice", ("pydoc_topics",)), f"{where}.corpus.builtin")
    if corpus["builtin"] is None and not corpus["files"]:
        raise ProtocolError(f"{where}.corpus: name a builtin corpus or at least one text file")
    if corpus["builtin"] is not None and corpus["files"]:
        raise ProtocolError(f"{where}.corpus: give either builtin or files, not both")
    p["corpus"] = corpus
    for i, peer in enumerate(p["peers"]):
        PEER.check(peer, f"{where}.peers[{i}]")
    if (p["prefill"] is None) == (p["contexts"] is None):
        raise ProtocolError(f"{where}: give exactly one of prefill (one context) and contexts (several)")
    if p["prefill"] is not None:
        check_value(p["prefill"], ("range", int, 1, 8190), f"{where}.prefill")
    else:
        check_value(p["contexts"], ("list", ("range", int, p["steps"] + 1, 8191), 1), f"{where}.contexts")
        if p["contexts"] != sorted(p["contexts"]):
            raise ProtocolError(f"{where}.contexts: list the contexts in ascending order, got {p['contexts']}")
    for _, prefill in context_views(p):
        if prefill + p["steps"] + 1 > 8192:
            raise ProtocolError(f"{where}.steps: prefill + steps + 1 = {prefill + p['steps'] + 1} exceeds the model's "
                                "8,192 positions")
    try:
        for _, prefill in context_views(p):  # a budget's kept count is derived per context
            check_scored_prefill(policies_of({**p, "prefill": prefill}, where=f"{where}.policies"), prefill,
                                 f"{where}.policies")
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    if p["model"] in MODELS:  # a model given by path is checked the same way once loaded (plan)
        check_model(p, MODELS[p["model"]], where)
    return p


def check_model(p: dict, dims: dict, where: str) -> None:
    """What the model's layers allow: the evidence layer is a full-attention layer (a sliding layer
    keeps what DynamicCache keeps, not the policy); no quanto peer on a model with sliding layers
    (transformers' QuantizedCache refuses them)."""
    layers, full = dims["layers"], dims["full_layers"]
    ev = p["evidence_layer"]
    if ev is not None and not 0 <= ev < layers:
        raise ProtocolError(f"{where}.evidence_layer: {p['model']} has layers 0..{layers - 1}, not {ev}")
    if ev is not None and ev not in full:
        raise ProtocolError(f"{where}.evidence_layer: layer {ev} of {p['model']} is a sliding-window layer, which keeps "
                            f"what DynamicCache keeps; the policy runs on its full-attention layers {full}")
    pols = policies_of(p)
    mixed = [q.name for q in pols if q.mixed]
    if dims.get("sliding_window") and mixed:
        raise ProtocolError(f"{where}.policies: per-head precision ({', '.join(mixed)}) allocates bits over every "
                            f"layer's KV heads, and {p['model']} has sliding-window layers (window "
                            f"{dims['sliding_window']}), which keep what DynamicCache keeps; drop those policies")
    oracles = [q.name for q in pols if q.heavy_oracle]
    if dims.get("sliding_window") and oracles:
        raise ProtocolError(f"{where}.policies: {', '.join(oracles)} ranks tokens by the whole segment's attention, "
                            f"measured by a float32 pass over every layer, and {p['model']} has sliding-window layers "
                            f"(window {dims['sliding_window']}), whose keys do not add up over a segment; drop those "
                            "policies")
    fit = heavy_count(p["window"], p["group"], head_dim=dims["head_dim"])
    over = [q for q in pols if q.heavy > fit]
    if over:
        raise ProtocolError(f"{where}.policies: {', '.join(q.name for q in over)} hold {max(q.heavy for q in over)} heavy "
                            f"hitters per (layer, KV head), sized for head dim 64; at {p['model']}'s head dim "
                            f"{dims['head_dim']} only {fit} fit in int2's bytes (R={p['window']}, G={p['group']}): "
                            "the arms would not be at equal bytes; drop those policies")
    if dims.get("sliding_window") and p["peers"]:
        raise ProtocolError(f"{where}.peers: transformers' QuantizedCache refuses models with sliding-window layers, "
                            f"and {p['model']} has them (window {dims['sliding_window']}); drop the peers")


def context_views(p: dict) -> list[tuple[str, int]]:
    """(case prefix, prefill) of each context of a study: ``("", prefill)`` for one prefill;
    ``("c{n}", n - steps)`` for each of ``contexts``."""
    if p.get("contexts"):
        return [(f"c{n}", n - p["steps"]) for n in p["contexts"]]
    return [("", p["prefill"])]


def case_id(prefix: str, i: int) -> str:
    return f"{prefix}-seg{i:03d}" if prefix else f"seg{i:03d}"


def policies_of(p: dict, where: str = "policies") -> list[Policy]:
    """The study's policies: presets at the protocol's R, G, W and S, or declared by their fields; a
    declared budget's kept count derived at the end of a segment of this context (``prefill``; with
    several contexts and none given, the longest) for a model of :data:`MODELS` without sliding layers
    (a budget of ``tokens`` needs no model)."""
    budget = None  # a study without a segment length (retrieval's trials) derives no budget
    if "steps" in p and (p.get("prefill") is not None or p.get("contexts")):
        prefill = p["prefill"] if p.get("prefill") is not None else max(pre for _, pre in context_views(p))
        dims = MODELS.get(p.get("model"))
        known = dims is not None and not dims.get("sliding_window")
        budget = {"prefill": prefill, "steps": p["steps"], "layers": dims["layers"] if known else None,
                  "kv_heads": dims["kv_heads"] if known else None, "head_dim": dims["head_dim"] if known else None,
                  "tolerance": p.get("budget_tolerance", 0.01)}
    return policies_from(p["policies"], window=p["window"], group=p["group"], evict_window=p["evict_window"],
                         sink=p["sink"], where=where, budget=budget)


def estimate_bytes(p: dict, base: Path | None = None) -> int:
    """Peak bytes: the float32 model, the reference's log-probabilities of one batch, the logits of
    one chunk (a prefill computes the last position's only), the prefill's activations, the caches
    (the shared prefill's K/V held beside one arm's cache, and the float32 oracle pass over the
    segment, run once per batch by the reference before its decode). A model given by path (relative to
    ``base``, the protocol's folder) is sized from its files before it is loaded
    (:func:`testbed.sources.capture.estimate_dims`)."""
    dims = estimate_dims(p["model"], base)
    vocab, layers, kv, d = dims["vocab"], dims["layers"], dims["kv_heads"], dims["head_dim"]
    b = min(p["batch"], p["segments"])
    prefill = max(pre for _, pre in context_views(p))
    n = prefill + p["steps"] + 1
    ref = b * p["steps"] * vocab * 4 * 2
    logits = b * p["reference_chunk"] * vocab * 4 * 3
    activations = b * prefill * dims.get("intermediate", 4 * 576) * 4 * 4 + (256 << 20)
    cache = 2 * 2 * layers * kv * n * d * 4 * b * (2 if p.get("shared_prefill", True) else 1)
    if any(pol.oracle for pol in policies_of(p)):
        # the oracle pass's DynamicCache beside the shared K/V (passes run one at a time); what the
        # batch's arms then hold of it (received: layers x kv x n float64) is smaller than that cache
        cache += 2 * layers * kv * n * d * 4 * b
    return dims["parameters"] * 4 + ref + logits + activations + cache


# -- the corpus -------------------------------------------------------------------------------------

def corpus_text(corpus: dict, base: Path | None = None) -> tuple[str, dict]:
    """The corpus as one string, and what it is (name, characters, sha256 of the UTF-8 text)."""
    if corpus.get("builtin") == "pydoc_topics":
        from pydoc_data import topics

        text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
        name = f"pydoc_data.topics of Python {sys.version.split()[0]} ({len(topics.topics)} topics in name order)"
    else:
        parts = []
        for f in corpus["files"]:
            path = Path(f)
            if not path.is_absolute() and base is not None:
                path = base / path
            try:
                parts.append(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                raise ProtocolError(f"corpus file {f}: cannot be read as UTF-8 text ({e})") from None
        text = "\n\n".join(parts)
        name = "files: " + ", ".join(corpus["files"])
    return text, {"corpus": name, "characters": len(text),
                  "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def segment_starts(n_tokens: int, segments: int, length: int) -> list[int]:
    """Disjoint windows of ``length`` tokens, evenly spaced over ``n_tokens``."""
    stride = n_tokens // segments
    if stride < length:
        raise ProtocolError(f"the corpus has {n_tokens} tokens: {segments} disjoint segments of {length} tokens "
                            f"need {segments * length}")
    return [i * stride for i in range(segments)]


def chunk_schedule(policy: Policy | None, start: int, steps: int, mode: str, ref_chunk: int) -> list[int]:
    """Tokens per forward for ``steps`` decode tokens after a cache of ``start`` tokens: one each
    in step mode; else up to the policy's next change of stored state (the reference: any), at
    most ``ref_chunk`` (the logits of a chunk are held in float32 and its KL summed in float64)."""
    out, n = [], start
    while n < start + steps:
        # a chunk never exceeds ref_chunk (exact in any chunking below a change point; bounds memory)
        c = 1 if mode == "step" else ref_chunk if policy is None else min(policy.next_change(n, masked=True), ref_chunk)
        c = int(min(c, start + steps - n))
        out.append(c)
        n += c
    return out


# -- peers ------------------------------------------------------------------------------------------

def _tensor_bytes(x) -> int:
    """Bytes of a tensor's storage; quanto's tensor subclasses are walked to their inner tensors."""
    if x is None:
        return 0
    flatten = getattr(type(x), "__tensor_flatten__", None)
    if flatten is not None and type(x) is not torch.Tensor:
        names, _ = x.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(x, n)) for n in names)
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return 0


def quanto_bytes(cache) -> int:
    """Bytes a ``QuantizedCache`` holds for one sequence: its quantized tensors (codes, scales,
    shifts, as quanto stores them) and its float residual, summed over layers."""
    total = 0
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        batch = layer.keys.shape[0] if layer.keys is not None and layer.keys.dim() == 4 else None
        t = (_tensor_bytes(layer._quantized_keys) + _tensor_bytes(layer._quantized_values)
             + _tensor_bytes(layer.keys) + _tensor_bytes(layer.values))
        if batch is None:
            batch = layer._quantized_keys.shape[0]
        total += t // batch
    return total


def _peer_name(peer: dict) -> str:
    return f"quanto_int{peer['bits']}"


# -- running ----------------------------------------------------------------------------------------

def _metrics(logits: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None, piece: int = 32):
    """Per token: log-prob of the target, KL(ref || this) (float64 sums), argmax, and the float32
    log-probabilities; KL is summed ``piece`` positions at a time to bound its float64 temporaries."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    am = logp.argmax(dim=-1)
    kl = torch.zeros(lp.shape, dtype=torch.float64)
    if ref_logp is not None:
        for a in range(0, logp.shape[1], piece):
            r = ref_logp[:, a:a + piece].to(torch.float64)
            kl[:, a:a + piece] = (r.exp() * (r - logp[:, a:a + piece].to(torch.float64))).sum(-1)
    return lp, kl, am, logp


def _forward(model, ids, cache, kw, last_only=False):
    """Logits of every position of ``ids`` (``last_only``: of the last position only, where the
    model takes ``logits_to_keep``: a prefill whose predictions nobody scores)."""
    extra = kw.get("extra", {}) if last_only else {}
    return model(input_ids=ids, use_cache=True, **{kw["cache"]: cache}, **extra).logits


class SharedPrefill:
    """One float32 prefill of a batch, shared by every arm: the post-RoPE K/V of every layer
    ``[B, H_kv, P, D]`` (what the model's own prefill hands any cache's ``update``), and, when a
    policy chooses its sink from attention, the prefill's sink scores per layer over the first
    ``candidates`` tokens (:func:`testbed.policies.cache.sink_scores`); when a mixed policy
    allocates its bits from the prefill's attention, each layer's head concentration ``[B, H_kv]``
    (:func:`testbed.policies.cache.concentration`); in either case the queries of batch row 0 of
    the ``record_layer`` (the audit's evidence); when a policy keeps heavy hitters, each layer's
    accumulated attention ``[B, H_kv, P]`` (:func:`testbed.policies.cache.accumulated_attention`); when
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
        attention call)."""
        from .policies.cache import PolicyLayer
        from .policies.scored import ScoredLayer

        with torch.no_grad():
            for i, (k, v) in enumerate(zip(self.keys, self.values)):
                layer = cache.layers[i] if hasattr(cache, "layers") and i < len(cache.layers) else None
                if isinstance(layer, ScoredLayer):
                    if getattr(layer.scorer, "ATTENTION", False) and self.tails is None:
                        raise ValueError(f"policy {layer.policy.name} scores tokens by the prefill's attention, but "
                                         "the shared prefill recorded no queries")
                    layer.load_prefill(k, v, None if self.tails is None else self.tails[i],
                                       None if self.scales is None else self.scales[i],
                                       None if self.received is None else self.received[i])
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

    from .policies.cache import accumulated_attention, capture_rope
    from .policies.cache import concentration as head_concentration
    from .policies.cache import sink_scores

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
                logits = _forward(model, ids, cache, kw, last_only=True)
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
    arm's own decode chunks (:func:`chunk_schedule`). Oracle arms of one schedule share one pass."""
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
    a ``DynamicCache`` inside :func:`testbed.policies.cache.policy_attention`, as each arm ran its
    own before): the concentration when a mixed oracle arm reads it, the accumulated attention when
    a heavy-hitter oracle does (separate sums over the same attention calls), ``record_layer``'s
    queries and keys. None when the study has no oracle arm."""
    from transformers import DynamicCache

    from .policies.cache import observe_concentration, policy_attention

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
                    _forward(model, ids[:, pos:pos + c], pre, kw, last_only=True)
                    pos += c
                del pre
            passes[schedule] = {"scores": seen.scores(n_layers) if conc else None,
                                "received": seen.accumulated(n_layers) if heavy else None,
                                "q": list(seen.q), "k": seen.k, "arms": [pol.name for pol in pols],
                                "seconds": time.perf_counter() - t0}
    return OraclePasses(passes)


def _run_arm(model, kw, ids, p, cache, schedule, ref_logp, keep_logp=False, bytes_of=None, prefill=None):
    """The prefill (its own forward, or ``prefill``: a :class:`SharedPrefill` loaded into the cache,
    or ``True``: the cache already holds it), then the decode tokens in ``schedule``; returns
    per-token arrays and per-forward bytes."""
    P = p["prefill"]
    lps, kls, ams, logps, nbytes, context = [], [], [], [], [], []
    with torch.no_grad():
        if prefill is None:
            _forward(model, ids[:, :P], cache, kw, last_only=True)
        elif prefill is not True:
            prefill.load_into(cache)
        if hasattr(cache, "finish_prefill"):  # a mixed policy allocates its bits over the whole model now
            cache.finish_prefill()
        nbytes.append(bytes_of(cache))
        context.append(P)
        pos = P
        for c in schedule:
            logits = _forward(model, ids[:, pos:pos + c], cache, kw)
            targets = ids[:, pos + 1:pos + c + 1]
            ref = None if ref_logp is None else ref_logp[:, pos - P:pos - P + c]
            lp, kl, am, logp = _metrics(logits, targets, ref)
            lps.append(lp)
            kls.append(kl)
            ams.append(am)
            if keep_logp:
                logps.append(logp)
            pos += c
            nbytes.append(bytes_of(cache))
            context.append(pos)
    out = {"logprob": torch.cat(lps, 1), "kl": torch.cat(kls, 1), "argmax": torch.cat(ams, 1).to(torch.int32),
           "bytes": np.asarray(nbytes, dtype=np.int64), "context": np.asarray(context, dtype=np.int64)}
    if keep_logp:
        out["logp"] = torch.cat(logps, 1)
    return out


def _summary(lp: np.ndarray, kl: np.ndarray, agree: np.ndarray) -> dict:
    nll = -float(np.mean(lp.astype(np.float64)))
    return {"nll": nll, "perplexity": math.exp(nll), "mean_kl": float(np.mean(kl.astype(np.float64))),
            "top1_agreement": float(np.mean(agree.astype(np.float64)))}


def _scorer_files(p: dict, base: Path | None) -> dict:
    """``{"file.py:Class": {"file": relative path, "sha256": of its bytes}}`` for the study's user scorers."""
    from .policies import scorers

    out = {}
    for pol in policies_of(p):
        if pol.scored and scorers.is_user_scorer(pol.scorer):
            file = pol.scorer.split(":")[0]
            path = Path(file) if base is None else Path(base) / file
            out[pol.scorer] = {"file": file, "sha256": scorers.user_file_sha256(path)}
    return out


def scored_needs(p: dict) -> tuple[int, bool]:
    """What the study's scored selections read of the shared prefill: the most last queries any of
    them reads (0: none; the whole prefill for one that reads every query), and whether one reads
    every query's accumulated attention (``h2o``-like)."""
    from .policies import scorers

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


def _arms(p: dict) -> list[tuple[str, object]]:
    """(name, what) of every arm, the reference first: what is None, a Policy or a peer's dict."""
    return [(REFERENCE, None)] + [(pol.name, pol) for pol in policies_of(p)] + [(_peer_name(x), x) for x in p["peers"]]


def plan(proto: dict, ctx, protocol_path: Path | None = None) -> tuple[dict, list[dict]]:
    """The study's shared part, done once into ``ctx`` (model, corpus, segments and their stored
    token ids, the live manifest): returns the segments as case records and the units, one per
    (batch of segments, arm), the reference of each batch first, every other arm of the batch
    needing it. No units when the model is missing (recorded as an exclusion, as a capture does)."""
    p = proto["live"]
    study = ctx.study
    progress = ctx.progress
    store = ctx.store
    base = Path(protocol_path).resolve().parent if protocol_path is not None else None
    hint = INSTALL_HINTS.get(p["model"], INSTALL_HINT)
    try:
        model, tokenizer, info, dims = load_checked(p["model"], base, progress, f"{study}: live.model")
    except CaptureUnavailable as e:
        entry = {"id": f"{study}/{p['model']}", "stage": e.stage, "error": f"{e}; install with: {hint}"}
        ctx.excluded.append(entry)
        print(f"[{study}] live study skipped: {e}; install with: {hint}", file=sys.stderr, flush=True)
        return {}, []
    check_model(p, dims, f"{study}: live")
    text, corpus_info = corpus_text(p["corpus"], base)
    t0 = time.perf_counter()
    stream = tokenizer(text, return_tensors="pt").input_ids[0]
    arms = _arms(p)
    seg_tokens, cases, seg_starts, views = {}, {}, {}, []
    for prefix, prefill in context_views(p):
        length = prefill + p["steps"] + 1
        starts = segment_starts(int(stream.numel()), p["segments"], length)
        progress(f"[{study}] corpus: {corpus_info['characters']:,} characters, {stream.numel():,} tokens "
                 f"({time.perf_counter() - t0:.1f} s); {len(starts)} segments of {length} tokens")
        seg_ids = [case_id(prefix, i) for i in range(len(starts))]
        views.append((prefill, seg_ids))
        for sid, s in zip(seg_ids, starts):
            tok = stream[s:s + length].to(torch.int64)
            seg_tokens[sid] = tok.tolist()
            seg_starts[sid] = int(s)
            arr = store.save(f"{study}/{sid}/token_ids", tok.to(torch.int32))
            cases[sid] = {
                "id": sid, "causal": True, "layout": [], "tokens_per_frame": None, "head_map": None,
                "meta": {"source": "corpus", "model": p["model"], "start_token": int(s), "tokens": length,
                         "token_ids_sha256": hashlib.sha256(tok.to(torch.int32).numpy().tobytes()).hexdigest()},
                "arrays": {"token_ids": arr}}
    ctx.extra_files[f"{study}/live_manifest.json"] = (json.dumps({
        "schema_version": 1,
        "experiment": f"{study}: cache policies inside {p['model']} (float32), teacher-forced decoding",
        "model": {k: v for k, v in info.items() if k not in ("load_seconds", "loaded_from")},
        "model_dims": dims,
        "corpus": corpus_info, "corpus_tokens": int(stream.numel()),
        "segments": seg_starts,
        "arms": [a for a, _ in arms],
        "scorer_files": _scorer_files(p, base),  # a user's scorer code, by the SHA-256 of its file
        "software": _software(), "hardware": _hardware(),
    }, indent=1) + "\n").encode("utf-8")
    return cases, batch_units(p, views, seg_tokens, base, dims)


def batch_units(p: dict, views: list[tuple[int, list[str]]], seg_tokens: dict[str, list[int]], base: Path | None,
                dims: dict) -> list[dict]:
    """The units of a live study, one per (batch of segments, arm), the reference of each batch
    first: ``views`` is (prefill, segment ids) per context, ``seg_tokens`` each segment's token ids
    (:func:`plan`; :mod:`testbed.replay` rebuilds the same units from a finished run's arrays)."""
    batches = [(prefill, vi, seg_ids[i:i + p["batch"]]) for prefill, seg_ids in views
               for vi, i in enumerate(range(0, len(seg_ids), p["batch"]))]
    units = []
    for bi, (prefill, vi, batch) in enumerate(batches):
        ref = len(units)
        arms = _arms({**p, "prefill": prefill})  # a budget's kept count is the context's
        for j, (arm, what) in enumerate(arms):
            # forward calls of the arm: what a scheduler starts first (quanto's one token per forward)
            forwards = 1 + (p["steps"] if what is not None and not isinstance(what, Policy) else
                            len(chunk_schedule(what, prefill, p["steps"], "chunked" if what is None else p["mode"],
                                               p["reference_chunk"])))
            units.append({"label": f"batch {bi + 1}/{len(batches)} {arm}", "batch": bi, "batches": len(batches),
                          "cost": cost_kind(what), "segments": batch,
                          "tokens": [seg_tokens[sid] for sid in batch], "arm": j, "needs": None if j == 0 else ref,
                          "forwards": forwards, "prefill": prefill, "first_of_context": vi == 0,
                          "model_base": None if base is None else str(base), "model_dims": dims})
    return units


def run_unit(proto: dict, unit: dict, ctx, ref=None) -> tuple[list, tuple | None, str]:
    """One arm on one batch of segments: its rows (arrays into ``ctx.store``), for the reference
    ``(log-probabilities, argmax, shared prefill, oracle passes)`` that the batch's other arms are
    compared with and start from, and a note for the progress line."""
    p = dict(proto["live"])
    p["prefill"] = unit.get("prefill", p["prefill"])  # the view of this unit's context
    study = ctx.study
    store = ctx.store
    model, _, _ = load_model(model=p["model"], base=None if unit.get("model_base") is None else Path(unit["model_base"]))
    kw = _forward_kwargs(model)
    cfg = model.config
    arm, what = _arms(p)[unit["arm"]]
    bi, batch = unit["batch"], unit["segments"]
    ids = torch.tensor(unit["tokens"], dtype=torch.int64)
    ref_logp, ref_argmax, shared, oracles = (None, None, None, None) if ref is None else ref
    if what is not None and not isinstance(what, Policy):
        ctx.one_off += _warm_quanto(model, kw, cfg, ctx.progress)  # before the arm's clock starts
    evidence_layer = p["evidence_layer"] if unit.get("first_of_context", bi == 0) else None  # None: none stored
    if arm == REFERENCE and p["shared_prefill"]:
        # the one prefill of the batch: every arm starts from its K/V (the reference continues its cache)
        tail, received = scored_needs(p)  # what the scored selections read of the prefill
        shared, cache = shared_prefill(model, kw, ids[:, :p["prefill"]], _mass_candidates(p), evidence_layer,
                                       _measures_concentration(p), any(pol.heavy for pol in policies_of(p))
                                       or received, tail, any(pol.key_rope == "pre" for pol in policies_of(p)))
        ctx.timings.append({"study": study, "case": f"batch{bi}", "arm": None, "op": "prefill", "repeat": 0,
                            "seconds": shared.seconds, "segments": len(batch), "tokens": len(batch) * p["prefill"],
                            "forwards": 1, "context": p["prefill"] + p["steps"]})
    if arm == REFERENCE:
        # the batch's oracle passes, once for all its oracle arms (before the reference's decode grows its cache)
        oracles = oracle_passes(model, kw, ids, p, evidence_layer)
        for sched, e in ({} if oracles is None else oracles.passes).items():
            ctx.timings.append({"study": study, "case": f"batch{bi}", "arm": None, "op": "oracle", "repeat": 0,
                                "seconds": e["seconds"], "segments": len(batch), "forwards": len(sched),
                                "arms": e["arms"]})
    t_arm = time.perf_counter()
    oracle = None  # what an oracle arm reads of its batch's oracle pass (oracle_passes)
    own = not p["shared_prefill"]
    if arm == REFERENCE:
        from transformers import DynamicCache

        if own:
            cache = DynamicCache(config=cfg)
        schedule = chunk_schedule(None, p["prefill"], p["steps"], "chunked", p["reference_chunk"])
        res = _run_arm(model, kw, ids, p, cache, schedule, None, keep_logp=True, bytes_of=lambda c: _dynamic_bytes(c),
                       prefill=None if own else True)
        ref_logp = res.pop("logp")
        ref_argmax = res["argmax"]
        kind, mode = "reference", "chunked"
    elif isinstance(what, Policy):
        from .policies.cache import PolicyCache, policy_attention

        scores = received = None
        schedule = chunk_schedule(what, p["prefill"], p["steps"], p["mode"], p["reference_chunk"])
        if what.oracle:  # float32 attention of the whole segment, in advance: the batch's pass (oracle_passes)
            if oracles is None:
                raise RuntimeError(f"oracle arm {arm}: the batch's reference handed on no oracle pass")
            oracle = oracles.of(what, p)
            if what.heavy_oracle:
                received = oracle["received"]
            else:
                scores = oracle["scores"]
        with policy_attention(model):
            cache = PolicyCache.for_model(what, cfg, record_layer=evidence_layer if what.middle != "float32" else None,
                                          scores=scores, received=received, scorer_base=unit.get("model_base"))
            res = _run_arm(model, kw, ids, p, cache, schedule, ref_logp, bytes_of=lambda c: c.stored_bytes(),
                           prefill=None if own else shared)
        kind, mode = "policy", p["mode"]
    else:
        from transformers import QuantizedCache

        cache = QuantizedCache("quanto", cfg, nbits=what["bits"], q_group_size=p["peer_group"],
                               residual_length=p["window"])
        schedule = [1] * p["steps"]
        res = _run_arm(model, kw, ids, p, cache, schedule, ref_logp, bytes_of=quanto_bytes,
                       prefill=None if own else shared)
        kind, mode = "peer", "step"
    seconds = time.perf_counter() - t_arm
    ctx.timings.append({"study": study, "case": f"batch{bi}", "arm": arm, "op": "decode", "repeat": 0,
                        "seconds": seconds, "segments": len(batch), "scored_tokens": len(batch) * p["steps"],
                        "forwards": len(schedule) + int(own), "context": p["prefill"] + p["steps"]})
    agree = (res["argmax"] == ref_argmax).numpy()
    rows = []
    for j, sid in enumerate(batch):
        prefix = f"{study}/{sid}/{arm}"
        lp = res["logprob"][j].numpy().astype(np.float32)
        kl = res["kl"][j].numpy().astype(np.float64)
        am = res["argmax"][j].numpy().astype(np.int32)
        arrays = {"logprob": store.save(f"{prefix}/logprob", lp), "argmax": store.save(f"{prefix}/argmax", am),
                  "bytes": store.save(f"{prefix}/bytes", res["bytes"]),
                  "context": store.save(f"{prefix}/context", res["context"])}
        if kind != "reference":
            arrays["kl"] = store.save(f"{prefix}/kl", kl)
        row = {"study": study, "analysis": "live_quality", "case": sid, "source": "corpus", "model": p["model"],
               "arm": arm, "kind": kind, "mode": mode, "forwards": len(schedule) + 1,
               **({} if p["model"] in MODELS else {"model_dims": unit["model_dims"]}),  # a model given by path
               "scored_tokens": p["steps"], "context_final": int(res["context"][-1]),
               "bytes_final": int(res["bytes"][-1]),
               "bytes_per_token": float(res["bytes"][-1]) / float(res["context"][-1]),
               **_summary(lp, kl, agree[j]),  # the reference: KL 0, agreement with itself 1
               "arrays": arrays}
        if isinstance(what, Policy):
            row["policy"] = what.config()
        if isinstance(what, Policy) and what.mixed:  # the allocation: each pair's bits, from which scores
            arrays["alloc_bits"] = store.save(f"{prefix}/alloc_bits", cache.alloc_bits()[j].numpy())
            arrays["alloc_score"] = store.save(f"{prefix}/alloc_score", cache.alloc_score[j].numpy().astype(np.float64))
        elif isinstance(what, Policy) and what.heavy:  # the heavy hitters held at the end: [L, H, count] token indices
            held = [layer.hh_index[j] for layer in cache.layers if getattr(layer, "hh_index", None) is not None]
            arrays["hh_index"] = store.save(f"{prefix}/hh_index", torch.stack(held).numpy().astype(np.int32))
        elif kind == "peer":
            row["peer"] = {"backend": "quanto", "bits": what["bits"], "q_group_size": p["peer_group"],
                           "residual_length": p["window"], "axis_key": 0, "axis_value": 0}
        if isinstance(what, Policy) and what.middle != "float32" and evidence_layer is not None and j == 0:
            ev = cache.layers[evidence_layer].evidence()
            if oracle is not None:  # what the oracle's scores of this layer were computed from: the
                # prefill's queries (those of every prefill-rule arm), the later ones, every key
                ev["input.q"] = oracle["q"][0].contiguous()
                ev["oracle.q"] = torch.cat(oracle["q"][1:], dim=1).contiguous()
                ev["oracle.k"] = oracle["k"].contiguous()
            row["evidence"] = {"layer": evidence_layer,
                               "arrays": {k: store.save(f"{prefix}/L{evidence_layer:02d}.{k}", v) for k, v in ev.items()}}
        rows.append(row)
    note = (f"{arm}, {batch_note(unit, len(batch), 'segments')}: {len(schedule) + 1} forwards, {seconds:.1f} s, "
            f"{1000 * seconds / (len(batch) * p['steps']):.1f} ms per scored token")
    return rows, ((ref_logp, ref_argmax, shared, oracles) if arm == REFERENCE else None), note


def cost_kind(what) -> str:
    """The cost class of an arm for the progress estimate (testbed.units.COST_PRIOR): the reference
    (it holds the batch's prefill), a testbed policy, or a quanto peer (one token per forward)."""
    return "reference" if what is None else "testbed" if isinstance(what, Policy) else "quanto"


def batch_note(unit: dict, items: int, word: str) -> str:
    """Which batch of its study a unit decodes, for the progress line: ``batch 2/3 (4 segments)``
    (the batch's index among the study's batches and how many segments or trials it holds)."""
    total = unit.get("batches")
    return f"batch {unit['batch'] + 1}" + (f"/{total}" if total else "") + f" ({items} {word})"


def _mass_candidates(p: dict) -> int | None:
    """The prefill tokens a sink chosen from attention is chosen from (one count for the study:
    every policy shares its sink and window), or None when no policy chooses so."""
    if not any(pol.sink_select == "mass" for pol in policies_of(p)):
        return None
    return sink_candidates(p["prefill"], p["sink"], p["window"])  # p: the view of one context


def _measures_concentration(p: dict) -> bool:
    """Whether some policy of the study allocates per-head bits from the prefill's attention."""
    return any(pol.mixed and pol.observes for pol in policies_of(p))


def _dynamic_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            total += (layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()) \
                // layer.keys.shape[0]
    return total


_QUANTO_WARM = []


def _warm_quanto(model, kw, cfg, progress=None) -> float:
    """quanto compiles its CPU extension on first use (a silent minute or more): say so on the
    progress callback, then do it before any arm is timed. Once per process; returns its seconds
    (0 once warm), which a unit adds to its context's ``one_off`` for the progress estimate."""
    if _QUANTO_WARM:
        return 0.0
    say = progress or (lambda m: None)
    say("[quanto] warming up before its first arm is timed: optimum-quanto compiles its CPU extension on a "
        "machine's first use (a minute or more, several on a busy machine; nothing else prints meanwhile), "
        "later loads it from its cache")
    t0 = time.perf_counter()
    _quanto_warmup(model, kw, cfg)
    _QUANTO_WARM.append(True)
    seconds = time.perf_counter() - t0
    say(f"[quanto] ready ({seconds:.1f} s)")
    return seconds


def _quanto_warmup(model, kw, cfg) -> None:
    """Four one-token forwards through a 4-bit QuantizedCache: quanto's first use, untimed."""
    from transformers import QuantizedCache

    with torch.no_grad():
        cache = QuantizedCache("quanto", cfg, nbits=4, q_group_size=64, residual_length=2)
        ids = torch.zeros(1, 4, dtype=torch.int64)
        for i in range(4):
            _forward(model, ids[:, i:i + 1], cache, kw)


# -- the report -------------------------------------------------------------------------------------

MIN_CI_SEGMENTS = 5  # below this a bootstrap over segments is no interval at all (2 values: their min and max)


def _bootstrap(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the mean over units (segments), resampled with replacement;
    NaN below ``MIN_CI_SEGMENTS`` units."""
    if x.size < MIN_CI_SEGMENTS:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n, x.size))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def summarize(rows: list[dict]) -> list[dict]:
    """Per arm, over segments: perplexity, paired Δ vs the reference, KL, agreement, bytes."""
    by_arm: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[r["case"]] = r
    ref = by_arm.get(REFERENCE, {})
    out = []
    for arm, segs in by_arm.items():
        ids = sorted(segs)
        nll = np.array([segs[s]["nll"] for s in ids])
        ref_nll = np.array([ref[s]["nll"] for s in ids if s in ref])
        ppl = math.exp(float(nll.mean()))
        entry = {"arm": arm, "kind": segs[ids[0]]["kind"], "mode": segs[ids[0]]["mode"], "segments": len(ids),
                 "perplexity": ppl, "mean_kl": float(np.mean([segs[s]["mean_kl"] for s in ids])),
                 "top1": float(np.mean([segs[s]["top1_agreement"] for s in ids])),
                 "bytes_per_token": float(np.mean([segs[s]["bytes_per_token"] for s in ids])),
                 "context": segs[ids[0]]["context_final"], "forwards": segs[ids[0]]["forwards"]}
        if ref_nll.size == nll.size and arm != REFERENCE:
            d = nll - ref_nll  # per segment; perplexity ratio over all segments = exp(mean d)
            entry["delta_pct"] = 100.0 * math.expm1(float(d.mean()))
            lo, hi = _bootstrap(d)
            entry["delta_ci"] = (100.0 * math.expm1(lo), 100.0 * math.expm1(hi))
            entry["worse"] = int((d > 0).sum())
        out.append(entry)
    return sorted(out, key=lambda e: (-e["bytes_per_token"], e["arm"]))


def comparator(arm: str, arms) -> str | None:
    """The arm a per-head precision arm is compared with at equal bytes: ``mix28_*`` (the bytes of
    int4) with uniform ``int4``; ``mix24_*`` (a 3-bit layout's bytes) with uniform ``int3`` where the
    study runs it, else with ``mix24_random``, the content-blind allocation of the same bytes;
    ``int2_hh`` (heavy hitters at int2's bytes), ``int2_hh_first`` (its content-blind control) and
    ``int2_hh_oracle`` (its oracle bound) with uniform ``int2``; None when that arm is absent
    (:data:`testbed.policies.policy.EQUAL_BYTES_VERSUS`)."""
    budget = equal_bytes_budget(arm)
    other = None if budget is None else equal_bytes_versus(budget, arms)
    return other if other != arm else None


def equal_bytes(rows: list[dict]) -> list[dict]:
    """Per per-head precision arm: paired over segments against its :func:`comparator` -- Δ
    perplexity (exp of the mean per-segment NLL difference, minus 1), its bootstrap interval (from
    ``MIN_CI_SEGMENTS`` segments), segments where the arm's perplexity is lower, mean KL of both,
    bytes per token of both."""
    by_arm: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[r["case"]] = r
    out = []
    for arm in sorted(by_arm):
        other = comparator(arm, by_arm)
        if other is None or set(by_arm[arm]) != set(by_arm[other]):
            continue
        ids = sorted(by_arm[arm])
        a, b = [by_arm[arm][s] for s in ids], [by_arm[other][s] for s in ids]
        d = np.array([x["nll"] for x in a]) - np.array([y["nll"] for y in b])
        lo, hi = _bootstrap(d)
        mean = lambda rs, k: float(np.mean([x[k] for x in rs]))  # noqa: E731
        out.append({"arm": arm, "versus": other, "segments": len(ids), "delta_pct": 100.0 * math.expm1(float(d.mean())),
                    "delta_ci": (100.0 * math.expm1(lo), 100.0 * math.expm1(hi)), "better": int((d < 0).sum()),
                    "mean_kl": mean(a, "mean_kl"), "versus_kl": mean(b, "mean_kl"), "top1": mean(a, "top1_agreement"),
                    "bytes_per_token": mean(a, "bytes_per_token"), "versus_bytes": mean(b, "bytes_per_token")})
    return out


EQUAL_BYTES_NOTE = (
    "Per-head precision at equal bytes: each mix* arm (and int2_hh) against the arm of the same bytes it is compared with "
    "(mix28_*, the bytes of int4 with 60 of the 90 (layer, KV head) pairs int2 and 30 int8, against uniform int4; "
    "mix24_*, a 3-bit layout's bytes with 45 pairs int2 and 45 int4, against uniform int3 where the study runs it, "
    "else against mix24_random, the content-blind allocation of those bytes; int2_hh, heavy hitters kept float32 "
    "at int2's bytes, and "
    "int2_hh_first, its content-blind control, and int2_hh_oracle, its oracle, against uniform int2). Δ is "
    "paired per segment (exp of the mean NLL difference, minus 1; negative: the "
    "arm predicts better); 'segments better' counts segments whose perplexity fell. Oracle arms (*_oracle*) decide from the "
    "whole segment's float32 attention: impossible online, an upper bound for the online rule, not a policy.")


def report(rows: list[dict], params: dict, timings: list | None = None) -> str:
    """report.md's section: one table with its notes per context of the study."""
    if not rows:
        return "(no rows: the live study was excluded; see the manifest's excluded entries)"
    views = context_views(params)
    if len(views) == 1:
        return _report_context(rows, {**params, "prefill": views[0][1]}, timings)
    parts = []
    for prefix, prefill in views:
        n = prefill + params["steps"]
        sel = [r for r in rows if r["case"].startswith(prefix + "-")]
        times = [t for t in timings or [] if t.get("context") == n]
        parts.append(f"**Context {n:,} tokens** ({prefill:,}-token prefill, then {params['steps']:,} scored tokens)"
                     f"\n\n{_report_context(sel, {**params, 'prefill': prefill}, times)}")
    return "\n\n".join(parts)


def _report_context(rows: list[dict], params: dict, timings: list | None = None) -> str:
    from tabulate import tabulate

    dims = MODELS.get(params["model"]) or rows[0]["model_dims"]
    # float16 K + V bytes per token: the reference's (DynamicCache's layout, sliding layers included) halved
    ref_rows = [r for r in rows if r["kind"] == "reference"]
    f16 = (float(np.mean([r["bytes_per_token"] for r in ref_rows])) / 2 if ref_rows
           else dims["layers"] * dims["kv_heads"] * dims["head_dim"] * 2 * 2)
    secs: dict[str, list] = {}
    study = rows[0]["study"]  # a run's timings hold every study's, and arm names repeat across live studies
    for t in timings or []:
        if t.get("study") == study and t.get("op") == "decode" and t.get("arm") is not None and t.get("scored_tokens"):
            secs.setdefault(t["arm"], []).append((t["seconds"], t["scored_tokens"]))
    table = []
    for e in summarize(rows):
        ms = secs.get(e["arm"])
        ms = 1000 * sum(s for s, _ in ms) / sum(n for _, n in ms) if ms else float("nan")
        ci = e.get("delta_ci")
        table.append([e["arm"], f"{e['mode']}, {e['forwards']}", f"{e['perplexity']:.4f}",
                      "—" if "delta_pct" not in e else f"{e['delta_pct']:+.2f} %",
                      "—" if not ci or math.isnan(ci[0]) else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]",
                      "—" if "worse" not in e else f"{e['worse']}/{e['segments']}",
                      f"{e['mean_kl']:.5f}", f"{100 * e['top1']:.2f} %", f"{e['bytes_per_token']:,.0f}",
                      f"{e['bytes_per_token'] / f16:.3f}", f"{ms:.1f}"])
    n_seg = len({r["case"] for r in rows})
    text = tabulate(table, headers=["arm", "mode, forwards", "perplexity", "Δ ppl vs DynamicCache", "95 % CI (segments)",
                                    "segments worse", "mean KL", "top-1 agree", "bytes / token", "÷ float16",
                                    "ms / scored token"], tablefmt="github")
    notes = (f"\n\n{n_seg} segments × {params['steps']} teacher-forced steps after a {params['prefill']}-token prefill; "
             "forwards per segment batch (prefill included); sorted by bytes per token (the whole cache of all "
             f"{dims['layers']} layers at the end of a segment, ÷ the tokens it has "
             f"seen; float16 K+V would be {f16:,.0f} B/token). Δ is the perplexity over all segments against the "
             "DynamicCache reference (exp of the mean per-segment NLL difference, minus 1); its interval is a "
             f"bootstrap over segments of that mean difference, given from {MIN_CI_SEGMENTS} segments on; "
             "'segments worse' counts segments whose perplexity rose. KL is KL(p_float32 ‖ p_arm) per scored token, averaged. "
             "Log-probabilities and KL rest on model forward passes the audit cannot repeat; the audit re-derives "
             "every aggregate, agreement and byte count from the stored arrays. ms / scored token is wall time of "
             "the arm's decoding (with a shared prefill, the prefill is timed once per batch apart: "
             "timings.json, op \"prefill\") on this machine, not a benchmark. Intervals are over segments, "
             "never tokens. What this table does not show: one small model "
             "(float32 weights dequantized from Q4_1), one corpus of technical English, teacher forcing (no "
             "free-running generation, no task accuracy); a policy's bytes per token include its float32 window, "
             "which dominates at short contexts.")
    eq = equal_bytes(rows)
    if eq:
        t2 = [[e["arm"], e["versus"], f"{e['delta_pct']:+.2f} %",
               "—" if math.isnan(e["delta_ci"][0]) else f"[{e['delta_ci'][0]:+.2f}, {e['delta_ci'][1]:+.2f}]",
               f"{e['better']}/{e['segments']}", f"{e['mean_kl']:.5f}", f"{e['versus_kl']:.5f}", f"{100 * e['top1']:.2f} %",
               f"{e['bytes_per_token']:,.0f}", f"{100 * (e['bytes_per_token'] / e['versus_bytes'] - 1):+.3f} %"] for e in eq]
        notes += "\n\n" + EQUAL_BYTES_NOTE + "\n\n" + tabulate(
            t2, headers=["arm", "compared with", "Δ ppl vs compared", "95 % CI (segments)", "segments better", "mean KL",
                         "compared's KL", "top-1 agree", "bytes / token", "bytes vs compared's"], tablefmt="github")
    return text + notes
