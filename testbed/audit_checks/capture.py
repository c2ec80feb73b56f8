"""Capture provenance: the capture manifests, gates, model identity, token ids and case metadata.

For every study whose protocol copy captures from a model (source ``capture``), the audit reads
``STUDY/capture_manifest.json`` (hashed in the run's manifest) and checks, against the protocol
copy and its own table of the models it knows (``MODELS``, written here, not read from the run):

- the manifest's ``config`` is the protocol's (model, tokens, chunk, regions, layers, KV heads,
  queries, recorded chunks, chunk schedule), and the model's identity fields (layers, heads, KV
  heads, head dim, parameter count, vocabulary, positions, the GGUF file's name and SHA-256) are
  the known model's, in ``config``, ``model_config`` and ``load`` alike; the live study's
  ``live_manifest.json`` names the same file and dimensions;
- the software versions it records are those of the run's environment (one run, one stack);
- its prompt runs are exactly the protocol's prompts less the accepted exclusions, in order, with
  the protocol's text and kind, and each run's expected counts re-derived here (forwards =
  tokens / chunk, observer calls = forwards x the model's layers, records = recorded chunks x
  layers) and met by its actual counts;
- the gates in ``manifest.json`` for each prompt are exactly the four the capture sets, with the
  expected value re-derived here and the actual one equal to the capture manifest's count — and
  ``records`` equal to the number of the prompt's cases in ``results.json``, counted here;
- every case of a prompt stores its ``token_ids`` (int32, the protocol's ``tokens`` long), the
  same bytes for every case of the prompt, whose SHA-256 the audit computes and compares with the
  capture manifest's and the case's; a capture-wide gate line or hash that does not fit FAILs;
- each case's metadata and shapes follow from the protocol and the model: query heads of the KV
  group, the KV heads, the query selection (evenly spaced from the end of the chunk), keys in the
  call, query positions, the 1/sqrt(D) scaling, the region layout, the head map.

What it cannot check: that the token ids are the tokenization of the prompt text (the audit has
no tokenizer) or that the stored Q/K/V came out of that model on those tokens (it cannot run the
model): ``--same-as`` against a re-run on another machine is the check for those. The hardware a
capture ran on is recorded, not cross-checked (a Ray cluster may run it on another machine).
"""

from __future__ import annotations

import hashlib
import math
import re

import numpy as np

from .common import strict_json

__all__ = ["check_run", "MODELS", "query_index", "llm_layout", "read_json", "compare_fields", "check_software"]

# The models the audit knows: what the name in a protocol denotes (the file and its dimensions).
MODELS = {
    "SmolLM2-135M-Instruct.Q4_1": {
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "parameter_count": 134515008,
        "vocab": 49152, "positions": 8192, "sliding_window": None, "full_layers": list(range(30)),
    },
    "gemma-3-270m.Q4_K_M": {
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "gguf_sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "layers": 18, "heads": 4, "kv_heads": 1, "head_dim": 256, "parameter_count": 268098176,
        "vocab": 262144, "positions": 32768, "sliding_window": 512, "full_layers": [5, 11, 17],
    },
}
GATES = ("forwards", "observer_calls", "observer_calls_one_per_forward_layer", "records")
CAPTURE_DEFAULTS = {"kv_heads": None, "queries": None, "record_chunks": [-1]}
SOFTWARE = ("python", "torch", "numpy")


def query_index(tq: int, sel) -> list[int]:
    """The queries a capture keeps of a call with ``tq`` queries: all, ``sel`` evenly spaced from the
    end (the newest token always kept), or the listed indices (negative from the end)."""
    if sel is None:
        return list(range(tq))
    if isinstance(sel, int):
        n = min(sel, tq)
        return sorted({tq - 1 - int(math.floor(j * (tq / n))) for j in range(n)})
    return sorted({i + tq if i < 0 else i for i in sel})


def llm_layout(keys: int, current: int, recent: int, sink: int) -> list[dict]:
    current = min(current, keys)
    sink = min(sink, keys - current)
    recent = min(recent, keys - current - sink)
    c = keys - current
    b = c - recent
    return [{"name": "sink", "start": 0, "stop": sink}, {"name": "middle", "start": sink, "stop": b},
            {"name": "recent", "start": b, "stop": c}, {"name": "current", "start": c, "stop": keys}]


def read_json(ctx, rel: str):
    if rel not in ctx.manifest.get("files", {}):
        raise ValueError(f"{rel} is not among the run's files")
    return strict_json(ctx.read_bytes(rel).decode("utf-8"))


def check_run(ctx) -> None:
    for study, proto in sorted(ctx.protocol_copies.items()):
        try:
            if proto.get("kind") == "live":
                _check_live_identity(ctx, study, proto)
            elif isinstance(proto.get("source"), dict) and proto["source"].get("kind") == "capture":
                _check_capture(ctx, study, {**CAPTURE_DEFAULTS, **proto["source"]})
        except Exception as e:  # noqa: BLE001 - a forged manifest must give a FAIL line, never a crash
            ctx.fail(f"{study} capture provenance", f"cannot be checked ({type(e).__name__}: {str(e)[:200]})")


_USER_SCORER = re.compile(r"^[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _check_scorer_files(ctx, rel: str, proto: dict, m: dict) -> None:
    """Every user scorer ("file.py:Class") a declared policy names has its file and SHA-256 recorded,
    and nothing else is: the audit cannot run the code, but the run must say which code it was."""
    want = sorted({e["selection"]["kind"] for e in proto.get("live", {}).get("policies", [])
                   if isinstance(e, dict) and isinstance(e.get("selection"), dict)
                   and _USER_SCORER.match(str(e["selection"].get("kind", "")))})
    got = m.get("scorer_files", {})
    if not isinstance(got, dict) or sorted(got) != want:
        ctx.fail(rel, f"scorer_files names {sorted(got) if isinstance(got, dict) else got!r}, the protocol's user "
                      f"scorers are {want}")
        return
    for name, entry in got.items():
        if not (isinstance(entry, dict) and entry.get("file") == name.split(":")[0]
                and _HEX64.match(str(entry.get("sha256", "")))):
            ctx.fail(rel, f"scorer_files[{name!r}] must record its file and a SHA-256, got {entry!r}")


def _check_live_identity(ctx, study: str, proto: dict) -> None:
    name = proto.get("live", {}).get("model")
    known = MODELS.get(name)
    rel = f"{study}/live_manifest.json"
    m = read_json(ctx, rel)
    _check_scorer_files(ctx, rel, proto, m)
    model, dims = m.get("model", {}), m.get("model_dims", {})
    if known is None:
        # a model given by path: nothing here knows it; its identity is what the run recorded (the
        # file's or folder's SHA-256), its dimensions are checked against every row's (self-consistent)
        outside = getattr(ctx, "outside_models", None)
        if isinstance(outside, dict):
            outside[study] = f"{name} (sha256 {str(model.get('gguf_sha256'))[:12]}...)"
        compare_fields(ctx, rel, {"model.model": (model.get("model"), name)})
        for row in ctx.results.get("rows", []):
            if isinstance(row, dict) and row.get("study") == study and row.get("model_dims") != dims:
                ctx.fail(row, "model_dims are not the live manifest's")
        check_software(ctx, rel, m.get("software"))
        return
    want = {"model.model": (model.get("model"), name), "model.gguf": (model.get("gguf"), known["gguf"]),
            "model.gguf_sha256": (model.get("gguf_sha256"), known["gguf_sha256"]),
            "model_dims.layers": (dims.get("layers"), known["layers"]),
            "model_dims.kv_heads": (dims.get("kv_heads"), known["kv_heads"]),
            "model_dims.head_dim": (dims.get("head_dim"), known["head_dim"]),
            "model_dims.vocab": (dims.get("vocab"), known["vocab"]),
            "model_dims.sliding_window": (dims.get("sliding_window"), known["sliding_window"]),
            "model_dims.full_layers": (dims.get("full_layers"), known["full_layers"])}
    compare_fields(ctx, rel, want)
    check_software(ctx, rel, m.get("software"))


def _outside_model(ctx, study: str, name: str, cfg: dict, mc: dict, load: dict) -> dict:
    """A capture from a model given by path: nothing here knows it, so its dimensions are the ones
    the manifest recorded (then checked against its own model_config and every case: self-consistent
    only), and its identity is the file's or folder's SHA-256 the run recorded."""
    outside = getattr(ctx, "outside_models", None)
    if isinstance(outside, dict):
        outside[study] = f"{name} (sha256 {str(load.get('gguf_sha256'))[:12]}...)"
    return {"layers": cfg.get("transformer_layers"), "heads": cfg.get("query_heads"),
            "kv_heads": cfg.get("kv_heads_in_model"), "head_dim": cfg.get("head_dim"),
            "parameter_count": cfg.get("parameter_count"), "vocab": mc.get("vocab_size"),
            "positions": mc.get("max_position_embeddings"), "gguf": load.get("gguf"),
            "gguf_sha256": load.get("gguf_sha256"), **_scales(mc, cfg.get("head_dim"))}


def _config_head_dim(mc: dict):
    """The head dimension a model's config implies, as the capture reads it: its ``head_dim``, or
    hidden_size / heads for the many configs that store none (Qwen2, Phi-3, OLMo, Granite)."""
    d = mc.get("head_dim")
    if d is not None:
        return d
    hidden, heads = mc.get("hidden_size"), mc.get("num_attention_heads")
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (hidden, heads)) and heads > 0
    return hidden // heads if ok else None


def _scales(mc: dict, head_dim) -> dict:
    """The score scale a model's config implies (Granite's ``attention_multiplier`` is the scale
    itself; Gemma's ``query_pre_attn_scalar`` replaces D in 1/sqrt(D)), and the factor a Case folds
    into q to keep softmax(q k^T / sqrt(D)) (1.0 when within 1e-6 of it, as the capture snaps it)."""
    d = float(head_dim or 1)
    multiplier = mc.get("attention_multiplier")
    if isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool):
        scaling = float(multiplier)
    else:
        scaling = float(mc.get("query_pre_attn_scalar") or d) ** -0.5
    prescale = scaling * math.sqrt(d)
    return {"scaling": scaling, "q_prescale": 1.0 if abs(prescale - 1.0) < 1e-6 else prescale}


def compare_fields(ctx, where: str, want: dict) -> None:
    for field, (got, expected) in want.items():
        ctx.numbers += 1
        if got != expected or type(got) is not type(expected):
            ctx.fail(where, f"{field} is {got!r}, expected {expected!r}")


def check_software(ctx, where: str, software) -> None:
    env = ctx.manifest.get("environment", {})
    if not isinstance(software, dict):
        ctx.fail(where, "software must be an object")
        return
    for k in SOFTWARE:
        if software.get(k) != env.get(k):
            ctx.fail(where, f"software.{k} {software.get(k)!r} is not the run environment's {env.get(k)!r}")


def _check_capture(ctx, study: str, p: dict) -> None:
    rel = f"{study}/capture_manifest.json"
    m = read_json(ctx, rel)
    excluded = {e.get("id") for e in ctx.manifest.get("excluded", []) if isinstance(e, dict)}
    whole = f"{study}/{p['model']}" in excluded
    known = MODELS.get(p["model"])
    n_chunks = p["tokens"] // p["chunk"]
    record_chunks = sorted({c % n_chunks for c in p["record_chunks"]})
    cfg = m.get("config", {})
    want = {f"config.{k}": (cfg.get(k), p[k]) for k in ("model", "tokens", "chunk", "sink_tokens", "recent_tokens",
                                                        "layers", "kv_heads", "queries")}
    want.update({"config.record_chunks": (cfg.get("record_chunks"), record_chunks),
                 "config.chunk_schedule": (cfg.get("chunk_schedule"), [p["chunk"]] * n_chunks),
                 "config.causal": (cfg.get("causal"), True),
                 "config.key_region_order": (cfg.get("key_region_order"), ["sink", "middle", "recent", "current"])})
    compare_fields(ctx, rel, want)
    check_software(ctx, rel, m.get("software"))
    if whole:
        if m.get("runs"):
            ctx.fail(rel, "the model did not load (excluded), yet the manifest lists prompt runs")
        return
    if not isinstance(m.get("load"), dict):
        ctx.fail(rel, "records no loaded model, yet the study is not excluded")
        return
    mc, load = cfg.get("model_config", {}), m["load"]
    if known is None:
        known = _outside_model(ctx, study, p["model"], cfg, mc, load)
    compare_fields(ctx, rel, {
        "config.transformer_layers": (cfg.get("transformer_layers"), known["layers"]),
        "config.query_heads": (cfg.get("query_heads"), known["heads"]),
        "config.kv_heads_in_model": (cfg.get("kv_heads_in_model"), known["kv_heads"]),
        "config.head_dim": (cfg.get("head_dim"), known["head_dim"]),
        "config.parameter_count": (cfg.get("parameter_count"), known["parameter_count"]),
        "config.dtype": (cfg.get("dtype"), "float32"),
        "model_config.num_hidden_layers": (mc.get("num_hidden_layers"), known["layers"]),
        "model_config.num_attention_heads": (mc.get("num_attention_heads"), known["heads"]),
        "model_config.num_key_value_heads": (mc.get("num_key_value_heads"), known["kv_heads"]),
        "model_config.head_dim": (_config_head_dim(mc), known["head_dim"]),
        "model_config.vocab_size": (mc.get("vocab_size"), known["vocab"]),
        "model_config.max_position_embeddings": (mc.get("max_position_embeddings"), known["positions"]),
        "load.model": (load.get("model"), p["model"]),
        "load.gguf": (load.get("gguf"), known["gguf"]),
        "load.gguf_sha256": (load.get("gguf_sha256"), known["gguf_sha256"]),
    })
    layers = known["layers"]
    prompts = [q for q in p["prompts"] if f"{study}/{q['id']}" not in excluded]
    runs = m.get("runs", [])
    if not isinstance(runs, list) or [r.get("id") if isinstance(r, dict) else None for r in runs] != [q["id"] for q in prompts]:
        got = [r.get("id") for r in runs if isinstance(r, dict)] if isinstance(runs, list) else runs
        ctx.fail(rel, f"runs {got!r} are not the protocol's prompts less the exclusions {[q['id'] for q in prompts]}")
        return
    cases = ctx.results.get("cases", {}).get(study, {})
    by_prompt: dict[str, list] = {}
    for cid, rec in sorted(cases.items()):
        meta = rec.get("meta", {}) if isinstance(rec, dict) else {}
        by_prompt.setdefault(meta.get("prompt"), []).append((cid, rec))
    gates = ctx.manifest.get("gates", {})
    mine = {g for g in gates if g.startswith(f"{study}.")}
    expected_gates = {f"{study}.{q['id']}.{g}" for q in prompts for g in GATES}
    for g in sorted(mine - expected_gates):
        ctx.fail(f"manifest.json gates.{g}", "not a gate the capture sets")
    for g in sorted(expected_gates - mine):
        ctx.fail(f"manifest.json gates.{g}", "missing: the capture sets this gate for every prompt")
    n_records = len(record_chunks) * len(p["layers"])
    for prompt, run in zip(prompts, runs):
        pid, where = prompt["id"], f"{rel} runs.{prompt['id']}"
        compare_fields(ctx, where, {
            "text": (run.get("text"), prompt["text"]), "kind": (run.get("kind"), prompt["kind"]),
            "prompt_tokens": (run.get("prompt_tokens"), p["tokens"]),
            "expected_top_level_forwards": (run.get("expected_top_level_forwards"), n_chunks),
            "actual_top_level_forwards": (run.get("actual_top_level_forwards"), n_chunks),
            "expected_observer_calls": (run.get("expected_observer_calls"), n_chunks * layers),
            "actual_observer_calls": (run.get("actual_observer_calls"), n_chunks * layers),
            "records": (run.get("records"), n_records),
        })
        if not isinstance(run.get("sink_token_text"), list) or len(run["sink_token_text"]) != min(p["sink_tokens"], p["tokens"]):
            ctx.fail(where, f"sink_token_text must list the {p['sink_tokens']} sink tokens")
        mine_cases = by_prompt.get(pid, [])
        actual = {"forwards": run.get("actual_top_level_forwards"), "observer_calls": run.get("actual_observer_calls"),
                  "observer_calls_one_per_forward_layer": n_chunks * layers, "records": len(mine_cases)}
        expect = {"forwards": n_chunks, "observer_calls": n_chunks * layers,
                  "observer_calls_one_per_forward_layer": n_chunks * layers, "records": n_records}
        for g in GATES:
            gate = gates.get(f"{study}.{pid}.{g}")
            if not isinstance(gate, dict):
                continue
            ctx.numbers += 2
            if gate.get("expected") != expect[g]:
                ctx.fail(f"manifest.json gates.{study}.{pid}.{g}",
                         f"expected {gate.get('expected')!r}, but the protocol and model give {expect[g]}")
            if gate.get("actual") != actual[g]:
                what = "cases in results.json" if g == "records" else "the capture manifest's count"
                ctx.fail(f"manifest.json gates.{study}.{pid}.{g}", f"actual {gate.get('actual')!r}, but {what}: {actual[g]}")
        digest = run.get("token_ids_sha256")
        ids_bytes = None
        for cid, rec in mine_cases:
            ids_bytes = _check_case(ctx, study, cid, rec, p, known, digest, ids_bytes)


def _check_case(ctx, study, cid, rec, p, known, digest, ids_bytes):
    where = f"results.json cases.{study}.{cid}"
    meta = rec.get("meta", {})
    arrays = rec.get("arrays", {})
    if "token_ids" not in arrays:
        ctx.fail(where, "token_ids: not stored (a capture stores the prompt's token ids with every case)")
        return ids_bytes
    try:
        ids = ctx.load(arrays["token_ids"])
    except Exception as e:  # noqa: BLE001 - a missing or failed array is a FAIL line
        ctx.fail(where, f"token_ids: {e}")
        return ids_bytes
    ctx.numbers += 1
    if ids.dtype != np.dtype("<i4") or ids.shape != (p["tokens"],):
        ctx.fail(where, f"token_ids must be int32 [{p['tokens']}], got {ids.dtype.str} {list(ids.shape)}")
    else:
        mine = hashlib.sha256(ids.tobytes()).hexdigest()
        if mine != digest:
            ctx.fail(where, f"token_ids hash {mine[:12]}.. is not the capture manifest's {str(digest)[:12]}..")
        if meta.get("token_ids_sha256") != mine:
            ctx.fail(where, "meta.token_ids_sha256 is not the hash of the stored token_ids")
        if ids_bytes is not None and ids.tobytes() != ids_bytes:
            ctx.fail(where, "token_ids differ from another case of the same prompt")
        if int(ids.min()) < 0 or int(ids.max()) >= known["vocab"]:
            ctx.fail(where, f"token_ids leave the vocabulary [0, {known['vocab']})")
        ids_bytes = ids.tobytes()
    chunk = meta.get("chunk")
    if not isinstance(chunk, int) or isinstance(chunk, bool):
        ctx.fail(where, f"meta.chunk {chunk!r} is not an integer")
        return ids_bytes
    group = known["heads"] // known["kv_heads"]
    kv = list(range(known["kv_heads"])) if p["kv_heads"] is None else sorted({int(h) for h in p["kv_heads"]})
    q_heads = [h * group + j for h in kv for j in range(group)]
    qi = query_index(p["chunk"], p["queries"])
    keys = (chunk + 1) * p["chunk"]
    want = {
        "meta.forward": (meta.get("forward"), chunk), "meta.q_heads": (meta.get("q_heads"), q_heads),
        "meta.kv_heads": (meta.get("kv_heads"), kv), "meta.query_index": (meta.get("query_index"), qi),
        "meta.queries_in_call": (meta.get("queries_in_call"), p["chunk"]), "meta.keys_in_call": (meta.get("keys_in_call"), keys),
        # a model the audit does not know may scale its scores otherwise (e.g. Gemma's query_pre_attn_scalar)
        "meta.scaling": (meta.get("scaling"), known.get("scaling", known["head_dim"] ** -0.5)),
        "meta.q_prescale": (meta.get("q_prescale"), known.get("q_prescale", 1.0)),
        "meta.dtype": (meta.get("dtype"), "float32"), "meta.tokens_per_chunk": (meta.get("tokens_per_chunk"), p["chunk"]),
        "meta.prompt_kind": (meta.get("prompt_kind"), next(q["kind"] for q in p["prompts"] if q["id"] == meta.get("prompt"))),
        "meta.sink_tokens": (meta.get("sink_tokens"), min(p["sink_tokens"], keys - p["chunk"])),
        # a causal call whose only kept query is the newest sees every key: recorded as not causal
        "causal": (rec.get("causal"), qi != [p["chunk"] - 1]),
        "layout": (rec.get("layout"), llm_layout(keys, p["chunk"], p["recent_tokens"], p["sink_tokens"])),
        "head_map": (rec.get("head_map"), [i // group for i in range(len(q_heads))]),
    }
    compare_fields(ctx, where, want)
    full = {"q": [len(q_heads), len(qi), known["head_dim"]], "k": [len(kv), keys, known["head_dim"]],
            "v": [len(kv), keys, known["head_dim"]]}
    kept = full
    archive = p.get("archive")
    if archive is not None:
        # which Q/K/V the protocol keeps for this prompt: its listed KV heads (case KV-axis
        # indices of the recorded heads) with their query heads, or nothing
        sel = sorted(kv.index(h) for h in archive.get("kv_heads", []) if h in kv) if meta.get("prompt") in archive.get(
            "prompts", []) else []
        sel_q = [i for i in range(len(q_heads)) if i // group in sel]
        compare_fields(ctx, where, {"archive": (rec.get("archive"), {"kv_heads": sel, "q_heads": sel_q, "shapes": full})})
        kept = {} if not sel else {"q": [len(sel_q), len(qi), known["head_dim"]], "k": [len(sel), keys, known["head_dim"]],
                                   "v": [len(sel), keys, known["head_dim"]]}
        stored = sorted(n for n in ("q", "k", "v") if n in arrays)
        if stored != sorted(kept):
            ctx.fail(where, f"stores {stored} of q/k/v, the protocol's archive keeps {sorted(kept)}")
            return ids_bytes
    elif "archive" in rec:
        ctx.fail(where, "has an archive entry, but the protocol keeps every array")
    try:
        qp = ctx.load(arrays.get("query_positions"))
        got = {n: ctx.load(arrays.get(n)) for n in kept}
    except Exception:  # noqa: BLE001 - the case's own checks report a missing array
        return ids_bytes
    compare_fields(ctx, where + " shape", {n: (list(x.shape), kept[n]) for n, x in got.items()})
    ctx.numbers += 1
    if qp.tolist() != [keys - p["chunk"] + i for i in qi]:
        ctx.fail(where, "query_positions are not the selected queries' positions in the recorded chunk")
    return ids_bytes
