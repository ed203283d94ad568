"""Drop-in replacements for ``torch.nn.utils``' gradient clipping functions (docs/functional.md)."""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import Tensor

from clipopt._dist import _mesh, _reduce, _stages
from clipopt._errors import NonFiniteNormError
from clipopt._kernels import _norms, _scale
from clipopt._validation import MaxNorm, NormType, check_foreach, check_norm_type, check_positive

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "NonFiniteNormError",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "get_total_norm",
]

TensorOrTensors: TypeAlias = Tensor | Iterable[Tensor]
MaybeTensors: TypeAlias = Tensor | Iterable[Tensor | None]


def _as_list(tensors: MaybeTensors) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)  # type: ignore[arg-type]


def _grads(parameters: list[Tensor]) -> list[Tensor]:
    every = [p.grad for p in parameters]  # read once each: a read costs a Python call
    return [g for g in every if g is not None]


def _scales(grads: list[Tensor], max_norm: MaxNorm) -> bool:
    return len(grads) > 0 and (isinstance(max_norm, Tensor) or max_norm != math.inf)


def _raise_if_nonfinite(norm: Tensor, norm_type: float) -> None:
    if not torch.isfinite(norm).item():  # the caller asked for this sync
        raise NonFiniteNormError(
            f"The total norm of order {norm_type} for gradients is non-finite ({norm.item()}), "
            "so it cannot be clipped. To clip anyway, pass error_if_nonfinite=False."
        )


@torch.no_grad()
def get_total_norm(
    tensors: MaybeTensors,
    norm_type: NormType = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: ProcessGroup | None = None,
    replicated: TensorOrTensors | None = None,
    pp_mesh: DeviceMesh | ProcessGroup | None = None,
) -> Tensor:
    """The norm of all ``tensors`` as one vector (of DTensors across their mesh).

    Args:
      tensors: a tensor or tensors, read once, None skipped; any devices, dtypes, sparse.
      norm_type: the order p: any number > 0, ``inf`` or ``'inf'``.
      error_if_nonfinite: raise :class:`NonFiniteNormError` on a NaN or inf norm.
      foreach: multi-tensor kernels (True or None) or per-tensor ops (False).
      process_group: the group plain ``tensors`` are split across; ``replicated``: those
        the same on all its ranks; ``pp_mesh``: the pipeline stages' 1-D mesh or group.

    Returns:
      A 0-dim float32 tensor (float64 if any input is) on the first tensor's device.

    Example:
      >>> import torch, clipopt
      >>> clipopt.get_total_norm([torch.tensor([3.0]), torch.tensor([4.0])])
      tensor(5.)
    """
    check_foreach(foreach)
    p, pp_group = check_norm_type(norm_type), _stages.stage_group(pp_mesh)
    present = [t for t in _as_list(tensors) if t is not None]
    shared = [] if replicated is None else [t for t in _as_list(replicated) if t is not None]
    scope = {"process_group": process_group, "replicated": shared, "pp_group": pp_group}
    norm = _reduce.global_norm(present, p, foreach, **scope)
    if error_if_nonfinite:
        _raise_if_nonfinite(norm, p)
    return norm


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: TensorOrTensors, max_norm: MaxNorm, total_norm: Tensor, foreach: bool | None = None
) -> None:
    """Scale grads in place by ``min(1, max_norm / (total_norm + 1e-6))``, on the device.

    Args:
      parameters: a tensor or tensors whose ``.grad`` is scaled, read once.
      max_norm: the largest allowed norm, > 0 (``inf``: scale nothing), or a 0-dim tensor.
      total_norm: the norm to clip against. foreach: as in :func:`get_total_norm`.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
      >>> clipopt.clip_grads_with_norm_([w], 1.0, torch.tensor(5.0)); w.grad
      tensor([0.6000, 0.8000])
    """
    check_positive("max_norm", max_norm)
    check_foreach(foreach)
    grads = _grads(_as_list(parameters))
    if _scales(grads, max_norm):
        coef = _scale.clip_coefficient(max_norm, total_norm)
        _scale.scale_(_mesh.local_tensors(grads), coef, foreach)


def _clip(
    parameters: TensorOrTensors,
    max_norm: MaxNorm,
    norm_type: NormType,
    error_if_nonfinite: bool,
    foreach: bool | None,
    process_group: ProcessGroup | None,
    replicated_params: TensorOrTensors | None,
    pp_mesh: DeviceMesh | ProcessGroup | None,
    in_place: bool,
) -> tuple[list[Tensor | None], Tensor]:
    check_positive("max_norm", max_norm)
    check_foreach(foreach)
    params = _as_list(parameters)
    if not params and isinstance(parameters, types.GeneratorType):  # as torch warns
        warnings.warn(
            "`parameters` is an empty generator, no gradient clipping will occur.",
            stacklevel=4,  # past this, the entry point and torch.no_grad's wrapper
        )
    p, pp_group, replicated = check_norm_type(norm_type), _stages.stage_group(pp_mesh), []
    if replicated_params is not None:
        shared = _as_list(replicated_params)
        _reduce.check_members("replicated_params", shared, params, "parameters")
        replicated = _grads(shared)
    grads, copies = _grads(params), []
    local = process_group is None and replicated_params is None and pp_group is None
    if in_place and local and _mesh.all_plain(grads or params):
        norm, groups = _norms.grouped_total_norm(grads, p, foreach)  # one grouping for both
    else:
        scope = {"process_group": process_group, "replicated": replicated, "pp_group": pp_group}
        norm, groups = _reduce.global_norm(grads, p, foreach, params=params, **scope), None
    if error_if_nonfinite:
        _raise_if_nonfinite(norm, p)
    if not in_place:
        copies = [None if q.grad is None else q.grad.clone() for q in params]
        grads = [c for c in copies if c is not None]
    if _scales(grads, max_norm):
        coef = _scale.clip_coefficient(max_norm, norm)
        if error_if_nonfinite and not torch.isfinite(coef).item():  # the caller asked
            raise NonFiniteNormError(f"the clip coefficient for max_norm={max_norm!r} is NaN")
        _scale.scale_groups_(groups or _norms.group(_mesh.local_tensors(grads)), coef, foreach)
    return copies, norm


@torch.no_grad()
def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: MaxNorm,
    norm_type: NormType = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: ProcessGroup | None = None,
    replicated_params: TensorOrTensors | None = None,
    pp_mesh: DeviceMesh | ProcessGroup | None = None,
) -> Tensor:
    """Clip the grads' total norm to ``max_norm`` in place, as torch's; raises before any
    grad is written.

    Args:
      parameters: a tensor or tensors (read once); grads that are None are skipped.
      max_norm: the largest allowed total norm, > 0 (``inf``: measure only), or a tensor.
      norm_type: and the rest as in :func:`get_total_norm` (``replicated_params``: its
        ``replicated``).

    Returns:
      The total norm before clipping, as :func:`get_total_norm` returns it.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([30.0, 40.0])
      >>> clipopt.clip_grad_norm_(w, max_norm=1.0), w.grad
      (tensor(50.), tensor([0.6000, 0.8000]))
    """
    args = (parameters, max_norm, norm_type, error_if_nonfinite, foreach, process_group)
    return _clip(*args, replicated_params, pp_mesh, in_place=True)[1]


@torch.no_grad()
def clip_grad_norm(
    parameters: TensorOrTensors,
    max_norm: MaxNorm,
    norm_type: NormType = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: ProcessGroup | None = None,
    replicated_params: TensorOrTensors | None = None,
    pp_mesh: DeviceMesh | ProcessGroup | None = None,
) -> tuple[list[Tensor | None], Tensor]:
    """:func:`clip_grad_norm_` out of place, same arguments: no ``.grad`` changes.

    Returns:
      A clipped copy of each grad (None where none), and the pre-clip norm.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([30.0, 40.0])
      >>> clipped, norm = clipopt.clip_grad_norm([w], max_norm=1.0)
      >>> clipped[0], norm, w.grad
      (tensor([0.6000, 0.8000]), tensor(50.), tensor([30., 40.]))
    """
    args = (parameters, max_norm, norm_type, error_if_nonfinite, foreach, process_group)
    return _clip(*args, replicated_params, pp_mesh, in_place=False)


@torch.no_grad()
def clip_grad_value_(
    parameters: TensorOrTensors, clip_value: float, foreach: bool | None = None
) -> None:
    """Clamp the grads into ``[-clip_value, clip_value]`` in place, as torch's.

    Args:
      parameters: a tensor or tensors (read once). foreach: as in :func:`get_total_norm`.
      clip_value: the largest magnitude, > 0 (``inf``: nothing changes).

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.tensor([-5.0, 0.5, 5.0])
      >>> clipopt.clip_grad_value_(w, 1.0); w.grad
      tensor([-1.0000,  0.5000,  1.0000])
    """
    check_positive("clip_value", clip_value, allow_tensor=False)
    check_foreach(foreach)
    value, params = float(clip_value), _as_list(parameters)
    if any(g.is_complex() for g in _grads(params)):
        raise TypeError("clip_grad_value_ needs real grads; a complex grad has no order")
    for q in params:
        if q.grad is not None and q.grad.is_sparse:
            q.grad = q.grad.coalesce()  # clamping duplicates separately would be wrong
    groups = _norms.group(_grads(params))
    for dense in groups.dense.values() if foreach is not False else ():
        torch._foreach_clamp_min_(dense, -value)
        torch._foreach_clamp_max_(dense, value)
    for g in _grads(params):
        if g.is_sparse or foreach is False:
            (g.values() if g.is_sparse else g).clamp_(-value, value)
