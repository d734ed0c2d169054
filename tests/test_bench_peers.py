"""``kitsune bench --peers``: the registry, the move check, grads that a step frees, state bytes, the command.

CI has none of the peer libraries: the runner is tested with tiny torch optimizers injected into the registry; the
real peers run here only where they are importable.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import signal
import time

import pytest
import torch
from rich.console import Console

from kitsune.bench import PEERS, BenchResult, Peer, main, register, run_bench, run_peer
from kitsune.bench.params import ParamSet
from kitsune.bench.peers import COMPILES_ON_CPU, KITSUNE_LION, Built, MoveCheck, ParamsDidNotMove, select_peers
from kitsune.bench.peers import state_bytes as count_state
from kitsune.bench.table import ADAMW_STATE_BYTES_PER_PARAM

CPU = torch.device("cpu")
# three tensors, one over bitsandbytes' 4096-element threshold for 8-bit state
TINY = ParamSet("tiny", "three tensors", (("w", (64, 128)), ("b", (8192,)), ("n", (10,))), default_steps=2)


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


class _SignStep(torch.optim.Optimizer):
    """``p -= lr * sign(g)`` with one state tensor; ``mode`` makes it misbehave as some libraries do."""

    def __init__(self, params, lr: float = 1e-3, mode: str = "ok") -> None:
        super().__init__(params, {"lr": lr})
        self.mode = mode
        self.calls = 0
        self.grad_norms: list[list[float | None]] = []  # per call, the grads it found

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        params = [p for g in self.param_groups for p in g["params"]]
        self.grad_norms.append([None if p.grad is None else float(p.grad.norm()) for p in params])
        if self.mode == "idle" or (self.mode == "skip_even" and self.calls % 2 == 0):
            return None
        if self.mode in ("hang", "hang_compiled") and self.calls > 1:  # as a library compiling for minutes
            until = time.perf_counter() + 20  # (bounded: a broken time limit fails the test, it does not hang it)
            try:
                # the runner's timer is armed now; its signal comes here, at once, whatever the earlier calls took
                # (a first optimizer in a process imports torch._dynamo, which outlasted a short real limit)
                self.timer_armed = signal.getitimer(signal.ITIMER_REAL)[0] > 0
                signal.raise_signal(signal.SIGALRM)
                while time.perf_counter() < until:
                    time.sleep(0.01)
            except Exception:  # as torch.compile's backends wrap what they raise, with the whole graph in it
                if self.mode == "hang_compiled":
                    raise RuntimeError("backend='inductor' raised:\n" + ", ".join(["%getitem"] * 5000)) from None
                raise
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg"].copy_(p.grad)
                p.add_(p.grad.sign(), alpha=-group["lr"])
                if self.mode == "free":
                    p.grad = None
                elif self.mode == "zero":
                    p.grad.zero_()
        return None


def _fake(name: str, mode: str = "ok", algorithm: str = "adamw", package: str = "torch", built: list | None = None):
    def build(params, device):
        if mode == "raise":
            raise RuntimeError("this library is broken here")
        opt = _SignStep(params, mode=mode)
        if built is not None:
            built.append(opt)
        return Built(opt, opt.step)

    return Peer(name, f"fake {name}", package, package, algorithm, build=build, settings=lambda d: f"mode={mode}")


def test_a_peer_is_timed_and_its_state_counted():
    built: list[_SignStep] = []
    v = run_peer(_fake("fake", built=built), TINY, CPU, steps=3, warmup=2, floor_ms=1.0)
    assert v.status == "ok", v.reason
    assert v.device_ms.median > 0 and v.host_ms.median > 0 and len(v.device_ms_steps) == 3
    assert v.state_bytes == 4 * TINY.n_elements  # one fp32 tensor per param
    assert v.peer.grads == "kept" and v.peer.checked_steps == 3 + 1  # each checked step, the device pass as one
    assert v.peer.package == "torch" and v.peer.version == importlib.metadata.version("torch")
    assert v.peer.settings == "mode=ok"
    assert built[0].calls == 2 + 3 + 3 + 3  # warm-up, device pass, host pass, checked steps


def test_a_slow_peer_times_fewer_steps(monkeypatch):
    """A peer whose last warm-up step shows that the set's steps would take longer than PEER_PASS_SECONDS a pass
    times fewer (never below PEER_MIN_STEPS), says so in its row and its JSON; a fast one times the set's."""
    from kitsune.bench import runner
    from kitsune.bench.table import _note

    assert runner.peer_steps(50, 1.0) == 10 and runner.peer_steps(50, 0.01) == 50
    assert runner.peer_steps(50, 60.0) == runner.PEER_MIN_STEPS and runner.peer_steps(3, 60.0) == 3
    built: list[_SignStep] = []
    monkeypatch.setattr(runner, "PEER_PASS_SECONDS", 1e9)  # no step is too slow (whatever the host does)
    fast = run_peer(_fake("fast"), TINY, CPU, steps=7, warmup=2, floor_ms=1.0)
    assert fast.peer.short_steps is None and len(fast.device_ms_steps) == 7 and fast.peer.warm_step_ms > 0
    monkeypatch.setattr(runner, "PEER_PASS_SECONDS", 0.0)  # every step is too slow now
    v = run_peer(_fake("slow", built=built), TINY, CPU, steps=7, warmup=2, floor_ms=1.0)
    assert v.status == "ok", v.reason
    assert v.peer.short_steps == runner.PEER_MIN_STEPS == 5
    assert len(v.device_ms_steps) == 5 and v.peer.checked_steps == 5 + 1
    assert built[0].calls == 2 + 5 + 5 + 5
    assert "; 5 steps a timed pass (a step took" in _note(v)
    assert "steps a timed pass" not in _note(fast)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="the time limit needs a timer signal (POSIX)")
def test_a_peer_past_its_time_is_stopped_and_the_next_one_runs(monkeypatch):
    """A peer still running after PEER_SECONDS is stopped where it is (here in its second warm-up step), its row
    says so and keeps no times; the timer and the SIGALRM handler are restored, so the next peer runs in full."""
    from kitsune.bench import runner
    from kitsune.bench.table import _note

    handler = signal.getsignal(signal.SIGALRM)
    monkeypatch.setattr(runner, "PEER_SECONDS", 30.0)
    built: list[_SignStep] = []
    v = run_peer(_fake("hangs", mode="hang", built=built), TINY, CPU, steps=3, warmup=3, floor_ms=1.0)
    assert built[0].timer_armed  # the step ran under the runner's timer, whose signal it raised
    assert v.status == "stopped" and v.device_ms is None and not v.device_ms_steps
    assert v.reason == "ran past 30 s (PEER_SECONDS), in warm-up step 2 of 3", v.reason
    assert _note(v) == f"stopped: {v.reason}"
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    after = run_peer(_fake("fine"), TINY, CPU, steps=3, warmup=2, floor_ms=1.0)
    assert after.status == "ok" and len(after.device_ms_steps) == 3, after.reason


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="the time limit needs a timer signal (POSIX)")
def test_a_stop_raised_again_by_a_compiler_is_a_stop_with_a_short_reason(monkeypatch):
    """A library that catches the time limit and raises its own error (torch.compile's backends, with the traced
    graph in the message) still gets a `stopped` row naming the limit, not a failure with the graph in it."""
    from kitsune.bench import runner

    monkeypatch.setattr(runner, "PEER_SECONDS", 30.0)
    v = run_peer(_fake("compiles", mode="hang_compiled"), TINY, CPU, steps=3, warmup=3, floor_ms=1.0)
    assert v.status == "stopped", (v.status, v.reason[:200])
    assert v.reason == "ran past 30 s (PEER_SECONDS), in warm-up step 2 of 3 (raised again as RuntimeError)"


def test_a_failure_reason_is_bounded():
    from kitsune.bench.guards import REASON_CHARS, failure_reason

    long = RuntimeError("backend='inductor' raised:\n\n" + ", ".join(f"%getitem_{i}" for i in range(16000)))
    reason = failure_reason(long)
    assert reason.startswith("RuntimeError: backend='inductor' raised: %getitem_0, %getitem_1")
    assert len(reason) == REASON_CHARS and reason.endswith("...")
    assert failure_reason(ValueError("short\n  second line\nthird\nfourth")) == "ValueError: short second line third"
    v = run_peer(_fake("broken", mode="raise"), TINY, CPU, steps=3, warmup=1, floor_ms=1.0)
    assert v.status == "failed" and v.reason == "RuntimeError: this library is broken here"


@pytest.mark.parametrize("mode", ["idle", "skip_even"])
def test_a_peer_whose_params_do_not_move_is_not_timed(mode):
    v = run_peer(_fake("lazy", mode=mode), TINY, CPU, steps=3, warmup=1, floor_ms=1.0)
    assert v.status == "not_timed" and v.reason.startswith("params did not move") and v.reason.endswith("not timed")
    assert v.device_ms is None and v.host_ms is None and v.pct_of_floor is None and v.device_ms_steps == []


@pytest.mark.parametrize(("mode", "grads"), [("free", "reattached"), ("zero", "refilled")])
def test_a_peer_that_frees_or_zeroes_the_grads_gets_fresh_ones(mode, grads):
    """Without fresh grads the fake's later steps would find None or zeros and move nothing."""
    built: list[_SignStep] = []
    v = run_peer(_fake("greedy", mode=mode, built=built), TINY, CPU, steps=3, warmup=2, floor_ms=1.0)
    assert v.status == "ok", v.reason
    assert v.peer.grads == grads
    seen = built[0].grad_norms
    assert len(seen) == 2 + 3 + 3 + 3
    for call in seen:
        assert all(n is not None and n > 0 for n in call)  # every step found a full, non-zero grad
    firsts = [call[0] for call in seen]
    assert len(set(firsts)) == len(firsts)  # and a fresh one each time


def test_move_check_names_the_param_and_rejects_non_finite():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    check = MoveCheck(params, ["a", "b"])
    check()
    with torch.no_grad():
        params[0].add_(1.0)  # b stays
    check()
    with pytest.raises(ParamsDidNotMove, match=r"1 of 2 params unchanged on 1 of 1 checked steps \(first: b\)"):
        check.verify()
    with torch.no_grad():
        params[0].fill_(float("nan"))
        params[1].add_(1.0)
    check()
    with pytest.raises(ParamsDidNotMove, match="NaN or inf"):
        check.verify()


def test_state_bytes_walks_nested_state_subclasses_and_shared_tensors():
    class Quantized(torch.Tensor):  # a torchao-style state: codes and scales behind one tensor
        @staticmethod
        def __new__(cls, codes, scale):
            return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)

        def __init__(self, codes, scale):
            self.codes, self.scale = codes, scale

        def __tensor_flatten__(self):
            return ["codes", "scale"], None

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    qmap = torch.zeros(256)  # shared by every param, as bitsandbytes' quantization maps are
    paged = torch.zeros(10)
    paged.is_paged = True
    state = {
        "p0": {"exp_avg": Quantized(torch.zeros(100, dtype=torch.uint8), torch.ones(2)), "qmap": qmap, "step": 3},
        "p1": {0: {"exp_avg_sq": torch.zeros(4, dtype=torch.float16), "qmap": qmap}},
    }
    assert count_state(state) == (100 + 2 * 4 + 256 * 4 + 4 * 2, False)
    assert count_state([paged, torch.zeros(1)]) == (44, True)


def test_select_peers_on_a_cpu_skips_the_compiled_ones_unless_named():
    chosen, skipped = select_peers("all", CPU)
    assert {p.name for p in chosen} | set(skipped) == set(PEERS)
    assert set(skipped) == {p.name for p in PEERS.values() if p.compiles} and "compile" in skipped
    assert all(reason == COMPILES_ON_CPU for reason in skipped.values())
    chosen, skipped = select_peers(["compile", "bnb"], CPU)
    assert [p.name for p in chosen] == ["bnb", "compile"] and skipped == {}  # registry order, nothing skipped
    assert len(select_peers("all", torch.device("cuda", 0))[0]) == len(PEERS)
    with pytest.raises(ValueError, match="unknown peer nope"):
        select_peers(["nope"], CPU)


def test_every_peer_names_what_pip_installs():
    assert {p.pip for p in PEERS.values()} == {
        "bitsandbytes",
        "torchao",
        "torch-optimi",
        "heavyball",
        "lion-pytorch",
        "torch",
    }
    assert {p.algorithm for p in PEERS.values()} == {"adamw", "lion"}


def test_run_bench_with_peers_lists_missing_ones_and_adds_a_lion_section(monkeypatch, tmp_path):
    for name in list(PEERS):
        monkeypatch.delitem(PEERS, name)
    monkeypatch.setitem(PEERS, "fake", _fake("fake"))
    monkeypatch.setitem(PEERS, "lazy", _fake("lazy", mode="idle"))
    monkeypatch.setitem(PEERS, "gone", _fake("gone", package="kitsune_no_such_package"))
    monkeypatch.setitem(PEERS, "fakelion", _fake("fakelion", algorithm="lion"))
    monkeypatch.setitem(PEERS, "broken", _fake("broken", mode="raise"))
    console = quiet()
    path = tmp_path / "peers.json"
    result = run_bench(
        sets=["many"], variants=["fused"], device="cpu", steps=2, json_path=path, console=console, peers="all"
    )
    entry = result.sets[0]
    rows = {v.variant: v for v in entry.variants}
    assert list(rows) == ["fused", "fake", "lazy", "broken"]  # not installed: no row; the Lion peer in its section
    assert rows["fused"].peer is None and rows["fused"].state_bytes == 8 * entry.n_elements + 4 * entry.n_tensors
    assert rows["fake"].status == "ok" and rows["lazy"].status == "not_timed" and rows["broken"].status == "failed"
    assert set(entry.ratio_to_kitsune) == set()  # no kitsune variant ran
    [gone] = [s for s in result.peers if not s.installed]
    assert gone.name == "gone" and gone.pip == "kitsune_no_such_package"
    [lion] = result.lion
    assert lion.workload == "lion_step" and [v.variant for v in lion.variants] == [KITSUNE_LION.name, "fakelion"]
    assert lion.bytes_per_param == 20 and lion.variants[0].peer.reference and not lion.variants[1].peer.reference
    assert all(v.status == "ok" for v in lion.variants) and set(lion.ratio_to_kitsune) == {"fakelion"}
    # kitsune's reference row says what it ran, as a variant's does (a CPU run outside the interpreter: torch's step)
    ours = lion.variants[0].kitsune
    assert ours is not None and ours.total_params == 2000 and not ours.fusion_active
    assert lion.variants[1].kitsune is None
    assert BenchResult.load(path) == result

    out = console.file.getvalue()
    assert "not installed: fake gone (pip install kitsune_no_such_package)" in out
    assert "many Lion" in out and "state MiB" in out and "not timed" in out and "params did not move" in out
    assert "this library is broken here" in out
    assert "params moved on each of 3 checks; fusion inactive: " in out

    from kitsune.bench.plot import write_svg

    svg = write_svg(path, tmp_path / "peers.svg").read_text()
    assert "many Lion" in svg and "not timed" in svg


def test_the_state_column_is_relative_to_fp32_adamw():
    from kitsune.bench.results import SetResult, VariantResult
    from kitsune.bench.table import _state

    entry = SetResult.model_construct(n_elements=1000)
    v = VariantResult(variant="x", label="x", status="ok", state_bytes=2000)
    assert ADAMW_STATE_BYTES_PER_PARAM == 8 and _state(v, entry) == f"{2000 / 2**20:,.1f} (0.25x)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kitsune")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_peers_option_parses():
    parser = _parser()
    assert parser.parse_args(["bench"]).peers is None
    assert parser.parse_args(["bench", "--peers"]).peers == "all"
    assert parser.parse_args(["bench", "--peers", "all"]).peers == "all"
    assert parser.parse_args(["bench", "--peers", "bnb, optimi"]).peers == ["bnb", "optimi"]
    assert parser.parse_args(["bench", "--peers", "--sets", "gpt2"]).sets == ["gpt2"]
    for bad in ("nope", ",", "bnb,nope"):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "--peers", bad])


def test_peers_default_to_fused_kitsune_and_its_low_precision_state_and_peer_failures_keep_exit_0(monkeypatch):
    import kitsune.bench.cli as cli

    seen = {}

    def fake_run_bench(**kwargs):
        seen.update(kwargs)
        return run_bench(**{**kwargs, "console": quiet()})

    monkeypatch.setattr(cli, "run_bench", fake_run_bench)
    monkeypatch.setitem(PEERS, "broken", _fake("broken", mode="raise"))
    args = _parser().parse_args(["bench", "--peers", "broken", "--device", "cpu", "--sets", "many", "--steps", "1"])
    assert args.func(args) == 0  # a peer broken on this machine is reported in its row, not as kitsune's failure
    assert seen["variants"] == ["fused", "kitsune", "8bit", "bf16state"] and seen["peers"] == ["broken"]
    args = _parser().parse_args(["bench", "--device", "cpu", "--sets", "many", "--steps", "1", "--variants", "fused"])
    assert args.func(args) == 0 and seen["peers"] is None and seen["variants"] == ["fused"]


def test_dry_run_of_every_peer_on_cpu(capsys, tmp_path):
    """``kitsune bench --peers --device cpu``: whatever is installed runs, the rest is listed; the table renders."""
    path = tmp_path / "dry.json"
    assert main(["--peers", "--device", "cpu", "--sets", "gpt2", "--steps", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "state MiB" in out and "torch fused" in out and "kitsune" in out
    # torch is always installed, and compiling its step takes minutes on a CPU
    assert any(line.startswith("skipped: ") and "torch.compile(step)" in line for line in out.splitlines())
    result = BenchResult.load(path)
    assert {s.name for s in result.peers} == set(PEERS)
    for status in result.peers:
        assert status.installed or f"pip install {status.pip}" in out.replace("\n", " ")
    raw = json.loads(path.read_text())
    assert raw["sets"][0]["variants"][0]["state_bytes"] > 0


@pytest.mark.parametrize("name", ["bnb", "bnb8bit", "bnb_paged", "optimi", "lion_pytorch"])
def test_real_peer_on_cpu_where_installed(name):
    peer = PEERS[name]
    pytest.importorskip(peer.package)
    v = run_peer(peer, TINY, CPU, steps=2, warmup=2, floor_ms=1.0)
    assert v.status == "ok", v.reason
    per_param = 4 if peer.algorithm == "lion" else 8
    if name == "bnb8bit":  # 8-bit codes for the two large tensors, fp32 for the 10-element one, plus scales and maps
        assert v.state_bytes < per_param * TINY.n_elements / 2
    else:
        assert per_param * TINY.n_elements <= v.state_bytes < per_param * TINY.n_elements + 4096


@pytest.mark.cuda
def test_peers_on_gpu_where_installed():
    result = run_bench(
        sets=["gpt2"], variants=["fused", "kitsune"], device="cuda", steps=5, warmup=4, console=quiet(), peers="all"
    )
    for entry in [*result.sets, *result.lion]:
        for v in entry.variants:
            # a peer that compiles may pass PEER_SECONDS on a busy host (stopped), or break (failed): its row says so
            assert v.status in ("ok", "failed", "stopped"), f"{v.variant}: {v.reason}"
            if v.peer is None or v.peer.reference:
                assert v.status == "ok", f"{v.variant}: {v.reason}"


def test_without_peers_the_run_is_as_before():
    console = quiet()
    result = run_bench(sets=["many"], variants=["fused", "kitsune"], device="cpu", steps=1, console=console)
    assert result.peers == [] and result.lion == []
    assert all(v.state_bytes is None and v.peer is None for v in result.sets[0].variants)
    out = console.file.getvalue()
    assert "state MiB" not in out and "not installed" not in out and "Lion" not in out
