"""Configuration: one frozen pydantic model per subsystem, and [`KitsuneConfig`][kitsune.KitsuneConfig] holding them
all.

Every field has a default and a docstring; invalid values raise `pydantic.ValidationError` naming the
field and the allowed range. Fields are strict, so a slip is refused rather than read as something else: a bool
field takes only True or False, an int field only an int (not a bool, float or str), a float field an int or a
float (not a bool or str). The deliberate exceptions are [`AMPConfig.dtype`][kitsune.config.AMPConfig.dtype] (also
``"float16"``/``"bfloat16"``) and [`GradConfig.norm_type`][kitsune.config.GradConfig.norm_type] (also ``"inf"``). The
keyword arguments of [`kitsune.KitsuneOptimizer`][kitsune.KitsuneOptimizer] are shorthand for these models (see
`resolve_config`).
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Collection
from typing import Annotated, Any, Literal, NamedTuple

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.functional_validators import BeforeValidator
from pydantic_core import PydanticCustomError

MiB = 1024 * 1024

_DTYPE_NAMES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _to_amp_dtype(value: Any) -> torch.dtype:
    if isinstance(value, str):
        key = value.removeprefix("torch.").lower()
        if key not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16 (or 'float16'/'bfloat16'), got {value!r}")
        return _DTYPE_NAMES[key]
    if value not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {value!r}")
    return value


AmpDtype = Annotated[
    torch.dtype,
    BeforeValidator(_to_amp_dtype),
    PlainSerializer(lambda d: str(d).removeprefix("torch."), return_type=str),
]


_FP32_MAX = float(torch.finfo(torch.float32).max)
"""The loss scale is held in fp32 on the device."""


def setting_hint(key: str, names: Collection[str], listing: str) -> str:
    """For an unknown setting ``key``: the one of ``names`` it is nearest (``did you mean enabled=...?``), else
    ``listing`` and every name (``its settings are a, b``)."""
    near = difflib.get_close_matches(key, list(names), n=1)
    return f"did you mean {near[0]}=...?" if near else f"{listing} are {', '.join(names)}"


class _Config(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, arbitrary_types_allowed=True, use_attribute_docstrings=True
    )

    @model_validator(mode="before")
    @classmethod
    def _known_settings(cls, data: Any) -> Any:
        """A misspelt setting names the one meant (``FusionConfig(enable=True)``: ``enabled``), not only pydantic's
        "extra inputs are not permitted"; a subsystem given as True or False names the config to write."""
        if not isinstance(data, dict) or cls.model_config.get("extra") != "forbid":
            return data  # (a subclass that allows extra settings takes them)
        fields = cls.model_fields
        aliases = {a for f in fields.values() for a in (f.alias, f.validation_alias) if isinstance(a, str)}
        for key, value in data.items():
            if not isinstance(key, str) or key in aliases:
                continue  # pydantic's own error for what is no name
            if key not in fields:
                raise ValueError(f"{cls.__name__} has no setting {key!r}: {setting_hint(key, fields, 'its settings')}")
            kind = fields[key].annotation
            if isinstance(value, bool) and isinstance(kind, type) and issubclass(kind, _Config):
                on = f"enabled={value}" if "enabled" in kind.model_fields else ("..." if value else "")
                raise ValueError(f"{key}={value}: write {key}={kind.__name__}({on}), a config")
        return data


class AMPConfig(_Config):
    """Mixed precision: autocast dtype and the device-resident dynamic loss scaler (fp16 only)."""

    enabled: StrictBool = True
    """Use mixed precision when the optimizer has AMP on (``enable_amp=True``)."""
    dtype: AmpDtype = torch.float16
    """Autocast dtype: torch.float16 (with dynamic loss scaling) or torch.bfloat16 (autocast only, no scaler)."""
    init_scale: StrictFloat = Field(2.0**16, gt=0, le=_FP32_MAX, allow_inf_nan=False)
    """Loss scale at the first step (fp16)."""
    growth_factor: StrictFloat = Field(2.0, gt=1.0, allow_inf_nan=False)
    """Multiply the scale by this after ``growth_interval`` consecutive steps without inf/nan grads."""
    backoff_factor: StrictFloat = Field(0.5, gt=0.0, lt=1.0)
    """Multiply the scale by this when a step finds inf/nan grads (the step is skipped)."""
    growth_interval: StrictInt = Field(2000, ge=1)
    """Clean steps needed before the scale grows."""

    @property
    def scales_loss(self) -> bool:
        """Whether the step unscales the grads and checks them for inf/nan: float16 AMP, switched on."""
        return self.enabled and self.dtype == torch.float16


class FusionConfig(_Config):
    """The fusion planner: which fused Triton kernels it may use and when fusing is worth it."""

    enabled: StrictBool = True
    """Use fused kernels when the optimizer has fusion on (``enable_fusion=True``)."""
    enable_elementwise: StrictBool = True
    """Fused multi-tensor update kernels (AdamW/Adam, SGD, Adagrad, RMSprop, NAdam, RAdam, Adamax, Adadelta, Rprop,
    ASGD, Lion, LAMB, LARS)."""
    enable_reduction: StrictBool = True
    """Fused multi-tensor norm kernels (grad clipping, inf/nan checks, trust ratios)."""
    enable_matmul: StrictBool = True
    """The ``triton_matmul`` route for Muon (torch.optim.Muon, kitsune.optim.Muon): fused momentum and update kernels
    around Newton-Schulz calls batched by shape; False leaves Muon groups to the optimizer's own step."""
    max_fusion_size: StrictInt | None = Field(None, ge=1)
    """Most tensors one launch covers; ``None`` means no limit (one launch per bucket)."""
    min_fusion_benefit: StrictFloat = Field(1.0, ge=0.0, allow_inf_nan=False)
    """Fuse a bucket only if the cost model predicts at least this speedup over the fallback (1.0 = any gain)."""
    native_checks: StrictBool = True
    """Check every step that the params and grads sit where the fused kernels' tables point in one native call
    (tens of ns a tensor, against 100-400 in Python). It is compiled once per machine and torch version, in a
    background thread started by the first fused plan (about 20-30 s; a C++ compiler, ninja and Python's headers
    are needed); until it is ready, or where it cannot be built, the same checks run in Python and the fusion
    report (``subsystem_status()``, the summary, the saved profile) says why under ``address_checks``. The results
    never depend on which one runs."""
    state_precision: Literal["param", "fp32", "bf16", "8bit"] = "param"
    """How the fused kernels keep optimizer state (moments, momentum buffers, accumulators). ``"param"``: in the
    param's dtype, as torch keeps it. ``"fp32"`` or ``"bf16"``: in that dtype (torch's keys; a plain torch optimizer
    loads it). ``"8bit"``: block-wise dynamic 8-bit quantization (256 elements per fp32 absmax, bitsandbytes' dynamic
    code; about 1 byte an element instead of 4), under ``{key}_codes``/``{key}_absmax`` (see Low-precision state in
    the docs). Applies to the fused buckets of Adam, AdamW, SGD (momentum), Adagrad, RMSprop, NAdam, RAdam, Adamax,
    Adadelta and Lion; the plan's ``state`` column shows each bucket's format and why a bucket kept the param's.
    Checkpoints of any precision load and are converted as they bind (`kitsune.convert_state_dict` converts them
    for plain torch)."""
    param_rounding: Literal["nearest", "stochastic", "kahan"] = "nearest"
    """How the fused kernels write updated bf16 params back. ``"nearest"``: rounded to the nearest bf16, as torch
    does. ``"stochastic"``: rounded up or down at random with the probabilities that make the stored value's
    expectation the fp32 result, so updates smaller than half a bf16 step still move the params on average: bf16
    params trained without fp32 master weights (as torch-optimi and torchao do). The random bits are Philox's,
    keyed by ``rounding_seed``, the step count and the element, so a run is reproducible. Params of other dtypes
    round as before (the plan notes float16 ones). ``"kahan"``: rounded to nearest with Kahan compensation, as
    torch-optimi's ``kahan_sum``: a tensor of the param's dtype per bf16 or float16 param (state key
    ``kahan_comp``, 2 bytes an element) carries what each rounding dropped into the next step's update, so small
    updates add up exactly instead of on average; fp32 params round as before, and trust-ratio optimizers (LAMB,
    LARS) and Muon's orthogonalised update keep nearest rounding (the plan notes them)."""
    rounding_seed: StrictInt = Field(0, ge=0, lt=2**63)
    """The key of ``param_rounding="stochastic"``'s random bits."""
    min_8bit_size: StrictInt = Field(4096, ge=0)
    """With ``state_precision="8bit"``: params with fewer elements (biases, norm weights) keep their state in the
    param's dtype, as bitsandbytes' ``min_8bit_size``: their state is small and quantizing it costs more accuracy
    than it saves memory."""


class GradConfig(_Config):
    """What the step does to the grads besides using them: clipping by global norm, and zeroing them."""

    max_norm: StrictFloat | None = Field(None, gt=0, allow_inf_nan=False)
    """Clip the grads to this global norm inside the step (``None``: no clipping). The norm of the last step stays
    on the device as ``optimizer.last_grad_norm``; with fusion the clip is applied inside the update kernel."""
    norm_type: float = 2.0
    """Norm for ``max_norm``: 2 or ``inf`` (``float("inf")`` or ``"inf"``), as in torch.nn.utils.clip_grad_norm_."""
    zero_in_step: StrictBool = False
    """The fused update writes zeros into each grad it used, so no separate zeroing pass is needed; the grads of
    fused params stay allocated (``zero_grad()`` then leaves them alone, ``set_to_none`` included). So, as with
    torch's ``zero_grad(set_to_none=False)``, a param that gets no grad in a later step is updated with a zero
    grad (momentum and weight decay move it), where a grad set to None would skip it."""

    @field_validator("norm_type", mode="before")
    @classmethod
    def _norm_type(cls, value: Any) -> float:
        # "inf" is the one string taken, as torch's clip_grad_norm_ documents it; a bool is never a norm
        norm = None
        if isinstance(value, str):
            norm = math.inf if value.lower() == "inf" else None
        elif not isinstance(value, bool):
            try:
                norm = float(value)
            except (TypeError, ValueError):
                pass
        if norm not in (2.0, math.inf):
            raise ValueError(f"norm_type must be 2 or inf, got {value!r}: other norms are not supported in the step")
        return norm


class StreamConfig(_Config):
    """CUDA streams the optimizer phase may spread work over."""

    num_streams: StrictInt = Field(4, ge=1, le=64)
    """Side streams available to the scheduler."""
    priority_streams: list[StrictInt] = Field(default_factory=list)
    """Indices (< num_streams) of streams created with high priority."""
    compute_streams: list[StrictInt] = Field(default_factory=list)
    """Indices of streams for compute-bound work (Newton-Schulz matmuls); empty means all streams."""
    step_in_backward: StrictBool = False
    """Launch each fused bucket's update on a side stream as soon as backward has produced its grads, overlapping
    the rest of backward (off under max_grad_norm, float16 loss scaling and LAMB/LARS)."""
    bucket_bytes: StrictInt = Field(32 * MiB, ge=1)
    """With ``step_in_backward``: bytes of params per update launched during backward (smaller buckets start
    sooner, larger ones launch less often)."""
    backward_stream: Literal["side", "current"] = "side"
    """With ``step_in_backward``, where the updates run on CUDA. ``"side"``: on a side stream that waits for the
    backward stream, so an update runs alongside the rest of backward's kernels (best where backward keeps the GPU
    busy). ``"current"``: on backward's own stream, queued between its kernels: no stream switch and no
    cross-stream wait per launch, so less host time inside backward (best where backward is host-bound and the GPU
    idles between its kernels anyway)."""

    @model_validator(mode="after")
    def _indices_in_range(self) -> StreamConfig:
        for name in ("priority_streams", "compute_streams"):
            indices = getattr(self, name)
            bad = [i for i in indices if not 0 <= i < self.num_streams]
            if bad:
                raise ValueError(
                    f"{name} holds {bad}, outside 0..{self.num_streams - 1}: stream indices must be below "
                    f"num_streams={self.num_streams}; raise num_streams or drop those indices"
                )
            if len(set(indices)) != len(indices):
                raise ValueError(f"{name} lists a stream twice: {indices}")
        return self


class GraphConfig(_Config):
    """CUDA graph capture of the optimizer phase."""

    enabled: StrictBool = True
    """Capture the phase into a CUDA graph and replay it (CUDA only)."""
    warmup_steps: StrictInt = Field(3, ge=1, le=1000)
    """Eager steps (on a side stream) before the first capture."""
    steady_replay: StrictBool = True
    """After a replayed step, replay the next steps after the address checks and a comparison of the groups' values
    only, without the step's full host path, while nothing else changed (see the CUDA graphs guide). False runs
    every step through the full path (for comparing the two)."""
    static_addresses: StrictBool = False
    """Promise that grads stay the same tensors from step to step (zeroed in place: ``zero_grad(set_to_none=False)``,
    ``MemoryConfig(flat_grads=True)`` or ``GradConfig(zero_in_step=True)``) and params keep their storage, as
    torch's own CUDA graph recipe requires of its static inputs. kitsune then skips the per-step check of every
    grad's and param's address (about 0.3 us a param) and watches them through weak references instead: a grad or
    storage that is freed (``model.zero_grad()``, ``p.data = ...``, ``model.half()``) is still noticed. A grad or
    storage replaced while your code keeps a reference to the old one is not, nor a param or grad given another view
    of its own storage (``p.data = p.data.t()``, ``p.grad.t_()``): leave this off if you do that (see the CUDA graphs
    guide)."""


class MemoryConfig(_Config):
    """The memory pool: flat per-(device, dtype) arenas for the state of the params the fused kernel updates."""

    pool_size: StrictInt = Field(512 * MiB, ge=0)
    """Most bytes of arena per device (state, step counts and, with ``flat_grads``, grads). Fused units are pooled
    whole, in plan order, while they fit; the rest keep one allocation per tensor. 0 turns the pool off."""
    flat_grads: StrictBool = False
    """Also keep the pooled params' grads in a flat arena: backward accumulates into it in place and
    ``zero_grad()`` zeroes it in one fill instead of freeing the grads (torch's ``set_to_none=False``)."""


def _to_process_group(value: Any) -> Any:
    if value is None:
        return None
    try:
        from torch.distributed import ProcessGroup
    except ImportError:  # torch built without torch.distributed
        ProcessGroup = ()  # noqa: N806
    if not isinstance(value, ProcessGroup):
        raise ValueError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(value).__name__}")
    return value


ProcessGroupField = Annotated[
    Any,
    BeforeValidator(_to_process_group),
    PlainSerializer(lambda g: None if g is None else f"ProcessGroup(size={g.size()})", return_type=Any),
]


class ShardConfig(_Config):
    """Sharded optimizer state for a replicated model (ZeRO stages 1 and 2) over torch.distributed."""

    stage: Literal[0, 1, 2] = 0
    """0: off. 1: grads all-reduced (averaged), each rank keeps state for and updates only the params it owns, then
    the params are all-gathered. 2: as 1, but grads are reduce-scattered, so each rank keeps only its own grads."""
    process_group: ProcessGroupField = None
    """The ranks that share the state (``None``: the default group, initialised before the optimizer is built)."""
    bucket_bytes: StrictInt = Field(25 * MiB, ge=1)
    """Bytes of grads per collective: smaller buckets start during backward sooner, larger ones launch less often."""
    overlap: StrictBool = True
    """Launch each bucket's collective from backward as soon as its grads are ready (False: all of them in
    ``step()``, after backward)."""
    gather_in_forward: StrictBool = False
    """Let the params' all-gather after the update finish during the next forward: ``step()`` launches every
    bucket's all-gather and returns, and a module waits for its own params' bucket when its forward begins (a
    forward pre-hook on every module while gathers are pending), so the gathers overlap the first layers' compute.
    A param read outside a module's forward before then (an EMA, ``model.state_dict()``, a param used by a module
    that does not own it before its owner runs) holds its old values until ``optimizer.wait_params()``; kitsune's
    own ``step()``, ``state_dict()`` and re-plans wait first. Holds every bucket's gather buffer (one copy of the
    trainable params) until the forward reaches it. For eager models: leave it off under ``torch.compile`` (a model
    compiled before any step never calls the hook; the step after a forward that read a param still pending
    refuses, updating nothing)."""

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_is_an_int(cls, value: Any) -> Any:
        # the Literal alone takes True as 1 and 1.0 as 1
        if isinstance(value, bool) or not isinstance(value, int):
            raise PydanticCustomError("int_type", "Input should be a valid integer")
        return value


class ProfilerConfig(_Config):
    """What the profiler records."""

    enabled: StrictBool = True
    """Record per-step timings (CUDA events on GPU, a monotonic clock on CPU). On in a section given to a
    `KitsuneConfig` (``profiler=ProfilerConfig(compare_steps=10)`` profiles), as the AMP and fusion sections are;
    ``KitsuneConfig()`` and ``profile=False`` leave it off."""
    max_step_records: StrictInt = Field(100_000, ge=1)
    """Per-step timings kept for the profile; older ones are dropped (summary counts still cover all steps)."""
    nvml_interval_s: StrictFloat = Field(0.5, ge=0.0, allow_inf_nan=False)
    """Seconds between NVML samples of the GPU while profiling CUDA params; 0 turns the sampler off."""
    nvml_max_samples: StrictInt = Field(100_000, ge=1)
    """NVML samples kept for the profile (48 bytes each; 100,000 are about 14 hours at the default interval);
    older ones are dropped, and the profile says how many."""
    sample_after: StrictInt = Field(10, ge=0)
    """Steps before the sampled windows (probe, then comparison) begin: Triton compiles, state is created and
    clocks settle in them."""
    probe_steps: StrictInt = Field(3, ge=0)
    """Steps run under ``torch.profiler`` and torch.cuda's sync debug mode to count kitsune's kernel launches and
    host syncs (CUDA only; 0 turns the probe off). Their times are left out of the statistics."""
    device_time_every: StrictInt = Field(32, ge=1)
    """CUDA: past the sampled windows, time one step in this many on the device (a pair of CUDA events); the others
    record their host time only (``step_ms`` None in their records), and the step-time statistics come from the
    steps timed (a run of 1000 steps: about 30 past the windows). Recording and reading a step's events costs the
    host about 10 us, most of what the profiler adds to a step timed: on an H200's host (2026-12-04,
    ``benchmarks/profiler-cost.py``, empty steps, 148 and 2000 params) the profiler's own work was 15.6-22.8 us a
    step with every step timed, 3.6-4.2 with one in 8 and 2.4-3.1 with one in 32; 1 times every step. The warm-up
    and the sampled windows (probe, comparison) time every step."""
    compare_steps: StrictInt = Field(0, ge=0)
    """Length of the live comparison: this many steps of kitsune, then this many of the wrapped optimizer's own
    step on the same params, timed alike; the summary reports the speedup measured. Off (0) by default: the
    baseline steps round differently from kitsune's kernels in the last bits, so a run with the comparison is not
    bit-identical to the same run without the profiler. At least 2 when on (the first step of each half settles and
    is left out)."""

    @field_validator("compare_steps")
    @classmethod
    def _compare_steps(cls, value: int) -> int:
        if value == 1:
            raise ValueError(
                "compare_steps=1 would measure nothing (the first step of each half settles and is left out): use 2 "
                "or more (10 is a good length), or 0 to leave the comparison off"
            )
        return value


class KitsuneConfig(_Config):
    """All of kitsune's settings in one object: ``KitsuneOptimizer(opt, config=KitsuneConfig(...))``."""

    amp: AMPConfig = AMPConfig(enabled=False)
    """Mixed precision (off unless enabled)."""
    fusion: FusionConfig = FusionConfig(enabled=False)
    """Fused kernels (off unless enabled)."""
    grads: GradConfig = GradConfig()
    """Clipping and zeroing of the grads in the step."""
    streams: StreamConfig = StreamConfig()
    """Stream scheduler."""
    graphs: GraphConfig = GraphConfig()
    """CUDA graph capture."""
    memory: MemoryConfig = MemoryConfig()
    """Memory pool."""
    profiler: ProfilerConfig = ProfilerConfig(enabled=False)
    """Profiler (off unless enabled)."""
    shard: ShardConfig = ShardConfig()
    """Sharded optimizer state (ZeRO; off unless ``stage`` is 1 or 2)."""

    @model_validator(mode="after")
    def _shard_combinations(self) -> KitsuneConfig:
        if self.shard.stage and self.streams.step_in_backward:
            raise ValueError(
                "ShardConfig(stage>0) with StreamConfig(step_in_backward=True): updates inside backward would run "
                "before the grads are reduced across ranks; turn step_in_backward off"
            )
        if self.shard.stage and self.memory.flat_grads:
            raise ValueError(
                "ShardConfig(stage>0) with MemoryConfig(flat_grads=True): the sharded grads live in the shard's own "
                "flat buckets; turn flat_grads off"
            )
        return self


class _Shorthand(NamedTuple):
    section: str
    field: str
    default: Any
    takes: str
    """What the keyword takes, for the message that refuses a value."""
    fix: str
    """How to write it instead."""


_BOOL = "True or False"
_KWARGS: dict[str, _Shorthand] = {
    "enable_amp": _Shorthand("amp", "enabled", False, _BOOL, "enable_amp=True or enable_amp=False"),
    "enable_fusion": _Shorthand("fusion", "enabled", False, _BOOL, "enable_fusion=True or enable_fusion=False"),
    "num_streams": _Shorthand("streams", "num_streams", 4, "an int from 1 to 64", "e.g. num_streams=4"),
    "profile": _Shorthand("profiler", "enabled", False, _BOOL, "profile=True or profile=False"),
    "memory_pool_size": _Shorthand(
        "memory",
        "pool_size",
        512 * MiB,
        "an int number of bytes, 0 or more (0 turns the pool off)",
        "e.g. memory_pool_size=512 * 1024 * 1024",
    ),
    "capture_graph": _Shorthand("graphs", "enabled", True, _BOOL, "capture_graph=True or capture_graph=False"),
    "max_grad_norm": _Shorthand(
        "grads",
        "max_norm",
        None,
        "a positive finite number or None (no clipping)",
        "the norm to clip to, e.g. max_grad_norm=1.0, or leave it out",
    ),
    "zero_stage": _Shorthand("shard", "stage", 0, "the int 0, 1 or 2", "e.g. zero_stage=1"),
}


def _from_shorthand(kwarg: str, value: Any) -> _Config:
    """The section one keyword shorthand stands for; a refused value is reported under the keyword the user wrote,
    not the field inside the section."""
    short = _KWARGS[kwarg]
    section = KitsuneConfig.model_fields[short.section].annotation
    try:
        return section(**{short.field: value})
    except ValidationError as exc:
        error = exc.errors()[0]
    fix = short.fix
    if isinstance(value, float) and value.is_integer() and type(short.default) is int:
        with contextlib.suppress(ValidationError):  # 4.0 for a count, 1e9 for bytes: the int it means, when valid
            section(**{short.field: int(value)})
            fix = f"{kwarg}={int(value)}"
    if isinstance(value, _Config):  # a whole section given to its switch: where that section goes instead
        fix = _section_fix(type(value)) or fix
    if error["type"].endswith("_type"):
        name = type(value).__name__
        what = "None" if value is None else f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
        raise ValueError(f"{kwarg}={value!r} is refused: {kwarg} takes {short.takes}, not {what}; write {fix}")
    raise ValueError(f"{kwarg}={value!r} is refused: {kwarg} takes {short.takes}; write {fix}")


_SECTION_ARGS = {
    "amp_config": "amp",
    "fusion_config": "fusion",
    "stream_config": "streams",
    "grad_config": "grads",
    "shard_config": "shard",
}


def _section_fix(cls: type) -> str | None:
    """How a ``cls`` section is passed: its ``*_config`` argument, or inside ``config=``."""
    section = next((name for name, f in KitsuneConfig.model_fields.items() if f.annotation is cls), None)
    if section is None:
        return None
    arg = next((a for a, name in _SECTION_ARGS.items() if name == section), None)
    switch = next((k for k, short in _KWARGS.items() if short.section == section and short.field == "enabled"), None)
    on = f" with {switch}=True" if arg and switch in ("enable_amp", "enable_fusion") else ""
    if arg:
        return f"{arg}={cls.__name__}(...){on}"
    default_on = " (its enabled=True is the default)" if "enabled" in cls.model_fields else ""
    return f"config=KitsuneConfig({section}={cls.__name__}(...)){default_on}"


def resolve_config(
    config: KitsuneConfig | None,
    sections: dict[str, Any],
    kwargs: dict[str, Any],
    given: Collection[str] | None = None,
) -> KitsuneConfig:
    """Merge ``config=``, the ``*_config`` objects and the keyword shorthands into one
    [`KitsuneConfig`][kitsune.KitsuneConfig].

    Raises ``ValueError`` when a keyword shorthand is refused, for its type (``max_grad_norm=True``,
    ``enable_fusion="no"``, ``num_streams=4.0``) or its range (``num_streams=0``): the message names the keyword as
    written, what it takes and the fix. It is a plain ``ValueError``, not the ``pydantic.ValidationError`` about the
    field inside the section, which the config classes raise when built directly. Raises ``ValueError`` too when two
    settings disagree, naming both and the fix, and ``TypeError`` when ``config=`` or a ``*_config`` argument is not
    the config class it names. ``given``: the keywords the caller passed (beside ``config=`` each is refused, also
    at its default value); without it, those that differ from their defaults.
    """
    # every keyword is checked, also where config= or a section makes it moot: a slip there is still a slip
    seeds = {kwarg: _from_shorthand(kwarg, value) for kwarg, value in kwargs.items()}
    changed = {k: v for k, v in kwargs.items() if v != _KWARGS[k].default or (given is not None and k in given)}
    given_sections = {k: v for k, v in sections.items() if v is not None}
    if config is not None:
        if not isinstance(config, KitsuneConfig):
            raise TypeError(f"config must be a KitsuneConfig, got {type(config).__name__}")
        extra = sorted(changed) + sorted(given_sections)
        if extra:
            raise ValueError(
                f"config= was given together with {', '.join(extra)}: put those settings inside the KitsuneConfig "
                "(its sections: amp=AMPConfig, fusion=FusionConfig, grads=GradConfig, graphs=GraphConfig, "
                "memory=MemoryConfig, profiler=ProfilerConfig, shard=ShardConfig, streams=StreamConfig; e.g. "
                "profile=True is KitsuneConfig(profiler=ProfilerConfig(enabled=True))) or drop config="
            )
        return config

    expected = {
        "amp_config": AMPConfig,
        "fusion_config": FusionConfig,
        "stream_config": StreamConfig,
        "grad_config": GradConfig,
        "shard_config": ShardConfig,
    }
    parts: dict[str, Any] = {}
    for arg, value in given_sections.items():
        if not isinstance(value, expected[arg]):
            raise TypeError(f"{arg} must be an instance of {expected[arg].__name__}, got {type(value).__name__}")
        parts[_SECTION_ARGS[arg]] = value

    # the on/off switches: a section object that says enabled=True needs its switch on
    for kwarg, arg in (("enable_amp", "amp_config"), ("enable_fusion", "fusion_config")):
        section = parts.get(_SECTION_ARGS[arg])
        switch = kwargs[kwarg]
        if section is not None and section.enabled and not switch:
            raise ValueError(
                f"{arg} was given (enabled=True) but {kwarg}=False: pass {kwarg}=True to use it, or leave {arg} out"
            )
        if section is not None and not section.enabled and switch:
            raise ValueError(f"{kwarg}=True contradicts {arg}.enabled=False: drop one of them")
        if section is None:
            parts[_SECTION_ARGS[arg]] = seeds[kwarg]

    streams = parts.get("streams")
    if streams is not None and "num_streams" in changed and streams.num_streams != kwargs["num_streams"]:
        raise ValueError(
            f"num_streams={kwargs['num_streams']} contradicts stream_config.num_streams={streams.num_streams}: "
            "set it in one place"
        )
    if streams is None:
        parts["streams"] = seeds["num_streams"]

    grads = parts.get("grads")
    if grads is not None and "max_grad_norm" in changed and grads.max_norm != kwargs["max_grad_norm"]:
        raise ValueError(
            f"max_grad_norm={kwargs['max_grad_norm']} contradicts grad_config.max_norm={grads.max_norm}: "
            "set it in one place"
        )
    if grads is None:
        parts["grads"] = seeds["max_grad_norm"]

    shard = parts.get("shard")
    if shard is not None and "zero_stage" in changed and shard.stage != kwargs["zero_stage"]:
        raise ValueError(
            f"zero_stage={kwargs['zero_stage']} contradicts shard_config.stage={shard.stage}: set it in one place"
        )
    if shard is None:
        parts["shard"] = seeds["zero_stage"]

    parts["profiler"] = seeds["profile"]
    parts["memory"] = seeds["memory_pool_size"]
    parts["graphs"] = seeds["capture_graph"]
    return KitsuneConfig(**parts)
