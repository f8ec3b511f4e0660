"""Tensors on the simulated ``npu``: device tensors without storage of their own whose values live
in a CPU tensor, with their ops registered for the PrivateUse1 dispatch key with ``torch.library``
(as PyTorch's own test_privateuseone_python_backend.py does), so they dispatch as torch_npu's do.

A device tensor comes from ``torch._C._acc.create_empty_tensor`` (contiguous, reported as
``npu:0``: the worker's one visible device). Its CPU values are found by its storage, which
a shallow copy such as ``param.data = t`` or an alias shares. Copies between host and device are
the ``_copy_from`` kernel, which records each one; every other op runs on CPU through one
fallback, and what it returns becomes a new device tensor (a view is a copy there: writes through
a view do not reach its base, except a view of contiguous rows, whose CPU values are the base's).
While a graph is captured in the calling thread (graphs.py), every op on device tensors is also
recorded as a step of the graph, and a copy between host and device is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tests.support.npu_sim.runtime import SIM

__all__ = ["register_kernels", "host_of", "storage_of", "rerun", "pin_memory", "is_pinned"]

#: storage (StorageImpl address) → (the storage, kept alive, and its CPU tensor)
_HOSTS: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
_sweep_at = [1024]
_libraries: list[torch.library.Library] = []


def _wrap(host: torch.Tensor) -> torch.Tensor:
    """A new device tensor holding ``host``'s values (kept contiguous, as the wrapper claims)."""
    SIM.ensure_init("tensor")
    host = host.contiguous()
    t = torch._C._acc.create_empty_tensor(tuple(host.shape), host.dtype)
    storage = t.untyped_storage()
    _HOSTS[storage._cdata] = (storage, host)
    if len(_HOSTS) >= _sweep_at[0]:
        _sweep()
    return t


def _sweep() -> None:
    """Forget storages no tensor uses any more (only our own reference is left)."""
    for key in [k for k, (s, _) in _HOSTS.items() if torch._C._storage_Use_Count(s._cdata) <= 1]:
        del _HOSTS[key]
    _sweep_at[0] = max(1024, 2 * len(_HOSTS))


def host_of(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding device tensor ``t``'s values."""
    entry = _HOSTS.get(t.untyped_storage()._cdata)
    if entry is None:
        raise RuntimeError("simulated npu: a device tensor without values")
    host = entry[1]
    if host.shape != t.shape:  # an alias PyTorch made with other sizes (a view)
        host = host.as_strided(t.size(), t.stride(), t.storage_offset())
    return host


def storage_of(t: torch.Tensor) -> int:
    """Where device tensor ``t``'s values live (shared by a view of contiguous rows and its base)."""
    return host_of(t).untyped_storage().data_ptr()


def _is_npu(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "npu"


def _launch(op: str) -> None:
    """Note work launched from a thread that never set its device (CANN has no context there)."""
    if SIM.bound_index() is None:
        SIM.record("unbound_launch", op=op)


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Any other op: run it on the CPU values, wrap what it returns (a step of the graph being
    captured, if one is)."""
    _launch(str(op))
    if op is torch.ops.aten._local_scalar_dense.default:  # .item(), bool(): waits for the device
        SIM.refuse_in_capture("reading a device value on the host")
    out, hosts = _on_host(op, args, kwargs)

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            same = hosts.get(id(x))
            return same if same is not None else _wrap(x)
        return x

    view = _is_view(op)
    if view:  # PyTorch ties a view to its base: of a normal tensor it is a normal one
        with torch.inference_mode(False):
            result = pytree.tree_map(wrap, out)
    else:
        result = pytree.tree_map(wrap, out)
    capture = SIM.capturing()
    if capture is not None:
        capture.step(op, args, kwargs, result, view=view)
    return result


def _on_host(op: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[int, torch.Tensor]]:
    """Run ``op`` on the CPU values of its device tensors; what it returned, and each CPU value
    (by id) → the device tensor it is the value of."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "npu":
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if kwargs.get("pin_memory"):
        kwargs = {**kwargs, "pin_memory": False}
    hosts: dict[int, torch.Tensor] = {}

    def unwrap(x: Any) -> Any:
        if _is_npu(x):
            h = host_of(x)
            hosts[id(h)] = x
            return h
        return x

    return op(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs)), hosts


def rerun(op: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
    """Run a captured step again on the device tensors it was captured with, writing what it
    returns into the device tensors it returned then (a graph's fixed addresses)."""
    fresh, _ = _on_host(op, args, kwargs)
    for old, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(fresh), strict=True):
        if _is_npu(old) and isinstance(new, torch.Tensor):
            dst = host_of(old)
            if dst.data_ptr() != new.data_ptr() or dst.shape != new.shape:
                dst.copy_(new)


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """A copy between device tensors, on their CPU values (a graph step when captured)."""
    return dst.copy_(src)


def _is_view(op: Any) -> bool:
    returns = op._schema.returns
    info = returns[0].alias_info if returns else None
    return info is not None and not info.is_write


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """A copy between host and device (or device and device), as the runtime would do it."""
    stream = SIM.current_stream()
    stream_id = stream.sim_id if stream is not None else None
    if _is_npu(src) and _is_npu(dst):
        _launch("d2d")
        host_of(dst).copy_(host_of(src))
        capture = SIM.capturing()
        if capture is not None:
            capture.step(_host_copy, (dst, src), {}, dst, view=False)
        return dst
    SIM.refuse_in_capture("a copy between host and device")
    if _is_npu(dst):  # host to device
        _launch("h2d")
        pinned = is_pinned(src)
        into = host_of(dst)  # the whole storage: a view of its first rows writes into its base
        row = max(1, math.prod(into.shape[1:]))
        SIM.record("h2d", stream=stream_id, non_blocking=non_blocking, pinned=pinned,
                   shape=list(src.shape), physical=SIM.physical(SIM.current_index()),
                   dst_storage=storage_of(dst),
                   dst_rows=into.untyped_storage().nbytes() // into.element_size() // row)
        if non_blocking and not pinned and stream is not None:
            stream.synchronize()  # torch_npu: from pageable memory the whole stream waits
        host_of(dst).copy_(src)
        return dst
    _launch("d2h")  # device to host
    values = host_of(src).clone()
    SIM.record("d2h", stream=stream_id, non_blocking=non_blocking, shape=list(src.shape),
               physical=SIM.physical(SIM.current_index()))
    if non_blocking and stream is not None:  # done when an event after it completes
        if dst.is_floating_point():
            dst.fill_(float("nan"))
        stream.writes.append((dst, values))
    else:
        if stream is not None:
            stream.synchronize()
        dst.copy_(values)
    return dst


def _to_copy(t: torch.Tensor, *, dtype: Any = None, layout: Any = None, device: Any = None,
             pin_memory: Any = None, non_blocking: bool = False,
             memory_format: Any = None) -> torch.Tensor:
    """``.to()`` of a device tensor. To the host the destination is page-locked memory when the
    copy does not block, as torch_npu allocates it (the Python backend has no such allocator)."""
    if not _is_npu(t):  # host to device (the device argument brought the call here)
        out = _wrap(torch.empty(t.shape, dtype=dtype or t.dtype))
        return _copy_from(t.to(dtype=dtype or t.dtype), out, non_blocking=non_blocking)
    if device is not None and torch.device(device).type == "cpu":
        out = torch.empty(t.shape, dtype=dtype or t.dtype)
        if non_blocking:
            out._npu_sim_pinned = True  # type: ignore[attr-defined]
        if out.dtype != t.dtype:
            return _copy_from(t, out, non_blocking=False)
        return _copy_from(t, out, non_blocking=non_blocking)
    return _fallback(torch.ops.aten._to_copy.default, t, dtype=dtype or t.dtype)


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if _is_npu(dst):
        raise RuntimeError("simulated npu: resizing a device tensor")
    dst.resize_(src.shape)
    return _copy_from(src, dst)


def is_pinned(t: torch.Tensor, device: Any = None) -> bool:
    """Whether host tensor ``t`` came from :func:`pin_memory` (the simulation's page-locked set)."""
    return bool(getattr(t, "_npu_sim_pinned", False))


def pin_memory(t: torch.Tensor, device: Any = None) -> torch.Tensor:
    """A page-locked copy of ``t`` (torch 2.13's Python backend has no pinned allocator)."""
    if t.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{t.device}' memory, only dense CPU tensors")
    SIM.ensure_init("pin_memory")
    if is_pinned(t):
        return t
    out = t.clone()
    out._npu_sim_pinned = True  # type: ignore[attr-defined]
    SIM.record("pin", shape=list(t.shape))
    return out


def register_kernels() -> None:
    """Register the PrivateUse1 kernels (once per process)."""
    if _libraries:
        return
    impl = torch.library.Library("aten", "IMPL")
    impl.impl("_copy_from", _copy_from, "PrivateUse1")
    impl.impl("_to_copy", _to_copy, "PrivateUse1")
    impl.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    _libraries.extend([impl, fallback])
