"""kitsune._paths: output files are written atomically (a failed write keeps the old file), ``~`` is expanded, and
what cannot be written is one line naming what happened and the fix."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kitsune._paths import check_output_path, write_output


def _fail(monkeypatch, exc: BaseException) -> None:
    """The write fails once the new file is begun: where a full disk shows (a flush, an fsync)."""

    def fsync(fd):
        raise exc

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_save_past_the_file_size_limit_keeps_the_old_profile(tmp_path):
    """A real failed write (RLIMIT_FSIZE, in a subprocess): one line saying what happened and the fix, the complete
    profile saved before is kept as it was, and no temporary file is left in its folder."""
    script = textwrap.dedent(
        """
        import resource, sys, torch
        from kitsune import KitsuneOptimizer

        model = torch.nn.Linear(4, 2)
        opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters()), profile=True)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.save_profile(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))  # the profile is larger
        try:
            opt.save_profile(sys.argv[1])
        except ValueError as exc:
            print(exc)
        """
    )
    path = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        f"{path}: cannot write it (the file is too large for this disk or this process's file size limit (ulimit -f); "
        "the existing file is unchanged): name a path on another disk, or raise the limit\n"
    )
    assert json.loads(path.read_text())["step_count"] == 1  # whole, not truncated at 512 bytes
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


@pytest.mark.parametrize(
    ("error", "because"),
    [
        (errno.ENOSPC, "the disk is full; the existing file is unchanged): free some space, or name a path on another"),
        (errno.EACCES, "permission denied; the existing file is unchanged): name a path in a folder this user can"),
        (errno.EIO, "Input/output error; the existing file is unchanged): name a path in a folder this user can"),
    ],
    ids=["disk-full", "permission", "other"],
)
def test_a_failed_write_says_what_happened_and_keeps_the_old_file(tmp_path, monkeypatch, error, because):
    path = tmp_path / "out.json"
    path.write_text('{"complete": true}')
    _fail(monkeypatch, OSError(error, os.strerror(error)))
    with pytest.raises(ValueError) as info:
        write_output(path, '{"complete": false, "more": "x"}')
    assert str(info.value).startswith(f"{path}: cannot write it ({because}")
    assert path.read_text() == '{"complete": true}' and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_an_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    """Ctrl-C in the middle of a write: the KeyboardInterrupt goes on, the old file and its folder stay as they were,
    the new file is removed."""
    path = tmp_path / "out.json"
    path.write_text("old")
    _fail(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        write_output(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_write_replaces_the_file_and_keeps_its_mode_and_links(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    path.chmod(0o640)
    assert write_output(path, "new") == path and path.read_text() == "new"
    assert path.stat().st_mode & 0o777 == 0o640
    link = tmp_path / "link.json"
    link.symlink_to(path)
    write_output(link, "through the link")
    assert link.is_symlink() and path.read_text() == "through the link"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "out.json"]


def test_a_link_to_nothing_yet_is_written_where_it_leads_or_names_what_is_missing(tmp_path):
    """A dangling link: the file is made where it leads, as open(path, "w") makes it; where the folder it leads to
    does not exist, or a folder on the way is a link to nothing, the message names what is missing (not a folder
    this user can write)."""
    link, target = tmp_path / "link.json", tmp_path / "made.json"
    link.symlink_to(target)
    write_output(link, "through the link")
    assert link.is_symlink() and target.read_text() == "through the link"
    lost = tmp_path / "lost.json"
    lost.symlink_to(tmp_path / "gone" / "x.json")
    for call in (check_output_path, lambda p: write_output(p, "text")):
        with pytest.raises(ValueError, match=r"is a link to .*x.json, whose folder does not exist: create .*gone"):
            call(lost)
    folder = tmp_path / "folder"
    folder.symlink_to(tmp_path / "moved")
    for call in (check_output_path, lambda p: write_output(p, "text")):
        with pytest.raises(ValueError, match=r"folder is a link to .*moved, which does not exist: create it"):
            call(folder / "sub" / "x.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "link.json", "lost.json", "made.json"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_pipe_or_device_is_written_in_place_not_replaced(tmp_path):
    """``save_profile("/dev/null")``, a named pipe, ``/dev/stdout`` piped to another program: the atomic write put a
    file where the device or pipe was (as root, /dev/null itself), or failed naming a reason that was not the
    cause. Such a target is written as ``open(path, "w")`` writes it; the check opens nothing (a pipe without a
    reader would wait)."""
    import stat
    import threading

    fifo = tmp_path / "profile.fifo"
    os.mkfifo(fifo)
    assert check_output_path(fifo) == fifo  # returns at once, no reader needed
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_output(fifo, '{"steps": 3}')
    reader.join(timeout=30)
    assert got == [b'{"steps": 3}'] and stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.fifo"]  # no temp file left
    code = "from kitsune._paths import write_output; write_output('/dev/stdout', 'to the pipe')"
    if Path("/dev/stdout").exists():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout == "to the pipe", out.stderr


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert check_output_path("~/a/x.json") == tmp_path / "home" / "a" / "x.json"
    assert write_output("~/a/x.json", "{}") == tmp_path / "home" / "a" / "x.json"
    assert (tmp_path / "home" / "a" / "x.json").read_text() == "{}" and not (tmp_path / "~").exists()


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "'': the path is empty: name a file"),
        ("reports/", "reports/: ends with '/', so it names a folder: name a file in it"),
        ("new/", "new/: ends with '/', so it names a folder: name a file in it"),
        ("adir", "adir: is a directory, not a file: name a file in it"),
    ],
    ids=["empty", "existing-folder-with-slash", "new-folder-with-slash", "existing-folder"],
)
def test_a_path_that_names_no_file_is_refused(tmp_path, monkeypatch, name, problem):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    (tmp_path / "adir").mkdir()
    for check in (check_output_path, lambda p: write_output(p, "x")):
        with pytest.raises(ValueError) as info:
            check(name)
        assert str(info.value) == problem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "reports"] and not any(Path("reports").iterdir())
