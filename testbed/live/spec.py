"""The live study's protocol: its spec (``SPEC``, ``PEER``, ``CORPUS``), validation against what
the model allows, its contexts and case ids, the policies and arms it declares, and its peak memory."""

from __future__ import annotations

from pathlib import Path

from ..policies import PRESETS, Policy
from ..policies.compose import check_scored_prefill, policies_from
from ..policies.presets import heavy_count
from ..schema import Key, ProtocolError, Spec, check_value
from ..sources.models import MODELS, estimate_dims


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
    "segment_range": Key((list, type(None)), "[first, stop]: run only segments first..stop-1 of the segments "
                                             "(their positions and ids unchanged), to split one study over several "
                                             "runs of the same protocol otherwise; null: all", None),
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
    "calibration": Key((dict, type(None)), "corpus text for the codec middles whose int_codebook levels are "
                                           "\"calibrated\": {\"windows\": C, \"tokens\": T}, C windows of T tokens "
                                           "(default: the prefill), window c ending where segment c + 1 starts (in "
                                           "the gaps, never scored); one table per layer by Lloyd's k-means over them "
                                           "(docs/live.md); null: none", None),
    "shared_prefill": Key(bool, "one float32 prefill per batch of segments, its K/V handed to every arm's cache "
                                "(exact: every policy applies to what it stores after the prefill); false: each arm "
                                "runs its own prefill", True),
}, rules=("exactly one of prefill and contexts is given", "prefill + steps + 1 <= 8192 (the model's positions)",
          "evidence_layer is below the model's layer count",
          "segment_range is [first, stop] with 0 <= first < stop <= segments",
          "calibration is given exactly when a policy's codebook levels are \"calibrated\"; one prefill, not contexts",
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
    if p["segment_range"] is not None:
        check_value(p["segment_range"], ("list", ("range", int, 0, 4096), 2), f"{where}.segment_range")
        if len(p["segment_range"]) != 2 or not 0 <= p["segment_range"][0] < p["segment_range"][1] <= p["segments"]:
            raise ProtocolError(f"{where}.segment_range: give [first, stop] with 0 <= first < stop <= segments "
                                f"({p['segments']}), got {p['segment_range']}")
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
    check_calibration(p, where)
    if p["model"] in MODELS:  # a model given by path is checked the same way once loaded (plan)
        check_model(p, MODELS[p["model"]], where)
    return p


def check_calibration(p: dict, where: str) -> None:
    """``calibration`` is given exactly when a policy's codebook is calibrated, as ``{"windows": C}``,
    for a study of one prefill."""
    needs = [q.name for q in policies_of(p) if q.calibrated]
    cal = p.get("calibration")
    if cal is None:
        if needs:
            raise ProtocolError(f"{where}.calibration: {', '.join(needs)} calibrate their codebooks per layer; give "
                                "calibration {\"windows\": C} (corpus text between the scored segments)")
        return
    if not needs:
        raise ProtocolError(f"{where}.calibration: no policy has \"calibrated\" codebook levels; drop it")
    if "windows" not in cal or not set(cal) <= {"windows", "tokens"}:
        raise ProtocolError(f"{where}.calibration: give {{\"windows\": C}} and optionally \"tokens\", got {cal!r}")
    check_value(cal["windows"], ("range", int, 1, p["segments"]), f"{where}.calibration.windows")
    if "tokens" in cal:
        check_value(cal["tokens"], ("range", int, 1, 8192), f"{where}.calibration.tokens")
    if p.get("contexts"):
        raise ProtocolError(f"{where}.calibration: calibration windows are one prefill long; a study of several "
                            "contexts is not served")
    if p.get("evidence_layer") is None:
        raise ProtocolError(f"{where}.calibration: the audit re-derives the evidence layer's tables from its stored "
                            "calibration input; give an evidence_layer")


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
    mixed = [q.name for q in pols if q.mixed or q.selective]
    if dims.get("sliding_window") and mixed:
        raise ProtocolError(f"{where}.policies: per-head precision or the selective rule ({', '.join(mixed)}) "
                            f"allocates over every layer's KV heads, and {p['model']} has sliding-window layers (window "
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
    calibrated = [q.name for q in pols if q.calibrated]
    if dims.get("sliding_window") and calibrated:
        raise ProtocolError(f"{where}.policies: {', '.join(calibrated)} calibrate a codebook for every layer, and "
                            f"{p['model']} has sliding-window layers (window {dims['sliding_window']}), which store no "
                            "middle; drop those policies")
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


def segment_indices(p: dict) -> range:
    """The indices of the segments this run decodes: ``segment_range``'s, else all of them."""
    first, stop = p.get("segment_range") or (0, p["segments"])
    return range(first, stop)


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


def peer_name(peer: dict) -> str:
    return f"quanto_int{peer['bits']}"


def arms_of(p: dict) -> list[tuple[str, object]]:
    """(name, what) of every arm, the reference first: what is None, a Policy or a peer's dict."""
    return [(REFERENCE, None)] + [(pol.name, pol) for pol in policies_of(p)] + [(peer_name(x), x) for x in p["peers"]]


def estimate_bytes(p: dict, base: Path | None = None) -> int:
    """Peak bytes: the float32 model, the reference's log-probabilities of one batch, the logits of
    one chunk (a prefill computes the last position's only), the prefill's activations, the caches
    (the shared prefill's K/V held beside one arm's cache, and the float32 oracle pass over the
    segment, run once per batch by the reference before its decode). A model given by path (relative to
    ``base``, the protocol's folder) is sized from its files before it is loaded
    (:func:`testbed.sources.models.estimate_dims`)."""
    dims = estimate_dims(p["model"], base)
    vocab, layers, kv, d = dims["vocab"], dims["layers"], dims["kv_heads"], dims["head_dim"]
    b = min(p["batch"], len(segment_indices(p)))
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
