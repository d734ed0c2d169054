"""What a launch of the update kernel computes: the algorithm, its compile-time switches and the layout of the
hyperparameter buffer. Importable without Triton, so the planner can explain why it cannot fuse."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Algo(IntEnum):
    ADAM = 0
    SGD = 1
    ADAGRAD = 2
    RMSPROP = 3
    LION = 4
    NADAM = 5
    RADAM = 6
    ADAMAX = 7
    ADADELTA = 8
    RPROP = 9
    ASGD = 10


class StateFormat(IntEnum):
    """How a launch stores the optimizer state tensors (``FusionConfig.state_precision``)."""

    PARAM = 0
    """In the param's dtype, as torch keeps it."""
    FP32 = 1
    BF16 = 2
    Q8 = 3
    """8-bit block-wise dynamic quantization (`kitsune.kernels.quant`): uint8 codes and an fp32 absmax per block."""


class Trust(IntEnum):
    """Layer-wise adaptation: a per-tensor trust ratio scales the update (LARS, LAMB)."""

    NONE = 0
    LARS = 1
    """SGD's update on ``trust * (g + wd * p)``, trust from the norms of the param and the grad (norm pass)."""
    LAMB = 2
    """Adam's direction plus ``wd * p``, scaled by ``||p|| / ||update||``: two launches (stage 1 stores the moments and
    reduces ``||update||`` per tensor, stage 2 applies it)."""


# Columns of the float64 hyperparameter buffer (one row per param group). Algorithms share columns:
#   B1: Adam/NAdam/RAdam/Adamax/Lion/LAMB beta1, SGD/RMSprop/LARS momentum, Rprop etaminus, ASGD lambd.
#   B2: Adam/NAdam/RAdam/Adamax/Lion/LAMB beta2, RMSprop alpha, Adadelta rho, Rprop etaplus, ASGD alpha.
#   EXTRA: SGD/LARS dampening, Adagrad lr_decay, LAMB bias_correction (1 or 0), NAdam momentum_decay * log2(0.96),
#     Rprop step_size_min, ASGD t0.
#   TRUST_A: LARS trust_coefficient, LAMB max_trust_ratio (inf for none), Rprop step_size_max.
#   ADAPT: LARS/LAMB layer_adaptation (1 or 0).
LR, B1, B2, EPS, WD, EXTRA, TRUST_A, ADAPT = range(8)
NUM_FIELDS = 8  # 64-byte rows


@dataclass(frozen=True)
class UpdateSpec:
    """The compile-time switches of one launch."""

    algo: Algo
    maximize: bool = False
    decoupled_wd: bool = False
    """Adam/NAdam/RAdam: AdamW's ``p *= 1 - lr * wd`` instead of L2 (``g += wd * p``). Lion always decouples."""
    amsgrad: bool = False
    momentum: bool = False
    """SGD ``momentum != 0`` / RMSprop ``momentum > 0``: a momentum_buffer exists."""
    nesterov: bool = False
    centered: bool = False
    trust: Trust = Trust.NONE
    state: StateFormat = StateFormat.PARAM
    """How the state tensors are stored (the planner sets it per bucket; a group's options never do)."""
    signed: int = 0
    """With 8-bit state: bit ``i`` set when slot ``state{i + 1}`` may hold negative values (the signed code table)."""
    stochastic: bool = False
    """bf16 params written back with stochastic rounding (``FusionConfig.param_rounding``; the planner sets it)."""
    kahan: bool = False
    """bf16 params written back with Kahan compensation: a bf16 buffer per param (role ``comp``, state key
    ``kahan_comp``) carries what rounding the param dropped into the next step (``param_rounding="kahan"``)."""

    @property
    def has_step(self) -> bool:
        """Whether the launch reads and advances a per-tensor step count (SGD: only to spot the first step; with
        stochastic rounding, every launch: the count picks the step's random stream)."""
        return self.algo not in (Algo.SGD, Algo.LION) or (self.algo == Algo.SGD and self.momentum) or self.stochastic

    @property
    def launches(self) -> int:
        """Kernel launches of one update over a unit's tensors: LAMB's two stages (`Trust.LAMB`), else one."""
        return 2 if self.trust == Trust.LAMB else 1

    @property
    def scalar_slots(self) -> int:
        """How many per-tensor float32 scalars besides ``step`` (roles ``scalar1``, ``scalar2``) the launch reads and
        its tensors' last blocks write: NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``."""
        return {Algo.NADAM: 1, Algo.ASGD: 2}.get(self.algo, 0)

    @property
    def state_slots(self) -> int:
        """How many state roles (``state1``..``state3``) the launch reads."""
        if self.algo == Algo.ADAM:
            return 3 if self.amsgrad else 2
        if self.algo == Algo.RMSPROP:
            return 3 if self.centered else (2 if self.momentum else 1)
        if self.algo == Algo.SGD:
            return 1 if self.momentum else 0
        if self.algo in (Algo.NADAM, Algo.RADAM, Algo.ADAMAX, Algo.ADADELTA, Algo.RPROP):
            return 2
        return 1

    def describe(self) -> str:
        """The switches that are on, e.g. ``"decoupled_wd, amsgrad"`` (``"-"`` for none)."""
        on = [
            n for n in ("maximize", "decoupled_wd", "amsgrad", "momentum", "nesterov", "centered") if getattr(self, n)
        ]
        if self.trust:
            on.append(f"trust ratio ({self.trust.name})")
        if self.stochastic:
            on.append("stochastic rounding")
        if self.kahan:
            on.append("Kahan compensation")
        return ", ".join(on) or "-"


@dataclass(frozen=True)
class MuonSpec:
    """The switches of one fused Muon bucket: its elementwise launches' constexprs and its Newton-Schulz calls.

    lr, momentum and weight decay are values (rows of the hyperparameter buffer); everything here changes the
    launches, so a change re-plans. ``ns_plan`` holds the ``(a, b, c)`` of each iteration (``ns_steps`` of them).
    """

    nesterov: bool = True
    adjust_lr_fn: str | None = None
    """``None``/``"original"``: ``sqrt(max(1, A / B))``; ``"match_rms_adamw"``: ``0.2 sqrt(max(A, B))``."""
    ns_plan: tuple[tuple[float, float, float], ...] = ()
    eps: float = 1e-7
    stochastic: bool = False
    """bf16 params written back with stochastic rounding (``FusionConfig.param_rounding``; the planner sets it): the
    decay and the orthogonalised update in fp32, one stochastic store."""
    matrices_only: bool = False
    """torch.optim.Muon: its step takes 2-D params only (kitsune's flattens the others into matrices); a param of
    another shape goes to that step, which rejects it."""
    maximize: bool = False
    """kitsune.optim.Muon's ``maximize``: the fused kernels descend only, so such a group takes the optimizer's own
    step."""

    has_step = False
    """torch.optim.Muon keeps no step count."""
    scalar_slots = 0
    state_slots = 1
    """``momentum_buffer``."""
    trust = Trust.NONE
    state = StateFormat.PARAM
    """Muon's momentum buffer stays in the param's dtype (``FusionConfig.state_precision`` does not apply)."""
    signed = 0

    def describe(self) -> str:
        """The switches, e.g. ``"nesterov, match_rms_adamw, 5 NS steps"``."""
        on = ["nesterov"] if self.nesterov else []
        if self.adjust_lr_fn == "match_rms_adamw":
            on.append("match_rms_adamw")
        if self.stochastic:
            on.append("stochastic rounding")
        return ", ".join([*on, f"{len(self.ns_plan)} NS steps"])
