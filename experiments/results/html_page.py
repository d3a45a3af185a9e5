"""Building blocks of a self-contained HTML page: escaped text, tables, embedded images, sections.

A report page is opened from a laptop, an archive or a CI artifact, often with no network, so
it must carry everything it shows: its style is an inline ``<style>`` block, it has no script,
and every image is a PNG embedded in the ``src`` attribute as a ``data:image/png;base64,...`` URI
(a browser decodes it like a file; nothing is fetched). A plot with no data becomes a sentence
saying which data is missing, never a broken image.
"""
from __future__ import annotations

import base64
import html
from collections.abc import Sequence

import matplotlib.pyplot as plt

from experiments.results.plots import figure_png

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em 2em; color: #1d1d1f; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.82em; margin: 0.6em 0; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f0f0f3; position: sticky; top: 0; }
tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.scroll { overflow-x: auto; max-width: 100%; }
.failed { color: #a00; font-weight: bold; }
.no-data { color: #666; font-style: italic; border: 1px dashed #bbb; padding: 0.6em; display: inline-block; }
figure { margin: 0.8em 0; } figcaption { font-size: 0.85em; color: #444; }
img { max-width: 100%; height: auto; }
pre { background: #f6f6f8; padding: 0.6em; font-size: 0.8em; overflow-x: auto; }
"""


def escape(value: object) -> str:
    return html.escape(str(value), quote=True)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def table(header: Sequence[str], rows: Sequence[Sequence[str]], table_id: str) -> str:
    """An HTML table of already formatted cells (numbers right-aligned), scrolling sideways when wide."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{escape(c)}</td>' if _is_number(c) else f"<td>{escape(c)}</td>" for c in row) + "</tr>"
        for row in rows)
    return f'<div class="scroll"><table id="{escape(table_id)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def png_image(png: bytes, alt: str) -> str:
    """``<img>`` carrying ``png`` in a data: URI."""
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def legends_outside(fig: plt.Figure) -> plt.Figure:
    """Move every legend of ``fig`` to the right of its axes, so a sweep's many curves stay visible."""
    for ax in fig.axes:
        if ax.get_legend() is not None:
            handles, labels = ax.get_legend_handles_labels()
            ax.legend(handles, labels, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return fig


def figure(title: str, fig: plt.Figure | None, missing: str, caption: str = "") -> str:
    """A titled plot: the figure embedded as PNG (legends beside the axes), or, when ``fig`` is ``None``,
    the sentence ``missing``."""
    if fig is None:
        body = f'<p class="no-data">No plot: {escape(missing)}</p>'
    else:
        png = figure_png(legends_outside(fig))
        body = png_image(png, title) + (f"<figcaption>{escape(caption)}</figcaption>" if caption else "")
    return f"<h3>{escape(title)}</h3><figure>{body}</figure>"


def section(title: str, *parts: str) -> str:
    return f"<section><h2>{escape(title)}</h2>{''.join(parts)}</section>"


def paragraph(text: str, css_class: str = "") -> str:
    return f'<p class="{css_class}">{escape(text)}</p>' if css_class else f"<p>{escape(text)}</p>"


def bullet_list(items: Sequence[str]) -> str:
    return "<ul>" + "".join(f"<li>{escape(item)}</li>" for item in items) + "</ul>"


def preformatted(text: str) -> str:
    return f"<pre>{escape(text)}</pre>"


def details(summary: str, body: str) -> str:
    """A collapsed block (``<details>``) the reader opens by clicking ``summary``."""
    return f"<details><summary>{escape(summary)}</summary>{body}</details>"


def page(title: str, sections: Sequence[str]) -> str:
    """A whole HTML document: ``title``, the inline style, then ``sections`` in order."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head>"
            f"<body><h1>{escape(title)}</h1>{''.join(sections)}</body></html>\n")
