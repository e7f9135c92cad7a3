"""Find device leaks without a GPU: tensors our code creates without saying where they live.

On a CPU-only machine every tensor is on the one device, so a round that builds a mask or a head
on the host while the target runs on CUDA passes every test and crashes on the first GPU. The
audit is a ``TorchFunctionMode`` that watches each torch call made *from this package's code*
(the innermost frame outside torch itself) and records:

- ``factory``: a tensor factory (``zeros``, ``arange``, ``tensor``, ``nn.Linear``'s ``empty`` ...)
  called without an explicit ``device``: it lands on the default device, wherever the target is;
- ``mixed``: a call whose tensor arguments sit on more than one device (0-dim host scalars
  aside), which torch allows for some ops (indexing a CUDA tensor with a host index) at the cost
  of a hidden copy and a sync; on a GPU this is what it catches.

Host bookkeeping stays allowed: say ``device="cpu"``. Used by ``tests/test_devices.py`` over one
round of every proposer and by ``scripts/gpu_check.py`` on CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.eye, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.linspace, torch.tensor, torch.as_tensor, torch.empty_strided,
    torch.tril_indices, torch.triu_indices,
}
_DATA_FACTORIES = {torch.tensor, torch.as_tensor}  # keep their argument's device when it is a tensor
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_SELF = str(Path(__file__).resolve())


# this project's packages: ``backends`` and ``exporters`` are top-level folders of the source tree
# (an editable install maps them) but sit inside ``spec_plugins`` once a wheel is installed
PACKAGES = ("spec_plugins", "spec_plugins.backends", "spec_plugins.exporters")


def _our_dirs() -> tuple[str, ...]:
    """The directories this project's code is imported from, each ending in a separator: the
    ``PACKAGES``' own search paths, wherever the install put them."""
    dirs: list[str] = []
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)  # the subpackage's location, without running its __init__
        for d in (spec.submodule_search_locations if spec else None) or ():
            dirs += [str(Path(d)) + os.sep, str(Path(d).resolve()) + os.sep]  # as imported, and through links
    return tuple(dict.fromkeys(dirs))


_OURS = _our_dirs()


@dataclass(frozen=True)
class Leak:
    kind: str  # "factory" | "mixed"
    func: str
    where: str  # file:line of our code that made the call

    def __str__(self) -> str:
        return f"{self.kind}: {self.func} at {self.where}"


def _caller() -> str | None:
    """file:line of the innermost frame outside torch, if it is this package's code."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != _SELF:
            root = next((d for d in _OURS if name.startswith(d)), None)
            if root is not None:  # named from the folder above its package: spec_plugins/..., backends/...
                return f"{Path(name).relative_to(Path(root).parent)}:{f.f_lineno}"
            return None
        f = f.f_back
    return None


def _devices(args: Any, kwargs: dict) -> set[torch.device]:
    out: set[torch.device] = set()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if not (x.dim() == 0 and x.device.type == "cpu"):
                out.add(x.device)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    visit(args)
    visit(list(kwargs.values()))
    return out


class DeviceAudit(TorchFunctionMode):
    """``with DeviceAudit() as audit: ...`` then ``audit.leaks`` (unique by kind, function, place)."""

    def __init__(self) -> None:
        super().__init__()
        self.leaks: list[Leak] = []
        self._seen: set[Leak] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        kind = None
        if func in _FACTORIES and kwargs.get("device") is None:
            data = args[0] if args else kwargs.get("data")
            if not (func in _DATA_FACTORIES and isinstance(data, torch.Tensor)):
                kind = "factory"
        elif len(_devices(args, kwargs)) > 1:
            kind = "mixed"
        if kind is not None:
            where = _caller()
            if where is not None:
                leak = Leak(kind, getattr(func, "__name__", str(func)), where)
                if leak not in self._seen:
                    self._seen.add(leak)
                    self.leaks.append(leak)
        return func(*args, **kwargs)

    def report(self) -> str:
        return "\n".join(str(leak) for leak in self.leaks) or "no leaks"


# ---- host syncs, counted without a GPU --------------------------------------------------------------
_UPLOADS = {"tensor", "as_tensor"}  # host data -> a device tensor, one blocking copy
_SYNCS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "__array__"}
# reads by another name: a Python answer (a bool, a string) from device data, or an output whose
# shape only the device's data decides (the host waits for it to size the result)
_DATA_READS = {"equal", "allclose", "__contains__", "__repr__", "__format__", "nonzero", "argwhere",
               "masked_select", "unique", "unique_consecutive", "bincount"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}
_MASKS = (torch.bool, torch.uint8)  # index dtypes ATen reads as masks
# calls taking integer sizes (or arange's bounds): a device tensor among them is read as a number
# (Python's argument parser calls ``__index__``/``item`` in C++, where this mode does not see it).
# name -> the positional arguments that are sizes; ``_SIZE_KWARGS`` name them as keywords
_SIZE_ARGS = {**dict.fromkeys(("arange", "zeros", "ones", "empty", "eye", "randperm"), slice(0, None)),
              "full": slice(0, 1), "new_full": slice(1, 2),
              **dict.fromkeys(("new_zeros", "new_ones", "new_empty", "narrow", "reshape", "view", "split",
                               "expand", "repeat", "tile"), slice(1, None))}
_SIZE_KWARGS = ("size", "shape", "start", "end", "step", "length", "split_size", "split_size_or_sections",
                "sizes", "repeats", "dims", "n", "m")
# lru_caches that keep device tensors from one call to the next: one made under an earlier counter
# (or none) is not marked under this one, so reading it would count nothing; the counter empties
# them when it starts and when it ends (test results then do not depend on what ran before).
# Kept by hand: tests/test_syncs_round12.py checks it against every module-level lru_cache in
# ``PACKAGES`` whose function takes a ``device``
_DEVICE_CACHES = (("spec_plugins.verify", "_shared"), ("spec_plugins.sampling", "_shared_groups"))


def _clear_device_caches() -> None:
    """Empty ``_DEVICE_CACHES`` (imported here: the counter runs with the package loaded)."""
    for module, name in _DEVICE_CACHES:
        getattr(importlib.import_module(module), name).cache_clear()


class HostSyncs(TorchFunctionMode):
    """Counts the device-to-host reads a round makes, on a CPU-only machine.

    The runtime under test is given a device object that compares unequal to the host's
    (``torch.device("cpu", 0)`` against ``HOST = torch.device("cpu")``, the same memory): every
    tensor made with that device, moved to it, or computed from such a tensor is "on the device";
    reading one back to Python (``tolist``, ``item``, ``bool``, ``int``, ``cpu``, ``numpy``,
    ``.to(host)``) is what blocks on a GPU, and is counted. So is a blocking upload of host data
    (``torch.tensor(data, device=...)``, ``.to(device)`` without ``non_blocking``): on CUDA it
    synchronizes the stream (``torch.cuda``'s sync debug mode counts both; the H200 run found 3
    per greedy round where reads alone counted 1). Tensors made on the host (slot bookkeeping,
    drafts built there) are not device tensors.

    As on a GPU, a device tensor *says* it is on the device while the counter runs (on a CPU every
    tensor says ``cpu``): code that follows a tensor's ``.device`` (``x.to(y.device)``,
    ``torch.tensor(..., device=y.device)``) then runs there and is counted as it would be, not as a
    read back. A read back gives a host copy (the CPU would return the device tensor itself, and
    reading that again would count again). ``mark`` a tensor made outside the counter (a model's
    weights) as device data.

    Reads by another name count too (``_hidden_read``): indexing a device tensor with a host list,
    a host index tensor (each a blocking upload), a boolean mask (its nonzero count) or a 0-dim
    device index (read as a number), an op whose output shape depends on device data
    (``nonzero``, ``unique``, one-argument ``where`` ...), a Python answer from device data
    (``equal``, ``in``, ``repr``), a copy into a host tensor (``copy_``, ``host[...] = device``),
    a slice bounded by a device tensor (``t[:n]`` reads ``n``), a device tensor as a size
    (``torch.arange(n)``, ``t.reshape(n, 1)``, ``t.narrow(0, 0, n)``: ``_SIZE_ARGS``). So do uploads
    by another name: ``device[...] = host tensor`` (a 0-dim host value is a fill, read on the host) and
    ``t.new_tensor(host data)`` where ``t`` is on the device."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.count = 0
        self.where: list[str] = []
        self._dev: dict[int, weakref.ref] = {}  # id -> the device tensor (identity, not tensor equality)

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        self._dev[id(t)] = weakref.ref(t)
        return t

    def _on_dev(self, t: Any) -> bool:
        ref = self._dev.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def __enter__(self) -> "HostSyncs":
        _clear_device_caches()
        real = torch._C.TensorBase.device.__get__
        torch.Tensor.device = property(lambda t: self.device if self._on_dev(t) else real(t))  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        del torch.Tensor.device
        _clear_device_caches()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_dev = any(self._on_dev(t) for t in _flat(args, kwargs))
        to_host = name == "to" and any(_is_host(a) for a in (*args[1:], kwargs.get("device")))
        # host.copy_(device tensor): a read into the host tensor, which stays host data
        copy_back = name == "copy_" and src is not None and not self._on_dev(src) and on_dev
        read = src is not None and self._on_dev(src) and (name in _SYNCS or to_host)
        hidden = self._hidden_read(name, args, kwargs) if (on_dev or name in _INDEXING) and not read else None
        if read or copy_back or hidden:
            self.count += 1
            self.where.append(f"{hidden or name} at {_caller() or '?'}")
        # ``t.new_tensor(data)`` makes its tensor where ``t`` is unless told where
        new_dest = (kwargs.get("device") or src.device) if name == "new_tensor" and src is not None else None
        made_here = kwargs.get("device") == self.device or new_dest == self.device or (name == "to" and any(
            a == self.device for a in (*args[1:], kwargs.get("device")) if isinstance(a, torch.device)))
        # an upload of host data that waits for it (CUDA: a blocking copy synchronizes the stream);
        # ``non_blocking=True`` (``transfer.upload``: the driver stages it and returns) does not
        blocking = not kwargs.get("non_blocking", False)
        data = args[0] if args else kwargs.get("data")  # ``torch.tensor(a device tensor)`` copies on the device
        upload = made_here and blocking and ((name in _UPLOADS and not self._on_dev(data))
                                             or (name == "to" and src is not None and not on_dev))
        new_data = args[1] if name == "new_tensor" and len(args) > 1 else kwargs.get("data")
        upload = upload or (new_dest == self.device and not self._on_dev(new_data))
        # ``device[...] = host tensor`` copies it up blocking (``copy_to``, ``ATen/TensorIndexing.h``)
        # unless it is 0-dim: ``fill_`` then takes its value on the host
        value = args[2] if name == "__setitem__" and len(args) > 2 else None
        upload = upload or (self._on_dev(src) and isinstance(value, torch.Tensor) and value.dim() > 0
                            and not self._on_dev(value))
        upload = upload or (name == "copy_" and src is not None and self._on_dev(src) and blocking
                            and len(args) > 1 and isinstance(args[1], torch.Tensor) and not self._on_dev(args[1]))
        if upload:
            self.count += 1
            self.where.append(f"upload {name} at {_caller() or '?'}")
        out = func(*args, **kwargs)
        if read and out is src:  # the CPU returned the device tensor itself: the host gets a copy
            return out.clone()
        made_host = name.startswith("new_") and _is_host(kwargs.get("device"))
        if (on_dev and not to_host and not copy_back and not made_host and name not in _SYNCS) or made_here:
            for t in _flat((out,), {}):
                if isinstance(t, torch.Tensor):
                    self.mark(t)
        return out

    def _hidden_read(self, name: str, args: tuple, kwargs: dict) -> str | None:
        """What a call touching device data waits for though it reads nothing by name (``None``: nothing)."""
        src = args[0] if args else None
        if name in _DATA_READS:
            return name
        if name == "where" and len(args) == 1 and not kwargs:
            return "where(condition)"
        if name == "repeat_interleave" and "output_size" not in kwargs:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", src if len(args) == 1 else None)
            return "repeat_interleave(tensor repeats)" if isinstance(repeats, torch.Tensor) else None
        if name in _SIZE_ARGS:
            sizes = (*args[_SIZE_ARGS[name]], *(kwargs.get(k) for k in _SIZE_KWARGS))
            return f"{name} with a device size" if any(self._on_dev(n) for n in _flat(sizes, {})) else None
        if name in _INDEXING and len(args) > 1:
            items = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, slice) and any(self._on_dev(b) for b in (i.start, i.stop, i.step)) for i in items):
                return f"{name} with a device slice bound"  # read as a number to slice
            if name == "__setitem__" and not self._on_dev(src) and self._on_dev(args[2] if len(args) > 2 else None):
                return "__setitem__ into a host tensor"
            if self._on_dev(src):
                return self._index_wait(name, args, kwargs)
        return None

    def _index_wait(self, name: str, args: tuple, kwargs: dict) -> str | None:
        """What indexing a device tensor waits for, as ATen indexes (``ATen/TensorIndexing.h``):
        a list or a host index tensor goes up blocking (0-dim host integers are read as ints);
        ``t[i]`` with a 0-dim device index reads it (``item``) to pick one entry; a mask's True
        entries are counted (nonzero) to size the result, unless the assignment runs as
        ``masked_fill_`` (``_fills_masked``). ``index_put(_)`` takes a tuple of tensors as they
        are: a 0-dim device index broadcasts there, and a 0-dim mask is still a mask."""
        put = name.startswith("index")
        index = args[1]
        items = tuple(index) if put or isinstance(index, tuple) else (index,)
        if any(isinstance(i, (list, tuple)) for i in items):
            return f"{name} with a host list"
        tensors = [i for i in items if isinstance(i, torch.Tensor)]
        if not put and any(i.dim() == 0 and self._on_dev(i) for i in tensors):
            return f"{name} with a 0-dim device index"
        if any((put or i.dim() > 0) and not self._on_dev(i) for i in tensors):
            return f"{name} with a host index tensor"
        masked = any((put or i.dim() > 0) and i.dtype in _MASKS for i in tensors)
        if masked and not self._fills_masked(name, args, kwargs, items):
            return f"{name} with a mask"
        return None

    def _fills_masked(self, name: str, args: tuple, kwargs: dict, items: tuple) -> bool:
        """Whether an assignment through a mask runs as ``masked_fill_``, which reads nothing
        (``_index_put_impl_`` asks ``canDispatchToMaskedFill``, ``ATen/native/
        TensorAdvancedIndexingUtils.h``): no accumulate, a one-element value on the host (``t[m] = 1``
        makes a Python number there for a CUDA tensor) and one device mask as the only index tensor
        (ints, slices, None, ``...`` and 0-dim integer tensors select or slice instead)."""
        if name == "__getitem__":
            return False
        put = name != "__setitem__"
        value = args[2] if len(args) > 2 else kwargs.get("values")
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if isinstance(value, torch.Tensor):
            one_host = value.numel() == 1 and not self._on_dev(value)
        else:  # a Python number or a nested list of them, made into a host tensor
            one_host = len(_flat((value,), {})) == 1
        # Python bools and 0-dim masks in ``t[...]`` become index tensors too (of longs)
        index_tensors = [i for i in items if isinstance(i, bool) or (
            isinstance(i, torch.Tensor) and (put or i.dim() > 0 or i.dtype in _MASKS))]
        lone = index_tensors[0] if len(index_tensors) == 1 else None
        mask = (isinstance(lone, torch.Tensor) and lone.dtype in _MASKS and self._on_dev(lone)
                and (put or lone.dim() > 0))
        return not accumulate and one_host and mask


def _flat(args: Any, kwargs: dict) -> list[Any]:
    out: list[Any] = []

    def visit(x: Any) -> None:
        if isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        else:
            out.append(x)

    visit(args)
    visit(list(kwargs.values()))
    return out


def _is_host(x: Any) -> bool:
    return (isinstance(x, torch.device) and x.type == "cpu" and x.index is None) or x == "cpu"
