"""A CUDA device simulated on a CPU-only torch, to prove on CPU that code keeps every tensor on
the device it was given.

Inside ``simulated_cuda()``, a tensor created with ``device="cuda"`` (``torch.zeros(...,
device="cuda")``, ``x.to("cuda")``, ``torch.tensor(..., device="cuda")``, or any factory given a
simulated tensor's ``.device``) is a ``SimulatedCuda`` tensor: its data lives on the CPU, its
``.device`` says ``cuda:0``, and every operation on it runs on that CPU data. What a real CUDA
device refuses is refused here too, with ``DeviceMismatch``:

- an operation mixing a simulated tensor with a CPU tensor of one or more dimensions (a CPU
  0-dim tensor is a scalar, which CUDA accepts), such as adding a CPU bias row to CUDA logits;
- a CPU tensor as the values of an indexed write into a simulated tensor;
- a CPU tensor indexed by a simulated one.

Allowed, as on CUDA: CPU index tensors (integer or mask) and Python lists indexing a simulated
tensor,
``.tolist()``/``.item()`` (a synchronisation), ``.to("cpu")``/``.cpu()`` and copies across.

``torch.Generator(device="cuda")`` gives a CPU generator marked as the device's; a draw on a
simulated tensor from an unmarked (CPU) generator, or the reverse, is refused, as on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)


_REAL_GENERATOR = torch.Generator
_device_generators: set[int] = set()


class _Generator(_REAL_GENERATOR):
    """``torch.Generator`` inside ``simulated_cuda()``: a CUDA one is a CPU one, marked."""

    def __new__(cls, device: str | torch.device = "cpu") -> _Generator:
        g = super().__new__(cls, device="cpu")  # type: ignore[call-arg]
        if _is_cuda(device):
            _device_generators.add(id(g))
        return g

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = CUDA

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._device


@dataclass(slots=True)
class Traffic:
    """Host-to-device transfers made inside one ``simulated_cuda()``."""

    copies: int = 0
    elements: int = 0

    def add(self, t: torch.Tensor) -> None:
        self.copies += 1
        self.elements += t.numel()


_traffic: list[Traffic] = []


def _count(t: torch.Tensor) -> None:
    for tr in _traffic:
        tr.add(t)


class DeviceMismatch(RuntimeError):
    """What CUDA would raise: tensors on two devices in one operation."""


class SimulatedCuda(torch.Tensor):
    """A tensor whose ``.device`` is ``cuda:0`` and whose data is ``elem`` on the CPU."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> SimulatedCuda:
        t = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, device=CUDA, requires_grad=False)
        t.elem = elem
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        raise RuntimeError(f"a simulated CUDA tensor used outside simulated_cuda(): {func}")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"SimulatedCuda({self.elem!r})"


def _is_cuda(d: object) -> bool:
    return isinstance(d, (str, torch.device)) and torch.device(d).type == "cuda"


def _wrap(x: Any) -> Any:
    return SimulatedCuda(x) if isinstance(x, torch.Tensor) and not isinstance(
        x, SimulatedCuda) else x


def _unwrap(x: Any) -> Any:
    if isinstance(x, SimulatedCuda):
        return x.elem
    if _is_cuda(x):
        return torch.device("cpu")
    return x


def _describe(ts: list[torch.Tensor]) -> str:
    return ", ".join(f"{'cuda' if isinstance(t, SimulatedCuda) else 'cpu'}"
                     f"{list(t.shape)}" for t in ts)


def _check(what: object, tensors: list[torch.Tensor]) -> None:
    dev = [t for t in tensors if isinstance(t, SimulatedCuda)]
    cpu = [t for t in tensors if not isinstance(t, SimulatedCuda) and t.dim() > 0]
    if dev and cpu:
        raise DeviceMismatch(f"{what}: expected all tensors on one device, got "
                             f"{_describe(tensors)}")


def _tensors(*trees: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(trees)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _index_tensors(index: Any) -> list[torch.Tensor]:
    return _tensors(index)


def _check_generators(func: object, args: Any, kwargs: Any) -> None:
    """A draw from a generator of one device into tensors of another is refused."""
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    for g in flat:
        if isinstance(g, _REAL_GENERATOR) and tensors:
            mine = id(g) in _device_generators
            if mine != any(isinstance(t, SimulatedCuda) for t in tensors):
                raise DeviceMismatch(f"{func}: a {'cuda' if mine else 'cpu'} generator drawing "
                                     f"into {_describe(tensors)}")


class _Functions(TorchFunctionMode):
    """What must be caught before torch's C++ bindings look for a CUDA runtime: moves across
    devices, factories given a CUDA device, indexing, and reading values back."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        _check_generators(func, args, kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy) and isinstance(
                args[0], SimulatedCuda):
            with torch._C.DisableTorchFunction():
                return func(args[0].elem, *args[1:], **kwargs)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], SimulatedCuda):
            x, index = args
            with torch._C.DisableTorchFunction():
                return _wrap(x.elem[tree_map(_unwrap, index)])
        if func is torch.Tensor.__getitem__ and any(
                isinstance(t, SimulatedCuda) for t in _index_tensors(args[1])):
            raise DeviceMismatch("indexing a cpu tensor with a cuda index: "
                                 f"{_describe([args[0], *_index_tensors(args[1])])}")
        if func is torch.Tensor.__setitem__ and isinstance(args[0], SimulatedCuda):
            x, index, value = args
            if isinstance(value, torch.Tensor):
                _check("writing cpu values into a cuda tensor", [x, value])
            with torch._C.DisableTorchFunction():
                x.elem[tree_map(_unwrap, index)] = _unwrap(value)
            return None
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            k = dict(kwargs, device="cpu")
            data = tree_map(_unwrap, args)
            with torch._C.DisableTorchFunction():
                made = func(*data, **k).clone()
            _count(made)
            return SimulatedCuda(made)
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if "not linked with support for cuda" not in str(e):
                raise
        # A binding that guards the device before dispatching (operators with a Python scalar,
        # ``~x``): checked and run here on the CPU data.
        _check(func, _tensors(args, kwargs))
        with torch._C.DisableTorchFunction():
            out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if isinstance(args[0], SimulatedCuda) and out is args[0].elem:
            return args[0]  # in place
        return tree_map(_wrap, out)

    @staticmethod
    def _move(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        x = args[0]
        target: torch.device | None = None
        if func is torch.Tensor.cuda:
            target = CUDA
        elif func is torch.Tensor.cpu:
            target = torch.device("cpu")
        else:
            for a in [*args[1:], kwargs.get("device")]:
                if isinstance(a, (str, torch.device)):
                    target = torch.device(a)
                elif isinstance(a, torch.Tensor):
                    target = a.device
        dtypes = [a for a in args[1:] if isinstance(a, torch.dtype)]
        dtype = kwargs.get("dtype", dtypes[0] if dtypes else None)
        with torch._C.DisableTorchFunction():
            if target is not None and target.type == "cuda" and not isinstance(x, SimulatedCuda):
                _count(x)
                return SimulatedCuda(x.to(dtype=dtype or x.dtype).clone())
            if target is not None and target.type == "cpu" and isinstance(x, SimulatedCuda):
                return x.elem.to(dtype=dtype or x.dtype).clone()
            if isinstance(x, SimulatedCuda):
                return SimulatedCuda(x.elem.to(dtype=dtype or x.dtype))
            return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    """Every aten operation: refused when it mixes devices, run on the CPU data otherwise, its
    results on the simulated device when any input (or a ``device=`` argument) was."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        name = str(func)
        cross = name.startswith(("aten.copy_", "aten._to_copy", "aten.lift_fresh",
                                 "aten._local_scalar_dense"))
        if name.startswith(("aten.index.", "aten.index_put", "aten._index_put_impl")):
            # CUDA takes CPU integer indices; not CPU values or a CPU source.
            indices = _tensors(args[1])
            rest = [t for t in tensors if not any(t is i for i in indices)]
            _check(func, rest)
        elif not cross:
            _check(func, tensors)
        on_device = any(isinstance(t, SimulatedCuda) for t in tensors) or any(
            _is_cuda(v) for v in kwargs.values())
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if name.startswith("aten.copy_"):
            return args[0]
        return tree_map(_wrap, out) if on_device else out


@contextlib.contextmanager
def simulated_cuda() -> Iterator[Traffic]:
    """Run the body with ``cuda`` simulated (see the module docstring); yields the count of its
    host-to-device transfers."""
    traffic = Traffic()
    _traffic.append(traffic)
    try:
        with mock.patch("torch.cuda._lazy_init", lambda: None), \
                mock.patch("torch.Generator", _Generator), _Functions(), _Dispatch():
            yield traffic
    finally:
        _traffic.remove(traffic)


def cuda_tensor(x: torch.Tensor) -> SimulatedCuda:
    """``x`` (CPU) as a simulated CUDA tensor."""
    return SimulatedCuda(x.clone())


def on_cuda(x: Any) -> bool:
    return isinstance(x, SimulatedCuda)

