#!/usr/bin/env bash
# The one script to run on a lent GPU: environment, the CUDA tests, `kitsune bench` on all sets, then the demo.
# Writes into $OUT (default ./gpu-out): env.log, cuda-tests.log, gpu-suites.log, gpu-fusion.log, bench.log,
# bench.json, muon.log, muon.json, demo.log, demo-profile.json, exit-codes.txt; with STAGES naming fresh,
# bench-fresh.log, bench-fresh.json, fresh-grads.json, step-parts.json and step-parts-b2b.json; with STAGES naming compile, e2e-compile.log and e2e-compile.json; with STAGES naming peers, peers.log and peers.json (the peers' wheels
# in .peers/, PEER_SETS the sets: one a call, as a set with every peer takes minutes).
# Each stage has its own time limit, so a slow stage cannot starve the next; a lent GPU allows 10 minutes a call,
# so run the stages in two or three calls (STAGES below).
# BENCH_DEVICE=cpu runs the same stages on a CPU with tiny sets (a dry run of this script, not a measurement).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export COLUMNS="${COLUMNS:-160}"  # rich tables in the logs: wide enough for every column
BENCH_DEVICE="${BENCH_DEVICE:-cuda}"
# STAGES picks what runs (a lent GPU allows 10 minutes a call: run "tests", "suites", "fusion" and "bench,demo"
# as calls of their own on a fresh machine; "all" runs the whole suite with workers, below)
STAGES=",${STAGES:-tests,suites,fusion,bench,muon,demo},"
stage() { [[ "$STAGES" == *",$1,"* ]]; }

wheels=()
compgen -G ".whl/*.whl" >/dev/null && wheels+=(.whl/*.whl)
stage peers && compgen -G ".peers/*.whl" >/dev/null && wheels+=(.peers/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi

{
    echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${HOSTNAME:-?}, git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi || echo "nvidia-smi failed (exit $?)"
    python3 - <<'PY' || echo "environment probe failed (exit $?)"
import importlib
import sys

print("python", sys.version.split()[0])
for name in ("torch", "triton", "pydantic", "rich", "pytest", "pynvml"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "(no __version__)"))
    except Exception as exc:  # report every missing package, not just the first
        print(name, f"MISSING: {exc}")
import torch

print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY
} 2>&1 | tee "$OUT/env.log"

tests_rc=0
if ! stage tests; then
    echo "cuda tests: not in STAGES"
elif python3 -c "import pytest" 2>/dev/null; then
    # collection errors in other modules (a missing test-only package) must not stop the CUDA tests that can run
    timeout 300 python3 -m pytest -q -m cuda --continue-on-collection-errors tests/ 2>&1 \
        | tee "$OUT/cuda-tests.log" || tests_rc=$?
else
    echo "pytest is not installed here: carry its wheel in .whl/" | tee "$OUT/cuda-tests.log"
    tests_rc=127
fi
echo "cuda tests exit code: $tests_rc"

# the CPU-interpreter suites on the GPU (their `device` fixture is CUDA here): the same trajectories through the
# compiled kernels, and the tests marked `slow` that `make test` leaves out (test_live_compare checks the CPU
# profiler's windows). Two stages: `suites` (the kernels, CUDA graphs, memory pool, streams and optimizers, ~310
# tests) and `fusion` (the fused executor, ~550). Each takes about a minute once Triton's cache holds the kernels;
# compiling them on a fresh machine took 400 s for 850 of the 860
# (H200, 2026-12-02), so on a fresh machine give each a call of its own (STAGES=suites, then STAGES=fusion)
suite() {  # suite NAME LOG PATHS...: pytest on PATHS into $OUT/LOG, its exit code in gpu_suites_rc (the first failure)
    local name=$1 log=$2 rc=0
    shift 2
    if stage "$name" && python3 -c "import pytest" 2>/dev/null; then
        timeout "${SUITE_TIMEOUT:-420}" python3 -m pytest -q "$@" 2>&1 | tee "$OUT/$log" || rc=$?
        echo "$name suite exit code: $rc"
        [ "$gpu_suites_rc" -ne 0 ] || gpu_suites_rc=$rc
    fi
}
gpu_suites_rc=0
suite suites gpu-suites.log tests/kernels tests/graphs tests/memory tests/streams tests/optim
suite fusion gpu-fusion.log tests/fusion --ignore tests/fusion/test_live_compare.py
# STAGES=all: the whole suite at once, the CUDA tests and the slow ones included, a test file per worker
# (pytest-xdist's wheel in .whl/; GPU_WORKERS workers, 6 by default: Triton compiles on the host's cores, so a fresh
# machine's compiles spread over them), for a call that must check everything in one go
if stage all && python3 -c "import xdist" 2>/dev/null; then
    suite all gpu-all.log -n "${GPU_WORKERS:-6}" --dist loadfile -rfE tests
elif stage all; then
    suite all gpu-all.log -rfE tests
fi

bench_rc=0
stage bench && {
# timed steps: 50 for gpt2 and many, 20 for llama1b (each set's default); bench.json is rewritten after each set
timeout 330 python3 -m kitsune.bench --device "$BENCH_DEVICE" --sets gpt2,many,llama1b --warmup 10 --phase --e2e \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || bench_rc=$?
}
# the same rows with the grads freed and re-allocated before every step, as a training loop's zero_grad() and
# backward() leave them (torch's graph and static_addresses=True, which need them in place, are skipped): a stage of
# its own (STAGES=fresh), as the bench's `fresh` row shows the one line so already, and a call brings back 8 files
stage fresh && {
timeout 120 python3 -m kitsune.bench --device "$BENCH_DEVICE" --sets gpt2,many --variants foreach,fused,kitsune,eager \
    --warmup 10 --grads fresh --json "$OUT/bench-fresh.json" 2>&1 | tee "$OUT/bench-fresh.log" || bench_rc=$?
# where the moving grads' host time goes: kept, moving, settled and Python-read grads on many; then the steady
# step part by part with kept grads, moving grads and an LR scheduler, each step after an idle device and back to
# back (their lines appended to bench-fresh.log)
timeout 120 python3 benchmarks/fresh-grads.py --device "$BENCH_DEVICE" --json "$OUT/fresh-grads.json" 2>&1 \
    | tee -a "$OUT/bench-fresh.log" || bench_rc=$?
timeout 120 python3 benchmarks/step-parts.py --device "$BENCH_DEVICE" --json "$OUT/step-parts.json" 2>&1 \
    | tee -a "$OUT/bench-fresh.log" || bench_rc=$?
timeout 120 python3 benchmarks/step-parts.py --device "$BENCH_DEVICE" --back-to-back \
    --json "$OUT/step-parts-b2b.json" 2>&1 | tee -a "$OUT/bench-fresh.log" || bench_rc=$?
}

# the same end-to-end run with the model compiled (torch.compile, inductor) on every side: a separate stage, as
# compiling takes a minute or two (STAGES=compile)
compile_rc=0
stage compile && {
timeout 270 python3 -m kitsune.bench --device "$BENCH_DEVICE" --sets gpt2 --variants fused,kitsune --e2e --compile \
    --json "$OUT/e2e-compile.json" 2>&1 | tee "$OUT/e2e-compile.log" || compile_rc=$?
}

# the optimizers users pick instead (kitsune bench --peers), on the sets of PEER_SETS; a peer has 90 s a set
# (kitsune.bench.runner.PEER_SECONDS), so `many` with every peer should fit a call; PEERS (names as --peers takes
# them, comma-separated; default all) splits a set's peers over calls where it does not
peers_rc=0
stage peers && {
timeout 570 python3 -m kitsune.bench --device "$BENCH_DEVICE" --peers "${PEERS:-all}" --sets "${PEER_SETS:-many}" \
    --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log" || peers_rc=$?
}

muon_rc=0
stage muon && {
timeout 170 python3 -m kitsune.bench --muon --json "$OUT/muon.json" 2>&1 | tee "$OUT/muon.log" || muon_rc=$?
}

demo_rc=0
stage demo && {
timeout 90 python3 -m kitsune demo --device "$BENCH_DEVICE" --profile-out "$OUT/demo-profile.json" 2>&1 \
    | tee "$OUT/demo.log" || demo_rc=$?
}

echo "cuda tests exit code: $tests_rc (124: timed out); suites on the GPU: $gpu_suites_rc;" \
    "bench exit code: $bench_rc (1: a variant failed); compiled e2e: $compile_rc; peers: $peers_rc;" \
    "muon bench exit code: $muon_rc;" \
    "demo exit code: $demo_rc" | tee "$OUT/exit-codes.txt"
if [ "$tests_rc" -ne 0 ]; then
    exit "$tests_rc"
fi
if [ "$gpu_suites_rc" -ne 0 ]; then
    exit "$gpu_suites_rc"
fi
exit "$bench_rc"
