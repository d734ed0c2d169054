"""`benchmarks/ns-codegen.py`: Newton-Schulz's launches compiled for Hopper on a CPU, their loads counted by width.

On an odd-width iterate (100 columns here, 50257 in GPT-2's vocabulary) the iteration buffers' whole k blocks keep
every Gram's and every product's operand loads 16 bytes wide; buffers exactly as wide as the iterate
(``--k-align 1``) drop them to 2-byte loads, which is what the check must tell apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import triton
import triton.runtime.jit as jit

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ns-codegen.py"
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

pytestmark = [
    pytest.mark.skipif(not (TOOLS / "ptxas").exists(), reason="this triton wheel ships no ptxas"),
    pytest.mark.skipif(
        not hasattr(jit, "create_function_from_signature") or not hasattr(jit.JITFunction, "_pack_args"),
        reason="this Triton lacks the launch binder the script specialises arguments with",
    ),
]


def _launches(tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / "launches.json"
    cmd = [sys.executable, str(SCRIPT), "--shape", "1x48x100", "--steps", "3", "--json", str(out), *extra]
    subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.read_text())


def test_iteration_buffers_keep_every_operand_load_16_bytes_wide(tmp_path):
    launches = _launches(tmp_path)
    grams = [r for r in launches if "X X^T" in r["launch"]]
    products = [r for r in launches if "B' X" in r["launch"]]
    assert len(grams) == len(products) == 3
    assert all(r["load16"] >= 16 and r["load_narrow"] <= 4 for r in grams), grams  # the few: tile table, norm
    assert all(r["load16"] >= 16 and r["load_narrow"] == 0 for r in products), products
    assert all(r["store_narrow"] == 0 for r in products[:-1])  # into the padded buffers
    assert products[-1]["store_narrow"] > 0  # the result's rows are 100 elements: no 16-byte store lines up

    unpadded = _launches(tmp_path, "--k-align", "1")
    grams = [r for r in unpadded if "X X^T" in r["launch"]]
    products = [r for r in unpadded if "B' X" in r["launch"]]
    assert all(r["load16"] == 0 and r["load_narrow"] > 16 for r in grams), grams
    assert all(r["load_narrow"] > 16 for r in products), products
