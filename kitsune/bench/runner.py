"""The run over parameter sets: each variant timed on fresh params, the AMP + clipping phase, the JSON."""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kitsune._device import parse_device
from kitsune._paths import as_path
from kitsune.bench.e2e import check_compile_backend, run_e2e
from kitsune.bench.guards import failure_reason, free_memory, memory_shortfall
from kitsune.bench.info import KitsuneInfo, kitsune_info, step_mark
from kitsune.bench.pairs import run_paired_ratio, run_profiler_cost
from kitsune.bench.params import (
    PARAM_SETS,
    ParamSet,
    check_grads_mode,
    fresh_grads,
    get_param_set,
    make_params,
    refill_grads,
)
from kitsune.bench.peers import (
    KITSUNE_LION,
    PEERS,
    MoveCheck,
    ParamsDidNotMove,
    Peer,
    installed,
    select_peers,
    state_bytes,
)
from kitsune.bench.peers import version as peer_version
from kitsune.bench.results import (
    BenchResult,
    PeerInfo,
    PeerStatus,
    SetResult,
    VariantResult,
)
from kitsune.bench.table import default_console, paired_line, peer_lines, print_results, profiler_cost_line
from kitsune.bench.timing import (
    Stats,
    StepTimes,
    copy_bandwidth,
    native_check_ready,
    synchronize,
    time_steps,
)
from kitsune.bench.variants import (
    ADAMW,
    BYTES_PER_PARAM,
    DEFAULT_VARIANTS,
    FIXED_GRADS,
    FRESH_GRADS,
    VARIANTS,
    make_variant,
)
from kitsune.config import GraphConfig
from kitsune.optimizer import KitsuneOptimizer
from kitsune.profiler.schema import collect_environment

FP32_BYTES = 4
# An fp32 AdamW step touches each parameter's four tensors once: it reads param, grad, exp_avg and exp_avg_sq,
# and writes param, exp_avg and exp_avg_sq back. Nothing less can do the update.
ADAMW_BYTES_PER_PARAM = FP32_BYTES * (4 + 3)  # 28
# The AMP + clipping phase as kitsune's two passes do it: pass 1 reads the grad (norms, inf check); pass 2 is
# the AdamW update above plus writing the grad back as zero (zero_grad(set_to_none=False)).
PHASE_BYTES_PER_PARAM = FP32_BYTES * (1 + 4 + 3 + 1)  # 36
COMPILED_WARMUP = 3
"""The fewest warm-up steps of a peer whose step is compiled: compilation must end before the timers start."""
PEER_PASS_SECONDS = 10.0
"""About how long a peer's timed pass may take (each of its two): a peer whose warm-up steps show it slower times
fewer steps, at least `PEER_MIN_STEPS` (torchao's 8-bit AdamW took about a second a step on ``many``, 2000 tensors:
the set's 50 steps twice made a ``--peers`` run longer than a lent GPU's 10-minute call)."""
PEER_MIN_STEPS = 5
"""The fewest steps a peer's timed pass takes, however slow its step."""
PEER_SECONDS = 90.0
"""The longest one peer may run on a set, from building it to its last timed step: a peer still running then is
stopped and its row says where (a library that compiles its step for each of ``many``'s 2,000 tensors ran past a lent
GPU's 10-minute call and took every later row with it). Enforced where a timer signal can be (the main thread on
POSIX) and seen when the library's code next runs Python."""
# An fp32 Lion step reads param, grad and exp_avg and writes param and exp_avg back.
LION_BYTES_PER_PARAM = FP32_BYTES * (3 + 2)  # 20


_Body = Callable[[], tuple[StepTimes, KitsuneInfo | None]]


class PeerStopped(Exception):
    """A peer ran past `PEER_SECONDS` (the message says in what)."""


@contextlib.contextmanager
def _time_limit(seconds: float, doing: Callable[[], str]) -> Iterator[None]:
    """Raise `PeerStopped` in the code below once ``seconds`` have passed (``doing()`` names what it was doing);
    without a timer signal here (not the main thread, or not POSIX) the code runs unbounded."""
    if seconds <= 0 or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise PeerStopped(f"ran past {seconds:g} s (PEER_SECONDS), {doing()}")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _stopped(exc: BaseException) -> PeerStopped | None:
    """The `PeerStopped` that ``exc`` was raised from or while handling, if any: a library that catches everything
    its compiler raises (``torch.compile``'s backends do) re-raises the time limit as an error of its own."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, PeerStopped):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _measure(result: VariantResult, body: _Body, device: torch.device, floor_ms: float) -> VariantResult:
    """Run ``body`` (which allocates, warms up and times) and fill ``result``; failures are recorded, not raised.

    Everything ``body`` allocated lives in its frame, so it is gone before the memory is handed back here.
    """
    try:
        times, result.kitsune = body()
        result.device_ms, result.host_ms = Stats.of(times.device_ms), Stats.of(times.host_ms)
        result.busy_host_ms = Stats.of(times.busy_host_ms) if times.busy_host_ms else None
        result.device_ms_steps, result.host_ms_steps = times.device_ms, times.host_ms
        median = result.device_ms.median
        result.pct_of_floor = 100 * floor_ms / median if median > 0 else None
    except ParamsDidNotMove as exc:  # its times are those of a step that does nothing: none are kept
        result.status, result.reason = "not_timed", f"{exc}: not timed"
    except Exception as exc:  # one broken variant must not cost the others their numbers
        stopped = _stopped(exc)
        if stopped is not None:
            wrapped = "" if stopped is exc else f" (raised again as {type(exc).__name__})"
            result.status, result.reason = "stopped", f"{stopped}{wrapped}"
        else:
            result.status, result.reason = "failed", failure_reason(exc)
    try:
        free_memory(device)
    except Exception as exc:  # e.g. a CUDA error left by the variant surfaces at the synchronize
        cleanup = f"freeing memory after it: {failure_reason(exc)}"
        result.status, result.reason = "failed", "; ".join(filter(None, [result.reason, cleanup]))
    return result


def run_variant(
    name: str,
    pset: ParamSet,
    device: torch.device,
    steps: int,
    warmup: int,
    floor_ms: float,
    seed: int = 0,
    audit: bool = False,
    grads: str = "kept",
) -> VariantResult:
    """Time one variant on fresh params (seeded: every variant starts from the same values).

    ``audit`` (``--peers`` runs, where the variants sit next to the peers): also count the state's bytes after
    warm-up and check, as a peer's, that the params moved on every checked step. ``grads`` (`GRADS`): ``fresh``
    frees and re-allocates every grad before each warm-up and timed step (`fresh_grads`, outside the timers); the
    variants that need grads in place (`FIXED_GRADS`) are skipped then; the variants of `FRESH_GRADS` always run so
    (and are skipped with ``fresh``: their row would repeat another).
    """
    result = VariantResult(variant=name, label=VARIANTS[name], status="ok")
    check_grads_mode(grads)
    if name in FRESH_GRADS:
        if grads == "fresh":
            result.status = "skipped"
            result.reason = f"with --grads fresh the {VARIANTS[FRESH_GRADS[name]]!r} row re-allocates its grads already"
            return result
        grads = "fresh"
    if grads == "fresh" and name in FIXED_GRADS:
        result.status, result.reason = "skipped", FIXED_GRADS[name]
        return result
    if name in BYTES_PER_PARAM:  # low-precision state: its own floor, and its state's memory in the table
        floor_ms *= BYTES_PER_PARAM[name] / ADAMW_BYTES_PER_PARAM
        audit = True
    if name == "graph" and device.type != "cuda":
        result.status, result.reason = "skipped", "CUDA only: a CUDA graph captures GPU work"
        return result
    shortfall = memory_shortfall(pset, device, moving_grads=grads == "fresh")
    if shortfall is not None:
        result.status, result.reason = "skipped", shortfall
        return result

    def body() -> tuple[StepTimes, KitsuneInfo | None]:
        params = make_params(pset, device, seed)
        variant = make_variant(name, params)
        between = None
        if grads == "fresh":
            between = partial(fresh_grads, params, torch.Generator(device=device).manual_seed(seed + 1))
        try:
            variant.warmup(warmup, between)
            if audit:
                result.state_bytes, _ = state_bytes(variant.opt.state)
            check = MoveCheck(params, [n for n, _ in pset.shapes])  # every row: a step that moves nothing is no row
            times = time_steps(variant.step, steps, device, between=between, check=check)
            check.verify()
            return times, variant.info()
        finally:
            variant.close()

    return _measure(result, body, device, floor_ms)


def run_peer(
    peer: Peer, pset: ParamSet, device: torch.device, steps: int, warmup: int, floor_ms: float, seed: int = 0
) -> VariantResult:
    """Time one peer on fresh params (the variants' values), after checking what its step does to the grads.

    The first warm-up step shows it: a step that leaves the grads alone gets nothing between steps, as the
    variants; one that zeroes or overwrites them gets fresh random grads in place before each later step; one that
    sets ``p.grad`` to None (or replaces it) gets the original grad tensors back, refilled. Either runs outside
    the timers (in the back-to-back pass the step's host work may overlap the refill's kernels on the GPU, as a
    training step's overlaps backward's). Then the steps are timed as a variant's, with
    a `MoveCheck`: a peer whose params did not move on every checked step is reported as not timed. A peer that
    compiles gets at least ``COMPILED_WARMUP`` warm-up steps (heavyball's ``compile_step`` runs its first step
    eagerly and compiles on the second). A peer whose last warm-up step took longer than ``PEER_PASS_SECONDS /
    steps`` times fewer steps (`peer_steps`): its `PeerInfo` says how many. A peer still running after
    `PEER_SECONDS` is stopped: its row's status is ``stopped``, its reason says in what.
    """
    warmup = max(warmup, COMPILED_WARMUP) if peer.compiles else warmup
    info = PeerInfo(
        package=peer.package,
        pip=peer.pip,
        version=peer_version(peer),
        algorithm=peer.algorithm,
        settings=peer.settings(device),
        reference=peer is KITSUNE_LION,
        warmup=warmup,
    )
    result = VariantResult(variant=peer.name, label=peer.label, status="ok", peer=info)
    shortfall = memory_shortfall(pset, device)
    if shortfall is not None:
        result.status, result.reason = "skipped", shortfall
        return result

    doing = ["while it was built"]  # what the peer is doing, for a stop's message

    def body() -> tuple[StepTimes, KitsuneInfo | None]:
        params = make_params(pset, device, seed)
        grads = [p.grad for p in params]
        gen = torch.Generator(device=device).manual_seed(seed + 1)

        def refill() -> None:
            refill_grads(params, gen)

        def reattach() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            refill_grads(params, gen)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = peer.build(params, device)
            before = _norms(grads)
            doing[0] = "in its first step"
            built.step()
            if any(p.grad is not g for p, g in zip(params, grads, strict=True)):
                info.grads, between = "reattached", reattach
            elif not torch.equal(_norms(grads), before):
                info.grads, between = "refilled", refill
            else:
                info.grads, between = "kept", None
            for i in range(warmup - 1):
                doing[0] = f"in warm-up step {i + 2} of {warmup}"
                if between is not None:
                    between()
                if i == warmup - 2:  # the last warm-up step, timed as a step of the host pass: how long a pass takes
                    synchronize(device)
                    t0 = time.perf_counter()
                built.step()
            if warmup > 1:
                synchronize(device)
                info.warm_step_ms = (time.perf_counter() - t0) * 1e3
                fewer = peer_steps(steps, info.warm_step_ms / 1e3)
                info.short_steps = fewer if fewer < steps else None
        for message in dict.fromkeys(str(w.message) for w in caught):
            if len(info.warnings) < 5:
                info.warnings.append(message)
        result.state_bytes, info.state_paged = state_bytes(built.opt.state)
        ours = isinstance(built.opt, KitsuneOptimizer)
        mark = step_mark(built.opt) if ours else None
        check = MoveCheck(params, [n for n, _ in pset.shapes])
        doing[0] = f"in its timed steps ({info.short_steps or steps} a pass)"
        times = time_steps(built.step, info.short_steps or steps, device, between=between, check=check)
        check.verify()
        info.checked_steps = check.checked_steps
        # kitsune's own reference rows (its fused Lion): what they ran, as the variants' rows say it
        return times, kitsune_info(built.opt, len(params), since=mark) if ours else None

    def body_then_reset() -> tuple[StepTimes, KitsuneInfo | None]:
        try:
            with _time_limit(PEER_SECONDS, lambda: doing[0]):
                return body()
        finally:
            if peer.compiles:  # compiled code and its guards would keep this peer's params and state alive
                torch._dynamo.reset()

    return _measure(result, body_then_reset, device, floor_ms)


def peer_steps(steps: int, step_seconds: float) -> int:
    """The steps a peer's timed pass takes: ``steps``, or fewer (at least `PEER_MIN_STEPS`) where ``steps`` of
    ``step_seconds`` each would take longer than `PEER_PASS_SECONDS`."""
    fit = int(PEER_PASS_SECONDS / step_seconds) if step_seconds > 0 else steps
    return max(min(steps, PEER_MIN_STEPS), min(steps, fit))


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(torch._foreach_norm(tensors)).cpu()


def run_phase(
    pset: ParamSet, device: torch.device, steps: int, warmup: int, floor_ms: float, seed: int = 0
) -> list[VariantResult]:
    """The careful AMP loop (unscale, clip 1.0, AdamW, scale update, zero the grads), torch's and kitsune's.

    ``fused``: GradScaler, ``torch.nn.utils.clip_grad_norm_`` and torch's fused AdamW. ``kitsune``: kitsune's own
    loss scaler with ``max_grad_norm=1.0`` and ``zero_in_step``: one norm launch (unscale, inf check, global norm)
    and one update launch (unscale, clip, skip, AdamW, zero). ``kitsune_scaler``: torch's GradScaler calls driving
    a fused ``KitsuneOptimizer`` with ``kitsune.clip_grad_norm_``, for a user who keeps their GradScaler loop.
    """
    from kitsune.clip import clip_grad_norm_ as kitsune_clip
    from kitsune.config import AMPConfig, GradConfig
    from kitsune.optimizer import KitsuneOptimizer

    def torch_opt(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **ADAMW, fused=True)

    def kitsune_opt(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return KitsuneOptimizer(torch.optim.AdamW(params, **ADAMW), enable_fusion=True)

    def kitsune_in_step(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return KitsuneOptimizer(
            torch.optim.AdamW(params, **ADAMW),
            enable_fusion=True,
            enable_amp=True,
            amp_config=AMPConfig(dtype=torch.float16),
            grad_config=GradConfig(max_norm=1.0, zero_in_step=True),
        )

    sides = [
        (VariantResult(variant="fused", label="torch fused loop", status="ok"), torch_opt, _torch_clip),
        (VariantResult(variant="kitsune", label="kitsune, all in the step", status="ok"), kitsune_in_step, None),
        (
            VariantResult(variant="kitsune_scaler", label="kitsune under GradScaler", status="ok"),
            kitsune_opt,
            kitsune_clip,
        ),
    ]
    shortfall = memory_shortfall(pset, device)
    if shortfall is not None:
        for result, _, _ in sides:
            result.status, result.reason = "skipped", shortfall
        return [result for result, _, _ in sides]

    def timed(make_opt: Any, clip: Any) -> _Body:
        def body() -> tuple[StepTimes, KitsuneInfo | None]:
            params = make_params(pset, device, seed)
            opt = make_opt(params)
            scaler = torch.amp.GradScaler(device.type)
            scaler.scale(torch.ones((), device=device))  # creates the scale, as scaler.scale(loss) does each step
            gen = torch.Generator(device=device).manual_seed(seed + 1)

            def phase() -> None:
                scaler.unscale_(opt)
                clip(params, 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=False)

            def in_step() -> None:
                opt.step()  # unscale, inf check, clip, update, skip, zero: two launches, then the scale update
                opt.zero_grad(set_to_none=False)  # nothing left to do: the step zeroed the grads

            def refill() -> None:
                refill_grads(params, gen)
                if clip is None:
                    opt.scale_loss(one)  # what optimizer.backward(loss) does before the backward pass

            one = torch.ones((), device=device)
            if clip is None:
                phase = in_step
            # the grads are zeroed each step: every step gets fresh random grads, outside the timers
            for _ in range(warmup):
                refill()
                phase()
            ours = isinstance(opt, KitsuneOptimizer)
            mark = step_mark(opt) if ours else None
            times = time_steps(phase, steps, device, between=refill)
            # what kitsune's sides ran with (a fallback shows in the table's notes, not as a "kitsune" time)
            return times, kitsune_info(opt, len(params), since=mark) if ours else None

        return body

    return [_measure(result, timed(make_opt, clip), device, floor_ms) for result, make_opt, clip in sides]


def _torch_clip(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _ratios(variants: list[VariantResult], ours: str = "kitsune") -> dict[str, float]:
    mine = next((v for v in variants if v.variant == ours and v.status == "ok"), None)
    if mine is None or not mine.device_ms.median > 0:
        return {}
    return {
        v.variant: v.device_ms.median / mine.device_ms.median
        for v in variants
        if v.variant != ours and v.status == "ok"
    }


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` (None: ``auto``) through `kitsune._device.parse_device`, a CUDA device with its index."""
    try:
        dev = parse_device("auto" if device is None else str(device))
    except ValueError as exc:
        raise ValueError(f"--device: {exc}") from None
    if dev.type == "cuda" and dev.index is None:  # torch.cuda.set_device and the allocator's counters need an index
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _command_line() -> str:
    return shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))


def run_bench(
    sets: list[str] | tuple[str, ...] = tuple(PARAM_SETS),
    variants: list[str] | tuple[str, ...] = DEFAULT_VARIANTS,
    device: str | torch.device | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    scale: float | None = None,
    phase: bool = False,
    json_path: str | Path | None = None,
    seed: int = 0,
    console: Console | None = None,
    command: str | None = None,
    e2e: bool = False,
    compile_backend: str | None = None,
    e2e_steps: int | None = None,
    e2e_batch: int | None = None,
    peers: Sequence[str] | Literal["all"] | None = None,
    grads: str = "kept",
) -> BenchResult:
    """Time every variant on every set, print the table, and write JSON when ``json_path`` is given.

    On a CPU the run is a smoke test, not a comparison (``BenchResult.cpu_smoke``): kitsune is a pass-through there,
    so the printed tables leave every ratio out; the JSON keeps the raw times.

    Args:
        sets: parameter set names (``PARAM_SETS``).
        variants: variant names (``VARIANTS``), run in this order on each set.
        device: ``cuda``, ``cpu`` or None for a GPU when there is one.
        steps: timed steps per variant; None: each set's default on a GPU (`ParamSet.default_steps`), 3 on a CPU.
        warmup: untimed steps first (at least 1); None: 10 on a GPU, 1 on a CPU.
        scale: shrink each tensor to about this fraction of its elements; None: 1 on a GPU, 0.001 on a CPU.
        phase: also time the AMP + clipping phase on the gpt2 set.
        json_path: where to write the results (rewritten after every set, ``complete`` set at the end).
        seed: seed of the params and grads (the same for every variant).
        console: where the progress bar and table go.
        command: the command line to record; None: this process's.
        e2e: also time whole training steps of a GPT-2 124M-shaped model (a tiny one on a CPU).
        compile_backend: with ``e2e``, run the model through ``torch.compile`` with this backend on every side.
        e2e_steps: with ``e2e``, timed steps a side; None: 50 on a GPU, 2 on a CPU.
        e2e_batch: with ``e2e``, sequences a step; None: 4 (a larger batch gives the GPU more work per step of host
            time: on a fast GPU, batch 4 leaves the step bound by the host).
        peers: also time these peers (``PEERS`` names; ``"all"``: every one, except on a CPU those that compile
            their step) after the variants on each set, each installed one in its row and the rest listed as not
            installed; Lion peers in a Lion section per set, next to kitsune's fused Lion. The variants then also
            record their state's bytes and have their moves checked, as the peers.
        grads: what happens to the variants' grads between steps (`GRADS`): ``kept`` (the same tensors and values)
            or ``fresh`` (freed and re-allocated with new values before every step, as ``zero_grad()`` and
            ``backward()`` leave them; outside the timers). With ``fresh`` the variants that need grads in place
            (torch's CUDA graph, ``static_addresses=True``) are skipped, and so are the paired measurements (the
            rows' grads are kept there); the phase and end to end are unchanged (their grads are fresh anyway).
    """
    dev = _resolve_device(device)
    cuda = dev.type == "cuda"
    for name in sets:
        get_param_set(name)  # unknown names fail before anything runs
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")
    warmup = warmup if warmup is not None else (10 if cuda else 1)
    scale = scale if scale is not None else (1.0 if cuda else 0.001)
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 (the graph variant captures after it), got {warmup}")
    least = GraphConfig().warmup_steps + 1  # kitsune's eager steps, then the one that captures its graph
    if cuda and warmup < least:
        raise ValueError(
            f"warmup must be at least {least} on CUDA, got {warmup}: kitsune captures its CUDA graph after "
            f"{least - 1} eager steps, and a capture inside the timed steps would be timed as a step"
        )
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if (compile_backend is not None or e2e_steps is not None or e2e_batch is not None) and not e2e:
        raise ValueError(
            "--compile, --e2e-steps and --e2e-batch apply to the end-to-end run: add --e2e, or leave them out"
        )
    if e2e_steps is not None and e2e_steps < 1:
        raise ValueError(f"e2e_steps must be at least 1, got {e2e_steps}")
    if compile_backend is not None:
        try:
            check_compile_backend(compile_backend)
        except ValueError as exc:
            raise ValueError(f"--compile: {exc}") from None
    if e2e_batch is not None and e2e_batch < 1:
        raise ValueError(f"e2e_batch must be at least 1, got {e2e_batch}")
    check_grads_mode(grads)
    if grads != "kept" and peers is not None:
        raise ValueError("--grads fresh times the variants only: leave out --peers (each peer's grads follow its step)")
    chosen, skipped_peers = select_peers(peers, dev) if peers is not None else ([], {})
    console = console or default_console()
    if cuda:
        torch.cuda.set_device(dev)
        console.print(native_check_ready(dev))

    bandwidth, copy_bytes = copy_bandwidth(dev)
    result = BenchResult(
        created=datetime.now(timezone.utc),
        command=command or _command_line(),
        environment=collect_environment(dev),
        device=str(dev),
        timer="cuda_events" if cuda else "perf_counter",
        cpu_smoke=not cuda,
        copy_bandwidth_gbs=bandwidth / 1e9,
        copy_buffer_bytes=copy_bytes,
        adamw={**ADAMW, "betas": list(ADAMW["betas"])},
        sets=[],
        phase=None,
        grads=grads,
        complete=False,
    )
    console.print(
        f"kitsune bench on {result.environment.device_name} ({dev}): copy bandwidth {bandwidth / 1e9:,.0f} GB/s, "
        f"AdamW fp32 moves {ADAMW_BYTES_PER_PARAM} bytes/param"
        + ("; grads freed and re-allocated before every step (--grads fresh)" if grads == "fresh" else "")
    )
    for peer in [p for p in PEERS.values() if p in chosen or p.name in skipped_peers]:
        ok = installed(peer)
        result.peers.append(
            PeerStatus(
                name=peer.name,
                label=peer.label,
                package=peer.package,
                pip=peer.pip,
                installed=ok,
                version=peer_version(peer) if ok else None,
                skipped=skipped_peers.get(peer.name) if ok else None,
            )
        )
    ready = [PEERS[s.name] for s in result.peers if s.installed and s.skipped is None]
    adamw_peers = [p for p in ready if p.algorithm == "adamw"]
    lion_peers = [p for p in ready if p.algorithm == "lion"]
    if lion_peers:  # a Lion section: kitsune's fused Lion first, what the Lion peers are compared with
        lion_peers.insert(0, KITSUNE_LION)
    for line in peer_lines(result.peers):
        console.print(line, highlight=False)

    def set_steps(pset: ParamSet) -> int:
        return steps if steps is not None else (pset.default_steps if cuda else 3)

    def new_set(pset: ParamSet, workload: str, bytes_per_param: int) -> SetResult:
        nbytes = bytes_per_param * pset.n_elements
        return SetResult(
            name=pset.name,
            workload=workload,
            description=pset.description,
            n_tensors=pset.n_tensors,
            n_elements=pset.n_elements,
            scale=scale,
            bytes_per_param=bytes_per_param,
            bytes_per_step=nbytes,
            floor_ms=nbytes / bandwidth * 1e3,
            steps=set_steps(pset),
            warmup=warmup,
            variants=[],
            ratio_to_kitsune={},
        )

    def report(set_name: str, v: VariantResult) -> None:
        if v.status == "ok":
            line = f"{v.device_ms.median:.3f} ms/step, host {v.host_ms.median:.3f} ms"
            if v.busy_host_ms is not None and v.device_ms.median != v.busy_host_ms.median:  # (CPU: the same times)
                line += f" ({v.busy_host_ms.median:.3f} back to back)"
        else:
            line = f"{v.status}: {v.reason}"
        console.print(f"  {set_name:8s} {v.label:16s} {line}", highlight=False)

    def save() -> None:
        if json_path is not None:
            result.save(json_path)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # no auto-refresh: a refresh thread would compete for the GIL with the host time being measured
    with Progress(*columns, console=console, auto_refresh=False) as progress:
        per_set = len(variants) + len(adamw_peers) + len(lion_peers)
        task = progress.add_task("bench", total=len(sets) * per_set + int(phase) + int(e2e))
        for name in sets:
            pset = get_param_set(name, scale)
            entry = new_set(pset, "adamw_step", ADAMW_BYTES_PER_PARAM)
            audit = peers is not None
            for variant in variants:
                progress.update(task, description=f"{name}: {VARIANTS[variant]}")
                progress.refresh()
                v = run_variant(variant, pset, dev, entry.steps, warmup, entry.floor_ms, seed, audit=audit, grads=grads)
                entry.variants.append(v)
                report(name, v)
                progress.advance(task)
            for peer in adamw_peers:
                progress.update(task, description=f"{name}: {peer.label}")
                progress.refresh()
                v = run_peer(peer, pset, dev, entry.steps, warmup, entry.floor_ms, seed)
                entry.variants.append(v)
                report(name, v)
                progress.advance(task)
            entry.ratio_to_kitsune = _ratios(entry.variants)
            # the pairs time kept grads: beside rows with fresh ones they would compare apart
            pairs_off = None
            if grads != "kept":
                pairs_off = f"not measured with --grads {grads}: the paired measurements keep the grads in place"
            if {"kitsune", "profiled"} <= set(variants):
                if pairs_off is not None:
                    entry.profiler_cost_reason = pairs_off
                else:
                    progress.update(task, description=f"{name}: the profiler's cost in pairs")
                    progress.refresh()
                    entry.profiler_cost, entry.profiler_cost_reason = run_profiler_cost(
                        pset, dev, entry.steps, warmup, seed
                    )
                    if cuda:  # a comparison: noise on a CPU, where it stays in the JSON only
                        console.print(f"  {name:8s} {profiler_cost_line(entry)}", highlight=False)
            if cuda and {"kitsune", "graph"} <= set(variants):
                if pairs_off is not None:
                    entry.paired_reason = pairs_off
                else:
                    progress.update(task, description=f"{name}: kitsune against torch's CUDA graph in pairs")
                    progress.refresh()
                    entry.paired, entry.paired_reason = run_paired_ratio(pset, dev, entry.steps, warmup, seed)
                    console.print(f"  {name:8s} {paired_line(entry)}", highlight=False)
            result.sets.append(entry)
            save()
            if lion_peers:
                lion = new_set(pset, "lion_step", LION_BYTES_PER_PARAM)
                for peer in lion_peers:
                    progress.update(task, description=f"{name}: {peer.label}")
                    progress.refresh()
                    v = run_peer(peer, pset, dev, lion.steps, warmup, lion.floor_ms, seed)
                    lion.variants.append(v)
                    report(f"{name} Lion", v)
                    progress.advance(task)
                lion.ratio_to_kitsune = _ratios(lion.variants, ours=KITSUNE_LION.name)
                result.lion.append(lion)
                save()
        if phase:
            pset = get_param_set("gpt2", scale)
            progress.update(task, description="gpt2: AMP + clipping phase")
            progress.refresh()
            result.phase = new_set(pset, "amp_clip_phase", PHASE_BYTES_PER_PARAM)
            result.phase.variants = run_phase(pset, dev, result.phase.steps, warmup, result.phase.floor_ms, seed)
            result.phase.ratio_to_kitsune = _ratios(result.phase.variants)
            for v in result.phase.variants:
                report("phase", v)
            progress.advance(task)
        if e2e:
            progress.update(task, description="end to end: GPT-2 124M training steps")
            progress.refresh()
            result.e2e = run_e2e(
                dev,
                steps=e2e_steps or (50 if cuda else 2),
                warmup=10 if cuda else 1,
                batch=e2e_batch or 4,
                seed=seed,
                compile_backend=compile_backend,
            )
            save()
            progress.advance(task)
        progress.update(task, description="done")
        progress.refresh()
    result.complete = True
    save()
    print_results(result, console)
    if json_path is not None:
        console.print(f"results written to {as_path(json_path)}", soft_wrap=True, markup=False)  # "~" expanded
    return result
