"""Measurements in pairs: two variants alive over copies of the same params, timed in alternating rounds (half of
them on a pair built in each order), each round's difference taken between sides run moments apart: the profiler's
cost (`run_profiler_cost`) and kitsune against torch's CUDA graph (`run_paired_ratio`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kitsune.bench.guards import failure_reason, free_memory, memory_shortfall
from kitsune.bench.params import ParamSet, make_params
from kitsune.bench.results import PairedRatio, ProfilerCost
from kitsune.bench.timing import Stats, paired_rounds
from kitsune.bench.variants import make_variant

PROFILER_ROUNDS = 10
"""The fewest rounds of a paired measurement (`_in_pairs`): half on a pair built with kitsune first, half on one
built with the other side first; on a CPU, all of them."""
PAIR_ROUNDS_MAX = 300
"""The most rounds of a paired measurement on CUDA: a host-bound step's rounds differ by +-15% (an H200's host,
`many`), so a median that resolves 2% takes a few hundred of them."""
PAIR_SECONDS = 2.0
"""CUDA: a paired measurement runs as many rounds as fit in about this many seconds (between `PROFILER_ROUNDS` and
`PAIR_ROUNDS_MAX`): on an H200 (2026-12-04) the profiler's cost got 162 rounds on `many`, 48 on `gpt2` and 10 on
`llama1b`."""
PROFILER_ROUND_STEPS = 10
"""Steps a side in each of its rounds (fewer where the set's timed steps are fewer): 10 rounds of 10 add about 400
steps to a set, 3 s on `llama1b`."""


def run_profiler_cost(
    pset: ParamSet, device: torch.device, steps: int, warmup: int, seed: int = 0
) -> tuple[ProfilerCost | None, str | None]:
    """``profile=True``'s cost on this set, measured in pairs (`ProfilerCost`): the ``kitsune`` and ``profiled``
    variants built over copies of the same seeded params, each warmed up, then alternating rounds (`_in_pairs`).
    ``(cost, None)``, or ``(None, why)`` where the GPU cannot hold both or a step failed."""

    def cost(device_pct: list[float], host_ms: list[float], round_steps: int) -> ProfilerCost:
        return ProfilerCost(
            rounds=len(device_pct), steps=round_steps, device_pct=Stats.of(device_pct), host_ms=Stats.of(host_ms)
        )

    return _paired_or_why(pset, device, steps, warmup, seed, "profiled", cost)


def run_paired_ratio(
    pset: ParamSet, device: torch.device, steps: int, warmup: int, seed: int = 0, against: str = "graph"
) -> tuple[PairedRatio | None, str | None]:
    """``against`` (a variant) over kitsune on this set, measured in pairs (`PairedRatio`), as the profiler's cost
    is: the table's ``t / kitsune`` divides the medians of passes run one after another, which a host's drift and
    the order of the rows move. ``(ratio, None)``, or ``(None, why)``."""

    def paired(device_pct: list[float], host_ms: list[float], round_steps: int) -> PairedRatio:
        ratios = [1 + pct / 100 for pct in device_pct]
        return PairedRatio(
            against=against, rounds=len(ratios), steps=round_steps, ratio=Stats.of(ratios), host_ms=Stats.of(host_ms)
        )

    return _paired_or_why(pset, device, steps, warmup, seed, against, paired)


def _paired_or_why(
    pset: ParamSet, device: torch.device, steps: int, warmup: int, seed: int, other: str, result: Callable[..., Any]
) -> tuple[Any, str | None]:
    """``(result(device_pct, host_ms, round_steps), None)`` of `_in_pairs` of kitsune and ``other``, or ``(None,
    why)`` where the GPU cannot hold both or a step failed (the table's rows stand without it)."""
    shortfall = memory_shortfall(pset, device, copies=2)
    if shortfall is not None:
        return None, f"two optimizers of the set: {shortfall}"
    try:
        return result(*_in_pairs(pset, device, steps, warmup, seed, "kitsune", other)), None
    except Exception as exc:
        return None, failure_reason(exc)
    finally:
        free_memory(device)


def _in_pairs(
    pset: ParamSet, device: torch.device, steps: int, warmup: int, seed: int, off: str, on: str
) -> tuple[list[float], list[float], int]:
    """`paired_rounds` of variants ``off`` and ``on`` (each round: ``on`` against ``off``), half of the rounds on a
    pair built ``off`` first and half on one built ``on`` first: the side built second ran faster on a host-bound set
    whichever it was (its objects land in fresh memory, the first's in the holes the table's rows left). The rounds:
    `PROFILER_ROUNDS` on a CPU; on CUDA as many as fit in `PAIR_SECONDS` (`_pair_rounds`). ``(device_pct, host_ms,
    steps a side in a round)``."""
    round_steps = max(1, min(steps, PROFILER_ROUND_STEPS))
    rounds: int | None = None  # a half's rounds: set by the first pair built

    def pairs(order: tuple[str, str]) -> tuple[list[float], list[float]]:
        nonlocal rounds
        built: dict[str, Any] = {}  # the optimizers and params live in this frame: gone before `_free`
        try:
            for name in order:
                built[name] = make_variant(name, make_params(pset, device, seed))
                built[name].warmup(warmup)
            if rounds is None:
                rounds = _pair_rounds(built[off].step, built[on].step, round_steps, device) // 2
            return paired_rounds(built[off].step, built[on].step, rounds, round_steps, device)
        finally:
            for variant in built.values():
                variant.close()

    device_pct: list[float] = []
    host_ms: list[float] = []
    for order in ((off, on), (on, off)):
        pct, host = pairs(order)
        free_memory(device)
        device_pct += pct
        host_ms += host
    return device_pct, host_ms, round_steps


def _pair_rounds(off: Callable[[], object], on: Callable[[], object], round_steps: int, device: torch.device) -> int:
    """Rounds of a paired measurement, both halves: `PROFILER_ROUNDS` on a CPU (a dry run of the harness); on CUDA,
    as many as one untimed round's time says fit in `PAIR_SECONDS`, between `PROFILER_ROUNDS` and
    `PAIR_ROUNDS_MAX`."""
    if device.type != "cuda":
        return PROFILER_ROUNDS
    t0 = time.perf_counter()
    paired_rounds(off, on, 1, round_steps, device)
    seconds = time.perf_counter() - t0
    return int(min(PAIR_ROUNDS_MAX, max(PROFILER_ROUNDS, PAIR_SECONDS / max(seconds, 1e-9))))
