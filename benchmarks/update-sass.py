"""The fused update kernel's Hopper (sm_90) machine code, compiled on this machine without a GPU: its registers and
the instructions of one pass of its tile loop, counted by opcode.

    python benchmarks/update-sass.py                          # 8-bit AdamW, as the planner launches it
    python benchmarks/update-sass.py --warps 2                # the same kernel with 2 warps a program
    python benchmarks/update-sass.py --set TILE=512           # a constexpr overridden
    python benchmarks/update-sass.py --kitsune /tmp/other     # the package in /tmp/other/kitsune
    python benchmarks/update-sass.py --state fp32 --dump update.sass --ttgir update.ttgir

A proxy for GPU runs, not a timing: it shows in seconds on a CPU what a change does to the 8-bit update's
instructions and registers (registers decide the warps an SM holds). Fewer instructions need not mean faster: the
kernel is bound by latency with few warps and waits on its table reads (Nsight Compute on an H200: issue slots 55%
busy), and 23% more instructions made it 15% slower where they cut its table reads' cache lines by more than half
(docs/benchmarks.md), so a change is kept only after `benchmarks/program-sweep.py` times it on a GPU.

The launch's arguments come from a real step (a child process runs one through Triton's CPU interpreter and
records the launch), so the kernel compiles with the constexprs the planner picks, except RNE_BF16, set as on a
GPU. ptxas, nvdisasm and cuobjdump are the ones the triton wheel ships. Another Triton version (the GPU image's)
may schedule the same kernel differently: compare trees with the same Triton.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

OPTIMIZERS = {
    "adamw": ("AdamW", {"lr": 1e-3, "weight_decay": 0.01}),
    "adam": ("Adam", {"lr": 1e-3}),
    "nadam": ("NAdam", {"lr": 1e-3}),
    "radam": ("RAdam", {"lr": 1e-3}),
    "adamax": ("Adamax", {"lr": 1e-3}),
    "adadelta": ("Adadelta", {"lr": 1.0}),
    "rprop": ("Rprop", {"lr": 1e-3}),
    "sgd": ("SGD", {"lr": 1e-2, "momentum": 0.9}),
}
_DTYPES = {"float32": "fp32", "float64": "fp64", "int32": "i32", "int64": "i64", "uint8": "u8"}
_DTYPES.update({"float16": "fp16", "bfloat16": "bf16"})


def _capture(args: argparse.Namespace) -> None:
    """Child process: one step through the interpreter, the update launch's argument types and constexprs to JSON."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import kitsune
    import kitsune.kernels.update as update
    from kitsune.config import FusionConfig

    seen: dict = {}

    class Recorder:
        def warmup(self, *call_args, grid, **constexprs):  # the step compiles its launches ahead: nothing to compile
            pass

        def __getitem__(self, grid):
            def launch(*call_args, **constexprs):
                sig = []
                for a in call_args:
                    if torch.is_tensor(a):
                        sig.append("*" + _DTYPES[str(a.dtype).removeprefix("torch.")])
                    elif isinstance(a, bool):
                        sig.append("i1")
                    elif isinstance(a, int):
                        sig.append("i64" if abs(a) >= 2**31 else "i32")
                    else:
                        sig.append("fp32")
                seen.setdefault("launches", []).append(
                    {"signature": sig, "constexprs": {k: str(v) for k, v in constexprs.items()}}
                )

            return launch

    update._update_kernel = Recorder()
    name, options = OPTIMIZERS[args.optimizer]
    torch.manual_seed(0)
    params = [torch.randn(args.numel, requires_grad=True)]
    optimizer = getattr(torch.optim, name)(params, **options)
    config = FusionConfig(state_precision=args.state)
    opt = kitsune.KitsuneOptimizer(optimizer, enable_fusion=True, fusion_config=config)
    params[0].grad = torch.randn_like(params[0])
    try:
        opt.step()
    except Exception:  # the recorder launched nothing, so later checks of the step may fail: the launch is recorded
        pass
    if not seen.get("launches"):
        raise SystemExit("no fused update was launched: is the route Triton? (see the optimizer's plan)")
    Path(args.capture_to).write_text(json.dumps(seen["launches"][-1]))


def _constexpr(value: str, tl):
    if value in ("True", "False"):
        return value == "True"
    if value.startswith("fp") or value.startswith("bf") or value.startswith("int") or value.startswith("uint"):
        return getattr(tl, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(value, value))
    return int(value)


def _loop(lines: list[str]) -> list[str]:
    """The instructions of the longest loop: from the label the farthest backward branch goes to, to that branch."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+(?:\S+,\s*)?`\((\.L_x_\d+)\)", line)
        start = labels.get(m.group(1), len(lines)) if m else len(lines)
        if start < i - 1 and (best is None or i - start > best[1] - best[0]):  # not the trap's branch to itself
            best = (start, i)
    if best is None:
        return []
    body = lines[best[0] : best[1] + 1]
    return [
        re.sub(r"/\*.*?\*/", "", line).strip().rstrip(" ;") for line in body if re.search(r"/\*[0-9a-f]{4}\*/", line)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--state", choices=["8bit", "bf16", "fp32"], default="8bit")
    parser.add_argument("--numel", type=int, default=20_000, help="elements of the one param stepped")
    parser.add_argument("--warps", type=int, help="warps a program (default: the launch's)")
    parser.add_argument("--maxnreg", type=int, help="cap the registers a thread (Triton's maxnreg option)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=INT", help="override a constexpr")
    parser.add_argument("--kitsune", help="import kitsune from this folder instead of the installed one")
    parser.add_argument("--dump", help="write the whole kernel's SASS here")
    parser.add_argument("--ttgir", help="write its Triton GPU IR here (each tensor's layout, the layout conversions)")
    parser.add_argument("--capture-to", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kitsune:
        sys.path.insert(0, args.kitsune)
    if args.capture_to:
        _capture(args)
        return

    os.environ.pop("TRITON_INTERPRET", None)  # compile here; only the child interprets
    with tempfile.TemporaryDirectory() as tmp:
        launch_file = Path(tmp) / "launch.json"
        child = [sys.executable, __file__, "--capture-to", str(launch_file), "--optimizer", args.optimizer]
        child += ["--state", args.state, "--numel", str(args.numel)]
        child += ["--kitsune", args.kitsune] if args.kitsune else []
        subprocess.run(child, check=True)
        launch = json.loads(launch_file.read_text())

        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        import kitsune.kernels.update as update

        fn = update._update_kernel
        recorded = launch["constexprs"]
        maxnreg = args.maxnreg or (None if recorded.get("maxnreg", "None") == "None" else int(recorded["maxnreg"]))
        constexprs = {k: _constexpr(v, tl) for k, v in recorded.items() if k != "maxnreg"}  # an option, as below
        warps = args.warps or constexprs.pop("num_warps", 4)
        constexprs.pop("num_warps", None)
        fp_fusion = bool(constexprs.pop("enable_fp_fusion", True))  # a compile option, as the launch passes it
        constexprs["RNE_BF16"] = False  # the interpreter's setting; a GPU launch rounds in hardware
        for item in args.set:
            name, _, value = item.partition("=")
            if name not in constexprs:
                raise SystemExit(f"--set {item}: no constexpr {name!r} (have: {', '.join(sorted(constexprs))})")
            constexprs[name] = int(value)
        types = iter(launch["signature"])
        signature = {n: "constexpr" if n in constexprs else next(types) for n in fn.arg_names}
        fixed = {(fn.arg_names.index(n),): v for n, v in constexprs.items()}
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs=fixed),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": 1, "enable_fp_fusion": fp_fusion, "maxnreg": maxnreg},
        )
        if args.ttgir:
            Path(args.ttgir).write_text(kernel.asm["ttgir"])
        cubin = Path(tmp) / "update.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        sass = subprocess.run([tools / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    if args.dump:
        Path(args.dump).write_text(sass)
    regs = re.search(r"REG:(\d+)", usage)
    spills = re.search(r"STACK:(\d+)", usage)
    loop = _loop(sass.splitlines())
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
    tile = constexprs.get("TILE", 0)
    print(f"triton {triton.__version__}, sm_90: {args.optimizer} {args.state}, {warps} warps, TILE {tile}, "
          f"BLOCK {constexprs.get('BLOCK')}, registers {regs.group(1) if regs else '?'}, "
          f"stack {spills.group(1) if spills else '?'} bytes")  # fmt: skip
    total = sum(1 for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line))
    print(f"kernel: {total} instructions")
    if not loop:
        print("no tile loop: a program works on one tile")
        return
    per_element = len(loop) * 32 * warps / tile if tile else float("nan")
    print(f"loop: {len(loop)} instructions a warp a pass, {per_element:.1f} a thread per element")
    print("  " + "  ".join(f"{k} {v}" for k, v in ops.most_common(24)))


if __name__ == "__main__":
    main()
