"""Configs: defaults, validation messages, and how keyword arguments combine with config objects."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kitsune import (
    AMPConfig,
    FusionConfig,
    GradConfig,
    GraphConfig,
    KitsuneConfig,
    KitsuneOptimizer,
    MemoryConfig,
    ProfilerConfig,
    StreamConfig,
)


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1)


INVALID = [
    (lambda: AMPConfig(backoff_factor=1.5), "backoff_factor", "less than 1"),
    (lambda: AMPConfig(growth_factor=1.0), "growth_factor", "greater than 1"),
    (lambda: AMPConfig(growth_interval=0), "growth_interval", "greater than or equal to 1"),
    (lambda: AMPConfig(init_scale=0), "init_scale", "greater than 0"),
    (lambda: AMPConfig(dtype=torch.float32), "dtype", "torch.float16 or torch.bfloat16"),
    (lambda: AMPConfig(dtype="int8"), "dtype", "torch.float16 or torch.bfloat16"),
    (lambda: FusionConfig(max_fusion_size=0), "max_fusion_size", "greater than or equal to 1"),
    (lambda: FusionConfig(min_fusion_benefit=-1), "min_fusion_benefit", "greater than or equal to 0"),
    (lambda: FusionConfig(enable_everything=True), "enable_everything", "Extra inputs are not permitted"),
    (lambda: StreamConfig(num_streams=0), "num_streams", "greater than or equal to 1"),
    (lambda: StreamConfig(num_streams=100), "num_streams", "less than or equal to 64"),
    (lambda: StreamConfig(num_streams=2, priority_streams=[2]), "priority_streams", "below num_streams=2"),
    (lambda: StreamConfig(compute_streams=[1, 1]), "compute_streams", "lists a stream twice"),
    (lambda: StreamConfig(backward_stream="main"), "backward_stream", "'side' or 'current'"),
    (lambda: GraphConfig(warmup_steps=0), "warmup_steps", "greater than or equal to 1"),
    (lambda: MemoryConfig(pool_size=-1), "pool_size", "greater than or equal to 0"),
    (lambda: ProfilerConfig(max_step_records=0), "max_step_records", "greater than or equal to 1"),
    (lambda: KitsuneConfig(amp={"growth_interval": -5}), "growth_interval", "greater than or equal to 1"),
    (lambda: AMPConfig(init_scale=float("inf")), "init_scale", "finite number"),
    (lambda: AMPConfig(init_scale=1e39), "init_scale", "less than or equal to 34028234"),
    (lambda: GradConfig(max_norm=float("inf")), "max_norm", "finite number"),
    (lambda: GradConfig(max_norm=float("nan")), "max_norm", "finite number"),
    (lambda: GradConfig(norm_type=None), "norm_type", "must be 2 or inf"),
    (lambda: GradConfig(norm_type=[2]), "norm_type", "must be 2 or inf"),
    (lambda: FusionConfig(min_fusion_benefit=float("inf")), "min_fusion_benefit", "finite number"),
    (lambda: ProfilerConfig(nvml_interval_s=float("inf")), "nvml_interval_s", "finite number"),
    (lambda: ProfilerConfig(compare_steps=1), "compare_steps", "use 2 or more (10 by default), or 0"),
]


@pytest.mark.parametrize("make, field, message", INVALID, ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(INVALID)])
def test_invalid_values_name_field_and_range(make, field, message):
    with pytest.raises(ValidationError) as info:
        make()
    text = str(info.value)
    assert field in text and message in text


def test_configs_are_frozen():
    cfg = AMPConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.init_scale = 4.0


def test_every_field_has_a_default_and_a_docstring():
    for model in (AMPConfig, FusionConfig, StreamConfig, GraphConfig, MemoryConfig, ProfilerConfig, KitsuneConfig):
        model()  # all defaults valid
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no docstring"


def test_amp_dtype_accepts_names_and_serialises():
    assert AMPConfig(dtype="bf16").dtype is torch.bfloat16
    assert AMPConfig(dtype="torch.float16").dtype is torch.float16
    dumped = KitsuneConfig(amp=AMPConfig(dtype=torch.bfloat16)).model_dump(mode="json")
    assert dumped["amp"]["dtype"] == "bfloat16"
    assert KitsuneConfig.model_validate(dumped).amp.dtype is torch.bfloat16


def test_keywords_build_the_config():
    opt = KitsuneOptimizer(_opt(), num_streams=6, profile=True, memory_pool_size=1024, capture_graph=False)
    cfg = opt.config
    assert cfg.streams.num_streams == 6 and opt.scheduler.num_streams == 6
    assert cfg.profiler.enabled and cfg.memory.pool_size == 1024 and not cfg.graphs.enabled
    assert not cfg.amp.enabled and not cfg.fusion.enabled


def test_config_object_is_used_as_is():
    config = KitsuneConfig(streams=StreamConfig(num_streams=2), profiler=ProfilerConfig(enabled=True))
    opt = KitsuneOptimizer(_opt(), config=config)
    assert opt.config is config and opt.profiler is not None


CONTRADICTIONS = [
    (dict(config=KitsuneConfig(), profile=True), ValueError, "config= was given together with profile"),
    (dict(config=KitsuneConfig(), amp_config=AMPConfig()), ValueError, "config= was given together with amp_config"),
    (dict(amp_config=AMPConfig()), ValueError, "pass enable_amp=True"),
    (dict(fusion_config=FusionConfig()), ValueError, "pass enable_fusion=True"),
    (dict(enable_amp=True, amp_config=AMPConfig(enabled=False)), ValueError, "contradicts amp_config.enabled=False"),
    (dict(num_streams=8, stream_config=StreamConfig(num_streams=4)), ValueError, "set it in one place"),
    (dict(num_streams=0), ValidationError, "num_streams"),
    (dict(memory_pool_size=-5), ValidationError, "pool_size"),
    (dict(config={"profiler": {"enabled": True}}), TypeError, "config must be a KitsuneConfig"),
    (dict(amp_config=FusionConfig(), enable_amp=True), TypeError, "amp_config must be an instance of AMPConfig"),
]


@pytest.mark.parametrize("kwargs, exc, message", CONTRADICTIONS)
def test_contradictions_and_bad_arguments_are_refused(kwargs, exc, message):
    opt = _opt()
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    with pytest.raises(exc, match=message):
        KitsuneOptimizer(opt, **kwargs)
    after = [p for g in opt.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_matching_stream_settings_are_fine():
    opt = KitsuneOptimizer(_opt(), num_streams=4, stream_config=StreamConfig(num_streams=4, priority_streams=[0]))
    assert opt.config.streams.priority_streams == [0]


def test_section_passed_with_switch_on():
    opt = KitsuneOptimizer(_opt(), enable_amp=True, amp_config=AMPConfig(dtype=torch.bfloat16, growth_interval=10))
    assert opt.config.amp.enabled and opt.config.amp.growth_interval == 10
    assert next(s for s in opt.subsystem_status() if s["name"] == "amp")["active"]
