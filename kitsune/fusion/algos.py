"""What the planner knows about each supported optimizer class: switches, hyperparameters, state, fallbacks.

Only these exact classes are fused; a subclass may change the math, so it keeps its own step. Each entry maps a
param group to the kernel's compile-time `UpdateSpec`, to its row of the hyperparameter buffer
(columns in `kitsune.kernels.update`), and to torch's state keys in the kernel's slots ``state1..3``.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kitsune.distributed import fsdp
from kitsune.fusion import state_format
from kitsune.kernels.coefficients import schedule
from kitsune.kernels.spec import Algo, MuonSpec, StateFormat, Trust, UpdateSpec
from kitsune.optim.base import check_pair
from kitsune.optim.lamb import LAMB
from kitsune.optim.lars import LARS
from kitsune.optim.lion import Lion
from kitsune.optim.muon import Muon

Row = tuple[Any, ...]  # (lr, b1, b2, eps, wd, extra, trust_a, adapt); an entry may be a tensor (e.g. a tensor lr)


@dataclass(frozen=True)
class AlgoInfo:
    name: str
    spec: Callable[[dict[str, Any]], UpdateSpec]
    row: Callable[[dict[str, Any]], Row]
    state_keys: Callable[[UpdateSpec], tuple[str | None, ...]]
    """torch's state keys, in kernel slot order (state1, state2, ...); None for a slot this variant leaves unused."""
    step_in_state: bool
    """torch keeps ``state['step']`` (SGD does not: kitsune counts privately to spot the first step)."""
    bytes_per_element: Callable[[UpdateSpec], int]
    """Reads + writes per element, in units of the param dtype size (for the cost model)."""
    foreach_launches: int
    """Roughly how many foreach kernels torch's foreach path runs per step (for the cost model)."""
    loop_launches: int = 0
    """Roughly how many kernels the optimizer's own per-param loop runs per param (for the cost model, when torch
    has no fused or foreach path for it: its own step is then the route the fused kernel is weighed against)."""
    torch_fused_devices: tuple[str, ...] = ()
    """Device types with a ``fused=True`` implementation in torch; empty when there is none."""
    torch_foreach: bool = True
    per_key_init: bool = False
    """How the optimizer's own step creates state, which the fused path follows: False, as torch.optim.Adam and most
    others, creates every key when a param's state is empty and raises ``KeyError`` for a key missing from a state
    that is not; True, as torch.optim.SGD (``momentum_buffer``) and Muon, creates each missing key on its own."""
    scalar_keys: tuple[str, ...] = ()
    """torch's per-tensor 0-dim state besides ``step``, in kernel slot order (``scalar1``, ``scalar2``): NAdam's
    ``mu_product``, ASGD's ``eta`` and ``mu``. Kept as ``step`` is: float32 on the param's device (torch's capturable
    layout), in the memory pool's step arena; every block reads it, the tensor's last block writes it."""
    fills: tuple[tuple[str, Callable[[dict[str, Any]], Any]], ...] = ()
    """State torch's lazy init does not start at zero: ``(key, its value from the param group)`` (Rprop's
    ``step_size`` and ASGD's ``eta``: the group's lr, a tensor lr included)."""
    host_scalars: tuple[str, ...] = ("step",)
    """The 0-dim state torch's own step keeps on the host unless ``capturable``: the profiler's live comparison moves
    it there for its baseline steps (ASGD keeps its scalars on the param's device either way)."""
    low_precision: bool = False
    """Whether ``FusionConfig.state_precision`` applies: its state may be kept in fp32, bf16 or 8 bits (every key is
    a moment or an accumulator; `kitsune.fusion.state_format.SIGNED` names them)."""
    one_dtype: bool = False
    """torch's own step needs each grad in its param's dtype (it lerps the grad into state made like the param):
    given a grad of another dtype (``p.grad_dtype``) it raises after it has bumped ``step`` and applied weight decay,
    so the fused executor refuses such a grad before anything changes, and state of a wider dtype than its param's
    (``model.half()`` after the state was made) instead of rounding it. kitsune.optim's optimizers refuse both in
    their own step (`kitsune.optim.base.EagerOptimizer`)."""
    aux: AlgoInfo | None = None
    """The algorithm of the groups whose spec is an `UpdateSpec` in an optimizer that is mostly something
    else (kitsune.optim.Muon's ``use_muon=False`` groups run AdamW): their fused units use it."""
    check: Callable[[dict[str, Any], str], None] | None = None
    """``check(group, where)``: raise for a value torch's own step refuses, or computes otherwise than the kernel,
    that `row` alone would pass on (``betas`` of three numbers, Adam's ``beta1=1``): run on the host before the values
    are uploaded, when they changed (kitsune.optim's optimizers check with their own `_check_group`)."""

    @property
    def scalars(self) -> tuple[str, ...]:
        """Every per-tensor 0-dim float32 state key, in table order: ``step`` (where torch keeps one), then
        `scalar_keys`."""
        return ("step",) * self.step_in_state + self.scalar_keys

    def one_dtype_for(self, spec: Any) -> bool:
        """`one_dtype` for the variant ``spec`` (an `UpdateSpec`, or Muon's): centered RMSprop's own step lerps the
        grad into ``grad_avg``, and Muon's its momentum, so they need one dtype too, where plain RMSprop's carries on
        with state of another."""
        return self.one_dtype or isinstance(spec, MuonSpec) or bool(getattr(spec, "centered", False))


def _switches(cls: type) -> Callable[[dict[str, Any], str], bool]:
    """How ``cls``'s step reads a switch of a group: a key its constructor takes (so this torch puts it in every
    group) is read as ``group[key]``, a KeyError once deleted, as torch's step raises before anything changes; a key
    this torch's class does not know is off."""
    known = frozenset(inspect.signature(cls.__init__).parameters)

    def switch(g: dict[str, Any], key: str) -> bool:
        return bool(g[key]) if key in known else bool(g.get(key, False))

    return switch


_DECOUPLED = "decoupled_weight_decay"


def _adam_spec(cls: type, decoupled: bool) -> Callable[[dict[str, Any]], UpdateSpec]:
    switch = _switches(cls)

    def spec(g: dict[str, Any]) -> UpdateSpec:
        return UpdateSpec(
            Algo.ADAM,
            maximize=switch(g, "maximize"),
            # AdamW's groups carry the flag too (True; torch's step reads it, so a group set to False decays as Adam)
            decoupled_wd=switch(g, _DECOUPLED) if _DECOUPLED in g else decoupled or switch(g, _DECOUPLED),
            amsgrad=switch(g, "amsgrad"),
        )

    return spec


def _adam_keys(s: UpdateSpec) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if s.amsgrad else ("exp_avg", "exp_avg_sq")


def _host_number(value: Any) -> float | None:
    """``value`` as a float where the host holds it (a number, a CPU tensor's one element), else None: a device
    tensor's value is not read (a sync), nor one that is no number (the upload refuses that, naming it)."""
    if type(value) is float:
        return value
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" and value.numel() == 1 else None
    return float(value) if isinstance(value, numbers.Real) else None


def _check_betas(g: dict[str, Any], where: str) -> None:
    check_pair("betas", g["betas"], where)


def _check_bias_corrected(g: dict[str, Any], where: str) -> None:
    """Adam's, AdamW's and Adamax's ``betas``: a pair, and ``beta1`` below 1, where torch's step divides the lr by the
    bias correction ``1 - beta1 ** step`` (a ZeroDivisionError at 1; the kernel's division would give every param
    inf)."""
    betas = g["betas"]
    if type(betas) is tuple and len(betas) == 2 and type(betas[0]) is float and betas[0] != 1.0:
        return  # as most are (an LR scheduler has this checked every step)
    beta1, _ = check_pair("betas", g["betas"], where)
    if _host_number(beta1) == 1.0:
        raise ZeroDivisionError(
            f"kitsune: betas[0]=1.0{where}: the bias correction 1 - beta1**step is 0 and the step divides by it "
            "(torch's step raises ZeroDivisionError there). Take beta1 < 1 (a scheduler's max_momentum=1.0?). "
            "Nothing was changed."
        )


def _check_rprop(g: dict[str, Any], where: str) -> None:
    """Rprop's ``etas`` and ``step_sizes``: pairs, and ``0 < etaminus < 1 < etaplus`` (what torch's constructor
    takes): torch's step writes the factors into the signs' tensor by value, so an eta of 0 or 1 collides with the
    sign it stands for and its step takes other branches than the kernel's."""
    check_pair("step_sizes", g["step_sizes"], where)
    etaminus, etaplus = (_host_number(v) for v in check_pair("etas", g["etas"], where))
    if etaminus is not None and etaplus is not None and not 0.0 < etaminus < 1.0 < etaplus:
        raise ValueError(
            f"kitsune: etas={g['etas']!r}{where}: torch.optim.Rprop takes 0 < etaminus < 1 < etaplus (its "
            "constructor refuses others, and its step, which sets the factors by value among signs of 0 and 1, takes "
            "another path with them). Nothing was changed."
        )


def _adam_row(g: dict[str, Any]) -> Row:
    return (g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], 0.0)


def _rmsprop_keys(s: UpdateSpec) -> tuple[str | None, ...]:
    keys = ("square_avg", "momentum_buffer" if s.momentum else None, "grad_avg" if s.centered else None)
    return keys[: s.state_slots]


def _spec(cls: type, algo: Algo) -> Callable[[dict[str, Any]], UpdateSpec]:
    """The switches of the algorithms that have only ``maximize`` and (NAdam, RAdam) ``decoupled_weight_decay``."""
    switch = _switches(cls)

    def spec(g: dict[str, Any]) -> UpdateSpec:
        return UpdateSpec(algo, maximize=switch(g, "maximize"), decoupled_wd=switch(g, "decoupled_weight_decay"))

    return spec


def _sgd_spec(g: dict[str, Any]) -> UpdateSpec:
    return UpdateSpec(
        Algo.SGD,
        maximize=_SGD_SWITCH(g, "maximize"),
        momentum=g["momentum"] != 0,
        nesterov=_SGD_SWITCH(g, "nesterov"),
    )


def _rmsprop_spec(g: dict[str, Any]) -> UpdateSpec:
    return UpdateSpec(
        Algo.RMSPROP,
        maximize=_RMSPROP_SWITCH(g, "maximize"),
        momentum=g["momentum"] > 0,
        centered=_RMSPROP_SWITCH(g, "centered"),
    )


_SGD_SWITCH = _switches(torch.optim.SGD)
_RMSPROP_SWITCH = _switches(torch.optim.RMSprop)
_ADAGRAD_SWITCH = _switches(torch.optim.Adagrad)


_LOG2_096 = math.log2(0.96)
"""NAdam's momentum schedule is ``0.96 ** (step * momentum_decay)``: the kernel takes ``exp2(step * EXTRA)``."""
_FUSED_DEVICES = ("cuda", "cpu", "xpu", "mps")

ALGOS: dict[type, AlgoInfo] = {
    torch.optim.Adam: AlgoInfo(
        "Adam",
        _adam_spec(torch.optim.Adam, False),
        _adam_row,
        _adam_keys,
        True,
        lambda s: 9 if s.amsgrad else 7,
        12,
        torch_fused_devices=_FUSED_DEVICES,
        low_precision=True,
        one_dtype=True,
        check=_check_bias_corrected,
    ),
    torch.optim.AdamW: AlgoInfo(
        "AdamW",
        _adam_spec(torch.optim.AdamW, True),
        _adam_row,
        _adam_keys,
        True,
        lambda s: 9 if s.amsgrad else 7,
        12,
        torch_fused_devices=_FUSED_DEVICES,
        low_precision=True,
        one_dtype=True,
        check=_check_bias_corrected,
    ),
    torch.optim.SGD: AlgoInfo(
        "SGD",
        _sgd_spec,
        lambda g: (g["lr"], g["momentum"], 0.0, 0.0, g["weight_decay"], g["dampening"]),
        lambda s: ("momentum_buffer",) if s.momentum else (),
        False,
        lambda s: 5 if s.momentum else 3,
        4,
        torch_fused_devices=_FUSED_DEVICES,
        per_key_init=True,
        low_precision=True,
    ),
    torch.optim.Adagrad: AlgoInfo(
        "Adagrad",
        lambda g: UpdateSpec(Algo.ADAGRAD, maximize=_ADAGRAD_SWITCH(g, "maximize")),
        lambda g: (g["lr"], 0.0, 0.0, g["eps"], g["weight_decay"], g["lr_decay"]),
        lambda s: ("sum",),
        True,
        lambda s: 5,
        6,
        torch_fused_devices=("cpu",),
        low_precision=True,
    ),
    torch.optim.RMSprop: AlgoInfo(
        "RMSprop",
        _rmsprop_spec,
        lambda g: (g["lr"], g["momentum"], g["alpha"], g["eps"], g["weight_decay"], 0.0),
        _rmsprop_keys,
        True,
        lambda s: 3 + 2 * s.state_slots,
        9,
        low_precision=True,
    ),
    torch.optim.NAdam: AlgoInfo(
        "NAdam",
        _spec(torch.optim.NAdam, Algo.NADAM),
        lambda g: (g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], g["momentum_decay"] * _LOG2_096),
        lambda s: ("exp_avg", "exp_avg_sq"),
        True,
        lambda s: 7,
        10,  # step, lerp_, mul_, addcmul_, sqrt, mu_product mul_, div_, add_, two addcdiv_
        scalar_keys=("mu_product",),
        fills=(("mu_product", lambda g: 1.0),),
        host_scalars=("step", "mu_product"),
        low_precision=True,
        one_dtype=True,
        check=_check_betas,
    ),
    torch.optim.RAdam: AlgoInfo(
        "RAdam",
        _spec(torch.optim.RAdam, Algo.RADAM),
        lambda g: (g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], 0.0),
        lambda s: ("exp_avg", "exp_avg_sq"),
        True,
        lambda s: 7,
        10,  # step, lerp_, mul_, addcmul_, sqrt, add_, div_, reciprocal_, add_, addcmul_
        low_precision=True,
        one_dtype=True,
        check=_check_betas,
    ),
    torch.optim.Adamax: AlgoInfo(
        "Adamax",
        _spec(torch.optim.Adamax, Algo.ADAMAX),
        lambda g: (g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], 0.0),
        lambda s: ("exp_avg", "exp_inf"),
        True,
        lambda s: 7,
        7,  # step, lerp_, mul_, abs, add_, maximum_, addcdiv_
        low_precision=True,
        one_dtype=True,
        check=_check_bias_corrected,
    ),
    torch.optim.Adadelta: AlgoInfo(
        "Adadelta",
        _spec(torch.optim.Adadelta, Algo.ADADELTA),
        lambda g: (g["lr"], 0.0, g["rho"], g["eps"], g["weight_decay"], 0.0),
        lambda s: ("square_avg", "acc_delta"),
        True,
        lambda s: 7,
        12,  # step, mul_, addcmul_, add, sqrt_, add, sqrt_, div_, mul_, mul_, addcmul_, add_
        low_precision=True,
    ),
    torch.optim.Rprop: AlgoInfo(
        "Rprop",
        _spec(torch.optim.Rprop, Algo.RPROP),
        lambda g: (g["lr"], g["etas"][0], g["etas"][1], 0.0, 0.0, g["step_sizes"][0], g["step_sizes"][1]),
        lambda s: ("prev", "step_size"),
        True,
        lambda s: 7,
        17,  # 6 foreach ops, then per tensor: three masked fills, clamp_, where, copy_, sign (a lower bound)
        fills=(("step_size", lambda g: g["lr"]),),
        check=_check_rprop,
    ),
    torch.optim.ASGD: AlgoInfo(
        "ASGD",
        _spec(torch.optim.ASGD, Algo.ASGD),
        lambda g: (g["lr"], g["lambd"], g["alpha"], 0.0, g["weight_decay"], g["t0"]),
        lambda s: ("ax",),
        True,
        lambda s: 5,
        9,  # step, add, addcmul_, sub, addcmul_, two copies of eta and mu (made per tensor on the host)
        scalar_keys=("eta", "mu"),
        fills=(("eta", lambda g: g["lr"]), ("mu", lambda g: 1.0)),
        host_scalars=(),
    ),
    Lion: AlgoInfo(
        "Lion",
        lambda g: UpdateSpec(Algo.LION, maximize=bool(g.get("maximize", False))),
        lambda g: (g["lr"], g["betas"][0], g["betas"][1], 0.0, g["weight_decay"], 0.0),
        lambda s: ("exp_avg",),
        False,
        lambda s: 5,
        0,
        loop_launches=5,  # mul_, lerp, sign_, add_, lerp_
        torch_foreach=False,
        low_precision=True,
        one_dtype=True,
    ),
    LARS: AlgoInfo(
        "LARS",
        lambda g: UpdateSpec(
            Algo.SGD,
            maximize=bool(g.get("maximize", False)),
            momentum=g["momentum"] != 0,
            nesterov=g["momentum"] != 0 and bool(g["nesterov"]),  # read as the eager step reads it (a KeyError)
            trust=Trust.LARS,
        ),
        lambda g: (
            g["lr"],
            g["momentum"],
            0.0,
            g["eps"],
            g["weight_decay"],
            g["dampening"],
            g["trust_coefficient"],
            float(bool(g["layer_adaptation"])),
        ),
        lambda s: ("momentum_buffer",) if s.momentum else (),
        False,
        lambda s: (5 if s.momentum else 3) + 2,  # + the norm pass over param and grad
        0,
        loop_launches=10,  # two norms, the ratio (div, add, mul, where), wd add, trust mul, momentum, add_
        torch_foreach=False,
        per_key_init=True,
    ),
    LAMB: AlgoInfo(
        "LAMB",
        lambda g: UpdateSpec(Algo.ADAM, maximize=bool(g.get("maximize", False)), trust=Trust.LAMB),
        lambda g: (
            g["lr"],
            g["betas"][0],
            g["betas"][1],
            g["eps"],
            g["weight_decay"],
            float(bool(g["bias_correction"])),  # each key read as the eager step reads it: missing, a KeyError
            _max_trust_ratio(g),
            float(bool(g["layer_adaptation"])),
        ),
        lambda s: ("exp_avg", "exp_avg_sq"),
        True,
        lambda s: 6 + 4 + 1,  # stage 1 (p, g, m, v in; m, v out), stage 2 (p, m, v in; p out), the norm of p
        0,
        loop_launches=14,  # step, lerp_, mul_, addcmul_, two divs, sqrt_, add_, wd add_, two norms, ratio, mul_, sub_
        torch_foreach=False,
        one_dtype=True,
    ),
}


def _max_trust_ratio(g: dict[str, Any]) -> float:
    """LAMB's cap on the trust ratio (inf for None), read where the eager step reads it: with layer adaptation."""
    if not g["layer_adaptation"] or g["max_trust_ratio"] is None:
        return math.inf
    return g["max_trust_ratio"]


OWN_STEP: dict[type, str] = {
    torch.optim.SparseAdam: (
        "SparseAdam takes sparse grads only (its moments change only where a grad has entries), so it keeps its "
        "own step"
    ),
    torch.optim.LBFGS: (
        "LBFGS runs a closure-driven line search that evaluates the loss several times per step, so it keeps its "
        "own step"
    ),
}
"""torch optimizers the fused kernel cannot run, with the reason the plan gives."""


def _muon_spec(schedules: bool) -> Callable[[dict[str, Any]], MuonSpec]:
    """A Muon group's switches. ``schedules`` (kitsune's Muon): ``ns_coefficients`` may be one triple per iteration,
    params of more than two dims are flattened into matrices, and ``maximize`` is an option; torch.optim.Muon takes
    exactly one triple and 2-D params only, and has no ``maximize``. ``ns_plan`` is None for settings the
    optimizer's own step rejects."""

    def spec(g: dict[str, Any]) -> MuonSpec:
        coefficients, steps = g["ns_coefficients"], g["ns_steps"]
        one = isinstance(coefficients, (tuple, list)) and len(coefficients) == 3
        one = one and all(isinstance(v, numbers.Real) for v in coefficients)
        plan: tuple | None = None
        if isinstance(steps, int) and 0 <= steps < 100 and (one or schedules):
            try:
                plan = tuple(schedule(coefficients, steps)) if steps else ()
            except ValueError:
                pass
        return MuonSpec(
            bool(g["nesterov"]),
            g["adjust_lr_fn"] or "original",
            plan,
            float(g["eps"]),
            matrices_only=not schedules,
            maximize=schedules and bool(g.get("maximize", False)),
        )

    return spec


def _muon_row(g: dict[str, Any]) -> Row:
    return (g["lr"], g["momentum"], 0.0, g["eps"], g["weight_decay"], 0.0)


def _muon_bytes(s: MuonSpec | UpdateSpec) -> int:
    # momentum (g, buf in; buf, bf16 update out) + apply (p, bf16 update in; p out); AdamW's 7 for AdamW groups
    return 6 if isinstance(s, MuonSpec) else 7


_MUON_SCHEDULES = _muon_spec(True)


def _kitsune_muon_spec(g: dict[str, Any]) -> MuonSpec | UpdateSpec:
    if g["use_muon"]:
        return _MUON_SCHEDULES(g)
    # its AdamW groups: decoupled decay, maximize by the eager step's negated grads, never amsgrad (whatever the key)
    return UpdateSpec(Algo.ADAM, maximize=bool(g.get("maximize", False)), decoupled_wd=True)


ALGOS[Muon] = AlgoInfo(
    "kitsune.optim.Muon",
    _kitsune_muon_spec,  # type: ignore[arg-type]
    lambda g: _muon_row(g) if g["use_muon"] else _adam_row(g),
    lambda s: ("momentum_buffer",) if isinstance(s, MuonSpec) else _adam_keys(s),
    False,
    _muon_bytes,  # type: ignore[arg-type]
    12,  # the AdamW groups run torch's functional AdamW, foreach on CUDA
    torch_foreach=False,
    per_key_init=True,  # a group whose use_muon flips starts the other algorithm's state from zero
    aux=replace(ALGOS[torch.optim.AdamW], per_key_init=True, low_precision=False),
)
if hasattr(torch.optim, "Muon"):  # torch >= 2.9
    ALGOS[torch.optim.Muon] = AlgoInfo(
        "torch.optim.Muon",
        _muon_spec(False),  # type: ignore[arg-type]
        _muon_row,
        lambda s: ("momentum_buffer",),
        False,
        _muon_bytes,  # type: ignore[arg-type]
        0,
        torch_foreach=False,
        per_key_init=True,
    )


KAHAN_COMP = "kahan_comp"
"""The state key of a param's Kahan compensation (``param_rounding="kahan"``): its dtype and shape, what rounding
dropped from the param so far (torch-optimi's name for it)."""


def extra_keys(spec: Any) -> tuple[str, ...]:
    """State kitsune keeps for a param beyond the optimizer's own keys: the Kahan compensation with
    ``spec.kahan``. Created as zeros wherever missing (a torch checkpoint has none), never in a low-precision
    format."""
    return (KAHAN_COMP,) if getattr(spec, "kahan", False) else ()


def scalar_dtype() -> torch.dtype:
    """The dtype torch gives ``state['step']`` (float64 only under ``torch.set_default_dtype(torch.float64)``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def missing_key(info: AlgoInfo, spec: UpdateSpec, state: dict) -> str | None:
    """The first key the optimizer's step reads that a param's (non-empty) ``state`` lacks (in any format), in about
    torch's reading order (the state tensors, the other scalars, then ``step``), or None."""
    keys = [k for k in info.state_keys(spec) if k] + list(info.scalar_keys) + (["step"] if info.step_in_state else [])
    return next((k for k in keys if not state_format.present(state, k)), None)


def init_state(
    info: AlgoInfo,
    spec: UpdateSpec,
    group: dict[str, Any],
    p: torch.Tensor,
    state: dict,
    alloc: Callable[[str], torch.Tensor] | None = None,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Create missing state for ``p`` as torch's lazy init would, with ``step`` on the param's device (as torch's
    fused and capturable paths keep it: the kernel reads it there). ``alloc(key)`` hands out the memory (the
    pool's arena views); without it each tensor is allocated on its own. ``defaults``: the optimizer's, where
    torch's lazy init reads a value there rather than in the group (Adagrad's ``initial_accumulator_value``).
    The other per-tensor scalars (`AlgoInfo.scalar_keys`) are float32 on the param's device, as ``step``."""
    fills = dict(info.fills)
    for key in info.scalars:
        if key not in state:
            t = alloc(key) if alloc else torch.empty((), dtype=torch.float32, device=p.device)
            state[key] = t.fill_(fills[key](group)) if key in fills else t.zero_()
    fmt = getattr(spec, "state", StateFormat.PARAM)
    for key in info.state_keys(spec):
        if key is None or state_format.present(state, key):  # None: set so by hand (SGD: start the buffer again)
            continue
        if fmt != StateFormat.PARAM:  # low-precision state (FusionConfig.state_precision)
            _init_low(info, key, fmt, group, p, state, alloc, defaults)
            continue
        t = alloc(key) if alloc else torch.empty_like(p, memory_format=torch.preserve_format)
        fill = _fill(info, key, group, defaults)
        if fill is not None:
            t.fill_(fill)
        elif info.name not in ("SGD", "LARS"):  # those write it from the grad on the first step (torch's clone)
            t.zero_()
        state[key] = t
    for key in extra_keys(spec):
        if key not in state:
            t = alloc(key) if alloc else torch.empty_like(p, memory_format=torch.preserve_format)
            state[key] = t.zero_()


def _fill(info: AlgoInfo, key: str, group: dict[str, Any], defaults: dict[str, Any] | None) -> Any:
    """The value state ``key`` starts at when it is not zero, or None."""
    fills = dict(info.fills)
    if key in fills:  # Rprop's step_size starts at the group's lr
        return fills[key](group)
    if key == "sum":  # Adagrad builds it in __init__; a group added later gets it here, from the defaults
        return (defaults or {}).get("initial_accumulator_value", group["initial_accumulator_value"])
    return None


def _init_low(
    info: AlgoInfo,
    key: str,
    fmt: StateFormat,
    group: dict[str, Any],
    p: torch.Tensor,
    state: dict,
    alloc: Callable[[str], torch.Tensor] | None,
    defaults: dict[str, Any] | None,
) -> None:
    """State ``key`` created in a low-precision format: zeros (or its fill) in fp32, converted to the format, in
    the pool's views where ``alloc`` hands them out."""
    fill = _fill(info, key, group, defaults)
    if fsdp.is_dtensor(p):  # FSDP2: a DTensor sharded as its param, as torch creates the state
        t = torch.zeros_like(p, dtype=torch.float32)
    else:
        t = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    if fill is not None:
        t.fill_(fill)
    state[key] = t
    state_format.conform(state, key, p, fmt)  # 8 bits: the codes and absmax entries; a float format: its dtype
    if alloc is not None:
        for name, _, _ in state_format.entries(key, fmt, p):
            state[name] = alloc(name).copy_(state[name])


def group_specs(info: AlgoInfo, groups: list[dict[str, Any]]) -> tuple[Any, ...]:
    """Each group's kernel switches (`AlgoInfo.spec`); a switch of a type they cannot be read from (``momentum="0.9"``)
    raises ``TypeError`` naming the group, before anything changes (a missing key raises ``KeyError`` as the
    optimizer's own step does)."""
    specs = []
    for i, g in enumerate(groups):
        try:
            specs.append(info.spec(g))
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"kitsune: param group {i} of {info.name} holds a switch of a type its step cannot read "
                f"({type(exc).__name__}: {exc}): give it a number or a bool, as torch.optim takes it. Nothing was "
                "changed."
            ) from exc
    return tuple(specs)


def trust_ratios(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` scales updates by per-tensor trust ratios (LAMB, LARS): those need one norm pass over
    every grad before the first update."""
    info = ALGOS.get(type(optimizer))
    return info is not None and any(spec.trust for spec in group_specs(info, optimizer.param_groups))


def unit_info(info: AlgoInfo | None, spec: Any) -> AlgoInfo | None:
    """The algorithm a bucket's units run: the optimizer's, or its auxiliary one (kitsune.optim.Muon's AdamW)."""
    return info.aux if info is not None and info.aux is not None and isinstance(spec, UpdateSpec) else info


def check_loaded(base: torch.optim.Optimizer) -> None:
    """After the wrapped optimizer loaded a state dict and before anything binds or steps on it: raise
    ``ValueError`` where a param's state cannot be what its algorithm keeps (a tensor of another shape than its
    param: a checkpoint of another model, or of the same params in another order; a step count that is no number;
    ``KeyError`` for a step count missing),
    for every param of an algorithm kitsune knows, whichever step updates it (a fused kernel, torch's path or the
    optimizer's own: torch's would raise halfway through its step). 8-bit state is `state_format.check_loaded`'s.
    Changes nothing."""
    info = ALGOS.get(type(base))
    if info is None:
        return
    state = base.state
    for g, spec in zip(base.param_groups, group_specs(info, base.param_groups), strict=True):
        algo = unit_info(info, spec)
        for p in g["params"]:
            s = state.get(p)
            if not s:
                continue
            for key in algo.scalars:  # type: ignore[union-attr]
                v = s.get(key)
                if v is None:  # torch's step raises on such state (its __setstate__ reads only the first param's)
                    raise KeyError(
                        f"this state dict's state for a param of shape {tuple(p.shape)} has no {key!r}, which "
                        f"{info.name} keeps in every state it makes. Nothing was loaded: the optimizer keeps its "
                        "state"
                    )
                if not (isinstance(v, (int, float)) or _strided(v) and v.numel() == 1):
                    raise ValueError(
                        f"this state dict's {key!r} for a param of shape {tuple(p.shape)} is {_what(v)}, not a "
                        "number or a one-element tensor. Nothing was loaded: the optimizer keeps its state"
                    )
            for key in algo.state_keys(spec):  # type: ignore[union-attr]
                t = s.get(key) if key else None
                if t is None:  # absent, or 8-bit (state_format.check_loaded checks that)
                    continue
                if info.name == "SGD" and key == "momentum_buffer" and _sparse_of(t, p):
                    continue  # torch's SGD's own from sparse grads: the planner leaves the param to that step
                if not _strided(t):
                    raise ValueError(
                        f"this state dict's {key!r} for a param of shape {tuple(p.shape)} is {_what(t)}: "
                        f"{info.name} keeps a dense tensor of the param's shape. Nothing was loaded: the optimizer "
                        "keeps its state"
                    )
                if t.shape != p.shape:
                    raise ValueError(
                        f"this state dict's {key!r} for a param of shape {tuple(p.shape)} has shape "
                        f"{tuple(t.shape)}: it was saved for another model or another param order. Nothing was "
                        "loaded: the optimizer keeps its state"
                    )


def _sparse_of(v: Any, p: torch.Tensor) -> bool:
    """A sparse tensor of ``p``'s shape (what torch's SGD makes its momentum buffer from a sparse grad)."""
    return isinstance(v, torch.Tensor) and v.is_sparse and v.shape == p.shape


def _strided(v: Any) -> bool:
    """A dense tensor."""
    return isinstance(v, torch.Tensor) and v.layout == torch.strided


def _what(v: Any) -> str:
    """How an error names a state value that cannot be the algorithm's."""
    if isinstance(v, torch.Tensor):
        return f"a {str(v.layout).removeprefix('torch.')} tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"
