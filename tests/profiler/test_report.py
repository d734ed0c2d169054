"""Profile round trip, Chrome trace, ``kitsune report`` and the HTML report (rendered in headless Chromium)."""

from __future__ import annotations

import argparse
import errno
import html
import io
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from headless import chromium, distinct_colours, png_rgb
from headless import launch as launch_chromium
from helpers import batches, small_model, train
from rich.console import Console

from kitsune import KitsuneOptimizer
from kitsune.cli import main as kitsune_main
from kitsune.fusion.plan import BucketPlan, Plan, Route
from kitsune.profiler.core import Comparison, TimeStats
from kitsune.profiler.html import STEP_COLOR, render_html, write_html
from kitsune.profiler.nvml import NvmlReport, NvmlSample, field_stats
from kitsune.profiler.report import register
from kitsune.profiler.schema import MemoryInfo, Profile, SubsystemStatus, build_profile, load_profile
from kitsune.profiler.summary import render_summary
from kitsune.profiler.trace import export_chrome_trace

NVML_PLOTS = ("plot-nvml-util", "plot-nvml-memory", "plot-nvml-power")


@pytest.fixture(scope="module")
def opt():
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), profile=True)
    train(m, opt, batches(30))
    return opt


def _fake_gpu_data(profile: Profile) -> Profile:
    """The profile as if it had run on a GPU: NVML samples every 0.5 s and allocator figures."""
    samples = [
        NvmlSample(
            t_us=i * 5e5,
            util_pct=50 + 45 * math.sin(i / 3),
            mem_used_mib=2000 + 40 * i,
            power_w=120 + 2 * i,
            temp_c=50 + i / 10,
            sm_clock_mhz=1980,
        )
        for i in range(40)
    ]
    nvml = NvmlReport(
        available=True, device="Fake H100", uuid="abc", interval_s=0.5, samples=samples, stats=field_stats(samples)
    )
    memory = MemoryInfo(
        allocated_bytes=2**30, peak_allocated_bytes=3 * 2**30, reserved_bytes=4 * 2**30,
        peak_reserved_bytes=4 * 2**30, total_bytes=80 * 2**30,
    )  # fmt: skip
    return profile.model_copy(update={"nvml": nvml, "memory": memory})


@pytest.fixture(scope="module")
def gpu_profile(opt) -> Profile:
    return _fake_gpu_data(build_profile(opt))


def _text(render) -> str:
    buf = io.StringIO()
    render(Console(file=buf, width=140, color_system=None))
    return buf.getvalue()


# -- the profile JSON ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_gpu_data", [False, True])
def test_profile_round_trip(opt, tmp_path, with_gpu_data):
    profile = build_profile(opt)
    if with_gpu_data:
        profile = _fake_gpu_data(profile)
    path = tmp_path / "p.json"
    path.write_text(profile.model_dump_json(indent=2))
    again = load_profile(path)
    assert again == profile
    assert again.steps[0].host_start_us is not None


def test_unavailable_nvml_section_is_short_in_json(opt, tmp_path):
    data = json.loads(opt.save_profile(tmp_path / "p.json").read_text())
    assert data["nvml"] == {"available": False, "reason": "params are not on a CUDA device"}
    assert data["memory"] is None and data["param_groups"] == 1 and data["num_params"] == 4


def test_profile_from_before_the_optional_fields_still_loads(opt, tmp_path):
    data = json.loads(build_profile(opt).model_dump_json())
    for key in ("nvml", "memory", "param_groups", "num_params"):
        del data[key]
    for step in data["steps"]:
        del step["host_start_us"], step["device_start_us"]
    data["schema_version"] = "1.0"  # written before a step's step_ms could be null
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_profile(path)
    assert old.schema_version == "1.0" and old.nvml is None and old.steps[0].host_start_us is None
    text = _text(lambda c: render_summary(old, c))
    assert "AdamW, 30 steps" in text
    words = " ".join(text.split())  # the title wraps at the table's width
    assert "step time (20 of 30 steps: 10 warm-up left out; host clock)" in words  # what was left out, counted
    events = json.loads(export_chrome_trace(old, tmp_path / "t.json").read_text())["traceEvents"]
    host = [e for e in events if e["ph"] == "X" and e["tid"] == 2]
    for a, b in zip(host, host[1:], strict=False):  # laid end to end
        assert b["ts"] == pytest.approx(a["ts"] + a["dur"])


# -- the Chrome trace ---------------------------------------------------------------------------------------------
def _check_trace(path: Path, steps: int) -> list[dict]:
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    assert isinstance(events, list)
    for e in events:
        assert {"name", "ph", "pid"} <= set(e) and e["ph"] in ("X", "M", "C")
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"step (device)", "host"}
    for tid in (1, 2):
        track = [e for e in events if e["ph"] == "X" and e["tid"] == tid]
        assert len(track) == steps
        for e in track:
            assert all(isinstance(e[k], (int, float)) for k in ("ts", "dur", "pid", "tid")) and e["dur"] > 0
        assert [e["args"]["step"] for e in track] == list(range(1, steps + 1))
        ts = [e["ts"] for e in track]
        assert all(b > a for a, b in zip(ts, ts[1:], strict=False)), "step timestamps must increase"
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(track, track[1:], strict=False)), "overlap"
    return events


def test_chrome_trace_from_profiler_optimizer_and_profile(opt, gpu_profile, tmp_path):
    for source in (opt.profiler, opt, build_profile(opt)):
        events = _check_trace(export_chrome_trace(source, tmp_path / "t.json"), 30)
        assert not any(e["ph"] == "C" for e in events)
    _check_trace(opt.export_chrome_trace(tmp_path / "method.json"), 30)
    events = _check_trace(export_chrome_trace(gpu_profile, tmp_path / "gpu.json"), 30)
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == 40 * 5 and {e["name"] for e in counters} >= {"GPU utilisation (%)", "power (W)"}
    with pytest.raises(TypeError, match="needs a Profile"):
        export_chrome_trace(object(), tmp_path / "x.json")


# -- the summary and `kitsune report` -----------------------------------------------------------------------------
def test_live_and_loaded_summaries_are_the_same(opt, tmp_path):
    live = _text(opt.print_summary)
    loaded = load_profile(opt.save_profile(tmp_path / "p.json"))
    assert _text(lambda c: render_summary(loaded, c)) == live
    assert "AdamW, 1 param group(s), 4 params, 30 steps" in live
    assert "GPU telemetry (NVML): unavailable: params are not on a CUDA device" in live


def test_summary_shows_nvml_and_memory(gpu_profile):
    text = _text(lambda c: render_summary(gpu_profile, c))
    assert "GPU telemetry (NVML): Fake H100, 40 samples every 0.5 s" in text
    assert "GPU utilisation" in text and "power" in text and "SM clock" in text
    assert "CUDA memory (torch allocator)" in text and "3.0 GiB" in text and "80.0 GiB" in text


def test_summary_shows_the_plan(gpu_profile):
    plan = {"kernels": 2, "fallbacks": [{"param": "emb.weight", "reason": "sparse grad"}]}
    text = _text(lambda c: render_summary(gpu_profile.model_copy(update={"plan": plan}), c))
    assert "plan" in text and "kernels" in text and "emb.weight" in text and "sparse grad" in text


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kitsune")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_kitsune_report_command(gpu_profile, tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(gpu_profile.model_dump_json())
    html, trace = tmp_path / "out" / "r.html", tmp_path / "t.json"
    assert _cli(["report", str(path), "--html", str(html), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "kitsune summary: AdamW" in out and "Fake H100" in out
    assert "step time (20 of 30 steps: 10 warm-up left out" in out
    assert f"wrote {html}" in out and html.read_text().startswith("<!DOCTYPE html>")
    _check_trace(trace, 30)

    # what is not a profile: one error line from the kitsune command (tests/test_cli.py has every case)
    assert kitsune_main(["report", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"schema_version": "1.0"}')
    assert kitsune_main(["report", str(tmp_path / "bad.json")]) == 2
    assert "is not a kitsune profile" in capsys.readouterr().err


# -- the HTML report ----------------------------------------------------------------------------------------------
def test_html_is_self_contained_and_has_every_section(gpu_profile):
    page = render_html(gpu_profile.model_copy(update={"plan": {"kernels": 2}}))
    assert "<title>kitsune profile: AdamW, 1 param group(s), 4 params, 30 steps</title>" in page
    for svg_id in ("plot-step-time", "plot-host-time", *NVML_PLOTS):
        assert f'<svg class="plot" id="{svg_id}"' in page
    for text in ("Environment", "Config", "Subsystems", "enable_fusion=False", 'id="plan"', 'id="memory"', "p50 "):
        assert text in page
    assert "http" not in page and "<script" not in page and "src=" not in page and "href=" not in page


def test_a_slow_warm_up_step_does_not_flatten_the_plot(opt):
    # Fixed times, not the measured ones: a CPU step stalled by the machine would be a second point above the axis.
    profile = build_profile(opt)
    steady = [s.model_copy(update={"step_ms": 1.0 + 0.05 * (s.step % 7), "host_ms": 0.5}) for s in profile.steps]
    assert "above the axis" not in render_html(profile.model_copy(update={"steps": steady}))
    steps = [s.model_copy(update={"step_ms": 500.0}) if s.step == 1 else s for s in steady]
    page = render_html(profile.model_copy(update={"steps": steps}))
    assert page.count("above the axis") == 1 and "1 point(s) above the axis, up to 500" in page


def test_html_without_gpu_data_or_timings(opt):
    profile = build_profile(opt)
    page = render_html(profile)
    assert "plot-step-time" in page and "Unavailable: params are not on a CUDA device" in page
    assert not any(i in page for i in NVML_PLOTS) and 'id="memory"' not in page
    page = render_html(profile.model_copy(update={"metrics": None, "steps": [], "nvml": None}))
    assert "Profiling was off" in page and "<svg" not in page


def test_html_of_an_optimizer_is_the_page_of_its_profile(opt, tmp_path):
    """``write_html(optimizer, path)``, as ``export_chrome_trace`` takes one: the page of the profile
    ``save_profile`` would write (its steps, its plot); anything else is a TypeError naming what it takes."""
    import re

    def undated(page: str) -> str:
        return re.sub(r"recorded \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \w+", "recorded", page)

    page = write_html(opt, tmp_path / "report.html").read_text()
    assert "plot-step-time" in page and undated(page) == undated(render_html(build_profile(opt)))
    with pytest.raises(TypeError, match="write_html needs a Profile .* or a KitsuneOptimizer, got list"):
        write_html([], tmp_path / "other.html")
    assert not (tmp_path / "other.html").exists()


def test_html_renders_in_headless_chromium(gpu_profile, tmp_path):
    chromium()
    # Fixed times, not the measured ones: a noisy line is steep, thin, anti-aliased segments with few pure pixels.
    # The stats too: measured ones on a loaded machine (p90 several ms) stretch the axis and push the line off-screen.
    steps = [s.model_copy(update={"step_ms": 1.0 + 0.05 * (s.step % 7), "host_ms": 0.5}) for s in gpu_profile.steps]
    stats = {"step_time": TimeStats.of([s.step_ms for s in steps]), "host_time": TimeStats.of([0.5] * len(steps))}
    metrics = gpu_profile.metrics.model_copy(update=stats)
    page = write_html(gpu_profile.model_copy(update={"steps": steps, "metrics": metrics}), tmp_path / "report.html")
    png = tmp_path / "shot.png"

    def launch(*args: str) -> subprocess.Popen:
        return launch_chromium(page.as_uri(), tmp_path / f"chromium-{len(args)}", *args)  # a fresh user-data-dir

    # tall enough that the plots stay in the shot when the config table above them grows
    shot = launch(f"--screenshot={png}", "--window-size=1200,2400", "--hide-scrollbars")
    dom = launch("--dump-dom")
    dom_html, _ = dom.communicate(timeout=60)
    shot.communicate(timeout=60)
    assert dom.returncode == 0 and shot.returncode == 0

    assert "<title>kitsune profile: AdamW, 1 param group(s), 4 params, 30 steps</title>" in dom_html
    for svg_id in ("plot-step-time", "plot-host-time", *NVML_PLOTS):
        assert f'id="{svg_id}"' in dom_html, svg_id
    assert dom_html.count("<polyline") == 5

    rgb = png_rgb(png)
    assert rgb.shape == (2400, 1200, 3)
    non_white = (rgb < 235).any(axis=-1).mean()
    colours = distinct_colours(rgb)
    assert non_white > 0.03, f"screenshot is almost blank ({non_white:.3%} non-white pixels)"
    assert colours > 100, f"only {colours} distinct colours"
    step_rgb = np.array([int(STEP_COLOR[i : i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(rgb.astype(int) - step_rgb).max(axis=-1) < 40).sum() > 100, "the step-time line is not drawn"


def _fused_profile(gpu_profile: Profile) -> Profile:
    """The fake GPU profile as a fused run's: probe and comparison-baseline steps among its records (left out of the
    statistics), a plan of long buckets and reasons, and the memory pool's nested report of byte counts."""
    modes = {**dict.fromkeys(range(11, 14), "probe"), **dict.fromkeys(range(24, 31), "baseline")}
    steps = [
        s.model_copy(update={"mode": modes.get(s.step, "kitsune"), "step_ms": 1 + 0.05 * (s.step % 7), "host_ms": 0.5})
        for s in gpu_profile.steps
    ]
    kept = [s for s in steps if s.mode == "kitsune"]
    stats = {"step_time": TimeStats.of([s.step_ms for s in kept]), "host_time": TimeStats.of([s.host_ms for s in kept])}
    long_reason = (
        "non-contiguous param: the fused kernel addresses flat memory (torch's foreach path takes it: torch's fused "
        "kernels need each grad laid out as its param)"
    )
    plan = Plan(
        [
            BucketPlan("cuda:0", "bfloat16", "AdamW", "decoupled_wd, amsgrad, maximize", Route.TRITON,
                       "fused Triton multi-tensor kernel", 148, 123_456_789, 3, 1_975_308_624, 2.93, [0, 1]),
            BucketPlan("cuda:0", "float32", "AdamW", "decoupled_wd", Route.TORCH_FOREACH, long_reason, 2, 4096, 0,
                       114_688, 1.4, [0], ["foreach=True ignored: kitsune picks the route per bucket"]),
        ]
    ).to_dict()  # fmt: skip
    pool = {
        "pool_size_bytes": 512 * 2**20,
        "arenas": 2,
        "bytes_per_device": {"cuda:0": {"reserved": 1_234_567_890, "allocated": 987_654_321}},
        "params_pooled": 148,
    }
    subsystems = [
        SubsystemStatus(name=s.name, active=True, reason=None, report=pool) if s.name == "memory" else s
        for s in gpu_profile.subsystems
    ]
    # the statistics over every kitsune step: no warm-up left out here (the opt fixture's 10 were)
    metrics = gpu_profile.metrics.model_copy(update={"steps_timed": 30, "warmup_left_out": 0, **stats})
    return gpu_profile.model_copy(update={"steps": steps, "metrics": metrics, "plan": plan, "subsystems": subsystems})


def test_html_counts_formats_and_words(gpu_profile):
    profile = _fused_profile(gpu_profile)
    reason = "kitsune ran the wrapped optimizer's own step on every param: there is nothing to compare"
    comparison = Comparison(status="not_applicable", reason=reason)  # a status whose field value is not a word
    profile = profile.model_copy(update={"metrics": profile.metrics.model_copy(update={"comparison": comparison})})
    page = render_html(profile)
    counts = r'id="step-counts">(\d+) steps timed; (\d+) in the statistics below \(left out: (.*?)\)'
    m = re.search(counts, page)
    assert m and m[1] == "30" and m[2] == "20" and m[3] == "3 probe, 7 comparison baseline", page
    warm = profile.metrics.model_copy(update={"warmup_left_out": 10})
    m = re.search(counts, render_html(profile.model_copy(update={"metrics": warm})))
    assert m and m[1] == "30" and m[3] == "10 warm-up, 3 probe, 7 comparison baseline"
    # on CUDA past the windows one step in device_time_every is timed on the device: the others are counted too
    last = {r.step for r in profile.steps if r.mode == "kitsune"}
    last = set(sorted(last)[-5:])
    untimed = [r.model_copy(update={"step_ms": None}) if r.step in last else r for r in profile.steps]
    m = re.search(counts, render_html(profile.model_copy(update={"steps": untimed})))
    assert m and m[3] == "3 probe, 7 comparison baseline, 5 not timed on the device"
    assert re.search(r"<td>step</td>\s*<td class=\"num\">20</td>", page)  # the statistics' own count
    text = html.unescape(re.sub(r"<svg.*?</svg>|<style>.*?</style>|<[^>]+>", " ", page, flags=re.S))
    assert not re.search(r"(?<![\d.,])\d{7,}(?![\d.,])", text), "a raw byte count"
    assert "512.0 MiB" in text and "1.1 GiB" in text and "1.8 GiB" in text and "123,456,789" in text
    assert "not_applicable" not in text
    assert "live comparison with the wrapped optimizer's own step: not applicable: kitsune ran" in text
    assert "{'" not in text and "2.9x" in text and text.count(" foreach path takes it") == 1


def test_html_fits_a_laptop_screen_in_headless_chromium(gpu_profile, tmp_path):
    """At 1280 px nothing is wider than the window, and the header's counts are the statistics' counts."""
    chromium()
    page = render_html(_fused_profile(gpu_profile))
    measure = (
        '<pre id="measure"></pre><script>const r = Math.max(...[...document.querySelectorAll("body *")]'
        '.map(e => e.getBoundingClientRect().right)); document.getElementById("measure").textContent = '
        "JSON.stringify({scroll: document.documentElement.scrollWidth, right: r});</script></body>"
    )
    (tmp_path / "measured.html").write_text(page.replace("</body>", measure), encoding="utf-8")
    report = write_html(_fused_profile(gpu_profile), tmp_path / "report.html")
    png = tmp_path / "laptop.png"
    dom = launch_chromium((tmp_path / "measured.html").as_uri(), tmp_path / "chromium-dom", "--window-size=1280,900",
                          "--dump-dom")  # fmt: skip
    dom_html, _ = dom.communicate(timeout=60)
    shot = launch_chromium(report.as_uri(), tmp_path / "chromium-shot", f"--screenshot={png}",
                           "--window-size=1280,2400", "--hide-scrollbars")  # fmt: skip
    shot.communicate(timeout=60)
    assert dom.returncode == 0 and shot.returncode == 0

    sizes = json.loads(re.search(r'<pre id="measure">(.*?)</pre>', dom_html)[1])
    assert sizes["scroll"] <= 1280 and sizes["right"] <= 1280, sizes
    counts = re.search(r"(\d+) steps timed; (\d+) in the statistics", dom_html)
    assert counts and int(counts[2]) == 20 and re.search(r"<td>step</td>\s*<td class=\"num\">20</td>", dom_html)
    points = re.search(r'id="plot-step-time".*?<polyline class="series" points="([^"]+)"', dom_html, re.S)[1]
    assert len(points.split()) == 20  # the plot shows the counted steps

    rgb = png_rgb(png)
    assert rgb.shape == (2400, 1280, 3)
    assert (rgb < 235).any(axis=-1).mean() > 0.02, "the screenshot is almost blank"
    margin = rgb[:, 1280 - 60 :]  # the page is 1132 px wide and centred: nothing is drawn in the right margin
    assert (margin.min(axis=-1) > 235).all(), "something runs past the page into the right margin"


def test_load_profile_names_what_is_wrong(opt, tmp_path):
    """load_profile raises a ValueError whose one line names the problem (the ``kitsune report`` error line)."""
    with pytest.raises(ValueError, match="is a directory, not a profile JSON written by save_profile"):
        load_profile(tmp_path)
    old = json.loads(build_profile(opt).model_dump_json())
    old["schema_version"] = "0.9"
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"schema_version '0.9' is not one this kitsune reads \(1.0, 1.1\)") as info:
        load_profile(tmp_path / "old.json")
    assert "\n" not in str(info.value)
    (tmp_path / "bin.json").write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        load_profile(tmp_path / "bin.json")
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("steps", ["x"], "is not a kitsune profile: steps.0: Input should be an object"),
        ("environment", "x", "is not a kitsune profile: environment: Input should be an object"),
        ("metrics", 3, "is not a kitsune profile: metrics: Input should be an object"),
    ],
)
def test_load_profile_names_a_malformed_nested_record(opt, tmp_path, field, value, expected):
    """An object at the top whose record is not one: the message names the field, not "its top level"."""
    data = json.loads(build_profile(opt).model_dump_json())
    data[field] = value
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        load_profile(tmp_path / "p.json")
    assert str(info.value) == f"{tmp_path / 'p.json'} {expected}"


def _writers(opt) -> dict[str, Callable[[Any], Any]]:
    """The three writers of the profiler's files, each taking a path."""
    return {
        "save_profile": opt.save_profile,
        "export_chrome_trace": opt.export_chrome_trace,
        "write_html": lambda p: write_html(build_profile(opt), p),
    }


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "'': the path is empty: name a file"),
        ("adir", "{p}: is a directory, not a file: name a file in it"),
        ("afile/out.json", "{p}: {d}/afile is a file, not a directory"),
        ("afile/sub/out.json", "{p}: {d}/afile is a file, not a directory"),
    ],
    ids=["empty", "directory", "under-a-file", "deep-under-a-file"],
)
@pytest.mark.parametrize("write", ["save_profile", "export_chrome_trace", "write_html"])
def test_writers_refuse_a_bad_path_before_writing(opt, tmp_path, monkeypatch, write, name, problem):
    """save_profile, export_chrome_trace and write_html check the path as the commands do (one ValueError naming the
    path and the problem), not with the OS error of a half-made directory; nothing is written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    path = tmp_path / name if name else ""
    with pytest.raises(ValueError) as info:
        _writers(opt)[write](path)
    assert str(info.value) == problem.format(p=path, d=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"] and not any((tmp_path / "adir").iterdir())


UNWRITABLE = "/proc/kitsune-no-such-dir/out.json"
"""A path that passes the permission check as root but that nothing can be made at: /proc takes no new entries."""


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("write", ["save_profile", "export_chrome_trace", "write_html"])
def test_writers_turn_an_os_error_into_one_line(opt, write):
    """Where making the folder or the file fails although the permissions allow it (root, a read-only mount), the
    writers raise the promised one-line ValueError naming the path, the reason and the fix, not the OSError."""
    with pytest.raises(ValueError) as info:
        _writers(opt)[write](UNWRITABLE)
    assert str(info.value) == (
        f"{UNWRITABLE}: cannot create {Path(UNWRITABLE).parent} (No such file or directory): name a path in a "
        "folder this user can write"
    )


def test_a_failed_write_leaves_no_folder_or_file_behind(opt, tmp_path, monkeypatch):
    """An OSError while writing (a disk that fills up once the file is begun): the ValueError, and the folders made
    for the file are removed with the file begun."""

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    path = tmp_path / "new" / "sub" / "p.json"
    with pytest.raises(ValueError) as info:
        opt.save_profile(path)
    assert (
        str(info.value)
        == f"{path}: cannot write it (the disk is full): free some space, or name a path on another disk"
    )
    assert list(tmp_path.iterdir()) == []


def test_load_profile_tells_a_bench_result_from_a_profile(tmp_path):
    """A ``kitsune bench --json`` file given to ``kitsune report``: said to be a bench result, with what reads it, not
    "re-save the profile" (its schema_version "1" is the bench result's own)."""
    bench = {"schema_version": "1", "created": "2024-01-01T00:00:00Z", "sets": [], "copy_bandwidth_gbs": 1.0}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bench))
    with pytest.raises(ValueError) as info:
        load_profile(path)
    assert str(info.value) == (
        f"{path} is a kitsune bench --json result, not a profile: chart it with python -m kitsune.bench.plot {path} "
        "OUT.svg"
    )


def test_an_unknown_version_written_by_this_kitsune_is_not_told_to_re_save(opt, tmp_path):
    from kitsune import __version__

    data = json.loads(build_profile(opt).model_dump_json())
    data["schema_version"] = "9.9"
    assert data["environment"]["kitsune"] == __version__
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        load_profile(tmp_path / "p.json")
    message = str(info.value)
    assert f"re-save the profile with kitsune {__version__}" not in message
    assert f"yet kitsune {__version__}, this version, wrote it (it writes 1.1): the file was changed" in message


@pytest.mark.parametrize("text", ["", "\n  \n"], ids=["empty", "whitespace"])
def test_an_empty_profile_file_is_said_to_be_empty(tmp_path, capsys, text):
    path = tmp_path / "p.json"
    path.write_text(text)
    assert kitsune_main(["report", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"kitsune report: {path}: the file is empty, so not a profile JSON written by save_profile()\n"
    )


def test_export_chrome_trace_without_the_profiler_names_the_fix(tmp_path):
    m = small_model()
    plain = KitsuneOptimizer(torch.optim.AdamW(m.parameters()))
    with pytest.raises(ValueError, match=r"records no steps: build it with profile=True"):
        plain.export_chrome_trace(tmp_path / "t.json")
    with pytest.raises(TypeError, match="got object"):  # what is no optimizer at all stays a TypeError
        export_chrome_trace(object(), tmp_path / "t.json")
    assert list(tmp_path.iterdir()) == []


def test_report_refuses_to_trace_a_profile_without_steps(tmp_path, capsys):
    m = small_model()
    path = KitsuneOptimizer(torch.optim.AdamW(m.parameters())).save_profile(tmp_path / "p.json")
    assert kitsune_main(["report", str(path), "--trace", str(tmp_path / "t.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"kitsune report: --trace: {path} holds no steps to trace")
    assert "profile=True" in captured.err and not (tmp_path / "t.json").exists()


def test_print_summary_takes_a_text_file_as_its_console(opt, capsys):
    """``print_summary(console=sys.stdout)`` (or any text file) prints there; what is neither a Console nor a file is
    a TypeError naming what to pass."""
    opt.print_summary(console=sys.stdout)
    assert "kitsune summary: AdamW" in capsys.readouterr().out
    buf = io.StringIO()
    opt.print_summary(console=buf)
    assert "kitsune summary: AdamW" in buf.getvalue()
    with pytest.raises(TypeError, match="expected a rich Console or a text file such as sys.stdout, got int"):
        opt.print_summary(console=3)


def test_report_expands_home_and_prints_the_path_written(opt, tmp_path, monkeypatch, capsys):
    """``~`` in the profile, ``--html=~/...`` and ``--trace`` (a shell leaves them as they are) is the home folder:
    no ./~ folder, and the line printed names the file written."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert opt.save_profile("~/p.json") == home / "p.json"
    assert kitsune_main(["report", "~/p.json", "--html=~/r/r.html", "--trace", "~/t.json"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {home / 'r' / 'r.html'}" in out and f"wrote {home / 't.json'}" in out
    assert sorted(p.name for p in home.iterdir()) == ["p.json", "r", "t.json"] and list(work.iterdir()) == []


@pytest.mark.parametrize("flag", ["--html", "--trace"])
def test_report_refuses_an_output_that_names_a_folder(opt, tmp_path, monkeypatch, capsys, flag):
    """``--html reports/``: a folder meant, not a file named reports; refused before anything is written."""
    monkeypatch.chdir(tmp_path)
    path = opt.save_profile("p.json")
    assert kitsune_main(["report", str(path), flag, "reports/"]) == 2
    assert capsys.readouterr().err == (
        f"kitsune report: {flag} reports/: ends with '/', so it names a folder: name a file in it\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_a_comparison_said_measured_without_its_figures_is_reported_as_prose(opt, tmp_path, capsys):
    """A profile edited to say the comparison was measured, with no statistics: the schema takes it; the report and
    the HTML page print its reason instead of raising an AssertionError (exit 1, a traceback)."""
    data = json.loads(build_profile(opt).model_dump_json())
    data["metrics"]["comparison"] = {"status": "measured", "reason": "edited by hand"}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert kitsune_main(["report", str(path), "--html", str(tmp_path / "p.html")]) == 0
    assert "edited by hand" in capsys.readouterr().out
    assert (tmp_path / "p.html").exists()


def test_paths_that_are_no_paths_name_what_a_path_is(opt, tmp_path):
    with pytest.raises(ValueError, match="the path is empty"):
        load_profile("")
    with pytest.raises(TypeError, match="expected a file path .* got NoneType"):
        opt.save_profile(None)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_copy_made_mid_run_reports_its_own_run_time():
    """A deepcopy of a profiled optimizer after 5 steps goes on with the original's windows; its run time counts from
    the copy (it stayed None: the run's start was taken at the first step only)."""
    import copy

    m = small_model()
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), profile=True)
    train(m, opt, batches(5))
    twin = copy.deepcopy(opt)
    train(m, twin, batches(12))
    metrics = build_profile(twin).metrics
    assert metrics is not None and metrics.run_ms is not None and metrics.run_ms > 0
