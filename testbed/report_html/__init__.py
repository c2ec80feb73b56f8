"""report.html: the run's figures, one self-contained file (inline PNGs, no script, no outside request).

Each figure is drawn from a *figure data* object computed here from the result rows (and the
arrays they name, already stored in the run): the same object is embedded beside the image as a
JSON data block (``<script type="application/json" id="figdata-N">``, which a browser never
executes), so that ``testbed.audit`` can recompute it from ``results.json`` with its own code and
compare (``testbed/audit_checks/report_html.py``). Units of every statistic are seeds, prompts or
segments (a case's rows are summarized first); row-level curves (ECDFs) say so in their caption.

matplotlib (Agg) is imported only when a report is built.

The package, by responsibility: :mod:`~testbed.report_html.data` (each figure's data from the rows
and arrays, what the audit recomputes: `figure_data`), :mod:`~testbed.report_html.draw` (matplotlib
drawing of a figure's data, `figure_layout` for the readability tests) and
:mod:`~testbed.report_html.page` (captions, PNG encoding, the per-arm table under a live figure, printed
from its data, and the page, `build_html`). The names other
modules use are re-exported here (``from testbed.report_html import build_html``).
"""

from .data import AGREEMENT_BLOCK, REGIONS, UNIFORM_REFERENCES, figure_data, is_oracle, policy_family
from .draw import DPI, MIN_TEXT_PX, PAGE_PX, figure_layout
from .page import CSP, build_html

__all__ = ["build_html", "figure_data", "figure_layout", "CSP", "AGREEMENT_BLOCK", "REGIONS", "UNIFORM_REFERENCES",
           "is_oracle", "policy_family", "PAGE_PX", "DPI", "MIN_TEXT_PX"]
