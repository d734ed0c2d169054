"""Every kernel launch passes kitsune's choice of compile options, so a Triton with other defaults changes neither
the results nor the speed."""

from __future__ import annotations

import ast
from pathlib import Path

import kitsune.kernels

KERNELS = Path(kitsune.kernels.__file__).parent


def _launches() -> list[tuple[str, int, ast.Call]]:
    """Each ``kernel[grid](...)`` and ``_common.launcher(kernel, grid, compile_only)(...)`` call in kitsune's kernel
    modules."""
    found = []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            launcher = isinstance(func, ast.Call) and ast.unparse(func.func) == "_common.launcher"
            if isinstance(func, ast.Subscript) or launcher:
                found.append((path.name, node.lineno, node))
    return found


def test_every_launch_passes_the_fp_fusion_choice():
    """`kitsune.kernels.common.FP_FUSION`, read at the launch (so a test may switch it): Triton 3.9 warns that its
    default changes in 3.10, and a launch that leaves it to the default would change with it."""
    launches = _launches()
    assert len(launches) >= 12, [f"{name}:{line}" for name, line, _ in launches]  # the scan finds the launches
    for name, line, call in launches:
        passed = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert passed.get("enable_fp_fusion") == "_common.FP_FUSION", f"{name}:{line}"
