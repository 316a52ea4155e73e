"""A checkpoint diff as one self-contained HTML page: inline CSS, inline SVG charts and a small sorting script.

The page loads nothing from anywhere. Every string of the document is escaped (tensor names come from the
checkpoints, so they are attacker-controlled), and a Content-Security-Policy pins the one script by its hash:
even a missed escape could not run code.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from typing import Any, Final

__all__ = ["render_html"]

_SYMBOLS: Final = {"changed": "~", "unchanged": "=", "added": "+", "removed": "-", "shape_changed": "!"}
_SEVERITIES: Final = ("critical", "warning", "info")
_NAMES_SHOWN: Final = 5
_NO_DATA: Final = '<p class="muted no-data">no data</p>'
_DEPTH_POINTS: Final = 512  # per stack: an SVG of thousands of marks is slow and no more readable
_W: Final = 760  # chart width; heights follow the content
_PLOT_LEFT, _PLOT_RIGHT, _PLOT_TOP, _PLOT_HEIGHT = 64, 744, 12, 150

# (key, label, kind, title): the key is what #sort=<key> names; "num" columns sort on data-value, nulls last.
_COLUMNS: Final = (
    ("status", "", "text", "status: ~ changed, = unchanged, + added, - removed, ! shape changed"),
    ("name", "tensor", "text", ""),
    ("layer_type", "layer type", "text", ""),
    ("shape", "shape", "num", "sorts by parameter count"),
    ("dtype", "dtype", "text", ""),
    ("mean", "mean a → b", "num", "sorts by |mean b − mean a|"),
    ("std", "std a → b", "num", "sorts by |std b − std a|"),
    ("l2", "L2", "num", "L2 norm of b − a"),
    ("max_abs", "max abs", "num", "largest |b − a|"),
    ("cosine", "cosine", "num", "cosine similarity of a and b"),
    ("relative_change", "rel. change", "num", "‖b − a‖ / ‖a‖"),
    ("fraction_changed", "changed", "num", "fraction of elements that changed"),
    ("nan", "NaN a/b", "num", "NaN count in a / in b"),
)

_CSS: Final = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d8dee4;--bg:#fff;--panel:#f6f8fa;--red:#cf222e;--green:#1a7f37;
--amber:#9a6700;--blue:#0969da;--purple:#8250df}
*{box-sizing:border-box}
body{margin:0 auto;max-width:1600px;padding:24px 32px;color:var(--fg);background:var(--bg);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:28px 0 10px;border-bottom:1px solid var(--line)}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.muted{color:var(--muted)}.note{background:#fff8c5;border:1px solid #eac54f;padding:6px 10px;border-radius:6px}
.verdict{display:inline-block;padding:2px 12px;border-radius:14px;color:#fff;font-size:15px;vertical-align:middle}
.verdict.equal{background:var(--green)}.verdict.different{background:var(--red)}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:12px}.side{background:var(--panel);padding:8px 12px;
border-radius:6px;word-break:break-all}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{background:var(--panel);border:1px solid var(--line);
border-radius:6px;padding:8px 14px;min-width:120px}.card b{display:block;font-size:19px}
.card span{color:var(--muted);font-size:12px}
.sev{display:inline-block;min-width:64px;text-align:center;border-radius:10px;color:#fff;font-size:12px;
padding:0 8px;margin-right:6px}.sev.critical{background:var(--red)}.sev.warning{background:var(--amber)}
.sev.info{background:var(--blue)}#insights li{margin:4px 0;list-style:none}#insights ul{padding:0}
.names{color:var(--muted);margin-left:78px;word-break:break-all}
table{border-collapse:collapse;font-size:13px}th,td{padding:3px 8px;border-bottom:1px solid var(--line);
text-align:left;vertical-align:top}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.wrap{max-height:85vh;overflow:auto;border:1px solid var(--line);border-radius:6px}
#tensors thead th{position:sticky;top:0;background:var(--panel);z-index:1;white-space:nowrap}
#tensors th button{all:unset;cursor:pointer}#tensors th[aria-sort=ascending] button::after{content:" ▲"}
#tensors th[aria-sort=descending] button::after{content:" ▼"}#tensors tbody tr:hover{background:#f3f7fd}
#tensors{width:100%}#tensors th[data-type=num]{text-align:right}
td.name{overflow-wrap:anywhere;min-width:18em}.sym{font-weight:bold;text-align:center}
tr[data-status=changed] .sym{color:var(--amber)}tr[data-status=added] .sym{color:var(--green)}
tr[data-status=removed] .sym{color:var(--red)}tr[data-status=shape_changed] .sym{color:var(--purple)}
tr[data-status=unchanged]{color:var(--muted)}.warn{color:var(--purple);font-weight:600}.bad{color:var(--red)}
svg{display:block;max-width:100%;height:auto}svg text{font:11px system-ui,sans-serif;fill:var(--fg)}
.bar.rel{fill:#54aeff}.bar.share{fill:#d4a72c}.axis{stroke:#8c959f}.grid{stroke:#eaeef2}
.line{fill:none;stroke:var(--blue);stroke-width:1.5}.point{fill:var(--blue)}figure{margin:8px 0 16px}
figcaption{font-weight:600}footer{margin-top:32px;color:var(--muted);font-size:12px}
"""

# Runs once the table is parsed (the script follows it), so --dump-dom already shows the #sort= order.
_SCRIPT: Final = """
(function () {
  "use strict";
  var table = document.getElementById("tensors");
  if (!table) return;
  var config = JSON.parse(document.getElementById("ckpt-diff-config").textContent);
  var heads = table.tHead.rows[0].cells, body = table.tBodies[0];
  var original = Array.prototype.slice.call(body.rows);
  var state = {index: -1, descending: false};
  function columnIndex(key) {
    for (var i = 0; i < heads.length; i++) if (heads[i].getAttribute("data-key") === key) return i;
    return -1;
  }
  function sortKey(row, index, numeric) {
    var cell = row.cells[index], raw = cell.getAttribute("data-value");
    if (!numeric) return raw !== null ? raw : cell.textContent;
    var value = raw === null || raw === "" ? NaN : parseFloat(raw);
    return isNaN(value) ? null : value;
  }
  function sortBy(index, descending) {
    var numeric = heads[index].getAttribute("data-type") === "num", sign = descending ? -1 : 1;
    var keyed = original.map(function (row, position) {
      return {row: row, key: sortKey(row, index, numeric), position: position};
    });
    keyed.sort(function (x, y) {  // nulls last either way; ties keep the caller's order
      if (x.key === null || y.key === null) {
        return x.key === y.key ? x.position - y.position : (x.key === null ? 1 : -1);
      }
      var order = x.key < y.key ? -1 : (x.key > y.key ? 1 : 0);
      return sign * order || x.position - y.position;
    });
    var fragment = document.createDocumentFragment();
    keyed.forEach(function (item) { fragment.appendChild(item.row); });
    body.appendChild(fragment);
    for (var i = 0; i < heads.length; i++) heads[i].removeAttribute("aria-sort");
    heads[index].setAttribute("aria-sort", descending ? "descending" : "ascending");
    state = {index: index, descending: descending};
  }
  function fromHash() {
    var match = /^#sort=(-?)([a-z0-9_]+)$/.exec(location.hash), index = match ? columnIndex(match[2]) : -1;
    if (index >= 0) sortBy(index, match[1] === "-");
  }
  table.tHead.addEventListener("click", function (event) {
    var head = event.target.closest("th[data-key]");
    if (!head) return;
    var index = head.cellIndex;
    var descending = state.index === index ? !state.descending : head.getAttribute("data-type") === "num";
    sortBy(index, descending);
    try {
      history.replaceState(null, "", "#sort=" + (descending ? "-" : "") + head.getAttribute("data-key"));
    } catch (error) { /* some file:// contexts refuse it: the sort still stands */ }
  });
  var initial = columnIndex(config.sort_by);  // the caller's order: a first click on it reverses it
  if (initial >= 0) state = {index: initial, descending: config.sort_by !== "name" && config.sort_by !== "cosine"};
  fromHash();
  window.addEventListener("hashchange", fromHash);
})();
"""

_SCRIPT_HASH: Final = "sha256-" + base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
_CSP: Final = (
    f"default-src 'none'; style-src 'unsafe-inline'; script-src '{_SCRIPT_HASH}'; img-src data:; "
    "base-uri 'none'; form-action 'none'"
)


def render_html(document: dict[str, object]) -> str:
    """A self-contained HTML page of a checkpoint diff (from its JSON document).

    Args:
        document: the JSON document of ``ckpt-diff`` (format "parity-harness ckpt-diff", version 2.0); its
            tensors are shown in the given order until a column header (or ``#sort=[-]<key>``) sorts them.

    Returns:
        The page: no external resources, every string of the document escaped.
    """
    a, b = _map(document.get("a")), _map(document.get("b"))
    verdict = str(document.get("verdict", ""))
    title = f"ckpt-diff: {a.get('path', '?')} vs {b.get('path', '?')}: {verdict}"
    config = {"sort_by": _map(document.get("options")).get("sort_by"), "columns": [c[0] for c in _COLUMNS]}
    body = [
        _header(document),
        _summary(document),
        _insights(document),
        _patterns(document),
        _layer_chart(_seq(document.get("layer_types"))),
        _depth_charts(_seq(document.get("depths"))),
        _entries(_seq(document.get("entries"))),
        _tensor_table(_seq(document.get("tensors")), str(config["sort_by"] or "-")),
        f"<footer>{_e(document.get('format', 'parity-harness ckpt-diff'))} {_e(document.get('version', ''))}</footer>",
        f'<script type="application/json" id="ckpt-diff-config">{_json_for_script(config)}</script>',
        f"<script>{_SCRIPT}</script>",
    ]
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# -- values ------------------------------------------------------------------------------------------------------


def _map(value: object) -> dict[str, Any]:
    """``value`` if it is a JSON object, else an empty one (a malformed field renders as missing)."""
    return value if isinstance(value, dict) else {}


def _seq(value: object) -> list[Any]:
    """``value`` if it is a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


def _e(value: object) -> str:
    """``value`` as escaped text, safe in element content and in quoted attributes."""
    return html.escape(str(value), quote=True)


def _finite(value: object) -> float | None:
    """``value`` as a float (the document's "inf"/"-inf" strings as infinities), or None (null, text, bool, NaN)."""
    if value in ("inf", "-inf"):
        return float(str(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _num(value: object) -> str:
    """A metric shown to 4 significant digits; null as "-"."""
    if value is None:
        return "-"
    number = _finite(value)
    return f"{number:.4g}" if number is not None else _e(value)


def _human(value: object, unit: str = "", signed: bool = False) -> str:
    """A count in decimal units (124.4 M, 497.8 MB), with a sign for deltas."""
    number = _finite(value)
    if number is None:
        return "-"
    sign = "+" if signed and number > 0 else ""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= scale:
            return f"{sign}{number / scale:.1f} {prefix}{unit}"
    return f"{sign}{number:g} {unit}".rstrip()


def _json_for_script(value: object) -> str:
    """JSON that cannot end its <script> element nor open a comment or CDATA inside it."""
    text = json.dumps(value, ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _names(names: list[Any]) -> str:
    """The first few tensor names, then "+N more"."""
    shown = ", ".join(f"<code>{_e(n)}</code>" for n in names[:_NAMES_SHOWN])
    return shown + (
        f' <span class="muted">+{len(names) - _NAMES_SHOWN} more</span>' if len(names) > _NAMES_SHOWN else ""
    )


# -- sections ----------------------------------------------------------------------------------------------------


def _side(label: str, side: dict[str, Any]) -> str:
    """One checkpoint: path, kind, size and the loader's notes."""
    notes = "".join(f"<li>{_e(n)}</li>" for n in _seq(side.get("notes")))
    return (
        f'<div class="side"><b>{label}</b> <code>{_e(side.get("path", "?"))}</code> '
        f'<span class="muted">({_e(side.get("kind", "?"))})</span><br>'
        f"{_e(side.get('tensors', '-'))} tensors · {_human(side.get('parameters'))} parameters · "
        f"{_human(side.get('bytes'), 'B')}" + (f'<ul class="muted">{notes}</ul>' if notes else "") + "</div>"
    )


def _header(document: dict[str, object]) -> str:
    """Title, verdict badge, both checkpoints and the options."""
    verdict = str(document.get("verdict", ""))
    badge = "equal" if verdict == "EQUAL" else "different"
    options = _map(document.get("options"))
    shape_only = (
        '<p class="note" id="shape-only">Only shapes and dtypes were compared (shape-only mode): '
        "no values were read, so value metrics are empty.</p>"
        if options.get("shape_only")
        else ""
    )
    shown = "all tensors" if options.get("show_unchanged") else "unchanged tensors hidden"
    return (
        f'<header><h1>Checkpoint diff <span id="verdict" class="verdict {badge}">{_e(verdict)}</span></h1>'
        f'<div class="sides">{_side("A", _map(document.get("a")))}{_side("B", _map(document.get("b")))}</div>'
        f'{shape_only}<p class="muted">epsilon {_num(options.get("epsilon"))} · ordered by '
        f"{_e(options.get('sort_by', '-'))} · {shown}</p></header>"
    )


def _card(value: str, label: str) -> str:
    """A summary card: a big value over a small label (both already escaped)."""
    return f'<div class="card"><b>{value}</b><span>{label}</span></div>'


def _summary(document: dict[str, object]) -> str:
    """Counts per status, size totals and cosines."""
    summary = _map(document.get("summary"))
    counts, totals = _map(summary.get("counts")), _map(summary.get("totals"))
    params, size = _map(totals.get("parameters")), _map(totals.get("bytes"))
    cards = [_card(_e(counts.get(s, 0)), f"{_SYMBOLS[s]} {s.replace('_', ' ')}") for s in _SYMBOLS]
    cards.append(_card(_e(summary.get("dtype_changed", 0)), "dtype changed"))
    cards += [
        _card(f"{_human(params.get('a'))} → {_human(params.get('b'))}", "parameters A → B"),
        _card(_human(params.get("delta"), signed=True), "parameters Δ"),
        _card(f"{_human(size.get('a'), 'B')} → {_human(size.get('b'), 'B')}", "bytes A → B"),
        _card(_human(size.get("delta"), "B", signed=True), "bytes Δ"),
    ]
    if totals.get("elements_changed") is not None:
        cards.append(_card(_human(totals.get("elements_changed")), "elements changed"))
    if summary.get("mean_cosine") is not None:
        cards.append(_card(_num(summary.get("mean_cosine")), "mean cosine"))
    lowest = _map(summary.get("min_cosine"))
    if lowest:
        cards.append(_card(_num(lowest.get("cosine")), f"min cosine: <code>{_e(lowest.get('name', '?'))}</code>"))
    key = str(_map(document.get("options")).get("sort_by", "relative_change"))
    shown = key if key in ("relative_change", "l2", "max_abs", "cosine") else "relative_change"
    largest = "".join(
        f"<li><code>{_e(c.get('name'))}</code> {_e(shown.replace('_', ' '))} {_num(c.get(shown))}</li>"
        for c in map(_map, _seq(summary.get("largest_changes")))
    )
    extra = f'<p class="muted">Largest changes by {_e(key.replace("_", " "))}:</p><ol>{largest}</ol>' if largest else ""
    return f'<section id="summary"><h2>Summary</h2><div class="cards">{"".join(cards)}</div>{extra}</section>'


def _insights(document: dict[str, object]) -> str:
    """Each insight with its severity badge and the tensors it names."""
    items = []
    for insight in map(_map, _seq(document.get("insights"))):
        severity = str(insight.get("severity", "info"))
        css = severity if severity in _SEVERITIES else "info"
        names = _seq(insight.get("tensors"))
        items.append(
            f'<li data-kind="{_e(insight.get("kind", ""))}"><span class="sev {css}">{_e(severity)}</span>'
            f"{_e(insight.get('message', ''))}"
            + (f'<div class="names">{_names(names)}</div>' if names else "")
            + "</li>"
        )
    content = f"<ul>{''.join(items)}</ul>" if items else '<p class="muted">No insights.</p>'
    return f'<section id="insights"><h2>Insights</h2>{content}</section>'


def _patterns(document: dict[str, object]) -> str:
    """The change patterns found (gradient over depth and the like) with their evidence."""
    rows = "".join(
        f"<tr><td><b>{_e(p.get('name', ''))}</b></td><td><code>{_e(p.get('scope', ''))}</code></td>"
        f'<td>{_e(p.get("evidence", ""))}</td><td class="muted">{_e(p.get("definition", ""))}</td></tr>'
        for p in map(_map, _seq(document.get("patterns")))
    )
    content = (
        f"<table><thead><tr><th>pattern</th><th>scope</th><th>evidence</th><th>meaning</th></tr></thead>{rows}</table>"
        if rows
        else '<p class="muted">No pattern found.</p>'
    )
    return f'<section id="patterns"><h2>Patterns</h2>{content}</section>'


def _entries(entries: list[Any]) -> str:
    """Non-tensor entries (epoch, step, config values); nothing when there are none."""
    if not entries:
        return ""
    rows = "".join(
        f'<tr data-status="{_e(x.get("status", ""))}"><td class="mono">{_e(x.get("name", ""))}</td>'
        f'<td>{_e(x.get("status", ""))}</td><td class="mono">{_scalar(x, "a")}</td>'
        f'<td class="mono">{_scalar(x, "b")}</td></tr>'
        for x in map(_map, entries)
    )
    return (
        '<section><h2>Other entries</h2><table id="entries"><thead><tr><th>name</th><th>status</th><th>A</th>'
        f"<th>B</th></tr></thead><tbody>{rows}</tbody></table></section>"
    )


def _scalar(entry: dict[str, Any], side: str) -> str:
    """An entry's value on one side: "-" when that side lacks it, JSON otherwise (strings quoted)."""
    if side not in entry or entry[side] is None:
        return "-"
    return _e(json.dumps(entry[side], ensure_ascii=False))


# -- charts ------------------------------------------------------------------------------------------------------


def _layer_chart(layer_types: list[Any]) -> str:
    """Per layer type: a bar of its relative change (scaled to the largest) and one of its share of change."""
    rows = [_map(r) for r in layer_types]
    if not rows:
        return f'<section id="chart-layer-types"><h2>By layer type</h2>{_NO_DATA}</section>'
    top = max((v for r in rows if (v := _finite(r.get("relative_change"))) is not None), default=0.0)
    height, marks = 28 + 22 * len(rows), []
    for i, row in enumerate(rows):
        y, rel, share = 26 + 22 * i, _finite(row.get("relative_change")), _finite(row.get("share_of_change"))
        width = 300 * rel / top if rel is not None and top > 0 else 0.0
        share_width = 180 * min(max(share, 0.0), 1.0) if share is not None else 0.0
        name = str(row.get("layer_type", "?"))
        label = f"{name}: {_e(row.get('tensors', '-'))} tensors, {_e(row.get('changed', '-'))} changed"
        marks.append(
            f"<g><title>{_e(label)}</title>"
            f'<text x="140" y="{y + 13}" text-anchor="end">{_e(name[:24])}</text>'
            f'<rect class="bar rel" x="150" y="{y}" width="{width:.1f}" height="16"/>'
            f'<text x="{156 + width:.1f}" y="{y + 13}">{_num(rel)}</text>'
            f'<rect class="bar share" x="530" y="{y}" width="{share_width:.1f}" height="16"/>'
            f'<text x="{536 + share_width:.1f}" y="{y + 13}">{_percent(share)}</text></g>'
        )
    svg = (
        f'<svg viewBox="0 0 {_W} {height}" width="{_W}" height="{height}" role="img" '
        'aria-label="relative change and share of change per layer type">'
        '<text x="150" y="14" class="muted">relative change</text><text x="530" y="14">share of change</text>'
        + "".join(marks)
        + "</svg>"
    )
    return f'<section id="chart-layer-types"><h2>By layer type</h2>{svg}</section>'


def _percent(value: float | None) -> str:
    """A share as a percentage ("-" when missing)."""
    return "-" if value is None else f"{100 * value:.3g}%"


def _depth_charts(depths: list[Any]) -> str:
    """One chart of relative change over depth per stack of repeated layers."""
    stacks: dict[str, list[dict[str, Any]]] = {}
    for point in map(_map, depths):
        stacks.setdefault(str(point.get("stack", "?")), []).append(point)
    figures = "".join(_depth_figure(stack, points) for stack, points in stacks.items())
    return f'<section id="chart-depths"><h2>By depth</h2>{figures or _NO_DATA}</section>'


def _depth_figure(stack: str, points: list[dict[str, Any]]) -> str:
    """A stack's chart, or "no data" when none of its depths has a relative change."""
    known = sorted(
        (d, r)
        for p in points
        if (d := _finite(p.get("depth"))) is not None and (r := _finite(p.get("relative_change"))) is not None
    )
    caption = f'<code>{_e(stack)}</code> <span class="muted">{len(points)} depth{"s" * (len(points) != 1)}'
    if len(known) < len(points):
        caption += f", {len(points) - len(known)} without data"
    shown = _capped(known, _DEPTH_POINTS)
    if len(shown) < len(known):
        caption += f"; {len(shown)} points drawn, each the largest of {math.ceil(len(known) / _DEPTH_POINTS)} depths"
    chart = _depth_svg(stack, shown) if shown else _NO_DATA
    return f'<figure class="stack" data-stack="{_e(stack)}"><figcaption>{caption}</span></figcaption>{chart}</figure>'


def _capped(points: list[tuple[float, float]], cap: int) -> list[tuple[float, float]]:
    """At most ``cap`` points: the largest change of each run of consecutive depths, so peaks survive."""
    if len(points) <= cap:
        return points
    size = math.ceil(len(points) / cap)
    return [max(points[i : i + size], key=lambda p: p[1]) for i in range(0, len(points), size)]


def _scale(value: float, low: float, high: float, out_low: float, out_high: float) -> float:
    """``value`` mapped from [low, high] onto [out_low, out_high]; a single value lands in the middle."""
    if high == low:
        return (out_low + out_high) / 2
    return out_low + (value - low) / (high - low) * (out_high - out_low)


def _depth_svg(stack: str, points: list[tuple[float, float]]) -> str:
    """Axes, ticks, a line and one circle per point (depth on x, relative change on y)."""
    x_low, x_high = points[0][0], points[-1][0]
    y_low = min(0.0, min(r for _, r in points))
    y_high = max(r for _, r in points)
    y_high = y_high if y_high > y_low else y_low + 1.0  # all zeros: an axis from 0 to 1, points on the floor
    bottom = _PLOT_TOP + _PLOT_HEIGHT
    xy = [
        (_scale(d, x_low, x_high, _PLOT_LEFT + 8, _PLOT_RIGHT - 8), _scale(r, y_low, y_high, bottom, _PLOT_TOP))
        for d, r in points
    ]
    radius = 3 if len(points) <= 64 else 1.6
    circles = "".join(
        f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="{radius}"><title>depth {d:g}: {r:.4g}</title></circle>'
        for (x, y), (d, r) in zip(xy, points, strict=True)
    )
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    return (
        f'<svg viewBox="0 0 {_W} {bottom + 40}" width="{_W}" height="{bottom + 40}" role="img" '
        f'aria-label="relative change by depth of {_e(stack)}">'
        + _depth_axes(x_low, x_high, y_low, y_high)
        + f'<polyline class="line" points="{line}"/>{circles}</svg>'
    )


def _depth_axes(x_low: float, x_high: float, y_low: float, y_high: float) -> str:
    """Both axes with three y ticks (and grid lines), up to seven depth ticks and the axis labels."""
    bottom = _PLOT_TOP + _PLOT_HEIGHT
    parts = [f'<line class="axis" x1="{_PLOT_LEFT}" y1="{bottom}" x2="{_PLOT_RIGHT}" y2="{bottom}"/>']
    parts.append(f'<line class="axis" x1="{_PLOT_LEFT}" y1="{_PLOT_TOP}" x2="{_PLOT_LEFT}" y2="{bottom}"/>')
    for value in (y_low, (y_low + y_high) / 2, y_high):
        y = _scale(value, y_low, y_high, bottom, _PLOT_TOP)
        parts.append(f'<line class="grid" x1="{_PLOT_LEFT + 1}" y1="{y:.1f}" x2="{_PLOT_RIGHT}" y2="{y:.1f}"/>')
        parts.append(f'<text x="{_PLOT_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.3g}</text>')
    step = max(1, math.ceil((x_high - x_low) / 6))
    tick = x_low
    while tick <= x_high:
        x = _scale(tick, x_low, x_high, _PLOT_LEFT + 8, _PLOT_RIGHT - 8)
        parts.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{tick:g}</text>')
        tick += step
    parts.append(f'<text x="{(_PLOT_LEFT + _PLOT_RIGHT) / 2}" y="{bottom + 34}" text-anchor="middle">depth</text>')
    middle = _PLOT_TOP + _PLOT_HEIGHT / 2
    parts.append(f'<text transform="translate(14 {middle}) rotate(-90)" text-anchor="middle">relative change</text>')
    return "".join(parts)


# -- the tensor table --------------------------------------------------------------------------------------------


def _tensor_table(tensors: list[Any], sort_by: str) -> str:
    """Every tensor in the caller's order; headers sort it (one delegated handler, so thousands of rows are fine)."""
    heads = "".join(
        f'<th data-key="{key}" data-type="{kind}" title="{_e(title)}"><button type="button">{_e(label) or "&nbsp;"}'
        "</button></th>"
        for key, label, kind, title in _COLUMNS
    )
    rows = "\n".join(_tensor_row(_map(t)) for t in tensors)
    footnote = (
        '<p class="muted">† started at zero: A was all zeros, so the change cannot be relative to A’s norm.</p>'
        if any(_map(t).get("started_at_zero") for t in tensors)
        else ""
    )
    return (
        f'<section><h2>Tensors <span class="muted">({len(tensors)}, ordered by {_e(sort_by)}; '
        "click a header to sort)</span></h2>"
        f'<div class="wrap"><table id="tensors"><thead><tr>{heads}</tr></thead><tbody>\n{rows}\n</tbody></table></div>'
        f"{footnote}</section>"
    )


def _cell(value: float | None, text: str, css: str = "n") -> str:
    """A numeric cell: ``data-value`` holds the raw number the sort reads (empty for null)."""
    raw = "" if value is None else ("Infinity" if value > 0 else "-Infinity") if math.isinf(value) else repr(value)
    return f'<td class="{css}" data-value="{raw}">{text}</td>'


def _tensor_row(tensor: dict[str, Any]) -> str:
    """One tensor: its status symbol, identity, shape and dtype, then each metric."""
    status = str(tensor.get("status", ""))
    stats_a, stats_b = _map(tensor.get("stats_a")), _map(tensor.get("stats_b"))
    relative = _num(tensor.get("relative_change")) + ("<sup>†</sup>" if tensor.get("started_at_zero") else "")
    cells = [
        f'<td class="sym" data-value="{_e(status)}" title="{_e(status)}">{_e(_SYMBOLS.get(status, "?"))}</td>',
        f'<td class="name mono" data-value="{_e(tensor.get("name", ""))}">{_e(tensor.get("name", ""))}</td>',
        f"<td>{_e(tensor.get('layer_type') or '-')}</td>",
        _shape_cell(tensor),
        _dtype_cell(tensor),
        _stat_cell(stats_a, stats_b, "mean"),
        _stat_cell(stats_a, stats_b, "std"),
        *(_cell(_finite(tensor.get(k)), _num(tensor.get(k))) for k in ("l2", "max_abs", "cosine")),
        _cell(_finite(tensor.get("relative_change")), relative),
        _cell(_finite(tensor.get("fraction_changed")), _num(tensor.get("fraction_changed"))),
        _nan_cell(stats_a, stats_b),
    ]
    return (
        f'<tr class="tensor" data-name="{_e(tensor.get("name", ""))}" data-status="{_e(status)}">'
        + "".join(cells)
        + "</tr>"
    )


def _shape(shape: object) -> str:
    """768x2304; "scalar" for (); "-" for a missing side."""
    if not isinstance(shape, list):
        return "-"
    return "x".join(_e(n) for n in shape) or "scalar"


def _shape_cell(tensor: dict[str, Any]) -> str:
    """The shape, "old → new" when it changed; sorts by parameter count."""
    shape_a, shape_b = tensor.get("shape_a"), tensor.get("shape_b")
    if shape_a is not None and shape_b is not None and shape_a != shape_b:
        text = f'<span class="warn">{_shape(shape_a)} → {_shape(shape_b)}</span>'
    else:
        text = _shape(shape_b if shape_b is not None else shape_a)
    parameters = _finite(tensor.get("parameters_b"))
    return _cell(parameters if parameters is not None else _finite(tensor.get("parameters_a")), text, "n mono")


def _dtype_cell(tensor: dict[str, Any]) -> str:
    """The dtype, "a → b" when it changed."""
    dtype_a, dtype_b = tensor.get("dtype_a"), tensor.get("dtype_b")
    if dtype_a is not None and dtype_b is not None and dtype_a != dtype_b:
        return f'<td class="mono warn">{_e(dtype_a)} → {_e(dtype_b)}</td>'
    return f'<td class="mono">{_e(dtype_b if dtype_b is not None else dtype_a if dtype_a is not None else "-")}</td>'


def _stat_cell(stats_a: dict[str, Any], stats_b: dict[str, Any], key: str) -> str:
    """A statistic "a → b"; sorts by how far it moved."""
    if not stats_a and not stats_b:
        return _cell(None, "-")
    a, b = _finite(stats_a.get(key)), _finite(stats_b.get(key))
    moved = abs(b - a) if a is not None and b is not None else None
    return _cell(moved, f"{_num(stats_a.get(key))} → {_num(stats_b.get(key))}")


def _nan_cell(stats_a: dict[str, Any], stats_b: dict[str, Any]) -> str:
    """NaN counts "a/b", red when any; sorts by their sum."""
    if not stats_a and not stats_b:
        return _cell(None, "-")
    nan_a, nan_b = _finite(stats_a.get("nan")), _finite(stats_b.get("nan"))
    total = (nan_a or 0.0) + (nan_b or 0.0)
    text = f"{_count(stats_a.get('nan'))}/{_count(stats_b.get('nan'))}"
    return _cell(total, text, "n bad" if total else "n")


def _count(value: object) -> str:
    """A count as is; null as "-"."""
    return "-" if value is None else _e(value)
