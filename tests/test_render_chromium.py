"""The reports as a reader sees them: index.html and notebook pages opened in headless Chromium
(Debian's `chromium`, installed by `make test`). Checks that the pages render, that every local link
resolves, that a matplotlib figure is embedded and drawn on screen, that the index puts the audit's
verdict count first and its table after the notebooks, that every provenance is a link to an element
id of its page (section headings with an apostrophe included), and that no page of a notebook that
passed shows a stderr block."""

import base64
import html
import json
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import nbformat
import numpy as np
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from kdlib import audit, report

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--disable-dev-shm-usage",  # containers often give /dev/shm only 64 MB
    # every host name fails at once: the pages must render offline, and a CI sandbox whose DNS
    # hangs cannot stall the page's load (nbconvert pages name MathJax and require.js on a CDN)
    "--host-resolver-rules=MAP * ~NOTFOUND",
]
MAGENTA = (1.0, 0.0, 1.0)  # the test figure's fill: a colour nothing else on the page uses
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
SECTION = "2. The seeds' 200k decision, re-checked"
AUDITED = {"mem_576_elements": "reproduced", "mem_8_6_kb_per_gpu": "contradicted",
           "moe_plateau_256": "consistent under a reading", "diag_baseline_c1_c10": "not reproducible here"}
# nbconvert renders stderr streams and error tracebacks alike as this block (nbconvert 7, lab template)
STDERR_BLOCK = re.compile(
    r'<div class="jp-RenderedText[^"]*"[^>]*data-mime-type="application/vnd\.jupyter\.stderr"'
)


def _nb(path, cells):
    nbformat.write(new_notebook(cells=cells, metadata={"kernelspec": KERNELSPEC}), str(path))


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"chromium not found at {CHROMIUM}: install Debian's `chromium` (make test does)")
    root = tmp_path_factory.mktemp("render")
    nbs = root / "notebooks"
    nbs.mkdir()
    _nb(nbs / "10_figure.ipynb", [
        new_markdown_cell("# 10 · Figure notebook\nDraws a magenta square; the headline is its side."),
        new_code_cell("SIDE = 1.0  # float: > 0", metadata={"tags": ["parameters"]}),
        new_code_cell(
            "import matplotlib.pyplot as plt\nimport kdlib.nb\n"
            "fig, ax = plt.subplots(figsize=(4, 3), dpi=100)  # 400 x 300 px\n"
            "ax.add_patch(plt.Rectangle((0, 0), SIDE, SIDE, color='#ff00ff'))\n"
            "ax.set_xlim(0, SIDE); ax.set_ylim(0, SIDE); ax.axis('off')\nplt.show()\n"
            "kdlib.nb.record('side', SIDE, unit='m', source='this notebook')"),
        new_markdown_cell(f"## {SECTION}\nA heading with an apostrophe, as notebook 05's section 5."),
        new_code_cell(
            "from kdlib import audit\n"
            f"link = '10_figure.html#' + audit.anchor({SECTION!r})\n"
            "kdlib.nb.record('weights', 594_205_351_936, unit='B', source=link)\n"
            f"for fid, verdict in {AUDITED!r}.items():\n"
            "    kdlib.nb.record(audit.RECORD_PREFIX + fid, verdict, note='ours', source=link)\n"
            "kdlib.nb.record(audit.RECORD_PREFIX + 'kern_tree_queue_65', 'reproduced', "
            "source='10_figure.html')"),
    ])
    _nb(nbs / "20_fail.ipynb", [
        new_markdown_cell("# 20 · Failing notebook\nRaises at once."),
        new_code_cell("raise ValueError('deliberate failure')"),
    ])
    out = root / "reports"
    assert report.cli(["--notebooks-dir", str(nbs), "--out", str(out)]) == 1  # 20_fail fails
    return out


def _chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return proc


def dump_dom(tmp_path, page: Path) -> str:
    return _chromium(tmp_path, "--dump-dom", page.as_uri()).stdout


def screenshot(tmp_path, page: Path, size=(1280, 2000)) -> np.ndarray:
    """RGB pixels in [0, 1], shape [H, W, 3]."""
    import matplotlib.image

    png = tmp_path / f"{page.stem}.screenshot.png"
    _chromium(tmp_path, f"--window-size={size[0]},{size[1]}", f"--screenshot={png}", page.as_uri())
    return matplotlib.image.imread(str(png))[..., :3]


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids, self.images = [], set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag == "img" and a.get("src"):
            self.images.append(a["src"])


def _parse(dom: str) -> _Links:
    p = _Links()
    p.feed(dom)
    return p


def _unresolved(dom: str, base: Path) -> list[str]:
    parsed = _parse(dom)
    bad = []
    for href in parsed.links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", href):  # http:, mailto:, data: ... are not local files
            continue
        target, _, frag = href.partition("#")
        if target and not (base / target).is_file():
            bad.append(href)
        elif not target and frag and frag not in parsed.ids:
            bad.append(href)
    return bad


def test_index_renders(out, tmp_path):
    dom = dump_dom(tmp_path, out / "index.html")
    assert "kdtree workbook: reports" in dom
    assert "10 · Figure notebook" in dom and "20 · Failing notebook" in dom
    assert "ValueError" in dom and "deliberate failure" in dom
    pixels = screenshot(tmp_path, out / "index.html")
    ink = (pixels.min(axis=-1) < 0.8).mean()  # share of pixels that are not (near-)white
    assert 0.005 < ink < 0.5, f"index screenshot looks blank or broken (ink share {ink:.4f})"


def test_every_local_link_resolves(out, tmp_path):
    dom = dump_dom(tmp_path, out / "index.html")
    local = [h for h in _parse(dom).links if not re.match(r"^[a-z][a-z0-9+.-]*:", h)]
    assert {"10_figure.html", "10_figure.ipynb", "20_fail.html", "#10_figure"} <= set(local)
    assert _unresolved(dom, out) == []
    page_dom = dump_dom(tmp_path, out / "10_figure.html")
    assert "index.html" in _parse(page_dom).links and _unresolved(page_dom, out) == []


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # IHDR follows the signature
    return width, height


def test_figure_is_embedded_and_drawn(out, tmp_path):
    dom = dump_dom(tmp_path, out / "10_figure.html")
    assert "10 · Figure notebook" in dom
    pngs = [s for s in _parse(dom).images if s.startswith("data:image/png;base64,")]
    assert len(pngs) == 1, f"expected one embedded PNG figure, found {len(pngs)}"
    data = base64.b64decode(pngs[0].split(",", 1)[1])
    width, height = _png_size(data)
    assert width >= 300 and height >= 200 and len(data) > 1000
    pixels = screenshot(tmp_path, out / "10_figure.html")
    magenta = (np.abs(pixels - np.array(MAGENTA)).max(axis=-1) < 0.1).sum()
    assert magenta > 30_000, f"the figure is not drawn on the page ({magenta} magenta pixels)"


def test_pages_load_nothing_from_the_network(out):
    """The pages open offline: no script, style sheet or image is fetched from another host (nbconvert's
    template would pull require.js, MathJax and mermaid from a CDN)."""
    for page in sorted(out.glob("*.html")):
        html = page.read_text()
        remote = re.findall(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//[^"]*"', html)
        assert not remote, f"{page.name} loads {remote}"
        assert "import(" not in html or "cdnjs" not in html, page.name


def test_failed_notebook_page_renders(out, tmp_path):
    dom = dump_dom(tmp_path, out / "20_fail.html")
    assert "deliberate failure" in dom and "ValueError" in dom


def _element_ids(tmp_path, page: Path, cache: dict) -> set[str]:
    if page not in cache:
        cache[page] = _parse(dump_dom(tmp_path, page)).ids
    return cache[page]


def _has_id(fragment: str, ids: set[str]) -> bool:
    """A browser tries the fragment as written, then percent-decoded (HTML: 'find a potential
    indicated element')."""
    return fragment in ids or unquote(fragment) in ids


def test_index_order_verdicts_notebooks_then_folded_table(out, tmp_path):
    dom = dump_dom(tmp_path, out / "index.html")
    at = {k: dom.index(k) for k in ('id="verdicts"', 'id="10_figure"', 'id="20_fail"', 'id="audit"')}
    assert at['id="verdicts"'] < at['id="10_figure"'] < at['id="20_fail"'] < at['id="audit"']
    audit_block = re.search(r'<details class="audit" id="audit"[^>]*>', dom).group(0)
    assert "open" not in audit_block  # folded
    counts = re.sub(r"<[^>]+>", "", dom[at['id="verdicts"']:dom.index("</p>", at['id="verdicts"'])])
    for n, verdict in ((2, "reproduced"), (1, "consistent under a reading"), (1, "contradicted"),
                       (1, "not reproducible here")):
        assert f"{n} {verdict}" in counts, counts
    claims = audit.catalogue()
    table = dom[at['id="audit"']:]
    for fid in AUDITED:
        assert claims[fid].figure in table and fid not in table  # the claim in words, not its id
    assert "553" in dom and "GiB" in dom and ">594,205,351,936<" not in dom


def test_every_provenance_is_a_link_to_an_element_of_its_page(out, tmp_path):
    dom = dump_dom(tmp_path, out / "index.html")
    cells = re.findall(r'<td class="prov">(.*?)</td>', dom, flags=re.S)
    pages = [c for c in cells if ".html" in c or "§" in c]
    assert len(pages) == len(AUDITED) + 2, cells  # the audit rows and the 'weights' record
    cache, checked = {}, 0
    for cell in pages:
        m = re.fullmatch(r'<a href="([^"]+)"[^>]*>[^<]+</a>', cell.strip())
        assert m, f"a provenance that names a page is not a link: {cell}"
        target, _, fragment = html.unescape(m.group(1)).partition("#")
        assert (out / target).is_file(), target
        if fragment:
            assert _has_id(fragment, _element_ids(tmp_path, out / target, cache)), (
                f"no id {fragment!r} in {target}"
            )
            checked += 1
    assert checked == len(AUDITED) + 1  # every one with an apostrophe in its anchor


def test_no_passed_page_shows_a_stderr_block(out, tmp_path):
    entries = {e["stem"]: e for e in json.loads((out / "index.json").read_text())["notebooks"]}
    for stem, e in entries.items():
        blocks = STDERR_BLOCK.findall(dump_dom(tmp_path, out / e["html"]))
        if e["status"] == "passed":
            assert blocks == [] and e["stderr"] == [], f"{stem}.html shows {len(blocks)} stderr block(s)"
        else:
            assert blocks, f"{stem}.html: its traceback is not where a stderr block is expected"
    assert STDERR_BLOCK.findall(dump_dom(tmp_path, out / "index.html")) == []
