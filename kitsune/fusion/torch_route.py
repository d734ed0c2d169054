"""The buckets the planner sends to torch's own fused (or foreach) implementation: a second instance of the wrapped
optimizer's class over those params, sharing its state, kept to the semantics of the wrapped optimizer's own step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kitsune.fusion.plan import Route
from kitsune.wrapped import grads_hidden


class TorchShadow:
    """Runs torch's own ``fused=True`` (or ``foreach=True``) implementation on a bucket's params.

    A second instance of the wrapped optimizer's class holds only those params and shares the wrapped
    optimizer's ``state`` dict, so state is created and updated by torch's own code; each step copies the
    groups' hyperparameters over (an LR scheduler writes only the wrapped optimizer's groups).
    """

    _SKIP = frozenset({"params", "fused", "foreach"})

    def __init__(
        self,
        base: torch.optim.Optimizer,
        route: Route,
        params_by_group: dict[int, list[torch.Tensor]],
        missing: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> None:
        flags = {"fused": True, "foreach": False} if route is Route.TORCH_FUSED else {"fused": None, "foreach": True}
        groups = []
        for gi, params in params_by_group.items():
            g = {k: v for k, v in base.param_groups[gi].items() if k != "params"}
            g.update({k: v for k, v in flags.items() if k in g or k == "foreach"})
            groups.append({**g, "params": params})
        self.group_index = list(params_by_group)
        self.params = [p for ps in params_by_group.values() for p in ps]
        self.param_set = set(self.params)
        self.route = route
        self._missing = missing
        """A param's state -> the first key torch's step reads that it lacks (`kitsune.fusion.algos.missing_key`), or
        None where the optimizer makes each missing key itself (`check_state`)."""
        self._unchecked = list(self.params) if missing is not None else []
        """The params `check_state` has not yet found with their state whole."""
        self.unhandled: list[torch.Tensor] = []
        """Params whose grad this step torch's fused step cannot take (sparse, or of another dtype than the param):
        `find_unhandled` leaves them to the wrapped optimizer's own step, as a fused unit does."""
        self.opt = type(base)(groups)
        self.opt.state = base.state
        self._strides: list[tuple[int, ...]] = []
        """Each param's strides when its state was last put in its order (`_conform_state`)."""
        if route is Route.TORCH_FUSED:
            self._conform_state()
        fn = type(self.opt).step
        # beneath torch's hook runner: global step hooks belong to the user's step, not to this inner one
        self._step = fn.__wrapped__ if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__") else fn

    def _conform_state(self) -> None:
        """torch's fused kernels walk a param, its grad and its state as flat memory in one order: state laid out
        in another order than its param (made before ``model.to(memory_format=torch.channels_last)``, or loaded
        from a checkpoint of the other order) is copied into the param's order, values unchanged, as the fused
        Triton route conforms its state. torch's own lazy init makes state like the param."""
        state = self.opt.state
        for p in self.params:
            s = state.get(p)
            for key, t in (s or {}).items():
                if (
                    isinstance(t, torch.Tensor)
                    and t.layout == torch.strided
                    and t.dim()
                    and t.shape == p.shape
                    and t.stride() != p.stride()
                ):
                    s[key] = torch.empty_like(p, dtype=t.dtype).copy_(t)
        self._strides = [p.stride() for p in self.params]

    def check_state(self, state: Any) -> None:
        """Raise ``KeyError`` as torch's step would, before anything changes, where a param with a grad has a state
        that is not empty but misses a key the step reads (amsgrad switched on mid-run, a checkpoint without
        ``exp_avg``): torch's route runs after the wrapped optimizer's own step, which would have updated its params
        by then. Each param until its state is found whole, once a plan (a switch changed, a load and the state
        dict replaced each plan again)."""
        if not self._unchecked:
            return
        left = []
        for p in self._unchecked:
            s = state.get(p)
            if not s or p.grad is None:  # torch's lazy init makes it whole; or no update this step
                left.append(p)
                continue
            key = self._missing(s)  # type: ignore[misc]
            if key is not None:
                raise KeyError(key)
        self._unchecked = left

    def find_unhandled(self) -> list[torch.Tensor]:
        """Before anything changes: the params whose grads torch's ``fused=True`` step cannot take this step (it
        raises on a sparse grad, e.g. from ``nn.Embedding(sparse=True)``, or one of another dtype; and it reads a
        grad laid out in another order than its param, or expanded, as if it were, a wrong update on a CPU: torch
        checks equal strides for its fast path); the foreach route takes what the wrapped optimizer's own step
        takes."""
        if self.route is not Route.TORCH_FUSED:
            return []
        # a param laid out anew since (model.to(channels_last)), or state the wrapped optimizer's step made last time
        # for the params left to it (SGD's momentum buffer is a clone of the grad, in the grad's order)
        strides = [p.stride() for p in self.params]
        if self.unhandled or strides != self._strides:
            self._conform_state()
        self.unhandled = [
            p
            for p, stride in zip(self.params, strides, strict=True)
            if (g := p.grad) is not None and (g.layout != torch.strided or g.dtype != p.dtype or g.stride() != stride)
        ]
        return self.unhandled

    def step(self, groups: Sequence[dict[str, Any]], found_inf: torch.Tensor | None = None) -> None:
        """One step of torch's implementation; ``found_inf`` (fused route only) skips it on the device, through
        the ``grad_scale``/``found_inf`` attributes torch's fused optimizers read for ``GradScaler``."""
        foreach = self.route is Route.TORCH_FOREACH
        adam = isinstance(self.opt, torch.optim.Adam)
        for shadow, gi in zip(self.opt.param_groups, self.group_index, strict=True):
            for k, v in groups[gi].items():
                if k not in self._SKIP:
                    shadow[k] = v
            if foreach and adam:
                # torch's Adam turns foreach off for a tensor lr without capturable (its foreach code refuses one)
                shadow["foreach"] = not (isinstance(shadow["lr"], torch.Tensor) and not shadow.get("capturable"))
        if found_inf is not None and self.route is Route.TORCH_FUSED and self._starts_state() and found_inf.item():
            # torch's fused step makes a param's first state before it reads found_inf (SGD's momentum buffer from
            # empty_like, left unwritten when skipped): a skipped step that would start state is skipped here, on
            # the host, as GradScaler skips the step of an optimizer that is not fused (a sync on such steps only)
            return
        with grads_hidden(self.unhandled):  # the wrapped step took these
            late = self._late_momentum()
            if not late:
                self._run(found_inf)
                return
            # torch's fused SGD starts every momentum buffer or none in one call: the params whose buffer starts
            # this step (a first grad after the others') take a call of their own, as the wrapped SGD steps them
            with grads_hidden(late):
                self._run(found_inf)
            with grads_hidden(without(self.params, late)):
                self._run(found_inf)

    def _starts_state(self) -> bool:
        """Whether this step would create state: a param with a grad and no state yet (or SGD with momentum and no
        buffer)."""
        state = self.opt.state
        sgd = isinstance(self.opt, torch.optim.SGD)
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = state.get(p)
                if not s or (sgd and group["momentum"] != 0 and s.get("momentum_buffer") is None):
                    return True
        return False

    def _late_momentum(self) -> list[torch.Tensor]:
        """On torch's fused SGD with momentum: the params with a grad and no momentum buffer yet, where others with a
        grad have one (else [])."""
        if self.route is not Route.TORCH_FUSED or not isinstance(self.opt, torch.optim.SGD):
            return []
        state = self.opt.state
        late, started = [], False
        for group in self.opt.param_groups:
            if group["momentum"] == 0:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                if state.get(p, {}).get("momentum_buffer") is None:
                    late.append(p)
                else:
                    started = True
        return late if started else []

    def _run(self, found_inf: torch.Tensor | None) -> None:
        if found_inf is not None and self.route is Route.TORCH_FUSED:
            # torch's fused steps subtract found_inf from their step tensors: 0-dim, as GradScaler's (kitsune's is (1,))
            found_inf = found_inf.reshape(())
            self.opt.grad_scale, self.opt.found_inf = None, found_inf  # type: ignore[attr-defined]
            try:
                self._step(self.opt)
            finally:
                del self.opt.grad_scale, self.opt.found_inf  # type: ignore[attr-defined]
            return
        self._step(self.opt)


def without(params: list[torch.Tensor], left: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` without those in ``left`` (by identity)."""
    out = set(map(id, left))
    return [p for p in params if id(p) not in out]
