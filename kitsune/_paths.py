"""Output paths of the ``kitsune`` commands (``demo --profile-out``, ``report --html/--trace``, ``bench --json``).

Checked before any work, so a bad path costs one line and exit code 2, not a traceback after the whole run.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def _stat(path: Path, out: Path) -> os.stat_result | None:
    """``path``'s stat, None where it does not exist (or sits under a file, which the walk up finds next)."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # a parent this user may not search, a loop of links, a name too long
        raise ValueError(f"{out}: cannot check it ({exc.strerror or exc})") from None


def check_output_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path when a file can be written there; else a ValueError of one line naming it and the problem.

    Refused: a directory; a file this user may not write; a path under a regular file; a path whose missing
    directories cannot be made in the nearest existing one (not writable). Nothing is created: the writers make the
    missing directories themselves.
    """
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


def write_output(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path``, making its missing directories, after `check_output_path`: a path nothing
    can be written at is a ValueError of one line, and nothing is written. Returns the path."""
    out = check_output_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
