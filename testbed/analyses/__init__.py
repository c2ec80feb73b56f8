"""Analyses run on every `Case` of a protocol. Each module has ``validate(params, where)``,
``evaluate(case, params, ctx) -> rows`` and ``report(rows, params) -> markdown``."""

from . import residual_window

ANALYSES = {"residual_window": residual_window}

__all__ = ["ANALYSES"]
