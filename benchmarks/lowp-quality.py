"""Does low-precision optimizer state train as well as fp32 state? GPT-2 small, the same init and batches, AdamW.

python benchmarks/lowp-quality.py --json lowp-quality.json      # on a GPU: GPT-2 124M, 300 steps, batch 8 x 256
python benchmarks/lowp-quality.py --device cpu --steps 40       # a dry run at tiny size (Triton's interpreter)

Trains `kitsune.bench.e2e.GPT` once per run of `kitsune.bench.quality.RUNS` (``param``: fp32 params and state;
``param-again``: the same once more, its difference the run's own noise; ``bf16``, ``8bit``: that state precision;
``bf16-params``: bf16 params and state, no fp32 master weights, stochastic rounding; ``bf16-params-nearest``: the same
rounded to nearest) with `kitsune.bench.quality.run_quality`: bf16 autocast, clipping at 1.0, AdamW (lr ``--lr``, weight
decay 0.1; ``--warmup`` steps of linear warm-up, then a cosine to a tenth of it), a synthetic next-token task. Prints
each run's first and final loss (the mean of the last 50 steps), the final loss relative to fp32's, its state memory,
and the plan's state formats.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=30, help="steps of linear learning-rate warm-up")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="after the warm-up")
    parser.add_argument("--seeds", type=int, default=1, help="runs with seeds 0..N-1 (init and batches)")
    parser.add_argument(
        "--runs",
        default="param,param-again,bf16,8bit,bf16-params,bf16-params-nearest,bf16-params-kahan",
        help="comma-separated, of RUNS",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before kitsune's kernels are imported
    from kitsune.bench.e2e import GPT2_SMALL, GPTConfig
    from kitsune.bench.quality import run_quality

    model = GPT2_SMALL if device.type == "cuda" else GPTConfig(vocab=32, block=16, layers=1, heads=2, dim=16)
    seq = args.seq if device.type == "cuda" else 16
    results = []
    for seed in range(args.seeds):
        runs = args.runs.split(",")
        result = run_quality(
            device, model, args.steps, args.batch, seq, runs, lr=args.lr, seed=seed, warmup=args.warmup,
            schedule=args.schedule,
        )  # fmt: skip
        results.append(result)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(
            f"{device} ({name}), torch {torch.__version__}, seed {seed}, {args.steps} steps, {args.batch} x {seq}, "
            f"lr {args.lr} ({args.warmup} steps warm-up, then {args.schedule})"
        )
        print(f"{'run':>19} {'first':>8} {'final':>8} {'vs fp32':>8} {'state MiB':>10} {'s':>6}  formats")
        for r in result.runs:
            print(
                f"{r.precision:>19} {r.first_loss:8.4f} {r.final_loss:8.4f} {result.relative(r.precision):+8.3%} "
                f"{r.state_bytes / 2**20:10.1f} {r.seconds:6.1f}  {', '.join(r.state_formats)}"
            )
    for precision in (r for r in args.runs.split(",") if r != "param"):
        rel = [r.relative(precision) for r in results]
        each = ", ".join(f"{x:+.3%}" for x in rel)
        print(f"{precision}: final loss vs fp32 over {len(rel)} seed(s): mean {sum(rel) / len(rel):+.3%} ({each})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("[" + ",".join(r.model_dump_json(indent=1) for r in results) + "]")


if __name__ == "__main__":
    main()
