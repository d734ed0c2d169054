"""Every example runs on CPU in seconds with a small --steps."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name, args", [("basic.py", ["--steps", "20"])])
def test_example_runs(name, args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out
    assert "loss" in out and "profile:" in out
    assert any(tmp_path.glob("*.json"))
