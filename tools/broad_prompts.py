"""Write the prompts of protocols/smollm2_broad.json from Python's pydoc_data.topics.

The broad real-model study needs many independent prompts without a download. This picks help
topics of the standard library's ``pydoc_data.topics`` in name order, each at least ``--chars``
characters long, skipping a topic whose opening shares any run of ``--shared`` characters with a
topic already taken (several topics quote each other: the compound statements and try, the special
method names and customization), until ``--count`` are taken; each prompt is the topic's first
``--chars`` characters. The texts are written into the protocol, so the study does not depend on
the Python version that runs it.

    python tools/broad_prompts.py protocols/smollm2_broad.json   # rewrites source.prompts in place
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _shingles(text: str, width: int) -> set:
    return {text[i:i + width] for i in range(0, max(1, len(text) - width + 1))}


def pick(count: int, chars: int, shared: int) -> list[dict]:
    from pydoc_data import topics

    taken, seen = [], set()
    for name in sorted(topics.topics):
        text = topics.topics[name]
        if len(text) < chars:
            continue
        head = text[:chars]
        sh = _shingles(head, shared)
        if sh & seen:
            continue
        seen |= sh
        pid = "pydoc_" + "".join(c if c.isalnum() else "_" for c in name)
        taken.append({"id": pid, "kind": f"pydoc topic '{name}'", "text": head})
        if len(taken) == count:
            return taken
    raise SystemExit(f"only {len(taken)} topics of at least {chars} characters share no {shared}-character run; "
                     f"{count} were asked for")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("protocol", type=Path, help="protocol JSON whose source.prompts is rewritten")
    ap.add_argument("--count", type=int, default=16, help="prompts to take (default 16)")
    ap.add_argument("--chars", type=int, default=3500, help="characters per prompt (default 3500)")
    ap.add_argument("--shared", type=int, default=120, help="no two prompts share a run this long (default 120)")
    a = ap.parse_args(argv)
    proto = json.loads(a.protocol.read_text(encoding="utf-8"))
    proto["source"]["prompts"] = pick(a.count, a.chars, a.shared)
    tmp = a.protocol.with_suffix(".tmp")
    tmp.write_text(json.dumps(proto, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(a.protocol)
    print(f"{a.protocol}: {len(proto['source']['prompts'])} prompts: "
          + ", ".join(p["id"] for p in proto["source"]["prompts"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
