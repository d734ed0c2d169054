"""Sharded optimizer state (ZeRO stages 1 and 2): 2 CPU processes on gloo (spawned once, with a timeout) against
one process.

Each rank trains on its half of every batch with ``zero_stage`` set and no DDP wrapper (the shard subsystem
averages the grads); after every step both ranks must hold the params one process gets from the whole batch, and
each rank must hold the optimizer state of about half of the params. One spawn runs every case (the ranks' results
are saved, the tests below read them); cases that name ``fused`` run the fused kernels in Triton's interpreter
(TRITON_INTERPRET=1), the others the wrapped optimizer's own step on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import run_ranks

STEPS = 4
BUCKET_BYTES = 1024  # several buckets even for this small model, so some reduce during backward
CASES = {
    "zero1_adamw": {"stage": 1, "opt": "adamw"},
    "zero2_adamw_clip": {"stage": 2, "opt": "adamw", "max_grad_norm": 0.05},
    "zero1_sgd_clip_no_overlap": {"stage": 1, "opt": "sgd", "max_grad_norm": 0.05, "overlap": False},
    "zero2_sgd_accumulate": {"stage": 2, "opt": "sgd", "accumulate": 2},
    "zero1_sgd_accumulate_context": {"stage": 1, "opt": "sgd", "accumulate": 2, "context": True},
    "zero2_adamw_clip_fused": {"stage": 2, "opt": "adamw", "max_grad_norm": 0.05, "fused": True},
    "zero1_sgd_clip_inf_fused": {"stage": 1, "opt": "sgd", "max_grad_norm": 0.02, "norm_type": "inf", "fused": True},
    # float16 loss scaling; rank 1's half of one batch overflows: every rank must skip that step, as one process does
    # (SGD: AdamW's m / sqrt(v) turns the float16 rounding of near-zero grads into whole lr-sized differences)
    "zero2_fp16_overflow": {"stage": 2, "opt": "sgd", "amp": True},
    "zero1_fp16_overflow_clip_fused": {"stage": 1, "opt": "sgd", "amp": True, "max_grad_norm": 0.05, "fused": True},
    # p.data = ... on one param before step MOVE_STEP, on every rank: only its owner's fused units hold it, so only
    # that rank sees the move; its re-plan must not run a collective the other rank does not (gloo aborted)
    "zero1_adamw_fused_storage_moved": {"stage": 1, "opt": "adamw", "fused": True, "move": True},
}
OVERFLOW_STEP = 2
MOVE_STEP = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)  # fresh random data every step
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


def _optimizer(model: torch.nn.Module, case: dict, stage: int):
    from kitsune import AMPConfig, GradConfig, KitsuneOptimizer, ShardConfig

    if case["opt"] == "adamw":
        base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    grads = GradConfig(max_norm=case.get("max_grad_norm"), norm_type=case.get("norm_type", 2.0))
    shard = ShardConfig(stage=stage, bucket_bytes=BUCKET_BYTES, overlap=case.get("overlap", True))
    amp = {"enable_amp": True, "amp_config": AMPConfig(dtype=torch.float16)} if case.get("amp") else {}
    return KitsuneOptimizer(
        base, enable_fusion=case.get("fused", False), grad_config=grads, shard_config=shard, capture_graph=False, **amp
    )


def _train(model, opt, steps, rank: int, world: int, case: dict, first: int = 0) -> None:
    k = case.get("accumulate", 1)
    for step in range(first, first + steps):
        x, y = _batch(step)
        if case.get("move") and step == MOVE_STEP:
            first = next(iter(model.parameters()))
            first.data = first.data.clone()  # the same values in a new storage
        if case.get("amp") and step == OVERFLOW_STEP:
            x[-1, 0] = float("inf")  # in the last row: rank 1's half
        lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
        xs, ys = x[lo:hi].chunk(k), y[lo:hi].chunk(k)
        for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
            quiet = case.get("context") and i < k - 1 and world > 1
            with opt.accumulating() if quiet else _null():
                with opt.autocast():
                    loss = torch.nn.functional.mse_loss(model(xi).float(), yi) / k
                opt.backward(loss)
        opt.step()
        opt.zero_grad()


class _null:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def _state(opt) -> dict:
    return {
        k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
        for k, s in opt.state_dict()["state"].items()
    }


def _run_case(name: str, case: dict, rank: int, world: int) -> dict:
    from kitsune.distributed import consolidated_state_dict
    from kitsune.distributed.zero import state_numel

    os.environ["TRITON_INTERPRET"] = "1" if case.get("fused") else "0"  # the planner reads it when it plans
    ref_model = _model()
    ref = _optimizer(ref_model, case, stage=0)
    _train(ref_model, ref, STEPS, 0, 1, case)

    model = _model()
    opt = _optimizer(model, case, stage=case["stage"])
    _train(model, opt, STEPS, rank, world, case)
    status = {s["name"]: s for s in opt.subsystem_status()}
    out = {
        "params": [p.detach().clone() for p in model.parameters()],
        "ref_params": [p.detach().clone() for p in ref_model.parameters()],
        "state_numel": state_numel(opt),
        "ref_state_numel": state_numel(ref),
        "shard": status["shard"],
        "fusion_fused": status["fusion"]["report"].get("params_fused", 0) if status["fusion"]["active"] else 0,
        "skipped_steps": opt.skipped_steps,
        "last_grad_norm": None if opt.last_grad_norm is None else float(opt.last_grad_norm),
        "ref_last_grad_norm": None if ref.last_grad_norm is None else float(ref.last_grad_norm),
    }
    if name == "zero2_adamw_clip":
        full = consolidated_state_dict(opt, to=None)
        plain = torch.optim.AdamW(_model().parameters(), lr=1e-2, weight_decay=0.1)
        plain.load_state_dict(full)  # the plain torch optimizer over the whole model takes it
        out["consolidated_state"] = _state(plain)
        out["ref_state"] = _state(ref)
        out["to_rank0"] = consolidated_state_dict(opt, to=0) is not None
        out["local_state_keys"] = sorted(opt.state_dict()["state"])
        # and back: a fresh sharded run loads the consolidated dict (each rank keeps its share) and goes on
        resumed = _model()
        resumed.load_state_dict(model.state_dict())
        again = _optimizer(resumed, case, stage=case["stage"])
        again.load_state_dict(full)
        out["resumed_state_numel"] = state_numel(again)
        _train(resumed, again, 2, rank, world, case, first=STEPS)
        _train(ref_model, ref, 2, 0, 1, case, first=STEPS)
        out["resumed_params"] = [p.detach().clone() for p in resumed.parameters()]
        out["ref_resumed_params"] = [p.detach().clone() for p in ref_model.parameters()]
        try:  # a rank's own shard does not load on the other rank
            other = _optimizer(_model(), case, stage=case["stage"])
            shard_sd = opt.state_dict()
            shard_sd["kitsune"]["subsystems"]["shard"]["rank"] = 1 - rank
            other.load_state_dict(shard_sd)
            out["wrong_shard_error"] = ""
        except ValueError as err:
            out["wrong_shard_error"] = str(err)
    return out


def _cases(rank: int, world: int) -> dict:
    return {name: _run_case(name, case, rank, world) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_cases, world=2, timeout_s=180)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process(ranks, name):
    for r in ranks:
        got = r[name]
        tol = 1e-3 if CASES[name].get("amp") else 2e-5  # float16 autocast rounds half a batch unlike the whole
        for a, b in zip(got["params"], got["ref_params"], strict=True):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        if CASES[name].get("amp"):
            assert got["skipped_steps"] == 1
        elif CASES[name].get("max_grad_norm"):  # the norm clipped is the global one, not this rank's share
            assert got["last_grad_norm"] == pytest.approx(got["ref_last_grad_norm"], rel=1e-5)
            assert got["ref_last_grad_norm"] > CASES[name]["max_grad_norm"]  # so the clip acted
    for a, b in zip(ranks[0][name]["params"], ranks[1][name]["params"], strict=True):
        assert torch.equal(a, b)  # the all-gather keeps the replicas identical


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_about_half_of_the_state(ranks, name):
    numels = [r[name]["state_numel"] for r in ranks]
    total = ranks[0][name]["ref_state_numel"]
    assert sum(numels) == total  # each param's state on exactly one rank
    largest = max(p.numel() for p in _model().parameters()) * (2 if CASES[name]["opt"] == "adamw" else 1)
    for n in numels:
        assert abs(n - total / 2) <= largest / 2, (numels, total)
    shard = ranks[0][name]["shard"]
    assert shard["active"] and shard["report"]["stage"] == CASES[name]["stage"]
    if CASES[name].get("fused"):
        assert ranks[0][name]["fusion_fused"] == shard["report"]["params_owned"]  # fused kernels, own params only


def test_overlap_reduces_buckets_during_backward(ranks):
    overlapped = ranks[0]["zero1_adamw"]["shard"]["report"]
    assert overlapped["buckets"] > 1 and overlapped["buckets_reduced_in_backward"] == overlapped["buckets"]
    assert overlapped["buckets_reduced_in_step"] == 0
    in_step = ranks[0]["zero1_sgd_clip_no_overlap"]["shard"]["report"]
    assert in_step["buckets_reduced_in_backward"] == 0 and in_step["buckets_reduced_in_step"] == in_step["buckets"]
    context = ranks[0]["zero1_sgd_accumulate_context"]["shard"]["report"]  # the last micro-step reduces, once
    assert context["buckets_reduced_in_backward"] == context["buckets"]
    twice = ranks[0]["zero2_sgd_accumulate"]["shard"]["report"]  # without the context: every micro-step reduces
    assert twice["buckets_reduced_in_backward"] == 2 * twice["buckets"]


def test_consolidated_state_dict_loads_into_torch_and_back(ranks):
    for r in ranks:
        got = r["zero2_adamw_clip"]
        assert set(got["consolidated_state"]) == set(got["ref_state"])
        for key, state in got["ref_state"].items():
            for name, want in state.items():
                torch.testing.assert_close(got["consolidated_state"][key][name], want, atol=2e-5, rtol=2e-5)
        for a, b in zip(got["resumed_params"], got["ref_resumed_params"], strict=True):
            torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
        assert got["resumed_state_numel"] == got["state_numel"]  # each rank kept only its share
        assert "load the consolidated state dict" in got["wrong_shard_error"]
    assert [r["zero2_adamw_clip"]["to_rank0"] for r in ranks] == [True, False]
    keys = [set(r["zero2_adamw_clip"]["local_state_keys"]) for r in ranks]
    assert not keys[0] & keys[1] and keys[0] | keys[1] == set(ranks[0]["zero2_adamw_clip"]["ref_state"])


# -- without processes (kitsune is imported in the tests: the ranks import it only after TRITON_INTERPRET is set) ----
def test_partition_balances_each_bucket_and_the_whole():
    from kitsune.distributed.zero import partition

    params = [torch.empty(n) for n in (1000, 10, 300, 300, 64, 7, 500, 500, 2)]
    buckets = partition(params, world=2, bucket_bytes=4 * 1200)
    seen = sorted(i for indices, *_ in buckets for i in indices)
    assert seen == list(range(len(params)))
    loads = [0, 0]
    for indices, owners, offsets, seg in buckets:
        for i, o, off in zip(indices, owners, offsets, strict=True):
            loads[o] += params[i].numel()
            assert off % 32 == 0 and off + params[i].numel() <= seg  # 128-byte slots inside the segment
    assert abs(loads[0] - loads[1]) <= 1000
    one = partition([torch.empty(5, dtype=torch.bfloat16), torch.empty(3)], world=2, bucket_bytes=1 << 20)
    assert len(one) == 2  # one bucket per dtype


def test_stage_one_reduces_each_segments_params_not_its_padding():
    """A bucket whose ranks own very different amounts pads the short segments to the longest; stage 1's all-reduce
    covers the elements that hold params in each segment only (a bucket of one large param: half the traffic)."""
    from kitsune.distributed.zero import Bucket, partition

    params = [torch.randn(1000), torch.randn(10), torch.randn(10)]
    ((indices, owners, offsets, seg),) = partition(params, world=2, bucket_bytes=1 << 20)
    bucket = Bucket([params[i] for i in indices], owners, offsets, seg, rank=0)
    assert seg == 1024 and owners == [0, 1, 1]  # 1000 elements in 128-byte slots; the two small ones on rank 1
    assert bucket.used == [1000, 32 + 10]  # rank 1's second param sits in the next 32-element slot
    big = torch.randn(5000)
    alone = partition([big], world=2, bucket_bytes=1 << 20)[0]
    assert Bucket([big], *alone[1:], rank=1).used == [5000]  # nothing of rank 1's segment is reduced


def test_stage_needs_a_process_group():
    from kitsune import KitsuneOptimizer

    with pytest.raises(ValueError, match="init_process_group"):
        KitsuneOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), zero_stage=1)


def test_stage_zero_is_inactive_with_its_reason():
    from kitsune import KitsuneOptimizer

    opt = KitsuneOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    shard = next(s for s in opt.subsystem_status() if s["name"] == "shard")
    assert not shard["active"] and shard["reason"] == "zero_stage=0"


def test_config_rejects_what_cannot_combine():
    from pydantic import ValidationError

    from kitsune import KitsuneConfig, KitsuneOptimizer, ShardConfig, StreamConfig

    with pytest.raises(ValidationError, match="step_in_backward"):
        KitsuneConfig(shard=ShardConfig(stage=2), streams=StreamConfig(step_in_backward=True))
    with pytest.raises(ValidationError):
        ShardConfig(stage=3)
    with pytest.raises(ValidationError, match="ProcessGroup"):
        ShardConfig(stage=1, process_group="world")
    with pytest.raises(ValueError, match="contradicts shard_config.stage"):
        KitsuneOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), zero_stage=1, shard_config=ShardConfig())
    for name, info in ShardConfig.model_fields.items():
        assert info.description, name
    assert KitsuneConfig(shard=ShardConfig(stage=1)).model_dump(mode="json")["shard"]["process_group"] is None
