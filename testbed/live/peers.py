"""The caches users know, run beside the policies: the bytes of transformers' ``DynamicCache``
(the reference) and ``QuantizedCache`` (the quanto peer), and quanto's one-off warm-up."""

from __future__ import annotations

import time

import torch

from .decode import forward


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


def dynamic_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            total += (layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()) \
                // layer.keys.shape[0]
    return total


_QUANTO_WARM = []


def warm_quanto(model, kw, cfg, progress=None) -> float:
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
            forward(model, ids[:, i:i + 1], cache, kw)
