"""The live study's corpus (the built-in pydoc topics or the protocol's text files) and the
disjoint segments cut from its token stream."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from ..schema import ProtocolError


def corpus_text(corpus: dict, base: Path | None = None) -> tuple[str, dict]:
    """The corpus as one string, and what it is (name, characters, sha256 of the UTF-8 text)."""
    if corpus.get("builtin") == "pydoc_topics":
        from pydoc_data import topics

        text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
        name = f"pydoc_data.topics of Python {sys.version.split()[0]} ({len(topics.topics)} topics in name order)"
    else:
        parts = []
        for f in corpus["files"]:
            path = Path(f)
            if not path.is_absolute() and base is not None:
                path = base / path
            try:
                parts.append(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                raise ProtocolError(f"corpus file {f}: cannot be read as UTF-8 text ({e})") from None
        text = "\n\n".join(parts)
        name = "files: " + ", ".join(corpus["files"])
    return text, {"corpus": name, "characters": len(text),
                  "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def segment_stride(n_tokens: int, segments: int) -> int:
    """Tokens from one segment's start to the next's: the segments are evenly spaced over the stream."""
    return n_tokens // segments


def segment_starts(n_tokens: int, segments: int, length: int) -> list[int]:
    """Disjoint windows of ``length`` tokens, evenly spaced over ``n_tokens``."""
    stride = segment_stride(n_tokens, segments)
    if stride < length:
        raise ProtocolError(f"the corpus has {n_tokens} tokens: {segments} disjoint segments of {length} tokens "
                            f"need {segments * length}")
    return [i * stride for i in range(segments)]
