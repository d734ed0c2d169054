"""The migration guide's snippets marked ``<!-- tested: NAME -->`` run as written, on a small model.

Each runs with ``model``, ``loader`` and ``loss_fn`` defined, the names the guide uses; on a machine without CUDA,
``"cuda"`` in a snippet reads ``"cpu"`` (torch's GradScaler and autocast take float16 on CPU too) and
``torch.compile(model)`` uses the ``aot_eager`` backend (inductor would build C++ kernels: minutes on CI's CPUs).
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from kitsune import KitsuneOptimizer

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "migration.md"
TESTED = re.compile(r"<!-- tested: ([\w-]+) -->\s*```python\n(.*?)```", re.S)


def snippets() -> dict[str, str]:
    return dict(TESTED.findall(GUIDE.read_text()))


def namespace() -> dict:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    loader = [(torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(4)]
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    return {"torch": torch, "nn": nn, "model": model, "loader": loader, "loss_fn": nn.functional.mse_loss}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = batch
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def check_wraps_adamw(ns: dict) -> None:
    optimizer = ns["optimizer"]
    assert isinstance(optimizer, KitsuneOptimizer) and type(optimizer.base_optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["fused"], group["foreach"]) == (3e-4, 0.1, None, None)
    before = [p.detach().clone() for p in ns["model"].parameters()]
    train_step(ns["model"], optimizer, ns["loader"][0])
    assert optimizer.step_count == 1 and not all(map(torch.equal, before, ns["model"].parameters()))


def apex_checkpoint(ns: dict, tmp: Path) -> None:
    """Three steps of plain AdamW saved in Apex FusedAdam's layout; the snippet's optimizer is a fresh wrapper over
    a model holding the saved weights."""
    reference_model = copy.deepcopy(ns["model"])
    reference = torch.optim.AdamW(reference_model.parameters(), lr=3e-4, weight_decay=0.1)
    for batch in ns["loader"][:3]:
        train_step(reference_model, reference, batch)
    torch_sd = reference.state_dict()
    apex_sd = {  # Apex: moments in float32 per param, one int step count per group, its own group keys
        "state": {i: {k: s[k].float() for k in ("exp_avg", "exp_avg_sq")} for i, s in torch_sd["state"].items()},
        "param_groups": [
            {"params": g["params"], "lr": 3e-4, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
             "weight_decay": 0.1, "step": 3}
            for g in torch_sd["param_groups"]
        ],
    }  # fmt: skip
    torch.save({"model": reference_model.state_dict(), "optimizer": apex_sd}, tmp / "apex-checkpoint.pt")
    ns["model"].load_state_dict(reference_model.state_dict())
    ns["reference"] = (reference_model, reference)
    ns["optimizer"] = KitsuneOptimizer(torch.optim.AdamW(ns["model"].parameters(), lr=3e-4, weight_decay=0.1))


def check_apex_checkpoint(ns: dict) -> None:
    """The resumed wrapper's next step is the uninterrupted run's, bit for bit (CPU: the wrapped AdamW's step)."""
    model, optimizer = ns["model"], ns["optimizer"]
    reference_model, reference = ns["reference"]
    train_step(model, optimizer, ns["loader"][3])
    train_step(reference_model, reference, ns["loader"][3])
    assert optimizer.state_dict()["state"][0]["step"].item() == 4.0
    assert all(map(torch.equal, model.parameters(), reference_model.parameters()))


def check_trained(ns: dict) -> None:
    optimizer = ns["optimizer"]
    assert isinstance(optimizer, KitsuneOptimizer) and optimizer.step_count == len(ns["loader"])


def check_kitsune_amp(ns: dict) -> None:
    check_trained(ns)
    optimizer = ns["optimizer"]
    assert optimizer.loss_scale > 1 and optimizer.last_grad_norm is not None


def check_compiled(ns: dict) -> None:
    """The compiled model trains through the wrapper with the clip in the step."""
    model, optimizer = ns["model"], ns["optimizer"]
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and optimizer.config.grads.max_norm == 1.0
    before = [p.detach().clone() for p in model.parameters()]
    for batch in ns["loader"]:
        train_step(model, optimizer, batch)
    assert optimizer.step_count == len(ns["loader"]) and optimizer.last_grad_norm is not None
    assert not any(map(torch.equal, before, model.parameters()))


SETUP: dict[str, Callable[[dict, Path], None]] = {"apex-checkpoint": apex_checkpoint}
CHECK: dict[str, Callable[[dict], None]] = {
    "torch-fused": check_wraps_adamw,
    "apex": check_wraps_adamw,
    "apex-checkpoint": check_apex_checkpoint,
    "gradscaler-keep": check_trained,
    "gradscaler-kitsune": check_kitsune_amp,
    "torch-compile": check_compiled,
}


def test_every_tested_snippet_has_a_check():
    assert set(snippets()) == set(CHECK)


@pytest.mark.parametrize("name", sorted(CHECK))
def test_snippet_runs(name, tmp_path, monkeypatch):
    code = snippets()[name]
    if not torch.cuda.is_available():
        code = code.replace('"cuda"', '"cpu"')
        code = code.replace("torch.compile(model)", 'torch.compile(model, backend="aot_eager")')
    monkeypatch.chdir(tmp_path)
    ns = namespace()
    if name in SETUP:
        SETUP[name](ns, tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "kitsune: fusion was asked for but is inactive", UserWarning)
        exec(compile(code, f"docs/migration.md ({name})", "exec"), ns)
    CHECK[name](ns)
