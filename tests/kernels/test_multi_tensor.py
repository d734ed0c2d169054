"""The multi-tensor engine: block maps, cached device tables, and the update kernel's per-tensor bookkeeping."""

from __future__ import annotations

from array import array

import pytest
import torch

from kitsune.kernels import DEAD, NUM_FIELDS, Algo, TensorTables, UpdateSpec, block_map, multi_tensor_update
from kitsune.kernels.multi_tensor import UploadRing
from kitsune.kernels.spec import B1, B2, EPS, EXTRA, LR


def test_block_map_odd_sizes():
    tensor, start = block_map([0, 1, 7, 4097, 1024], block=1024)
    assert tensor.dtype == torch.int32 and start.dtype == torch.int64
    assert tensor.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 4]  # an empty tensor still gets one block
    assert start.tolist() == [0, 0, 0, 0, 1024, 2048, 3072, 4096, 0]


def test_block_map_offsets_past_2_31():
    n = 2**31 + 5  # sizes only: no memory is allocated
    tensor, start = block_map([3, n], block=2**20)
    assert start[-1].item() == 2**31 and start.dtype == torch.int64
    assert tensor[-1].item() == 1 and (tensor == 1).sum().item() == 2**11 + 1


def test_tables_upload_only_on_change():
    tables = TensorTables(torch.device("cpu"), [3, 4], [0, 0])
    assert tables.set_role("grad", [16, 32]) and tables.uploads == 1
    buffer = tables.role("grad").data_ptr()
    assert not tables.set_role("grad", [16, 32]) and tables.uploads == 1
    assert tables.set_role("grad", [16, 48]) and tables.uploads == 2
    assert tables.role("grad").data_ptr() == buffer  # rewritten in place: a captured graph would stay valid
    assert tables.role("grad").tolist() == [16, 48]
    with pytest.raises(ValueError, match="2 tensors"):
        tables.set_role("param", [1, 2, 3])


def test_a_staged_upload_becomes_the_record_and_the_next_read_gets_a_new_tensor(device):
    """`TensorTables.staging`: the tensor a native read writes the next addresses into, page-locked on a GPU. Handed
    to `set_role`, it is uploaded from where it is and kept as the role's record, so the next staging tensor is
    another: a later read never writes into the record, nor into memory an upload in flight may still read."""
    tables = TensorTables(device, [4, 4, 4], [0, 0, 0])
    tables.set_role("grad", [16, 32, 48])
    staged = tables.staging("grad")
    assert tables.staging("grad") is staged  # the same until handed over
    assert staged.device.type == "cpu" and staged.dtype == torch.int64 and staged.numel() == 3
    assert staged.is_pinned() == (device.type == "cuda")
    staged.copy_(torch.tensor([64, 80, 96]))
    assert tables.set_role("grad", None, staged, low_bits=(64 | 80 | 96) & 63) and tables.uploads == 2
    assert tables.host("grad")[0] is staged
    following = tables.staging("grad")
    assert following is not staged and following.data_ptr() != staged.data_ptr()
    following.fill_(-7)  # the next read writes here
    assert tables.addresses("grad") == [64, 80, 96] and tables.role("grad").tolist() == [64, 80, 96]
    assert tables.aligned(["grad"], 16) and not tables.aligned(["grad"], 32)
    # a staging tensor handed over with the addresses the table holds is not taken: the next read writes it again
    following.copy_(torch.tensor([64, 80, 96]))
    assert not tables.set_role("grad", [64, 80, 96], following) and tables.staging("grad") is following
    assert tables.host("grad")[0] is staged
    # the same with other addresses: taken, uploaded
    following.copy_(torch.tensor([128, 144, 160]))
    assert tables.set_role("grad", [128, 144, 160], following) and tables.staging("grad") is not following
    assert tables.role("grad").tolist() == [128, 144, 160] and tables.host("grad")[0] is following


def test_the_records_of_many_uploads_hold_until_the_role_is_set_again(device):
    """Grads that move every step, over several laps of the role's host slots: each upload's record (`host`,
    `addresses`) and the device table hold that upload's addresses, the staging tensor is never the record, and
    addresses given as a list or in a caller's own tensor go the same way."""
    tables = TensorTables(device, [4, 4, 4], [0, 0, 0])
    gen = torch.Generator().manual_seed(5)
    laps = 3 * UploadRing((3,), torch.int64, device).slots + 3
    for i in range(laps):
        addresses = (torch.randint(1, 2**40, (3,), generator=gen) * 16).tolist()
        if i % 3 == 0:  # a native read's way: into the staging tensor
            staging = tables.staging("grad")
            assert staging is not tables.host("grad")[0]
            staging.copy_(torch.tensor(addresses))
            assert tables.set_role("grad", None, staging)
        elif i % 3 == 1:  # a list
            assert tables.set_role("grad", addresses)
        else:  # the caller's own tensor, kept as the record
            mine = torch.tensor(addresses)
            assert tables.set_role("grad", list(addresses), mine) and tables.host("grad")[0] is mine
        tables.staging("grad").fill_(-1)  # the next read writes into the staging tensor: never the record
        assert tables.host("grad")[0].tolist() == addresses and tables.addresses("grad") == addresses
        assert tables.role("grad").tolist() == addresses
    assert tables.uploads == laps


def _rows(i: int) -> array:
    """Upload ``i``'s values: every one differs from every other upload's."""
    return array("d", [i + j / 16 for j in range(2 * NUM_FIELDS)])


def test_an_upload_ring_lands_every_upload_bit_for_bit_over_several_laps(device):
    """`UploadRing`: uploads of one shape, three laps of its slots, each seen by the device work queued after it (a
    device copy of the buffer, as the next step's kernel reads it); the buffer keeps its address."""
    out = torch.full((2, NUM_FIELDS), -1.0, dtype=torch.float64, device=device)
    ring = UploadRing((2, NUM_FIELDS), torch.float64, device)
    seen = torch.empty((3 * ring.slots + 5, 2, NUM_FIELDS), dtype=torch.float64, device=device)
    address = out.data_ptr()
    for i in range(seen.shape[0]):
        ring.upload(_rows(i), out)
        seen[i].copy_(out)
    assert out.data_ptr() == address
    for i in range(seen.shape[0]):
        assert seen[i].flatten().tolist() == list(_rows(i))


def test_an_upload_that_does_not_fit_the_ring_changes_nothing(device):
    out = torch.zeros((2, NUM_FIELDS), dtype=torch.float64, device=device)
    ring = UploadRing((2, NUM_FIELDS), torch.float64, device)
    ring.upload(_rows(1), out)
    with pytest.raises(ValueError, match="8 values of 8 bytes for a torch.float64 upload of \\(2, 8\\)"):
        ring.upload(array("d", [0.5] * NUM_FIELDS), out)
    with pytest.raises(ValueError, match="16 values of 4 bytes"):
        ring.upload(array("f", [0.5] * 2 * NUM_FIELDS), out)
    assert out.flatten().tolist() == list(_rows(1))


@pytest.mark.cuda
@pytest.mark.parametrize("streams", [1, 2])
def test_an_upload_ring_waits_for_its_slots_copies_before_writing_them_again(streams):
    """The host queues more uploads than the ring has slots while the device is held up (on one of two streams): a
    slot is written again only after the copy that read it ran, so every upload still lands as it was given."""
    device = torch.device("cuda")
    queues = [torch.cuda.current_stream(device)] + [torch.cuda.Stream(device) for _ in range(streams - 1)]
    outs = [torch.zeros((2, NUM_FIELDS), dtype=torch.float64, device=device) for _ in queues]
    ring = UploadRing((2, NUM_FIELDS), torch.float64, device)
    n = 3 * ring.slots + 5
    seen = torch.zeros((n, 2, NUM_FIELDS), dtype=torch.float64, device=device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(queues[-1]):
        torch.cuda._sleep(50_000_000)  # tens of ms: the host runs laps ahead of this stream's copies
    for i in range(n):
        which = i % len(queues)
        with torch.cuda.stream(queues[which]):
            ring.upload(_rows(i), outs[which])
            seen[i].copy_(outs[which])
    torch.cuda.synchronize(device)
    for i in range(n):
        assert seen[i].flatten().tolist() == list(_rows(i)), i


def test_a_listed_upload_is_staged_and_kept_as_the_record(device):
    """`TensorTables.set_role` with a list: the table gets those addresses and the record (`host`) is the staged
    tensor the upload read, page-locked on a GPU, not a pageable one copied again."""
    tables = TensorTables(device, [4, 4], [0, 0])
    tables.set_role("grad", [16, 32])
    assert tables.set_role("grad", [48, 2**33]) and tables.role("grad").tolist() == [48, 2**33]
    host, _ = tables.host("grad")
    assert host.tolist() == [48, 2**33] and host.is_pinned() == (device.type == "cuda")


def test_alignment_answers_follow_the_addresses_set():
    """`TensorTables.aligned` (asked by every 8-bit launch) keeps its answer while the roles' addresses stay, and
    answers again when one of them moves: off a multiple, back onto one, or only in another role (kept). A `DEAD`
    tensor counts as aligned; `numel_gcd` divides every element count."""
    tables = TensorTables(torch.device("cpu"), [24, 40, 8], [0, 0, 0])
    assert tables.numel_gcd == 8 and TensorTables(torch.device("cpu"), [24, 36], [0, 0]).numel_gcd == 12
    tables.set_role("param", [64, 128, 256])
    tables.set_role("state1", [1024, 2048, DEAD])
    assert tables.aligned(["param", "state1"], 16) and not tables.aligned(["param", "state1"], 128)
    tables.set_role("param", [64, 132, 256])  # one param 4 bytes past a multiple of 16
    assert not tables.aligned(["param", "state1"], 16) and tables.aligned(["state1"], 16)
    tables.set_role("grad", [4, 8, 12])  # another role: the answers about param and state1 stand
    assert not tables.aligned(["param", "state1"], 16) and tables.aligned(["state1"], 16)
    tables.set_role("param", [64, 128, 256])
    assert tables.aligned(["param", "state1"], 16) and not tables.aligned(["grad"], 16)
    # low bits given (the native follow's OR of the addresses' low six bits): answered from them, for every power
    # of two up to 64, and computed again from the addresses once a role is set without them
    tables.set_role("grad", [96, 160, 32], low_bits=96 & 63 | 160 & 63 | 32 & 63)
    assert tables.aligned(["grad"], 32) and not tables.aligned(["grad"], 64)
    tables.set_role("grad", [104, 160, 32], low_bits=104 & 63 | 160 & 63 | 32 & 63)
    assert tables.aligned(["grad"], 8) and not tables.aligned(["grad"], 16)
    tables.set_role("grad", [128, 256, 64])
    assert tables.aligned(["grad"], 64) and not tables.aligned(["grad"], 128)


def _sgd_launch(params, grads, bufs, steps, device, lr=0.5, momentum=0.9, block=8):
    tables = TensorTables(device, [p.numel() for p in params], [0] * len(params), block=block)
    tables.set_role("param", [p.data_ptr() for p in params])
    tables.set_role("grad", [DEAD if g is None else g.data_ptr() for g in grads])
    tables.set_role("state1", [b.data_ptr() for b in bufs])
    tables.set_role("step", [s.data_ptr() for s in steps])
    hyper = torch.zeros(1, NUM_FIELDS, dtype=torch.float64, device=device)
    hyper[0, LR], hyper[0, B1] = lr, momentum
    multi_tensor_update(tables, hyper, UpdateSpec(Algo.SGD, momentum=True), params[0].dtype)
    return tables


def test_dead_and_empty_tensors_and_step_counts(device):
    """grad None: untouched, step kept; empty: step advances; multi-block: counted once; counters reset."""
    sizes = [5, 0, 21, 3]  # 21 elements = 3 blocks of 8
    params = [torch.randn(n, device=device) for n in sizes]
    before = [p.clone() for p in params]
    grads = [torch.randn(n, device=device) for n in sizes]
    grads[3] = None
    bufs = [torch.full((n,), 7.0, device=device) for n in sizes]
    steps = [torch.zeros((), device=device) for _ in sizes]
    tables = _sgd_launch(params, grads, bufs, steps, device)
    assert [s.item() for s in steps] == [1.0, 1.0, 1.0, 0.0]
    assert tables.counter.tolist() == [0, 0, 0, 0]
    for i in (0, 2):  # first step: the buffer is the grad, p -= lr * grad
        torch.testing.assert_close(bufs[i], grads[i])
        torch.testing.assert_close(params[i], before[i] - 0.5 * grads[i])
    assert torch.equal(params[3], before[3]) and torch.equal(bufs[3], torch.full((3,), 7.0, device=device))
    _sgd_launch(params, grads, bufs, steps, device)  # second step: momentum applies
    assert [s.item() for s in steps] == [2.0, 2.0, 2.0, 0.0]
    torch.testing.assert_close(bufs[2], grads[2] * 1.9)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log2(beta1 = 0) = -inf
def test_adam_moment_lerps_like_torch_at_weight_one(device):
    """beta1 = 0: torch's ``exp_avg.lerp_(grad, 1)`` is the grad exactly, which ``a + w * (b - a)`` may miss."""
    gen = torch.Generator().manual_seed(0)
    p, g, m = (torch.randn(257, generator=gen).to(device) for _ in range(3))
    v, step = torch.ones(257, device=device), torch.zeros((), device=device)
    tables = TensorTables(device, [257], [0], block=64)
    for role, t in (("param", p), ("grad", g), ("state1", m), ("state2", v), ("step", step)):
        tables.set_role(role, [t.data_ptr()])
    hyper = torch.zeros(1, NUM_FIELDS, dtype=torch.float64, device=device)
    hyper[0, LR], hyper[0, B1], hyper[0, B2], hyper[0, EPS] = 1e-3, 0.0, 0.999, 1e-8
    multi_tensor_update(tables, hyper, UpdateSpec(Algo.ADAM), torch.float32)
    assert torch.equal(m, g)


def test_per_tensor_scalars_written_once_per_live_tensor(device):
    """ASGD's eta and mu (roles scalar1, scalar2): every block of a tensor reads the old values, its last block writes
    the next ones; a tensor without a grad keeps them, and a nonzero found_inf keeps every one."""
    sizes = [5, 21, 3]  # 21 elements = 3 blocks of 8
    params = [torch.randn(n, device=device) for n in sizes]
    grads = [torch.randn(n, device=device) for n in sizes[:2]] + [None]
    ax = [torch.zeros(n, device=device) for n in sizes]
    steps, etas, mus = ([torch.full((), v, device=device) for _ in sizes] for v in (0.0, 0.5, 1.0))
    tables = TensorTables(device, sizes, [0] * 3, block=8)
    tables.set_role("param", [p.data_ptr() for p in params])
    tables.set_role("grad", [DEAD if g is None else g.data_ptr() for g in grads])
    for role, ts in (("state1", ax), ("step", steps), ("scalar1", etas), ("scalar2", mus)):
        tables.set_role(role, [t.data_ptr() for t in ts])
    hyper = torch.zeros(1, NUM_FIELDS, dtype=torch.float64, device=device)
    hyper[0, LR], hyper[0, B1], hyper[0, B2], hyper[0, EXTRA] = 0.1, 1e-2, 0.75, 0.0  # lr, lambd, alpha, t0
    before = [p.clone() for p in params]
    flag = torch.ones((), device=device)
    multi_tensor_update(tables, hyper, UpdateSpec(Algo.ASGD), torch.float32, found_inf=flag)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    assert [s.item() for s in steps] == [0.0] * 3 and [e.item() for e in etas] == [0.5] * 3
    multi_tensor_update(tables, hyper, UpdateSpec(Algo.ASGD), torch.float32, found_inf=flag.zero_())
    eta = torch.tensor(0.1 / (1 + 1e-2 * 0.1) ** 0.75, dtype=torch.float32).item()
    assert [s.item() for s in steps] == [1.0, 1.0, 0.0]
    assert [e.item() for e in etas] == pytest.approx([eta, eta, 0.5], rel=1e-6)
    assert [m.item() for m in mus] == [1.0, 1.0, 1.0]  # 1 / max(1, step - t0)
    for i in (0, 1):  # p (1 - lambd eta) - eta g, with the old eta; ax copies p while mu is 1
        torch.testing.assert_close(params[i], before[i] * (1 - 1e-2 * 0.5) - 0.5 * grads[i])
        torch.testing.assert_close(ax[i], params[i])
    assert torch.equal(params[2], before[2]) and not ax[2].any()


def test_launch_checks_its_inputs():
    tables = TensorTables(torch.device("cpu"), [3], [0])
    with pytest.raises(ValueError, match="float64"):
        multi_tensor_update(tables, torch.zeros(1, NUM_FIELDS), UpdateSpec(Algo.SGD), torch.float32)
    with pytest.raises(ValueError, match="supports"):
        hyper = torch.zeros(1, NUM_FIELDS, dtype=torch.float64)
        multi_tensor_update(tables, hyper, UpdateSpec(Algo.SGD), torch.float64)


@pytest.mark.cuda
def test_one_tensor_over_2_31_elements():
    """int64 offsets end to end: SGD with momentum on 2**31 + 3 fp32 elements (3 roles, ~26 GB)."""
    n = 2**31 + 3
    device = torch.device("cuda")
    p = torch.ones(n, device=device)
    g = torch.ones(n, device=device)
    g[-3:] = torch.tensor([2.0, 3.0, 4.0], device=device)
    buf = torch.empty(n, device=device)
    step = torch.zeros((), device=device)
    _sgd_launch([p], [g], [buf], [step], device, lr=0.5, block=1024)
    assert step.item() == 1.0
    torch.testing.assert_close(p[-4:].cpu(), torch.tensor([0.5, 0.0, -0.5, -1.0]))
    torch.testing.assert_close(p[:4].cpu(), torch.full((4,), 0.5))
    assert (p[2**31 - 8 : 2**31] == 0.5).all()  # the last 3 elements had other grads


def test_an_upload_ring_keeps_to_its_memory_budget_with_eight_slots_at_least_on_a_gpu():
    gpu = torch.device("cuda")  # (a ring makes its slots at its first upload: sized here without a GPU)
    assert UploadRing((2, NUM_FIELDS), torch.float64, gpu).slots == UploadRing.MAX_SLOTS == 32  # 128 bytes a slot
    many = UploadRing((5000,), torch.int64, gpu)  # a grad table of 5000 tensors: 40 KB a slot
    assert many.slots == 16 and many.slots * 5000 * 8 <= UploadRing.BUDGET
    assert UploadRing((10**6,), torch.int64, gpu).slots == 8  # over the budget: eight all the same
    # on a CPU each copy is done when it returns: the record of the last upload and the next slot
    assert UploadRing((2, NUM_FIELDS), torch.float64, torch.device("cpu")).slots == 2
