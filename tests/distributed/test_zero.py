"""Sharded optimizer state (ZeRO stages 1 and 2, the even partition by elements): gloo CPU processes (spawned once
per world size, with a timeout) against one process.

Each rank trains on its share of every batch with ``zero_stage`` set and no DDP wrapper (the shard subsystem
averages the grads); after every step every rank must hold the params one process gets from the whole batch, and
each rank must hold the optimizer state of exactly its elements of the partition. One 2-rank spawn runs every case in
``CASES`` (the ranks' results are saved, the tests below read them); one 3-rank spawn moves a consolidated checkpoint
from 2 ranks to 3. Cases that name ``fused`` run the fused kernels in Triton's interpreter (TRITON_INTERPRET=1), the
others the wrapped optimizer's own step on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import run_ranks

STEPS = 4
LONG = 15  # five turns of the side branch's three patterns
ROWS = 12  # rows per batch: an equal share for 2, 3 and 4 ranks
BUCKET_BYTES = 1024  # several buckets even for this small model, so some reduce during backward, and params span ranks
ALIGN = 32  # fp32 elements per 128-byte slot
STATE_KEYS = {"adamw": 2, "sgd": 1, "lamb": 2}  # per-element state tensors per param
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
    # p.data = ... on one param (one both ranks hold part of) before step MOVE_STEP, on every rank: each rank's shard
    # param follows it, and the fused executor re-plans its own units without a collective (gloo would abort)
    "zero1_adamw_fused_storage_moved": {"stage": 1, "opt": "adamw", "fused": True, "move": True},
    # many steps of the even partition, clipped, with a side branch whose params get no grad on some steps: on every
    # rank (skipped, as torch skips them) or on rank 0 only (rank 0's pieces still take the average)
    "zero1_adamw_side_long": {"stage": 1, "opt": "adamw", "max_grad_norm": 0.05, "side": True, "steps": LONG},
    "zero2_sgd_side_long": {"stage": 2, "opt": "sgd", "max_grad_norm": 0.05, "side": True, "steps": LONG},
    "zero2_adamw_side_fused": {"stage": 2, "opt": "adamw", "max_grad_norm": 0.05, "side": True, "fused": True},
    # zero_grad(set_to_none=False) on the sharded run: a param counts as having a grad when a backward made one since
    # the last step, so the side branch is skipped as torch skips it with set_to_none=True (the reference's)
    "zero1_sgd_side_keep_grads": {"stage": 1, "opt": "sgd", "side": True, "keep": True, "steps": 9},
    # per-param math: LAMB's trust ratios keep every param whole on one rank
    "zero2_lamb_whole": {"stage": 2, "opt": "lamb", "max_grad_norm": 0.5},
    # a frozen first layer (requires_grad=False) stays out of the buckets: no state, never changed, the rest cut evenly
    "zero2_adamw_frozen_fused": {"stage": 2, "opt": "adamw", "max_grad_norm": 0.05, "freeze": True, "fused": True},
    # the params' all-gather left to the next forward (each module waits for its own params): the body's and, on the
    # steps it runs, the side branch's; the side branch's gathers left pending complete at the next step
    "zero1_adamw_clip_gather_in_forward": {"stage": 1, "opt": "adamw", "max_grad_norm": 0.05, "gather": True},
    "zero2_sgd_side_gather_in_forward": {"stage": 2, "opt": "sgd", "side": True, "gather": True, "steps": 9},
    "zero2_adamw_gather_in_forward_fused": {"stage": 2, "opt": "adamw", "gather": True, "fused": True},
}
OVERFLOW_STEP = 2
MOVE_STEP = 2


class _Net(torch.nn.Module):
    """An MLP and, with ``side``, a second branch added on the rows a step picks (no rows: no grad for it)."""

    def __init__(self, side: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4)
        )
        self.side = (
            torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)) if side else None
        )

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.side is not None and rows.any():
            out = torch.where(rows[:, None], out + self.side(x), out)
        return out


def _model(side: bool = False, freeze: bool = False) -> _Net:
    torch.manual_seed(0)
    net = _Net(side)
    net.body[0].requires_grad_(not freeze)
    return net


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)  # fresh random data every step
    return torch.randn(ROWS, 8, generator=gen), torch.randn(ROWS, 4, generator=gen)


def _side_rows(step: int) -> torch.Tensor:
    """The rows the side branch takes: none (no rank has a grad for it), the last row (the last rank's share only),
    or the first and the last."""
    rows = torch.zeros(ROWS, dtype=torch.bool)
    if step % 3 == 1:
        rows[-1] = True
    elif step % 3 == 2:
        rows[0] = rows[-1] = True
    return rows


def _optimizer(model: torch.nn.Module, case: dict, stage: int, group=None, params=None):
    from kitsune import AMPConfig, GradConfig, KitsuneOptimizer, ShardConfig
    from kitsune.optim import LAMB

    params = list(model.parameters()) if params is None else params
    if case["opt"] == "adamw":
        base = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    elif case["opt"] == "lamb":
        base = LAMB(params, lr=1e-2, weight_decay=0.1)
    else:
        base = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    grads = GradConfig(max_norm=case.get("max_grad_norm"), norm_type=case.get("norm_type", 2.0))
    shard = ShardConfig(
        stage=stage,
        bucket_bytes=BUCKET_BYTES,
        overlap=case.get("overlap", True),
        process_group=group,
        gather_in_forward=case.get("gather", False),
    )
    amp = {"enable_amp": True, "amp_config": AMPConfig(dtype=torch.float16)} if case.get("amp") else {}
    return KitsuneOptimizer(
        base, enable_fusion=case.get("fused", False), grad_config=grads, shard_config=shard, capture_graph=False, **amp
    )


def _train(model, opt, steps, rank: int, world: int, case: dict, first: int = 0, before_step=None) -> None:
    k = case.get("accumulate", 1)
    for step in range(first, first + steps):
        x, y = _batch(step)
        rows = _side_rows(step) if case.get("side") else torch.zeros(ROWS, dtype=torch.bool)
        if case.get("move") and step == MOVE_STEP:
            moved = model.body[0].weight
            moved.data = moved.data.clone()  # the same values in a new storage
        if case.get("amp") and step == OVERFLOW_STEP:
            x[-1, 0] = float("inf")  # in the last row: rank 1's half
        lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
        for i, (xi, yi, ri) in enumerate(zip(x[lo:hi].chunk(k), y[lo:hi].chunk(k), rows[lo:hi].chunk(k), strict=True)):
            quiet = case.get("context") and i < k - 1 and world > 1
            with opt.accumulating() if quiet else _null():
                with opt.autocast():
                    loss = torch.nn.functional.mse_loss(model(xi, ri).float(), yi) / k
                opt.backward(loss)
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad(set_to_none=not (case.get("keep") and _sharded(opt)))


def _gather_in_forward(model, opt, ref_model, rank: int, world: int) -> dict:
    """After the last step with ``gather_in_forward``: which params hold the reference values before any forward,
    after a forward of the body alone, and after ``optimizer.wait_params()``; the global forward hook's count."""
    from torch.nn.modules.module import _global_forward_pre_hooks

    def close(params) -> list[bool]:
        return [torch.allclose(p, q, atol=2e-5, rtol=2e-5) for p, q in params]

    pairs = list(zip(model.parameters(), ref_model.parameters(), strict=True))
    body = len(list(model.body.parameters()))
    out = {"hooks_pending": len(_global_forward_pre_hooks), "close_before": close(pairs)}
    x, _ = _batch(0)
    with torch.no_grad():
        model(x, torch.zeros(len(x), dtype=torch.bool))  # the side branch does not run
    out["close_after_forward"] = close(pairs)
    out["hooks_after_forward"] = len(_global_forward_pre_hooks)
    opt.wait_params()
    out["hooks_after_wait"] = len(_global_forward_pre_hooks)
    out["body"] = body
    return out


def _sharded(opt) -> bool:
    return next(s for s in opt.subsystems if s.name == "shard").active


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


def _copy(model: torch.nn.Module, side: bool) -> torch.nn.Module:
    out = _model(side)
    out.load_state_dict(model.state_dict())
    return out


def _run_case(name: str, case: dict, rank: int, world: int) -> dict:
    from kitsune.distributed import consolidated_state_dict, state_numel

    os.environ["TRITON_INTERPRET"] = "1" if case.get("fused") else "0"  # the planner reads it when it plans
    side, steps = case.get("side", False), case.get("steps", STEPS)
    ref_model = _model(side, case.get("freeze", False))
    ref = _optimizer(ref_model, case, stage=0)
    _train(ref_model, ref, steps, 0, 1, case)

    model = _model(side, case.get("freeze", False))
    frozen = [p.detach().clone() for p in model.body[0].parameters()]
    opt = _optimizer(model, case, stage=case["stage"])
    _train(model, opt, steps, rank, world, case)
    gathered = _gather_in_forward(model, opt, ref_model, rank, world) if case.get("gather") else {}
    status = {s["name"]: s for s in opt.subsystem_status()}
    out = {
        **gathered,
        "frozen_unchanged": all(torch.equal(a, b) for a, b in zip(frozen, model.body[0].parameters(), strict=True)),
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
    if side or name == "zero2_adamw_clip":  # the joined state: whole tensors, step counts included
        out["consolidated_state"] = _state(_plain(model, consolidated_state_dict(opt, to=None), case))
        out["ref_state"] = _state(ref)
    if name == "zero2_adamw_clip":
        out.update(_checkpoints(model, opt, ref_model, ref, case, rank, world))
    return out


def _plain(model: torch.nn.Module, full: dict, case: dict, groups=None) -> torch.optim.Optimizer:
    """The plain torch optimizer over a copy of ``model``, loaded with ``full``; ``groups(model)``: its param groups
    as the sharded run's (default: one group of every param)."""
    cls = torch.optim.AdamW if case["opt"] == "adamw" else torch.optim.SGD
    copy = _copy(model, case.get("side", False))
    plain = cls([{"params": list(ps)} for ps in (groups or (lambda m: [m.parameters()]))(copy)], lr=0.1)
    plain.load_state_dict(full)  # the plain torch optimizer over the whole model takes it
    return plain


def _checkpoints(model, opt, ref_model, ref, case: dict, rank: int, world: int) -> dict:
    """A consolidated and a per-rank checkpoint, each loaded into a fresh sharded run that goes on; a load that must
    fail changes nothing."""
    from kitsune.distributed import consolidated_state_dict, state_numel

    out: dict = {}
    full = consolidated_state_dict(opt, to=None)
    out["to_rank0"] = consolidated_state_dict(opt, to=0) is not None
    own = opt.state_dict()
    out["local_state_keys"] = sorted(own["state"])
    resumed, again = _copy(model, False), None
    again = _optimizer(resumed, case, stage=case["stage"])
    again.load_state_dict(full)  # each rank keeps its own elements
    out["resumed_state_numel"] = state_numel(again)
    mine, mine_opt = _copy(model, False), None
    mine_opt = _optimizer(mine, case, stage=case["stage"])
    mine_opt.load_state_dict(own)  # this rank's own shard, back into the same rank
    out["own_round_trip"] = _same(_state(mine_opt), _state(opt))
    _train(resumed, again, 2, rank, world, case, first=STEPS)
    _train(mine, mine_opt, 2, rank, world, case, first=STEPS)
    _train(ref_model, ref, 2, 0, 1, case, first=STEPS)
    out["resumed_params"] = [p.detach().clone() for p in resumed.parameters()]
    out["own_resumed_params"] = [p.detach().clone() for p in mine.parameters()]
    out["ref_resumed_params"] = [p.detach().clone() for p in ref_model.parameters()]
    try:  # a rank's own shard does not load on the other rank
        other = _optimizer(_model(), case, stage=case["stage"])
        shard_sd = opt.state_dict()
        shard_sd["kitsune"]["subsystems"]["shard"]["rank"] = 1 - rank
        other.load_state_dict(shard_sd)
        out["wrong_shard_error"] = ""
    except ValueError as err:
        out["wrong_shard_error"] = str(err)
    bad = {**full, "state": dict(full["state"])}  # one moment a row short: refused before anything changes
    bad["state"][4] = {**bad["state"][4], "exp_avg_sq": bad["state"][4]["exp_avg_sq"].reshape(-1)[:-1]}
    before = _state(again)
    try:
        again.load_state_dict(bad)
        out["bad_load_error"] = ""
    except ValueError as err:
        out["bad_load_error"] = str(err)
    out["bad_load_changed_nothing"] = _same(_state(again), before)
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(_equal(a[k][n], b[k][n]) for n in a[k]) for k in a
    )


def _equal(x, y) -> bool:
    return torch.equal(x, y) if torch.is_tensor(x) else x == y


def _regroup_groups(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """`_regroup`'s param groups, after its add_param_group."""
    return [list(model.body[4].parameters()), list(model.body[:3].parameters())]


def _regroup(rank: int, world: int) -> dict:
    """``add_param_group`` after some steps: the partition changes, and the state already made moves with it."""
    from kitsune.distributed import consolidated_state_dict, state_numel

    os.environ["TRITON_INTERPRET"] = "0"
    case = {"stage": 2, "opt": "adamw", "max_grad_norm": 0.05}
    out = {}
    for stage, r, w in ((0, 0, 1), (2, rank, world)):
        model = _model()
        opt = _optimizer(model, {**case, "stage": stage}, stage)
        first, later = _regroup_groups(model)
        opt.param_groups[0]["params"] = first  # the last layer only, to start with
        _train(model, opt, 2, r, w, case)
        opt.add_param_group({"params": later, "lr": 5e-3})
        _train(model, opt, 3, r, w, case, first=2)
        out[stage] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "state": _state(_plain(model, consolidated_state_dict(opt, to=None), case, _regroup_groups)),
            "state_numel": state_numel(opt),
        }
    return out


MIDSTEP = 4
"""`_regroup_midstep` adds its param group between this step's backward and its step: a step on which only the
last rank has rows for the side branch (`_side_rows`)."""


def _regroup_midstep(rank: int, world: int) -> dict:
    """``add_param_group`` between a backward and its step (stages 1 and 2, against one process), on a step where only
    the last rank has a grad for the side branch: the grads the old layout reduced go back into the params and are
    reduced again under the new one, the side branch's at full weight on every rank. The group added holds a param
    outside the model (it never gets a grad)."""
    from kitsune.distributed import consolidated_state_dict

    os.environ["TRITON_INTERPRET"] = "0"
    case = {"opt": "adamw", "max_grad_norm": 0.05, "side": True}
    out = {}
    for stage, r, w in ((0, 0, 1), (1, rank, world), (2, rank, world)):
        model = _model(True)
        extra = torch.nn.Parameter(torch.randn(40, generator=torch.Generator().manual_seed(7)))
        opt = _optimizer(model, case, stage)
        _train(model, opt, MIDSTEP, r, w, case)
        add = lambda opt=opt, extra=extra: opt.add_param_group({"params": [extra], "lr": 5e-3})  # noqa: E731
        _train(model, opt, 1, r, w, case, first=MIDSTEP, before_step=add)
        _train(model, opt, 2, r, w, case, first=MIDSTEP + 1)
        full = consolidated_state_dict(opt, to=None)
        out[stage] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "extra_unchanged": torch.equal(extra, torch.randn(40, generator=torch.Generator().manual_seed(7))),
            "state": _state(_plain(model, full, case, lambda m, extra=extra: [m.parameters(), [extra]])),
        }
    return out


LOW_PRECISION = {"8bit": 2, "bf16": 1}  # state_precision -> the ZeRO stage it runs under


def _low_precision(rank: int, world: int) -> dict:
    """Low-precision state under ZeRO (fused, interpreted): each rank keeps its pieces in the format (8-bit blocks
    start at each piece), against one process in the same precision and in fp32; the consolidated state dict in
    torch's keys loads into plain torch, and into a fresh sharded run that goes on exactly as the original."""
    from kitsune import FusionConfig, GradConfig, KitsuneOptimizer, ShardConfig
    from kitsune.distributed import consolidated_state_dict

    os.environ["TRITON_INTERPRET"] = "1"
    case = {"opt": "adamw", "max_grad_norm": 0.05}
    out = {}
    for precision, stage in LOW_PRECISION.items():

        def make(model, stage, precision=precision):
            fusion = FusionConfig(enabled=True, state_precision=precision, min_8bit_size=64)
            return KitsuneOptimizer(
                torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                enable_fusion=True,
                fusion_config=fusion,
                grad_config=GradConfig(max_norm=0.05),
                shard_config=ShardConfig(stage=stage, bucket_bytes=BUCKET_BYTES),
                capture_graph=False,
            )

        runs = {}
        for name, (fmt, st) in {"ref": (precision, 0), "fp32": ("param", 0), "sharded": (precision, stage)}.items():
            model = _model()
            opt = make(model, st, fmt)
            _train(model, opt, STEPS, rank if st else 0, world if st else 1, case)
            runs[name] = (model, opt)

        def params(m):
            return [p.detach().clone() for p in m.parameters()]

        model, opt = runs["sharded"]
        trained = params(model)
        keys = sorted({k for s in opt.state.values() for k in s})
        full = consolidated_state_dict(opt, to=None)
        plain = _plain(model, full, case)
        resumed = _copy(model, False)
        again = make(resumed, stage)
        again.load_state_dict(full)
        for m, o in ((resumed, again), (model, opt)):
            _train(m, o, 2, rank, world, case, first=STEPS)
        # one param of 4 blocks cut in two at a block boundary: each rank's blocks are the whole param's blocks
        aligned = {}
        for name, (fmt, st) in {"ref": (precision, 0), "fp32": ("param", 0), "sharded": (precision, stage)}.items():
            torch.manual_seed(1)
            w = torch.nn.Parameter(torch.randn(4 * 256))
            opt = make(torch.nn.ParameterList([w]), st, fmt)
            gen = torch.Generator().manual_seed(2)
            for _ in range(LONG):
                w.grad = torch.randn(w.shape, generator=gen) * torch.rand(w.shape, generator=gen) ** 3
                opt.step()
                opt.zero_grad()
            aligned[name] = w.detach().clone()
        out[precision] = {
            "aligned": aligned,
            "keys": keys,
            "params": trained,
            "continued": params(model),
            "ref": params(runs["ref"][0]),
            "fp32": params(runs["fp32"][0]),
            "full_state": {k: {n: (v.dtype, tuple(v.shape)) for n, v in st.items()} for k, st in full["state"].items()},
            "plain_keys": sorted({n for st in plain.state.values() for n in st}),
            "resumed": params(resumed),
        }
    return out


def _mismatches(rank: int, world: int) -> dict:
    """Ranks that built their optimizers differently: each build's error on this rank (None: it built)."""
    from kitsune import KitsuneOptimizer, ShardConfig

    def build(params, shard) -> str | None:
        try:
            KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), shard_config=shard, capture_graph=False)
        except ValueError as exc:
            return str(exc)
        return None

    model = _model()
    other = _Net(side=True) if rank == 1 else model  # rank 1 holds more params
    return {
        "params": build(list(other.parameters()), ShardConfig(stage=1, bucket_bytes=BUCKET_BYTES)),
        "stage": build(list(model.parameters()), ShardConfig(stage=1 + rank, bucket_bytes=BUCKET_BYTES)),
        "bucket_bytes": build(list(model.parameters()), ShardConfig(stage=1, bucket_bytes=BUCKET_BYTES * (1 + rank))),
        "same": build(list(model.parameters()), ShardConfig(stage=1, bucket_bytes=BUCKET_BYTES)),
    }


def _cases(rank: int, world: int) -> dict:
    return {
        **{name: _run_case(name, case, rank, world) for name, case in CASES.items()},
        "regroup": _regroup(rank, world),
        "regroup_midstep": _regroup_midstep(rank, world),
        "low_precision": _low_precision(rank, world),
        "mismatches": _mismatches(rank, world),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_cases, world=2, timeout_s=240)


def _layouts(case: dict, world: int = 2):
    """The partition the ranks compute, computed here: reverse registration order, whole params for LAMB."""
    from kitsune.distributed.layout import partition

    order = [p for p in _model(case.get("side", False), case.get("freeze", False)).parameters() if p.requires_grad]
    order = order[::-1]
    return order, partition(order, world, BUCKET_BYTES, [case["opt"] == "lamb"] * len(order))


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process(ranks, name):
    case = CASES[name]
    for r in ranks:
        got = r[name]
        tol = 1e-3 if case.get("amp") else 2e-5  # float16 autocast rounds half a batch unlike the whole
        for a, b in zip(got["params"], got["ref_params"], strict=True):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        if case.get("amp"):
            assert got["skipped_steps"] == 1
        elif case.get("max_grad_norm"):  # the norm clipped is the global one, not this rank's share
            assert got["last_grad_norm"] == pytest.approx(got["ref_last_grad_norm"], rel=1e-5)
            assert got["ref_last_grad_norm"] > case["max_grad_norm"]  # so the clip acted
    for a, b in zip(ranks[0][name]["params"], ranks[1][name]["params"], strict=True):
        assert torch.equal(a, b)  # the all-gather keeps the replicas identical
    if case.get("freeze"):
        assert all(r[name]["frozen_unchanged"] for r in ranks)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_the_state_of_its_elements(ranks, name):
    from kitsune.distributed.layout import elements_per_rank

    case = CASES[name]
    order, layouts = _layouts(case)
    per_rank = elements_per_rank(layouts, 2)
    numels = [r[name]["state_numel"] for r in ranks]
    assert numels == [n * STATE_KEYS[case["opt"]] for n in per_rank]  # exactly its elements' state
    assert sum(numels) == ranks[0][name]["ref_state_numel"]  # each element's state on exactly one rank
    shard = ranks[0][name]["shard"]
    assert shard["active"] and shard["report"]["stage"] == case["stage"]
    total = sum(p.numel() for p in order)
    if case["opt"] == "lamb":
        assert shard["report"]["whole_params"] == {"LAMB's trust ratio needs the norms of whole params": len(order)}
        assert shard["report"]["params_split"] == 0
    else:  # even: within a 128-byte slot per bucket of half
        assert max(per_rank) <= total / 2 + ALIGN * len(layouts), per_rank
        assert shard["report"]["whole_params"] == {} and shard["report"]["params_split"] > 0
    if case.get("fused"):  # fused kernels, over what this rank updates only (whole params and shard params)
        frozen = 2 if case.get("freeze") else 0  # planned as without ZeRO: in the groups, skipped with no grad
        assert ranks[0][name]["fusion_fused"] == shard["report"]["params_owned"] + frozen


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


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.get("side")] + ["zero2_adamw_clip"])
def test_consolidated_state_is_torchs(ranks, name):
    """The ranks' pieces joined into whole tensors equal one process's state, which skipped the side branch on the
    steps no rank had a grad for it (its step count says so)."""
    for r in ranks:
        got, want = r[name]["consolidated_state"], r[name]["ref_state"]
        assert set(got) == set(want)
        for key, state in want.items():
            assert set(got[key]) == set(state)
            for n, v in state.items():
                tol = 1e-4 if CASES[name].get("steps") else 2e-5
                torch.testing.assert_close(got[key][n], v, atol=tol, rtol=tol)
    if CASES[name].get("side"):
        first_side = len(list(_model().parameters()))  # the side branch's params come after the body's
        steps = CASES[name].get("steps", STEPS)
        stepped = sum(bool(_side_rows(s).any()) for s in range(steps))
        if "step" in ranks[0][name]["ref_state"][first_side]:
            assert float(ranks[0][name]["consolidated_state"][first_side]["step"]) == stepped < steps


def test_checkpoints_load_into_torch_and_back(ranks):
    for r in ranks:
        got = r["zero2_adamw_clip"]
        for key in ("resumed_params", "own_resumed_params"):
            for a, b in zip(got[key], got["ref_resumed_params"], strict=True):
                torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
        assert got["resumed_state_numel"] == got["state_numel"]  # each rank kept only its elements
        assert got["own_round_trip"]  # a rank's own state dict loads back as it was
        assert "load the consolidated state dict" in got["wrong_shard_error"]
        assert "has 95 elements where 96 belong" in got["bad_load_error"] and got["bad_load_changed_nothing"]
    assert [r["zero2_adamw_clip"]["to_rank0"] for r in ranks] == [True, False]
    keys = [set(r["zero2_adamw_clip"]["local_state_keys"]) for r in ranks]
    assert keys[0] | keys[1] == set(ranks[0]["zero2_adamw_clip"]["ref_state"])
    order, layouts = _layouts(CASES["zero2_adamw_clip"])
    index = {id(p): i for i, p in enumerate(order[::-1])}
    split = {
        index[id(order[i])] for L in layouts for k, i in enumerate(L.indices) if 0 < L.range(k, 0)[1] < L.numels[k]
    }
    assert keys[0] & keys[1] == split and split  # a param both ranks hold part of has state on both


# -- a consolidated checkpoint from 2 ranks into 3 -------------------------------------------------------------------
RESHARD = {"stage": 2, "opt": "adamw", "max_grad_norm": 0.05, "side": True}


def _reshard(rank: int, world: int) -> dict:
    """Ranks 0 and 1 train with ZeRO-2 on a group of their own and consolidate; all 3 ranks load that into ZeRO-1
    over the 3 and go on, against one process all along."""
    import torch.distributed as dist

    from kitsune.distributed import consolidated_state_dict, state_numel

    os.environ["TRITON_INTERPRET"] = "0"
    pair = dist.new_group([0, 1])  # a collective: every rank creates it
    ref_model = _model(True)
    ref = _optimizer(ref_model, RESHARD, stage=0)
    _train(ref_model, ref, STEPS, 0, 1, RESHARD)
    sent: list = [None, None]
    if rank < 2:
        model = _model(True)
        opt = _optimizer(model, RESHARD, stage=2, group=pair)
        _train(model, opt, STEPS, rank, 2, RESHARD)
        sent = [consolidated_state_dict(opt, to=0), model.state_dict()]
    dist.broadcast_object_list(sent, src=0)
    later = {**RESHARD, "stage": 1}
    model = _model(True)
    model.load_state_dict(sent[1])
    opt = _optimizer(model, later, stage=1)
    opt.load_state_dict(sent[0])
    loaded = state_numel(opt)
    _train(model, opt, STEPS, rank, world, later, first=STEPS)
    _train(ref_model, ref, STEPS, 0, 1, later, first=STEPS)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "ref_params": [p.detach().clone() for p in ref_model.parameters()],
        "loaded_state_numel": loaded,
        "state_numel": state_numel(opt),
        "ref_state_numel": state_numel(ref),
        "report": next(s for s in opt.subsystem_status() if s["name"] == "shard")["report"],
    }


def test_consolidated_checkpoint_moves_to_another_world_size():
    from kitsune.distributed.layout import elements_per_rank

    res = run_ranks(_reshard, world=3, timeout_s=180)
    _, layouts = _layouts(RESHARD, world=3)
    per_rank = elements_per_rank(layouts, 3)
    for rank, r in enumerate(res):
        for a, b in zip(r["params"], r["ref_params"], strict=True):
            torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
        assert r["loaded_state_numel"] == r["state_numel"] == 2 * per_rank[rank]  # its elements, from the start
        assert r["report"]["world_size"] == 3 and r["report"]["params_split"] > 0
    assert sum(r["state_numel"] for r in res) == res[0]["ref_state_numel"]


# -- without processes (kitsune is imported in the tests: the ranks import it only after TRITON_INTERPRET is set) ----
def _random_params(gen: torch.Generator) -> list[torch.Tensor]:
    sizes = torch.randint(0, 700, (int(torch.randint(1, 30, (), generator=gen)),), generator=gen).tolist()
    sizes[0] = 1  # a one-element param, and (sizes permitting) empty ones
    dtypes = [torch.float32, torch.bfloat16]
    return [torch.empty(n, device="meta", dtype=dtypes[int(torch.randint(0, 2, (), generator=gen))]) for n in sizes]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_element_ranges_cover_every_param_once(world):
    """Over random params, bucket sizes and whole-or-not flags: the ranks' ranges of each param tile it in rank
    order, each rank within its aligned segment; a whole param lies in one rank's segment."""
    from kitsune.distributed.layout import ALIGN_BYTES, elements_per_rank, partition

    gen = torch.Generator().manual_seed(world)
    for _ in range(40):
        params = _random_params(gen)
        whole = [bool(torch.rand((), generator=gen) < 0.3) for _ in params]
        layouts = partition(params, world, int(torch.randint(64, 4096, (), generator=gen)), whole)
        assert sorted(i for L in layouts for i in L.indices) == list(range(len(params)))
        for L in layouts:
            align = ALIGN_BYTES // params[L.indices[0]].element_size()
            assert L.seg % align == 0 and all(s % align == 0 for s in L.starts)
            assert len({(params[i].dtype, whole[i]) for i in L.indices}) == 1
            for k, n in enumerate(L.numels):
                ranges = [L.range(k, r) for r in range(world)]
                pieces = [(lo, hi) for lo, hi in ranges if hi > lo]
                if n:  # in rank order, each starting where the one before ends, from 0 to n
                    assert [lo for lo, _ in pieces] == [0] + [hi for _, hi in pieces[:-1]] and pieces[-1][1] == n
                assert all(hi - lo <= L.seg for lo, hi in ranges)
                if L.whole:
                    assert len(pieces) == (n > 0)
                assert sum(L.updates(k, r) for r in range(world)) == (world if n == 0 else len(pieces))
        assert sum(elements_per_rank(layouts, world)) == sum(p.numel() for p in params)


@pytest.mark.parametrize("name", ["gpt2", "llama1b"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_even_partition_of_real_shapes(name, world):
    """GPT-2 124M and the 1.2B Llama shapes, 25 MiB buckets: no rank holds more than 1/world of the state + 2%
    (whole params left rank 0 of 2 with 65% of GPT-2's, its embedding alone being 31%)."""
    from kitsune.bench.params import PARAM_SETS
    from kitsune.config import ShardConfig
    from kitsune.distributed.layout import elements_per_rank, partition

    params = [torch.empty(shape, device="meta") for _, shape in PARAM_SETS[name].shapes][::-1]
    total = sum(p.numel() for p in params)
    per_rank = elements_per_rank(partition(params, world, ShardConfig().bucket_bytes), world)
    assert sum(per_rank) == total
    assert max(per_rank) <= total / world * 1.02, [n / total for n in per_rank]


def test_stage_one_reduces_the_elements_that_hold_params():
    """Whole params pad the short segments to the longest: stage 1's all-reduce covers the elements that hold params
    in each segment only. Cut by elements, the segments are full but the last, and one all-reduce covers them."""
    from kitsune.distributed.layout import Bucket, partition

    params = [torch.randn(1000), torch.randn(10), torch.randn(10)]
    (whole,) = partition(params, world=2, bucket_bytes=1 << 20, whole=[True] * 3)
    bucket = Bucket([params[i] for i in whole.indices], whole, rank=0, world=2)
    assert whole.seg == 1024 and [whole.updates(k, 1) for k in range(3)] == [False, True, True]
    assert bucket.spans == [(0, 1000), (1024, 1024 + 32 + 10)]  # rank 1's second param sits in the next slot
    (even,) = partition(params, world=2, bucket_bytes=1 << 20)
    assert even.starts == (0, 1024, 1056) and even.seg == 544  # ceil(1066 / 2) rounded up to a 32-element slot
    assert Bucket(params, even, rank=1, world=2).spans == [(0, 1066)]
    assert [even.range(0, r) for r in (0, 1)] == [(0, 544), (544, 1000)]  # the large param spans both ranks


def test_whole_reason_decides_per_optimizer_and_group():
    from kitsune.distributed.layout import whole_reason
    from kitsune.optim import LAMB, LARS, Lion, Muon

    w = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.nn.Parameter(torch.randn(4))
    for cls in (torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, Lion):
        opt = cls([w], lr=0.1)
        assert whole_reason(opt, opt.param_groups[0]) is None
    for cls in (LAMB, LARS):
        opt = cls([w], lr=0.1)
        assert "trust ratio" in whole_reason(opt, opt.param_groups[0])
    muon = Muon([{"params": [w]}, {"params": [b], "use_muon": False}])
    assert "orthogonalises whole matrices" in whole_reason(muon, muon.param_groups[0])
    assert whole_reason(muon, muon.param_groups[1]) is None  # AdamW: cut by elements

    class MyAdamW(torch.optim.AdamW):  # a subclass may change the math
        pass

    mine = MyAdamW([w])
    assert "not an optimizer kitsune knows to be elementwise" in whole_reason(mine, mine.param_groups[0])


def test_a_pieces_8bit_scales_are_checked_against_its_own_elements():
    """A ZeRO piece's 8-bit state needs one absmax per 256 of the piece's elements (not the whole param's): the
    check on load names the param and the fix, and a piece whose block count fits passes."""
    from kitsune.distributed.shard_state import check_sizes
    from kitsune.fusion.state_format import quantize

    p = torch.randn(1000)
    piece = torch.randn(600)  # this rank's 600 of the param's 1000 elements: 3 blocks
    codes, absmax = quantize(piece, signed=True)
    check_sizes({"exp_avg_codes": codes, "exp_avg_absmax": absmax}, 4, piece.numel(), p)
    whole_codes, _ = quantize(p, signed=True)  # the param's codes, with the piece's 3 scales
    with pytest.raises(ValueError, match=r"param 4: .*'exp_avg_absmax' has 3 elements where its 1000 elements need 4"):
        check_sizes({"exp_avg_codes": whole_codes, "exp_avg_absmax": absmax}, 4, p.numel(), p)


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


def _assert_same_run(got: dict, want: dict) -> None:
    """A sharded run's params and consolidated state equal one process's, within fp tolerance."""
    for a, b in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert set(got["state"]) == set(want["state"])
    for key, state in want["state"].items():
        for n, v in state.items():
            torch.testing.assert_close(got["state"][key][n], v, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_add_param_group_between_backward_and_step_keeps_the_reduced_grads(ranks, stage):
    assert _side_rows(MIDSTEP).tolist() == [False] * (ROWS - 1) + [True]  # the last rank's rows only
    for r in ranks:
        got, want = r["regroup_midstep"][stage], r["regroup_midstep"][0]
        assert got["extra_unchanged"] and want["extra_unchanged"]
        _assert_same_run(got, want)


def test_add_param_group_moves_the_state(ranks):
    """The state made before ``add_param_group`` is re-partitioned with the params (gathered and cut anew)."""
    for r in ranks:
        _assert_same_run(r["regroup"][2], r["regroup"][0])
    assert sum(r["regroup"][2]["state_numel"] for r in ranks) == ranks[0]["regroup"][0]["state_numel"]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.get("gather")])
def test_gather_in_forward_completes_each_module_before_its_forward(ranks, name):
    """After a step, the params' all-gathers are pending: every rank holds the other ranks' elements of a split
    param as they were; a module's forward completes its own params' gathers, ``wait_params`` the rest, and the
    global forward hook goes once nothing is pending (the params equal one process's: the test above)."""
    side = CASES[name].get("side", False)
    for r in ranks:
        got = r[name]
        body = got["body"]
        assert got["hooks_pending"] == 1 and not all(got["close_before"])  # stale until gathered
        assert all(got["close_after_forward"][:body])  # the body's modules gathered their own params
        if side:  # the side branch did not run: its gathers stay pending, with the hook
            assert not all(got["close_after_forward"][body:]) and got["hooks_after_forward"] == 1
        else:
            assert got["hooks_after_forward"] == 0
        assert got["hooks_after_wait"] == 0


@pytest.mark.parametrize("precision", list(LOW_PRECISION))
def test_low_precision_state_under_zero(ranks, precision):
    """Sharded 8-bit (stage 2) and bf16 (stage 1) state: the ranks hold their pieces in the format; the params stay
    with one process in the same precision, much closer than to fp32 state (8 bits: within the quantization error,
    as each rank's blocks start at its piece; bf16: elementwise, the same roundings); the consolidated state is
    torch's keys, which plain torch loads; a fresh sharded run resumed from it steps exactly as the original."""
    for r in ranks:
        got = r["low_precision"][precision]
        if precision == "8bit":
            assert {"exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes"} <= set(got["keys"])
        else:
            assert "exp_avg" in got["keys"] and "exp_avg_codes" not in got["keys"]
        diff = max(float((a - b).abs().max()) for a, b in zip(got["params"], got["ref"], strict=True))
        gap = max(float((a - b).abs().max()) for a, b in zip(got["ref"], got["fp32"], strict=True))
        # 8 bits: each rank's blocks start at its piece, so the model's split params round in other blocks than one
        # process's: a difference of the quantization's size, as 8 bits against fp32
        assert gap > 0 and diff <= (3.0 if precision == "8bit" else 0.05) * gap, (diff, gap)
        aligned = got["aligned"]  # cut at a block boundary: the same blocks, the same roundings as one process
        aligned_gap = float((aligned["fp32"] - aligned["ref"]).abs().max())
        assert aligned_gap > 0 and float((aligned["sharded"] - aligned["ref"]).abs().max()) <= 1e-3 * aligned_gap
        for st in got["full_state"].values():  # torch's keys and the whole params' shapes, fp32 for 8-bit state
            assert set(st) == {"exp_avg", "exp_avg_sq", "step"}
            want = torch.float32 if precision == "8bit" else torch.bfloat16
            assert st["exp_avg"][0] == want and st["exp_avg_sq"][0] == want
        assert got["plain_keys"] == ["exp_avg", "exp_avg_sq", "step"]
        for a, b in zip(got["resumed"], got["continued"], strict=True):  # 8-bit state decoded re-encodes as it was
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_ranks_built_differently_raise_on_every_rank_before_any_collective_of_the_step(ranks):
    """Other params, another stage or another bucket size on one rank: every rank raises a ValueError naming the
    difference at build time, instead of running collectives of other sizes (gloo aborts; NCCL hangs)."""
    for rank, res in enumerate(ranks):
        got = res["mismatches"]
        assert "holds other params" in got["params"], rank
        assert "stage=" in got["stage"] and "same settings" in got["stage"], rank
        assert "bucket_bytes=" in got["bucket_bytes"], rank
        assert got["same"] is None, rank
