"""Newton-Schulz's kernels for one call as a Hopper GPU (sm_90) would compile them, on a CPU: each launch's loads
from global memory counted by width.

    python benchmarks/ns-codegen.py --shape 1x768x50257      # a wide, odd-width iterate
    python benchmarks/ns-codegen.py --shape 1x50257x768      # GPT-2's wte, as Muon sees it
    python benchmarks/ns-codegen.py --shape 1x768x50257 --k-align 1 --json launches.json

The call runs with the kernels replaced by recorders (nothing computes), each recorded launch then goes through
Triton's own specialisation of its arguments (an integer divisible by 16, a 16-byte aligned pointer, an integer 1)
and compiles for sm_90 with the ptxas the triton wheel ships. A load of 16 bytes (`cp.async` of 16, `ld.global`
of `.v4`) moves 8 bf16 values; a 2-byte one moves one: a launch whose operand loads are 2 bytes wide runs its tensor
cores far below their rate (the odd-width iterate's products: ~50 TFLOP/s on an H200). The tiles are the ones
`pick_configs` gives a GPU with ``--sms`` SMs, TMA descriptors included (``tma``: bulk tensor copies); each kernel's
registers and stack (spills) come from cuobjdump. A proxy for GPU runs, not a timing; it uses Triton internals (the
binder of `JITFunction.run`), so another Triton version may need it adjusted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile: the kernels must be JIT functions, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from kitsune.kernels import newton_schulz as ns  # noqa: E402

KERNELS = ("_prologue_kernel", "_syrk_kernel", "_gram_reduce_kernel", "_poly_kernel")
TARGET = GPUTarget("cuda", 90, 32)
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def record(shape: tuple[int, int, int], steps: int, sms: int) -> list[dict]:
    """The launches of one ``newton_schulz_launch`` on a bf16 input of ``shape``, in order, none of them run."""
    launches: list[dict] = []
    real = {name: getattr(ns, name) for name in KERNELS}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({"kernel": self.name, "grid": grid, "args": args, "kwargs": kwargs})

            return launch

    ns._num_sms = lambda device: sms  # pick_configs' view of the GPU
    interpreted = ns.INTERPRETED
    ns.INTERPRETED = True  # TMA descriptors of CPU tensors, as of a GPU's (RNE_BF16 is set back at compile time)
    for name in KERNELS:
        setattr(ns, name, Recorder(name))
    try:
        x = torch.randn(shape, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        m, n = sorted(shape[1:])
        configs = ns.pick_configs(m, n, shape[0], torch.bfloat16, torch.device("cuda"))
        ns.newton_schulz_launch(x, out, ns.schedule(ns.MUON_COEFFICIENTS, steps), 1e-7, torch.bfloat16, configs)
    finally:
        ns.INTERPRETED = interpreted
        for name, fn in real.items():
            setattr(ns, name, fn)
    for launch in launches:
        launch["fn"] = real[launch["kernel"]]
    return launches


def compile_launch(launch: dict, backend, cache: dict) -> dict[str, int]:
    """The launch's kernel compiled for sm_90 as its arguments specialise it: its global loads and stores by width
    (memoised on the specialisation)."""
    fn = launch["fn"]
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch["kwargs"], "RNE_BF16": False}  # a GPU rounds in hardware
    bound, specialization, options = binder(*launch["args"], **kwargs)
    key = (launch["kernel"], repr(specialization), repr(sorted(kwargs.items(), key=lambda kv: kv[0])))
    if key not in cache:
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
        cache[key] = {**widths(compiled.asm["ptx"]), **resources(compiled.asm["cubin"])}
    return cache[key]


def resources(cubin: bytes) -> dict[str, int]:
    """Registers a thread and stack bytes (spilled registers) of a compiled kernel, from cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return {"registers": int(regs.group(1)) if regs else -1, "stack": int(stack.group(1)) if stack else -1}


def widths(ptx: str) -> dict[str, int]:
    """Global memory instructions of a PTX listing: ``tma`` (bulk tensor copies through a descriptor), then by bytes
    moved a thread: ``load16`` (16-byte ``cp.async`` or ``.v4`` of 32 bits), ``load_narrow`` (anything less), and
    the same for stores."""
    counts = {"tma": 0, "load16": 0, "load_narrow": 0, "store16": 0, "store_narrow": 0}
    for line in ptx.splitlines():
        op = re.sub(r"^@!?%\w+\s+", "", line.strip())  # a predicate
        if op.startswith("cp.async.bulk.tensor"):
            counts["tma"] += 1
        elif op.startswith("cp.async") and "shared.global" in op:
            counts["load16" if re.search(r",\s*(?:16|0x10)\s*(?:,|;)", op) else "load_narrow"] += 1
        elif op.startswith(("ld.global", "st.global")):
            kind = "load" if op.startswith("ld") else "store"
            wide = re.search(r"\.v4\.(?:b|u|f)32|\.v2\.(?:b|u|f)64|\.v8\.(?:b|u|f)16", op)
            counts[f"{kind}16" if wide else f"{kind}_narrow"] += 1
    return counts


def describe(launch: dict, it: int) -> str:
    """Which launch of the call this is, with the extents it reads."""
    a, kw = launch["args"], launch["kwargs"]
    if launch["kernel"] == "_syrk_kernel":
        return f"iteration {it}: {'B' if kw['HAS_C'] else 'X X^T'} K={a[14]} EVEN_K={kw['EVEN_K']}"
    if launch["kernel"] == "_poly_kernel":
        return f"iteration {it}: B' X N={a[-2]} N_READ={a[-1]}"
    if launch["kernel"] == "_gram_reduce_kernel":
        return f"iteration {it}: reduce"
    return "prologue"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1x768x50257", help="batch x rows x cols")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sms", type=int, default=132, help="the SMs pick_configs sizes tiles for")
    parser.add_argument("--k-align", type=int, help="the iteration buffers' column multiple (ns.K_ALIGN) to try")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.k_align:
        ns.K_ALIGN = args.k_align
    shape = tuple(int(v) for v in args.shape.split("x"))
    backend = make_backend(TARGET)
    cache: dict = {}
    rows, it = [], 0
    print(f"triton {triton.__version__}, sm_90, {args.shape} bf16, K_ALIGN {ns.K_ALIGN}")
    for launch in record(shape, args.steps, args.sms):
        it += launch["kernel"] == "_syrk_kernel" and not launch["kwargs"]["HAS_C"]
        counts = compile_launch(launch, backend, cache)
        rows.append({"kernel": launch["kernel"], "launch": describe(launch, it), **counts})
        print(f"  {launch['kernel']:<20} {rows[-1]['launch']:<44} " + "  ".join(f"{k} {v}" for k, v in counts.items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
