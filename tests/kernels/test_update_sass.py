"""`benchmarks/update-sass.py`: the fused update compiled for Hopper on a CPU, its tile loop found and counted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "update-sass.py"
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (TOOLS / "nvdisasm").exists(), reason="this triton wheel ships no nvdisasm")
def test_the_8bit_update_compiles_for_hopper_and_its_loop_is_counted(tmp_path):
    dump = tmp_path / "update.sass"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--optimizer", "adam", "--dump", str(dump)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "adam 8bit, 4 warps, TILE 256" in out
    loop = int(re.search(r"loop: (\d+) instructions", out).group(1))
    kernel = int(re.search(r"kernel: (\d+) instructions", out).group(1))
    assert 50 < loop < kernel
    assert int(re.search(r"registers (\d+)", out).group(1)) > 0
    sass = dump.read_text()
    # the loop reads each tile's codes as words and stores them as bytes, and reduces a block's absmax across lanes
    assert "LDG.E " in sass and "STG.E.U8" in sass and "SHFL.BFLY" in sass
