"""Lion's eager reference: checked once against a float64 hand computation of the paper's update."""

from __future__ import annotations

import pytest
import torch

from kitsune.optim import Lion


def test_eager_matches_hand_computation_in_float64():
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(11, dtype=torch.float64, generator=gen)
    grads = [torch.randn(11, dtype=torch.float64, generator=gen) for _ in range(6)]
    lr, (b1, b2), wd = 0.01, (0.9, 0.99), 0.1
    p = torch.nn.Parameter(p0.clone())
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    want, m = p0.clone(), torch.zeros(11, dtype=torch.float64)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        c = b1 * m + (1 - b1) * g  # Chen et al. 2023, Algorithm 2
        want = want * (1 - lr * wd) - lr * torch.sign(c)
        m = b2 * m + (1 - b2) * g
    torch.testing.assert_close(p.detach(), want, atol=1e-14, rtol=1e-14)
    torch.testing.assert_close(opt.state[p]["exp_avg"], m, atol=1e-14, rtol=1e-14)


def test_state_skips_and_maximize():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = Lion([p, q], lr=0.1, maximize=True)
    p.grad = torch.tensor([1.0, -1.0, 0.0])
    opt.step()
    assert list(opt.state[p]) == ["exp_avg"] and opt.state[p]["exp_avg"].dtype == p.dtype
    assert q not in opt.state  # grad None: no state, no update
    torch.testing.assert_close(p.detach(), torch.tensor([1.1, 0.9, 1.0]))  # maximize ascends; sign(0) = 0


@pytest.mark.parametrize(
    "kwargs", [{"lr": -1.0}, {"betas": (1.5, 0.9)}, {"betas": (0.9, -0.1)}, {"weight_decay": -0.1}]
)
def test_rejects_invalid_hyperparameters(kwargs):
    with pytest.raises(ValueError, match="Invalid"):
        Lion([torch.nn.Parameter(torch.ones(1))], **kwargs)
