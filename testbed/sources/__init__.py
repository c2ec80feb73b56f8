"""Sources of `Case`s. Each source module has ``validate(params, where)`` and ``cases(params, ctx)``.

Heavy dependencies (transformers for capture) are imported inside the functions that need them,
so a protocol that does not use a source never pays for it.
"""

from . import capture, synthetic, traces, video

SOURCES = {"synthetic": synthetic, "capture": capture, "trace": traces, "synthetic_video": video}

__all__ = ["SOURCES"]
