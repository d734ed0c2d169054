"""What ``kitsune bench`` records: pydantic models of a run's results, written to and read from JSON."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kitsune._paths import as_path, write_output
from kitsune.bench.e2e import E2EResult
from kitsune.bench.info import KitsuneInfo
from kitsune.bench.timing import Stats
from kitsune.profiler.schema import Environment


class PeerInfo(BaseModel):
    """What a ``--peers`` row ran: the library, its settings, and what the runner did about its grads."""

    package: str
    """The import name (``bitsandbytes``, ``optimi``, ...; ``kitsune`` for kitsune's own rows in a Lion section)."""
    pip: str
    """What ``pip install`` takes."""
    version: str | None
    algorithm: Literal["adamw", "lion"]
    settings: str
    """The options it ran with, in words (e.g. ``optim_bits=32``, ``triton=True``)."""
    warmup: int = 0
    """Untimed steps it ran first (the set's, or more for a peer whose step is compiled)."""
    reference: bool = False
    """kitsune's own row in a peer section: its failure fails the run, as a variant's does; a peer's does not."""
    grads: Literal["kept", "refilled", "reattached"] = "kept"
    """What the first warm-up step did to the grads, and so what ran before each later step, outside the timers:
    ``kept`` (nothing), ``refilled`` (the step zeroed or overwrote them: fresh random values in place), or
    ``reattached`` (the step set ``p.grad`` to None or replaced it: the original tensors put back, refilled)."""
    state_paged: bool = False
    """Some state tensors live in paged (CUDA managed) memory (bitsandbytes' paged optimizers)."""
    checked_steps: int = 0
    """Steps whose move was checked: each host-timed step on its own, the device-timed ones together."""
    warm_step_ms: float | None = None
    """Wall time of its last warm-up step, synchronized (None with a single warm-up step)."""
    short_steps: int | None = None
    """Where that step was too slow for the set's steps in `kitsune.bench.runner.PEER_PASS_SECONDS`: the steps
    each of its timed passes took instead (at least `kitsune.bench.runner.PEER_MIN_STEPS`); None: the set's."""
    warnings: list[str] = []
    """Warnings the library raised while it was built and warmed up (the first few)."""


class PeerStatus(BaseModel):
    """A peer asked for with ``--peers``, whether or not it is installed."""

    name: str
    label: str
    package: str
    pip: str
    installed: bool
    version: str | None = None
    skipped: str | None = None
    """Why an installed peer did not run (``--peers`` without names on a CPU skips those that compile)."""


class VariantResult(BaseModel):
    variant: str
    label: str
    status: Literal["ok", "skipped", "failed", "not_available", "not_timed", "stopped"]
    reason: str | None = None
    """Why the variant was skipped, failed, is not available, or was not timed (``not_timed``: its params did not
    move on every step, so its times would be those of a step that does nothing; ``stopped``: a peer still running
    after `kitsune.bench.runner.PEER_SECONDS`)."""
    device_ms: Stats | None = None
    """Device time per step (CUDA events; wall time on a CPU)."""
    host_ms: Stats | None = None
    """Host time of the ``step()`` call alone, started with the device idle, no synchronize inside."""
    busy_host_ms: Stats | None = None
    """Host time of the ``step()`` call in the device pass, the steps back to back: where it is above ``host_ms``
    the call waited on the GPU or the host ran slower there; where ``device_ms`` is about this, the GPU waited on the
    host."""
    pct_of_floor: float | None = None
    """100 * floor_ms / median device ms: how close the step comes to the memory's copy rate."""
    device_ms_steps: list[float] = []
    host_ms_steps: list[float] = []
    kitsune: KitsuneInfo | None = None
    state_bytes: int | None = None
    """Bytes of the optimizer's state tensors after warm-up (quantized codes and their scales included; each
    distinct tensor once); recorded in ``--peers`` runs only."""
    peer: PeerInfo | None = None
    """Set on the rows of ``--peers`` (None on torch's and kitsune's AdamW variants)."""


class PairedRatio(BaseModel):
    """One variant against kitsune, measured in pairs as `ProfilerCost` is: both alive over copies of the same seeded
    params, warmed up, then ``rounds`` rounds of ``steps`` steps each side, the order alternating, half the rounds on
    a pair built with kitsune first and half on one built with the other first."""

    against: str
    """The other variant (``graph``: torch's fused, capturable AdamW replayed from a CUDA graph)."""
    rounds: int
    steps: int
    ratio: Stats
    """Per round: the other's median ms a step back to back over kitsune's (above 1: kitsune is faster)."""
    host_ms: Stats
    """Per round: the other's median host ms of a ``step()`` call minus kitsune's."""


class ProfilerCost(BaseModel):
    """What ``profile=True`` costs a step, measured in pairs: the one line with the profiler off and on (the
    ``kitsune`` and ``profiled`` variants), both alive over copies of the same seeded params, warmed up, then
    ``rounds`` rounds of ``steps`` steps each side, the order alternating from round to round, half of them on a
    pair built with the profiler off first and half on one built with it on first (the side built second ran faster
    on a host-bound set, whichever it was). A round compares the two sides run moments apart, so the drift between
    passes (a host that slows down, caches that another variant left cold) cancels, as it does not between the
    table's rows."""

    rounds: int
    steps: int
    """Steps a side in each round (the device pass's and again the host pass's, as `time_steps` times them)."""
    device_pct: Stats
    """Per round: ``100 * (on / off - 1)`` of the median ms a step back to back (CUDA events; wall time on a CPU)."""
    host_ms: Stats
    """Per round: the median host ms of a ``step()`` call (the GPU synchronized before it), on minus off."""


class SetResult(BaseModel):
    name: str
    workload: Literal["adamw_step", "amp_clip_phase", "lion_step"]
    description: str
    n_tensors: int
    n_elements: int
    scale: float
    bytes_per_param: int
    bytes_per_step: int
    floor_ms: float
    """bytes_per_step / measured copy bandwidth."""
    steps: int
    warmup: int
    variants: list[VariantResult]
    ratio_to_kitsune: dict[str, float]
    """Per other row (torch's variants, peers, kitsune's other variants): its median device ms / the ``kitsune``
    row's (above 1: the ``kitsune`` row is faster); in a ``lion_step`` set, over kitsune's fused Lion."""
    profiler_cost: ProfilerCost | None = None
    """With the ``kitsune`` and ``profiled`` variants both asked for: the profiler's cost measured in pairs."""
    profiler_cost_reason: str | None = None
    """Why the pairs were not measured where both variants were asked for (the GPU cannot hold two optimizers of
    the set, or it failed)."""
    paired: PairedRatio | None = None
    """On CUDA, with the ``kitsune`` and ``graph`` variants both asked for: kitsune against torch's CUDA graph recipe
    measured in pairs (the table's ``t / kitsune`` divides medians of passes run one after another)."""
    paired_reason: str | None = None
    """Why that pair was not measured where both variants were asked for."""


class BenchResult(BaseModel):
    schema_version: Literal["1"] = "1"
    created: datetime
    command: str
    environment: Environment
    device: str
    timer: Literal["cuda_events", "perf_counter"]
    cpu_smoke: bool = False
    """A run on a CPU: a smoke test of the command, not a comparison. kitsune is a pass-through there (its fused
    kernels and CUDA graphs need CUDA), so its rows run torch's own step and any ratio between rows is noise; the
    printed tables leave the ratios out, the raw times stay here. False in files written before the field (their
    ``timer`` is ``perf_counter`` on a CPU)."""
    copy_bandwidth_gbs: float
    """Measured device-to-device copy rate, read + write bytes, in GB/s (1e9)."""
    copy_buffer_bytes: int
    adamw: dict[str, Any]
    sets: list[SetResult]
    phase: SetResult | None
    e2e: E2EResult | None = None
    """Whole training steps of a GPT-2 124M-shaped model (``--e2e``)."""
    peers: list[PeerStatus] = []
    """Every peer ``--peers`` asked for, installed or not (their rows are in ``sets`` and ``lion``)."""
    lion: list[SetResult] = []
    """Per set, with ``--peers`` and a Lion peer installed: kitsune's fused Lion against the Lion peers."""
    grads: Literal["kept", "fresh"] = "kept"
    """The AdamW rows' grads between steps (``--grads``): ``kept``, the same tensors and values; ``fresh``, freed and
    re-allocated with new values before every step, as ``zero_grad()`` and ``backward()`` leave them ("kept" in
    files written before the field)."""
    complete: bool
    """False while the run is still going (the JSON is rewritten after every set)."""

    def save(self, path: str | Path) -> Path:
        """Write the JSON to ``path`` (``~`` expanded), making its folder; returns the path.

        Atomic (`kitsune._paths.write_output`): the run saves after every set, and a save that fails or is
        interrupted leaves the previous file whole. A path nothing can be written at is that function's one-line
        ValueError.
        """
        return write_output(path, self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: str | Path) -> BenchResult:
        """The result saved at ``path`` (``~`` expanded, as `save` does)."""
        return cls.model_validate_json(as_path(path).read_text(encoding="utf-8"))
