"""The engine owns the plug-in interfaces: no module under engine/ imports strategies/."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_engine_never_imports_strategies():
    offenders = {
        str(path.relative_to(ENGINE.parent)): [m for m in imported_modules(path) if m.split(".")[0] == "strategies"]
        for path in ENGINE.rglob("*.py")
    }
    offenders = {path: mods for path, mods in offenders.items() if mods}
    assert not offenders, f"engine modules import strategies/: {offenders}"


def test_the_check_sees_imports(tmp_path):
    # The checker itself must notice an import, or the test above could never fail.
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom strategies.cache.paged import PagedCache\n")
    assert "strategies.cache.paged" in imported_modules(sample)
