"""The reports as a reader sees them: index.html and notebook pages opened in headless Chromium
(Debian's `chromium`, installed by `make test`). Checks that the pages render, that every local link
resolves, and that a matplotlib figure is embedded and drawn on screen."""

import base64
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from kdlib import report

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--disable-dev-shm-usage",  # containers often give /dev/shm only 64 MB
         # every host name fails at once: the pages must render offline, and a CI sandbox whose DNS
         # hangs cannot stall the page's load (nbconvert pages name MathJax and require.js on a CDN)
         "--host-resolver-rules=MAP * ~NOTFOUND"]
MAGENTA = (1.0, 0.0, 1.0)  # the test figure's fill: a colour nothing else on the page uses
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


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


def test_failed_notebook_page_renders(out, tmp_path):
    dom = dump_dom(tmp_path, out / "20_fail.html")
    assert "deliberate failure" in dom and "ValueError" in dom
