"""``kitsune bench --peers``: the optimizers users pick instead of kitsune, each where it is installed.

Every peer is built on the same params as the variants, with the same hyperparameters (``ADAMW``; ``LION`` for
the Lion peers, whose rows sit next to kitsune's fused Lion). A peer that is not importable is listed as not
installed, with what ``pip install`` takes; it is never an error. The runner (`kitsune.bench.runner.run_peer`)
times a peer as it times a variant and checks that its params moved on every checked step (`MoveCheck`): a
library that frees the grads, skips a step or does nothing is reported as not timed, never as a fast number.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from kitsune.bench.variants import ADAMW

LION = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.1}
"""The Lion hyperparameters of every Lion row (Lion's usual lr is 3-10x below AdamW's, its weight decay above)."""


class Built(NamedTuple):
    """A peer built over the params: ``step`` is what the timers call, ``opt`` holds the state that is counted."""

    opt: torch.optim.Optimizer
    step: Callable[[], object]


@dataclass(frozen=True)
class Peer:
    """One row of ``--peers``: how to build it, and what to tell a user who does not have it."""

    name: str
    """What ``--peers`` takes."""
    label: str
    """The row's label in the table."""
    package: str
    """The import name whose presence decides "installed"."""
    pip: str
    """What ``pip install`` takes."""
    algorithm: Literal["adamw", "lion"]
    build: Callable[[list[torch.nn.Parameter], torch.device], Built]
    settings: Callable[[torch.device], str]
    """The options it runs with on this device, in words."""
    compiles: bool = False
    """Its step goes through ``torch.compile``: warm-up takes minutes on a CPU, so a CPU run of every peer
    (``--peers`` without names) skips it; naming it runs it."""


def _opt(opt: torch.optim.Optimizer) -> Built:
    return Built(opt, opt.step)


def _bnb(cls: str, **options: Any) -> Callable[[list[torch.nn.Parameter], torch.device], Built]:
    def build(params: list[torch.nn.Parameter], device: torch.device) -> Built:
        import bitsandbytes as bnb

        return _opt(getattr(bnb.optim, cls)(params, **ADAMW, **options))

    return build


def _torchao(cls: str) -> Callable[[list[torch.nn.Parameter], torch.device], Built]:
    def build(params: list[torch.nn.Parameter], device: torch.device) -> Built:
        try:
            module = importlib.import_module("torchao.optim")
        except ImportError:  # torchao before 0.11 kept them in the prototype namespace
            module = importlib.import_module("torchao.prototype.low_bit_optim")
        return _opt(getattr(module, cls)(params, **ADAMW))

    return build


def _optimi(params: list[torch.nn.Parameter], device: torch.device) -> Built:
    import optimi

    # triton=True: optimi's Triton kernels, which its docs call faster than its foreach and for-loop paths (foreach
    # is deprecated); they need a GPU, so elsewhere the for-loop runs
    triton = device.type == "cuda"
    return _opt(optimi.AdamW(params, **ADAMW, triton=triton, foreach=False))


def _heavyball(compile_step: bool) -> Callable[[list[torch.nn.Parameter], torch.device], Built]:
    def build(params: list[torch.nn.Parameter], device: torch.device) -> Built:
        import heavyball

        cls = getattr(heavyball, "AdamW", None) or heavyball.ForeachAdamW  # ForeachAdamW: heavyball before 3.0
        options = {"compile_step": True} if compile_step else {}
        return _opt(cls(params, **ADAMW, **options))

    return build


def _compiled_step(params: list[torch.nn.Parameter], device: torch.device) -> Built:
    # PyTorch's recipe ("Compiling the optimizer with torch.compile"): the whole step() in one compiled function;
    # the warm-up's first call compiles it. lr stays a float: it never changes here, so nothing recompiles.
    opt = torch.optim.AdamW(params, **ADAMW)

    @torch.compile(fullgraph=False)
    def step() -> None:
        opt.step()

    return Built(opt, step)


def _lion_pytorch(params: list[torch.nn.Parameter], device: torch.device) -> Built:
    from lion_pytorch import Lion

    return _opt(Lion(params, **LION, use_triton=device.type == "cuda"))


def _kitsune_lion(params: list[torch.nn.Parameter], device: torch.device) -> Built:
    from kitsune.optim import Lion
    from kitsune.optimizer import KitsuneOptimizer

    return _opt(KitsuneOptimizer(Lion(params, **LION), enable_fusion=True))


def _fixed(text: str) -> Callable[[torch.device], str]:
    return lambda device: text


def _on_cuda(cuda: str, other: str) -> Callable[[torch.device], str]:
    return lambda device: cuda if device.type == "cuda" else other


_BNB = {"package": "bitsandbytes", "pip": "bitsandbytes", "algorithm": "adamw"}
_NOT_PAGED = "; not paged off CUDA (bitsandbytes falls back)"
# The paged ones run last of the AdamW peers: bitsandbytes never frees paged state (managed memory, held until the
# process ends), so it stays allocated through every row after them.
_PEERS = [
    Peer("bnb", "bnb AdamW 32-bit", **_BNB, build=_bnb("AdamW", optim_bits=32), settings=_fixed("optim_bits=32")),
    Peer(
        "bnb8bit",
        "bnb AdamW8bit",
        **_BNB,
        build=_bnb("AdamW8bit"),
        settings=_fixed("8-bit blockwise state (tensors under 4096 elements keep 32-bit state)"),
    ),
    Peer(
        "torchao8bit",
        "torchao AdamW8bit",
        "torchao",
        "torchao",
        "adamw",
        build=_torchao("AdamW8bit"),
        settings=_fixed("torchao.optim.AdamW8bit, block_size 256; each param's update torch.compiled"),
        compiles=True,
    ),
    Peer(
        "torchao4bit",
        "torchao AdamW4bit",
        "torchao",
        "torchao",
        "adamw",
        build=_torchao("AdamW4bit"),
        settings=_fixed("torchao.optim.AdamW4bit, block_size 128; each param's update torch.compiled"),
        compiles=True,
    ),
    Peer(
        "optimi",
        "optimi AdamW",
        "optimi",
        "torch-optimi",
        "adamw",
        build=_optimi,
        settings=_on_cuda("triton=True", "triton=False, foreach=False: the for-loop (its Triton kernels need a GPU)"),
    ),
    Peer(
        "heavyball",
        "heavyball AdamW",
        "heavyball",
        "heavyball",
        "adamw",
        build=_heavyball(compile_step=False),
        settings=_fixed("heavyball.AdamW as it comes: multi_tensor=True, its building blocks torch.compiled"),
        compiles=True,
    ),
    Peer(
        "heavyball_step",
        "heavyball AdamW, compile_step",
        "heavyball",
        "heavyball",
        "adamw",
        build=_heavyball(compile_step=True),
        settings=_fixed("heavyball.AdamW, compile_step=True: the whole step torch.compiled (fullgraph)"),
        compiles=True,
    ),
    Peer(
        "compile",
        "torch.compile(step)",
        "torch",
        "torch",
        "adamw",
        build=_compiled_step,
        settings=_fixed("torch.optim.AdamW (foreach), step() inside @torch.compile(fullgraph=False), lr a float"),
        compiles=True,
    ),
    Peer(
        "bnb_paged",
        "bnb PagedAdamW",
        **_BNB,
        build=_bnb("PagedAdamW"),
        settings=_on_cuda(
            "32-bit state, paged (CUDA managed) memory for tensors of 1e5 elements and up", "32-bit state" + _NOT_PAGED
        ),
    ),
    Peer(
        "bnb_paged8bit",
        "bnb PagedAdamW8bit",
        **_BNB,
        build=_bnb("PagedAdamW8bit"),
        settings=_on_cuda(
            "8-bit state, paged (CUDA managed) memory for tensors of 1e5 elements and up", "8-bit state" + _NOT_PAGED
        ),
    ),
    Peer(
        "lion_pytorch",
        "lion-pytorch Lion",
        "lion_pytorch",
        "lion-pytorch",
        "lion",
        build=_lion_pytorch,
        settings=_on_cuda("use_triton=True", "use_triton=False (its Triton kernel needs a GPU)"),
    ),
]
PEERS: dict[str, Peer] = {p.name: p for p in _PEERS}
"""Every peer, by the name ``--peers`` takes, in the order they run."""

KITSUNE_LION = Peer(
    "kitsune_lion",
    "kitsune Lion",
    "kitsune",
    "kitsune-optim",
    "lion",
    _kitsune_lion,
    _fixed("KitsuneOptimizer(kitsune.optim.Lion(...), enable_fusion=True)"),
)
"""kitsune's own row in each Lion section: what the Lion peers are compared with."""


COMPILES_ON_CPU = "its step is torch.compiled: minutes of warm-up on a CPU (name it in --peers to run it)"


def select_peers(names: Sequence[str] | Literal["all"], device: torch.device) -> tuple[list[Peer], dict[str, str]]:
    """The peers to run, in registry order, and the ones skipped with why.

    ``"all"`` (``--peers`` without names) skips, on a CPU, the peers that compile their step; names run as named.
    """
    if names == "all":
        chosen = list(PEERS.values())
        skipped = {p.name: COMPILES_ON_CPU for p in chosen if p.compiles and device.type != "cuda"}
        return [p for p in chosen if p.name not in skipped], skipped
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer {', '.join(unknown)}: choose from {', '.join(PEERS)}")
    return [p for p in PEERS.values() if p.name in names], {}


def installed(peer: Peer) -> bool:
    """Whether the peer's package can be found (not imported: a broken install shows when its row runs)."""
    try:
        return importlib.util.find_spec(peer.package) is not None
    except (ImportError, ValueError):
        return False


def version(peer: Peer) -> str | None:
    try:
        return importlib.metadata.version(peer.pip)
    except importlib.metadata.PackageNotFoundError:
        module = importlib.import_module(peer.package) if installed(peer) else None
        return getattr(module, "__version__", None)


def state_bytes(state: Any) -> tuple[int, bool]:
    """Bytes of every tensor in an optimizer's ``state`` (nested dicts and lists too), and whether any is paged.

    A tensor subclass (torchao's quantized states) counts its inner tensors: codes, scales and maps. A tensor that
    several params share (bitsandbytes' quantization maps) counts once. Views count their own elements.
    """
    seen: set[tuple[int, int, torch.dtype, torch.device]] = set()
    total, paged = 0, False

    def walk(obj: Any) -> None:
        nonlocal total, paged
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(obj, "__tensor_flatten__"):
                for attr in obj.__tensor_flatten__()[0]:
                    walk(getattr(obj, attr))
                return
            key = (obj.data_ptr(), obj.numel(), obj.dtype, obj.device)
            if key in seen:
                return
            seen.add(key)
            total += obj.numel() * obj.element_size()
            paged = paged or bool(getattr(obj, "is_paged", False))
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(state)
    return total, paged


class ParamsDidNotMove(Exception):
    """A row's params did not change on some checked step: its times would be those of a step that does nothing."""


class MoveCheck:
    """Each param's L2 norm, snapshotted on the device (one ``torch._foreach_norm``) at every call.

    Passed as ``check`` to `kitsune.bench.timing.time_steps`, it snapshots before and after the device pass and
    after each of as many untimed steps run as the timed ones (never between timed steps, so the timed passes are
    the same with it or without): `verify` then sees the device pass move every param, and every checked step.
    An AdamW or Lion step changes every element by about ``lr``, which changes the norm far above float32
    rounding, so an unchanged norm means an unchanged param.
    """

    def __init__(self, params: list[torch.nn.Parameter], names: Sequence[str]) -> None:
        self.params = params
        self.names = list(names)
        self.snapshots: list[torch.Tensor] = []

    def __call__(self) -> None:
        with torch.no_grad():
            self.snapshots.append(torch.stack(torch._foreach_norm([p.detach() for p in self.params])))

    @property
    def checked_steps(self) -> int:
        return max(len(self.snapshots) - 1, 0)

    def verify(self) -> None:
        """Raise `ParamsDidNotMove` unless every param changed between every two snapshots and stayed finite."""
        if len(self.snapshots) < 2:
            raise ValueError("MoveCheck.verify needs two snapshots or more")
        norms = torch.stack(self.snapshots).cpu()  # (snapshots, params)
        if not torch.isfinite(norms).all():
            raise ParamsDidNotMove("params became NaN or inf")
        still = norms[1:] == norms[:-1]  # (steps checked, params): True where a param did not move
        if still.any():
            steps, params = still.any(dim=1), still.any(dim=0)
            first = int(params.nonzero()[0])
            raise ParamsDidNotMove(
                f"params did not move: {int(params.sum())} of {len(self.params)} params unchanged on "
                f"{int(steps.sum())} of {len(steps)} checked steps (first: {self.names[first]})"
            )
