"""The distribution: a wheel builds without deprecation warnings, ships the license, and states what kitsune needs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import NamedTuple

import pytest

import kitsune

ROOT = Path(__file__).resolve().parents[1]


class Built(NamedTuple):
    wheel: Path
    log: str
    """pip's and the build backend's output (pip -v shows the backend's warnings)."""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """A wheel built offline from a copy of the sources (the build leaves build/ and *.egg-info where it runs)."""
    try:
        major = int(version("setuptools").split(".")[0])
    except PackageNotFoundError:
        major = 0
    if major < 77:
        pytest.skip("the build needs setuptools>=77 installed (PEP 639 license fields); --no-build-isolation uses it")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kitsune", src / "kitsune", ignore=shutil.ignore_patterns("__pycache__"))
    dist = src / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = dist.glob("kitsune_optim-*.whl")
    return Built(wheel, proc.stdout + proc.stderr)


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        return whl.read(name).decode()


def test_wheel_builds_without_deprecation_warnings(built):
    license_lines = [
        line for line in built.log.splitlines() if "deprecat" in line.lower() and "license" in line.lower()
    ]
    assert not license_lines, "\n".join(license_lines)  # `license = {text = ...}`, License classifiers
    assert "SetuptoolsDeprecationWarning" not in built.log, built.log[-4000:]


def test_wheel_ships_the_apache_license(built):
    with zipfile.ZipFile(built.wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        text = whl.read(name).decode()
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "Copyright 2026 kitsune developers" in text
    metadata = _metadata(built.wheel)
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata


def test_wheel_requires_the_tested_torch_and_numpy(built):
    requires = re.findall(r"^Requires-Dist: ([^;\n]+)", _metadata(built.wheel), flags=re.M)
    assert "torch>=2.11" in requires  # the oldest torch kitsune is tested on
    assert any(r.startswith("numpy") for r in requires)  # without it, importing torch warns on every command


def test_version_is_the_distributions(built):
    assert f"\nVersion: {kitsune.__version__}\n" in _metadata(built.wheel)


def test_readme_installs_from_a_clone_until_the_package_is_published():
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^pip install \.\s", install, flags=re.M)  # works from a clone, published or not
    assert "python -m pip wheel --no-deps . -w dist" in install and "pip install dist/kitsune_optim-*.whl" in install
    assert "Once it is published, `pip install kitsune-optim`" in install
    docs = (ROOT / "docs" / "installation.md").read_text()
    assert (
        re.search(r"^pip install \.\s", docs, flags=re.M)
        and "Once kitsune is published, `pip install kitsune-optim`" in docs
    )
    assert "PyTorch 2.11 or newer" in docs and "`torch>=2.11`" in docs
