"""Round 14: ``HostSyncs`` counts the blocking copies it missed (assignment across host and
device, ``new_tensor`` of host data, a slice bounded by a device tensor), and ``transfer.fetch``
packs a mix of host and device parts on the device, not on the host with an unsynchronized copy.

Counted on a CPU as ``tests/test_host_syncs.py`` does: ``torch.device("cpu", 0)`` stands for the
device (see ``HostSyncs``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_plugins.device_audit import HostSyncs
from spec_plugins.transfer import HOST, fetch

DEV = torch.device("cpu", 0)  # the same memory, a device unequal to the host's


def _counted(fn) -> tuple[int, list[str]]:
    """Host syncs ``fn(device tensor, host tensor)`` makes, and where."""
    with HostSyncs(DEV) as syncs:
        d, h = torch.arange(1.0, 4.0, device=DEV), torch.zeros(3, device=HOST)
        start = syncs.count
        fn(d, h)
        return syncs.count - start, syncs.where


@pytest.mark.parametrize("assign", [
    lambda d, h: h.__setitem__(slice(None), d),  # host[:] = device
    lambda d, h: h.__setitem__(0, d[0]),  # one entry: still a device-to-host copy
], ids=["slice", "entry"])
def test_assigning_device_data_into_a_host_tensor_is_a_read(assign):
    n, where = _counted(assign)
    assert n == 1, where


def test_assigning_a_host_tensor_into_a_device_tensor_is_a_blocking_upload():
    n, where = _counted(lambda d, h: d.__setitem__(slice(None), h))
    assert n == 1 and "upload __setitem__" in where[-1], where


@pytest.mark.parametrize("value", [
    lambda d: torch.tensor(2.0, device=HOST),  # 0-dim on the host: a fill, read on the host
    lambda d: 5.0,
    lambda d: d * 2,  # device to device
], ids=["host-0dim", "number", "device"])
def test_assignments_that_copy_nothing_across_count_nothing(value):
    n, where = _counted(lambda d, h: d.__setitem__(slice(None), value(d)))
    assert n == 0, where


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_new_tensor_of_host_data_on_the_device_is_a_blocking_upload():
    with HostSyncs(DEV) as syncs:
        d = torch.ones(3, device=DEV)
        start = syncs.count
        up = d.new_tensor([1, 2, 3])
        assert syncs.count - start == 1 and syncs._on_dev(up), syncs.where
        kw = d.new_tensor(data=[1, 2])
        assert syncs.count - start == 2 and syncs._on_dev(kw), syncs.where
        same = d.new_tensor(d.detach().clone())  # device data stays on the device: no copy across
        host = d.new_tensor([1, 2], device="cpu")  # made on the host: neither an upload nor device data
        assert syncs.count - start == 2, syncs.where
        assert syncs._on_dev(same) and not syncs._on_dev(host)
        host.tolist()
        assert syncs.count - start == 2, syncs.where


@pytest.mark.parametrize("on", ["device", "host"])
def test_a_slice_bounded_by_a_device_tensor_reads_it(on):
    def cut(d, h):
        (d if on == "device" else h)[: d.sum().long() - 4]

    n, where = _counted(cut)
    assert n == 1 and "slice bound" in where[-1], where


def test_a_slice_bounded_by_host_numbers_reads_nothing():
    n, where = _counted(lambda d, h: d[: torch.tensor(2)] + d[1:])
    assert n == 0, where


# each call takes ``n``, a 0-dim device integer (2), as a size: Python's argument parser reads it
_SIZED = {
    "arange": lambda d, h, n: torch.arange(n), "arange(end=)": lambda d, h, n: torch.arange(0, end=n),
    "zeros": lambda d, h, n: torch.zeros(n), "zeros(tuple)": lambda d, h, n: torch.zeros((n, 2)),
    "empty": lambda d, h, n: torch.empty(n, 1), "ones": lambda d, h, n: torch.ones(n),
    "full": lambda d, h, n: torch.full((n,), 1.0), "eye": lambda d, h, n: torch.eye(n),
    "new_zeros": lambda d, h, n: d.new_zeros(n), "new_full": lambda d, h, n: d.new_full((n,), 0.0),
    "narrow": lambda d, h, n: h.narrow(0, 0, n), "narrow(device)": lambda d, h, n: d.narrow(0, 0, n),
    "torch.narrow": lambda d, h, n: torch.narrow(h, 0, 0, length=n),
    "reshape": lambda d, h, n: h[:2].reshape(n, 1), "view": lambda d, h, n: d[:2].view((n, 1)),
    "split": lambda d, h, n: h.split(n), "expand": lambda d, h, n: h[:1].expand(n, 3),
    "repeat": lambda d, h, n: d.repeat(n), "tile": lambda d, h, n: h.tile((n,)),
}


@pytest.mark.parametrize("use", list(_SIZED.values()), ids=list(_SIZED))
def test_a_device_tensor_used_as_a_size_is_read(use):
    n, where = _counted(lambda d, h: use(d, h, d[1].long()))
    assert n == 1 and "device size" in where[-1], where


def test_sizes_from_the_host_read_nothing():
    def sized(d, h):
        k = torch.tensor(2)  # a 0-dim host integer: read on the host
        torch.arange(k), torch.zeros(k, 2), d.narrow(0, 0, k), d[:2].reshape(k, 1), d.split(k), d.repeat(2)
        d.new_zeros(3), d[:1].expand(3), torch.full((3,), 1.0)

    n, where = _counted(sized)
    assert n == 0, where


class _Moves(HostSyncs):
    """``HostSyncs`` that also keeps each ``.to`` call's target and ``non_blocking``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.moves: list[tuple[torch.device | str | None, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "to":
            target = next((a for a in args[1:] if isinstance(a, (torch.device, str))), kwargs.get("device"))
            self.moves.append((target, bool(kwargs.get("non_blocking", False))))
        return super().__torch_function__(func, types, args, kwargs)


def test_fetch_packs_on_the_device_when_the_first_part_is_on_the_host():
    """A host part first: every part goes to the device part's device, and the one read is the
    packed tensor's (no ``.to(host, non_blocking=True)`` that ``cat`` could read before it lands)."""
    host_ids = torch.tensor([[4, 5], [6, 7]], device=HOST)
    with _Moves(DEV) as audit:
        scores = torch.tensor([0.25, -1.5, 3.0], device=DEV)
        flags = torch.tensor([True, False], device=DEV)
        start = audit.count
        out = fetch({"ids": host_ids, "scores": scores, "flags": flags})
    to_host = [m for m in audit.moves if m[0] in (HOST, "cpu")]
    assert not any(nb for _, nb in to_host), audit.moves
    assert (DEV, True) in audit.moves, audit.moves  # the host part went up, not waited for
    assert audit.count - start == 1, audit.where
    np.testing.assert_array_equal(out["ids"], np.array([[4, 5], [6, 7]]))
    np.testing.assert_array_equal(out["scores"], np.array([0.25, -1.5, 3.0]))
    np.testing.assert_array_equal(out["flags"], np.array([True, False]))


def test_fetch_of_host_parts_only_stays_on_the_host():
    with _Moves(DEV) as audit:
        out = fetch({"a": torch.tensor([1, 2], device=HOST), "b": torch.tensor([0.5], device=HOST)})
        assert audit.count == 0, audit.where
    assert audit.moves == [] and out["a"].tolist() == [1, 2] and out["b"].tolist() == [0.5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the stale read is a CUDA stream race")
def test_fetch_reads_a_late_device_part_after_it_lands_on_cuda():
    """The device part is queued behind a long kernel (``torch.cuda._sleep``): packing it on the
    host without a sync would read it before it is written."""
    host = torch.arange(4, device=HOST).pin_memory()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    late = torch.arange(1, 100_001, device="cuda") * 3
    out = fetch({"host": host, "late": late})
    np.testing.assert_array_equal(out["host"], np.arange(4))
    np.testing.assert_array_equal(out["late"], np.arange(1, 100_001) * 3)
