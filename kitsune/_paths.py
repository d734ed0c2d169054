"""Output paths of the ``kitsune`` commands (``demo --profile-out``, ``report --html/--trace``, ``bench --json``).

Checked before any work, so a bad path costs one line and exit code 2, not a traceback after the whole run.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _stat(path: Path, out: Path) -> os.stat_result | None:
    """``path``'s stat, None where it does not exist (or sits under a file, which the walk up finds next)."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # a parent this user may not search, a loop of links, a name too long
        raise ValueError(f"{out}: cannot check it ({exc.strerror or exc})") from None


def _refuse(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path unless what is there (or its nearest existing folder) rules a file out; else a ValueError."""
    out = Path(path)
    found = _stat(out, out)
    if found is not None:
        if stat.S_ISDIR(found.st_mode):
            raise ValueError(f"{out}: is a directory, not a file")
        if not os.access(out, os.W_OK):
            raise ValueError(f"{out}: is not writable (permission denied)")
        return out
    parent = out.parent
    while (found := _stat(parent, out)) is None:
        if parent == parent.parent:  # "." or "/" gone: a deleted working directory
            raise ValueError(f"{out}: cannot check it ({parent} does not exist)")
        parent = parent.parent
    if not stat.S_ISDIR(found.st_mode):
        raise ValueError(f"{out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        missing = "it" if parent == out.parent else "its directories"
        raise ValueError(f"{out}: cannot create {missing} in {parent} (permission denied)")
    return out


def _failed(out: Path, exc: OSError) -> ValueError:
    """The one line for an OSError met while making ``out``'s folders or writing it: the path, the reason, the fix."""
    what = "write it" if exc.filename is None or Path(exc.filename) == out else f"create {exc.filename}"
    return ValueError(f"{out}: cannot {what} ({exc.strerror or exc}): name a path in a folder this user can write")


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


def check_output_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path when a file can be written there; else a ValueError of one line naming it and the problem.

    Refused: a directory; a file this user may not write; a path under a regular file; a path whose missing
    directories cannot be made in the nearest existing one (not writable); a path where making the directories or
    the file fails (``/proc``, a read-only mount, which permission bits alone do not show). The check makes the
    missing directories and opens the file, then removes what it made: nothing is left behind, and an existing file
    is not changed.
    """

    def touch(out: Path, existed: bool) -> None:
        with open(out, "a" if existed else "x", encoding="utf-8"):  # "a": an existing file is not truncated
            pass

    return _make(path, touch, keep=False)


def write_output(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path``, making its missing directories. A path nothing can be written at (what
    `check_output_path` refuses, or one where making a directory or writing fails) is a ValueError of one line naming
    the path, the reason and the fix; then the directories made and a file begun are removed. Returns the path."""
    return _make(path, lambda out, _: out.write_text(text, encoding="utf-8"), keep=True)


def _make(path: str | os.PathLike[str], write: Callable[[Path, bool], Any], keep: bool) -> Path:
    """``write(out, existed)`` at ``path`` after `_refuse` and with its missing folders made; an OSError is the
    one-line ValueError, with the folders made and a file begun removed. ``keep=False`` (a check): what was made is
    removed afterwards too."""
    out = _refuse(path)
    made = _make_folders(out)
    existed = out.exists()
    try:
        write(out, existed)
        if not (keep or existed):
            out.unlink()
    except OSError as exc:
        if not existed:
            with contextlib.suppress(OSError):  # (the one line below says what failed)
                out.unlink(missing_ok=True)
        _remove(made)
        raise _failed(out, exc) from exc
    if not keep:
        _remove(made)
    return out
