"""Reading dataset and trace files line by line, so every error names its file, line and field.

Benchmark inputs come from outside the project (a ShareGPT dump, a production trace) and are
often damaged: a truncated last line, a record without its ``prompt``, a length written as text.
A loader that fails with ``KeyError: 'prompt'`` leaves the user searching a 100 MB file; these
helpers fail with ``ValueError: data.jsonl:812: field 'prompt' is missing`` instead.

* :func:`jsonl_records` reads JSON Lines (one object per line; blank lines skipped).
* :func:`json_array_records` reads one JSON array of objects and reports each object's line.
* :func:`field` fetches and type-checks one field of a record.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Where:
    """A position in an input file, printed as ``file:line``."""

    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def _read(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: the file is empty")
    return text


def _as_object(value: Any, where: Where) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def jsonl_records(path: str | Path) -> Iterator[tuple[Where, dict[str, Any]]]:
    """``(where, object)`` for every non-blank line of a JSON Lines file."""
    path = Path(path)
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = Where(path, number)
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        yield where, _as_object(value, where)


def json_array_records(path: str | Path) -> Iterator[tuple[Where, dict[str, Any]]]:
    """``(where, object)`` for every element of a file holding one JSON array, each element's
    line being the line its opening brace is on."""
    path = Path(path)
    text = _read(path)
    decoder = json.JSONDecoder()

    def line_of(index: int) -> int:
        return text.count("\n", 0, index) + 1

    def skip_space(index: int) -> int:
        while index < len(text) and text[index].isspace():
            index += 1
        return index

    index = skip_space(0)
    if text[index] != "[":
        raise ValueError(f"{Where(path, line_of(index))}: expected a JSON array of records ('['), got {text[index]!r}")
    index = skip_space(index + 1)
    if index < len(text) and text[index] == "]":
        raise ValueError(f"{path}: the JSON array is empty")
    while True:
        where = Where(path, line_of(index))
        try:
            value, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError as error:
            raise ValueError(f"{Where(path, error.lineno)}: not valid JSON ({error.msg} at column {error.colno})") from None
        yield where, _as_object(value, where)
        index = skip_space(index)
        if index >= len(text):
            raise ValueError(f"{Where(path, line_of(index))}: the JSON array is not closed (']' missing)")
        if text[index] == "]":
            return
        if text[index] != ",":
            raise ValueError(f"{Where(path, line_of(index))}: expected ',' or ']' between records, got {text[index]!r}")
        index = skip_space(index + 1)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list"}


def field(record: dict[str, Any], name: str, kind: type, where: Where, required: bool = True,
          minimum: float | None = None) -> Any:
    """``record[name]`` checked to be of ``kind`` (``float`` accepts integers; ``bool`` is never a
    number) and at least ``minimum``; ``None`` when absent and not ``required``."""
    if name not in record or record[name] is None:
        if required:
            raise ValueError(f"{where}: field {name!r} is missing")
        return None
    value = record[name]
    accepted = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise ValueError(f"{where}: field {name!r} must be {_TYPE_NAMES.get(kind, kind.__name__)}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: field {name!r} must be >= {minimum}, got {value!r}")
    return value
