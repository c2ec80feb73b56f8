"""report.html's live figure in bits per element and the per-arm table under it (issue 46): the bits
from the model's dimensions, Δ's interval as report.md's, the table sorted and escaped, the audit's
own page equal to the builder's, and a forged cell, row order or embedded interval failing. The same
forgery on a finished live run is tests/test_report_html.py's ``test_live_table_cell_changed``."""

from __future__ import annotations

import json
import struct
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest

from testbed import report_html as rh
from testbed.audit_checks import report_html as audit_side
from testbed.audit_checks import report_html_figures as audit_figures
from testbed.live.summary import summarize
from testbed.report_html import page as rh_page
from tests.test_equal_bytes_figure import _Ctx, load, made_up_rows
from tests.test_report_html import unreadable

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1"
# SmolLM2-135M's model card (config.json): 30 layers, 3 key-value heads, head dimension 576 / 9 = 64
SMOL_ELEMENTS = 2 * 30 * 3 * 64  # K and V elements one token adds to the cache
ARMS = ["int4", "int2", "float32", "mix24_random", "mix28_diffuse"]


def live_rows(segments=8, contexts=("",), model=SMOLLM2, dims=None, arms=ARMS):
    """made_up_rows with a model, its dimensions where given, and a top-1 agreement per row."""
    rows = made_up_rows(arms, segments=segments, contexts=contexts)
    for i, r in enumerate(rows):
        r["model"] = model
        r["top1_agreement"] = 1.0 if r["kind"] == "reference" else 0.5 + (i % 7) / 20
        r.update(mode="chunked", forwards=2, context_final=2048)  # what report.md's summary reads too
        if dims is not None:
            r["model_dims"] = dims
    return rows


def live_data(rows):
    return next(d for d in rh.figure_data(rows, load) if d["kind"] == "live_quality")


class _Table(HTMLParser):
    """The rows of every <table> of a page, as cell texts (what a reader sees, entities decoded)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows, self.caption, self._cell, self._in_caption = [], [], None, False

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "caption":
            self._in_caption = True

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "caption":
            self._in_caption = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        elif self._in_caption:
            self.caption.append(data)


def table_of(lines) -> _Table:
    t = _Table()
    t.feed("\n".join(lines))
    return t


def test_bits_per_element_are_the_bytes_over_the_models_kv_elements():
    """SmolLM2 (named): 11,520 K and V elements per token, so the float32 DynamicCache's 46,080 B is
    32 bits; a model given by path: its rows' model_dims; no dimensions at all: no bits, no top axis."""
    d = live_data(live_rows())
    assert d["dims"] == {"layers": 30, "kv_heads": 3, "head_dim": 64}
    for e in d["arms"]:
        assert e["bits_per_element"] == pytest.approx(8 * e["bytes_per_token"] / SMOL_ELEMENTS, rel=1e-8)
    ref = next(e for e in d["arms"] if e["arm"] == "dynamic_cache")
    assert ref["bits_per_element"] == pytest.approx(32.0, rel=1e-9)
    assert "× 30 layers × 3 KV heads × 64 head dim = 11,520 K and V elements" in rh_page._caption(d)
    gemma_like = {"layers": 18, "kv_heads": 1, "head_dim": 256, "vocab": 10}
    d = live_data(live_rows(model="models/mine", dims=gemma_like))
    assert d["dims"] == {"layers": 18, "kv_heads": 1, "head_dim": 256}
    assert d["arms"][0]["bits_per_element"] == pytest.approx(8 * 46080 / (2 * 18 * 256))
    d = live_data(live_rows(model="models/mine"))
    assert d["dims"] is None and {e["bits_per_element"] for e in d["arms"]} == {None}
    assert "bits per element" not in rh_page._caption(d)
    assert {row[2] for row in table_of(rh_page._table(1, d)).rows[1:]} == {"—"}


def _own_bootstrap(x, n=2000, seed=0):
    """The caption's definition: 2,000 resamples of the segments with replacement on numpy's
    default_rng(0), the 2.5 and 97.5 percentiles of the resampled means."""
    rng = np.random.default_rng(seed)
    means = [x[rng.integers(0, x.size, size=x.size)].mean() for _ in range(n)]
    return np.percentile(means, 2.5), np.percentile(means, 97.5)


def test_delta_interval_is_report_mds_and_the_documented_bootstrap():
    rows = live_rows()
    d = live_data(rows)
    md = {e["arm"]: e for e in summarize(rows)}
    ref = {r["case"]: r["nll"] for r in rows if r["arm"] == "dynamic_cache"}
    for e in d["arms"]:
        if e["arm"] == "dynamic_cache":
            assert e["delta_pct"] is None and e["delta_ci"] is None
            continue
        assert e["delta_ci"] == pytest.approx(list(md[e["arm"]]["delta_ci"]), rel=1e-8)  # report.md's numbers
        diffs = np.array(sorted((r["case"], r["nll"] - ref[r["case"]]) for r in rows if r["arm"] == e["arm"]),
                         dtype=object)[:, 1].astype(float)
        lo, hi = _own_bootstrap(diffs)
        assert e["delta_ci"] == pytest.approx([100 * np.expm1(lo), 100 * np.expm1(hi)], rel=1e-8)
        assert e["delta_ci"][0] <= e["delta_pct"] <= e["delta_ci"][1]
        own_top1 = np.mean([r["top1_agreement"] for r in rows if r["arm"] == e["arm"]])
        assert e["top1"] == pytest.approx(own_top1)
    few = live_data(live_rows(segments=4))  # below 5 segments: no interval, a dash in the table
    assert {e["delta_ci"] is None for e in few["arms"]} == {True}
    assert {row[4] for row in table_of(rh_page._table(1, few)).rows[1:]} == {"—"}


def test_the_table_is_sorted_by_bits_escaped_and_reads_the_figures_numbers():
    rows = live_rows()
    for r in rows:  # an arm name a page must escape
        if r["arm"] == "int2":
            r["arm"] = "int2<b>&"
    d = live_data(rows)
    lines = rh_page._table(1, d)
    assert not any("<b>&" in line for line in lines[2:])  # markup only in the caption
    t = table_of(lines)
    head, body = t.rows[0], t.rows[1:]
    assert head == ["arm", "bytes / token", "bits / element", "Δ ppl vs reference", "95 % CI (segments)", "mean KL",
                    "top-1 agree"]
    bits = [float(row[2]) for row in body]
    assert bits == sorted(bits) and len(body) == len(d["arms"])
    assert body[0][0] == "int2<b>&" and body[-1][0] in ("dynamic_cache", "float32")
    ref = {r["case"]: r["nll"] for r in rows if r["arm"] == "dynamic_cache"}
    for row in body:
        sel = [r for r in rows if r["arm"] == row[0]]
        bpt = np.mean([r["bytes_per_token"] for r in sel])
        assert row[1] == f"{bpt:,.0f}" and float(row[2]) == pytest.approx(8 * bpt / SMOL_ELEMENTS, abs=5e-4)
        assert float(row[5]) == pytest.approx(np.mean([r["mean_kl"] for r in sel]), abs=5e-6)
        assert float(row[6].rstrip(" %")) == pytest.approx(100 * np.mean([r["top1_agreement"] for r in sel]), abs=5e-3)
        if row[0] != "dynamic_cache":
            delta = 100 * np.expm1(np.mean([r["nll"] - ref[r["case"]] for r in sel]))
            assert float(row[3].rstrip(" %")) == pytest.approx(delta, abs=5e-3)
            lo, hi = (float(x) for x in row[4].strip("[]").split(", "))
            assert lo <= float(row[3].rstrip(" %")) <= hi
    assert "sorted by bits per element (" in "".join(t.caption)


def test_contexts_keep_their_own_order_within_the_table():
    d = live_data(live_rows(contexts=("c96", "c160")))
    t = table_of(rh_page._table(1, d))
    names = [row[0] for row in t.rows[1:]]
    assert [n.rpartition(" @ ")[2] for n in names] == ["96"] * 6 + ["160"] * 6
    for ctx in ("96", "160"):
        bits = [float(row[2]) for row in t.rows[1:] if row[0].endswith(f" @ {ctx}")]
        assert bits == sorted(bits)
    assert "sorted by bits per element within each context" in "".join(t.caption)


def test_the_top_axis_reads_bits_where_the_bottom_reads_bytes():
    """Each tick of the bits axis sits where the bytes axis has bits x 11,520 / 8 bytes (32 bits at
    the reference's 46,080); the figure reads at page width with the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from testbed.report_html.draw import RC, draw_figure

    d = live_data(live_rows())
    with matplotlib.rc_context(RC):
        fig = draw_figure(plt, d)
        fig.canvas.draw()
        for ax in fig.axes[:2]:
            (top,) = ax.child_axes
            lo, hi = sorted(ax.get_xlim())
            ticks = [t for t in top.get_xticks() if lo <= t * SMOL_ELEMENTS / 8 <= hi]
            assert len(ticks) >= 2 and 32 in ticks
            for t in ticks:
                x_top = top.transData.transform((t, 0))[0]
                x_bytes = ax.transData.transform((t * SMOL_ELEMENTS / 8, 1))[0]
                assert x_top == pytest.approx(x_bytes, abs=0.5)
            assert "bits per element" in top.get_xlabel()
        plt.close(fig)
    assert unreadable(rh.figure_layout(d), 1120) == []


# -- the audit: its own page against the builder's, and forgeries ------------------------------

def _tiny_png(plt, d) -> bytes:
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x00")) + chunk(b"IEND", b""))


class _AuditCtx(_Ctx):
    """What audit_checks.report_html.check_run reads of an audit: the manifest, report.html's bytes,
    the rows, the protocol copies; FAIL lines collected."""

    def __init__(self, rows, text):
        self.manifest = {"files": {"report.html": "sha"}}
        self.results = {"rows": rows}
        self.protocol_copies = {"q": {"description": "made-up rows & <words>"}}
        self.text, self.failures, self.numbers = text, [], 0

    def read_bytes(self, rel):
        return self.text.encode("utf-8")

    def fail(self, where, message):
        self.failures.append(f"{where}: {message}")


@pytest.fixture(scope="module", params=[("",), ("c96", "c160")], ids=["one context", "two contexts"])
def built(request):
    rows = live_rows(contexts=request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rh_page, "_png", _tiny_png)  # the audit reads the data and the words, not pixels
        mp.setattr(rh_page, "load_array", lambda root, rel: load(rel))
        text = rh.build_html([{"name": "q", "description": "made-up rows & <words>"}], rows, None)
    return rows, text


def audit_failures(rows, text):
    ctx = _AuditCtx(rows, text)
    audit_side.check_run(ctx)
    return ctx.failures


def test_the_audit_writes_the_builders_table(built):
    rows, text = built
    assert '<table id="table-1" data-key="live_quality/q">' in text
    assert audit_failures(rows, text) == []
    derived = audit_figures.derive_figures(rows, _Ctx())["live_quality/q"]
    assert [line for _, line in audit_side.table_lines(1, derived)] == rh_page._table(1, live_data(rows))


def test_a_forged_table_cell_fails_naming_its_row(built):
    rows, text = built
    m = next(line for line in text.split("\n") if line.startswith("<tr><th>int4"))
    delta = m.split("<td>")[3].split("</td>")[0]  # the Δ cell, "-0.15 %"
    forged = m.replace(f"<td>{delta}</td>", f"<td>{float(delta.rstrip(' %')) + 10:+.2f} %</td>", 1)
    assert forged != m
    failures = audit_failures(rows, text.replace(m, forged, 1))
    arm = m[len("<tr><th>"):m.index("</th>")]
    assert len(failures) == 1 and f"table 1 (live_quality/q) row {arm!r}" in failures[0], failures
    assert "words differ" in failures[0] and f"call for {delta.split(' ')[0]!r}" in failures[0]


def test_two_table_rows_swapped_fail(built):
    rows, text = built
    lines = text.split("\n")
    i = next(k for k, line in enumerate(lines) if line.startswith("<tr><th>int2"))
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    failures = audit_failures(rows, "\n".join(lines))  # a line moved: one missing where it belongs
    assert any(f"table 1 (live_quality/q) row {lines[i + 1][8:lines[i + 1].index('</th>')]!r}: missing" in f
               for f in failures), failures


def test_a_forged_interval_in_the_data_block_fails(built):
    """A data block whose interval was widened (its table left alone): the data check names the field."""
    rows, text = built
    start = text.index('id="figdata-1">') + len('id="figdata-1">')
    block = text[start:text.index("</script>", start)]
    data = json.loads(block)
    e = next(e for e in data["arms"] if e["delta_ci"])
    i = data["arms"].index(e)
    e["delta_ci"][1] *= 2
    failures = audit_failures(rows, text.replace(block, rh_page._json_block(data), 1))
    assert any(f"arms[{i}].delta_ci[1]" in f and "plotted data differs" in f for f in failures), failures


def test_the_audits_static_text_is_the_builders():
    assert audit_side.BITS_AXIS == rh_page._BITS_AXIS
    assert audit_side.TABLE_CAPTION == rh_page._TABLE_CAPTION
    assert audit_side.TABLE_HEADERS == rh_page._TABLE_HEADERS
