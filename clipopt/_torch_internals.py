"""Every private torch API clipopt uses, each beside the public path that replaces it.

No other clipopt module names a ``torch._`` attribute or imports a private torch module
(``tests/test_torch_internals.py`` fails if one does). Each internal below is looked up,
and where it computes something checked against its public replacement, once at import;
where it is missing or fails the check, the public path is used, with the same results
(only slower). ``CLIPOPT_DISABLE_TORCH_INTERNALS=1`` (read once, at import) takes every
public path, so that the suite can run them on every torch release.

Each internal, the releases checked to have it (the matrix of ``make matrix`` runs 2.6.0
to 2.14.1), and what runs without it:

- ``torch._C._dynamo.guards.TensorGuards`` (2.6-2.14): a plan made afresh per call.
- ``torch._C._group_tensors_by_device_and_dtype`` (2.6-2.14): a dict built in Python.
- ``torch._C._has_storage`` (2.6-2.14): not known, so the raw reader below is unused.
- ``guards._torchinductor_pyobject_tensor_data_ptr`` (2.6-2.14): ``Tensor.data_ptr``.
- ``torch._foreach_norm``, ``_foreach_mul_``, ``_foreach_clamp_min_`` / ``_max_``
  (2.6-2.14): one torch op per tensor.
- ``DeviceMesh._get_root_mesh`` (2.10-2.14); before it
  ``torch.distributed.device_mesh._mesh_resources.get_root_mesh`` (2.6-2.14): without
  either, grads on several sub-meshes are refused with an error.
- ``torch.distributed.tensor.placement_types._StridedShard`` (2.6-2.14; a subclass of
  ``Shard`` up to 2.13, not in 2.14): a DTensor laid out so is refused with an error.
- ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset`` (2.7-2.14);
  in 2.6 the same module's ``compute_local_shape_and_global_offset``, given a stand-in
  mesh at each coordinate; without either, strided layouts are refused as above.

On CPU torch's foreach ops are loops of the same per-tensor ops, so both paths give the
same bits; on CUDA the foreach kernels may round differently in the last place.

Two more places use torch internals of their own subsystem, and say so at their top:
:mod:`clipopt._hooks` (``torch.optim``'s step-hook dicts, which a wrapper must fire in
torch's order) and :mod:`clipopt._step._fold` (the ``grad_scale`` / ``found_inf`` attributes
that torch's fused optimizers read, as ``GradScaler`` sets them).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DISABLE_ENV",
    "available",
    "disabled",
    "foreach_clamp_",
    "foreach_mul_",
    "foreach_norm",
    "group_by_device_and_dtype",
    "has_storage",
    "local_shape_and_offset",
    "root_mesh",
    "strided_shard_types",
    "tensor_data_ptr_reader",
    "tensor_guard",
]

DISABLE_ENV = "CLIPOPT_DISABLE_TORCH_INTERNALS"
"""Set to anything but ``""`` or ``"0"`` to take the public path of every internal."""

_DISABLED = os.environ.get(DISABLE_ENV, "") not in ("", "0")

GroupKey = tuple[torch.device, torch.dtype]


def disabled() -> bool:
    """Whether ``CLIPOPT_DISABLE_TORCH_INTERNALS`` was set when clipopt was imported."""
    return _DISABLED


def _lookup(owner: object, name: str) -> Any:
    return None if _DISABLED else getattr(owner, name, None)


# --- grouping by device and dtype -------------------------------------------------------


def _group_in_python(tensors: Sequence[Tensor]) -> dict[GroupKey, tuple[list[Tensor], list[int]]]:
    grouped: dict[GroupKey, tuple[list[Tensor], list[int]]] = {}
    for index, t in enumerate(tensors):
        members, indices = grouped.setdefault((t.device, t.dtype), ([], []))
        members.append(t)
        indices.append(index)
    return grouped


def _group_in_cpp(
    helper: Any, tensors: Sequence[Tensor]
) -> dict[GroupKey, tuple[list[Tensor], list[int]]]:
    # The helper's own dict order is unspecified, but it reports each tensor's index.
    grouped = helper([list(tensors)], True)
    ordered = sorted(grouped.items(), key=lambda item: item[1][1][0])
    return {key: (list(lists[0]), list(indices)) for key, (lists, indices) in ordered}


def group_by_device_and_dtype(
    tensors: Sequence[Tensor],
) -> dict[GroupKey, tuple[list[Tensor], list[int]]]:
    """``tensors`` by (device, dtype), each group's tensors and their positions in order,
    groups in order of first appearance (as ``torch.nn.utils`` groups grads)."""
    if not tensors:
        return {}
    # torch 2.6's dynamo cannot trace the helper; a compiled graph groups as Python does.
    if _GROUPER is None or torch.compiler.is_compiling():
        return _group_in_python(tensors)
    return _group_in_cpp(_GROUPER, tensors)


def _checked_grouper() -> Any:
    helper = _lookup(torch._C, "_group_tensors_by_device_and_dtype")
    if helper is None:
        return None
    probe = [torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.ones(3)]
    try:
        found = _group_in_cpp(helper, probe)
    except (RuntimeError, TypeError):
        return None
    expected = _group_in_python(probe)
    same = list(found) == list(expected) and all(
        found[k][1] == expected[k][1]
        and all(a is b for a, b in zip(found[k][0], expected[k][0], strict=True))
        for k in expected
    )
    return helper if same else None


_GROUPER = _checked_grouper()


# --- tensors' storage and data pointers -------------------------------------------------

_HAS_STORAGE = _lookup(torch._C, "_has_storage")


def has_storage(t: Tensor) -> bool:
    """Whether ``t`` is known to have storage (False where this torch cannot say)."""
    return _HAS_STORAGE is not None and bool(_HAS_STORAGE(t))


def tensor_data_ptr_reader() -> int:
    """The address of torch's C function that reads a tensor's data pointer (the one
    inductor's generated CPU code calls); 0 where there is none. It aborts the process on
    a tensor without storage, and :mod:`clipopt._kernels._cpu` checks it against ``data_ptr``
    before using it."""
    try:
        from torch._C._dynamo import guards
    except ImportError:
        return 0
    address = _lookup(guards, "_torchinductor_pyobject_tensor_data_ptr")
    return address if isinstance(address, int) and address > 0 else 0


# --- guards on tensors' metadata --------------------------------------------------------


def _guard_type() -> Any:
    try:
        from torch._C._dynamo import guards
    except ImportError:
        return None
    kind = _lookup(guards, "TensorGuards")
    if kind is None:
        return None
    probe = torch.zeros(2, 3)
    try:
        guard = _make_guard(kind, [probe])
        holds = guard.check(torch.ones(2, 3)) and not guard.check(torch.ones(3, 2))
    except (RuntimeError, TypeError):
        return None
    return kind if holds else None


def _make_guard(kind: Any, tensors: Sequence[Tensor]) -> Any:
    return kind(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )


_GUARD = _guard_type()


def tensor_guard(tensors: Sequence[Tensor]) -> Any:
    """A check (``.check(*tensors) -> bool``) that tensors have the dtype, device, layout,
    dispatch keys, ``requires_grad``, shape and strides of ``tensors``: the C++ check
    ``torch.compile`` guards tensors with; None where this torch has none."""
    return None if _GUARD is None else _make_guard(_GUARD, tensors)


# --- foreach ops ------------------------------------------------------------------------

_FOREACH = not _DISABLED and all(
    hasattr(torch, name)
    for name in ("_foreach_norm", "_foreach_mul_", "_foreach_clamp_min_", "_foreach_clamp_max_")
)
# Looked up on torch at each call, not kept: a profiler or a test may wrap torch's own.


def foreach_norm(tensors: list[Tensor], p: float, dtype: torch.dtype | None = None) -> list[Tensor]:
    """The ``p``-norm of each tensor (0-dim, in ``dtype`` if given), as torch's clip takes
    them: one grouped kernel on CUDA."""
    if not _FOREACH:
        return [torch.linalg.vector_norm(t, p, dtype=dtype) for t in tensors]
    return list(torch._foreach_norm(tensors, p, dtype=dtype))


def foreach_mul_(tensors: list[Tensor], coef: Tensor) -> None:
    """Multiply each tensor in place by the 0-dim ``coef``."""
    if not _FOREACH:
        for t in tensors:
            t.mul_(coef)
        return
    torch._foreach_mul_(tensors, coef)


def foreach_clamp_(tensors: list[Tensor], value: float) -> None:
    """Clamp each tensor in place to ``[-value, value]``."""
    if not _FOREACH:
        for t in tensors:
            t.clamp_(-value, value)
        return
    torch._foreach_clamp_min_(tensors, -value)
    torch._foreach_clamp_max_(tensors, value)


# --- DTensor layouts --------------------------------------------------------------------


def strided_shard_types() -> tuple[type, ...]:
    """``(_StridedShard,)``, the placement FSDP2 gives dim 0 over TP, or ``()`` where this
    torch has none (or internals are disabled): such a layout is then refused."""
    if _DISABLED:
        return ()
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return ()
    return (_StridedShard,)


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (itself if it was not); None where this torch
    cannot say (or internals are disabled)."""
    if _DISABLED:
        return None
    method = getattr(mesh, "_get_root_mesh", None)
    if method is not None:
        return method()
    from torch.distributed import device_mesh

    resources = getattr(device_mesh, "_mesh_resources", None)
    lookup = getattr(resources, "get_root_mesh", None)
    return None if lookup is None else lookup(mesh)


class _MeshAt:
    """What torch 2.6's ``compute_local_shape_and_global_offset`` reads of a mesh: its
    shape and one rank's coordinate, for any coordinate."""

    def __init__(self, shape: tuple[int, ...], coordinate: list[int]) -> None:
        self._shape, self._coordinate = shape, coordinate
        self.ndim = len(shape)

    def size(self, mesh_dim: int) -> int:
        return self._shape[mesh_dim]

    def get_coordinate(self) -> list[int]:
        return self._coordinate


def local_shape_and_offset(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: list[int],
    placements: Sequence[Any],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The local shape and global offset, by torch's own rule, of a DTensor of ``shape``
    on the rank at ``coordinate`` of a mesh of ``mesh_shape``; None where this torch
    offers no such rule (or internals are disabled)."""
    if _DISABLED:
        return None
    from torch.distributed.tensor import _utils

    compute = getattr(_utils, "_compute_local_shape_and_global_offset", None)
    if compute is not None:
        local, offset = compute(shape, mesh_shape, list(coordinate), placements)
    else:
        public_module_form = getattr(_utils, "compute_local_shape_and_global_offset", None)
        if public_module_form is None:
            return None
        local, offset = public_module_form(shape, _MeshAt(mesh_shape, coordinate), placements)
    return tuple(local), tuple(offset)


def available() -> dict[str, bool]:
    """Which internals this process uses (False: their public path runs instead)."""
    try:
        from torch.distributed.tensor import _utils
    except ImportError:
        _utils = None  # type: ignore[assignment]
    return {
        "TensorGuards": _GUARD is not None,
        "_group_tensors_by_device_and_dtype": _GROUPER is not None,
        "_has_storage": _HAS_STORAGE is not None,
        "_torchinductor_pyobject_tensor_data_ptr": tensor_data_ptr_reader() != 0,
        "_foreach_norm/_mul_/_clamp_min_/_clamp_max_": _FOREACH,
        "_StridedShard": bool(strided_shard_types()),
        "root mesh lookup": not _DISABLED,
        "_compute_local_shape_and_global_offset": not _DISABLED
        and _utils is not None
        and hasattr(_utils, "_compute_local_shape_and_global_offset"),
    }
