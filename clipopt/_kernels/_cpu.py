"""Norm and scale of dense CPU grads by the C kernels in ``_native.c``.

For the norms clipping uses (1, 2, inf) of float32, float64, bfloat16 and float16
grads, one call reads a whole (device, dtype) group at the speed of ``torch.sum`` (the
1- and 2-norm of float16 grads at about half of it on CPUs without F16C, where the
conversion to float is done with integer operations), on torch's own OpenMP threads
(on Linux; on the calling thread elsewhere), with float32 sums per 1024 elements added
in double (and any block that could have overflowed or underflowed read again in
double): about 1e-8 relative at 40M elements, and no overflow for any finite float32
grad.
``torch.linalg.vector_norm`` accumulates the whole tensor in its own dtype.

The scale of float32, float64 and bfloat16 grads is one call too, rounding as
``mul_`` does, where torch's foreach ``mul_`` on CPU is one ``mul_`` (and one parallel
region) per grad. A coefficient of exactly 1 writes nothing: the kernel reads it from
the coefficient's memory, so no Python code looks at its value.

In eager mode the kernels are called directly; under ``torch.compile`` they are the
custom ops ``clipopt::dense_partial_norm`` and ``clipopt::dense_scale_``, the same
code, so eager and compiled runs give the same bits.

The extension is optional: an install without a working C compiler leaves it out, and
``CLIPOPT_DISABLE_NATIVE=1`` in the environment (read once, at import) leaves it unused.
Either way :func:`available` is False, :func:`supports` and :func:`scales` say no to
every case, and every CPU grad takes the torch-ops path of :mod:`clipopt._kernels._norms`.
"""

from __future__ import annotations

import contextlib
import math
import os
import types
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from clipopt import _torch_internals

_native: types.ModuleType | None
try:
    from clipopt._kernels import _native
except ImportError:  # installed where the C extension could not be built
    _native = None

__all__ = [
    "DISABLE_ENV",
    "Run",
    "any_of_type",
    "available",
    "coefficient",
    "dense_flat_view",
    "disabled",
    "grads_of",
    "norm_partial",
    "norm_value",
    "scale_",
    "scales",
    "split_dense",
    "supports",
    "tensor_norms",
]

DISABLE_ENV = "CLIPOPT_DISABLE_NATIVE"
"""Set to anything but ``""`` or ``"0"`` to leave the C kernels unused."""

_ENABLED = _native is not None and os.environ.get(DISABLE_ENV, "") in ("", "0")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Leave the C kernels unused inside the block, as ``CLIPOPT_DISABLE_NATIVE`` would.

    For benchmarks and tests that compare both CPU paths in one process; it changes a
    module-wide switch, so other threads see it too.
    """
    global _ENABLED
    saved, _ENABLED = _ENABLED, False
    try:
        yield
    finally:
        _ENABLED = saved


def available() -> bool:
    """Whether clipopt's CPU norm and scale run in the C kernels of ``_native.c``.

    Returns:
      False where the extension was not built (no C compiler at install time) or
      ``CLIPOPT_DISABLE_NATIVE`` was set when clipopt was imported; the same results
      then come from torch ops, more slowly.
    """
    return _ENABLED


_SUM_SQUARES, _SUM_ABS, _MAX_ABS = 0, 1, 2
_OPS = {2.0: _SUM_SQUARES, 1.0: _SUM_ABS, math.inf: _MAX_ABS}
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
_SCALED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_SCALE_COEFFICIENTS = (torch.float32, torch.float64)


def grads_of(params: Sequence[Tensor]) -> list[Tensor]:
    """``[p.grad for p in params if p.grad is not None]``, each ``.grad`` read once.

    In one C loop where the kernels are in use (2000 parameters: 175 us in Python, 137
    us so), in Python under ``torch.compile``, which traces it.
    """
    if _ENABLED and _native is not None and not torch.compiler.is_compiling():
        found: list[Tensor] = _native.grads(params)
        return found
    every = [p.grad for p in params]
    return [g for g in every if g is not None]


def any_of_type(objects: Sequence[object], cls: type) -> bool:
    """``any(issubclass(type(o), cls) for o in objects)``, each run of one type checked
    once: in one C loop where the kernels are in use (2000 grads: 40 us by a set of
    their types, 3 us so), in Python under ``torch.compile``."""
    if _ENABLED and _native is not None and not torch.compiler.is_compiling():
        found: bool = _native.any_instance(objects, cls)
        return found
    return any(issubclass(kind, cls) for kind in set(map(type, objects)))


def coefficient(max_norm: float, norm: Tensor, eps: float) -> Tensor | None:
    """``min(1, max_norm / (norm + eps))`` with the bits of the torch ops of
    :func:`clipopt._kernels._scale.clip_coefficient`, by one C call, for a 0-dim float32 or
    float64 CPU ``norm`` in eager mode; None where that does not apply.

    The eight small torch ops cost 40 us after a clip's pass over thousands of grads.
    """
    if not (_ENABLED and norm.device.type == "cpu" and norm.dim() == 0):
        return None
    if norm.dtype not in _SCALE_COEFFICIENTS or torch.compiler.is_compiling():
        return None
    out = torch.empty((), dtype=norm.dtype)
    code = _DTYPES[norm.dtype]
    _kernels().coefficient(norm.data_ptr(), code, max_norm, eps, out.data_ptr())
    return out


def supports(p: float, dtype: torch.dtype) -> bool:
    """Whether the C reduction computes the ``p``-norm of ``dtype`` grads."""
    return _ENABLED and p in _OPS and dtype in _DTYPES


def scales(dtype: torch.dtype) -> bool:
    """Whether the C kernel scales ``dtype`` grads (float16 rounding is left to torch)."""
    return _ENABLED and dtype in _SCALED_DTYPES


def dense_flat_view(t: Tensor) -> Tensor | None:
    """``t``'s elements as a contiguous 1-D view in memory order; None if it has gaps.

    A norm ignores order, so a channels-last or transposed tensor is as good as a
    contiguous one once its dims are permuted by decreasing stride.
    """
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
    permuted = t.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


def split_dense(tensors: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """``tensors`` split into those whose elements fill ``numel()`` slots from
    ``data_ptr()`` on (which the C kernels read) and those with gaps in memory."""
    if all(map(Tensor.is_contiguous, tensors)):  # the usual case, at C speed per tensor
        return list(tensors), []
    dense: list[Tensor] = []
    gappy: list[Tensor] = []
    for t in tensors:
        if t.is_contiguous() or dense_flat_view(t) is not None:
            dense.append(t)
        else:
            gappy.append(t)
    return dense, gappy


def _raw_data_ptr() -> int:
    """The address of torch's C function that reads a tensor's data pointer (the one
    inductor's generated CPU code calls); 0 where this torch has none.

    The C layout calls it for the tensors of a plain :class:`Run`, where
    ``Tensor.data_ptr`` (a method call and a Python int per tensor) cost as much as
    reading 500 floats (2000 grads: 130 us, against 22 us).
    """
    address = _torch_internals.tensor_data_ptr_reader()
    if _native is None or address == 0:
        return 0
    # It is private: check once that it reads what data_ptr does, or leave it unused.
    probe = [torch.arange(1.0, 9.0)]
    code = _DTYPES[torch.float32]
    raw = _native.layout(code, probe, [8], Tensor.data_ptr, Tensor, address)
    by_method = _native.reduce(_SUM_SQUARES, code, [probe[0].data_ptr()], [8], 1)
    return address if _native.reduce_layout(_SUM_SQUARES, raw, 1) == by_method else 0


_RAW_DATA_PTR = _raw_data_ptr()


def _kernels() -> types.ModuleType:
    if _native is None:
        raise RuntimeError(
            "clipopt was installed without its C extension (clipopt._kernels._native)"
        )
    return _native


class Run:
    """Dense CPU tensors of one dtype that one C call reads, and their element counts.

    Their addresses are read, and the buffers cut into the kernels' chunks, on first use
    (one C pass, :attr:`layout`) and kept: a clip's norm and its scale read the same
    grads, with nothing run in between that could move them; the run holds the tensors,
    so the memory stays theirs.

    Args:
      tensors: dense by :func:`split_dense`.
      numels: their element counts, if known (a plan's); read here otherwise.
      plain: the caller knows every tensor to be a strided ``torch.Tensor`` (no subclass)
        with storage (a plan checked it): their addresses may then be read by torch's own
        C function, which aborts the process on a tensor without storage.
    """

    __slots__ = ("_layout", "numels", "plain", "tensors")

    def __init__(
        self, tensors: list[Tensor], numels: list[int] | None = None, plain: bool = False
    ) -> None:
        self.tensors = tensors
        self.numels = list(map(Tensor.numel, tensors)) if numels is None else numels
        self.plain = plain
        self._layout: object = None

    @property
    def layout(self) -> object:
        """The C kernels' view of the tensors: their chunks, by address."""
        if self._layout is None:
            code = _DTYPES[self.tensors[0].dtype]
            raw = _RAW_DATA_PTR if self.plain else 0
            self._layout = _kernels().layout(
                code, self.tensors, self.numels, Tensor.data_ptr, Tensor, raw
            )
        return self._layout


def _run(dense: list[Tensor] | Run) -> Run:
    return dense if isinstance(dense, Run) else Run(dense)


def norm_value(run: Run, p: float, threads: int = 0) -> float:
    """The ``p``-norm of a run's tensors (1, 2 or ``math.inf``), read by ``threads`` of
    torch's threads (0: all of them; read here, which a compiled graph cannot do).

    Eager only: the value comes back to Python, as a float. NaN if any element is NaN.
    """
    value: float = _kernels().reduce_layout(_OPS[p], run.layout, threads or torch.get_num_threads())
    return math.sqrt(value) if p == 2.0 else value


def _reduce(run: Run, p: float, threads: int) -> Tensor:
    """:func:`norm_value` as a float64 1-vector."""
    return torch.tensor([norm_value(run, p, threads)], dtype=torch.float64)


# The schemas are written out: torch 2.6 cannot infer one from ``list[Tensor]``.
@torch.library.custom_op(
    "clipopt::dense_partial_norm",
    mutates_args=(),
    schema="(Tensor[] dense, float p, int threads) -> Tensor",
)
def _reduce_op(dense: list[Tensor], p: float, threads: int) -> Tensor:
    return _reduce(Run(dense), p, threads)


@_reduce_op.register_fake
def _(dense: list[Tensor], p: float, threads: int) -> Tensor:
    return dense[0].new_empty((1,), dtype=torch.float64)


def norm_partial(dense: list[Tensor] | Run, p: float, threads: int | None = None) -> Tensor:
    """The ``p``-norm of ``dense`` as a float64 tensor of one element.

    Args:
      dense: CPU tensors of one dtype that :func:`supports`, dense by :func:`split_dense`,
        or a :class:`Run` of them.
      p: 1, 2 or ``math.inf``.
      threads: how many of torch's threads to read with; None: all of them.

    Returns:
      ``tensor([norm], dtype=float64)``; NaN if any element is NaN.
    """
    count = 0 if threads is None else threads
    if torch.compiler.is_compiling():
        tensors = dense.tensors if isinstance(dense, Run) else dense
        partial: Tensor = _reduce_op(tensors, p, count)
        return partial
    return _reduce(_run(dense), p, count)


def tensor_norms(run: Run, p: float) -> Tensor:
    """The ``p``-norm of each tensor of a run, as a float64 1-D tensor (eager only).

    One pass over all of them on torch's threads; each value has the bits that
    :func:`norm_value` of a run of that tensor alone gives (chunks are combined per
    tensor, in order, whatever thread read them). Empty tensors have norm 0.
    """
    out = torch.empty(len(run.tensors), dtype=torch.float64)
    _kernels().norms_layout(_OPS[p], run.layout, out.data_ptr(), torch.get_num_threads())
    return out


def _scale(run: Run, coef: Tensor) -> None:
    _kernels().scale_layout(
        run.layout,
        coef.data_ptr(),
        _DTYPES[coef.dtype],
        torch.get_num_threads(),
    )


@torch.library.custom_op(
    "clipopt::dense_scale_",
    mutates_args=("dense",),
    schema="(Tensor(a!)[] dense, Tensor coef) -> ()",
)
def _scale_op(dense: list[Tensor], coef: Tensor) -> None:
    _scale(Run(dense), coef)


def scale_(dense: list[Tensor] | Run, coef: Tensor) -> None:
    """Multiply every tensor of ``dense`` in place by ``coef``, as ``mul_`` would.

    Args:
      dense: CPU tensors of one dtype that :func:`scales`, dense by :func:`split_dense`,
        or a :class:`Run` of them.
      coef: a 0-dim float32 or float64 CPU tensor.
    """
    run = _run(dense)
    if torch.compiler.is_compiling():
        _scale_op(run.tensors, coef)
        return
    _scale(run, coef)
    # Written through raw pointers: tell autograd, as mul_ would have.
    torch.autograd.graph.increment_version(run.tensors)
