"""Shared test set-up.

Without a GPU, the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), as in CI. Triton picks
interpreter or compiler when a kernel is decorated, so the kernels are imported here with the switch on and the
environment is then restored: tests outside the folders of the kernels and the fused executor (kernels, fusion,
graphs, memory, streams; elsewhere the CPU bit-identical promise holds) see the environment they expect, and the
planner sends CPU params to the fused kernels only inside those folders.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

CPU_ONLY = not torch.cuda.is_available()
INTERPRETED_DIRS = {"kernels", "fusion", "graphs", "memory", "streams"}

if CPU_ONLY:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # before triton.language is imported: its own jit functions are interpreted
    import interpreter_patch

    interpreter_patch.install()
    import kitsune.kernels.common as _common
    import kitsune.kernels.muon_update as _muon_update
    import kitsune.kernels.newton_schulz as _newton_schulz
    import kitsune.kernels.norms as _norms
    import kitsune.kernels.quant as _quant
    import kitsune.kernels.update as _update

    if type(_update._update_kernel).__name__ != "InterpretedFunction":  # imported earlier without the switch
        importlib.reload(_common)  # first: the kernels call its helpers
        importlib.reload(_quant)  # and the update kernel calls the quantization helpers
        importlib.reload(_update)
        importlib.reload(_norms)
        importlib.reload(_newton_schulz)
        importlib.reload(_muon_update)
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _interpret(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner sends CPU params to the fused kernel only under TRITON_INTERPRET=1."""
    if CPU_ONLY and request.node.path.parent.name in INTERPRETED_DIRS:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu") if CPU_ONLY else torch.device("cuda")


@pytest.fixture(scope="session", autouse=True)
def _native_checks() -> None:
    """Build (or load from torch's cache) the native address check before any test runs, so that no test depends
    on how fast a background build is. Where it cannot build, the tests run the Python checks and
    tests/fusion/test_address_checks.py fails with the reason."""
    from kitsune import _native

    _native.wait(timeout=600)


@pytest.fixture(params=["native", "torch"])
def check_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on each per-step address check: the native one (`kitsune._native`), and torch's C++ check that
    units use while it builds (on a CPU build of torch, a Python stand-in with its contract)."""
    from twins import ptrs_equal_stand_in

    from kitsune import _native
    from kitsune.fusion import units

    if request.param == "native":
        assert _native.CHECKS is not None, f"the native address check is unavailable: {_native.reason()}"
    else:
        monkeypatch.setattr(_native, "CHECKS", None)
        monkeypatch.setattr(units, "_PTRS_EQUAL", units._PTRS_EQUAL or ptrs_equal_stand_in)
    return request.param
