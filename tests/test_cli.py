"""The `kitsune` command: demo and doctor run end to end."""

from __future__ import annotations

import json
import subprocess
import sys

from kitsune.cli import main
from kitsune.demo import run_demo


def test_demo_runs_and_matches_torch_on_cpu(tmp_path, capsys):
    out = tmp_path / "demo-profile.json"
    result = run_demo(steps=6, device="cpu", profile_path=out)
    assert result.max_loss_diff == 0.0  # on CPU kitsune runs the wrapped optimizer: bit-identical
    assert result.kitsune.losses[-1] < result.kitsune.losses[0]
    data = json.loads(out.read_text())
    assert data["step_count"] == 6 and len(data["steps"]) == 6


def test_demo_command_line(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["demo", "--steps", "4", "--device", "cpu", "--profile-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "torch vs kitsune" in text and "bit-identical" in text and str(out) in text.replace("\n", "")
    assert "subsystems" in text and out.exists()


def test_demo_rejects_zero_steps(capsys):
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_doctor_reports_machine_and_subsystems(capsys):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    for word in ("torch", "CUDA", "Triton", "NVML", "fusion", "profiler"):
        assert word in text


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "kitsune", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in proc.stdout and "doctor" in proc.stdout
