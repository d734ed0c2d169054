"""Output paths of the ``kitsune`` commands (``demo --profile-out``, ``report --html/--trace``, ``bench --json``).

Checked before any work, so a bad path costs one line and exit code 2, not a traceback after the whole run. Written
atomically: the text goes to a new file in the same folder, which then replaces the old one in one step, so a write
that fails (a full disk, Ctrl-C) leaves the old file whole. What is not a regular file (``/dev/null``, a named pipe,
``/dev/stdout``) is written in place, as ``open(path, "w")`` writes it: replacing it would put a file where the
device or the pipe was.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path


def _stat(path: Path, out: Path) -> os.stat_result | None:
    """``path``'s stat, None where it does not exist (or sits under a file, which the walk up finds next)."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # a parent this user may not search, a loop of links, a name too long
        raise ValueError(f"{out}: cannot check it ({exc.strerror or exc})") from None


def as_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path with ``~`` expanded; a ValueError for ``""`` (which Path reads as "."), a TypeError naming
    what a path is for anything else (None, a number)."""
    try:
        text = os.fspath(path)
    except TypeError:
        raise TypeError(f"expected a file path (a str or a pathlib.Path), got {type(path).__name__}") from None
    if text == "":
        raise ValueError("'': the path is empty: name a file")
    try:
        return Path(text).expanduser()
    except RuntimeError:  # no HOME and no passwd entry
        raise ValueError(f"{text}: cannot expand '~' (no home directory is known): name the full path") from None


def _refuse(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path unless what is there (or its nearest existing folder) rules a file out; else a ValueError."""
    out = as_path(path)
    text = os.fspath(path)
    if text.endswith(tuple(s for s in (os.sep, os.altsep) if s)):  # Path("reports/") drops the slash
        raise ValueError(f"{text}: ends with {text[-1]!r}, so it names a folder: name a file in it")
    found = _stat(out, out)
    if found is not None:
        if stat.S_ISDIR(found.st_mode):
            raise ValueError(f"{out}: is a directory, not a file: name a file in it")
        if not os.access(out, os.W_OK):
            raise ValueError(f"{out}: is not writable (permission denied): name a path this user can write")
        return out
    if out.is_symlink():  # a link to no file yet: the file is made where it leads, in a folder that must exist
        target = Path(os.path.realpath(out))
        if _stat(target.parent, out) is None:
            raise ValueError(
                f"{out}: is a link to {target}, whose folder does not exist: create {target.parent}, or name another "
                "path"
            )
    parent = out.parent
    while (found := _stat(parent, out)) is None:
        if parent.is_symlink():  # a folder on the way is a link to nothing: it cannot be made where the link is
            raise ValueError(
                f"{out}: {parent} is a link to {os.path.realpath(parent)}, which does not exist: create it, or name "
                "another path"
            )
        if parent == parent.parent:  # "." or "/" gone: a deleted working directory
            raise ValueError(f"{out}: cannot check it ({parent} does not exist)")
        parent = parent.parent
    if not stat.S_ISDIR(found.st_mode):
        raise ValueError(f"{out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        missing = "it" if parent == out.parent else "its directories"
        raise ValueError(
            f"{out}: cannot create {missing} in {parent} (permission denied): name a path in a folder this user can "
            "write"
        )
    return out


_FULL = "free some space, or name a path on another disk"
_BECAUSE = {
    errno.ENOSPC: ("the disk is full", _FULL),
    errno.EDQUOT: ("the disk quota is used up", _FULL),
    errno.EFBIG: (
        "the file is too large for this disk or this process's file size limit (ulimit -f)",
        "name a path on another disk, or raise the limit",
    ),
    errno.EROFS: ("read-only file system", "name a path on a writable disk"),
    errno.EACCES: ("permission denied", "name a path in a folder this user can write"),
    errno.EPERM: ("permission denied", "name a path in a folder this user can write"),
}
"""errno -> (what happened, the fix); any other error: its own text and the fix of a folder this user can write."""


def _failed(out: Path, exc: OSError, kept: bool = False) -> ValueError:
    """The one line for an OSError met while making ``out``'s folders or writing it: the path, what happened and the
    fix; ``kept``: an older file at ``out`` is still there, unchanged (the write replaces it only once complete)."""
    what = "write it" if exc.filename is None or Path(exc.filename) == out else f"create {exc.filename}"
    reason, fix = _BECAUSE.get(exc.errno, (exc.strerror or str(exc), "name a path in a folder this user can write"))
    unchanged = "; the existing file is unchanged" if kept else ""
    return ValueError(f"{out}: cannot {what} ({reason}{unchanged}): {fix}")


def _make_folders(out: Path) -> list[Path]:
    """Make ``out``'s missing folders; returns those made, outermost first. On an OSError none is left behind."""
    missing = []
    parent = out.parent
    while _stat(parent, out) is None:
        missing.append(parent)
        parent = parent.parent
    made: list[Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:  # made meanwhile by someone else: theirs to keep
            continue
        except OSError as exc:
            _remove(made)
            raise _failed(out, exc) from exc
        made.append(folder)
    return made


def _remove(made: list[Path]) -> None:
    """Remove the folders ``_make_folders`` made, innermost first, where they are still empty."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            return


def _replace(out: Path, data: bytes | None) -> None:
    """Write ``data`` to a new file next to ``out`` and move it over ``out`` in one step; ``None``: only make that
    file and remove it (the check). The new file is removed on any failure, Ctrl-C included; an OSError names
    ``out``, not the new file. A device, a pipe or a socket at ``out`` is written in place (the check opens nothing:
    a pipe without a reader would wait)."""
    try:
        found = os.stat(out)  # through links: /dev/stdout is the pipe or terminal it leads to
    except OSError:
        found = None
    if found is not None and not stat.S_ISREG(found.st_mode):
        if data is not None:
            with open(out, "wb") as file:
                file.write(data)
        return
    target = Path(os.path.realpath(out))  # through a link: its file is replaced, the link kept
    temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 less the umask, as a plain write
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(out)) from exc
    try:
        with os.fdopen(fd, "wb") as file:
            if data is not None:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())  # on disk before the rename: a crash leaves the old file or the new one
        if data is not None:
            with contextlib.suppress(FileNotFoundError):  # an existing file keeps its permissions
                os.chmod(temp, stat.S_IMODE(os.stat(target).st_mode))
            os.replace(temp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise OSError(exc.errno, exc.strerror, str(out)) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if data is None:
        os.unlink(temp)


def check_output_path(path: str | os.PathLike[str]) -> Path:
    """``path`` (``~`` expanded) as a Path when a file can be written there; else a ValueError of one line naming it,
    the problem and the fix.

    Refused: ``""``; a path ending in a separator, or naming a directory; a file this user may not write; a path
    under a regular file; a path whose missing directories cannot be made in the nearest existing one (not
    writable); a path where making the directories or a file next to it fails (``/proc``, a read-only mount, which
    permission bits alone do not show). The check makes the missing directories and a file in the folder, as
    `write_output` does, then removes what it made: nothing is left behind, and an existing file is not changed.
    """
    return _make(path, None, keep=False)


def write_output(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` (``~`` expanded), making its missing directories; returns the path.

    Atomic: the text goes to a new file in the same folder, which then replaces any old file in one step, so a
    failed write (a full disk, Ctrl-C) leaves the old file as it was. A path nothing can be written at (what
    `check_output_path` refuses, or one where making a directory or writing fails) is a ValueError of one line naming
    the path, what happened and the fix; the directories made and the new file are removed.
    """
    return _make(path, text.encode("utf-8"), keep=True)


def _make(path: str | os.PathLike[str], data: bytes | None, keep: bool) -> Path:
    """`_replace` at ``path`` after `_refuse` and with its missing folders made; an OSError is the one-line
    ValueError, with the folders made removed. ``keep=False`` (a check): what was made is removed afterwards too."""
    out = _refuse(path)
    made = _make_folders(out)
    existed = out.exists()
    try:
        _replace(out, data)
    except OSError as exc:
        _remove(made)
        raise _failed(out, exc, kept=existed and data is not None) from exc
    except BaseException:
        _remove(made)
        raise
    if not keep:
        _remove(made)
    return out


def output_file(text: str) -> Path:
    """An argparse ``type`` for an output file (``--profile-out``): `check_output_path`, its ValueError as argparse's
    one error line, so a bad path is refused before the run, not after it."""
    try:
        return check_output_path(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def output_dir(*names: str) -> Callable[[str], Path]:
    """An argparse ``type`` for a folder the program writes ``names`` into (``--out-dir``): the folder (``~``
    expanded) when each file can be written there (`check_output_path`), else argparse's one error line."""

    def parse(text: str) -> Path:
        if text == "":
            raise argparse.ArgumentTypeError("'': the path is empty: name a folder ('.' for this one)")
        try:
            folder = as_path(text)
            for name in names:
                check_output_path(folder / name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return folder

    return parse
