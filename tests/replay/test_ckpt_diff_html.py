"""ckpt-diff's HTML page: hostile names stay text, every section renders, charts hold up, and it sorts in a browser."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from parity_harness.replay.report.ckpt_diff.html import render_html

KINDS = ("attention", "mlp", "norm")
HOSTILE = '<script>alert(1)</script>"onmouseover=alert(1) x="'


def _tensor(name: str, depth: int | None, l2: float | None, layer_type: str = "mlp", **extra: Any) -> dict[str, Any]:
    """One changed tensor of shape 768x2304 with every metric set (``extra`` overrides)."""
    stats = {"mean": 0.0, "std": 0.02, "min": -0.1, "max": 0.1, "norm": 26.6, "nan": 0, "inf": 0}
    tensor = {
        "name": name,
        "status": "changed",
        "layer_type": layer_type,
        "depth": depth,
        "shape_a": [768, 2304],
        "shape_b": [768, 2304],
        "dtype_a": "F32",
        "dtype_b": "F32",
        "dtype_changed": False,
        "parameters_a": 1769472,
        "parameters_b": 1769472,
        "stats_a": stats,
        "stats_b": {**stats, "std": 0.021},
        "l1": 1.0,
        "l2": l2,
        "max_abs": None if l2 is None else l2 / 10,
        "mean_abs": 0.001,
        "cosine": None if l2 is None else 1 - l2 / 100,
        "relative_change": None if l2 is None else l2 / 26.6,
        "started_at_zero": False,
        "fraction_changed": 1.0,
        "elements_changed": 1769472,
    }
    return {**tensor, **extra}


SIDES = {
    side: {
        "path": f"runs/{side}.safetensors",
        "kind": "safetensors",
        "tensors": 150,
        "parameters": 124439808 + extra,
        "bytes": 4 * (124439808 + extra),
        "notes": ["stripped the 'module.' prefix of every name"],
    }
    for side, extra in (("a", 0), ("b", 1152))
}
SUMMARY = {
    "counts": {"changed": 12, "unchanged": 28, "added": 1, "removed": 1, "shape_changed": 0},
    "dtype_changed": 0,
    "totals": {
        "parameters": {"a": 124439808, "b": 124440960, "delta": 1152},
        "bytes": {"a": 497759232, "b": 497763840, "delta": 4608},
        "elements_changed": 98000000,
    },
    "mean_cosine": 0.9987,
    "min_cosine": {"name": "transformer.h.3.attention.weight", "cosine": 0.41},
    "largest_changes": [{"name": "transformer.h.0.mlp.weight", "relative_change": 0.21}],
}
INSIGHTS = [
    {"severity": "critical", "kind": "low_cosine", "message": "1 tensor points elsewhere", "tensors": ["h.3.attn"]},
    {
        "severity": "info",
        "kind": "frozen",
        "message": "28 tensors are frozen",
        "tensors": [f"f.{i}" for i in range(28)],
    },
]
PATTERNS = [{"name": "gradient", "scope": "transformer.h", "evidence": "rank correlation -0.93", "definition": "..."}]


def _document(layers: int = 4, **extra: Any) -> dict[str, Any]:
    """A diff of ``layers`` blocks of 3 tensors, listed by name, with L2 scrambled and one L2 null."""
    tensors = [
        _tensor(f"transformer.h.{d}.{kind}.weight", d, None if (d, k) == (1, 1) else float((7 * d + 3 * k) % 11), kind)
        for d in range(layers)
        for k, kind in enumerate(KINDS)
    ]
    layer_types = [
        {"layer_type": kind, "tensors": layers, "relative_change": 0.05 * (i + 1), "share_of_change": (i + 1) / 6}
        for i, kind in enumerate(KINDS)
    ]
    document = {
        "format": "parity-harness ckpt-diff",
        "version": "2.0",
        **SIDES,
        "options": {"epsilon": 0.0, "shape_only": False, "sort_by": "name", "show_unchanged": False},
        "verdict": "DIFFERENT",
        "equal": False,
        "summary": SUMMARY,
        "patterns": PATTERNS,
        "insights": INSIGHTS,
        "layer_types": layer_types,
        "depths": [{"stack": "transformer.h", "depth": d, "relative_change": 0.2 / (d + 1)} for d in range(layers)],
        "entries": [{"name": "epoch", "status": "changed", "a": 3, "b": 4}],
        "tensors": tensors,
    }
    return {**document, **extra}


def _section(page: str, element_id: str) -> str:
    """The markup of the <section> with ``element_id``."""
    match = re.search(rf'<section id="{element_id}">(.*?)</section>', page, re.S)
    assert match, f"no section {element_id!r}"
    return match.group(1)


def _row(page: str, name: str) -> str:
    """The markup of the tensor row named ``name``."""
    match = re.search(rf'<tr class="tensor" data-name="{re.escape(html.escape(name))}"[^>]*>(.*?)</tr>', page, re.S)
    assert match, f"no row for {name!r}"
    return match.group(1)


def test_hostile_strings_stay_text() -> None:
    """Names, paths, messages and values from a checkpoint never become markup or script."""
    document = _document(
        a={"path": "<img src=x onerror=alert(1)>", "kind": "pt", "tensors": 1, "parameters": 1, "bytes": 4},
        options={"sort_by": "</script><script>alert(4)</script><!--", "shape_only": False},
        insights=[{"severity": "<b>", "kind": '"x', "message": "<script>alert(2)</script>", "tensors": [HOSTILE]}],
        entries=[{"name": "<i>step</i>", "status": "changed", "a": "</td><script>alert(3)</script>", "b": None}],
        tensors=[_tensor(HOSTILE, 0, 1.0, layer_type="<u>mlp</u>")],
        layer_types=[{"layer_type": "<svg onload=alert(5)>", "relative_change": 0.1, "share_of_change": 1.0}],
        depths=[{"stack": "</svg><script>alert(6)</script>", "depth": 0, "relative_change": 0.1}],
    )
    page = render_html(document)
    assert page.count("<script") == 2
    assert page.count("</script>") == 2
    assert "<img" not in page
    assert "<svg onload" not in page
    assert "<u>" not in page
    assert "<i>step" not in page
    assert re.search(r"<[^>]*\sonmouseover=", page) is None
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;onmouseover=alert(1) x=&quot;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page
    config = re.search(r'<script type="application/json" id="ckpt-diff-config">(.*?)</script>', page, re.S)
    assert config
    assert json.loads(config.group(1))["sort_by"] == "</script><script>alert(4)</script><!--"


def test_page_is_self_contained() -> None:
    """The page loads nothing from the network, and its policy forbids it and any injected script."""
    page = render_html(_document())
    assert not re.search(r"(src|href)=|https?://|@import|url\(", page.replace("http-equiv", ""))
    assert "default-src 'none'" in page
    assert "script-src 'sha256-" in page


@pytest.mark.parametrize(("verdict", "badge"), [("DIFFERENT", "different"), ("EQUAL", "equal")], ids=["diff", "equal"])
def test_every_section_and_the_verdict(verdict: str, badge: str) -> None:
    """Each section has its id, the verdict its badge, and both checkpoints are named."""
    page = render_html(_document(verdict=verdict, equal=verdict == "EQUAL"))
    for element_id in ("verdict", "summary", "insights", "patterns", "chart-layer-types", "chart-depths", "tensors"):
        assert f'id="{element_id}"' in page
    assert f'<span id="verdict" class="verdict {badge}">{verdict}</span>' in page
    assert "runs/a.safetensors" in page
    assert "runs/b.safetensors" in page
    assert "shape-only" not in page
    assert 'id="entries"' in page
    assert '<td class="mono">3</td>' in page
    assert page.count('<tr class="tensor"') == 12


def test_summary_reads_in_human_units() -> None:
    """Totals show as 124.4 M parameters and 497.8 MB with signed deltas; insights cap their names."""
    page = render_html(_document())
    summary = _section(page, "summary")
    assert "124.4 M → 124.4 M" in summary
    assert "+1.2 k" in summary
    assert "497.8 MB → 497.8 MB" in summary
    assert "+4.6 kB" in summary
    assert "0.9987" in summary
    insights = _section(page, "insights")
    assert '<span class="sev critical">critical</span>' in insights
    assert "+23 more" in insights


def test_shapes_dtypes_and_missing_metrics() -> None:
    """A changed shape reads "old → new", a changed dtype "a → b", and a null metric "-"."""
    resized = _tensor("wte", 0, 2.0, shape_b=[768, 2305], dtype_b="BF16", parameters_b=1770240)
    nulls = dict.fromkeys(("stats_a", "stats_b", "fraction_changed", "shape_a"))
    added = _tensor("new.bias", None, None, status="added", shape_b=[3], started_at_zero=True, **nulls)
    page = render_html(_document(tensors=[resized, added], options={"shape_only": True, "sort_by": "name"}))
    assert "768x2304 → 768x2305" in _row(page, "wte")
    assert "F32 → BF16" in _row(page, "wte")
    row = _row(page, "new.bias")
    assert '<td class="n mono" data-value="1769472.0">3</td>' in row
    assert row.count('data-value="">-</td>') == 7  # mean, std, L2, max abs, cosine, changed, NaN
    assert 'data-value="">-<sup>†</sup></td>' in row
    assert 'id="shape-only"' in page


def test_numbers_show_four_significant_digits() -> None:
    """Metrics show 4 significant digits while data-value keeps the raw number for sorting."""
    page = render_html(_document(tensors=[_tensor("w", 0, 0.123456789)]))
    assert '<td class="n" data-value="0.123456789">0.1235</td>' in _row(page, "w")


def test_layer_type_chart_has_a_bar_per_type() -> None:
    """The layer-type chart draws one relative-change bar per layer type, scaled to the largest."""
    chart = _section(render_html(_document()), "chart-layer-types")
    assert chart.count('class="bar rel"') == len(KINDS)
    assert chart.count('class="bar share"') == len(KINDS)
    assert 'width="300.0"' in chart  # the largest fills the scale


def test_depth_chart_has_a_mark_per_depth() -> None:
    """Each stack gets a chart with one point per depth, and axis labels."""
    depths = [{"stack": s, "depth": d, "relative_change": 0.1 * d} for s in ("enc", "dec") for d in range(6)]
    chart = _section(render_html(_document(depths=depths)), "chart-depths")
    assert chart.count('class="point"') == 12
    assert chart.count('<figure class="stack"') == 2
    assert ">depth</text>" in chart
    assert ">relative change</text>" in chart


@pytest.mark.parametrize(
    ("depths", "points"),
    [
        ([], 0),
        ([{"stack": "h", "depth": 0, "relative_change": None}], 0),
        ([{"stack": "h", "depth": 5, "relative_change": 0.3}], 1),
        ([{"stack": "h", "depth": d, "relative_change": 0.0} for d in range(4)], 4),
    ],
    ids=["empty", "all-null", "single-point", "all-zero"],
)
def test_depth_chart_edge_cases(depths: list[dict[str, Any]], points: int) -> None:
    """No depths or only nulls say "no data"; one point or all zeros still draw, without NaN coordinates."""
    chart = _section(render_html(_document(depths=depths)), "chart-depths")
    assert chart.count('class="point"') == points
    assert ("no data" in chart) == (points == 0)
    assert "nan" not in chart.lower()
    assert "inf" not in chart.lower()


def test_depth_chart_caps_points_and_keeps_peaks() -> None:
    """Thousands of depths draw at most 512 points, and the largest change is among them."""
    depths = [{"stack": "h", "depth": d, "relative_change": 0.001 * (d % 7)} for d in range(5000)]
    depths[4321]["relative_change"] = 9.5
    chart = _section(render_html(_document(depths=depths)), "chart-depths")
    assert chart.count('class="point"') <= 512
    assert "<title>depth 4321: 9.5</title>" in chart


def _chromium() -> str:
    """A headless-capable Chromium, or skip."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    pytest.skip("no headless Chromium installed (apt-get install chromium)")


def _browse(page: Path, profile: Path, *flags: str, fragment: str = "") -> str:
    """Run headless Chromium on ``page`` and return its stdout (stderr carries harmless D-Bus warnings)."""
    command = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}", *flags]
    done = subprocess.run(
        [*command, page.as_uri() + fragment], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize(
    ("fragment", "key", "descending"),
    [("#sort=-l2", "l2", True), ("#sort=cosine", "cosine", False)],
    ids=["-l2", "cosine"],
)
def test_browser_sorts_from_the_fragment(tmp_path: Path, fragment: str, key: str, descending: bool) -> None:
    """In a real browser, report.html#sort=[-]key opens with the rows in that order, nulls last."""
    document = _document(layers=30)
    page = tmp_path / "report.html"
    page.write_text(render_html(document), encoding="utf-8")
    dom = _browse(page, tmp_path / "profile", "--dump-dom", fragment=fragment)
    for element_id in ("verdict", "summary", "insights", "chart-layer-types", "chart-depths", "tensors"):
        assert f'id="{element_id}"' in dom
    names = [html.unescape(n) for n in re.findall(r'<tr class="tensor" data-name="([^"]*)"', dom)]
    value = {t["name"]: t[key] for t in document["tensors"]}
    known = [value[n] for n in names if value[n] is not None]
    assert len(names) == 90
    assert known == sorted(known, reverse=descending)
    assert value[names[-1]] is None
    direction = "descending" if descending else "ascending"
    assert re.search(rf'<th data-key="{key}"[^>]*aria-sort="{direction}"', dom)


def test_browser_draws_the_page(tmp_path: Path) -> None:
    """A headless browser renders the page to a real, non-blank screenshot."""
    page, shot = tmp_path / "report.html", tmp_path / "shot.png"
    page.write_text(render_html(_document(layers=30)), encoding="utf-8")
    _browse(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,2000")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000


def test_browser_runs_no_injected_script(tmp_path: Path) -> None:
    """A tensor name carrying script or an event handler does nothing when the page is opened."""
    payloads = [
        "<script>document.body.setAttribute('data-pwned','1')</script>",
        "<img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">",
    ]
    page = tmp_path / "report.html"
    page.write_text(render_html(_document(tensors=[_tensor(p, 0, 1.0) for p in payloads])), encoding="utf-8")
    dom = _browse(page, tmp_path / "profile", "--dump-dom", fragment="#sort=-name")
    assert re.search(r"<body[^>]*data-pwned", dom) is None
    assert dom.count('<tr class="tensor"') == 2


def test_browser_opens_the_clis_own_report(tmp_path: Path) -> None:
    """The page ckpt-diff itself writes for a real pair (an infinity, a reshaped tensor, a zero-start bias) opens in
    the browser with its sections, and #sort=-l2 orders the rows as the CLI's --sort-by l2 does."""
    import numpy as np
    from click.testing import CliRunner

    from parity_harness.replay.cli.ckpt_diff import main

    generator = np.random.default_rng(0)
    a = {f"h.{i}.attn.weight": generator.standard_normal((16, 16)).astype(np.float32) for i in range(6)}
    a |= {"h.0.attn.bias": np.zeros(16, np.float32), "head.weight": np.ones((2, 3), np.float32)}
    b = {name: value + np.float32(0.01 * (1 + i)) for i, (name, value) in enumerate(a.items())}
    b["h.3.attn.weight"][0, 0] = np.inf
    b["head.weight"] = np.ones((2, 4), np.float32)
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    args = [str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--sort-by", "l2"]
    page = tmp_path / "report.html"
    assert CliRunner().invoke(main, [*args, "--format", "html", "--out", str(page)]).exit_code == 1
    expected = [t["name"] for t in json.loads(CliRunner().invoke(main, [*args, "--format", "json"]).stdout)["tensors"]]
    dom = _browse(page, tmp_path / "profile", "--dump-dom", fragment="#sort=-l2")
    for element_id in ("verdict", "summary", "insights", "chart-layer-types", "chart-depths", "tensors"):
        assert f'id="{element_id}"' in dom
    shown = [html.unescape(n) for n in re.findall(r'<tr class="tensor" data-name="([^"]*)"', dom)]
    assert shown[0] == "h.3.attn.weight"  # infinite L2 first, as the CLI puts it
    assert shown[: len(expected) - 1] == expected[: len(expected) - 1]  # the reshaped tensor (no L2) last
    assert str(tmp_path / "a.npz") in html.unescape(dom)
