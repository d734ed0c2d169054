"""Twin trajectories: the same fresh random grads through the plain torch optimizer and through kitsune."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from kitsune import KitsuneOptimizer
from kitsune.graphs import GraphSubsystem

# per-dtype (atol, rtol), set for 50 steps (trajectories run 30); bf16/fp16 against the rounded fp32 reference
TOL = {  # (see trajectory)
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 8e-3),  # ~one bf16 ulp at 1.0
    torch.float16: (1e-3, 1e-3),
}

Groups = Callable[[list[torch.nn.Parameter]], list[dict[str, Any]]]


def make_params(
    sizes: Sequence[int | tuple[int, ...]], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in sizes]


def random_grads(params: Sequence[torch.Tensor], step: int, seed: int = 1) -> list[torch.Tensor]:
    """Fresh non-zero grads for ``step`` (same for both twins), as fp32 draws cast to the param dtype."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    return [(torch.randn(p.shape, generator=gen) * 0.5 + 0.1).to(device=p.device, dtype=p.dtype) for p in params]


def trajectory(
    make_opt: Callable[[Any], torch.optim.Optimizer],
    sizes: Sequence[int | tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    steps: int = 30,
    fused: bool = False,
    groups: Groups | None = None,
    has_grad: Callable[[int, int], bool] | None = None,
    schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
    set_to_none: bool = True,
    rounded: bool = False,
    **kitsune_kwargs: Any,
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Run ``steps`` steps; ``has_grad(step, i)`` False leaves param i's grad None that step.

    ``rounded=True`` is the low-precision reference: torch's optimizer on fp32 copies, with params and state
    rounded to ``dtype`` after every step. That is math in fp32 and storage in ``dtype``, the semantics of the
    fused kernel (and of torch's own fused kernels); torch's eager path instead rounds after every op.
    """
    params = make_params(sizes, dtype, device)
    if rounded:
        low, params = dtype, [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = make_opt(groups(params) if groups else params)
    if fused:
        opt = KitsuneOptimizer(opt, enable_fusion=True, **kitsune_kwargs)
    sched = schedule(opt) if schedule else None
    for step in range(steps):
        grads = random_grads([p.to(low) for p in params] if rounded else params, step)
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if has_grad is None or has_grad(step, i):
                g = g.to(p.dtype)
                p.grad = g if set_to_none or p.grad is None else p.grad.copy_(g)
        opt.step()
        if rounded:
            with torch.no_grad():
                for p in params:
                    p.copy_(p.to(low))
                    for key, t in opt.state.get(p, {}).items():
                        if key != "step" and isinstance(t, torch.Tensor):
                            t.copy_(t.to(low))
        opt.zero_grad(set_to_none=set_to_none)
        if sched is not None:
            sched.step()
    return params, opt


def step_twins(model: torch.nn.Module, twin: torch.nn.Module, opt: Any, ref: Any, x: torch.Tensor) -> None:
    """One step of the same loss (the sum of the outputs' squares on ``x``) on ``model`` with ``opt`` and on its twin
    with ``ref``; their params then agree to a rounding."""
    for m, o in ((model, opt), (twin, ref)):
        m(x).square().sum().backward()
        o.step()
        o.zero_grad()
    for p, t in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


def assert_close_params(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(
            x.detach().to(dtype), y.detach().to(dtype), atol=atol, rtol=rtol, msg=lambda m, i=i: f"param {i}: {m}"
        )


def assert_same_state(
    ref: torch.optim.Optimizer, ours: torch.optim.Optimizer, dtype: torch.dtype, values: bool = True
) -> None:
    """Same params with state, same keys, dtypes, shapes, step counts; values within the dtype's tolerance."""
    atol, rtol = TOL[dtype]
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    our_params = [p for g in ours.param_groups for p in g["params"]]
    for i, (pr, po) in enumerate(zip(ref_params, our_params, strict=True)):
        sr, so = ref.state.get(pr, {}), ours.state.get(po, {})
        assert sorted(sr) == sorted(so), f"param {i}: state keys {sorted(sr)} vs {sorted(so)}"
        for key, vr in sr.items():
            vo = so[key]
            if not isinstance(vr, torch.Tensor):
                assert vr == vo
                continue
            if key == "step":
                assert vr.dtype == vo.dtype and (not values or vr.item() == vo.item()), f"param {i}: {vr!r} vs {vo!r}"
            elif not values:
                assert (vr.dtype, vr.shape) == (vo.dtype, vo.shape), f"param {i} {key}: {vr.dtype} vs {vo.dtype}"
            else:
                assert vr.shape == vo.shape
                torch.testing.assert_close(
                    vo.cpu().to(dtype),
                    vr.cpu().to(dtype),
                    atol=atol,
                    rtol=rtol,
                    msg=lambda m, i=i, k=key: f"param {i} {k}: {m}",
                )


def ptrs_equal_stand_in(tensors, ptrs, indices) -> bool:
    """torch's C++ address check (``torch._C._tensors_data_ptrs_at_indices_equal``, absent from CPU builds) in
    Python, with its contract: True when every listed tensor sits at its address, an error for a non-tensor."""
    for i in indices:
        t = tensors[i]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a tensor at {i}, got {type(t).__name__}")
        if t.data_ptr() != ptrs[i]:
            return False
    return True


class _Launches:
    """Record the Triton launches made inside a ``with``: each kernel's name, its compile-time switches (keyword
    arguments) and its host scalars (positional numbers): what a CUDA graph freezes at capture."""

    def __enter__(self) -> list[tuple]:
        import triton.runtime.interpreter as interpreter
        import triton.runtime.jit as jit

        self.log: list[tuple] = []
        self.saved = [(cls, cls.run) for cls in (interpreter.InterpretedFunction, jit.JITFunction)]
        log = self.log
        for cls, run in self.saved:

            def recording(kernel, *args, grid, warmup, _run=run, **kwargs):
                if not warmup:
                    scalars = tuple(a for a in args if isinstance(a, bool | int | float))
                    log.append((kernel.__name__, scalars, tuple(sorted(kwargs.items()))))
                return _run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

            cls.run = recording
        return log

    def __exit__(self, *exc: object) -> None:
        for cls, run in self.saved:
            cls.run = run


class RecordingBackend:
    """A CUDA graph backend for CPU tests: capture records the callable without running it (a real capture runs
    nothing), replay runs it; ``fail`` makes every capture raise. As a real graph freezes its launches at capture,
    every replay must make the launches of the first (the same kernels, switches and host scalars): one that
    would replay a stale variant raises."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.captured = 0
        self.replayed = 0
        self.collective_captures = 0

    def supports(self, device: torch.device) -> str | None:
        return None

    def collectives(self, groups) -> str | None:
        return None  # gloo's collectives run where a real capture would replay NCCL's

    def eager(self, fn, device) -> None:
        fn()

    def capture(self, fn, device, collectives: bool = False) -> Any:
        self.collective_captures += collectives
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured += 1
        return [fn, None]

    def replay(self, graph) -> None:
        self.replayed += 1
        with _Launches() as launches:
            graph[0]()
        if graph[1] is None:
            graph[1] = launches
        elif launches != graph[1]:
            pairs = zip(graph[1], launches, strict=False)
            changed = next(((a, b) for a, b in pairs if a != b), f"{len(graph[1])} launches, then {len(launches)}")
            raise AssertionError(f"a replay launches other kernel variants than its capture: {changed}")


def record_graphs(opt: KitsuneOptimizer, backend: RecordingBackend | None = None) -> RecordingBackend:
    """Give ``opt``'s graph subsystem the recording stand-in (or ``backend``) and re-plan: the graph subsystem must
    then be active."""
    backend = backend or RecordingBackend()
    graphs = opt._subsystem("graphs")
    assert isinstance(graphs, GraphSubsystem)
    graphs.backend = backend
    opt._replan()
    assert graphs.active, graphs.reason
    return backend


def grads_in_place(params: Sequence[torch.Tensor], step: int, skip: Sequence[int] | set[int] = ()) -> None:
    """This step's grads written into the grads already there (as zero_grad(set_to_none=False) leaves them); a new
    grad where one is None, and None for the params in ``skip``."""
    for i, (p, g) in enumerate(zip(params, random_grads(params, step), strict=True)):
        if i in skip:
            p.grad = None
        else:
            p.grad = g if p.grad is None else p.grad.copy_(g)


def graphed_twins(
    device: torch.device,
    sizes: Sequence[int | tuple[int, ...]],
    make: Callable[[Any], torch.optim.Optimizer],
    **kw: Any,
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], torch.optim.Optimizer, KitsuneOptimizer, Any]:
    """Two copies of the same params: torch's optimizer ``make(ref)`` and ``KitsuneOptimizer(make(ours), **kw)`` with
    the recording graph backend. Returns ``ref, ours, ref_opt, opt, backend``."""
    ref, ours = make_params(sizes, torch.float32, device), make_params(sizes, torch.float32, device)
    opt = KitsuneOptimizer(make(ours), **kw)
    return ref, ours, make(ref), opt, record_graphs(opt)


def structural_change(change: str, pairs: list[tuple[list[torch.nn.Parameter], torch.optim.Optimizer]]) -> bool:
    """Make ``change`` on both sides of ``pairs`` (``[(ref, ref_opt), (ours, opt)]``) if it is a structural one:
    ``add_param_group`` (a group of one new param, lr 0.02), ``load_state_dict`` (kitsune's own, reloaded) or
    ``storage`` (every param's ``p.data`` replaced by a copy) or ``swap_param`` (group 0's second param replaced in
    its list, in place, by a new param of the same shape). Returns whether it was one of those."""
    (ref, _), (ours, opt) = pairs
    if change == "add_param_group":
        for params, o in pairs:
            new = make_params([6], torch.float32, ours[0].device, seed=5)
            o.add_param_group({"params": new, "lr": 0.02})
            params += new
    elif change == "load_state_dict":
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif change == "storage":
        for p, q in zip(ref, ours, strict=True):
            p.data, q.data = p.data.clone(), q.data.clone()
    elif change == "swap_param":
        for params, o in pairs:
            new = make_params([tuple(params[1].shape)], torch.float32, ours[0].device, seed=7)[0]
            o.param_groups[0]["params"][1] = params[1] = new
    else:
        return False
    return True


def set_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """``p.grad = g``, ``g`` of another dtype than ``p`` too (``p.grad_dtype``, which torch sets only without a
    grad)."""
    p.grad = None
    p.grad_dtype = None if g.dtype == p.dtype else g.dtype
    p.grad = g


def assert_refused(
    opt: Any, params: list[torch.Tensor], match: str, *args: Any, error: type[Exception] = ValueError
) -> None:
    """``opt.step(*args)`` raises ``error`` matching ``match`` and changes nothing: every param, and every state
    entry's keys, dtype and values, as they were."""
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(error, match=match):
        opt.step(*args)
    for p, b, st in zip(params, before, state, strict=True):
        assert torch.equal(p, b) and opt.state[p].keys() == st.keys()
        for k, v in st.items():
            assert opt.state[p][k].dtype == v.dtype and torch.equal(opt.state[p][k], v), k


def assert_steps_as_the_wrapped_step(
    opt: Any,
    params: list[torch.Tensor],
    make: Callable[[list[torch.Tensor]], Any],
    grads: Callable[[int], Any],
    steps: range,
) -> None:
    """Narrowed params on the wrapped optimizer's own step: a twin built by ``make``, given ``opt``'s state as kitsune
    holds it (float32), follows ``opt`` bit for bit over ``steps`` with float32 grads (``grads(step)``, one a param,
    set through ``p.grad_dtype``); every param stays on that step with its state float32, as it was made."""
    twins = [p.detach().clone().requires_grad_() for p in params]
    ref = make(twins)
    ref.load_state_dict(opt.state_dict())
    for t, p in zip(twins, params, strict=True):
        ref.state[t] = {k: v.clone() for k, v in opt.state[p].items()}  # float32, as kitsune holds it
    for step in steps:
        for p, t, g in zip(params, twins, grads(step), strict=True):
            for x in (p, t):
                set_grad(x, g.float())
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):
            assert torch.equal(p, t), step
    assert {b.route.value for b in opt.plan.buckets} == {"base_step"}
    assert all(t.dtype == torch.float32 for p in params for t in opt.state[p].values())  # kept as they were made


UNCOMPILABLE = "out of resource: shared memory, Required: 262144, Hardware limit: 232448"
"""What Triton raises for a kernel whose tiles need more shared memory than the GPU has (when it is loaded)."""


class Uncompilable:
    """Stands in for a Triton kernel (``kitsune.kernels.update._update_kernel``, ...) that Triton cannot compile or
    load on this GPU for the launches ``fails(args, kwargs)`` picks (every one by default): their compile ahead
    (``warmup``) and their launch raise as Triton does; the others run the real kernel."""

    def __init__(self, real: Any, fails: Callable[[tuple, dict], bool] | None = None) -> None:
        self.real, self.fails = real, fails or (lambda args, kwargs: True)
        self.__name__ = real.__name__

    def _check(self, args: tuple, kwargs: dict) -> None:
        if self.fails(args, kwargs):
            raise RuntimeError(UNCOMPILABLE)

    def warmup(self, *args: Any, grid: Any, **kwargs: Any) -> Any:
        self._check(args, kwargs)
        return self.real.warmup(*args, grid=grid, **kwargs)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self._check(args, kwargs)
            return self.real[grid](*args, **kwargs)

        return launch
