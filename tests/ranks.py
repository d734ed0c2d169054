"""The multi-rank harness: a job run on several gloo ranks, each a spawned process, each rank's results returned.

Every rank interprets kitsune's kernels on the CPU (as CI does; on NCCL, with a GPU a rank, they are compiled), uses
one thread, and saves what the job returns; a job that raises on a rank fails the test with that rank's traceback,
and ranks that hang (a collective one rank never joined) fail it after ``timeout_s`` instead of the CI job.
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

Job = Callable[[int, int], dict[str, Any]]
"""``job(rank, world)``: a module-level function (the spawned processes import it by name)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, job: Job, backend: str) -> None:
    if backend == "nccl":  # one GPU a rank, the kernels compiled
        torch.cuda.set_device(rank)
    else:
        os.environ["TRITON_INTERPRET"] = "1"  # before kitsune's kernels are imported in this process
        import interpreter_patch

        interpreter_patch.install()
        import kitsune.kernels.newton_schulz
        import kitsune.kernels.norms
        import kitsune.kernels.update  # noqa: F401

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        results: dict[str, Any] = job(rank, world)
    except Exception:
        results = {"__error__": traceback.format_exc()}
    finally:
        gc.collect()  # FSDP2 modules before the process group (gloo may abort at exit otherwise)
        dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


def shard_linears(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 over ``mesh``: every ``nn.Linear`` child of ``model`` its own ``fully_shard`` unit, then the model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def gpu_world(cap: int = 8) -> int:
    """The world size of the NCCL tests: every GPU this machine shows, 2 to ``cap`` (with fewer than 2 GPUs,
    ``run_ranks`` skips the test)."""
    return min(max(torch.cuda.device_count(), 2), cap)


def run_ranks(job: Job, world: int = 2, timeout_s: int = 120, backend: str = "gloo") -> list[dict[str, Any]]:
    """Run ``job`` on ``world`` ranks; return each rank's results, in rank order. ``backend="nccl"``: rank r on GPU r,
    the kernels compiled (the test skips where fewer than ``world`` GPUs are seen)."""
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs for NCCL, {torch.cuda.device_count()} seen")
    for attempt in range(2):
        try:
            results = _spawn(job, world, timeout_s, backend)
            break
        except mp.ProcessRaisedException as exc:
            # gloo's rendezvous on a loaded host: a rank's connection to another closed before any job code ran;
            # the ranks start again on a new port (once)
            if attempt or "init_process_group" not in str(exc) or "connectFullMesh" not in str(exc):
                raise
    for r, res in enumerate(results):
        if "__error__" in res:
            pytest.fail(f"rank {r} of {job.__module__}.{job.__name__} raised:\n{res['__error__']}")
    return results


def _spawn(job: Job, world: int, timeout_s: int, backend: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _entry, args=(world, free_port(), out, job, backend), nprocs=world, join=False, start_method="spawn"
        )
        for _ in range(timeout_s * 2):
            if ctx.join(timeout=0.5):
                break
        else:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{job.__module__}.{job.__name__}: the {world} ranks did not finish within {timeout_s} s")
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]


def run_cases(jobs: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
    """Inside a rank: each of ``jobs`` (name -> case) in turn, its results under its name; a case that raises leaves
    its traceback (``{"error": ...}``, which `case_results` turns into the test's failure) and the others still run.
    A barrier after each keeps the ranks' cases apart."""
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return results


def case_results(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Every rank's results of case ``name`` (`run_cases`), or the test fails with the first rank's traceback."""
    for r, res in enumerate(ranks):
        if "error" in res.get(name, {}):
            pytest.fail(f"rank {r}, case {name}:\n{res[name]['error']}")
    return [res[name] for res in ranks]
