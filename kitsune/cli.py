"""The ``kitsune`` command."""

from __future__ import annotations

import argparse
import sys


def _demo_device(text: str) -> str:
    """``--device`` of the demo through :func:`kitsune._device.parse_device`: its ValueError as an argparse error."""
    from kitsune._device import parse_device

    try:
        return str(parse_device(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _demo(args: argparse.Namespace) -> int:
    from kitsune.demo import run_demo

    run_demo(steps=args.steps, device=args.device, profile_path=args.profile_out, seed=args.seed)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from kitsune.doctor import print_doctor

    print_doctor()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kitsune", description="A fast optimizer phase for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny GPT with torch and with kitsune, side by side")
    demo.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    demo.add_argument(
        "--device", type=_demo_device, default="auto", help="auto (GPU when there is one), cpu, cuda or cuda:N"
    )
    demo.add_argument("--profile-out", default="kitsune-profile.json", help="where to write the profile JSON")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    doctor = sub.add_parser("doctor", help="report what this machine supports")
    doctor.set_defaults(func=_doctor)

    from kitsune.bench import register as register_bench

    register_bench(sub)

    from kitsune.profiler.report import register as register_report

    register_report(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "steps", 1) < 1:
        print("kitsune: --steps must be at least 1", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
