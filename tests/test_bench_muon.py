"""The Muon benchmark's FLOP counts, and its refusal to run off a GPU."""

from __future__ import annotations

import pytest
import torch

from kitsune.bench.muon import flops, run_muon_bench


def test_flop_counts():
    plain, sym = flops(4096, 4096, steps=1)
    assert plain == 6 * 4096**3 and sym == 4 * 4096**3  # symmetric: two thirds for a square matrix
    assert flops(1024, 3072) == flops(3072, 1024)  # a tall matrix is transposed first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_cpu():
    with pytest.raises(ValueError, match="CUDA GPU"):
        run_muon_bench("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cli_flag_refuses_cpu_with_a_message(capsys):
    from kitsune.bench.cli import main

    assert main(["--muon", "--device", "cpu"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
