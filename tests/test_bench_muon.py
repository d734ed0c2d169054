"""The Muon benchmark's FLOP counts, its rows (the fusion planner's among them), and its refusal to run off a GPU."""

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


@pytest.mark.parametrize("argv", [["bench", "--muon"], ["bench", "--muon", "--device", "auto"]])
def test_muon_flag_without_a_gpu_is_one_error_line(argv, monkeypatch, capsys):
    """``kitsune bench --muon`` (and ``python -m kitsune.bench --muon``) with the default ``--device auto`` where
    torch sees no GPU: one line saying the benchmark needs a CUDA GPU, exit code 2, no traceback."""
    from kitsune.bench.cli import main as bench_main
    from kitsune.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for run in (lambda: main(argv), lambda: bench_main(argv[1:])):
        assert run() == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("kitsune bench --muon: ") and captured.err.count("\n") == 1
        assert "needs a CUDA GPU" in captured.err and "without --muon" in captured.err


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.filterwarnings("ignore:kitsune. fusion was asked for but is inactive:UserWarning")  # CPU params
def test_step_rows_include_the_fusion_planner():
    """The Muon step is timed for torch.optim.Muon, kitsune.optim.Muon and KitsuneOptimizer(torch.optim.Muon)."""
    from io import StringIO

    from rich.console import Console

    from kitsune import KitsuneOptimizer
    from kitsune.bench.muon import STEP_VARIANTS, print_muon_results

    assert list(STEP_VARIANTS) == ["torch", "kitsune", "planner"]
    opt = STEP_VARIANTS["planner"][1]([torch.nn.Parameter(torch.randn(8, 8))])
    assert isinstance(opt, KitsuneOptimizer) and type(opt.base_optimizer) is torch.optim.Muon
    assert opt.config.fusion.enabled and opt.config.fusion.enable_matmul

    timing = {"device_ms": 1.0, "host_ms": 0.5}
    step = {"torch": {"device_ms": 4.0, "host_ms": 3.0}, "kitsune": timing, "planner": timing}
    ns = {"size": 1024, "torch_ms": 0.26, "torch_graph_ms": 0.21, "kitsune_ms": 0.1, "speedup": 2.6}
    ns |= {"speedup_over_graph": 2.1, "torch_tflops": 1.0, "kitsune_tflops": 1.0, "kitsune_pct_of_matmul": 50.0}
    ns |= {"kitsune_effective_tflops": 1.5}
    result = {"device": "GPU", "matmul_tflops": 1.0, "newton_schulz": [ns], "muon_step": step}
    result["muon_step"] |= {"speedup": 4.0, "planner_speedup": 4.0}
    out = StringIO()
    print_muon_results(result, Console(file=out, width=250))
    assert "KitsuneOptimizer(torch.optim.Muon, enable_fusion=True)" in out.getvalue()
    assert out.getvalue().count("4.00x") == 2
    # torch's function replayed from a CUDA graph beside its direct calls: kitsune's calls replay graphs too
    assert "torch graph ms" in out.getvalue() and "0.210" in out.getvalue() and "2.10x" in out.getvalue()


def test_step_timing_rotates_the_order_and_warms_each_optimizer(monkeypatch):
    """The Muon step's rows are timed in rounds, the order rotated each round, each optimizer stepped untimed just
    before its timed steps (the logic, on CPU tensors, each row an SGD that logs its steps)."""
    from kitsune.bench import muon

    log: list[str] = []

    def recording(name):
        def factory(params):
            opt = torch.optim.SGD(params, lr=0.1)
            opt.register_step_post_hook(lambda *_: log.append(name))
            return opt

        return factory

    variants = {name: (label, recording(name)) for name, (label, _) in muon.STEP_VARIANTS.items()}
    monkeypatch.setattr(muon, "STEP_VARIANTS", variants)
    monkeypatch.setattr(muon, "STEP_SHAPES", [(6, 10), (6, 10)])
    result = muon._muon_step(torch.device("cpu"), steps=6, rounds=3)  # 2 timed steps per round and optimizer
    runs = [name for i, name in enumerate(log) if i == 0 or log[i - 1] != name]
    assert runs == ["torch", "kitsune", "planner"] + ["torch", "kitsune", "planner", "kitsune", "planner", "torch",
                                                     "planner", "torch", "kitsune"]  # fmt: skip
    # 3 to warm up; then per round 2 untimed, 2 for the device timer, 2 for the host timer and 2 checked to move
    assert all(log.count(name) == 3 + 3 * 8 for name in variants)
    assert set(result) == {"torch", "kitsune", "planner", "speedup", "planner_speedup"}
    assert result["speedup"] == result["torch"]["device_ms"] / result["kitsune"]["device_ms"] > 0


def test_a_step_row_whose_params_do_not_move_is_refused(monkeypatch):
    """Each Muon step row's params are snapshotted around its timed steps: a step that changes nothing (lr 0 here)
    raises instead of giving a time."""
    from kitsune.bench import muon
    from kitsune.bench.peers import ParamsDidNotMove

    def make(lr):
        return lambda params: torch.optim.SGD(params, lr=lr)

    variants = {"torch": ("moves", make(0.1)), "kitsune": ("still", make(0.0)), "planner": ("moves too", make(0.1))}
    monkeypatch.setattr(muon, "STEP_VARIANTS", variants)
    monkeypatch.setattr(muon, "STEP_SHAPES", [(6, 10), (6, 10)])
    with pytest.raises(ParamsDidNotMove, match="2 of 2 params unchanged"):
        muon._muon_step(torch.device("cpu"), steps=4, rounds=2)


@pytest.mark.filterwarnings("ignore:kitsune. fusion was asked for but is inactive:UserWarning")  # CPU params
def test_the_planner_row_shows_its_route(monkeypatch):
    """A KitsuneOptimizer row records what its plan ran, and the table prints it (on a CPU: fusion inactive, the
    wrapped optimizer's own step, no graph)."""
    from io import StringIO

    from rich.console import Console

    from kitsune import KitsuneOptimizer
    from kitsune.bench import muon

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    variants = {
        "torch": ("torch SGD", sgd),
        "kitsune": ("another SGD", sgd),
        "planner": ("KitsuneOptimizer(SGD)", lambda ps: KitsuneOptimizer(sgd(ps), enable_fusion=True)),
    }
    monkeypatch.setattr(muon, "STEP_VARIANTS", variants)
    monkeypatch.setattr(muon, "STEP_SHAPES", [(6, 10), (6, 10)])
    step = muon._muon_step(torch.device("cpu"), steps=4, rounds=2)
    assert "route" not in step["torch"] and "route" not in step["kitsune"]
    assert step["planner"]["fused_all"] is False
    assert step["planner"]["route"].startswith("fusion inactive: nothing to fuse: CPU tensors")
    result = {"device": "CPU", "matmul_tflops": 1.0, "newton_schulz": [], "muon_step": step}
    out = StringIO()
    muon.print_muon_results(result, Console(file=out, width=400))
    assert "KitsuneOptimizer(SGD): fusion inactive: nothing to fuse: CPU tensors" in out.getvalue()
