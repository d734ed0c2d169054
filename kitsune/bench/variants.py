"""The AdamW variants ``kitsune bench`` times: torch's foreach, fused and CUDA-graph steps, and kitsune's."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from kitsune.bench.info import KitsuneInfo, kitsune_info, step_mark

ADAMW = {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
"""The AdamW hyperparameters every variant uses (betas and eps are torch's defaults)."""

VARIANTS: dict[str, str] = {
    "foreach": "torch foreach",
    "fused": "torch fused",
    "graph": "torch graph",
    "kitsune": "kitsune",
    "fresh": "kitsune, grads re-allocated",
    "eager": "kitsune, capture_graph=False",
    "static": "kitsune, static_addresses=True",
    "profiled": "kitsune, profile=True",
    "8bit": "kitsune, state_precision='8bit'",
    "bf16state": "kitsune, state_precision='bf16'",
}
"""Variant name (what ``--variants`` takes) -> label in the table. ``graph`` is fused + capturable AdamW replayed
from a CUDA graph; ``kitsune`` is kitsune as it comes (on CUDA its phase is captured in a CUDA graph after
warm-up), ``fresh`` the same with every grad freed and re-allocated with new values before each step, outside the
timers (`FRESH_GRADS`: as a training loop's ``zero_grad()`` and ``backward()`` leave them, beside the rows whose
grads stay in place), ``eager`` the same with ``capture_graph=False``, ``static`` the same with
``GraphConfig(static_addresses=True)`` (the grads stay in place, as in every variant here, so the per-step address
checks are skipped); ``profiled`` is kitsune with ``profile=True`` as it comes (`ProfilerConfig`'s defaults: the
NVML sampler on, the probe in its window), warmed up past the sampled windows, so its timed steps are the steady
ones a profiled run takes. ``8bit`` and ``bf16state`` are the one line with
``FusionConfig(state_precision=...)`` (and ``min_8bit_size``'s default): their % of floor is against their own
bytes (`BYTES_PER_PARAM`), and the table adds the state's memory."""

DEFAULT_VARIANTS = ("foreach", "fused", "graph", "kitsune", "fresh", "eager", "static", "profiled")
"""What a run without ``--variants`` times (``--peers`` runs time fused, kitsune and the low-precision ones)."""

FIXED_GRADS = {
    "graph": "torch's CUDA-graph recipe captures the grads' addresses: its loop keeps the grads in place "
    "(zero_grad(set_to_none=False)), so it does not run with --grads fresh",
    "static": "static_addresses=True promises grads that stay in place: it does not run with --grads fresh",
}
"""The variants that need the grads to stay where they are, and why (``--grads fresh`` skips them)."""

FRESH_GRADS = {"fresh": "kitsune"}
"""The variants that run another with fresh grads (``--grads fresh`` for that row alone): name -> the variant run."""

STATE_PRECISION = {"8bit": "8bit", "bf16state": "bf16"}
"""The low-precision variants and the ``state_precision`` each runs."""


def _adamw_bytes(precision: str) -> float:
    from kitsune.fusion.algos import ALGOS
    from kitsune.fusion.state_format import PRECISIONS, update_bytes
    from kitsune.kernels.spec import Algo, UpdateSpec

    spec = UpdateSpec(Algo.ADAM, decoupled_wd=True, state=PRECISIONS[precision])
    return update_bytes(spec, ALGOS[torch.optim.AdamW].bytes_per_element(spec), torch.float32)


BYTES_PER_PARAM = {name: _adamw_bytes(precision) for name, precision in STATE_PRECISION.items()}
"""Bytes an AdamW step moves per param in the low-precision variants, as the planner counts them (fp32 params read
and written, the fp32 grad read; each moment read and written in 1 byte plus its share of an fp32 absmax per 256:
16.06 in all, or in 2 bytes: 20); fp32 state moves 28."""


class _TorchVariant:
    """A torch AdamW; ``step`` is its bound ``step`` so the timers see nothing else."""

    def __init__(self, params: list[torch.nn.Parameter], **flags: bool) -> None:
        self.opt: torch.optim.Optimizer = torch.optim.AdamW(params, **ADAMW, **flags)
        self.step = self.opt.step

    def warmup(self, n: int, between: Callable[[], object] | None = None) -> None:
        """``n`` untimed steps, ``between`` before each (e.g. fresh grads)."""
        for _ in range(n):
            if between is not None:
                between()
            self.step()

    def info(self) -> KitsuneInfo | None:
        return None

    def close(self) -> None:
        del self.opt, self.step


class _GraphVariant(_TorchVariant):
    """Fused capturable AdamW captured once in a CUDA graph, then replayed."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        if params and params[0].device.type != "cuda":
            raise ValueError("the graph variant needs CUDA params")
        super().__init__(params, fused=True, capturable=True)
        self.graph: torch.cuda.CUDAGraph | None = None

    def warmup(self, n: int, between: Callable[[], object] | None = None) -> None:
        if between is not None:
            raise ValueError(FIXED_GRADS["graph"])
        # Eager steps on a side stream first (torch's recipe: state is allocated and kernels are loaded outside
        # the capture), then capture one step, then replay the rest: n steps in all, as the other variants run.
        eager = max(1, min(3, n))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side), warnings.catch_warnings():
                # torch warns that capturable=True runs uncaptured: true, and intended, for these steps only
                warnings.filterwarnings("ignore", message=".*capturable=True.*")
                for _ in range(eager):
                    self.opt.step()
        finally:  # a step that raised: the next variant's timing does not start under what it queued
            torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.opt.step()  # recorded, not run
        self.step = self.graph.replay
        for _ in range(n - eager):
            self.step()

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()  # gives its private memory pool back
            self.graph = None
        super().close()


class _KitsuneVariant(_TorchVariant):
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        profile: bool = False,
        graph: bool = True,
        static: bool = False,
        state_precision: str = "param",
    ) -> None:
        from kitsune.config import FusionConfig, GraphConfig, KitsuneConfig, ProfilerConfig
        from kitsune.optimizer import KitsuneOptimizer

        self.params = params
        self.warnings: list[str] = []
        profiler = ProfilerConfig(enabled=profile)  # as profile=True comes; `warmup` runs past its windows
        config = KitsuneConfig(
            fusion=FusionConfig(enabled=True, state_precision=state_precision),
            profiler=profiler,
            graphs=GraphConfig(enabled=graph, static_addresses=static),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.opt = KitsuneOptimizer(torch.optim.AdamW(params, **ADAMW), config=config)
        self._keep(caught)
        self.step = self.opt.step

    def _keep(self, caught: list[warnings.WarningMessage]) -> None:
        for w in caught:
            if str(w.message) not in self.warnings:
                self.warnings.append(str(w.message))

    def warmup(self, n: int, between: Callable[[], object] | None = None) -> None:
        """``n`` untimed steps, and with the profiler on as many more as its sampled windows (the warm-up it leaves
        out, the probe) still take: they do other work than a steady step, and no timer may see them."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().warmup(n, between)
            profiler = self.opt.profiler
            while profiler is not None and profiler.sampling:
                super().warmup(1, between)
        self._keep(caught)
        self.mark = step_mark(self.opt)

    def info(self) -> KitsuneInfo:
        return kitsune_info(self.opt, len(self.params), self.warnings, since=self.mark)

    def close(self) -> None:
        if self.opt.profiler is not None:
            self.opt.profiler.close()  # the NVML sampler's thread: the next variant's timings must not share the host
        del self.params
        super().close()


def make_variant(name: str, params: list[torch.nn.Parameter]) -> _TorchVariant:
    """Build variant ``name`` over ``params``: call ``warmup(n)`` once, then ``step()``; ``close()`` at the end."""
    name = FRESH_GRADS.get(name, name)  # the same optimizer; its runner re-allocates the grads
    if name == "foreach":
        return _TorchVariant(params, foreach=True)
    if name == "fused":
        return _TorchVariant(params, fused=True)
    if name == "graph":
        return _GraphVariant(params)
    if name == "kitsune":
        return _KitsuneVariant(params)
    if name == "eager":
        return _KitsuneVariant(params, graph=False)
    if name == "static":
        return _KitsuneVariant(params, static=True)
    if name == "profiled":
        return _KitsuneVariant(params, profile=True)
    if name in STATE_PRECISION:
        return _KitsuneVariant(params, state_precision=STATE_PRECISION[name])
    raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")
