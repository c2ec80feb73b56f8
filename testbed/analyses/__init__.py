"""Analyses run on every `Case` of a protocol. Each module has ``validate(params, where)``,
``evaluate(case, params, ctx) -> rows`` and ``report(rows, params) -> markdown``."""

from . import ablation_analysis, mx_paths, observation, residual_window, selective

ANALYSES = {"residual_window": residual_window, "mx_paths": mx_paths, "ablation": ablation_analysis,
            "observation": observation, "selective": selective}

__all__ = ["ANALYSES"]
