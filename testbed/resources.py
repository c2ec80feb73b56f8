"""Memory guard: estimate a protocol's peak memory before anything is allocated, refuse what cannot fit.

A source module may define ``estimate_bytes(params, p_payload=True) -> int``: the peak resident
bytes of its largest Case as it goes through the analysis chain (the trace and capture sources
also take ``base``, the protocol's folder, for the files or the model a protocol names by path;
``p_payload`` is `stores_p_payload` of the protocol's analyses).
:func:`attention_chain_bytes` gives that peak for a Case of given dimensions, so most sources
only have to name their largest Case. A source without the hook is not guarded (the run says so
on stderr and records ``null`` in the manifest).

The estimate is compared with the memory this process can still get: ``MemAvailable`` from
``/proc/meminfo``, lowered to the cgroup limit when the run is inside a container (v2
``memory.max - memory.current``, v1 ``limit_in_bytes - usage_in_bytes``), or psutil's
``virtual_memory().available`` where ``/proc`` is missing. When none can be read the guard is
skipped rather than guessed.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ResourceError", "attention_chain_bytes", "available_bytes", "check_memory",
           "format_bytes", "stores_p_payload", "synthetic_estimate_bytes", "tile_scores", "DEFAULT_MAX_SCORES"]


OVERHEAD = 256 << 20
DEFAULT_MAX_SCORES = 1 << 21  # float64 scores per tile of the analyses (16 MiB); a tile's temporaries are a few times that


class ResourceError(ValueError):
    """A protocol whose largest Case cannot fit in the memory available now."""


def tile_scores(heads: int, queries: int, keys: int, max_scores: int = DEFAULT_MAX_SCORES) -> int:
    """Scores in the largest tile of queries ``[H, c, Tk]`` the analyses work over
    (`testbed.attention.query_tiles`): ``c`` queries as ``max_scores`` allows, at least one."""
    per_query = max(1, heads * keys)
    return per_query * min(queries, max(1, int(max_scores) // per_query))


def attention_chain_bytes(heads: int, kv_heads: int, queries: int, keys: int, head_dim: int,
                          max_scores: int = DEFAULT_MAX_SCORES, p_payload: bool = True) -> int:
    """Peak bytes of one Case ``q [H, Tq, D]``, ``k, v [H_kv, Tk, D]`` through the analysis chain.

    The analyses work over tiles of queries of about ``max_scores`` float64 scores (observation,
    ablation, mx_paths, residual_window: each analysis's ``max_scores``; the estimate assumes the
    default, `DEFAULT_MAX_SCORES`, since a source's estimate does not see the analyses' parameters).
    Counted, as an upper bound (each coefficient is above the peak resident memory measured for
    the residual-window analysis on this term alone, tests/test_resource_guard.py, and for
    mx_paths and residual_window tiled, tests/test_tiles.py):

    - the Case itself in float32 (q, k, v) and its int64 query positions;
    - 6 float64 score / probability tiles ``[H, c, Tk]`` (`tile_scores`): a reference tile and a
      quantized one, their logits while they are computed, and the differences a row statistic
      takes (``[H, Tq, Tk]`` itself when the Case fits one tile);
    - 3 bytes per score of ``[H, Tq, Tk]``: mx_paths' stored P payload (one byte per code, its
      scales, and the serialized copy the array store writes); not with ``p_payload`` false, when
      the protocol's mx_paths stores none (`stores_p_payload`);
    - 3 float64 copies of K or V expanded to H heads (the reference attention; about 2.3 measured);
    - 16 float32 copies of K or V at H_kv heads: dequantized K and V, the quantizers' group-padded
      working copies and their temporaries (about 14 measured);
    - 3 float64 outputs ``[H, Tq, D]``;
    - a fixed ``OVERHEAD`` (256 MiB) for what does not scale with the Case: the first compilation
      of the fused kernels (about 70 MiB measured) and memory the allocator keeps after freeing
      mid-sized temporaries.

    An analysis with a larger working set than the attention chain should be given its own term.
    """
    f32, f64 = 4, 8
    q = heads * queries * head_dim
    kv = kv_heads * keys * head_dim
    case = (q + 2 * kv) * f32 + queries * 8
    probs = 6 * tile_scores(heads, queries, keys, max_scores) * f64 + (3 * heads * queries * keys if p_payload else 0)
    kv_work = 3 * heads * keys * head_dim * f64 + 16 * kv * f32
    outputs = 3 * q * f64
    return int(case + probs + kv_work + outputs + OVERHEAD)


def stores_p_payload(analyses: dict | None) -> bool:
    """Whether a protocol's analyses may store mx_paths' whole P payload (``[H, Tq, Tk]`` codes):
    false only when its mx_paths says so (``p_path`` or ``store_p`` false); a protocol without
    mx_paths, or an unknown one (None), is counted as storing it (an upper bound)."""
    mx = (analyses or {}).get("mx_paths")
    return mx is None or bool(mx.get("p_path", True) and mx.get("store_p", True))


def synthetic_estimate_bytes(params: dict, p_payload: bool = True) -> int:
    """``estimate_bytes`` for :mod:`testbed.sources.synthetic`: every Case of a protocol has the same
    heads, queries and head_dim, so the largest is the one with the longest length."""
    return attention_chain_bytes(params["heads"], params["kv_heads"], params["queries"], max(params["lengths"]),
                                 params["head_dim"], p_payload=p_payload)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_bytes() -> int | None:
    """Bytes this process can still allocate, or None when no source of that number is readable."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, use = _read_int(limit), _read_int(usage)
        if lim is not None and use is not None and lim < (1 << 60):
            candidates.append(max(0, lim - use))
    if not candidates:
        try:
            import psutil

            candidates.append(int(psutil.virtual_memory().available))
        except Exception:  # psutil is optional (test extra); no number means no guard
            return None
    return min(candidates)


def format_bytes(n: int | float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_memory(estimates: dict[str, int | None], available: int | None = None) -> dict:
    """Refuse (``ResourceError``, naming the estimate) a protocol whose largest Case cannot fit;
    ``estimates``: {study: peak bytes or None} (:func:`testbed.protocol.estimate_protocol`).

    Returns ``{"available_bytes": ..., "estimated_peak_bytes": {study: bytes or None}}`` for the manifest.
    """
    available = available_bytes() if available is None else available
    if available is not None:
        for name, est in estimates.items():
            if est is not None and est > available:
                raise ResourceError(
                    f"protocol {name}: its largest case needs an estimated {format_bytes(est)} of memory, "
                    f"only {format_bytes(available)} is available; reduce source lengths / queries / heads "
                    "(or pass --no-memory-guard to run anyway)")
    return {"available_bytes": available, "estimated_peak_bytes": estimates}
