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
    assert "adam 8bit, 2 warps, TILE 512" in out  # the vector layout, as the launcher picks it
    loop = int(re.search(r"loop: (\d+) instructions", out).group(1))
    kernel = int(re.search(r"kernel: (\d+) instructions", out).group(1))
    assert 50 < loop < kernel
    assert int(re.search(r"registers (\d+)", out).group(1)) > 0
    sass = dump.read_text()
    # the vector layout reads and writes a thread's 8 params as 16-byte vectors and its 8 codes as 8-byte ones, and
    # reduces a block's absmax across a warp's lanes
    assert "LDG.E.128" in sass and "STG.E.128" in sass and "STG.E.64" in sass and "SHFL.BFLY" in sass
