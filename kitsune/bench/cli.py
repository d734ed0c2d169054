"""The ``bench`` command: ``kitsune bench`` (through `register`) and ``python -m kitsune.bench``."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kitsune._device import device_arg
from kitsune._paths import check_output_path, write_output
from kitsune.bench.params import GRADS, PARAM_SETS
from kitsune.bench.peers import PEERS
from kitsune.bench.results import BenchResult
from kitsune.bench.runner import run_bench
from kitsune.bench.variants import DEFAULT_VARIANTS, VARIANTS
from kitsune.cli import positive_int, seed


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--scale``, as the scripts under ``benchmarks/`` take them (`device_and_defaults`)."""
    parser.add_argument("--device", type=device_arg, default="cuda", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--scale", type=float, default=None, help="elements per tensor (default 1; 0.001 on a CPU)")


def device_and_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace, **defaults: tuple[Any, Any]) -> Any:
    """The scripts' ``torch.device`` (`add_device_args`), with ``args.scale`` and each of ``defaults`` (name ->
    (default on a CPU, default on CUDA)) that was left None filled in: a CPU run is a dry run at 0.001 of the size.
    A parser error where CUDA is asked for and there is none."""
    import torch

    device = torch.device(args.device)
    cpu = device.type == "cpu"
    for name, (on_cpu, on_cuda) in {"scale": (0.001, 1.0), **defaults}.items():
        if getattr(args, name) is None:
            setattr(args, name, on_cpu if cpu else on_cuda)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --device cpu for a dry run")
    return device


def write_script_json(path: Path, device: Any, out: dict[str, Any]) -> None:
    """A `benchmarks/` script's results at ``path``: ``out`` under an ``environment`` entry (torch's, kitsune's and
    CUDA's versions, and the GPU's name on one)."""
    import json

    import torch

    from kitsune import __version__

    env = {"torch": torch.__version__, "kitsune": __version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
    path.write_text(json.dumps({"environment": env, **out}, indent=1))


def _names(choices: dict[str, Any]) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``choices``, at least one; a repeated name counts
    once (``gpt2,gpt2`` times gpt2 once)."""

    def parse(text: str) -> list[str]:
        names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))  # each once, in order
        if not names:  # "" or ",": a run of nothing would exit 0 having timed nothing
            raise argparse.ArgumentTypeError(f"no name given: choose one or more of {', '.join(choices)}")
        bad = [n for n in names if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}: choose from {', '.join(choices)}")
        return names

    return parse


def _peers(text: str) -> list[str] | str:
    """``--peers``: ``all`` (also what ``--peers`` alone gives), or peer names as ``_names`` takes them."""
    return "all" if text.strip() == "all" else _names(PEERS)(text)


PEER_VARIANTS = ["fused", "kitsune", "8bit", "bf16state"]
"""The variants a ``--peers`` run times next to the peers unless ``--variants`` names others: torch's fused AdamW
and kitsune's one line, ``KitsuneOptimizer(torch.optim.AdamW(...), enable_fusion=True)``."""


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options, shared by ``kitsune bench`` and ``python -m kitsune.bench``."""
    parser.add_argument(
        "--sets",
        type=_names(PARAM_SETS),
        default=list(PARAM_SETS),
        help=f"comma-separated, of {','.join(PARAM_SETS)} (default: all)",
    )
    parser.add_argument(
        "--variants",
        type=_names(VARIANTS),
        default=None,
        help=f"comma-separated, of {','.join(VARIANTS)} (graph is CUDA only; default: "
        f"{','.join(DEFAULT_VARIANTS)}; with --peers {','.join(PEER_VARIANTS)})",
    )
    parser.add_argument(
        "--peers",
        type=_peers,
        nargs="?",
        const="all",
        default=None,
        metavar="NAMES",
        help=f"also time the optimizers users pick instead, where installed: all, or comma-separated of "
        f"{','.join(PEERS)} (on a CPU, all skips those that compile their step)",
    )
    parser.add_argument(
        "--steps",
        dest="timed_steps",
        type=positive_int,
        default=None,
        help="timed steps (default per set: gpt2 50, many 50, llama1b 20, resnet50 50; CPU 3)",
    )
    parser.add_argument("--warmup", type=positive_int, default=None, help="untimed steps first (default 10; CPU 1)")
    parser.add_argument(
        "--scale", type=_scale, default=None, help="fraction of each tensor's elements (default 1; CPU 0.001)"
    )
    parser.add_argument("--device", default="auto", help="auto (GPU when there is one), cpu, cuda or cuda:N")
    parser.add_argument("--phase", action="store_true", help="also time the AMP + clipping phase (gpt2 set)")
    parser.add_argument(
        "--e2e", action="store_true", help="also time whole training steps of a GPT-2 124M-shaped model"
    )
    parser.add_argument(
        "--e2e-steps", type=positive_int, default=None, help="with --e2e: timed steps a side (default 50; CPU 2)"
    )
    parser.add_argument(
        "--e2e-batch", type=positive_int, default=None, help="with --e2e: sequences of 512 tokens a step (default 4)"
    )
    parser.add_argument(
        "--compile",
        dest="compile_backend",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="with --e2e: run the model through torch.compile on every side (backend: inductor unless named)",
    )
    parser.add_argument("--muon", action="store_true", help="time Newton-Schulz and a Muon step instead (CUDA only)")
    parser.add_argument("--json", dest="json_path", default=None, help="write every number to this JSON file")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the params and grads")
    parser.add_argument(
        "--grads",
        choices=GRADS,
        default="kept",
        help="the AdamW rows' grads between steps: kept (the same tensors, default) or fresh (freed and re-allocated "
        "with new values before every step, as zero_grad() and backward() leave them; torch's graph and "
        "static_addresses=True, which need them in place, are skipped)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    """``func`` of the ``bench`` subcommand: run it, return the exit code (130 after Ctrl-C, with one line saying
    where the sets done so far are)."""
    if args.json_path is not None:
        try:  # before the run: the JSON is first written after the first set is timed
            args.json_path = check_output_path(args.json_path)  # "~" expanded
        except ValueError as exc:
            print(f"kitsune bench: --json {exc}", file=sys.stderr)
            return 2
    before = _identity(args.json_path)
    try:
        return _run_muon(args) if args.muon else _run(args)
    except KeyboardInterrupt:
        print(f"kitsune bench: {_interrupted(args.json_path, before)}", file=sys.stderr)
        return 130


def _identity(path: Path | None) -> tuple[int, int, int] | None:
    """What tells a file apart from the one that replaces it (each save is a new file): inode, mtime, size."""
    try:
        found = path.stat() if path is not None else None
    except OSError:
        return None
    return None if found is None else (found.st_ino, found.st_mtime_ns, found.st_size)


def _interrupted(path: Path | None, before: tuple[int, int, int] | None) -> str:
    """The line for Ctrl-C: where what was timed so far is, or that nothing was written (and an older file is
    untouched: every save replaces the file whole, or not at all)."""
    if path is None:
        return "interrupted (nothing written: without --json the numbers are only printed)"
    if _identity(path) == before:
        kept = f"{path} is untouched" if before is not None else f"{path} was not written"
        return f"interrupted before the first set was done: {kept}"
    try:
        names = ", ".join(s.name for s in BenchResult.load(path).sets) or "the environment only"
    except (OSError, ValueError):
        names = "a partial run"
    return f"interrupted: the sets done so far ({names}) are in {path} (complete: false)"


def _run(args: argparse.Namespace) -> int:
    import torch

    variants = args.variants or (PEER_VARIANTS if args.peers is not None else list(DEFAULT_VARIANTS))
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    try:
        with warnings.catch_warnings():
            if on_cpu:  # each kitsune side would warn that fusion is inactive there: the run's footer says it once
                warnings.filterwarnings("ignore", message=r"kitsune: \w+ was asked for but is inactive")
            result = run_bench(
                sets=args.sets,
                variants=variants,
                device=args.device,
                steps=args.timed_steps,
                warmup=args.warmup,
                scale=args.scale,
                phase=args.phase,
                e2e=args.e2e,
                compile_backend=args.compile_backend,
                e2e_steps=args.e2e_steps,
                e2e_batch=args.e2e_batch,
                json_path=args.json_path,
                seed=args.seed,
                peers=args.peers,
                grads=args.grads,
            )
    except ValueError as exc:
        print(f"kitsune bench: {exc}", file=sys.stderr)
        return 2
    entries = [*result.sets, *result.lion, *([result.phase] if result.phase is not None else [])]
    # a peer that fails (a library broken on this machine) is reported in its row; kitsune's and torch's fail the run
    ours = [v for e in entries for v in e.variants if v.peer is None or v.peer.reference]
    return 1 if any(v.status == "failed" for v in ours) else 0


def _run_muon(args: argparse.Namespace) -> int:
    import json

    import torch

    if not torch.cuda.is_available():  # before importing the benchmark: it imports Triton, which a CPU install may lack
        print(
            f"kitsune bench --muon: the Muon benchmark needs a CUDA GPU (it times Triton kernels), and torch "
            f"{torch.__version__} sees none: run it on a machine with one; kitsune bench without --muon also runs on "
            "a CPU",
            file=sys.stderr,
        )
        return 2

    from kitsune.bench.muon import run_muon_bench

    device = "cuda" if args.device == "auto" else args.device
    try:
        result = run_muon_bench(device)
    except ValueError as exc:
        print(f"kitsune bench --muon: {exc}", file=sys.stderr)
        return 2
    if args.json_path is not None:
        try:  # checked before the run; a disk that fills up meanwhile is still one line
            write_output(args.json_path, json.dumps(result, indent=2, default=str))
        except ValueError as exc:
            print(f"kitsune bench: --json {exc}", file=sys.stderr)
            return 2
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to the ``kitsune`` command's subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="time torch's AdamW variants against kitsune's",
        description="Time an AdamW step with torch foreach, torch fused, torch fused + CUDA graph and kitsune; with "
        "--peers, also with the optimizers users pick instead (bitsandbytes, torchao, optimi, heavyball, lion-pytorch, "
        "a compiled torch step), where installed. On a CPU the run is a smoke test of the command, not a comparison.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m kitsune.bench``: the same options as ``kitsune bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m kitsune.bench",
        description="Time an AdamW step with torch foreach, torch fused, torch fused + CUDA graph and kitsune. On a "
        "CPU the run is a smoke test of the command, not a comparison.",
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
