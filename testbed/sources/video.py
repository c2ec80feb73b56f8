"""Synthetic chunked attention with a structured cache: a video-like and an LLM-like layout.

Replays the setting of the video KV-cache attention study (docs/studies.md) without its model:
a *current chunk* of queries attends to a cache of earlier tokens plus the chunk itself.

``video``: a latent video of frames of ``tokens_per_frame`` tokens (15 x 26 = 390 in the study;
small by default). Chunk ``c`` covers frames ``[c*C, (c+1)*C)`` (``C = current_frames``); the
keys are, in physical order, ``sink`` (the first ``sink_frames`` frames of the video), ``recent``
(the ``recent_frames`` frames just before the chunk) and ``current`` (the chunk), as in the
study's ``[sink4, recent6, current6]``. The queries are the chunk's tokens and see every key
(bidirectional inside the chunk: ``causal=False``).

``llm``: one token per position, ``sink | middle | recent | current`` with ``current`` the last
``llm_current`` tokens; the queries are the current tokens and are causal (query ``i`` sees keys
``0 .. its own position``), as in chunked prefill.

Content. Token ``(f, s)`` (frame or position ``f``, spatial slot ``s``) has the unit vector
``x = normalize(spatial[s] + temporal[f] + noise * e)``, where ``temporal`` is an AR(1) process
over frames with correlation ``rho`` (nearby frames are similar, far ones are not) and
``spatial`` is shared by all frames (the same place in the picture; absent in the LLM layout).
Keys are ``x`` and values are ``x * sqrt(D) + e'``; the query of a current token is its own
content plus noise, scaled by the head's *concentration* ``kappa_h * sqrt(D)``, so its logits
are ``kappa_h * cos``: large ``kappa`` gives sharp heads, small ``kappa`` near-uniform ones.
Channel 0 is reserved for the attention sink: sink keys and every query carry ``a`` there with
``a^2 / sqrt(D) = sink_logit``, a content-free bonus like a real attention sink's. Query heads
that share a KV head (GQA) share the content and differ in concentration.

Per-head bonuses (video layout; both empty by default, and then the generator is the one above,
bit for bit). ``sink_logits[h]`` replaces ``sink_logit`` for query head ``h``: the sink keys carry
``c = D^(1/4)`` in channel 0 and query head ``h`` carries ``sink_logits[h] * sqrt(D) / c``.
``current_logits[h]`` (may be negative) adds a content-free bonus to the current chunk's keys for
query head ``h`` the same way through a second reserved channel, channel 1; the content then
lives in channels ``2 .. D-1``. So a head's logits are ``kappa_h * cos + sink_h [sink key] +
current_h [current key]``. ``tools/calibrate_video.py`` fits them (docs/calibration.md).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from ..case import Case, Region
from ..resources import attention_chain_bytes
from ..schema import Key, ProtocolError, Spec

__all__ = ["LAYOUTS", "make_video_case", "make_llm_case", "validate", "cases", "estimate_bytes", "SPEC"]

LAYOUTS = ("video", "llm")
DEFAULT_CONCENTRATIONS = [16.0, 6.0, 3.0, 0.5]


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=1e-12)


def _content(g: torch.Generator, kv_heads: int, frames: int, tpf: int, dim: int, rho: float, noise: float,
             spatial: bool) -> torch.Tensor:
    """Unit content vectors ``[H_kv, frames, tpf, dim]``."""
    sp = torch.randn(kv_heads, 1, tpf, dim, generator=g) / math.sqrt(dim) if spatial else torch.zeros(kv_heads, 1, tpf, dim)
    w = torch.empty(kv_heads, frames, 1, dim)
    w[:, 0] = torch.randn(kv_heads, 1, dim, generator=g) / math.sqrt(dim)
    innov = math.sqrt(max(0.0, 1.0 - rho * rho))
    for f in range(1, frames):
        w[:, f] = rho * w[:, f - 1] + innov * torch.randn(kv_heads, 1, dim, generator=g) / math.sqrt(dim)
    e = torch.randn(kv_heads, frames, tpf, dim, generator=g) / math.sqrt(dim)
    return _unit(sp + w + noise * e)


def _qkv(g, content_keys, content_queries, heads, kv_heads, head_dim, concentrations, sink_keys, sink_logit,
         query_noise, sink_logits=(), current_logits=(), current_start=None):
    """Keys, values and queries from flattened content (``[H_kv, T, C]``) plus the reserved channels:
    channel 0 (sink) and, with ``current_logits``, channel 1 (current); ``C = D - reserved``."""
    hkv, tk, dc = content_keys.shape
    off = head_dim - dc  # reserved channels in front of the content
    group = heads // kv_heads
    a = math.sqrt(sink_logit * math.sqrt(head_dim)) if sink_logit > 0 else 0.0
    c = head_dim ** 0.25  # the key side of a per-head bonus: query value * c / sqrt(D) = the bonus
    k = torch.zeros(hkv, tk, head_dim)
    k[..., off:] = content_keys
    k[:, :sink_keys, 0] = c if sink_logits else a
    if current_logits:
        k[:, current_start:, 1] = c
    v = content_keys * math.sqrt(head_dim)
    v = torch.cat([torch.randn(hkv, tk, off, generator=g), v], dim=-1) + 0.5 * torch.randn(hkv, tk, head_dim, generator=g)
    tq = content_queries.shape[1]
    q = torch.zeros(heads, tq, head_dim)
    for hh in range(heads):
        kappa = concentrations[hh % len(concentrations)]
        cq = _unit(content_queries[hh // group] + query_noise * torch.randn(tq, dc, generator=g) / math.sqrt(head_dim))
        q[hh, :, off:] = kappa * math.sqrt(head_dim) * cq
        q[hh, :, 0] = sink_logits[hh] * math.sqrt(head_dim) / c if sink_logits else a
        if current_logits:
            q[hh, :, 1] = current_logits[hh] * math.sqrt(head_dim) / c
    return q.contiguous(), k.contiguous(), v.contiguous()


def make_video_case(seed: int, chunk: int = 3, *, tokens_per_frame: int = 4, sink_frames: int = 4,
                    recent_frames: int = 6, current_frames: int = 6, heads: int = 4, kv_heads: int = 4,
                    head_dim: int = 32, concentrations=None, rho: float = 0.8, noise: float = 0.5,
                    query_noise: float = 0.3, sink_logit: float = 1.0, sink_logits=(), current_logits=()) -> Case:
    concentrations = list(concentrations or DEFAULT_CONCENTRATIONS)
    sink_logits, current_logits = [float(x) for x in sink_logits], [float(x) for x in current_logits]
    for name, vals in (("sink_logits", sink_logits), ("current_logits", current_logits)):
        if vals and len(vals) != heads:
            raise ValueError(f"{name}: {len(vals)} values for {heads} heads (give none or one per query head)")
    if current_logits and head_dim < 3:
        raise ValueError(f"current_logits need head_dim >= 3 (two reserved channels), got {head_dim}")
    start = chunk * current_frames
    if start - recent_frames < sink_frames:
        raise ValueError(f"chunk {chunk}: the recent frames [{start - recent_frames}, {start}) would overlap the "
                         f"{sink_frames} sink frames; use chunk >= {-(-(sink_frames + recent_frames) // current_frames)}")
    if heads % kv_heads:
        raise ValueError(f"{heads} heads are not a multiple of {kv_heads} KV heads")
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * chunk + 17)
    frames_total = start + current_frames
    dc = head_dim - (2 if current_logits else 1)  # content channels
    x = _content(g, kv_heads, frames_total, tokens_per_frame, dc, rho, noise, spatial=True)
    key_frames = list(range(sink_frames)) + list(range(start - recent_frames, start)) + list(range(start, frames_total))
    ck = x[:, key_frames].reshape(kv_heads, -1, dc)
    cq = x[:, start:frames_total].reshape(kv_heads, -1, dc)
    tpf = tokens_per_frame
    s_end = sink_frames * tpf
    r_end = s_end + recent_frames * tpf
    tk = r_end + current_frames * tpf
    q, k, v = _qkv(g, ck, cq, heads, kv_heads, head_dim, concentrations, s_end, sink_logit, query_noise,
                   sink_logits, current_logits, r_end)
    layout = (Region("sink", 0, s_end), Region("recent", s_end, r_end), Region("current", r_end, tk))
    return Case(
        id=f"video-s{seed}-c{chunk}", q=q, k=k, v=v,
        query_positions=torch.arange(r_end, tk, dtype=torch.int64), causal=False, layout=layout,
        tokens_per_frame=tpf,
        meta={"source": "synthetic_video", "distribution": "video", "layout_kind": "video", "seed": seed,
              "chunk": chunk, "key_frames": key_frames,
              "head_concentration": [concentrations[hh % len(concentrations)] for hh in range(heads)],
              "rho": rho, "sink_logit": sink_logit,
              **({"sink_logits": sink_logits} if sink_logits else {}),
              **({"current_logits": current_logits} if current_logits else {})},
    )


def make_llm_case(seed: int, *, sink: int = 4, middle: int = 28, recent: int = 16, current: int = 32,
                  heads: int = 4, kv_heads: int = 2, head_dim: int = 32, concentrations=None, rho: float = 0.95,
                  noise: float = 0.5, query_noise: float = 0.3, sink_logit: float = 3.0) -> Case:
    concentrations = list(concentrations or DEFAULT_CONCENTRATIONS)
    if heads % kv_heads:
        raise ValueError(f"{heads} heads are not a multiple of {kv_heads} KV heads")
    g = torch.Generator().manual_seed(1_000_003 * seed + 104_729)
    tk = sink + middle + recent + current
    x = _content(g, kv_heads, tk, 1, head_dim - 1, rho, noise, spatial=False).reshape(kv_heads, tk, head_dim - 1)
    q, k, v = _qkv(g, x, x[:, tk - current:], heads, kv_heads, head_dim, concentrations, sink, sink_logit, query_noise)
    b1, b2, b3 = sink, sink + middle, sink + middle + recent
    layout = (Region("sink", 0, b1), Region("middle", b1, b2), Region("recent", b2, b3), Region("current", b3, tk))
    return Case(
        id=f"llm-s{seed}", q=q, k=k, v=v,
        query_positions=torch.arange(b3, tk, dtype=torch.int64), causal=True, layout=layout,
        meta={"source": "synthetic_video", "distribution": "llm_causal", "layout_kind": "llm", "seed": seed,
              "head_concentration": [concentrations[hh % len(concentrations)] for hh in range(heads)],
              "rho": rho, "sink_logit": sink_logit},
    )


SPEC = Spec("source: synthetic_video", "Synthetic chunked attention with a structured cache (testbed/sources/video.py)"
            ": a current chunk of queries attends to sink, recent and current frames (video) or to "
            "sink | middle | recent | current tokens (llm).", {
    "kind": Key(("choice", ("synthetic_video",)), "the source kind"),
    "seeds": Key(("list", ("range", int, 0, 1 << 31), 1), "generator seeds"),
    "layouts": Key(("list", ("choice", LAYOUTS), 1), "video: frames, bidirectional chunk; llm: tokens, causal chunk"),
    "chunks": Key(("list", ("range", int, 1, 1 << 12), 1), "video: which chunk of the video is current", [3]),
    "tokens_per_frame": Key(("range", int, 1, 4096), "video: tokens per frame", 4),
    "sink_frames": Key(("range", int, 1, 256), "video: frames at the start kept as the sink", 4),
    "recent_frames": Key(("range", int, 1, 256), "video: frames just before the chunk", 6),
    "current_frames": Key(("range", int, 1, 256), "video: frames of the current chunk (the queries)", 6),
    "llm_sink": Key(("range", int, 1, 1 << 16), "llm: sink tokens", 4),
    "llm_middle": Key(("range", int, 1, 1 << 20), "llm: middle tokens", 28),
    "llm_recent": Key(("range", int, 1, 1 << 16), "llm: recent tokens", 16),
    "llm_current": Key(("range", int, 1, 1 << 16), "llm: current tokens (the causal queries)", 32),
    "heads": Key(("range", int, 1, 256), "query heads H", 4),
    "kv_heads": Key(("range", int, 1, 256), "video: KV heads", 4),
    "llm_kv_heads": Key(("range", int, 1, 256), "llm: KV heads", 2),
    "head_dim": Key(("range", int, 2, 4096), "head dimension D (channel 0 carries the sink bonus; with current_logits, "
                    "channel 1 the current one)", 32),
    "concentrations": Key(("list", ("range", float, 0.0, 1000.0), 1),
                          "per-head concentration kappa (cycled over heads): large is sharp, small near uniform",
                          list(DEFAULT_CONCENTRATIONS)),
    "rho": Key(("range", float, 0.0, 1.0), "video: AR(1) correlation of content between frames", 0.8),
    "llm_rho": Key(("range", float, 0.0, 1.0), "llm: AR(1) correlation between tokens", 0.95),
    "noise": Key(("range", float, 0.0, 100.0), "per-token content noise", 0.5),
    "query_noise": Key(("range", float, 0.0, 100.0), "noise added to each query's content", 0.3),
    "sink_logit": Key(("range", float, 0.0, 100.0), "video: content-free logit bonus of the sink keys", 1.0),
    "sink_logits": Key(list, "video: per query head, the sink keys' logit bonus in place of sink_logit (numbers 0 to "
                       "100, repeats allowed; empty: sink_logit for every head)", []),
    "current_logits": Key(list, "video: per query head, a content-free logit bonus of the current chunk's keys through "
                          "reserved channel 1 (numbers -100 to 100, repeats allowed; empty: none, and channel 1 "
                          "carries content)", []),
    "llm_sink_logit": Key(("range", float, 0.0, 100.0), "llm: logit bonus of the sink tokens", 3.0),
}, rules=("heads is a multiple of kv_heads and of llm_kv_heads",
          "sink_logits and current_logits are each empty or one number per query head (heads); current_logits "
          "need head_dim >= 3",
          "video: chunk * current_frames - recent_frames >= sink_frames for every chunk (recent frames do not "
          "overlap the sink)"))


def validate(params: dict, where: str) -> dict:
    p = SPEC.check(params, where)
    for key in ("kv_heads", "llm_kv_heads"):
        if p["heads"] % p[key]:
            raise ProtocolError(f"{where}.{key}: {p['heads']} heads are not a multiple of {p[key]}")
    for key, lo, hi in (("sink_logits", 0.0, 100.0), ("current_logits", -100.0, 100.0)):
        vals = p[key]
        for i, x in enumerate(vals):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise ProtocolError(f"{where}.{key}[{i}]: expected a number, got {type(x).__name__} {x!r}")
            if not lo <= x <= hi:
                raise ProtocolError(f"{where}.{key}[{i}]: {x!r} is outside [{lo}, {hi}]")
        if vals and len(vals) != p["heads"]:
            raise ProtocolError(f"{where}.{key}: {len(vals)} values for {p['heads']} heads (give none or one per query head)")
    if p["current_logits"] and p["head_dim"] < 3:
        raise ProtocolError(f"{where}.head_dim: current_logits need head_dim >= 3 (two reserved channels), got {p['head_dim']}")
    if "video" in p["layouts"]:
        for i, c in enumerate(p["chunks"]):
            if c * p["current_frames"] - p["recent_frames"] < p["sink_frames"]:
                raise ProtocolError(f"{where}.chunks[{i}]: chunk {c} puts the recent frames over the sink frames")
    return p


UNIT = "case"  # what one unit of this source is, in progress lines


def units(params: dict) -> list[dict]:
    """One unit per case, in the order `cases` makes them (what a Ray task runs)."""
    out = []
    for seed in params["seeds"]:
        for layout in params["layouts"]:
            for chunk in (params["chunks"] if layout == "video" else [None]):
                out.append({**params, "seeds": [seed], "layouts": [layout],
                            "chunks": [chunk] if chunk is not None else params["chunks"]})
    return out


def estimate_bytes(params: dict, p_payload: bool = True) -> int:
    """Peak bytes of the largest Case (the memory guard's hook): the analysis chain of the largest
    video and LLM case, plus the float32 content the video generator makes for every frame up to
    the chunk's end (three copies: content, noise and their sum)."""
    best = 0
    h, d, tpf = params["heads"], params["head_dim"], params["tokens_per_frame"]
    if "video" in params["layouts"]:
        keys = (params["sink_frames"] + params["recent_frames"] + params["current_frames"]) * tpf
        frames = (max(params["chunks"]) + 1) * params["current_frames"]
        content = 3 * params["kv_heads"] * frames * tpf * d * 4
        best = attention_chain_bytes(h, params["kv_heads"], params["current_frames"] * tpf, keys, d,
                                     p_payload=p_payload) + content
    if "llm" in params["layouts"]:
        keys = params["llm_sink"] + params["llm_middle"] + params["llm_recent"] + params["llm_current"]
        best = max(best, attention_chain_bytes(h, params["llm_kv_heads"], params["llm_current"], keys, d,
                                               p_payload=p_payload))
    return int(best)


def cases(params: dict, ctx=None) -> Iterator[Case]:
    common = dict(heads=params["heads"], head_dim=params["head_dim"], concentrations=params["concentrations"],
                  noise=params["noise"], query_noise=params["query_noise"])
    for seed in params["seeds"]:
        for layout in params["layouts"]:
            if layout == "video":
                for chunk in params["chunks"]:
                    yield make_video_case(seed, chunk, tokens_per_frame=params["tokens_per_frame"],
                                          sink_frames=params["sink_frames"], recent_frames=params["recent_frames"],
                                          current_frames=params["current_frames"], kv_heads=params["kv_heads"],
                                          rho=params["rho"], sink_logit=params["sink_logit"],
                                          sink_logits=params.get("sink_logits", []),
                                          current_logits=params.get("current_logits", []), **common)
            else:
                yield make_llm_case(seed, sink=params["llm_sink"], middle=params["llm_middle"],
                                    recent=params["llm_recent"], current=params["llm_current"],
                                    kv_heads=params["llm_kv_heads"], rho=params["llm_rho"],
                                    sink_logit=params["llm_sink_logit"], **common)
