"""The profiler end to end: a live summary, a saved profile, a Chrome trace, and an HTML report from the file.

python examples/profiler_report.py --steps 50
python examples/profiler_report.py --steps 50 --out-dir runs/profile

With ``profile=True`` the optimizer times every step (CUDA events on a GPU, the host clock on a CPU). The
example trains a small model, then writes into ``--out-dir``:

  profile.json  optimizer.save_profile(): environment, config, subsystems, plan, per-step timings
  trace.json    kitsune.profiler.trace.export_chrome_trace(): open it in chrome://tracing or ui.perfetto.dev
  report.html   what ``kitsune report profile.json --html report.html`` writes, made here by running the
                same command in-process (``kitsune.cli.main([...])``), so it is built from the saved file

On CPU the summary shows the host-clock timings, which subsystems are off and why, and that GPU telemetry
(NVML) is unavailable; on a GPU it adds the fusion plan, NVML samples and CUDA memory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
from pathlib import Path

import torch
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, output_dir, positive_int
from kitsune.cli import main as kitsune_cli
from kitsune.profiler.schema import load_profile
from kitsune.profiler.trace import export_chrome_trace


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=200)
    add_device_argument(parser)
    files = output_dir("profile.json", "trace.json", "report.html")  # checked before the run
    parser.add_argument("--out-dir", type=files, default=".", help="where the three files are written")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).to(device)
    optimizer = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        enable_fusion=device.type == "cuda",
        profile=True,
    )
    centers = torch.randn(10, 64, device=device)
    for step in range(args.steps):
        labels = torch.randint(0, 10, (128,), device=device)
        x = centers[labels] + torch.randn(128, 64, device=device)
        loss = nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")

    # 1. the live summary
    optimizer.print_summary()

    # 2. the profile and the trace
    profile_path = optimizer.save_profile(args.out_dir / "profile.json")
    trace_path = export_chrome_trace(optimizer, args.out_dir / "trace.json")
    events = json.loads(trace_path.read_text())["traceEvents"]
    steps_in_trace = sum(1 for e in events if e["ph"] == "X") // 2  # one event per step on each of two tracks
    print(f"profile: {profile_path}")
    print(f"trace:   {trace_path} (steps: {steps_in_trace}; open it in chrome://tracing or https://ui.perfetto.dev)")

    # 3. the profile read back, as the `kitsune report` command does
    profile = load_profile(profile_path)
    step_time = profile.metrics.step_time
    print(
        f"profile.json read back: steps {len(profile.steps)}, p50 step {step_time.p50_ms:.3f} ms "
        f"({profile.metrics.timing})"
    )

    html_path = args.out_dir / "report.html"
    command = ["report", str(profile_path), "--html", str(html_path)]
    print(f"the same report from the file, from the command line:\n  kitsune {shlex.join(command)}")
    print(f"and in Python, as done here:\n  kitsune.cli.main({command!r})")
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):  # it prints the summary above again, read from the file
        rc = kitsune_cli(command)
    if rc != 0:
        raise SystemExit(f"kitsune report failed ({rc}):\n{captured.getvalue()}")
    lines = captured.getvalue().splitlines()
    print(f"  -> printed the {len(lines) - 1}-line summary read back from {profile_path}, then: {lines[-1]}")
    print(f"report:  {html_path} ({html_path.stat().st_size:,} bytes, self-contained: open it in a browser)")
    return html_path


if __name__ == "__main__":
    main()
