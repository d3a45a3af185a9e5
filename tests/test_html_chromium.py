"""A generated report.html opened in a real headless Chromium: the page renders, every image decodes
(``naturalWidth > 0``) and the tables, as laid out, show the sweep's numbers.

Chromium runs the page with a probe script appended to a copy (the page itself has no script): on
``load`` it records each image's decoded size and each table's rendered text and height into the
DOM, which ``--dump-dom`` prints; the same launch takes a screenshot, which must not be blank. scripts/install.sh
installs Debian's ``chromium`` where it is missing; without it this test is skipped.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from experiments.results.html_report import write_html_report
from experiments.results.report import write_report
from tests.result_folders import write_sweep

BROWSER = next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH (scripts/install.sh runs `apt-get install -y chromium`)")

PROBE = """<script>window.addEventListener("load", () => {
  const images = [...document.images].map(i => ({complete: i.complete, width: i.naturalWidth, height: i.naturalHeight}));
  const tables = {};
  for (const t of document.querySelectorAll("table")) tables[t.id] = {text: t.innerText, height: t.getBoundingClientRect().height};
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({images, tables, height: document.body.scrollHeight});
  document.body.appendChild(out);
});</script>"""


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={profile}", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=60)


def rendered(page: Path, tmp_path: Path, *args: str) -> dict:
    """What Chromium made of ``page``: images' decoded sizes, tables' rendered text and height."""
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    proc = chromium(probed, tmp_path / "profile", "--dump-dom", *args)
    found = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"Chromium printed no probe: {proc.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


@pytest.fixture(scope="module")
def sweep_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_sweep(tmp_path_factory.mktemp("sweep") / "sweep", levels=(1, 4, 16))
    write_report(root)
    return write_html_report(root)


def test_chromium_renders_the_page_with_every_image_and_the_sweeps_numbers(sweep_page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "page.png"
    result = rendered(sweep_page, tmp_path, f"--screenshot={shot}", "--window-size=1200,2400")
    assert len(result["images"]) == 6
    for image in result["images"]:
        assert image["complete"] and image["width"] > 0 and image["height"] > 0, image
    runs = result["tables"]["runs"]
    assert runs["height"] > 0
    rows = [line.split("\t") for line in runs["text"].strip().splitlines()]
    report = [line.strip("|").split(" | ") for line in (sweep_page.parent / "report.md").read_text().splitlines()
              if line.startswith("| ")]
    assert len(rows) == len(report) == 1 + 3
    for shown, written in zip(rows, report):  # every cell of report.md, as the browser shows it
        assert [cell.strip() for cell in shown] == [cell.strip() for cell in written][:len(shown)]
    assert rows[1][rows[0].index("output_throughput")] == f"{20 / 1.1:.4g}"
    with Image.open(shot) as image:  # the page as drawn: text, tables and plots, not an empty page
        assert image.size == (1200, 2400)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is None or len(colours) > 50


def test_a_broken_image_is_caught(sweep_page: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    broken.write_text(sweep_page.read_text().replace("base64,iVBOR", "base64,AAAAA", 1))
    widths = [image["width"] for image in rendered(broken, tmp_path)["images"]]
    assert widths.count(0) == 1
