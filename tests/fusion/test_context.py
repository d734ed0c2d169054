"""The device-held hyperparameters (`kitsune.fusion.context.DeviceContext`): what an LR scheduler's every step
uploads lands bit for bit, in the buffer the kernels and captured graphs hold, and a bad value changes nothing."""

from __future__ import annotations

import pytest
import torch

from kitsune.fusion.context import DeviceContext
from kitsune.kernels.spec import NUM_FIELDS


def _row(group: dict) -> tuple:
    return tuple(group["values"])


def _groups(gen: torch.Generator, widths: tuple[int, ...]) -> list[dict]:
    return [{"values": torch.randn(w, generator=gen, dtype=torch.float64).tolist()} for w in widths]


def _expected(groups: list[dict]) -> torch.Tensor:
    out = torch.zeros(len(groups), NUM_FIELDS, dtype=torch.float64)
    for i, g in enumerate(groups):
        out[i, : len(g["values"])] = torch.tensor(g["values"], dtype=torch.float64)
    return out


def test_refreshes_land_bit_for_bit_in_the_same_buffer(device):
    """Rows of different widths, padded with zeros, over many refreshes with new random values each (an LR
    scheduler's steps): each lands exactly, in the buffer first made (its address is baked into captured graphs);
    unchanged values upload nothing."""
    gen = torch.Generator().manual_seed(11)
    context = DeviceContext(device, _row)
    groups = _groups(gen, (5, NUM_FIELDS, 1))
    assert context.refresh(groups) and context.uploads == 1
    buffer = context.buffer
    assert buffer.device.type == device.type and torch.equal(buffer.cpu(), _expected(groups))
    for step in range(20):
        groups[step % 3]["values"][0] = torch.randn(1, generator=gen, dtype=torch.float64).item()
        assert context.refresh(groups)
        assert context.buffer is buffer and torch.equal(buffer.cpu(), _expected(groups))
    assert not context.refresh(groups) and context.uploads == 21
    assert not context.differs(groups)
    groups[1]["values"][-1] += 1.0
    assert context.differs(groups) and context.uploads == 21  # asked, not uploaded


def test_a_value_that_is_not_a_number_changes_nothing(device):
    gen = torch.Generator().manual_seed(12)
    context = DeviceContext(device, _row)
    groups = _groups(gen, (4, 4))
    context.refresh(groups)
    before = context.buffer.clone()
    good = list(groups[1]["values"])
    groups[0]["values"][0] = 0.5  # a change before the bad value: not uploaded either
    groups[1]["values"][2] = "0.1"
    with pytest.raises(TypeError, match=r"param group 1 holds '0.1' \(str\) where its step reads a number"):
        context.refresh(groups)
    assert torch.equal(context.buffer, before) and context.uploads == 1
    groups[1]["values"] = good
    assert context.refresh(groups) and torch.equal(context.buffer.cpu(), _expected(groups))


def test_a_row_wider_than_the_buffer_is_refused(device):
    context = DeviceContext(device, _row)
    with pytest.raises(ValueError, match=f"at most {NUM_FIELDS} fit"):
        context.refresh([{"values": [1.0] * (NUM_FIELDS + 1)}])
    assert context.buffer is None


def test_a_numpy_value_changed_in_place_is_uploaded(device):
    """A 0-d NumPy array keeps its identity when ``lr[...] = x`` changes it, as a tensor does under ``fill_``: the
    refresh compares its value, not the object."""
    numpy = pytest.importorskip("numpy")
    lr = numpy.array(1e-3)
    context = DeviceContext(device, _row)
    groups = [{"values": [lr, 0.9]}]
    assert context.refresh(groups)
    for value in (0.25, 0.5, 0.5, 1e-4):
        changed = float(lr) != value
        lr[...] = value
        assert context.refresh(groups) == changed
        assert context.buffer[0, 0].item() == value


class _Odd:
    """A number-like value whose float() raises ValueError."""

    def __float__(self) -> float:
        raise ValueError("no value yet")


def test_every_kind_of_number_lands_as_float_gives_it_and_other_values_are_named(device):
    """The rows' values are converted together where each is a number (bool, int, a float subclass, a Fraction, an
    object with ``__float__``), exactly as ``float()`` converts each; one that is not (None, text, a ``__float__``
    that raises) is named, and nothing changes."""
    from fractions import Fraction

    class Rate:
        def __float__(self) -> float:
            return 0.125

    class Sub(float):
        pass

    context = DeviceContext(device, _row)
    values = [True, 3, Sub(0.1), Fraction(1, 3), Rate(), 2**53 + 1, -0.0]
    assert context.refresh([{"values": values}])
    assert context.buffer[0].tolist() == [float(v) for v in values] + [0.0] * (NUM_FIELDS - len(values))
    before = context.buffer.clone()
    for bad, name in ((None, "NoneType"), (b"1", "bytes"), (_Odd(), "_Odd")):
        with pytest.raises(TypeError, match=rf"param group 0 holds .* \({name}\) where its step reads a number"):
            context.refresh([{"values": [0.5, bad]}])
        assert torch.equal(context.buffer, before) and context.uploads == 1
