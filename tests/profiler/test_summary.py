"""``print_summary()`` reads well at 80 columns (CI logs, piped output) and at 160: nothing past the width, no reason
squeezed one word a line, each reason once, byte counts and nested reports written for people."""

from __future__ import annotations

import io
import re

import pytest
import torch
from helpers import batches, small_model, train
from rich.console import Console

from kitsune import FusionConfig, KitsuneConfig, KitsuneOptimizer, ProfilerConfig
from kitsune.profiler.summary import readable, wrap

WIDTHS = (80, 160)
BORDERS = "│┃┏┓┗┛┡┩└┘┌┐━─╇┳┻┬┴┼╋├┤"
RAW_BYTES = re.compile(r"(?<![\d.,])\d{7,}(?![\d.,])")


def _config(fused: bool) -> KitsuneConfig:
    return KitsuneConfig(
        fusion=FusionConfig(enabled=True),
        profiler=ProfilerConfig(enabled=True, sample_after=2, compare_steps=3 if fused else 10, nvml_interval_s=0),
    )


@pytest.fixture
def cpu_run() -> KitsuneOptimizer:
    """fusion asked for on CPU params: every param goes to the wrapped optimizer's own step."""
    m = small_model()
    with pytest.warns(UserWarning, match="fusion was asked for but is inactive"):
        opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), config=_config(fused=False))
        train(m, opt, batches(20))
    return opt


@pytest.fixture
def fused_run(monkeypatch, device) -> KitsuneOptimizer:
    """The fused path: on CUDA, or on a CPU under Triton's interpreter (the kernels were imported for it)."""
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    m = small_model(device=device)
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), config=_config(fused=True))
    train(m, opt, batches(20, device=device))
    if opt.profiler is not None:
        opt.profiler.close()
    return opt


def _render(opt: KitsuneOptimizer, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    opt.print_summary(console=console)
    return console.export_text()


def _reasons(opt: KitsuneOptimizer) -> list[str]:
    """Every reason the summary has to give: inactive subsystems', the plan's, the probe's and the comparison's."""
    out = [s["reason"] for s in opt.subsystem_status() if not s["active"] and s["reason"]]
    if opt.plan is not None:
        out += [b.reason for b in opt.plan.buckets]
    metrics = opt.profiler.get_metrics()
    out += [r for r in (metrics.probe.reason, metrics.comparison.reason) if r]
    return out


def _clauses(reasons: list[str]) -> set[str]:
    """The parts of the reasons (split at ``:``, ``;`` and brackets) of 4 words or more: reasons nest one another."""
    parts = (p.strip() for r in reasons for p in re.split(r"[:;()]", r))
    return {p for p in parts if len(p.split()) >= 4}


def _prose(line: str) -> str:
    """Where long text goes on a line: a table row's last cell (detail, value), or the whole line outside tables."""
    if line.lstrip().startswith("┃") or line.strip(BORDERS + " ") == "":
        return ""  # a header row or a rule
    return line.split("│")[-2] if line.lstrip().startswith("│") else line


def _check(text: str, width: int, reasons: list[str]) -> str:
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    assert "{'" not in text and '{"' not in text, "a raw dict"
    assert not RAW_BYTES.search(text), RAW_BYTES.search(text)
    # a word of a reason of several words, alone where long text goes: squeezed into a narrow column
    words = {w for r in reasons if len(r.split()) > 2 for w in r.split() if len(w) >= 4 and any(c.isalpha() for c in w)}
    for line in lines:
        alone = _prose(line).split()
        assert not (len(alone) == 1 and alone[0] in words and alone[0] not in ("subsystems", "plan")), line
    flat = " ".join(re.sub(f"[{BORDERS}]", " ", text).split())
    for clause in _clauses(reasons):
        assert flat.count(clause) <= 1, f"said {flat.count(clause)} times: {clause}"
    return flat


@pytest.mark.parametrize("width", WIDTHS)
def test_cpu_summary_reads_well_and_says_what_pass_through_means(cpu_run, width):
    flat = _check(_render(cpu_run, width), width, _reasons(cpu_run))
    assert "TRITON_INTERPRET" not in flat  # a test mode, far slower than torch: never advice
    assert flat.count("bit-identical") == 1 and flat.count("fused kernels need CUDA") == 1
    assert "pass-through: AdamW's own step updated every param" in flat
    assert "nothing to fuse: CPU params (see pass-through above)" in flat  # the fusion row refers to it
    assert "fusion is inactive (see fusion)" in flat  # graphs refer to fusion's reason, not repeat it
    assert "not_applicable" not in flat and "nothing to compare" not in flat  # said once, as pass-through
    assert "bytes_per_step 5.8 KiB" in flat


@pytest.mark.parametrize("profile", [True, False])
def test_summary_before_the_first_step_claims_no_update(profile):
    """Right after construction no step has updated anything: the summary says so, not what updated the params."""
    opt = KitsuneOptimizer(torch.optim.AdamW(small_model().parameters()), profile=profile)
    flat = " ".join(_render(opt, 160).split())
    assert "pass-through" not in flat and "updated every param" not in flat and "bit-identical" not in flat
    assert (
        "no step has run yet: which step updates the params (AdamW's own or kitsune's) is said after the first" in flat
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_fused_summary_reads_well(fused_run, width):
    flat = _check(_render(fused_run, width), width, _reasons(fused_run))
    assert "pass-through" not in flat
    assert "pool_size_bytes: 512.0 MiB" in flat and "bytes_per_device: " in flat and "(reserved: " in flat
    assert "static_addresses" not in flat  # None: left out
    assert "fused_launches_per_step: 1" in flat and re.search(r"\[1\] fused Triton multi-tensor kernel", flat)
    # the bucket's label, whole: at 80 columns the seven columns do not fit, and rich squeezed it away
    assert f"AdamW (decoupled_wd) float32 {fused_run.plan.buckets[0].device}" in flat
    assert "live comparison with torch.optim.adamw.AdamW.step" in flat


def test_summary_after_a_reset_or_a_load_says_no_step_was_recorded():
    """Steps ran but none is recorded (the profiler reset, or the state loaded into a new optimizer): the summary
    says so, not that no step has run (which contradicted its own headline)."""
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), profile=True)
    train(m, opt, batches(5))
    opt.profiler.reset()
    other = KitsuneOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1), profile=True)
    other.load_state_dict(opt.state_dict())
    for o in (opt, other):
        flat = " ".join(_render(o, 160).split())
        assert "5 steps" in flat and "no step has run yet" not in flat
        assert "step timings: none recorded of the 5 step(s) so far" in flat


def test_readable_writes_nested_reports_and_bytes_for_people():
    report = {
        "pool_size_bytes": 512 * 2**20,
        "bytes_per_device": {"cuda:0": {"reserved": 3 * 2**30, "allocated": 1536}},
        "params": 12,
        "fraction_bytes": 0.25,
        "stopped": [],
        "gone": None,
    }
    assert readable(report) == (
        "pool_size_bytes: 512.0 MiB; bytes_per_device: cuda:0 (reserved: 3.0 GiB, allocated: 1.5 KiB); params: 12; "
        "fraction_bytes: 0.25; stopped: none"
    )
    assert readable({"loss_scale": 65536.0, "lr": 0.00123456}) == "loss_scale: 65536; lr: 0.001235"  # whole: in full


@pytest.mark.parametrize("width", [20, 33, 47, 80])
def test_wrap_never_leaves_one_word_alone_on_the_last_line(width):
    text = "the wrapped optimizer's own step keeps results bit-identical to torch on every param"
    lines = wrap(text, width, indent="  ")
    assert " ".join(" ".join(lines).split()) == text
    assert all(len(line) <= width for line in lines) and len(lines[-1].split()) >= 2, lines
    assert wrap("a-word-longer-than-the-width", 5)  # cut, not lost
