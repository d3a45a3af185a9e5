"""report.html: a run's and a sweep's page hold their numbers (the rows of summary.md / report.md),
embed every image as a data: URI, say so where a plot has no data, and never replace an older page."""
from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.results.files import summary_rows
from experiments.results.html_report import RunPageCallback, write_html_report
from experiments.results.load_curves import pareto_front
from experiments.results.report import write_report
from tests.harness_runs import SIMULATED_TINY, run_once
from tests.result_folders import write_run, write_sweep


class Page(HTMLParser):
    """The tables (by id: header + rows of cell texts), the images' src and the script/link tags of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[str] = []
        self.external: list[str] = []
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attributes.get("id") or f"table{len(self.tables)}", [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.images.append(attributes.get("src") or "")
        elif tag in ("script", "link", "iframe") or any((v or "").startswith(("http:", "https:", "//")) for _, v in attrs):
            self.external.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self._table[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def assert_self_contained(page: Page) -> None:
    assert page.images, "the page has no image"
    for src in page.images:
        assert src.startswith("data:image/png;base64,"), src[:60]
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    assert page.external == [], f"the page loads something from outside: {page.external}"


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    outcome = run_once([*SIMULATED_TINY, "workload=burst", "workload.concurrency=4"], out)
    assert not outcome.failed, outcome.summary.get("error")
    return out


def test_run_page_shows_every_summary_row_and_embeds_its_plots(simulated_run: Path) -> None:
    path = write_html_report(simulated_run)
    assert path == simulated_run / "report.html"
    page = Page(path.read_text())
    summary = json.loads((simulated_run / "summary.json").read_text())
    assert page.tables["metrics"][1:] == [list(row) for row in summary_rows(summary)]
    assert ["output tok/s", f"{summary['metrics']['output_throughput']:.4g}"] in page.tables["metrics"]
    environment = dict(row for row in page.tables["environment"][1:])
    assert environment["python"] == summary["environment"]["python"]
    assert "cache:" in path.read_text()  # the resolved config.yaml is on the page
    assert len(page.images) == 3  # TTFT CDF, ITL CDF, KV usage: the simulator records KV
    assert_self_contained(page)


def test_sweep_page_table_is_report_md(tmp_path: Path) -> None:
    root = write_sweep(tmp_path / "sweep")
    write_run(root / "3", {}, ["workload.concurrency=64"], status="failed", concurrency=64)
    write_report(root)
    page = Page(write_html_report(root).read_text())
    md_rows = [[cell.strip() for cell in line.strip("|").split(" | ")]
               for line in (root / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert page.tables["runs"] == md_rows  # same columns, same numbers, one row per job
    assert [row[0] for row in page.tables["runs"][1:]] == ["0", "1", "2", "3"]
    text = (root / "report.html").read_text()
    assert "job 3: failed: RuntimeError: the server died" in text  # the runs left out are listed
    for title in ("Latency vs achieved request rate", "Goodput vs achieved request rate", "Pareto", "TTFT CDF",
                  "ITL CDF", "KV usage over time"):
        assert title in text
    assert "No plot" not in text
    assert len(page.images) == 6
    assert_self_contained(page)


def test_plots_without_data_say_so(tmp_path: Path) -> None:
    root = write_sweep(tmp_path / "peer", levels=(8,), kv=False)  # one run, no KV numbers: an HTTP peer
    text = write_html_report(root).read_text()
    assert "No plot: no run recorded KV usage" in text
    assert text.count("No plot: the sweep has fewer than two successful runs") == 3
    assert_self_contained(Page(text))  # the CDFs still have data


def test_a_failed_run_page_shows_the_error_and_no_broken_plot(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", {}, ["engine=vllm"], status="failed")
    text = write_html_report(run).read_text()
    assert "FAILED: RuntimeError: the server died" in text
    assert text.count("No plot:") == 3 and "<img" not in text


def test_existing_report_html_is_never_replaced_silently(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", {"output_throughput": 12.5}, [])
    first = write_html_report(run)
    (run / "summary.json").write_text((run / "summary.json").read_text().replace("12.5", "99.5"))
    second = write_html_report(run)
    assert second.name == "report_1.html" and "12.5" in first.read_text() and "99.5" in second.read_text()
    assert write_html_report(run, replace=True) == first and "99.5" in first.read_text()


def test_a_folder_that_is_not_a_run_or_sweep_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "missing"))):
        write_html_report(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty.*no job folders"):
        write_html_report(tmp_path / "empty")


def test_run_page_callback_writes_the_page_unless_switched_off(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", {"output_throughput": 3.0}, [])
    RunPageCallback().on_job_end(OmegaConf.create({"html_report": False, "hydra": {"runtime": {"output_dir": str(run)}}}))
    assert not (run / "report.html").exists()
    RunPageCallback().on_job_end(OmegaConf.create({"html_report": True, "hydra": {"runtime": {"output_dir": str(run)}}}))
    assert (run / "report.html").is_file()


def test_pareto_front_keeps_only_runs_nothing_beats_on_both_axes() -> None:
    points = [(10.0, 5.0), (20.0, 4.0), (15.0, 3.0), (5.0, 5.0), (30.0, 1.0)]
    assert pareto_front(points) == [(10.0, 5.0), (20.0, 4.0), (30.0, 1.0)]
