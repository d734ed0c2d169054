"""``kitsune doctor``: what this machine supports and which subsystems would be active."""

from __future__ import annotations

import os
from typing import Any

import torch
from rich.console import Console
from rich.table import Table


def _triton() -> tuple[str | None, str | None]:
    try:
        import triton
    except ImportError as exc:
        return None, str(exc)
    return triton.__version__, None


def _nvml() -> tuple[bool, str]:
    try:
        import pynvml
    except ImportError:
        return False, "nvidia-ml-py is not installed: pip install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml raises NVMLError subclasses; any failure means "no NVML here"
        return False, f"nvmlInit failed: {exc}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    driver = driver.decode() if isinstance(driver, bytes) else driver
    return True, f"driver {driver}, {count} device(s)"


def diagnose() -> dict[str, Any]:
    """Facts about this machine as a dict (what ``kitsune doctor`` prints)."""
    from kitsune import KitsuneOptimizer, __version__

    cuda = torch.cuda.is_available()
    triton_version, triton_error = _triton()
    nvml_ok, nvml_detail = _nvml()
    device = torch.device("cuda" if cuda else "cpu")
    probe = torch.nn.Parameter(torch.zeros(4, dtype=torch.float32, device=device))
    with _quiet_warnings():
        opt = KitsuneOptimizer(torch.optim.AdamW([probe]), enable_fusion=True, enable_amp=cuda, profile=True)
    return {
        "kitsune": __version__,
        "torch": torch.__version__,
        "cuda": {
            "available": cuda,
            "version": torch.version.cuda,
            "device": torch.cuda.get_device_name() if cuda else None,
        },
        "triton": {
            "version": triton_version,
            "error": triton_error,
            "interpret": os.environ.get("TRITON_INTERPRET") == "1",
        },
        "nvml": {"available": nvml_ok, "detail": nvml_detail},
        "subsystems": opt.subsystem_status(),
    }


class _quiet_warnings:
    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def print_doctor(console: Console | None = None) -> dict[str, Any]:
    from kitsune.profiler.summary import subsystem_table

    console = console or Console()
    info = diagnose()
    table = Table(title="kitsune doctor", title_justify="left")
    table.add_column("component")
    table.add_column("status", overflow="fold")
    ok, bad = "[green]yes[/]", "[yellow]no[/]"
    table.add_row("kitsune", info["kitsune"])
    table.add_row("torch", info["torch"])
    c = info["cuda"]
    table.add_row("CUDA", f"{ok} {c['version']}, {c['device']}" if c["available"] else f"{bad} (CPU only)")
    t = info["triton"]
    triton_line = f"{ok} {t['version']}" if t["version"] else f"{bad} {t['error']}"
    if t["interpret"]:
        triton_line += " (TRITON_INTERPRET=1: kernels run in the CPU interpreter)"
    table.add_row("Triton", triton_line)
    n = info["nvml"]
    table.add_row("NVML", f"{ok} {n['detail']}" if n["available"] else f"{bad} ({n['detail']})")
    console.print(table)
    console.print("with enable_fusion=True, profile=True" + (", enable_amp=True" if c["available"] else "") + ":")
    console.print(subsystem_table(info["subsystems"]))
    return info
