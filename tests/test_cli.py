"""The `kitsune` command: demo, doctor, report and bench end to end, and what each refuses (one error line, exit 2)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from kitsune.cli import main
from kitsune.demo import run_demo


def test_demo_runs_and_matches_torch_on_cpu(tmp_path, capsys):
    out = tmp_path / "demo-profile.json"
    result = run_demo(steps=6, device="cpu", profile_path=out)
    assert result.max_loss_diff == 0.0  # on CPU kitsune runs the wrapped optimizer: bit-identical
    assert result.kitsune.losses[-1] < result.kitsune.losses[0]
    data = json.loads(out.read_text())
    assert data["step_count"] == 6 and len(data["steps"]) == 6


def test_demo_command_line(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["demo", "--steps", "4", "--device", "cpu", "--profile-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "torch vs kitsune" in text and "bit-identical" in text and str(out) in text.replace("\n", "")
    assert "subsystems" in text and out.exists()


def _argparse_error(capsys, argv: list[str]) -> str:
    """``kitsune ARGV`` refused by argparse: exit code 2; its stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return captured.err


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", "must be at least 1, got 0"),
        ("-3", "must be at least 1, got -3"),
        ("x", "expected a whole number of at least 1, got 'x'"),
    ],
)
def test_demo_steps_is_checked_by_argparse(capsys, value, expected):
    err = _argparse_error(capsys, ["demo", "--steps", value])
    assert err.splitlines()[-1] == f"kitsune demo: error: argument --steps: {expected}"


@pytest.mark.parametrize("flag", ["--steps", "--warmup", "--e2e-steps", "--e2e-batch"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_bench_counts_are_checked_by_argparse(capsys, flag, value):
    err = _argparse_error(capsys, ["bench", flag, value])
    assert err.splitlines()[-1] == f"kitsune bench: error: argument {flag}: must be at least 1, got {value}"


@pytest.mark.parametrize("command", ["demo", "bench"])
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("99999999999999999999999", "must be from -2**63 to 2**64 - 1 (torch.manual_seed's range), got 9999"),
        ("1.5", "expected a whole number, got '1.5'"),
    ],
)
def test_a_seed_torch_cannot_take_is_an_argparse_error(capsys, command, value, expected):
    err = _argparse_error(capsys, [command, "--seed", value])
    assert err.splitlines()[-1].startswith(f"kitsune {command}: error: argument --seed: {expected}")


def test_bench_scale_that_is_not_a_number_is_an_argparse_error(capsys):
    err = _argparse_error(capsys, ["bench", "--scale", "half"])
    assert err.splitlines()[-1] == "kitsune bench: error: argument --scale: expected a number in (0, 1], got 'half'"


def test_demo_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED seed of the model's init and the synthetic batches (default 0)" in text


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (
            ["demo"],
            [
                "Train a tiny GPT",
                "--profile-out PROFILE_OUT where to write the profile JSON (default kitsune-profile.json)",
            ],
        ),
        (["doctor"], ["Report what this machine supports"]),
        (["report"], ["Read a profile JSON written by save_profile()", "--trace a Chrome trace"]),
        (
            ["bench"],
            [
                "smoke test of the command, not a comparison",
                "--sets SETS comma-separated, of gpt2,many,llama1b,resnet50 (default: all)",
            ],
        ),
    ],
    ids=["demo", "doctor", "report", "bench"],
)
def test_help_describes_the_command_and_its_defaults(capsys, monkeypatch, command, says):
    """Each command's ``--help`` has a description under its usage line, and options with a default state it."""
    monkeypatch.setenv("COLUMNS", "400")  # argparse would wrap kitsune-profile.json after its hyphen
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.split("\n\n")[1].strip(), "no description between the usage and the options"
    flat = " ".join(text.split())
    for phrase in says:
        assert phrase in flat


def test_version_names_kitsune_torch_and_triton(capsys):
    import torch

    import kitsune

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    try:
        triton = f"triton {version('triton')}"
    except PackageNotFoundError:
        triton = "triton not installed"
    assert capsys.readouterr().out == f"kitsune {kitsune.__version__} (torch {torch.__version__}, {triton})\n"


@pytest.mark.parametrize("argv", [["--bogus"], ["--bogus", "doctor"]])
def test_an_unknown_option_is_named(capsys, argv):
    """``kitsune --bogus``: argparse names the option, before the command too, not a missing command."""
    err = _argparse_error(capsys, argv)
    assert err.splitlines()[-1] == "kitsune: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize(
    "argv",
    [["demo", "--bogus"], ["doctor", "--bogus"], ["report", "p.json", "--bogus"], ["bench", "--bogus", "3"]],
    ids=["demo", "doctor", "report", "bench"],
)
def test_an_unknown_option_after_the_command_is_the_commands_error(capsys, argv):
    """After the command, an unknown option is refused with that command's usage and name, as its own options are."""
    err = _argparse_error(capsys, argv)
    command, unknown = argv[0], " ".join(a for a in argv[1:] if a != "p.json")
    assert err.startswith(f"usage: kitsune {command} ")
    assert err.splitlines()[-1] == f"kitsune {command}: error: unrecognized arguments: {unknown}"


def test_no_command_is_still_an_error(capsys):
    err = _argparse_error(capsys, [])
    assert err.splitlines()[-1] == "kitsune: error: the following arguments are required: command"


def test_commands_print_no_numpy_warning():
    """torch warns "Failed to initialize NumPy" on import when NumPy is missing, so NumPy is a dependency."""
    for argv in (["--help"], ["--version"]):
        proc = subprocess.run([sys.executable, "-m", "kitsune", *argv], capture_output=True, text=True, check=True)
        assert "NumPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


def test_doctor_reports_machine_and_subsystems(capsys):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    for word in ("torch", "CUDA", "Triton", "NVML", "fusion", "profiler"):
        assert word in text


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "kitsune", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in proc.stdout and "doctor" in proc.stdout


def test_demo_refuses_cuda_without_a_gpu(monkeypatch, capsys):
    """``--device cuda`` where torch sees no GPU: an argparse error naming the fix, not torch's traceback."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(SystemExit) as info:
            main(["demo", "--steps", "1", "--device", device])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "kitsune demo: error: argument --device:" in err and "no CUDA GPU" in err
        assert "--device cpu" in err and "--device auto" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        main(["demo", "--device", "gpu"])
    assert info.value.code == 2
    assert "choose auto, cpu, cuda or cuda:N" in capsys.readouterr().err


def _write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d, "is a directory, not a profile JSON written by save_profile()"),
        (lambda d: d / "missing.json", "missing.json: no such file"),
        (lambda d: _write_bytes(d / "p.json", b'{"schema_version": "\xff"}'), "is not UTF-8 text"),
        (lambda d: _write_bytes(d / "p.json", b"schema_version: 1.0\n"), "is not JSON (expected value"),
        (
            lambda d: _write_bytes(d / "p.json", b'{"schema_version": "1.1", "steps": [{"st'),
            "is not JSON (EOF while parsing a string at line 1 column 40): the file ends too soon, as a copy or a "
            "download cut short leaves it",
        ),
        (lambda d: _write_bytes(d / "p.json", b"[1, 2]"), "its top level is not an object"),
        (
            lambda d: _write_bytes(d / "p.json", b'{"schema_version": "0.9", "environment": {"kitsune": "0.0.1"}}'),
            "schema_version '0.9' is not one this kitsune reads (1.0, 1.1); written by kitsune 0.0.1: re-save the "
            "profile",
        ),
        (
            lambda d: _write_bytes(d / "p.json", b'{"schema_version": "2.0", "environment": {"kitsune": "9.0.0"}}'),
            "schema_version '2.0' is not one this kitsune reads (1.0, 1.1): a newer kitsune wrote it (9.0.0): "
            "install that kitsune or a newer one to read it (git pull in your clone, then pip install .)",
        ),
        (lambda d: _write_bytes(d / "p.json", b'{"schema_version": 1.1}'), "schema_version is 1.1 (float): a string"),
        (lambda d: _write_bytes(d / "p.json", b'{"schema_version": "1.0"}'), "is not a kitsune profile: created:"),
        (
            lambda d: _write_bytes(d / "t.json", b'{"traceEvents": [], "displayTimeUnit": "ms"}'),
            "t.json is a Chrome trace, not a profile: open it in Perfetto",
        ),
    ],
    ids=[
        "directory",
        "missing",
        "not-utf8",
        "not-json",
        "cut-short",
        "not-an-object",
        "old-schema",
        "newer-schema",
        "version-not-a-string",
        "missing-fields",
        "trace",
    ],
)
def test_report_names_what_is_wrong_with_the_file(tmp_path, capsys, make, expected):
    """``kitsune report PATH`` on what is not a profile: one error line naming the problem, exit code 2."""
    path = make(tmp_path)
    assert main(["report", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"kitsune report: {path}") and captured.err.count("\n") == 1
    assert expected in captured.err


@pytest.fixture
def profile_json(tmp_path):
    """A saved profile of three CPU steps."""
    import torch

    from kitsune import KitsuneOptimizer

    model = torch.nn.Linear(4, 2)
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters()), profile=True)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt.save_profile(tmp_path / "p.json")


@pytest.mark.parametrize("edit", ["buckets", "elements", "nan"])
def test_report_of_a_profile_edited_by_hand_is_one_line(profile_json, tmp_path, capsys, edit):
    """The schema leaves the plan's contents free and took nan for a step time: a profile edited by hand (or by
    another tool) that passed the checks ended in a traceback from the summary or the HTML. One line, exit 2."""
    import json

    data = json.loads(profile_json.read_text())
    if edit == "buckets":
        data["plan"] = {"buckets": "x"}
    elif edit == "elements":
        data["plan"] = {"buckets": [{"elements": "abc", "route": "triton"}]}
    else:
        data["steps"][0]["step_ms"] = float("nan")
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    assert main(["report", str(path), "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kitsune report: {path}") and err.count("\n") == 1
    assert "Traceback" not in err


def _deny_writes_to(monkeypatch, directory: Path) -> None:
    """``directory`` read-only: chmod, and os.access emulating it (root passes every permission check)."""
    directory.chmod(0o500)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != directory)


BAD_OUTPUTS = {
    "directory": ("adir", None, "{p}: is a directory, not a file: name a file in it"),
    "under-a-file": ("afile/out.json", None, "{p}: {d}/afile is a file, not a directory"),
    "deep-under-a-file": ("afile/sub/out.json", None, "{p}: {d}/afile is a file, not a directory"),
    "file-not-writable": (
        "afile",
        "afile",
        "{p}: is not writable (permission denied): name a path this user can write",
    ),
    "parent-not-writable": (
        "adir/out.json",
        "adir",
        "{p}: cannot create it in {d}/adir (permission denied): name a path in a folder this user can write",
    ),
    "parents-not-writable": (
        "adir/new/out.json",
        "adir",
        "{p}: cannot create its directories in {d}/adir (permission denied): name a path in a folder this user "
        "can write",
    ),
}
"""kind -> (the output path, the path made read-only or None, the problem), paths under the work directory."""
COMMANDS = {
    "demo": (["demo", "--steps", "1", "--device", "cpu", "--profile-out"], "kitsune demo: --profile-out"),
    "report-html": (["report", "{profile}", "--html"], "kitsune report: --html"),
    "report-trace": (["report", "{profile}", "--trace"], "kitsune report: --trace"),
    "bench": (["bench", "--device", "cpu", "--sets", "gpt2", "--steps", "1", "--json"], "kitsune bench: --json"),
    "bench-muon": (["bench", "--muon", "--json"], "kitsune bench: --json"),
}


@pytest.mark.parametrize("kind", BAD_OUTPUTS)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_output_path_is_one_line_before_any_work(tmp_path, profile_json, capsys, monkeypatch, command, kind):
    """Every output path is checked first: one line naming the option, the path and the problem; exit code 2."""
    work = tmp_path / "work"
    (work / "adir").mkdir(parents=True)
    (work / "afile").write_text("")
    name, read_only, problem = BAD_OUTPUTS[kind]
    path = work / name
    if read_only is not None:
        _deny_writes_to(monkeypatch, work / read_only)
    argv, prefix = COMMANDS[command]
    assert main([a.format(profile=profile_json) for a in argv] + [str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran: no demo banner, no bench table, no summary
    assert captured.err == f"{prefix} {problem.format(p=path, d=work)}\n"
    assert sorted(p.name for p in work.iterdir()) == ["adir", "afile"] and not any((work / "adir").iterdir())


UNWRITABLE = "/proc/kitsune-no-such-dir/out.json"
"""A path that passes the permission check as root but that nothing can be made at: /proc takes no new entries."""


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_that_cannot_be_made_is_one_line_before_any_work(profile_json, capsys, command):
    """A path the permission check passes but where the folder or the file cannot be made (root, a read-only mount):
    found by making them before any work, not by a traceback at the end of the run."""
    argv, prefix = COMMANDS[command]
    assert main([a.format(profile=profile_json) for a in argv] + [UNWRITABLE]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"{prefix} {UNWRITABLE}: cannot create {Path(UNWRITABLE).parent} (No such file or directory): name a path "
        "in a folder this user can write\n"
    )


def test_the_output_check_leaves_nothing_behind(tmp_path, monkeypatch):
    """The check makes the missing folders and the file, then removes them, whether the file could be made or not;
    an existing file is left as it was."""
    from kitsune._paths import check_output_path

    path = tmp_path / "new" / "sub" / "out.json"
    assert check_output_path(path) == path and list(tmp_path.iterdir()) == []
    (tmp_path / "old.json").write_text("kept")
    assert check_output_path(tmp_path / "old.json") == tmp_path / "old.json"
    assert (tmp_path / "old.json").read_text() == "kept"

    real_open = os.open

    def read_only(file, *args, **kwargs):  # the file next to the output, which the check makes and removes
        if Path(file).parent == path.parent:
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ValueError) as info:
        check_output_path(path)
    assert str(info.value) == f"{path}: cannot write it (read-only file system): name a path on a writable disk"
    assert [p.name for p in tmp_path.iterdir()] == ["old.json"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--html", "{profile}"], "--html {profile}: is the profile itself: name another file"),
        (["--trace", "{profile}"], "--trace {profile}: is the profile itself: name another file"),
        (["--html", "{dir}/r", "--trace", "{dir}/r"], "--trace {dir}/r: is the --html file too: name another file"),
    ],
    ids=["html-over-profile", "trace-over-profile", "trace-over-html"],
)
def test_report_writes_no_file_over_another(profile_json, capsys, argv, expected):
    before = profile_json.read_text()
    fill = {"profile": profile_json, "dir": profile_json.parent}
    assert main(["report", str(profile_json), *(a.format(**fill) for a in argv)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"kitsune report: {expected.format(**fill)}\n"
    assert profile_json.read_text() == before and not (profile_json.parent / "r").exists()


def test_report_makes_missing_directories_of_its_outputs(profile_json, capsys):
    html, trace = profile_json.parent / "a" / "b" / "r.html", profile_json.parent / "c" / "t.json"
    assert main(["report", str(profile_json), "--html", str(html), "--trace", str(trace)]) == 0
    assert html.read_text().startswith("<!DOCTYPE html>") and json.loads(trace.read_text())


@pytest.mark.parametrize("command", ["demo", "bench", "bench-muon"])
def test_an_empty_output_path_is_said_to_be_empty(capsys, command):
    """``--profile-out ''`` / ``--json ''``: the path is empty (not ".: is a directory", what Path("") reads as)."""
    argv, prefix = COMMANDS[command]
    assert main([*argv, ""]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"{prefix} '': the path is empty: name a file\n"


def test_demo_of_one_step_counts_it_as_one(tmp_path, capsys, monkeypatch):
    """ "1 step", not "1 steps", in the demo's lines and the summary it prints; "~" in --profile-out is the home
    folder, and the line printed names the file written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["demo", "--steps", "1", "--device", "cpu", "--profile-out", "~/p.json"]) == 0
    text = capsys.readouterr().out
    assert "1 steps" not in text and "on cpu, 1 step, AdamW" in text and "(1 step each)" in text
    assert "29 params, 1 step\n" in text and "step time (1 step timed, host clock)" in text
    assert f"profile written to {tmp_path / 'p.json'}" in text and (tmp_path / "p.json").is_file()
    shown = text.split("read it again, or as an HTML report: ")[1].split()  # a command that reads it back
    assert shown[-4:] == ["report", str(tmp_path / "p.json"), "--html", "kitsune-report.html"]
    again = [*shown[shown.index("report") : -1], str(tmp_path / "r.html")]  # not into the working folder
    assert main(again) == 0 and (tmp_path / "r.html").is_file()


def test_an_interrupted_demo_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C during the demo: one line and exit code 130, as kitsune bench; the profile, saved last and whole, is
    not there."""
    import kitsune.demo

    def interrupted(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kitsune.demo, "run_demo", interrupted)
    assert main(["demo", "--profile-out", str(tmp_path / "p.json")]) == 130
    assert capsys.readouterr().err == f"kitsune demo: interrupted ({tmp_path / 'p.json'} was not written)\n"
    assert not (tmp_path / "p.json").exists()
    (tmp_path / "p.json").write_text("older")
    assert main(["demo", "--profile-out", str(tmp_path / "p.json")]) == 130
    assert (
        capsys.readouterr().err
        == f"kitsune demo: interrupted (the profile already at {tmp_path / 'p.json'} is as it was)\n"
    )
    assert (tmp_path / "p.json").read_text() == "older"


def test_doctor_says_why_nvml_is_missing_once(capsys, monkeypatch):
    """The NVML row reads "no (nvmlInit failed: ...)", not "no NVML unavailable: ..."."""
    import types

    def fail() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=fail))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "no (nvmlInit failed: NVML Shared Library Not Found)" in text and "NVML unavailable" not in text
