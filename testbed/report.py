"""report.md: one section per study, one table set per analysis, built from the result rows."""

from __future__ import annotations

from . import live, retrieval_study
from .analyses import ANALYSES

__all__ = ["build_report"]


def build_report(protocols: list[dict], rows: list[dict], manifest: dict, timings: list | None = None) -> str:
    lines = ["# testbed run report", ""]
    env = manifest.get("environment", {})
    lines.append(f"Created {manifest.get('created_utc')} with python {env.get('python')}, torch {env.get('torch')}, "
                 f"numpy {env.get('numpy')} on {env.get('cpu')}. Rows: {len(rows)}. "
                 "Every number below is re-derived from the stored arrays by `python -m testbed.audit`.")
    lines.append("")
    lines.append("Rows inside one seed or prompt are not independent experiments; tables give means or medians "
                 "over inputs, not confidence intervals over rows.")
    if manifest.get("excluded"):
        lines.append("")
        lines.append("Excluded (not counted as results):")
        for e in manifest["excluded"]:
            lines.append(f"- `{e.get('id')}` at stage `{e.get('stage')}`: {e.get('error')}")
    for proto in protocols:
        study = proto["name"]
        lines += ["", f"## {study}", ""]
        if proto.get("description"):
            lines += [proto["description"], ""]
        if proto.get("kind") == "live":
            sel = [r for r in rows if r["study"] == study]
            lines += ["### live_quality", "", live.report(sel, proto["live"], timings), ""]
            continue
        if proto.get("kind") == "retrieval":
            sel = [r for r in rows if r["study"] == study]
            lines += ["### retrieval", "", retrieval_study.report(sel, proto["retrieval"]), ""]
            continue
        for name, params in proto["analyses"].items():
            sel = [r for r in rows if r["study"] == study and r["analysis"] == name]
            lines += [f"### {name}", ""]
            if not sel:
                lines += ["(no rows)", ""]
                continue
            lines += [ANALYSES[name].report(sel, params), ""]
    return "\n".join(lines).rstrip() + "\n"
