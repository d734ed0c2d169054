"""The ``kitsune`` command, and the argparse ``type`` helpers its subcommands and the examples share: a bad
``--device``, output file or output folder is one error line before any work."""

from __future__ import annotations

import argparse
import sys

from kitsune._device import device_arg
from kitsune._paths import output_dir, output_file

__all__ = [
    "add_device_argument",
    "build_parser",
    "device_arg",
    "main",
    "output_dir",
    "output_file",
    "positive_float",
    "positive_int",
    "seed",
]


def add_device_argument(parser: argparse.ArgumentParser, gpu_index: bool = True) -> None:
    """``--device`` on ``parser``, ``auto`` by default (CUDA where torch sees a GPU), through `device_arg`: one error
    line, before any work, for a device torch cannot use. ``gpu_index=False``: ``cpu`` or ``cuda`` alone, for a
    program that puts each rank on its GPU itself (torchrun's LOCAL_RANK, Lightning, Accelerate)."""
    if gpu_index:
        parser.add_argument(
            "--device", type=device_arg, default="auto", help="auto (GPU when there is one), cpu, cuda or cuda:N"
        )
        return
    parser.add_argument(
        "--device",
        type=device_arg,
        choices=["cpu", "cuda"],
        default="auto",
        metavar="{auto,cpu,cuda}",
        help="auto: cuda where there is a GPU",
    )


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1 (a step count, a batch size), else argparse's error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number greater than 0 (a clipping norm, a rate), else argparse's error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number greater than 0, got {text!r}") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number greater than 0, got {text}")
    return value


def seed(text: str) -> int:
    """An argparse ``type``: a seed ``torch.manual_seed`` takes (a whole number from -2**63 to 2**64 - 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be from -2**63 to 2**64 - 1 (torch.manual_seed's range), got {value}")
    return value


def _version() -> str:
    """``kitsune --version``: kitsune's version, and torch's and Triton's, which decide what runs."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import kitsune

    try:
        triton = f"triton {version('triton')}"  # the metadata, not the import: importing Triton takes a second
    except PackageNotFoundError:
        triton = "triton not installed"
    return f"kitsune {kitsune.__version__} (torch {torch.__version__}, {triton})"


def _demo(args: argparse.Namespace) -> int:
    from kitsune._paths import check_output_path

    try:  # before the run: a bad path would otherwise fail only at its end, when the profile is saved
        path = check_output_path(args.profile_out)
    except ValueError as exc:
        print(f"kitsune demo: --profile-out {exc}", file=sys.stderr)
        return 2
    older = path.exists()

    from kitsune.demo import run_demo

    try:
        run_demo(steps=args.steps, device=args.device, profile_path=args.profile_out, seed=args.seed)
    except KeyboardInterrupt:  # the profile is saved last, whole or not at all: an older one is as it was
        kept = f"the profile already at {path} is as it was" if older else f"{path} was not written"
        print(f"kitsune demo: interrupted ({kept})", file=sys.stderr)
        return 130
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from kitsune.doctor import print_doctor

    print_doctor()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kitsune", description="A fast optimizer phase for PyTorch training.")
    parser.add_argument("--version", action="version", version=_version())
    # not required=True: argparse would then report a missing command before an unknown option (`kitsune --bogus`)
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser(
        "demo",
        help="train a tiny GPT with torch and with kitsune, side by side",
        description="Train a tiny GPT on synthetic batches with torch's AdamW and with kitsune's, side by side: the "
        "losses, the step's and the iteration's speedup with its spread (on a GPU; on a CPU kitsune is a "
        "pass-through and no speedup is shown), the profiler's summary, and the profile saved as JSON.",
    )
    demo.add_argument("--steps", type=positive_int, default=100, help="training steps per run (default 100)")
    add_device_argument(demo)
    demo.add_argument(
        "--profile-out",
        default="kitsune-profile.json",
        help="where to write the profile JSON (default kitsune-profile.json)",
    )
    demo.add_argument(
        "--seed", type=seed, default=0, help="seed of the model's init and the synthetic batches (default 0)"
    )
    demo.set_defaults(func=_demo)

    doctor = sub.add_parser(
        "doctor",
        help="report what this machine supports",
        description="Report what this machine supports: the torch and CUDA versions, the GPU, Triton, NVML, and "
        "which kitsune subsystems would be active here.",
    )
    doctor.set_defaults(func=_doctor)

    from kitsune.bench import register as register_bench

    register_bench(sub)

    from kitsune.profiler.report import register as register_report

    register_report(sub)
    for command in sub.choices.values():  # for `_parse`: the parser to refuse an unknown argument after the command
        command.set_defaults(command_parser=command)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, with an unknown argument after the command refused by that command's parser: its usage
    and ``kitsune CMD: error:``, not the top level's. One before the command is the top level's."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        tokens = sys.argv[1:] if argv is None else argv
        # the top-level options take no value: the command is the first token that is not an option
        before = tokens[: tokens.index(args.command)] if args.command is not None else tokens
        owner = parser if args.command is None or any(a in before for a in unknown) else args.command_parser
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    if args.command is None:
        parser.error("the following arguments are required: command")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
