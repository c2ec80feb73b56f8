"""Independent re-derivation of result rows, one module per analysis.

Like :mod:`testbed.audit`, these modules import only the standard library and numpy (never the
testbed's quantizers, attention or metrics): they decode the stored packed arrays with their own
code and recompute every reported number in float64. ``CHECKS`` maps an analysis name to a
function ``check(row, ctx) -> None`` that reports problems through ``ctx.fail``; ``RUN_CHECKS``
maps a file of the run to a function ``check(ctx) -> None`` run once all rows are checked (for
``results.json``: completeness, exactly the cases and rows the frozen protocols produce; for the
capture manifests: provenance, the model's identity, gates, token ids and case metadata; for
``report.md``: every table cell and every run-derived number of its prose re-derived from the rows).
"""

from . import (ablation_audit, capture, completeness, live_quality, mx_paths, observation, report_html, report_md,
               residual_window, retrieval, selective)

CHECKS = {"residual_window": residual_window.check, "mx_paths": mx_paths.check, "ablation": ablation_audit.check,
          "observation": observation.check, "live_quality": live_quality.check,
          "retrieval": retrieval.check, "selective": selective.check}

RUN_CHECKS = {"report.html": report_html.check_run, "report.md": report_md.check_run,
              "results.json": completeness.check_run, "capture_manifest.json": capture.check_run}

__all__ = ["CHECKS", "RUN_CHECKS"]
