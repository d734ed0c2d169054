"""Every example runs on CPU in seconds with a small --steps, and does what its docstring says.

The new examples are pinned to ``--device cpu`` here, so the checks hold on a GPU machine too: on CPU every update
goes through the wrapped torch optimizer, which is what makes the bit-identical checks exact.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FUSION_OFF_ON_CPU = pytest.mark.filterwarnings("ignore:kitsune. fusion was asked for but is inactive:UserWarning")
LIGHTNING_PYTREE = pytest.mark.filterwarnings(
    "ignore:`isinstance.treespec, LeafSpec.` is deprecated"
)  # Lightning's own


def needs(package: str) -> pytest.MarkDecorator:
    """Skip, with the install line as the reason, where an integration example's package is not installed
    (``make test`` installs both: they are in the ``dev`` extra)."""
    missing = importlib.util.find_spec(package) is None
    return pytest.mark.skipif(missing, reason=f"{package} is not installed: pip install -e '.[dev]' (or {package})")


NEEDS_LIGHTNING, NEEDS_ACCELERATE = needs("lightning"), needs("accelerate")


def first_last_loss(out: str) -> tuple[float, float]:
    """The example's own "loss (mean of k steps): first A -> last B" line."""
    m = re.search(r"loss \(mean of \d+ (?:steps?|micro-batch(?:es)?)\): first ([\d.]+) -> last ([\d.]+)", out)
    assert m, out
    return float(m[1]), float(m[2])


def check_basic(out: str, tmp: Path) -> None:
    assert "loss" in out and "profile:" in out
    assert any(tmp.glob("*.json"))


def check_amp_float16(out: str, tmp: Path) -> None:
    first, last = first_last_loss(out)
    assert last < 0.5 * first
    assert "forward output dtype torch.float16" in out
    # the injected overflow: that step was skipped, nothing moved, and the scale backed off once
    assert "update skipped (params unchanged: True), loss scale 65536 -> 32768" in out
    assert re.search(r"loss scale 32768, skipped steps 1, host syncs in step\(\) \d+", out)
    assert "on CPU:" in out and "reads the inf/nan flag on the host once per step" in out
    assert "kitsune summary" in out and "dtype: float16" in out


def check_amp_bfloat16(out: str, tmp: Path) -> None:
    first, last = first_last_loss(out)
    assert last < 0.5 * first
    assert "forward output dtype torch.bfloat16" in out
    assert "loss scale 1, skipped steps 0, host syncs in step() 0" in out
    assert "kitsune summary" in out and "dtype: bfloat16" in out


def check_checkpoint_resume(out: str, tmp: Path) -> None:
    assert (tmp / "ckpt-kitsune.pt").is_file() and (tmp / "ckpt-torch.pt").is_file()
    m = re.search(r"loss ([\d.]+) -> ([\d.]+)", out)
    assert m and float(m[2]) < float(m[1])
    diffs = dict(re.findall(r"^  (\S.*?)\s+(\d\.\d{3}e[+-]\d+)  ", out, flags=re.M))
    assert set(diffs) == {
        "plain torch, uninterrupted",
        "(a) kitsune ckpt -> KitsuneOptimizer",
        "(b) kitsune ckpt -> torch.optim.AdamW",
        "(c) torch ckpt -> KitsuneOptimizer",
    }, out
    # on CPU every update goes through torch's AdamW: a resumed run is the uninterrupted run, bit for bit
    assert all(float(d) == 0.0 for d in diffs.values()), diffs
    ckpt = torch.load(tmp / "ckpt-kitsune.pt")
    assert set(ckpt) == {"model", "optimizer", "scheduler", "step"}
    assert ckpt["optimizer"]["kitsune"]["step_count"] == ckpt["step"] == 6


def check_profiler_report(out: str, tmp: Path) -> None:
    assert "kitsune summary" in out and "step time" in out
    profile = json.loads((tmp / "profile.json").read_text())
    assert profile["step_count"] == 8 and len(profile["steps"]) == 8
    trace = json.loads((tmp / "trace.json").read_text())
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(steps) == 2 * 8  # a device track and a host track
    html = (tmp / "report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "<svg" in html
    assert "kitsune report profile.json --html report.html" in out
    assert "wrote report.html" in out


def check_lion(out: str, tmp: Path) -> None:
    first, last = first_last_loss(out)
    assert last < first
    assert "kitsune fusion plan" in out and "Lion float32" in out
    assert "-> base_step: CPU tensors" in out
    assert "max |param diff| vs the unwrapped Lion: 0.000e+00 (bit-identical)" in out


def check_muon(out: str, tmp: Path) -> None:
    first, last = first_last_loss(out)
    assert last < 0.5 * first
    assert "kitsune fusion plan" in out and "Muon float32 cpu: 28 tensors -> base_step: CPU tensors" in out
    assert "max |param diff| vs the unwrapped Muon: 0.000e+00 (bit-identical)" in out
    assert "kitsune summary: Muon, 2 param group(s), 28 params, 20 steps" in out


def check_lightning(out: str, tmp: Path) -> None:
    assert "Lightning's optimizer: KitsuneOptimizer wrapping AdamW" in out
    assert "kitsune steps 10, trainer.global_step 10" in out
    assert (tmp / "lightning.ckpt").is_file() and "loads into a plain AdamW (kitsune key: True)" in out
    assert "max |param diff| vs the same run with the plain AdamW: 0.000e+00 (bit-identical)" in out
    assert "kitsune summary: AdamW" in out and "10 steps" in out


def check_lightning_fp32(out: str, tmp: Path) -> None:
    check_lightning(out, tmp)
    assert "GradScaler" not in out and "clipped in the step" not in out and "the step times include them" in out


def check_lightning_fp16(out: str, tmp: Path) -> None:
    check_lightning(out, tmp)
    assert re.search(r"Lightning's GradScaler drove the step: loss scale now \d+", out)


def check_lightning_fp16_kitsune_clip(out: str, tmp: Path) -> None:
    check_lightning_fp16(out, tmp)
    assert re.search(r"kitsune clipped in the step: the last step's grad norm \d", out)


def check_accelerate(out: str, tmp: Path) -> None:
    first, last = first_last_loss(out)
    assert last < first
    assert "prepared optimizer: AcceleratedOptimizer around KitsuneOptimizer" in out
    assert "micro-batches 24, accumulation 2, kitsune steps 12" in out
    assert (tmp / "accelerate-state" / "optimizer.bin").is_file() and "(kitsune key: True)" in out
    assert "max |param diff| vs the same loop with the plain AdamW: 0.000e+00 (bit-identical)" in out
    assert "kitsune summary: AdamW" in out


def check_ddp(out: str, tmp: Path) -> None:
    first, last = first_last_loss(out)
    assert last < first
    for rank in (0, 1):
        assert f"rank {rank}/2: backend gloo, device cpu" in out
        assert re.search(rf"^rank {rank}: 5 steps, max \|param diff\| vs rank 0: 0\.000e\+00, moved [1-9]", out, re.M)
    assert "params on all 2 ranks after 5 steps: identical" in out


def check_fsdp2(out: str, tmp: Path) -> None:
    first, last = first_last_loss(out)
    assert last < first
    for rank in (0, 1):
        assert f"rank {rank}/2: backend gloo, device cpu, 0 shards fused (CPU tensors" in out
        assert re.search(rf"^rank {rank}: 5 steps, max \|param diff\| vs rank 0: 0\.000e\+00, moved [1-9]", out, re.M)
    assert "exp_avg DTensor[Shard(dim=0)], exp_avg_sq DTensor[Shard(dim=0)], step Tensor[]" in out
    assert "full params on all 2 ranks after 5 steps: identical" in out


def check_zero(out: str, tmp: Path) -> None:
    first, last = first_last_loss(out)
    assert last < first
    shares = []
    for rank in (0, 1):
        assert re.search(rf"^rank {rank}/2: backend gloo, device cpu, kitsune subsystems active: .*shard", out, re.M)
        agree = rf"^rank {rank}: 5 steps, max \|param diff\| vs rank 0: 0\.000e\+00, moved [1-9]"
        m = re.search(agree + r".*optimizer state (\d+) of", out, re.M)
        assert m, out
        shares.append(int(m[1]))
    assert "params on all 2 ranks after 5 steps: identical" in out
    m = re.search(r"consolidated state dict: 12 params, (\d+) elements, loaded into torch.optim.AdamW", out)
    assert m and sum(shares) == int(m[1]) and max(shares) < 0.6 * int(m[1])


# Lightning's AMP plugin refuses gradient_clip_val for optimizers that unscale in their own step
CASES = [
    pytest.param("basic.py", ["--steps", "20"], check_basic, id="basic"),
    pytest.param(
        "amp.py",
        ["--steps", "16", "--device", "cpu", "--dtype", "float16", "--overflow-at", "8"],
        check_amp_float16,
        id="amp-float16",
    ),
    pytest.param(
        "amp.py", ["--steps", "16", "--device", "cpu", "--dtype", "bfloat16"], check_amp_bfloat16, id="amp-bf16"
    ),
    pytest.param("checkpoint_resume.py", ["--steps", "12", "--device", "cpu"], check_checkpoint_resume, id="ckpt"),
    pytest.param("profiler_report.py", ["--steps", "8", "--device", "cpu"], check_profiler_report, id="profiler"),
    pytest.param("lion.py", ["--steps", "20", "--device", "cpu"], check_lion, id="lion", marks=FUSION_OFF_ON_CPU),
    pytest.param("muon.py", ["--steps", "20", "--device", "cpu"], check_muon, id="muon", marks=FUSION_OFF_ON_CPU),
    pytest.param(
        "lightning_example.py",
        ["--steps", "10", "--device", "cpu"],
        check_lightning_fp32,
        id="lightning",
        marks=[LIGHTNING_PYTREE, NEEDS_LIGHTNING],
    ),
    pytest.param(
        "lightning_example.py",
        ["--steps", "10", "--device", "cpu", "--precision", "16-mixed", "--clip", "hook"],
        check_lightning_fp16,
        id="lightning-fp16-clip-hook",
        marks=[LIGHTNING_PYTREE, NEEDS_LIGHTNING],
    ),
    pytest.param(
        "lightning_example.py",
        ["--steps", "10", "--device", "cpu", "--precision", "16-mixed", "--clip", "kitsune"],
        check_lightning_fp16_kitsune_clip,
        id="lightning-fp16-clip-kitsune",
        marks=[LIGHTNING_PYTREE, NEEDS_LIGHTNING],
    ),
    pytest.param(  # the default clip under mixed precision: kitsune's, in the step
        "lightning_example.py",
        ["--steps", "10", "--device", "cpu", "--precision", "16-mixed"],
        check_lightning_fp16_kitsune_clip,
        id="lightning-fp16-default-clip",
        marks=[LIGHTNING_PYTREE, NEEDS_LIGHTNING],
    ),
    pytest.param(
        "accelerate_example.py",
        ["--steps", "12", "--device", "cpu"],
        check_accelerate,
        id="accelerate",
        marks=NEEDS_ACCELERATE,
    ),
    pytest.param(
        "accelerate_example.py",
        ["--steps", "12", "--device", "cpu", "--mixed-precision", "bf16"],
        check_accelerate,
        id="accelerate-bf16",
        marks=NEEDS_ACCELERATE,
    ),
]

# examples that need several processes: run through torchrun in a subprocess
GLOO_EXIT_ABORT = "terminate called without an active exception"
TORCHRUN_CASES = [
    pytest.param("ddp.py", ["--steps", "5", "--device", "cpu"], check_ddp, id="ddp"),
    pytest.param("fsdp2.py", ["--steps", "5", "--device", "cpu"], check_fsdp2, id="fsdp2"),
    pytest.param("zero.py", ["--steps", "5", "--device", "cpu"], check_zero, id="zero"),
]


@pytest.mark.parametrize("name, args, check", CASES)
def test_example_runs(name, args, check, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [name, *args])
    environ = dict(os.environ)  # Lightning's seed_everything sets PL_GLOBAL_SEED
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        if "accelerate.state" in sys.modules:  # Accelerate keeps one process-wide state; the next case sets its own
            sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)
    check(capsys.readouterr().out, tmp_path)


@NEEDS_LIGHTNING
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_clipping_under_mixed_precision_is_a_usage_error(precision, tmp_path, monkeypatch, capsys):
    """KitsuneOptimizer unscales in its step (``_step_supports_amp_scaling = True``, as torch's fused AdamW), so
    Lightning's MixedPrecision refuses to clip for it, with a traceback after the trainer started: the example
    refuses ``--clip lightning`` under mixed precision before anything runs, naming the two ways that work."""
    monkeypatch.chdir(tmp_path)
    args = ["--steps", "3", "--device", "cpu", "--precision", precision, "--clip", "lightning"]
    monkeypatch.setattr(sys, "argv", ["lightning_example.py", *args])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(EXAMPLES / "lightning_example.py"), run_name="__main__")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--clip lightning works with --precision 32-true only" in err and "--clip kitsune or --clip hook" in err


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch was built without torch.distributed")
@pytest.mark.parametrize("name, args, check", TORCHRUN_CASES)
def test_example_runs_under_torchrun(name, args, check, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLES / name)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and GLOO_EXIT_ABORT in proc.stderr:
        # gloo's teardown race (pytorch/pytorch#65237): a rank aborts while the interpreter exits, after the example
        # finished and destroyed its process group; rare on a loaded machine. One more run must exit cleanly.
        proc = subprocess.run([*cmd, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    check(proc.stdout, tmp_path)


STEP_COUNTS = [
    pytest.param(
        path.name,
        marks={"lightning_example.py": NEEDS_LIGHTNING, "accelerate_example.py": NEEDS_ACCELERATE}.get(path.name, ()),
        id=path.stem,
    )
    for path in sorted(EXAMPLES.glob("*.py"))
    if '"--steps"' in path.read_text()
]


@pytest.mark.parametrize("value", ["0", "-5"])
@pytest.mark.parametrize("name", STEP_COUNTS)
def test_a_step_count_below_one_is_an_argparse_error(name, value, tmp_path, monkeypatch, capsys):
    """``--steps 0``: argparse's usage and one error line, before any training (not an error from a loop that never
    ran)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [name, "--steps", value])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and list(tmp_path.iterdir()) == []
    assert captured.err.splitlines()[-1] == f"{name}: error: argument --steps: must be at least 1, got {value}"


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is a valid --device here")
BAD_ARGUMENTS = [
    pytest.param("amp.py", ["--device", "gpu"], "--device: choose auto, cpu, cuda or cuda:N", id="amp-gpu"),
    pytest.param("lion.py", ["--device", "cuda"], "--device: cuda asked for, but torch", id="lion-cuda", marks=NO_GPU),
    pytest.param("ddp.py", ["--device", "cuda"], "--device: cuda asked for, but torch", id="ddp-cuda", marks=NO_GPU),
    pytest.param("basic.py", ["--profile-out", "adir"], "--profile-out: adir: is a directory", id="basic-folder"),
    pytest.param("basic.py", ["--profile-out", "out/"], "--profile-out: out/: ends with '/'", id="basic-slash"),
    pytest.param(
        "profiler_report.py",
        ["--out-dir", "/proc/kitsune-no-such-dir"],
        "--out-dir: /proc/kitsune-no-such-dir/profile.json: cannot create /proc/kitsune-no-such-dir",
        id="profiler-proc",
        marks=pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc"),
    ),
    pytest.param(
        "checkpoint_resume.py",
        ["--out-dir", "afile"],
        "--out-dir: afile/ckpt-kitsune.pt: afile is a file, not a directory",
        id="ckpt-file",
    ),
    pytest.param(
        "amp.py",
        ["--steps", "10", "--overflow-at", "10"],
        "--overflow-at: 10 is not a step of this run: take one from 0 to 9",
        id="amp-overflow-late",
    ),
    pytest.param("amp.py", ["--overflow-at", "-1"], "--overflow-at: -1 is not a step", id="amp-overflow-negative"),
    pytest.param(
        "lightning_example.py",
        ["--clip-val", "-1"],
        "--clip-val: must be a finite number greater than 0, got -1",
        id="lightning-clip-negative",
        marks=NEEDS_LIGHTNING,
    ),
    pytest.param(
        "lightning_example.py",
        ["--clip-val", "nan"],
        "--clip-val: must be a finite number greater than 0, got nan",
        id="lightning-clip-nan",
        marks=NEEDS_LIGHTNING,
    ),
]


@pytest.mark.parametrize("name, args, problem", BAD_ARGUMENTS)
def test_a_bad_argument_is_one_error_line_before_any_training(name, args, problem, tmp_path, monkeypatch, capsys):
    """A ``--device`` torch cannot use and an output nothing can be written at are refused by argparse, through the
    ``kitsune`` commands' own checks: usage and one error line, exit code 2, nothing trained or written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(sys, "argv", [name, "--steps", "2", *args])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.splitlines()[-1].startswith(f"{name}: error: argument {problem}"), captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"] and not any((tmp_path / "adir").iterdir())


def test_a_mean_of_one_step_is_one_step(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["amp.py", "--steps", "2", "--device", "cpu", "--dtype", "bfloat16"])
    runpy.run_path(str(EXAMPLES / "amp.py"), run_name="__main__")
    assert "loss (mean of 1 step): first" in capsys.readouterr().out


def test_every_example_is_tested_and_documented():
    tested = {p.values[0] for p in (*CASES, *TORCHRUN_CASES)}
    listed = (EXAMPLES.parent / "docs" / "quickstart.md").read_text()
    for path in sorted(EXAMPLES.glob("*.py")):
        assert f"`examples/{path.name}`" in listed, f"{path.name} is not in docs/quickstart.md's list of examples"
        assert path.name in tested, f"{path.name} has no case in tests/test_examples.py"
        source = path.read_text()
        doc = runpy.run_path(str(path), run_name="not_main").get("__doc__") or ""
        how = rf"^(python|torchrun)\b.* examples/{re.escape(path.name)}\b"
        assert re.search(how, doc, re.M), f"{path.name}: the docstring should say how to run it"
        if path.name != "basic.py":
            has_device = '"--device"' in source or "add_device_argument(" in source
            assert '"--steps"' in source and has_device, f"{path.name}: --steps and --device"


WRITES = re.compile(r'out_dir / "([^"]+)"|"--profile-out", default="([^"]+)"')


def test_what_the_examples_write_is_ignored_by_git():
    """Each file or folder an example writes by default (into the current directory, the repository's root as the
    docs run them) is in .gitignore, so running the examples leaves ``git status`` clean."""
    if shutil.which("git") is None or not (EXAMPLES.parent / ".git").exists():
        pytest.skip("not a git checkout")
    written = {a or b for path in sorted((EXAMPLES).glob("*.py")) for a, b in WRITES.findall(path.read_text())}
    assert {"basic-profile.json", "ckpt-torch.pt", "trace.json", "accelerate-state"} <= written, written
    # NAME/x: ignored when NAME is, whether .gitignore names a file or a folder (a folder's pattern ends in "/")
    paths = [f"{name}/x" for name in sorted(written)]
    cmd = ["git", "check-ignore", "--no-index", *paths]
    proc = subprocess.run(cmd, cwd=EXAMPLES.parent, capture_output=True, text=True)
    assert sorted(proc.stdout.split()) == paths, f"not in .gitignore: {sorted(set(paths) - set(proc.stdout.split()))}"
