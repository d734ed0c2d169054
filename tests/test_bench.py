"""``kitsune bench``: parameter sets, the runner on CPU, JSON, the command; on a GPU, all four variants."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import time

import pytest
import torch
from rich.console import Console

from kitsune.bench import (
    ADAMW_BYTES_PER_PARAM,
    PARAM_SETS,
    BenchResult,
    get_param_set,
    main,
    make_params,
    make_variant,
    register,
    run_bench,
)
from kitsune.bench.timing import StepTimes, paired_rounds, percentile, time_steps


def quiet() -> Console:
    return Console(file=io.StringIO(), width=160)


@pytest.mark.parametrize(
    ("name", "tensors", "elements"),
    [
        ("gpt2", 148, 124_439_808),  # GPT-2 124M without the lm head (tied to wte)
        ("many", 2000, 2000 * 4096),
        # embed + lm head 2 * 32000 * 2048, per layer 4 * 2048^2 + 3 * 2048 * 8192 + 2 * 2048, final norm 2048
        ("llama1b", 147, 2 * 32000 * 2048 + 16 * (4 * 2048**2 + 3 * 2048 * 8192 + 2 * 2048) + 2048),
        ("resnet50", 161, 25_557_032),  # torchvision's resnet50: 53 convs, 53 batch norms' weight and bias, fc
    ],
)
def test_full_scale_sets_have_documented_sizes(name, tensors, elements):
    pset = PARAM_SETS[name]
    assert pset.n_tensors == len(pset.shapes) == tensors
    assert pset.n_elements == sum(math.prod(shape) for _, shape in pset.shapes) == elements
    assert len({n for n, _ in pset.shapes}) == tensors  # names are unique


def test_llama1b_is_about_1_2b_and_gpt2_floor_matches_design():
    assert 1.2e9 <= PARAM_SETS["llama1b"].n_elements < 1.21e9
    # DESIGN.md: 124M params * 28 bytes at 3.0 TB/s is 1.16 ms
    assert PARAM_SETS["gpt2"].n_elements * ADAMW_BYTES_PER_PARAM / 3.0e12 * 1e3 == pytest.approx(1.16, abs=0.01)


@pytest.mark.parametrize("scale", [1.0, 0.001])
def test_the_resnet50_set_is_a_channels_last_net(scale):
    """Its params as `make_params` gives them: every conv weight and its grad in channels_last order, the 3x3 and
    7x7 ones in that order alone at any scale (the scale shrinks their channels, not their kernels)."""
    pset = get_param_set("resnet50", scale)
    params = make_params(pset, "cpu")
    convs = [p for p in params if p.dim() == 4]
    assert len(convs) == 53 and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert all(p.grad.is_contiguous(memory_format=torch.channels_last) for p in convs)
    spatial = [p for p in convs if p.shape[2] > 1 and p.shape[1] > 1]
    assert len(spatial) >= 16 and not any(p.is_contiguous() for p in spatial)
    assert 0.0005 < pset.n_elements / PARAM_SETS["resnet50"].n_elements <= 1


def test_scaling_keeps_tensor_count_and_shrinks_elements():
    full = PARAM_SETS["gpt2"]
    small = get_param_set("gpt2", 0.001)
    assert small.n_tensors == full.n_tensors
    assert 0.0005 < small.n_elements / full.n_elements < 0.002
    assert all(min(shape) >= 1 for _, shape in small.shapes)
    with pytest.raises(ValueError, match="scale"):
        get_param_set("gpt2", 0.0)
    with pytest.raises(ValueError, match="unknown parameter set"):
        get_param_set("gpt3")


def test_params_are_seeded_with_random_grads():
    pset = get_param_set("gpt2", 0.001)
    a, b = make_params(pset, "cpu", seed=3), make_params(pset, "cpu", seed=3)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y) and torch.equal(x.grad, y.grad)
        assert x.grad.abs().min() > 0 or x.numel() < 4  # never zeros


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 10) == pytest.approx(1.1)
    assert percentile([5.0], 90) == 5.0


def test_cpu_variants_end_at_the_same_params():
    pset = get_param_set("gpt2", 0.001)
    finals = {}
    for name in ("foreach", "fused", "kitsune"):
        params = make_params(pset, "cpu", seed=0)
        variant = make_variant(name, params)
        variant.warmup(2)
        for _ in range(3):
            variant.step()
        variant.close()
        finals[name] = [p.detach().clone() for p in params]
    for name in ("foreach", "kitsune"):
        for x, y in zip(finals[name], finals["fused"], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_run_bench_on_cpu_and_json_round_trip(tmp_path, monkeypatch):
    from kitsune.bench import pairs

    monkeypatch.setattr(pairs, "PROFILER_ROUNDS", 2)  # one round a build order (the rounds: tests further down)
    path = tmp_path / "out" / "bench.json"
    result = run_bench(
        sets=["gpt2", "many"], device="cpu", steps=2, warmup=1, phase=True, json_path=path, console=quiet()
    )
    assert result.complete and result.timer == "perf_counter" and result.copy_bandwidth_gbs > 0
    assert [s.name for s in result.sets] == ["gpt2", "many"]
    for entry in result.sets:
        assert entry.floor_ms > 0 and entry.bytes_per_step == ADAMW_BYTES_PER_PARAM * entry.n_elements
        by_name = {v.variant: v for v in entry.variants}
        assert list(by_name) == ["foreach", "fused", "graph", "kitsune", "fresh", "eager", "static", "profiled"]
        for name in ("foreach", "fused", "kitsune", "fresh", "eager", "static", "profiled"):
            v = by_name[name]
            assert v.status == "ok", v.reason
            assert v.device_ms.median > 0 and v.host_ms.median > 0 and len(v.device_ms_steps) == 2
            assert v.device_ms.p10 <= v.device_ms.median <= v.device_ms.p90
            assert v.busy_host_ms == v.device_ms  # on a CPU the device pass's times are its calls' wall times
        assert by_name["graph"].status == "skipped" and "CUDA" in by_name["graph"].reason
        assert set(entry.ratio_to_kitsune) == {"foreach", "fused", "fresh", "eager", "static", "profiled"}
        assert "profiler" in by_name["profiled"].kitsune.active_subsystems
        assert "profiler" not in by_name["kitsune"].kitsune.active_subsystems
        info = by_name["kitsune"].kitsune
        assert info is not None and info.total_params == entry.n_tensors
        assert {s["name"] for s in info.subsystems} >= {"fusion", "profiler"}
        assert info.fused_all is False or info.fusion_active  # inactive fusion never claims to have fused all
        cost = entry.profiler_cost  # both kitsune variants ran: the profiler's cost measured in pairs too
        assert cost is not None and entry.profiler_cost_reason is None
        assert (cost.rounds, cost.steps) == (2, 2)
        assert all(math.isfinite(x) for x in (cost.device_pct.median, cost.host_ms.median, cost.host_ms.p90))
    torch_side, kitsune_side, scaler_side = result.phase.variants
    assert result.phase.workload == "amp_clip_phase" and torch_side.status == "ok" and torch_side.device_ms.median > 0
    assert kitsune_side.status == "ok" and kitsune_side.device_ms.median > 0
    assert scaler_side.status == "ok" and scaler_side.variant == "kitsune_scaler"
    assert result.phase.ratio_to_kitsune.keys() == {"fused", "kitsune_scaler"}
    # kitsune's sides say what they ran with (a fallback would show in the notes, not pass for kitsune's time)
    assert torch_side.kitsune is None
    assert kitsune_side.kitsune is not None and "amp" in kitsune_side.kitsune.active_subsystems
    assert scaler_side.kitsune is not None and scaler_side.kitsune.total_params == len(get_param_set("gpt2").shapes)

    loaded = BenchResult.load(path)
    assert loaded == result
    raw = json.loads(path.read_text())
    assert raw["environment"]["torch"] == torch.__version__ and raw["command"] and raw["created"]

    # the chart of the same JSON: one bar per variant that ran, as long as its share of the floor
    from xml.dom.minidom import parseString

    from kitsune.bench.plot import _BAR, main, write_svg

    svg = write_svg(path, tmp_path / "bench.svg").read_text()
    dom = parseString(svg)
    texts = [t.firstChild.data for t in dom.getElementsByTagName("text") if t.firstChild]
    bars = dom.getElementsByTagName("rect")[1:]  # after the background
    ran = [v for entry in (*result.sets, result.phase) for v in entry.variants if v.status == "ok"]
    assert len(bars) == len(ran)
    for bar, v in zip(bars, ran, strict=True):
        assert float(bar.getAttribute("width")) == pytest.approx(
            max(_BAR * min(v.pct_of_floor, 100) / 100, 1), abs=0.06
        )
        assert v.label in texts
    assert "skipped" in texts  # the graph variant, which needs CUDA
    assert main([str(path)]) == 2

    # an 8-bit row's bar is against the set's fp32 floor too (its table column: its own smaller floor), so a step
    # faster than fp32's floor fills the bar, and its text gives both shares
    from kitsune.bench.plot import bench_svg
    from kitsune.bench.timing import Stats
    from kitsune.bench.variants import BYTES_PER_PARAM

    entry = loaded.sets[0]
    ms = entry.floor_ms / 1.6  # 160% of the fp32 floor; 8-bit moves 16.06 of fp32's 28 bytes: 92% of its own
    own = 100 * entry.floor_ms * BYTES_PER_PARAM["8bit"] / 28 / ms
    row = entry.variants[0].model_copy(update={"variant": "8bit", "label": "kitsune, 8-bit state"})
    row.device_ms, row.pct_of_floor = Stats.of([ms]), own
    entry.variants = [row]
    dom = parseString(bench_svg(loaded.model_copy(update={"sets": [entry], "phase": None})))
    bars = dom.getElementsByTagName("rect")[1:]
    texts = [t.firstChild.data for t in dom.getElementsByTagName("text") if t.firstChild]
    assert len(bars) == 1 and float(bars[0].getAttribute("width")) == pytest.approx(_BAR, abs=0.06)
    assert f"{ms:.3f} ms (160%; 92% of its own floor, 16.06 B/param)" in texts


def test_a_warmup_too_short_for_kitsunes_capture_is_refused_on_cuda(monkeypatch):
    """With fewer warm-up steps than kitsune's eager steps and its capture, the capture was timed as a step."""
    from kitsune.bench import runner

    monkeypatch.setattr(runner, "_resolve_device", lambda device: torch.device("cuda"))
    with pytest.raises(ValueError, match="warmup must be at least 4 on CUDA, got 3"):
        run_bench(sets=["gpt2"], warmup=3, console=quiet())


def test_run_bench_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown variant"):
        run_bench(sets=["gpt2"], variants=["sgd"], device="cpu", console=quiet())
    with pytest.raises(ValueError, match="warmup"):
        run_bench(sets=["gpt2"], device="cpu", warmup=0, console=quiet())
    with pytest.raises(ValueError, match="add --e2e"):
        run_bench(sets=["gpt2"], device="cpu", compile_backend="inductor", console=quiet())
    with pytest.raises(ValueError, match="add --e2e"):
        run_bench(sets=["gpt2"], device="cpu", e2e_steps=100, console=quiet())
    with pytest.raises(ValueError, match="e2e_steps must be at least 1"):
        run_bench(sets=["gpt2"], device="cpu", e2e=True, e2e_steps=0, console=quiet())
    with pytest.raises(ValueError, match="add --e2e"):
        run_bench(sets=["gpt2"], device="cpu", e2e_batch=16, console=quiet())
    with pytest.raises(ValueError, match="e2e_batch must be at least 1"):
        run_bench(sets=["gpt2"], device="cpu", e2e=True, e2e_batch=0, console=quiet())


def test_e2e_options_reach_the_end_to_end_run():
    result = run_bench(
        sets=["gpt2"], variants=["fused"], device="cpu", steps=1, e2e=True, e2e_steps=1, e2e_batch=3, console=quiet()
    )
    assert result.e2e is not None and result.e2e.batch == 3 and result.e2e.steps == 1
    assert all(len(side.losses) == result.e2e.warmup + 1 for side in result.e2e.sides)


def test_gc_clock_sums_collections_while_installed():
    import gc

    from kitsune.bench.timing import GcClock

    with GcClock() as clock:
        gc.collect()
        gc.collect()
    assert clock.ms > 0.0 and clock._callback not in gc.callbacks
    after = clock.ms
    gc.collect()  # removed: no longer counted
    assert clock.ms == after


def test_auto_device_names_the_current_gpu(monkeypatch):
    from kitsune.bench.runner import _resolve_device

    assert _resolve_device("auto") == torch.device("cpu") or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    # with an index: torch.cuda.set_device and the allocator's counters refuse a bare "cuda"
    assert _resolve_device("auto") == _resolve_device(None) == _resolve_device("cuda") == torch.device("cuda", 3)


def test_register_adds_bench_subcommand(tmp_path):
    parser = argparse.ArgumentParser(prog="kitsune")
    register(parser.add_subparsers(dest="command", required=True))
    path = tmp_path / "b.json"
    argv = ["bench", "--sets", "many", "--variants", "fused,kitsune", "--steps", "2", "--device", "cpu"]
    args = parser.parse_args([*argv, "--json", str(path)])
    assert args.sets == ["many"] and args.variants == ["fused", "kitsune"] and args.timed_steps == 2
    assert not hasattr(args, "steps")  # kitsune's top-level main() checks args.steps as an int
    assert args.compile_backend is None
    assert args.e2e_steps is None and parser.parse_args(["bench", "--e2e-steps", "7"]).e2e_steps == 7
    assert args.e2e_batch is None and parser.parse_args(["bench", "--e2e-batch", "16"]).e2e_batch == 16
    assert parser.parse_args(["bench", "--e2e", "--compile"]).compile_backend == "inductor"
    assert parser.parse_args(["bench", "--e2e", "--compile", "aot_eager"]).compile_backend == "aot_eager"
    assert args.func(args) == 0
    assert [v.variant for v in BenchResult.load(path).sets[0].variants] == ["fused", "kitsune"]
    for bad in (["--sets", "gpt3"], ["--variants", "sgd"], ["--steps", "0"], ["--scale", "2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", *bad])


@pytest.mark.parametrize(
    ("argv", "listed"),
    [
        (["--sets", ","], "gpt2, many, llama1b, resnet50"),
        (["--sets", ""], "gpt2, many, llama1b, resnet50"),
        (["--sets", "gpt3"], "gpt2, many, llama1b, resnet50"),
        (["--variants", " , "], "foreach, fused, graph, kitsune"),
        (["--variants", "sgd,adam"], "foreach, fused, graph, kitsune"),
    ],
)
def test_empty_or_unknown_names_are_an_argparse_error(argv, listed, capsys):
    """``--sets ,`` and the like name no set: an error listing the valid names, not a run of nothing (exit 0)."""
    with pytest.raises(SystemExit) as info:
        main([*argv, "--device", "cpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {argv[0]}:" in err and listed in err


def test_an_unknown_device_is_one_error_line(capsys):
    assert main(["--sets", "gpt2", "--steps", "2", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err == "kitsune bench: --device: choose auto, cpu, cuda or cuda:N (N: a GPU index), got 'tpu'\n"


def test_module_entry_point(capsys):
    assert main(["--sets", "gpt2", "--variants", "fused,graph", "--steps", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "torch fused" in out and "skipped" in out and "CUDA only" in out


def test_a_cpu_run_leaves_the_pass_through_to_its_footer(capsys):
    """Each kitsune side on the CPU would warn that fusion is inactive there, with its source line: the run's footer
    says it once, and the warnings filter is as it was afterwards."""
    import warnings

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["--sets", "many", "--variants", "fused,kitsune", "--steps", "1", "--device", "cpu"]) == 0
        assert not [w for w in seen if "was asked for but is inactive" in str(w.message)]
        assert warnings.filters[0][0] == "always"  # the run's filter went with it
    assert warnings.filters == before
    assert "smoke test" in " ".join(capsys.readouterr().out.split())


@pytest.mark.cuda
def test_every_variant_times_on_gpu():
    result = run_bench(sets=["gpt2"], device=None, steps=5, warmup=4, console=quiet())  # the CLI's --device auto
    assert result.timer == "cuda_events" and math.isfinite(result.copy_bandwidth_gbs) and result.copy_bandwidth_gbs > 0
    entry = result.sets[0]
    assert entry.scale == 1.0 and entry.n_tensors == 148
    for v in entry.variants:
        assert v.status == "ok", f"{v.variant}: {v.reason}"
        assert v.device_ms.median > 0 and v.host_ms.median > 0 and 0 < v.pct_of_floor
    assert set(entry.ratio_to_kitsune) == {"foreach", "fused", "graph", "fresh", "eager", "static", "profiled"}
    ours = {v.variant: v.kitsune for v in entry.variants if v.kitsune is not None}
    assert set(ours) == {"kitsune", "fresh", "eager", "static", "profiled"}
    for name, info in ours.items():
        assert info.fused_all and not info.fallbacks, (name, info.fallbacks)
        assert info.steps_after_warmup == 3 * 5, name  # the device pass, the host pass and the checked steps
    assert ours["eager"].graph_replays is None  # capture_graph=False: no graph, and the row says none
    for name in ("kitsune", "static"):  # kept grads: every step after warm-up replays the graph
        assert ours[name].graph_replays == 15 and ours[name].last_eager_reason is None, ours[name]
    assert ours["fresh"].graph_replays is not None and ours["profiled"].graph_replays is not None


def test_a_kitsune_rows_info_counts_its_steps_and_replays_after_warm_up():
    """`kitsune_info` counts the steps after the warm-up's `step_mark` and how many replayed the graph; Muon's
    ``triton_matmul`` route is fused (not a fallback); the row's note says what ran eagerly and why."""
    from kitsune.bench.info import kitsune_info, route_line, step_mark

    class Stub:  # the two calls kitsune_info makes, with the counts a run would leave
        step_count, replays = 10, 7

        def subsystem_status(self):
            plan = {"buckets": [{"tensors": 8, "route": "triton_matmul"}, {"tensors": 2, "route": "torch_foreach"}]}
            plan["buckets"][1]["reason"] = "1-D params: Muon takes matrices"
            fusion = {"params_fused": 8, "plan": plan, "fused_launches_per_step": 3}
            graphs = {"replays": self.replays, "last_eager_reason": "the grads moved to new kernel variants"}
            return [
                {"name": "fusion", "active": True, "reason": None, "report": fusion},
                {"name": "graphs", "active": True, "reason": None, "report": graphs},
            ]

    opt = Stub()
    mark = step_mark(opt)
    assert mark == (10, 7)
    opt.step_count, opt.replays = 16, 13  # 6 steps, each replayed
    info = kitsune_info(opt, 10, since=mark)
    assert (info.steps_after_warmup, info.graph_replays, info.last_eager_reason) == (6, 6, None)
    assert info.fallbacks == ["2 tensors -> torch_foreach: 1-D params: Muon takes matrices"] and not info.fused_all
    assert "graph replayed on 6 of the 6 steps after warm-up;" in route_line(info)
    opt.step_count = 18  # 2 more, not replayed
    info = kitsune_info(opt, 10, since=mark)
    assert (info.steps_after_warmup, info.graph_replays) == (8, 6)
    assert route_line(info) == (
        "fused 8/10 params in 3 launch(es)/step; fallback: 2 tensors -> torch_foreach: 1-D params: Muon takes "
        "matrices; graph replayed on 6 of the 8 steps after warm-up (the last eager one: the grads moved to new "
        "kernel variants); active subsystems: fusion, graphs"
    )
    assert kitsune_info(opt, 10).steps_after_warmup is None  # no mark: nothing counted


@pytest.mark.cuda
def test_gpu_variants_end_at_the_same_params():
    pset = PARAM_SETS["gpt2"]
    finals = {}
    for name in ("fused", "graph", "kitsune", "eager", "static"):
        params = make_params(pset, "cuda", seed=0)
        variant = make_variant(name, params)
        variant.warmup(4)  # the graph variant: 3 eager steps, capture, 1 replay
        for _ in range(3):
            variant.step()
        variant.close()
        torch.cuda.synchronize()
        finals[name] = [p.detach().clone() for p in params]
        del params, variant
    for name in ("graph", "kitsune", "eager", "static"):
        for i, (x, y) in enumerate(zip(finals[name], finals["fused"], strict=True)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, n=name: f"{n} param {i}: {m}")


def test_e2e_on_cpu_trains_both_sides_alike():
    from kitsune.bench.e2e import run_e2e

    result = run_e2e(torch.device("cpu"), steps=2, warmup=1, batch=2, seq=16)
    torch_side, kitsune_side, zero_side, noclip_side, backward_side, flat_side, current_side, step_side = result.sides
    names = ["torch", "kitsune", "kitsune_zero", "torch_noclip", "kitsune_backward", "kitsune_backward_flat"]
    names += ["kitsune_backward_current", "kitsune_noclip"]
    assert [s.name for s in result.sides] == names and result.n_params > 0
    # without clipping both sides make the same steps (on CPU kitsune's step is torch's own)
    assert backward_side.last_loss == pytest.approx(noclip_side.last_loss, rel=1e-4)
    assert flat_side.last_loss == pytest.approx(noclip_side.last_loss, rel=1e-4)
    assert current_side.last_loss == pytest.approx(noclip_side.last_loss, rel=1e-4)
    assert step_side.last_loss == pytest.approx(noclip_side.last_loss, rel=1e-4)
    assert result.ratio_noclip == pytest.approx(backward_side.tokens_per_s / noclip_side.tokens_per_s)
    assert result.ratio_noclip_current == pytest.approx(current_side.tokens_per_s / noclip_side.tokens_per_s)
    assert result.ratio_noclip_step == pytest.approx(step_side.tokens_per_s / noclip_side.tokens_per_s)
    assert zero_side.last_loss == pytest.approx(torch_side.last_loss, rel=1e-4)
    assert torch_side.tokens_per_s > 0 and kitsune_side.tokens_per_s > 0
    assert result.ratio == pytest.approx(kitsune_side.tokens_per_s / torch_side.tokens_per_s)
    # same weights, same batches, same AdamW and clip: the losses agree (kitsune's CPU step is torch's own)
    assert kitsune_side.last_loss == pytest.approx(torch_side.last_loss, rel=1e-4)
    # each kitsune side records what it ran (here: the wrapped step, no graph) and the steps it took after warm-up
    for side in result.sides:
        if side.name.startswith("torch"):
            assert side.kitsune is None
        else:
            assert side.kitsune.steps_after_warmup == 2 and side.kitsune.graph_replays is None, side.name
            assert not side.kitsune.fusion_active and "CPU tensors" in side.kitsune.fusion_reason


def test_e2e_flat_grads_sides_pool_every_grad_of_gpt2():
    """The flat-grads sides raise the pool's cap above GPT-2's AdamW state and grads (the default 512 MiB holds
    part of them only, so part of the grads would stay outside the arena)."""
    from kitsune.bench.e2e import CPU_TINY, FLAT_POOL, GPT, GPT2_SMALL, build_side

    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(GPT2_SMALL).parameters())
    assert 512 << 20 < 3 * 4 * n < FLAT_POOL  # fp32 exp_avg, exp_avg_sq and grad per param
    torch.manual_seed(0)
    init = GPT(CPU_TINY).state_dict()
    flat = build_side("kitsune_backward_flat", CPU_TINY, init, torch.device("cpu"))
    assert flat.opt.config.memory.flat_grads and flat.opt.config.memory.pool_size == FLAT_POOL
    plain = build_side("kitsune_backward", CPU_TINY, init, torch.device("cpu"))
    assert not plain.opt.config.memory.flat_grads and plain.opt.config.memory.pool_size == 512 << 20


def test_e2e_turns_rotate_the_order_and_give_every_side_the_same_batches():
    from kitsune.bench.e2e import _in_turns

    calls: list[tuple[int, int]] = []

    def side(k: int):
        def step(batch: torch.Tensor) -> torch.Tensor:
            calls.append((k, int(batch)))
            return batch.float()

        return step

    data = [torch.tensor(i) for i in range(8)]
    out = _in_turns([side(0), side(1), side(2)], data, steps=6, device=torch.device("cpu"), first=3, block=2)
    assert [len(ms) for ms, _ in out] == [3, 3, 3] and all(t > 0 for ms, _ in out for t in ms)
    for k, (_, losses) in enumerate(out):
        assert [int(x) for x in losses] == [3, 4, 5, 6, 7, 0]  # the same batches, in the same order
        assert [b for s, b in calls if s == k] == [3, 4, 5, 6, 7, 0]
    orders = [[calls[i + j][0] for j in range(0, 6, 2)] for i in range(0, len(calls), 6)]  # each round's order
    assert orders == [[0, 1, 2], [1, 0, 2], [2, 0, 1]]  # each first once; every other round backwards
    assert [s for s, _ in calls[:6]] == [0, 0, 1, 1, 2, 2]  # each side runs its block in one turn


def test_e2e_with_a_compiled_model_trains_every_side_alike():
    from kitsune.bench.e2e import run_e2e

    eager = run_e2e(torch.device("cpu"), steps=2, warmup=2, batch=2, seq=16)
    compiled = run_e2e(torch.device("cpu"), steps=2, warmup=2, batch=2, seq=16, compile_backend="aot_eager")
    assert compiled.compile_backend == "aot_eager" and eager.compile_backend is None
    assert [s.name for s in compiled.sides] == [s.name for s in eager.sides]
    for e, c in zip(eager.sides, compiled.sides, strict=True):
        # the compiled forward and backward train like the eager ones, updates inside backward included
        assert c.losses == pytest.approx(e.losses, rel=1e-4), c.name


def test_time_steps_keeps_the_host_times_of_the_back_to_back_pass():
    """The device pass's ``step()`` calls are timed on the host too (`StepTimes.busy_host_ms`): one per step, each
    covering the call, apart from the host pass's calls."""
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.002:  # 2 ms a call
            pass

    times = time_steps(step, 3, torch.device("cpu"))
    assert len(calls) == 6 and len(times.busy_host_ms) == 3 and len(times.host_ms) == 3
    assert min(times.busy_host_ms) >= 2.0 and min(times.host_ms) >= 2.0


def test_paired_rounds_alternate_the_sides_and_compare_each_round(monkeypatch):
    """`paired_rounds`: off first in even rounds, on first in odd ones; each round's device share is on's median
    over off's, less 1, and its host time on's median minus off's, each side's medians from its own `time_steps`."""
    from kitsune.bench import timing

    calls = []
    times = {"off": iter([(2.0, 0.5), (4.0, 1.0), (3.0, 0.5)]), "on": iter([(3.0, 0.75), (5.0, 1.0), (3.0, 0.25)])}

    def fake_time_steps(step, steps, device, **kwargs):
        side = step()
        calls.append((side, steps))
        device_ms, host_ms = next(times[side])
        return StepTimes(device_ms=[device_ms, device_ms * 3, 0.0], host_ms=[host_ms] * 3)

    monkeypatch.setattr(timing, "time_steps", fake_time_steps)
    device_pct, host_ms = paired_rounds(lambda: "off", lambda: "on", 3, 7, torch.device("cpu"))
    assert calls == [("off", 7), ("on", 7), ("on", 7), ("off", 7), ("off", 7), ("on", 7)]
    assert device_pct == pytest.approx([50.0, 25.0, 0.0]) and host_ms == pytest.approx([0.25, 0.0, -0.25])
    with pytest.raises(ValueError, match="rounds"):
        paired_rounds(lambda: "off", lambda: "on", 0, 7, torch.device("cpu"))


def test_profiler_cost_is_not_measured_where_two_optimizers_do_not_fit(monkeypatch):
    from kitsune.bench import pairs

    monkeypatch.setattr(pairs, "memory_shortfall", lambda pset, device, copies=1: f"{copies} copies: no room")
    cost, reason = pairs.run_profiler_cost(get_param_set("gpt2", 0.001), torch.device("cpu"), 2, 1)
    assert cost is None and reason == "two optimizers of the set: 2 copies: no room"


class _NamedVariant:
    """A bench variant whose step returns its name: which side a pair's round ran."""

    def __init__(self, name: str) -> None:
        self.name = name

    def warmup(self, n: int) -> None:
        pass

    def step(self) -> str:
        return self.name

    def close(self) -> None:
        pass


def test_profiler_cost_runs_half_its_rounds_on_a_pair_built_in_each_order(monkeypatch):
    """The side built second measured faster on a host-bound set, whichever it was (profile=True came out 5-10%
    cheaper than off on `many`): half the rounds run on a pair built off first, half on one built on first, and each
    round still compares off with on."""
    from kitsune.bench import pairs

    built, compared = [], []
    monkeypatch.setattr(pairs, "make_variant", lambda name, params: built.append(name) or _NamedVariant(name))

    def paired(off, on, rounds, steps, device):
        compared.append((off(), on(), rounds))
        return [1.0] * rounds, [0.01] * rounds

    monkeypatch.setattr(pairs, "paired_rounds", paired)
    cost, reason = pairs.run_profiler_cost(get_param_set("gpt2", 0.001), torch.device("cpu"), 2, 1)
    assert reason is None and cost.rounds == pairs.PROFILER_ROUNDS
    assert built == ["kitsune", "profiled", "profiled", "kitsune"]
    half = pairs.PROFILER_ROUNDS // 2
    assert compared == [("kitsune", "profiled", half), ("kitsune", "profiled", half)]


@pytest.mark.parametrize(("seconds", "rounds"), [(0.001, 300), (0.02, 100), (0.05, 40), (1.0, 10)])
def test_paired_measurements_on_cuda_run_as_many_rounds_as_fit_their_time(monkeypatch, seconds, rounds):
    """A host-bound step's rounds differ by +-15%, so a median that resolves 2% needs hundreds of rounds: on CUDA a
    paired measurement runs as many as one untimed round says fit in PAIR_SECONDS, at least PROFILER_ROUNDS and at
    most PAIR_ROUNDS_MAX, split between the two build orders; on a CPU (a dry run) PROFILER_ROUNDS."""
    from kitsune.bench import pairs

    clock = iter([100.0, 100.0 + seconds])
    monkeypatch.setattr(pairs.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(pairs, "make_variant", lambda name, params: _NamedVariant(name))
    monkeypatch.setattr(pairs, "make_params", lambda pset, device, seed: [])  # no CUDA here
    compared = []

    def paired(off, on, n, steps, device):
        compared.append(n)
        return [1.0] * n, [0.01] * n

    monkeypatch.setattr(pairs, "paired_rounds", paired)
    monkeypatch.setattr(pairs, "memory_shortfall", lambda *args, **kwargs: None)
    monkeypatch.setattr(pairs, "free_memory", lambda device: None)
    cost, reason = pairs.run_profiler_cost(get_param_set("gpt2", 0.001), torch.device("cuda"), 10, 4)
    assert reason is None and pairs.PAIR_SECONDS == 2.0
    assert compared == [1, rounds // 2, rounds // 2] and cost.rounds == rounds  # the untimed round, then two halves
    assert pairs._pair_rounds(lambda: None, lambda: None, 10, torch.device("cpu")) == pairs.PROFILER_ROUNDS


def test_kitsune_against_the_cuda_graph_is_measured_in_pairs_built_in_each_order(monkeypatch):
    """The table's t / kitsune divides medians of passes run one after another; the headline ratio against torch's
    CUDA graph is also measured in pairs (half the rounds on a pair built kitsune first), the graph's time over
    kitsune's each round, and printed with its spread."""
    from kitsune.bench import pairs
    from kitsune.bench.results import SetResult
    from kitsune.bench.table import paired_line

    built, compared = [], []
    monkeypatch.setattr(pairs, "make_variant", lambda name, params: built.append(name) or _NamedVariant(name))

    def paired(off, on, rounds, steps, device):
        compared.append((off(), on()))
        return [140.0] * rounds, [0.002] * rounds  # the graph 2.4x kitsune's time each round

    monkeypatch.setattr(pairs, "paired_rounds", paired)
    ratio, reason = pairs.run_paired_ratio(get_param_set("many", 0.001), torch.device("cpu"), 4, 1)
    assert reason is None and ratio.against == "graph" and ratio.rounds == pairs.PROFILER_ROUNDS
    assert built == ["kitsune", "graph", "graph", "kitsune"] and compared == [("kitsune", "graph")] * 2
    assert ratio.ratio.median == pytest.approx(2.4) and ratio.steps == 4
    entry = SetResult.model_construct(name="many", paired=ratio, paired_reason=None)
    assert "2.40x (p10-p90 2.40x to 2.40x)" in paired_line(entry)
    monkeypatch.setattr(pairs, "memory_shortfall", lambda pset, device, copies=1: "no room")
    assert pairs.run_paired_ratio(get_param_set("many", 0.001), torch.device("cpu"), 4, 1) == (
        None,
        "two optimizers of the set: no room",
    )


RATIO = re.compile(r"\d\.\d+x\b|\d%")


def test_a_cpu_run_is_a_smoke_test_and_prints_no_ratio(tmp_path):
    """On a CPU kitsune is a pass-through: the tables show the times with ``-`` for every ratio, no end-to-end ratio
    and no label of GPU work, and the output says once that the run is a smoke test; the JSON keeps the times and
    carries the flag. The same result on a GPU (the flag off) prints its ratios."""
    from kitsune.bench.table import CPU_SMOKE, print_results

    buf = io.StringIO()
    console = Console(file=buf, width=200, color_system=None)
    path = tmp_path / "bench.json"
    result = run_bench(
        sets=["gpt2"], variants=["fused", "kitsune"], device="cpu", steps=1, e2e=True, e2e_steps=1, e2e_batch=1,
        json_path=path, console=console,
    )  # fmt: skip
    text = buf.getvalue()
    assert result.cpu_smoke and json.loads(path.read_text())["cpu_smoke"] is True
    assert result.sets[0].variants[0].device_ms.median > 0 and result.sets[0].ratio_to_kitsune  # kept in the JSON
    flat = " ".join(text.split())
    assert flat.count(CPU_SMOKE) == 1 and flat.index(CPU_SMOKE) > flat.index("last loss")  # once, after the tables
    assert not RATIO.search(text), text
    assert "tokens/s over torch's" not in text and "profile=True, in pairs" not in text
    rows = [line for line in text.splitlines() if line.startswith("│") and ("torch" in line or "kitsune" in line)]
    assert [row.split("│")[7:9] for row in rows[:2]] == [["       - ", "           - "]] * 2  # % floor, t / kitsune
    e2e = [side.label for side in result.e2e.sides]
    assert len(e2e) == 8 and not any(
        "graph" in label or "inside backward" in label or "fused" in label for label in e2e
    )

    buf.seek(0), buf.truncate()
    print_results(result.model_copy(update={"cpu_smoke": False}), console)
    assert RATIO.search(buf.getvalue()) and "tokens/s over torch's" in buf.getvalue()
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "cpu_smoke"}  # a file from before the flag
    assert BenchResult.model_validate(old).cpu_smoke is False


def test_an_unknown_compile_backend_is_one_line_before_anything_runs(monkeypatch, capsys):
    """``--compile BOGUS``: torch.compile fails only at the model's first forward, after the other timings; the name
    is checked against torch's backends first."""
    from kitsune.bench import runner
    from kitsune.bench.e2e import run_e2e

    monkeypatch.setattr(runner, "run_variant", lambda *a, **k: pytest.fail("timed before the backend was checked"))
    assert main(["--sets", "gpt2", "--device", "cpu", "--e2e", "--compile", "bogus"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("kitsune bench: --compile: torch ") and "backend 'bogus'" in captured.err
    assert "inductor" in captured.err
    with pytest.raises(ValueError, match="no torch.compile backend 'bogus'"):
        run_e2e(torch.device("cpu"), steps=1, warmup=1, compile_backend="bogus")


def _interrupt_at(monkeypatch, set_name: str) -> None:
    """Ctrl-C while the first variant of ``set_name`` is timed."""
    import kitsune.bench.runner as runner

    real = runner.run_variant

    def run_variant(name, pset, *args, **kwargs):
        if pset.name == set_name:
            raise KeyboardInterrupt
        return real(name, pset, *args, **kwargs)

    monkeypatch.setattr(runner, "run_variant", run_variant)


BENCH = ["--variants", "fused", "--steps", "1", "--warmup", "1", "--device", "cpu"]


def test_ctrl_c_is_one_line_naming_the_sets_saved(tmp_path, monkeypatch, capsys):
    """Ctrl-C after the first set: exit code 130 and one line saying where the sets done so far are; the JSON (saved
    whole after each set) holds them, marked complete: false."""
    path = tmp_path / "b.json"
    path.write_text('{"an older": "complete run"}')
    _interrupt_at(monkeypatch, "many")
    assert main(["--sets", "gpt2,many", *BENCH, "--json", str(path)]) == 130
    err = capsys.readouterr().err
    assert err == f"kitsune bench: interrupted: the sets done so far (gpt2) are in {path} (complete: false)\n"
    saved = BenchResult.load(path)
    assert not saved.complete and [s.name for s in saved.sets] == ["gpt2"]
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # no temporary file left


@pytest.mark.parametrize("old", [True, False], ids=["old-file", "no-file"])
def test_ctrl_c_before_the_first_set_leaves_the_old_file(tmp_path, monkeypatch, capsys, old):
    path = tmp_path / "b.json"
    if old:
        path.write_text('{"an older": "complete run"}')
    _interrupt_at(monkeypatch, "gpt2")
    assert main(["--sets", "gpt2", *BENCH, "--json", str(path)]) == 130
    kept = f"{path} is untouched" if old else f"{path} was not written"
    assert capsys.readouterr().err == f"kitsune bench: interrupted before the first set was done: {kept}\n"
    assert (path.read_text() == '{"an older": "complete run"}') if old else not path.exists()


def test_a_name_given_twice_runs_once(tmp_path):
    parser = argparse.ArgumentParser(prog="kitsune")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--sets", "gpt2,many,gpt2", "--variants", "fused,fused,kitsune"])
    assert args.sets == ["gpt2", "many"] and args.variants == ["fused", "kitsune"]


def test_plot_says_what_is_wrong_in_one_line(tmp_path, capsys):
    """``python -m kitsune.bench.plot``: --help exits 0; a missing file, a JSON that is no bench result (a profile)
    and a folder as the output are one line each, exit code 2; a partial run is charted and said to be partial."""
    from kitsune.bench.plot import main as plot

    assert plot(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m kitsune.bench.plot BENCH.json OUT.svg\n\nA ")

    missing = tmp_path / "missing.json"
    assert plot([str(missing), str(tmp_path / "o.svg")]) == 2
    assert capsys.readouterr().err == f"python -m kitsune.bench.plot: {missing}: no such file\n"

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"schema_version": "1.1", "steps": [], "subsystems": []}))
    assert plot([str(profile), str(tmp_path / "o.svg")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"python -m kitsune.bench.plot: {profile}: is a profile, not a bench result: read it with kitsune report "
        f"{profile}\n"
    )

    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    assert plot([str(other), str(tmp_path / "o.svg")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m kitsune.bench.plot: {other}: is not a kitsune bench --json result (")
    assert err.count("\n") == 1

    bench = tmp_path / "b.json"
    run_bench(sets=["gpt2"], variants=["fused"], device="cpu", steps=1, json_path=bench, console=quiet())
    assert plot([str(bench), str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"python -m kitsune.bench.plot: {tmp_path}: is a directory, not a file: name a file in it\n"
    )
    partial = BenchResult.load(bench)
    partial.complete = False
    partial.save(bench)
    assert plot([str(bench), str(tmp_path / "o.svg")]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{tmp_path / 'o.svg'}\n"
    assert captured.err == (
        f"note: {bench} is a partial run (complete: false; the run was stopped or is still going): the chart shows "
        "what was done (gpt2)\n"
    )
    assert "a partial run (complete: false)" in (tmp_path / "o.svg").read_text()


def test_fresh_grads_frees_every_grad_and_gives_each_param_a_new_one():
    """`fresh_grads`: what zero_grad() and backward() leave, new tensors (the old ones freed) of new random values,
    shaped and typed as their params."""
    from kitsune.bench.params import fresh_grads

    params = make_params(get_param_set("gpt2", 0.001), "cpu", seed=0)
    before = [p.grad for p in params]
    values = [g.clone() for g in before]
    fresh_grads(params, torch.Generator().manual_seed(1))
    for p, old, value in zip(params, before, values, strict=True):
        assert p.grad is not old and torch.equal(old, value)  # a new tensor; the old one untouched
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype and p.grad.device == p.device
        assert not torch.equal(p.grad, value) and p.grad.abs().sum() > 0


def test_grads_fresh_gives_every_warmup_and_timed_step_new_grads(monkeypatch):
    """``run_variant(grads="fresh")``: before every warm-up step and every timed step (both passes) each param holds
    a grad it has not held before; with the default the same tensors every step."""
    from kitsune.bench import runner, variants

    seen: list[list[torch.Tensor]] = []  # the grads themselves: held, so no later grad can reuse an id

    class Recording(variants._TorchVariant):
        def __init__(self, params):
            super().__init__(params, foreach=True)
            self.params = params

            def step():
                seen.append([p.grad for p in self.params])
                self.opt.step()

            self.step = step

    monkeypatch.setattr(runner, "make_variant", lambda name, params: Recording(params))
    pset = get_param_set("gpt2", 0.001)
    for grads in ("fresh", "kept"):
        seen.clear()
        v = runner.run_variant("foreach", pset, torch.device("cpu"), 3, 2, 1.0, grads=grads)
        assert v.status == "ok" and len(seen) == 2 + 3 * 3  # the warm-up, both timed passes, the checked steps
        ids = [{id(g) for g in step} for step in seen]
        if grads == "fresh":  # no step sees a grad an earlier step held
            assert all(len(ids[k]) == len(pset.shapes) and not ids[k] & set().union(*ids[:k]) for k in range(len(ids)))
        else:
            assert all(step_ids == ids[0] for step_ids in ids)


def test_the_fresh_variant_is_the_one_line_with_new_grads_every_step(monkeypatch):
    """The ``fresh`` row: kitsune's one line, whose every warm-up and timed step meets grads it has not seen, beside
    rows whose grads stay in place; with ``--grads fresh`` it would repeat the ``kitsune`` row, and is skipped."""
    from kitsune.bench import runner, variants

    built: list[str] = []
    seen: list[list[torch.Tensor]] = []  # the grads themselves: held, so no later grad can reuse an id
    make = variants.make_variant

    def recording(name, params):
        v = make(name, params)
        built.append(type(v.opt).__name__ if hasattr(v, "opt") else type(v).__name__)
        step = v.step

        def record():
            seen.append([p.grad for p in params])
            return step()

        v.step = record
        return v

    monkeypatch.setattr(runner, "make_variant", recording)
    pset = get_param_set("gpt2", 0.001)
    for name in ("fresh", "kitsune"):
        seen.clear()
        v = runner.run_variant(name, pset, torch.device("cpu"), 3, 2, 1.0)
        assert v.status == "ok" and v.label == variants.VARIANTS[name] and len(seen) == 2 + 3 * 3
        assert v.kitsune is not None and v.kitsune.total_params == len(pset.shapes)
        ids = [{id(g) for g in step} for step in seen]
        if name == "fresh":  # no step sees a grad an earlier step held
            assert all(len(ids[k]) == len(pset.shapes) and not ids[k] & set().union(*ids[:k]) for k in range(len(ids)))
        else:
            assert all(step_ids == ids[0] for step_ids in ids)
    assert built == ["KitsuneOptimizer", "KitsuneOptimizer"]
    skipped = runner.run_variant("fresh", pset, torch.device("cpu"), 3, 2, 1.0, grads="fresh")
    assert skipped.status == "skipped" and "'kitsune' row re-allocates its grads already" in skipped.reason


def test_grads_fresh_skips_the_recipes_that_need_grads_in_place_and_is_recorded(tmp_path):
    from kitsune.bench.variants import FIXED_GRADS

    path = tmp_path / "fresh.json"
    result = run_bench(
        sets=["many"],
        variants=["fused", "graph", "kitsune", "static", "profiled"],
        device="cpu",
        steps=2,
        warmup=1,
        json_path=path,
        console=quiet(),
        grads="fresh",
    )
    rows = {v.variant: v for v in result.sets[0].variants}
    assert rows["graph"].status == "skipped" and rows["graph"].reason == FIXED_GRADS["graph"]
    assert rows["static"].status == "skipped" and rows["static"].reason == FIXED_GRADS["static"]
    assert all(rows[n].status == "ok" for n in ("fused", "kitsune", "profiled"))
    assert result.sets[0].profiler_cost is None  # the pairs keep their grads: not run with fresh ones
    assert result.sets[0].profiler_cost_reason == (
        "not measured with --grads fresh: the paired measurements keep the grads in place"
    )
    loaded = BenchResult.load(path)
    assert loaded.grads == "fresh"
    console = quiet()
    from kitsune.bench.table import print_results

    print_results(loaded, console)
    assert "grads re-allocated every step" in console.file.getvalue()


def test_grads_mode_is_checked_before_anything_runs():
    with pytest.raises(ValueError, match="grads mode 'often'"):
        run_bench(sets=["gpt2"], device="cpu", console=quiet(), grads="often")
    with pytest.raises(ValueError, match="leave out --peers"):
        run_bench(sets=["gpt2"], device="cpu", console=quiet(), grads="fresh", peers="all")
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--grads", "often"])


def test_a_result_saves_and_loads_under_a_home_relative_path(tmp_path, monkeypatch):
    """``save`` expands ``~``; ``load`` of the same text finds the same file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    result = run_bench(sets=["gpt2"], variants=["kitsune"], device="cpu", steps=2, warmup=1, console=quiet())
    saved = result.save("~/runs/bench.json")
    assert saved == tmp_path / "runs" / "bench.json" and saved.is_file()
    assert BenchResult.load("~/runs/bench.json") == result


def test_the_profiled_variant_is_profile_true_as_it_comes_warmed_past_its_windows():
    """The ``profiled`` row (and the profiler's cost in pairs) times ``profile=True`` with `ProfilerConfig`'s
    defaults, not a lighter profiler; its warm-up runs on past the sampled windows, so no timed step is one of them,
    and closing it stops the NVML sampler."""
    from kitsune.bench.variants import make_variant
    from kitsune.config import ProfilerConfig

    params = make_params(get_param_set("gpt2", 0.001), "cpu", seed=0)
    v = make_variant("profiled", params)
    assert v.opt.config.profiler == ProfilerConfig(enabled=True)
    profiler = v.opt.profiler
    assert profiler is not None and profiler.sampling
    v.warmup(2)
    assert not profiler.sampling and v.opt.step_count > 2  # the windows: past them
    closed = []
    profiler.close = lambda: closed.append(True)
    v.close()
    assert closed == [True]


def test_time_block_times_each_call_after_a_collection(monkeypatch):
    """`kitsune.bench.timing.time_block` (the benchmark scripts' cold-then-warm block): ``gc.collect()`` first, then
    the calls back to back; the first call's host time apart from the median of the others, and the block's mean."""
    from kitsune.bench import timing

    events: list[str] = []
    monkeypatch.setattr(timing.gc, "collect", lambda: events.append("collect"))
    clock = iter(range(0, 10**9, 10**6))  # every clock read 1 ms after the last
    monkeypatch.setattr(timing.time, "perf_counter_ns", lambda: next(clock))
    out = timing.time_block(lambda: events.append("step"), 4, torch.device("cpu"))
    assert events == ["collect", "step", "step", "step", "step"]
    assert set(out) == {"ms", "host_ms", "first_ms", "later_ms"}
    assert out["first_ms"] == out["later_ms"] == out["host_ms"] == 1.0  # each call between two reads 1 ms apart
    assert out["ms"] == 9 * 1.0 / 4  # the wall clock around the block: 9 reads' worth over 4 steps


def test_the_scripts_device_and_defaults_fill_what_was_left_out():
    """`benchmarks/`'s scripts: on a CPU the size and the CPU's defaults where an option was left out (given ones
    stay); CUDA asked for where there is none is a parser error that says to pass --device cpu."""
    import argparse

    from kitsune.bench.cli import add_device_args, device_and_defaults

    parser = argparse.ArgumentParser()
    add_device_args(parser)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(["--device", "cpu", "--steps", "7"])
    device = device_and_defaults(parser, args, rounds=(2, 20), steps=(3, 20))
    assert device.type == "cpu" and (args.scale, args.rounds, args.steps) == (0.001, 2, 7)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            device_and_defaults(parser, parser.parse_args([]))


@pytest.mark.parametrize("moves", [True, False], ids=["moves", "does_nothing"])
def test_every_variant_row_is_checked_to_move_its_params_outside_the_timed_passes(moves, monkeypatch):
    """Every row, not only ``--peers`` runs and the low-precision rows: a step that leaves the params as they were
    is reported as not timed. The snapshots are taken before and after the back-to-back pass and after each of as
    many untimed steps: never between timed steps, so every row's host pass is the same."""
    from kitsune.bench import runner, variants

    events: list[str] = []

    class Recording(variants._TorchVariant):
        def __init__(self, params):
            super().__init__(params, foreach=True)

            def step():
                events.append("step")
                if moves:
                    self.opt.step()

            self.step = step

    real_check = runner.MoveCheck

    class Check(real_check):
        def __call__(self):
            events.append("check")
            super().__call__()

    monkeypatch.setattr(runner, "make_variant", lambda name, params: Recording(params))
    monkeypatch.setattr(runner, "MoveCheck", Check)
    v = runner.run_variant("fused", get_param_set("gpt2", 0.001), torch.device("cpu"), 3, 2, 1.0)
    if not moves:
        assert v.status == "not_timed" and "did not move" in v.reason
        return
    assert v.status == "ok", v.reason
    timed = ["step"] * 3
    assert events == ["step"] * 2 + ["check", *timed, "check", *timed] + ["step", "check"] * 3
