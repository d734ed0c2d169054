"""``kitsune report profile.json [--html report.html] [--trace trace.json]``: a saved profile, read back."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from kitsune._paths import check_output_path
from kitsune.profiler.html import write_html
from kitsune.profiler.schema import load_profile
from kitsune.profiler.summary import render_summary
from kitsune.profiler.trace import export_chrome_trace


def _output_problem(args: argparse.Namespace) -> str | None:
    """The first output (``--html``, ``--trace``) that cannot be written, as one line; None when all can. Each one
    that can is replaced in ``args`` by its Path, ``~`` expanded."""
    taken = {args.profile.resolve(): "the profile itself"}
    for flag, name in (("--html", "html"), ("--trace", "trace")):
        if getattr(args, name) is None:
            continue
        try:
            path = check_output_path(getattr(args, name))
        except ValueError as exc:
            return f"{flag} {exc}"
        setattr(args, name, path)
        where = path.resolve()
        if where in taken:  # the later write would replace the earlier file, or the profile itself
            return f"{flag} {path}: is {taken[where]}: name another file"
        taken[where] = f"the {flag} file too"
    return None


def run_report(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    problem = _output_problem(args)  # before anything is read or printed
    if problem is not None:
        print(f"kitsune report: {problem}", file=sys.stderr)
        return 2
    try:
        profile = load_profile(args.profile)
    except FileNotFoundError:
        print(f"kitsune report: {args.profile}: no such file", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kitsune report: {args.profile}: cannot read it ({exc.strerror or exc})", file=sys.stderr)
        return 2
    except ValueError as exc:  # load_profile's one line: a directory, not JSON, another schema_version, ...
        print(f"kitsune report: {exc}", file=sys.stderr)
        return 2
    if args.trace is not None and not profile.steps:  # an empty trace would open as a blank timeline
        print(
            f"kitsune report: --trace: {args.profile} holds no steps to trace (it was saved from an optimizer "
            "without profile=True, or before its first step): leave --trace out, or save the profile of a run with "
            "profile=True",
            file=sys.stderr,
        )
        return 2
    try:
        render_summary(profile, console)
        if args.html is not None:
            console.print(f"wrote {write_html(profile, args.html)}", soft_wrap=True, markup=False)  # a path, whole
        if args.trace is not None:
            trace = export_chrome_trace(profile, args.trace)
            console.print(f"wrote {trace} (open it in chrome://tracing or Perfetto)", soft_wrap=True, markup=False)
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
        # the schema leaves the plan's contents free (each kitsune version writes its own): a file edited by hand, or
        # written by another tool, can hold what the report cannot lay out
        print(
            f"kitsune report: {args.profile}: a field the report reads holds what kitsune does not write "
            f"({type(exc).__name__}: {exc}): the file was changed after it was saved, or written by another tool; "
            "save the profile again from the run",
            file=sys.stderr,
        )
        return 2
    return 0


def _input_path(text: str) -> Path:
    """The profile argument, ``~`` expanded (a shell leaves ``--x=~/p.json`` and a quoted ``~`` as they are); ``""``
    is refused (Path reads it as the current folder)."""
    if text == "":
        raise argparse.ArgumentTypeError("'': the path is empty: name the profile JSON that save_profile() wrote")
    return Path(text).expanduser()


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``report`` command to the ``kitsune`` CLI's subparsers."""
    parser = subparsers.add_parser(
        "report",
        help="print the summary of a saved profile; write an HTML report",
        description="Read a profile JSON written by save_profile() (or kitsune demo --profile-out) and print its "
        "summary, as print_summary() did during the run; --html also writes a self-contained HTML report, --trace "
        "a Chrome trace of the timed steps (open it in chrome://tracing or ui.perfetto.dev). The outputs are checked "
        "before the profile is read: a path that cannot be written is one error line, exit code 2.",
    )
    parser.add_argument("profile", type=_input_path, help="a profile JSON written by save_profile()")
    # str, not Path: Path("reports/") drops the "/" that says the user named a folder
    parser.add_argument("--html", metavar="REPORT.html", help="also write a self-contained HTML report")
    parser.add_argument("--trace", metavar="TRACE.json", help="also write a Chrome trace of the steps")
    parser.set_defaults(func=run_report)
    return parser
