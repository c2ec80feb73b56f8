"""Decode-step time of testbed's live cache policies against transformers' caches, in one process.

    python benchmarks/bench_live.py                       # contexts 256 1024 2048, batch 1, 2 threads
    python benchmarks/bench_live.py --contexts 256 4096 --steps 8 --threads 2
    python benchmarks/bench_live.py --contexts 256 1024 2048 4096 8064 --steps 6 --repeats 2 --warmup 2 --threads 2
    python benchmarks/bench_live.py --throughput          # the study's scored tokens per second

For each context C: the model (SmolLM2-135M-Instruct, the Q4_1 GGUF dequantized to float32) reads a
C-token prefill of the built-in corpus once; each cache is filled with those post-RoPE K/V through
its own ``update`` (so it packs, evicts or quantizes them as a prefill would), then runs one-token
decode steps; the time
of a step is the median over ``--steps`` steps after ``--warmup`` untimed ones and over
``--repeats`` repeats (fresh caches each), every arm on the same tokens; the arms are interleaved
step by step (each step in a fresh shuffled order), so that drift of the machine and bursts of other
load spread over all of them. Arms: ``DynamicCache`` (float32, the reference), transformers' ``QuantizedCache``
(quanto) at 4 and 2 bits (groups of 64, residual 128; its CPU extension is compiled and warmed up
before anything is timed), and testbed policies (KIVI-style int4 / int2 with R = 128, G = 32;
MXFP8; StreamingLLM eviction sink 4 + window 256), whose step decodes the packed history, and the
int policies again with ``direct`` attention, which reads the packed history from its codes
(testbed.policies.packed_attention: one numba kernel call per layer over the codes and the float
keys).

Also printed: the bytes of tensors each cache object holds against its accounted bytes (testbed
policies: their byte accounting; the others: what they hold is what they are charged). Ratios
are against DynamicCache and against quanto at the same bits; figures go to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.live import dynamic_bytes, warm_quanto, corpus_text, quanto_bytes  # noqa: E402
from testbed.policies import preset  # noqa: E402
from testbed.sources.models import forward_kwargs, load_model  # noqa: E402


def _held_bytes(cache) -> int:
    """Every tensor the policy cache object holds, per sequence (batch 1)."""
    total = 0
    for layer in cache.layers:
        for x in (layer.sink_k, layer.sink_v, layer.tail_k, layer.tail_v):
            total += x.numel() * x.element_size()
        for span in (layer.mid_k, layer.mid_v):
            if span is not None:
                total += sum(x.numel() * x.element_size() for b in span.buffers.values() for x in [b.view()] if x is not None)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--steps", type=int, default=6, help="timed one-token steps per arm and repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--throughput", action="store_true",
                    help="instead: teacher forcing of 256 steps after a 256-token prefill (int4, R 128, G 32), one "
                         "token per forward at batch 1 against chunked at batch 1 and 4, ms per scored token")
    args = ap.parse_args(argv)
    top = 8192 - args.warmup - args.steps - 1  # SmolLM2's max_position_embeddings
    if any(not 16 <= c <= top for c in args.contexts) or args.steps < 1 or args.repeats < 1:
        ap.error(f"contexts must be in [16, {top}] (8192 positions less warm-up and steps); steps and repeats at least 1")
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache, QuantizedCache

    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    model, tok, _ = load_model(progress=lambda m: print(m, file=sys.stderr))
    kw = forward_kwargs(model)
    cfg = model.config
    text, _ = corpus_text({"builtin": "pydoc_topics"})
    ids = tok(text, return_tensors="pt").input_ids[:, : max(args.contexts) + args.warmup + args.steps + 1]
    if args.throughput:
        return _throughput(model, kw, ids if ids.shape[1] >= 513 else tok(text, return_tensors="pt").input_ids)
    warm_quanto(model, kw, cfg)
    policies = [preset(n, window=128, group=32, evict_window=256, sink=4) for n in ("int4", "int2", "mxfp8", "streaming")]
    arms = {"DynamicCache": (lambda: DynamicCache(config=cfg), dynamic_bytes),
            "quanto int4": (lambda: QuantizedCache("quanto", cfg, nbits=4, q_group_size=64, residual_length=128), quanto_bytes),
            "quanto int2": (lambda: QuantizedCache("quanto", cfg, nbits=2, q_group_size=64, residual_length=128), quanto_bytes)}
    for p in policies:
        arms[f"testbed {p.name}"] = ((lambda p=p: PolicyCache(p, cfg.num_hidden_layers)), (lambda c: c.stored_bytes()))
        if p.name in ("int4", "int2"):
            arms[f"testbed {p.name} direct"] = ((lambda p=p: PolicyCache(p, cfg.num_hidden_layers, direct=True)),
                                                (lambda c: c.stored_bytes()))
    rng = random.Random(0)
    print(f"# bench_live: SmolLM2-135M float32, batch 1, {args.threads} threads, median of {args.steps} steps x "
          f"{args.repeats} repeats after {args.warmup} warm-up steps")
    for ctx_len in args.contexts:
        times = {a: [] for a in arms}
        held = {}
        # one prefill; every cache is then filled with its post-RoPE K/V through its own update()
        ref = DynamicCache(config=cfg)
        with torch.no_grad():
            model(input_ids=ids[:, :ctx_len], use_cache=True, logits_to_keep=1, **{kw["cache"]: ref})
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in ref.layers]
        del ref
        for _ in range(args.repeats):
            order = list(arms)
            rng.shuffle(order)
            caches = {}
            with torch.no_grad(), policy_attention(model):
                for arm in order:
                    caches[arm] = arms[arm][0]()
                    for i, (k, v) in enumerate(kv):
                        caches[arm].update(k.clone(), v.clone(), i)
                # step by step: every arm takes its i-th step before any takes its (i+1)-th, in a
                # fresh shuffled order, so a burst of other load on the machine hits all arms alike
                for i in range(args.warmup + args.steps):
                    rng.shuffle(order)
                    pos = ctx_len + i
                    for arm in order:
                        t0 = time.perf_counter()
                        model(input_ids=ids[:, pos:pos + 1], use_cache=True, logits_to_keep=1,
                              **{kw["cache"]: caches[arm]})
                        dt = time.perf_counter() - t0
                        if i >= args.warmup:
                            times[arm].append(dt)
            for arm, cache in caches.items():
                accounted = arms[arm][1]
                held[arm] = (_held_bytes(cache) if arm.startswith("testbed") else accounted(cache), accounted(cache))
            del caches
        med = {a: statistics.median(t) for a, t in times.items()}
        print(f"\n## context {ctx_len}\n")
        print("| arm | step (ms) | × DynamicCache | × quanto same bits | tensor bytes held (MB) | accounted (MB) |")
        print("|---|---|---|---|---|---|")
        for arm, m in med.items():
            bits = "int4" if "int4" in arm else "int2" if "int2" in arm else None
            peer = f"{med[f'quanto {bits}'] and m / med[f'quanto {bits}']:.2f}" if bits and not arm.startswith("quanto") else "—"
            h, acc = held[arm]
            print(f"| {arm} | {1000 * m:.1f} | {m / med['DynamicCache']:.2f} | {peer} | {h / 1e6:.2f} | {acc / 1e6:.2f} |")
    return 0


def _throughput(model, kw, ids) -> int:
    from testbed.live import chunk_schedule
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    pol = preset("int4", window=128, group=32)
    seg = ids[:, 1000:1000 + 513]

    def run(chunks, b):
        x = seg.repeat(b, 1)
        cache = PolicyCache(pol, model.config.num_hidden_layers)
        with torch.no_grad(), policy_attention(model):
            model(input_ids=x[:, :256], use_cache=True, logits_to_keep=1, **{kw["cache"]: cache})
            t0, pos = time.perf_counter(), 256
            for c in chunks:  # every position's logits, as the study scores them
                model(input_ids=x[:, pos:pos + c], use_cache=True, **{kw["cache"]: cache})
                pos += c
            return time.perf_counter() - t0

    sched = chunk_schedule(pol, 256, 256, "chunked", 256)
    step, ch1, ch4 = run([1] * 256, 1), run(sched, 1), run(sched, 4)
    print(f"# teacher forcing, int4 R=128 G=32, 256 steps after 256 tokens ({len(sched)} chunked forwards)")
    print(f"one token per forward, batch 1: {1000 * step / 256:.1f} ms per scored token")
    print(f"chunked, batch 1: {1000 * ch1 / 256:.1f} ms ({step / ch1:.1f} x)")
    print(f"chunked, batch 4: {1000 * ch4 / 1024:.1f} ms ({step / (ch4 / 4):.1f} x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
