"""Every distributed mode against one process, on NCCL over every GPU the machine shows (2 to 8; skipped without 2).

Each mode trains the same model over the same batches as one process of plain torch does on the whole batch: each
rank takes its share of every batch, so the averaged grads differ from the whole batch's only by the order of the
sums (the ranks' shares, the ring's reduction). The modes: DDP, ZeRO stage 1, ZeRO stage 2, ZeRO stage 2 with the
params' all-gather left to the next forward, FSDP2 (``fully_shard``), each on the fused kernels (the route is
asserted), and distributed Muon (``process_group``: each rank orthogonalises its share of the matrices, then one
all-gather), whose ranks all take the whole batch, so that its grads are one process's and the check is of the
sharing alone (Newton-Schulz in bfloat16 would carry the sums' rounding on); every mode clips. FSDP2's captured
step and its float16 AMP run over 100 steps are in ``test_fsdp.py``; these are the CPU (gloo) tests' counterparts
at the largest world a machine has.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from ranks import gpu_world, run_ranks, shard_linears

STEPS = 30
BATCH = 48  # divides among 2, 3, 4, 6 and 8 ranks
LR = 1e-2  # AdamW's, and the Muon mode's for its vectors
MUON_LR = 0.02
CLIP = 0.5
MODES = ("ddp", "zero1", "zero2", "zero2_gather_in_forward", "fsdp2", "muon")
FUSED_ROUTES = {"triton", "triton_matmul"}
DISTRIBUTED_MUON = "distributed Muon"  # its own step shares the Newton-Schulz work (the plan says so, base_step)


def _device() -> str:
    """The ranks' GPU on NCCL; the CPU on gloo (a dry run of this module's jobs without GPUs)."""
    import torch.distributed as dist

    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    lin = torch.nn.Linear
    return torch.nn.Sequential(
        lin(24, 128), torch.nn.GELU(), lin(128, 128), torch.nn.GELU(), lin(128, 64), torch.nn.GELU(), lin(64, 4)
    ).to(_device())


def _batches():
    gen = torch.Generator().manual_seed(17)  # fresh random data every step, the same on every rank
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 24, generator=gen), torch.randn(BATCH, 4, generator=gen)
        yield x.to(_device()), y.to(_device())


def _inner(mode: str, model: torch.nn.Module, process_group=None) -> torch.optim.Optimizer:
    if mode == "muon":
        from kitsune.optim import Muon

        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        groups = [{"params": matrices}, {"params": others, "use_muon": False, "lr": LR}]
        return Muon(groups, lr=MUON_LR, weight_decay=0.05, process_group=process_group)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _one_process(mode: str) -> tuple[list[torch.Tensor], list[float]]:
    """Plain torch on the whole batch (kitsune's own Muon, unsharded, for the Muon mode): the reference."""
    model = _model()
    opt = _inner(mode, model)
    norms = []
    for x, y in _batches():
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


def _distributed(mode: str, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from kitsune import KitsuneOptimizer, ShardConfig

    model = _model()
    kwargs: dict = {"enable_fusion": True, "max_grad_norm": CLIP}  # the one line, with clipping
    inner_model = model
    if mode in ("ddp", "muon"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        inner_model = model.module
    elif mode.startswith("zero"):
        kwargs["shard_config"] = ShardConfig(stage=int(mode[4]), gather_in_forward=mode.endswith("forward"))
    else:  # fsdp2
        shard_linears(model, init_device_mesh(_device(), (world,)))
    opt = KitsuneOptimizer(_inner(mode, inner_model, dist.group.WORLD if mode == "muon" else None), **kwargs)
    norms = []
    for x, y in _batches():
        lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
        if mode == "muon":  # the whole batch on every rank: the same grads as one process, bit for bit
            lo, hi = 0, len(x)
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        norms.append(float(opt.last_grad_norm))
        opt.zero_grad()
    opt.wait_params()  # the last step's gathers, where they were left to the next forward
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in inner_model.parameters()]
    return {
        "params": [p.detach().clone() for p in params],
        "norms": norms,
        "routes": sorted({(b.route.value, b.reason or "") for b in opt.plan.buckets}) if opt.plan else [],
        "subsystems": [(s["name"], s["active"], s["reason"]) for s in opt.subsystem_status()],
    }


def _modes(rank: int, world: int) -> dict:
    """Every mode on this rank; a mode that raises is reported with its traceback and the others still run."""
    out: dict = {}
    for mode in MODES:
        try:
            out[mode] = _compare(mode, rank, world)
        except Exception:
            out[mode] = {"error": traceback.format_exc()}
    return out


def _compare(mode: str, rank: int, world: int) -> dict:
    ref_params, ref_norms = _one_process(mode)
    got = _distributed(mode, rank, world)
    got["diff"] = max(float((p - q).abs().max()) for p, q in zip(got["params"], ref_params, strict=True))
    got["moved"] = max(float((p - q).abs().max()) for p, q in zip(got["params"], _initial(), strict=True))
    got["ref_norms"] = ref_norms
    del got["params"]
    return got


def _initial() -> list[torch.Tensor]:
    return [p.detach() for p in _model().parameters()]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_modes, world=gpu_world(), timeout_s=300, backend="nccl")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_one_process_on_nccl(ranks, mode):
    """The params after 30 clipped steps equal one process's within a small fraction of one lr step (the sums'
    order rounds differently, and AdamW's m / sqrt(v) and Newton-Schulz carry it on), on every rank, with the
    kitsune kernels on the update and the same clipped norms."""
    for rank, res in enumerate(ranks):
        r = res[mode]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["routes"], f"rank {rank}: no plan; the subsystems: {r['subsystems']}"
        print(f"{mode} rank {rank} of {len(ranks)}: params within {r['diff']:.3g} (moved {r['moved']:.3g})")
        if mode == "muon":
            assert [(route, DISTRIBUTED_MUON in why) for route, why in r["routes"]] == [("base_step", True)]
        else:
            assert {route for route, _ in r["routes"]} <= FUSED_ROUTES, r["routes"]
        assert r["moved"] > 10 * LR  # the run trained
        assert r["diff"] <= 0.05 * (MUON_LR if mode == "muon" else LR), (mode, rank, r["diff"])
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-4), mode
