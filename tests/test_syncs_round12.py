"""Round 12: host syncs the counter missed, and the one per-row trees made.

``device_audit.HostSyncs`` counted reads by name (``item``, ``tolist``, ``cpu`` ...) only: indexing
a device tensor with a host list or a mask, ops whose output shape the device's data decides, and
Python answers from device data (``equal``, ``in``, ``repr``) all wait for the device and went
uncounted; so did ``sampling._depth_groups`` indexing per-row trees with a host list once per depth
(3-9 syncs a round for EAGLE / parallel trees with a user processor or repetition penalty). A
device tensor kept in an ``lru_cache`` under one counter was host data under the next, so reads of
it counted 0 depending on which test ran first."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_host_syncs import DEV, syncs_per_round, target  # noqa: F401 - target: the module's fixture

from spec_plugins.device_audit import _DEVICE_CACHES, PACKAGES, HostSyncs
from spec_plugins.sampling import _shared_groups
from spec_plugins.transfer import upload_tensor
from spec_plugins.verify import _shared

# each waits for the device on a GPU (a read, a blocking upload, or a data-dependent output size)
HIDDEN_READS: dict[str, Callable[[torch.Tensor], Any]] = {
    "host.copy_(device)": lambda t: torch.empty(4, dtype=torch.long, device="cpu").copy_(t),
    "t[bool mask]": lambda t: t[t > 0],
    "t[bool mask] = device values": lambda t: t.clone().__setitem__(t > 0, t[:2]),
    "t[bool mask] = device scalar": lambda t: t.clone().__setitem__(t > 0, t[0]),
    "index_put_ mask, device values": lambda t: t.clone().index_put_((t > 0,), t[:2]),
    "index_put_ mask, accumulate": lambda t: t.clone().index_put_((t > 0,), torch.tensor(1), accumulate=True),
    "t[0-dim device index]": lambda t: t[t.argmax()],
    "t[0-dim device index] = 9": lambda t: t.clone().__setitem__(t.argmax(), 9),
    "t[:, 0-dim device index]": lambda t: t[None][:, t.argmax()],
    "t[0-dim device bool]": lambda t: t[t.any()],
    "t[host list]": lambda t: t[[1, 2]],
    "t[:, host list]": lambda t: t[None][:, [1, 2]],
    "t[host index tensor]": lambda t: t[torch.tensor([1, 2], device="cpu")],
    "t[host index tensor] = 0": lambda t: t.clone().__setitem__(torch.tensor([1, 2], device="cpu"), 0),
    "index_put_ host index": lambda t: t.clone().index_put_((torch.tensor([1], device="cpu"),), t[:1]),
    "t.nonzero()": lambda t: t.nonzero(),
    "torch.argwhere": lambda t: torch.argwhere(t),
    "torch.where(condition)": lambda t: torch.where(t > 0),
    "masked_select": lambda t: torch.masked_select(t, t > 0),
    "torch.unique": lambda t: torch.unique(t),
    "repeat_interleave(tensor repeats)": lambda t: torch.repeat_interleave(t),
    "t.repeat_interleave(tensor)": lambda t: t.repeat_interleave(t),
    "bincount": lambda t: torch.bincount(t),
    "torch.equal": lambda t: torch.equal(t, t),
    "torch.allclose": lambda t: torch.allclose(t.float(), t.float()),
    "3 in t": lambda t: 3 in t,
    "repr(t)": lambda t: repr(t),
    "f'{t[1]}'": lambda t: f"{t[1]}",
}


def _count(op: Callable[[torch.Tensor], Any]) -> int:
    """Syncs ``op`` makes on a device tensor made inside the counter."""
    with HostSyncs(DEV) as syncs:
        t = torch.tensor([0, 3, 0, 5], device=DEV)
        before = syncs.count
        op(t)
        return syncs.count - before


@pytest.mark.parametrize("name", list(HIDDEN_READS))
def test_the_counter_counts_a_read_by_another_name_once(name):
    assert _count(HIDDEN_READS[name]) == 1


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_the_counter_counts_no_sync_where_none_is_made():
    """A device-to-device ``torch.tensor``, device indices, basic indexing, int repeats and a
    three-argument ``where`` wait for nothing; neither does assigning one host value through a
    lone device mask, which ATen runs as ``masked_fill_`` (``canDispatchToMaskedFill``); a host
    tensor filled from the device stays host data (reading it again is not a second sync)."""
    free = {
        "torch.tensor(device tensor)": lambda t: torch.tensor(t, device=DEV),
        "t[device index]": lambda t: t[upload_tensor([1, 2], DEV)],
        "t[0-dim host index]": lambda t: t[torch.tensor(1, device="cpu")],
        "index_put_ 0-dim device index": lambda t: t.clone().index_put_((t.argmax(),), t[0]),
        "t[bool mask] = 1": lambda t: t.clone().__setitem__(t > 0, 1),
        "t[:, bool mask] = 1.5": lambda t: t[None].float().__setitem__((slice(None), t > 0), 1.5),
        "t[bool mask] = host scalar tensor": lambda t: t.clone().__setitem__(t > 0, torch.tensor(7)),
        "index_put_ mask, host scalar": lambda t: t.clone().index_put_((t > 0,), torch.tensor(7)),
        "masked_fill_": lambda t: t.clone().masked_fill_(t > 0, 0),
        "t[int, slice]": lambda t: t[None][0, 1:],
        "repeat_interleave(int)": lambda t: t.repeat_interleave(2),
        "where(cond, a, b)": lambda t: torch.where(t > 0, t, 0),
    }
    for name, op in free.items():
        assert _count(op) == 0, name
    with HostSyncs(DEV) as syncs:
        host = torch.empty(4, dtype=torch.long, device="cpu")
        host.copy_(upload_tensor([1, 2, 3, 4], DEV))
        assert host.tolist() == [1, 2, 3, 4] and syncs.count == 1


@pytest.mark.parametrize("kind", ["eagle-tree", "parallel-tree"])
def test_per_row_trees_with_penalty_and_processor_read_once_a_round(target, kind):  # noqa: F811
    """``_depth_groups`` uploads each depth's nodes once, without waiting: no host-list index."""
    per_round, where, _ = syncs_per_round(*target, kind, "rep-and-processor")
    assert len(per_round) > 1 and max(per_round) <= 1, f"{kind}: syncs per round {per_round}, where: {where}"


@pytest.mark.parametrize("kind", ["ngram", "eagle-chain"])
def test_nodes_processed_apart_are_named_without_a_read(target, kind):  # noqa: F811
    """After a user processor raises, ``process_tree_apart`` names each failing node from the
    group's host copy of its nodes, not by reading the device's back."""
    per_round, where, _ = syncs_per_round(*target, kind, "processor-raises")
    assert len(per_round) > 1 and max(per_round) <= 1, f"{kind}: syncs per round {per_round}, where: {where}"


CACHED_READS: dict[str, Callable[[], Any]] = {
    "verify._shared": lambda: _shared((-1, 0, 0), DEV)[3].tolist(),
    "sampling._shared_groups": lambda: _shared_groups((-1, 0, 0), DEV)[1][1].tolist(),
}


@pytest.mark.parametrize("name", list(CACHED_READS))
def test_a_cached_device_tensor_counts_under_the_next_counter(name):
    """``_DEVICE_CACHES`` memoise device tensors; the counter empties them when it starts, so
    the second counter's read is counted as the first one's was."""
    counts = []
    for _ in range(2):
        with HostSyncs(DEV) as syncs:
            CACHED_READS[name]()
            counts.append(syncs.count)
    assert counts == [1, 1]


def _device_lru_caches() -> set[tuple[str, str]]:
    """(module, name) of every module-level ``lru_cache`` in the project whose function takes a
    ``device``: each may keep device tensors from one counter to the next."""
    found: set[tuple[str, str]] = set()
    for pkg in PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
            for obj in vars(importlib.import_module(info.name)).values():
                if callable(obj) and hasattr(obj, "cache_clear") and hasattr(obj, "__wrapped__") \
                        and "device" in inspect.signature(obj.__wrapped__).parameters:
                    found.add((obj.__module__, obj.__name__))
    return found


def test_every_device_cache_is_emptied_by_the_counter():
    """``_DEVICE_CACHES`` is kept by hand: a new cache of device tensors left out of it would
    make counts depend on which test ran first."""
    assert _device_lru_caches() == set(_DEVICE_CACHES)
