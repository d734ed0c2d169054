"""``--device`` of ``kitsune demo`` and ``kitsune bench``: one parser (``kitsune._device``), one message per case.

CPU only: the GPUs torch sees are monkeypatched, and a refused device fails before anything runs.
"""

from __future__ import annotations

import pytest
import torch

from kitsune._device import parse_device
from kitsune.bench.runner import _resolve_device
from kitsune.cli import build_parser, main

UNKNOWN = "choose auto, cpu, cuda or cuda:N (N: a GPU index), got {!r}"
NO_GPU = (
    "{} asked for, but torch " + torch.__version__ + " sees no CUDA GPU: use --device cpu, or --device auto to take a "
    "GPU only when there is one"
)
NOT_DEVICES = ("cpu:1", "cpu:0", "mps", "gpu", "", "CUDA", "Cpu", "AUTO", "cuda:", "cuda:-1", "cuda:01", " cuda")
"""A CPU index, other device types, no text, other cases, bad indices, spaces: refused, listing what is accepted."""


def see_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Make torch see ``count`` CUDA GPUs (0: none), cuda:0 the current one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize(
    ("gpus", "text", "demo", "bench"),
    [
        (0, "auto", "cpu", "cpu"),
        (1, "auto", "cuda", "cuda:0"),  # bench gives a bare cuda the current GPU's index
        (0, "cpu", "cpu", "cpu"),
        (1, "cpu", "cpu", "cpu"),
        (1, "cuda", "cuda", "cuda:0"),
        (1, "cuda:0", "cuda:0", "cuda:0"),
        (2, "cuda:1", "cuda:1", "cuda:1"),
    ],
)
def test_accepted(gpus, text, demo, bench, monkeypatch):
    see_gpus(monkeypatch, gpus)
    assert parse_device(text) == torch.device(demo)
    assert build_parser().parse_args(["demo", "--device", text]).device == demo
    assert _resolve_device(text) == torch.device(bench)


def test_auto_is_the_default_of_both_commands(monkeypatch):
    see_gpus(monkeypatch, 1)
    assert build_parser().parse_args(["demo"]).device == "cuda"
    assert build_parser().parse_args(["bench"]).device == "auto"  # run_bench resolves it, as _resolve_device(None)
    assert _resolve_device("auto") == _resolve_device(None) == torch.device("cuda", 0)
    see_gpus(monkeypatch, 0)
    assert build_parser().parse_args(["demo"]).device == "cpu" and _resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize(
    ("gpus", "text", "message"),
    [
        (0, "cuda", NO_GPU.format("cuda")),
        (0, "cuda:0", NO_GPU.format("cuda:0")),
        (0, "cuda:1", NO_GPU.format("cuda:1")),
        (1, "cuda:1", "cuda:1 asked for, but torch sees 1 CUDA GPU: use cuda:0 or cuda"),
        (4, "cuda:4", "cuda:4 asked for, but torch sees 4 CUDA GPUs: use cuda:0 to cuda:3 or cuda"),
        (4, "cuda:7", "cuda:7 asked for, but torch sees 4 CUDA GPUs: use cuda:0 to cuda:3 or cuda"),
        *[(gpus, text, UNKNOWN.format(text)) for gpus in (0, 1) for text in NOT_DEVICES],
    ],
)
def test_refused_with_one_message_for_both_commands(gpus, text, message, monkeypatch, capsys):
    """Each refusal: the same message from both commands, each in its own way, exit code 2 and no traceback."""
    see_gpus(monkeypatch, gpus)
    with pytest.raises(ValueError) as info:
        parse_device(text)
    assert str(info.value) == message

    # demo: an argparse error (usage, then the error line)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", "1", "--device", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kitsune demo") and "Traceback" not in err
    assert err.splitlines()[-1] == f"kitsune demo: error: argument --device: {message}"

    # bench: one line, before anything runs
    assert main(["bench", "--sets", "many", "--variants", "fused", "--steps", "1", "--device", text]) == 2
    assert capsys.readouterr().err == f"kitsune bench: --device: {message}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cuda:3", "cuda:3 asked for, but torch sees 1 CUDA GPU: use cuda:0 or cuda"),
        ("gpu", UNKNOWN.format("gpu")),
        ("cpu:1", UNKNOWN.format("cpu:1")),
    ],
)
def test_muon_bench_refuses_with_the_same_messages(text, message, monkeypatch, capsys):
    """``kitsune bench --muon --device ...`` where torch sees one GPU: the shared message in the --muon line, exit
    code 2, before any GPU work (cuda:3 used to reach torch.cuda.device and end in a traceback)."""
    see_gpus(monkeypatch, 1)
    assert main(["bench", "--muon", "--device", text]) == 2
    assert capsys.readouterr().err == f"kitsune bench --muon: {message}\n"
