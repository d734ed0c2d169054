"""Configs: defaults, validation messages, and how keyword arguments combine with config objects."""

from __future__ import annotations

import math
import re

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
    ShardConfig,
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
    (lambda: FusionConfig(enable_everything=True), "enable_everything", "FusionConfig has no setting"),
    (lambda: MemoryConfig(zzz=1), "zzz", "MemoryConfig has no setting 'zzz': its settings are pool_size, flat_grads"),
    (lambda: FusionConfig(enable=True), "enable", "FusionConfig has no setting 'enable': did you mean enabled=...?"),
    (lambda: GraphConfig(static_address=True), "static_address", "did you mean static_addresses=...?"),
    (lambda: KitsuneConfig(fusion=True), "fusion", "fusion=True: write fusion=FusionConfig(enabled=True), a config"),
    (lambda: KitsuneConfig(amp=False), "amp", "amp=False: write amp=AMPConfig(enabled=False), a config"),
    (lambda: KitsuneConfig(shard=True), "shard", "shard=True: write shard=ShardConfig(...), a config"),
    (lambda: StreamConfig(num_streams=0), "num_streams", "greater than or equal to 1"),
    (lambda: StreamConfig(num_streams=100), "num_streams", "less than or equal to 64"),
    (lambda: StreamConfig(num_streams=2, priority_streams=[2]), "priority_streams", "below num_streams=2"),
    (lambda: StreamConfig(compute_streams=[1, 1]), "compute_streams", "lists a stream twice"),
    (lambda: StreamConfig(backward_stream="main"), "backward_stream", "'side' or 'current'"),
    (lambda: GraphConfig(warmup_steps=0), "warmup_steps", "greater than or equal to 1"),
    (lambda: MemoryConfig(pool_size=-1), "pool_size", "greater than or equal to 0"),
    (lambda: ProfilerConfig(max_step_records=0), "max_step_records", "greater than or equal to 1"),
    (lambda: ProfilerConfig(nvml_max_samples=0), "nvml_max_samples", "greater than or equal to 1"),
    (lambda: KitsuneConfig(amp={"growth_interval": -5}), "growth_interval", "greater than or equal to 1"),
    (lambda: AMPConfig(init_scale=float("inf")), "init_scale", "finite number"),
    (lambda: AMPConfig(init_scale=1e39), "init_scale", "less than or equal to 34028234"),
    (lambda: GradConfig(max_norm=float("inf")), "max_norm", "finite number"),
    (lambda: GradConfig(max_norm=float("nan")), "max_norm", "finite number"),
    (lambda: GradConfig(norm_type=None), "norm_type", "must be 2 or inf"),
    (lambda: GradConfig(norm_type=[2]), "norm_type", "must be 2 or inf"),
    (lambda: FusionConfig(min_fusion_benefit=float("inf")), "min_fusion_benefit", "finite number"),
    (lambda: ProfilerConfig(nvml_interval_s=float("inf")), "nvml_interval_s", "finite number"),
    (lambda: ProfilerConfig(compare_steps=1), "compare_steps", "use 2 or more (10 is a good length), or 0"),
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
    for model in (AMPConfig, FusionConfig, GradConfig, StreamConfig, GraphConfig, MemoryConfig, ProfilerConfig,
                  ShardConfig, KitsuneConfig):  # fmt: skip
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
    # beside config=, a setting at its default value is refused too: it would be ignored
    (
        dict(config=KitsuneConfig(profiler={"enabled": True}), profile=False),
        ValueError,
        "config= was given together with profile",
    ),
    (dict(config=KitsuneConfig(graphs={"enabled": False}), capture_graph=True), ValueError, "with capture_graph"),
    (dict(config=KitsuneConfig(), amp_config=AMPConfig()), ValueError, "config= was given together with amp_config"),
    (dict(amp_config=AMPConfig()), ValueError, "pass enable_amp=True"),
    (dict(fusion_config=FusionConfig()), ValueError, "pass enable_fusion=True"),
    (dict(enable_amp=True, amp_config=AMPConfig(enabled=False)), ValueError, "contradicts amp_config.enabled=False"),
    (dict(num_streams=8, stream_config=StreamConfig(num_streams=4)), ValueError, "set it in one place"),
    (dict(num_streams=0), ValueError, "num_streams=0 is refused: num_streams takes an int from 1 to 64"),
    (dict(memory_pool_size=-5), ValueError, r"memory_pool_size=-5 is refused: memory_pool_size takes an int number"),
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


# -- strictness: a slip is refused, not read as something else ------------------------------------------------------


def _tiny_sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


# keyword shorthand -> the field it stands for
SHORTHANDS = {
    "enable_amp": "enabled",
    "enable_fusion": "enabled",
    "num_streams": "num_streams",
    "profile": "enabled",
    "memory_pool_size": "pool_size",
    "capture_graph": "enabled",
    "max_grad_norm": "max_norm",
    "zero_stage": "stage",
}

KEYWORD_SLIPS = [
    ("enable_amp", "yes", "not a str"),
    ("enable_amp", 1, "not an int"),
    ("enable_fusion", "no", "not a str"),
    ("enable_fusion", 0, "not an int"),
    ("profile", "True", "not a str"),
    ("profile", 1, "not an int"),
    ("capture_graph", "off", "not a str"),
    ("capture_graph", None, "not None"),
    ("num_streams", True, "not a bool"),
    ("num_streams", "4", "not a str"),
    ("num_streams", 4.0, "not a float"),
    ("memory_pool_size", True, "not a bool"),
    ("memory_pool_size", "1GB", "not a str"),
    ("memory_pool_size", 1e9, "not a float"),
    ("max_grad_norm", True, "not a bool"),
    ("max_grad_norm", "1.0", "not a str"),
    ("zero_stage", True, "not a bool"),
    ("zero_stage", "1", "not a str"),
    ("zero_stage", 1.0, "not a float"),
]


@pytest.mark.parametrize("keyword, value, got", KEYWORD_SLIPS, ids=[f"{k}={v!r}" for k, v, _ in KEYWORD_SLIPS])
def test_keyword_of_the_wrong_type_is_refused_under_its_own_name(keyword, value, got):
    with pytest.raises(ValueError) as info:
        KitsuneOptimizer(_tiny_sgd(), **{keyword: value})
    assert type(info.value) is ValueError  # not pydantic's error about the field inside the section
    text = str(info.value)
    assert text.startswith(f"{keyword}={value!r} is refused: {keyword} takes ") and got in text
    assert f"write {keyword}=" in text or f"e.g. {keyword}=" in text
    field = SHORTHANDS[keyword]
    if field != keyword:
        assert not re.search(rf"\b{field}\b", text), text


def test_a_config_section_given_to_its_switch_is_pointed_where_it_goes():
    """``profile=ProfilerConfig(...)``: the fix named was ``profile=True``, which drops the settings; it names where
    the section goes (there is no ``profiler_config`` keyword), and for sections with one, their ``*_config``."""
    from kitsune import AMPConfig, MemoryConfig, ProfilerConfig

    def refusal(**kwargs):
        with pytest.raises(ValueError) as info:
            KitsuneOptimizer(_tiny_sgd(), **kwargs)
        return str(info.value)

    assert refusal(profile=ProfilerConfig(compare_steps=2)).endswith(
        "profile takes True or False, not a ProfilerConfig; write "
        "config=KitsuneConfig(profiler=ProfilerConfig(...)) (its enabled=True is the default)"
    )
    assert refusal(enable_amp=AMPConfig()).endswith(
        "not an AMPConfig; write amp_config=AMPConfig(...) with enable_amp=True"
    )
    assert refusal(memory_pool_size=MemoryConfig()).endswith(
        "not a MemoryConfig; write config=KitsuneConfig(memory=MemoryConfig(...))"
    )


def test_keyword_messages_say_what_it_takes_and_the_fix():
    def refusal(**kwargs):
        with pytest.raises(ValueError) as info:
            KitsuneOptimizer(_tiny_sgd(), **kwargs)
        return str(info.value)

    assert refusal(max_grad_norm=True) == (
        "max_grad_norm=True is refused: max_grad_norm takes a positive finite number or None (no clipping), not a "
        "bool; write the norm to clip to, e.g. max_grad_norm=1.0, or leave it out"
    )
    bools = "takes True or False, not a str; write enable_fusion=True or enable_fusion=False"
    assert refusal(enable_fusion="no").endswith(bools)
    assert refusal(zero_stage=True).endswith("takes the int 0, 1 or 2, not a bool; write e.g. zero_stage=1")
    # a whole float is the int it means, when that int is valid
    assert refusal(num_streams=4.0).endswith("write num_streams=4")
    assert refusal(memory_pool_size=1e9).endswith("write memory_pool_size=1000000000")
    assert refusal(num_streams=100.0).endswith("write e.g. num_streams=4")
    # out of range: no type to blame
    assert refusal(max_grad_norm=float("inf")).startswith("max_grad_norm=inf is refused: max_grad_norm takes a")
    stage = "zero_stage=3 is refused: zero_stage takes the int 0, 1 or 2; write e.g. zero_stage=1"
    assert refusal(zero_stage=3) == stage


MOOT_SLIPS = [
    (dict(config=KitsuneConfig(), profile=0), "profile=0 is refused"),
    (dict(num_streams=4.0, stream_config=StreamConfig(num_streams=4)), "num_streams=4.0 is refused"),
    (dict(zero_stage=False, shard_config=ShardConfig()), "zero_stage=False is refused"),
    (dict(max_grad_norm=True, grad_config=GradConfig(max_norm=1.0)), "max_grad_norm=True is refused"),
    (dict(enable_amp="yes", amp_config=AMPConfig()), "enable_amp='yes' is refused"),
]


@pytest.mark.parametrize("kwargs, message", MOOT_SLIPS)
def test_keyword_slips_are_refused_where_config_or_a_section_would_hide_them(kwargs, message):
    """0 == False and 4.0 == 4, so these once passed the checks for contradictions unseen."""
    with pytest.raises(ValueError, match=re.escape(message)):
        KitsuneOptimizer(_tiny_sgd(), **kwargs)


# every field, by what it takes; the fields left out are the deliberate coercions (see LENIENT)
STRICT_FIELDS = {
    AMPConfig: {"enabled": "bool", "init_scale": "float", "growth_factor": "float", "backoff_factor": "float",
                "growth_interval": "int"},
    FusionConfig: {"enabled": "bool", "enable_elementwise": "bool", "enable_reduction": "bool",
                   "enable_matmul": "bool", "max_fusion_size": "int", "min_fusion_benefit": "float",
                   "native_checks": "bool", "min_8bit_size": "int", "rounding_seed": "int"},
    GradConfig: {"max_norm": "float", "zero_in_step": "bool"},
    StreamConfig: {"num_streams": "int", "priority_streams": "ints", "compute_streams": "ints",
                   "step_in_backward": "bool", "bucket_bytes": "int"},
    GraphConfig: {"enabled": "bool", "warmup_steps": "int", "steady_replay": "bool", "static_addresses": "bool"},
    MemoryConfig: {"pool_size": "int", "flat_grads": "bool"},
    ShardConfig: {"stage": "int", "bucket_bytes": "int", "overlap": "bool", "gather_in_forward": "bool"},
    ProfilerConfig: {"enabled": "bool", "max_step_records": "int", "nvml_interval_s": "float",
                     "nvml_max_samples": "int", "sample_after": "int", "device_time_every": "int", "probe_steps": "int",
                     "compare_steps": "int"},
}  # fmt: skip
LENIENT = {
    AMPConfig: {"dtype"},  # also "float16"/"bfloat16" and the other names in _DTYPE_NAMES
    GradConfig: {"norm_type"},  # also "inf", as torch's clip_grad_norm_
    StreamConfig: {"backward_stream"},  # a Literal of two strings: nothing else gets through
    FusionConfig: {"state_precision", "param_rounding"},  # Literals of strings
    ShardConfig: {"process_group"},  # a ProcessGroup or None, checked by isinstance
    KitsuneConfig: set(KitsuneConfig.model_fields),  # the sections: an instance, or a dict validated strictly
}
# values a lax model would coerce into something valid
SLIPS = {
    "bool": [1, 0, "yes", "false", None],
    "int": [True, 2.0, "2"],
    "float": [True, "0.5"],
    "ints": ["0", [True], ["0"], [0.0]],
}
FIELD_SLIPS = [
    (model, name, value)
    for model, fields in STRICT_FIELDS.items()
    for name, kind in fields.items()
    for value in SLIPS[kind]
]


def test_every_field_is_strict_or_a_listed_coercion():
    for model in (*STRICT_FIELDS, KitsuneConfig):
        assert set(model.model_fields) == set(STRICT_FIELDS.get(model, {})) | LENIENT.get(model, set()), model


@pytest.mark.parametrize("model, name, value", FIELD_SLIPS, ids=[f"{m.__name__}.{n}={v!r}" for m, n, v in FIELD_SLIPS])
def test_field_of_the_wrong_type_is_refused_by_pydantic_naming_the_field(model, name, value):
    with pytest.raises(ValidationError) as info:
        model(**{name: value})
    (error,) = info.value.errors()
    assert error["loc"][0] == name and error["type"] in ("bool_type", "int_type", "float_type", "list_type")
    assert name in str(info.value)


def test_direct_config_keeps_pydantic_errors_naming_the_field():
    with pytest.raises(ValidationError, match="max_norm"):
        GradConfig(max_norm=True)
    with pytest.raises(ValidationError, match="num_streams") as info:
        KitsuneConfig(streams={"num_streams": "4"})  # a section as a dict is validated as strictly
    assert info.value.errors()[0]["loc"] == ("streams", "num_streams")
    with pytest.raises(ValidationError, match="amp"):
        KitsuneConfig(amp=True)


@pytest.mark.parametrize("value", ["2", True, False, "two", "-inf"])
def test_norm_type_takes_no_other_string_and_no_bool(value):
    with pytest.raises(ValidationError, match="norm_type must be 2 or inf"):
        GradConfig(norm_type=value)


def test_documented_coercions_still_work():
    assert AMPConfig(dtype="float16").dtype is torch.float16
    assert AMPConfig(dtype="bfloat16").dtype is torch.bfloat16
    for value in ("inf", "INF", float("inf")):
        assert GradConfig(norm_type=value).norm_type == math.inf
    for value in (2, 2.0):
        assert GradConfig(norm_type=value).norm_type == 2.0
    assert ShardConfig(process_group=None).process_group is None
    # an int where a float is meant is a number all the same
    ints = [
        (AMPConfig, "init_scale", 65536),
        (AMPConfig, "growth_factor", 4),
        (GradConfig, "max_norm", 1),
        (FusionConfig, "min_fusion_benefit", 2),
        (ProfilerConfig, "nvml_interval_s", 1),
    ]
    for model, name, value in ints:
        got = getattr(model(**{name: value}), name)
        assert got == value and type(got) is float, (model, name)
    # a tuple of indices is as good as a list
    assert StreamConfig(priority_streams=(0, 1)).priority_streams == [0, 1]
    opt = KitsuneOptimizer(_tiny_sgd(), max_grad_norm=1, num_streams=2, memory_pool_size=0, zero_stage=0)
    assert opt.config.grads.max_norm == 1.0 and type(opt.config.grads.max_norm) is float
    assert opt.config.streams.num_streams == 2 and opt.config.memory.pool_size == 0


def test_a_profiler_section_in_a_kitsune_config_profiles_as_the_other_sections_do():
    """``KitsuneConfig(profiler=ProfilerConfig(...))`` turns the profiler on, as a fusion or AMP section turns its
    subsystem on (its settings were ignored with the profiler off); ``KitsuneConfig()`` and ``profile=False`` leave it
    off, and ``enabled=False`` in the section too."""
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = KitsuneOptimizer(
        torch.optim.SGD(params, lr=0.1), config=KitsuneConfig(profiler=ProfilerConfig(compare_steps=10))
    )
    assert opt.profiler is not None and opt.config.profiler.compare_steps == 10
    for off in (
        KitsuneOptimizer(torch.optim.SGD(params, lr=0.1), config=KitsuneConfig()),
        KitsuneOptimizer(torch.optim.SGD(params, lr=0.1)),
        KitsuneOptimizer(torch.optim.SGD(params, lr=0.1), config=KitsuneConfig(profiler=ProfilerConfig(enabled=False))),
    ):
        assert off.profiler is None


def test_settings_are_named_not_positional_and_a_misspelt_one_names_the_setting_meant():
    """``KitsuneOptimizer(opt, True)`` turned AMP on where fusion was meant: every setting is keyword-only, and the
    refusal says so; a misspelt keyword names the one meant."""
    with pytest.raises(TypeError, match=r"the optimizer as its only positional argument, got 2: name each setting"):
        KitsuneOptimizer(_opt(), True)
    with pytest.raises(TypeError, match=r"unknown setting 'enable_fusions': did you mean enable_fusion=\.\.\.\?"):
        KitsuneOptimizer(_opt(), enable_fusions=True)
    with pytest.raises(TypeError, match=r"unknown setting 'bogus': the settings are enable_amp, enable_fusion"):
        KitsuneOptimizer(_opt(), bogus=True)
    assert KitsuneOptimizer(_opt(), config=KitsuneConfig()).config == KitsuneConfig()  # config= alone


def test_the_misspelt_setting_check_leaves_subclasses_aliases_and_odd_keys_to_pydantic():
    """The check that names the setting meant applies to kitsune's own configs: a subclass that allows extra
    settings takes them, a field's alias is a name, and a key that is no string gets pydantic's own error."""
    from pydantic import ConfigDict, Field

    class Extra(FusionConfig):
        model_config = ConfigDict(extra="allow")

    class Aliased(FusionConfig):
        note: str = Field("", alias="Note")

    assert Extra(anything=1).anything == 1  # type: ignore[attr-defined]
    assert Aliased(Note="x").note == "x"
    with pytest.raises(ValidationError):
        FusionConfig.model_validate({1: 2})
    with pytest.raises(ValidationError, match="did you mean enabled"):
        Aliased(enable=True)
