"""The `kitsune` command: demo, doctor and report end to end, and what each refuses (one error line, exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


def test_demo_refuses_cuda_without_a_gpu(monkeypatch, capsys):
    """``--device cuda`` where torch sees no GPU: an argparse error naming the fix, not torch's traceback."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(SystemExit) as info:
            main(["demo", "--steps", "1", "--device", device])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "kitsune demo: error: argument --device:" in err and "no CUDA GPU" in err
        assert "--device cpu" in err and "--device auto" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        main(["demo", "--device", "gpu"])
    assert info.value.code == 2
    assert "choose auto, cpu, cuda or cuda:N" in capsys.readouterr().err


def _write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d, "is a directory, not a profile JSON written by save_profile()"),
        (lambda d: d / "missing.json", "missing.json: no such file"),
        (lambda d: _write_bytes(d / "p.json", b'{"schema_version": "\xff"}'), "is not UTF-8 text"),
        (lambda d: _write_bytes(d / "p.json", b"schema_version: 1.0\n"), "is not JSON (expected value"),
        (lambda d: _write_bytes(d / "p.json", b"[1, 2]"), "its top level is not an object"),
        (
            lambda d: _write_bytes(d / "p.json", b'{"schema_version": "0.9", "environment": {"kitsune": "0.0.1"}}'),
            "schema_version '0.9' is not one this kitsune reads (1.0); written by kitsune 0.0.1: re-save the profile",
        ),
        (lambda d: _write_bytes(d / "p.json", b'{"schema_version": "1.0"}'), "is not a kitsune profile: created:"),
    ],
    ids=["directory", "missing", "not-utf8", "not-json", "not-an-object", "old-schema", "missing-fields"],
)
def test_report_names_what_is_wrong_with_the_file(tmp_path, capsys, make, expected):
    """``kitsune report PATH`` on what is not a profile: one error line naming the problem, exit code 2."""
    path = make(tmp_path)
    assert main(["report", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"kitsune report: {path}") and captured.err.count("\n") == 1
    assert expected in captured.err
