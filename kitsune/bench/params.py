"""The benchmark's parameter sets: shapes only, so sizes are known without allocating anything."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ParamSet:
    """A named list of parameter shapes and how many timed steps it gets by default on a GPU."""

    name: str
    description: str
    shapes: tuple[tuple[str, Shape], ...]
    """(name, shape) per tensor, in model order."""
    default_steps: int
    channels_last: bool = False
    """Whether its 4-D tensors lie in channels_last order, as a vision model's conv weights after
    ``model.to(memory_format=torch.channels_last)``."""

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)

    @property
    def n_elements(self) -> int:
        return sum(math.prod(shape) for _, shape in self.shapes)

    def scaled(self, scale: float) -> ParamSet:
        """The same tensors with about ``scale`` times the elements each (each dim times scale**(1/ndim); a
        channels_last set's 4-D tensors keep their kernel's height and width, their two channel dims scaled by
        scale**(1/2), so that they stay in channels_last order and not row-major too).

        The tensor count is kept: it is what the host-bound sets are about.
        """
        if not 0 < scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {scale}")
        if scale == 1:
            return self

        def dims(shape: Shape) -> Shape:
            if self.channels_last and len(shape) == 4:
                return (*(max(1, round(d * scale**0.5)) for d in shape[:2]), *shape[2:])
            return tuple(max(1, round(d * scale ** (1 / len(shape)))) for d in shape)

        shapes = tuple((name, dims(shape)) for name, shape in self.shapes)
        return replace(self, description=f"{self.description} (scale {scale:g})", shapes=shapes)


def _gpt2() -> tuple[tuple[str, Shape], ...]:
    # GPT-2 124M as in Hugging Face's layout (Conv1D weights are (in, out)); the lm head is tied to wte.
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: list[tuple[str, Shape]] = [("wte", (vocab, d)), ("wpe", (ctx, d))]
    for i in range(layers):
        h = f"h.{i}"
        shapes += [
            (f"{h}.ln_1.weight", (d,)),
            (f"{h}.ln_1.bias", (d,)),
            (f"{h}.attn.c_attn.weight", (d, 3 * d)),
            (f"{h}.attn.c_attn.bias", (3 * d,)),
            (f"{h}.attn.c_proj.weight", (d, d)),
            (f"{h}.attn.c_proj.bias", (d,)),
            (f"{h}.ln_2.weight", (d,)),
            (f"{h}.ln_2.bias", (d,)),
            (f"{h}.mlp.c_fc.weight", (d, 4 * d)),
            (f"{h}.mlp.c_fc.bias", (4 * d,)),
            (f"{h}.mlp.c_proj.weight", (4 * d, d)),
            (f"{h}.mlp.c_proj.bias", (d,)),
        ]
    return (*shapes, ("ln_f.weight", (d,)), ("ln_f.bias", (d,)))


def _many() -> tuple[tuple[str, Shape], ...]:
    return tuple((f"p.{i}", (4096,)) for i in range(2000))


def _llama1b() -> tuple[tuple[str, Shape], ...]:
    # Llama-style decoder: no biases, RMSNorm weights only, untied embedding and lm head.
    d, ffn, vocab, layers = 2048, 8192, 32000, 16
    shapes: list[tuple[str, Shape]] = [("embed_tokens", (vocab, d))]
    for i in range(layers):
        L = f"layers.{i}"
        shapes += [
            (f"{L}.input_layernorm.weight", (d,)),
            *((f"{L}.self_attn.{p}_proj.weight", (d, d)) for p in "qkvo"),
            (f"{L}.post_attention_layernorm.weight", (d,)),
            (f"{L}.mlp.gate_proj.weight", (ffn, d)),
            (f"{L}.mlp.up_proj.weight", (ffn, d)),
            (f"{L}.mlp.down_proj.weight", (d, ffn)),
        ]
    return (*shapes, ("norm.weight", (d,)), ("lm_head.weight", (vocab, d)))


def _resnet50() -> tuple[tuple[str, Shape], ...]:
    # torchvision's ResNet-50: bottleneck blocks (1x1, 3x3, 1x1 convs, expansion 4) in stages of 3, 4, 6 and 3, a
    # batch norm's weight and bias after every conv, a 1x1 conv and batch norm on each stage's first shortcut
    shapes: list[tuple[str, Shape]] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    width = 64
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True), 1):
        for b in range(blocks):
            n = f"layer{stage}.{b}"
            convs = [
                ("conv1", (planes, width, 1, 1)),
                ("conv2", (planes, planes, 3, 3)),
                ("conv3", (4 * planes, planes, 1, 1)),
            ]
            if b == 0:
                convs.append(("downsample.0", (4 * planes, width, 1, 1)))
            for i, (conv, shape) in enumerate(convs, 1):
                bn = f"{n}.downsample.1" if conv.startswith("downsample") else f"{n}.bn{i}"
                shapes += [(f"{n}.{conv}.weight", shape), (f"{bn}.weight", (shape[0],)), (f"{bn}.bias", (shape[0],))]
            width = 4 * planes
    return (*shapes, ("fc.weight", (1000, 2048)), ("fc.bias", (1000,)))


PARAM_SETS: dict[str, ParamSet] = {
    "gpt2": ParamSet("gpt2", "GPT-2 124M shapes", _gpt2(), default_steps=50),
    "many": ParamSet("many", "2000 tensors of 4096 elements", _many(), default_steps=50),
    "llama1b": ParamSet("llama1b", "1.2B Llama-style (16 layers, hidden 2048, FFN 8192)", _llama1b(), 20),
    "resnet50": ParamSet(
        "resnet50", "ResNet-50 shapes, conv weights channels_last", _resnet50(), 50, channels_last=True
    ),
}
"""Every set, by the name ``--sets`` takes."""


def get_param_set(name: str, scale: float = 1.0) -> ParamSet:
    if name not in PARAM_SETS:
        raise ValueError(f"unknown parameter set {name!r}: choose from {', '.join(PARAM_SETS)}")
    return PARAM_SETS[name].scaled(scale)


def make_params(
    pset: ParamSet, device: torch.device | str, seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[torch.nn.Parameter]:
    """Fresh params (normal, std 0.02) with ``.grad`` already filled with standard-normal values.

    The same (set, seed) gives the same values on a device, so every variant starts from the same state.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for _, shape in pset.shapes:
        data = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
        if pset.channels_last and data.dim() == 4:
            data = data.contiguous(memory_format=torch.channels_last)
        p = torch.nn.Parameter(data)
        # random, never zeros: no kernel may take a shortcut on an all-zero grad (laid out as its param, as
        # backward makes it)
        p.grad = torch.empty_like(p).normal_(generator=gen)
        params.append(p)
    return params


def fresh_grads(params: list[torch.nn.Parameter], gen: torch.Generator) -> None:
    """What a training loop leaves: ``zero_grad()`` frees every grad (``p.grad = None``, torch's default), the
    forward's activations take their blocks, and backward allocates new grads elsewhere. Here: every grad a new
    tensor of fresh random values, made while the last ones still hold their blocks, so each step's grads sit where
    the step before last left them (as the demo's loop found: its grads moved on every step). A step that reads
    grads through addresses it kept must see that they moved, and re-point its tables."""
    last = [p.grad for p in params]  # the activations' share of the blocks: held until the new grads are made
    for p in params:
        p.grad = None
    with torch.no_grad():
        for p in params:
            p.grad = torch.empty_like(p).normal_(generator=gen)
    del last


GRADS = ("kept", "fresh")
"""``kitsune bench --grads``: ``kept``, the grads stay the same tensors with the same values every step (the
default, and how torch's CUDA-graph recipe keeps them); ``fresh``, `fresh_grads` before every step, outside the
timers."""


def check_grads_mode(grads: str) -> None:
    """ValueError unless ``grads`` is one of `GRADS`."""
    if grads not in GRADS:
        raise ValueError(f"unknown grads mode {grads!r}: choose from {', '.join(GRADS)}")


def refill_grads(params: list[torch.nn.Parameter], gen: torch.Generator) -> None:
    """Give every param a fresh random grad in place (addresses unchanged, so captured graphs stay valid)."""
    with torch.no_grad():
        for p in params:
            p.grad.normal_(generator=gen)
