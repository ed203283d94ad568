"""The C kernels (``clipopt/_kernels/_native.c``): the norm against float64 references, the
scale bit for bit against torch's ``mul_``.

It cuts buffers into chunks of ``CHUNK`` elements (the unit handed to a thread) and
sums float32 blocks of ``BLOCK`` elements in ``LANES`` lanes, so the sizes below sit on
both sides of each. Error bounds are derived, not fitted: a lane adds at most
``BLOCK / LANES = 32`` terms and the lanes fold in 5 pairwise levels, so a float32
block sum of non-negative terms is off by at most ``(31 + 5) u`` relative
(``u = 2**-24``); the double additions after it cost ~1e-16 each. The 2-norm, a square
root, halves that.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import clipopt
from clipopt._kernels import _cpu

if not _cpu.available():
    pytest.skip(
        "the C kernel is not in use: clipopt._kernels._native was not built, or "
        f"{_cpu.DISABLE_ENV} is set (tests/test_fallback.py covers that path)",
        allow_module_level=True,
    )

from clipopt._kernels import _native

CHUNK = 1 << 16
BLOCK = 1024
PER_THREAD = 1 << 18
U = 2.0**-24
RTOL = {1.0: 37 * U, 2.0: 19 * U, math.inf: 0.0}
RTOL_DOUBLE = 1e-13
OPS = {2.0: 0, 1.0: 1, math.inf: 2}
CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
NORMS = [1.0, 2.0, math.inf]
SIZES = [1, 31, 32, 33, BLOCK - 1, BLOCK, BLOCK + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7]


def reference(tensors: Sequence[Tensor], p: float) -> float:
    """The p-norm of every element, computed in float64."""
    values = torch.cat([t.double().abs().reshape(-1) for t in tensors])
    if p == math.inf:
        return values.max().item()
    return values.pow(p).sum().pow(1.0 / p).item()


def native(tensors: Sequence[Tensor], p: float, threads: int | None = None) -> float:
    """The C reduction's p-norm of ``tensors`` (all dense, one dtype)."""
    value = _native.reduce(
        OPS[p],
        CODES[tensors[0].dtype],
        [t.data_ptr() for t in tensors],
        [t.numel() for t in tensors],
        torch.get_num_threads() if threads is None else threads,
    )
    return math.sqrt(value) if p == 2.0 else value


def assert_matches(got: float, tensors: Sequence[Tensor], p: float) -> None:
    rtol = RTOL_DOUBLE if tensors[0].dtype == torch.float64 and p != math.inf else RTOL[p]
    expected = reference(tensors, p)
    assert got == pytest.approx(expected, rel=rtol, abs=0.0), (got, expected)


def gaussian(n: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=generator, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("n", SIZES)
def test_each_size_dtype_and_norm(n: int, p: float, dtype: torch.dtype) -> None:
    t = gaussian(n, dtype, seed=n)
    assert_matches(native([t], p), [t], p)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from(SIZES) | st.integers(0, 5000), min_size=1, max_size=6),
    dtype=st.sampled_from(list(CODES)),
    p=st.sampled_from(NORMS),
    exponent=st.integers(-30, 30),
    seed=st.integers(0, 2**16),
)
def test_many_buffers_at_any_scale(
    sizes: list[int], dtype: torch.dtype, p: float, exponent: int, seed: int
) -> None:
    """Scales whose float32 squares overflow (1e30) or underflow (1e-30) stay exact."""
    if dtype in (torch.float16, torch.bfloat16):
        exponent = max(min(exponent, 2), -2) if dtype == torch.float16 else exponent
    tensors = [gaussian(n, dtype, seed + i, scale=10.0**exponent) for i, n in enumerate(sizes)]
    if sum(t.numel() for t in tensors) == 0:
        assert native(tensors, p) == 0.0
        return
    assert_matches(native(tensors, p), tensors, p)


def test_float32_squares_past_overflow_and_underflow_in_one_block() -> None:
    """One block mixing 1e30 (square overflows float32) with 1e-30 (square underflows)."""
    t = torch.tensor([1e30, -1e-30, 3e29, 1e-30] * 300, dtype=torch.float32)
    assert math.isfinite(native([t], 2.0))
    assert_matches(native([t], 2.0), [t], 2.0)
    tiny = torch.full((5000,), 1e-30, dtype=torch.float32)
    assert_matches(native([tiny], 2.0), [tiny], 2.0)
    assert torch.linalg.vector_norm(tiny).item() == 0.0  # what the C reduction avoids


def test_zeros() -> None:
    zeros = torch.zeros(3 * BLOCK + 5)
    for p in NORMS:
        assert native([zeros], p) == 0.0


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(list(CODES)),
    p=st.sampled_from(NORMS),
    special=st.sampled_from([math.nan, math.inf, -math.inf]),
    index=st.integers(0, 3 * CHUNK - 1),
    with_nan_elsewhere=st.booleans(),
)
def test_nan_and_inf_propagate(
    dtype: torch.dtype, p: float, special: float, index: int, with_nan_elsewhere: bool
) -> None:
    t = gaussian(3 * CHUNK, dtype, seed=index)
    t[index] = special
    if with_nan_elsewhere:
        t[(index + CHUNK + 17) % t.numel()] = math.nan
    got = native([t], p)
    if math.isnan(special) or with_nan_elsewhere:
        assert math.isnan(got)
    else:
        assert got == math.inf


@pytest.fixture(params=[False, True], ids=["integer", "f16c"])
def float16_path(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Each float16 conversion the C reduction has: integer operations, and the F16C
    instruction (skipped where the CPU lacks it). The default is restored after."""
    default = _native.float16_by_f16c(True)
    if _native.float16_by_f16c(request.param) != request.param:
        pytest.skip("this CPU has no F16C")
    try:
        yield request.param
    finally:
        _native.float16_by_f16c(default)


EVERY_FLOAT16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_every_float16_value(float16_path: bool, flush_denormal: bool) -> None:
    """All 65536 halves, with and without flush-to-zero and denormals-are-zero on the
    calling thread: float16 subnormals are normal floats, and must stay exact."""
    finite = EVERY_FLOAT16[torch.isfinite(EVERY_FLOAT16)]
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for p in (1.0, 2.0):
            assert_matches(native([finite], p, threads=1), [finite], p)
    finally:
        torch.set_flush_denormal(False)
    every = EVERY_FLOAT16
    address = every.data_ptr()
    for i, value in enumerate(every.double().abs().tolist()):
        got = _native.reduce(2, 3, [address + 2 * i], [1], 1)
        assert got == value or (math.isnan(got) and math.isnan(value)), (i, got, value)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.sampled_from(SIZES) | st.integers(0, 5000), min_size=1, max_size=4),
    p=st.sampled_from([1.0, 2.0]),
    exponent=st.integers(-8, 4),
    special=st.sampled_from([None, math.inf, math.nan]),
    seed=st.integers(0, 2**16),
)
def test_float16_paths_give_the_same_bits(
    sizes: list[int], p: float, exponent: int, special: float | None, seed: int
) -> None:
    """The F16C conversion and the integer one add the same values in the same order."""
    if not _native.float16_by_f16c(True):
        pytest.skip("this CPU has no F16C")
    tensors = [
        gaussian(n, torch.float16, seed + i, scale=2.0**exponent) for i, n in enumerate(sizes)
    ]
    if special is not None and tensors[0].numel():
        tensors[0][seed % tensors[0].numel()] = special
    try:
        by_f16c = native(tensors, p)
        _native.float16_by_f16c(False)
        by_integers = native(tensors, p)
    finally:
        _native.float16_by_f16c(True)
    assert by_f16c == by_integers or (math.isnan(by_f16c) and math.isnan(by_integers))


@pytest.mark.parametrize("offset", [0, 1])
def test_every_bfloat16_value(offset: int) -> None:
    """bfloat16 is read as 32-bit words of two elements: every value, in either half."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every[torch.isfinite(every)]
    shifted = torch.cat([torch.zeros(offset, dtype=torch.bfloat16), finite])[offset:]
    for p in NORMS:
        assert_matches(native([shifted], p), [finite], p)


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("n", [1, 2, 33, 3 * 32 + 5, BLOCK + 1, CHUNK + 3])
def test_a_buffer_may_start_at_any_element(dtype: torch.dtype, n: int) -> None:
    """Views start anywhere: a 16-bit buffer read in 32-bit words may be 2-byte aligned."""
    base = gaussian(n + 3, dtype, seed=n)
    for start in range(4):
        view = base[start : start + n]
        for p in NORMS:
            assert_matches(native([view], p), [view], p)


@pytest.mark.parametrize("dtype", list(CODES))
def test_result_does_not_depend_on_threads(dtype: torch.dtype) -> None:
    """Chunks are combined in a fixed order: every thread count gives the same bits."""
    tensors = [gaussian(n, dtype, seed=n) for n in (5 * PER_THREAD + 3, 1000, CHUNK * 7)]
    for p in NORMS:
        one = native(tensors, p, threads=1)
        assert all(native(tensors, p, threads=t) == one for t in (2, 3, 4, 7))


def test_bad_arguments_raise() -> None:
    t = torch.ones(4)
    with pytest.raises(ValueError, match="op must be"):
        _native.reduce(7, 0, [t.data_ptr()], [4], 1)
    with pytest.raises(ValueError, match="dtype must be"):
        _native.reduce(0, 9, [t.data_ptr()], [4], 1)
    with pytest.raises(ValueError, match="differ in length"):
        _native.reduce(0, 0, [t.data_ptr()], [4, 4], 1)
    with pytest.raises(ValueError, match="numels must be >= 0"):
        _native.reduce(0, 0, [t.data_ptr()], [-1], 1)
    with pytest.raises(TypeError, match="addresses must hold ints"):
        _native.reduce(0, 0, ["x"], [4], 1)


# ---------------------------------------------------------------- scale

SCALED = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}
SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -3e-39, 3e38, 1e-45]


def native_scale(tensors: Sequence[Tensor], coef: Tensor, threads: int = 2) -> None:
    _native.scale(
        SCALED[tensors[0].dtype],
        [t.data_ptr() for t in tensors],
        [t.numel() for t in tensors],
        coef.data_ptr(),
        CODES[coef.dtype],
        threads,
    )


def assert_same_bits(got: Tensor, expected: Tensor) -> None:
    """Equal values, NaN where NaN (torch's vector and scalar paths differ in NaN bits)."""
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(SCALED)),
    coef_dtype=st.sampled_from([torch.float32, torch.float64]),
    coef=st.floats(0.0, 1.0, allow_subnormal=True) | st.sampled_from([math.nan, 0.5, 1e-30]),
    sizes=st.lists(st.sampled_from(SIZES) | st.integers(0, 3000), min_size=1, max_size=5),
    special_at=st.lists(st.integers(0, 10**6), max_size=6),
    seed=st.integers(0, 2**16),
    threads=st.integers(1, 4),
)
def test_scale_rounds_like_mul(
    dtype: torch.dtype,
    coef_dtype: torch.dtype,
    coef: float,
    sizes: list[int],
    special_at: list[int],
    seed: int,
    threads: int,
) -> None:
    """Bit for bit what ``mul_`` by the same 0-dim tensor gives, specials and subnormals
    included, whatever the thread count."""
    tensors = [gaussian(n, dtype, seed + i, scale=10.0 ** (i - 2)) for i, n in enumerate(sizes)]
    for k, where in enumerate(special_at):
        t = tensors[where % len(tensors)]
        if t.numel():
            t[where % t.numel()] = SPECIALS[k % len(SPECIALS)]
    coefficient = torch.tensor(coef, dtype=coef_dtype)
    expected = [t.clone().mul_(coefficient) for t in tensors]
    native_scale(tensors, coefficient, threads)
    for got, want in zip(tensors, expected, strict=True):
        assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", list(SCALED))
def test_scale_on_many_threads_matches_mul(dtype: torch.dtype) -> None:
    sizes = (5 * PER_THREAD + 3, 1000, CHUNK * 7)
    coef = torch.tensor(0.3)
    for threads in (1, 2, 3, 7):
        tensors = [gaussian(n, dtype, seed=n) for n in sizes]
        expected = [t.clone().mul_(coef) for t in tensors]
        native_scale(tensors, coef, threads)
        for got, want in zip(tensors, expected, strict=True):
            assert_same_bits(got, want)


def test_scale_by_exactly_one_writes_nothing() -> None:
    """Multiplying a signalling NaN by 1 quiets it; skipping the write keeps its bits."""
    signalling = torch.tensor([0x7F800001, 0x3F800000], dtype=torch.int32).view(torch.float32)
    before = signalling.view(torch.int32).clone()
    native_scale([signalling], torch.tensor(1.0))
    assert torch.equal(signalling.view(torch.int32), before)
    native_scale([signalling], torch.tensor(0.5))
    assert signalling.view(torch.int32)[0].item() != before[0].item()  # the write happened
    assert math.isnan(signalling[0].item()) and signalling[1].item() == 0.5


def test_scale_of_memory_listed_twice_matches_a_loop_of_mul() -> None:
    """A grad listed twice, and overlapping views, are scaled once per listing."""
    base = gaussian(6 * PER_THREAD, torch.float32, seed=1)
    coef = torch.tensor(0.75)
    for views in (
        lambda b: [b, b[:1000], b],
        lambda b: [b[: 4 * PER_THREAD], b[2 * PER_THREAD :]],
    ):
        expected = base.clone()
        for view in views(expected):
            view.mul_(coef)
        got = base.clone()
        native_scale(views(got), coef, threads=4)
        assert_same_bits(got, expected)


def test_scale_bad_arguments_raise() -> None:
    t, coef = torch.ones(4), torch.tensor(0.5)
    with pytest.raises(ValueError, match="dtype must be 0 to 2, got 3"):
        _native.scale(3, [t.data_ptr()], [4], coef.data_ptr(), 0, 1)
    with pytest.raises(ValueError, match="coefficient_dtype must be 0 or 1, got 2"):
        _native.scale(0, [t.data_ptr()], [4], coef.data_ptr(), 2, 1)
    with pytest.raises(ValueError, match="differ in length"):
        _native.scale(0, [t.data_ptr()], [], coef.data_ptr(), 0, 1)
    assert torch.equal(t, torch.ones(4))


# ---------------------------------------------------------------- layouts


def _layout(tensors: Sequence[Tensor]) -> object:
    return _native.layout(
        CODES[tensors[0].dtype], list(tensors), [t.numel() for t in tensors], Tensor.data_ptr
    )


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(list(CODES)),
    sizes=st.lists(st.sampled_from(SIZES[:8]), min_size=1, max_size=40),
    p=st.sampled_from(NORMS),
)
def test_a_layout_reduces_as_the_address_lists_do(
    dtype: torch.dtype, sizes: list[int], p: float
) -> None:
    """The same chunks, so the same bits: the addresses read in C are data_ptr()'s."""
    generator = torch.Generator().manual_seed(len(sizes))
    tensors = [torch.randn(n, generator=generator).to(dtype) for n in sizes]
    got = _native.reduce_layout(OPS[p], _layout(tensors), 2)
    expected = _native.reduce(
        OPS[p], CODES[dtype], [t.data_ptr() for t in tensors], [t.numel() for t in tensors], 2
    )
    assert got == expected or (math.isnan(got) and math.isnan(expected))


@pytest.mark.skipif(not _cpu._RAW_DATA_PTR, reason="this torch has no C data-pointer reader")
@pytest.mark.parametrize("p", NORMS)
def test_torchs_c_address_reader_gives_the_data_ptr_method_s_chunks(p: float) -> None:
    """Given torch's C reader, a layout calls it for tensors of exactly the type named and
    the data_ptr method for the others (a subclass, a Parameter): the same bits."""

    class Marked(Tensor):
        pass

    generator = torch.Generator().manual_seed(9)
    tensors: list[Tensor] = [torch.randn(n, generator=generator) for n in (3, 500, 70000)]
    tensors += [torch.randn(9).as_subclass(Marked), torch.nn.Parameter(torch.randn(4))]
    numels = [t.numel() for t in tensors]
    raw = _native.layout(0, tensors, numels, Tensor.data_ptr, Tensor, _cpu._RAW_DATA_PTR)
    by_method = _native.reduce(OPS[p], 0, [t.data_ptr() for t in tensors], numels, 2)
    assert _native.reduce_layout(OPS[p], raw, 2) == by_method


@pytest.mark.parametrize("dtype", list(SCALED))
def test_a_layout_scales_as_mul_does_twice_over_for_memory_listed_twice(dtype: torch.dtype) -> None:
    """A layout is scaled more than once (its overlap verdict is kept): each time as a loop
    of mul_ would, with a tensor listed twice scaled twice, in a shuffled address order."""
    base = torch.randn(6000).to(dtype)
    views = [base[i * 500 : (i + 1) * 500] for i in (7, 2, 9, 0, 4)]
    listed = [*views, views[1]]
    layout = _layout(listed)
    expected = base.clone()
    for coef in (torch.tensor(0.7), torch.tensor(1.3, dtype=torch.float64)):
        _native.scale_layout(layout, coef.data_ptr(), CODES[coef.dtype], 2)
        for i in (7, 2, 9, 0, 4, 2):
            expected[i * 500 : (i + 1) * 500].mul_(coef)
        assert_same_bits(base, expected)


def test_layout_bad_arguments_raise() -> None:
    t = torch.ones(4)
    with pytest.raises(ValueError, match="dtype must be 0 to 3, got 7"):
        _native.layout(7, [t], [4], Tensor.data_ptr)
    with pytest.raises(ValueError, match="differ in length"):
        _native.layout(0, [t], [], Tensor.data_ptr)
    with pytest.raises(ValueError, match="numels must be >= 0, got -1"):
        _native.layout(0, [t], [-1], Tensor.data_ptr)
    with pytest.raises(RuntimeError, match=r"data pointer|storage"):
        _native.layout(0, [torch.ones(4).to_sparse()], [4], Tensor.data_ptr)
    with pytest.raises(ValueError, match="op must be 0, 1 or 2, got 5"):
        _native.reduce_layout(5, _layout([t]), 1)
    with pytest.raises(ValueError, match="PyCapsule"):
        _native.reduce_layout(0, object(), 1)
    with pytest.raises(ValueError, match="dtype must be 0 to 2, got 3"):
        _native.scale_layout(_layout([t.half()]), torch.tensor(0.5).data_ptr(), 0, 1)


# ---------------------------------------------------------------- use by clipopt


def _count_buffers(monkeypatch: pytest.MonkeyPatch, name: str, at: int) -> list[int]:
    """Records the buffer count of every call into the C function ``name``: the length
    of its argument ``at``, or of the tensors of the layout it is given there."""
    calls: list[int] = []
    real = getattr(_native, name)
    real_layout = _native.layout
    buffers: dict[int, tuple[object, int]] = {}

    def layout(*args: Any) -> Any:
        made = real_layout(*args)
        buffers[id(made)] = (made, len(args[1]))
        return made

    def counted(*args: Any) -> Any:
        given = args[at]
        calls.append(buffers[id(given)][1] if id(given) in buffers else len(given))
        return real(*args)

    monkeypatch.setattr(_cpu._native, "layout", layout)
    monkeypatch.setattr(_cpu._native, name, counted)
    return calls


@pytest.fixture
def reduce_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the buffer count of every call into the C reduction."""
    return _count_buffers(monkeypatch, "reduce_layout", at=1)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_norm_reads_each_group_in_one_call(
    reduce_calls: list[int], foreach: bool | None
) -> None:
    """Dense grads of each dtype in one call, channels-last and empty ones included,
    whatever ``foreach`` says; a grad with gaps in memory and a norm order the C code
    lacks take torch's path."""
    conv = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last)
    gappy = torch.randn(64, 300)[:, :200]
    grads = [torch.randn(3000), conv, gappy, torch.zeros(0), torch.randn(700).bfloat16()]
    for p in NORMS:
        reduce_calls.clear()
        got = clipopt.get_total_norm(grads, p, foreach=foreach).item()
        assert reduce_calls == [3, 1]  # float32: the vector, the conv, the empty; bfloat16
        assert got == pytest.approx(reference(grads, p), rel=1e-6)
    reduce_calls.clear()
    clipopt.get_total_norm(grads, 3.0, foreach=foreach)
    assert reduce_calls == []


@pytest.fixture
def scale_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the buffer count of every call into the C scale."""
    return _count_buffers(monkeypatch, "scale_layout", at=0)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_norm_scales_each_group_in_one_call(
    scale_calls: list[int], foreach: bool | None
) -> None:
    """Dense float32 and bfloat16 grads in one call each; a grad with gaps and float16
    grads are scaled by torch; every grad ends up as torch's clip leaves it."""

    def layouts() -> list[Tensor]:
        generator = torch.Generator().manual_seed(0)
        conv = torch.randn(8, 3, 5, 5, generator=generator)
        return [
            torch.randn(3000, generator=generator),
            conv.to(memory_format=torch.channels_last),
            torch.randn(64, 300, generator=generator)[:, :200],
            torch.randn(700, generator=generator).bfloat16(),
            torch.randn(50, generator=generator).half(),
        ]

    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in layouts()]
    reference_params = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    for p, q, g, h in zip(params, reference_params, layouts(), layouts(), strict=True):
        p.grad, q.grad = g, h
    versions = [p.grad._version for p in params]
    norm = clipopt.clip_grad_norm_(params, 1.0, foreach=foreach)
    torch.nn.utils.clip_grads_with_norm_(reference_params, 1.0, norm, foreach=foreach)
    assert scale_calls == [2, 1]
    for p, q, before in zip(params, reference_params, versions, strict=True):
        assert_same_bits(p.grad, q.grad)
        assert p.grad._version > before  # autograd sees the in-place write


def test_an_inference_grad_is_refused_before_any_grad_is_scaled() -> None:
    """As torch's ``mul_`` refuses it; the C scale would write it without complaint."""
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(3)]
    params[0].grad = torch.full((1000,), 5.0)
    with torch.inference_mode():
        params[1].grad = torch.full((1000,), 5.0)
    params[2].grad = torch.full((1000,), 5.0)
    torch_param = torch.nn.Parameter(torch.zeros(1000))
    with torch.inference_mode():
        torch_param.grad = torch.full((1000,), 5.0)
    with pytest.raises(RuntimeError, match="inference tensor"):
        torch.nn.utils.clip_grad_norm_([torch_param], 1.0)  # (after scaling it, in 2.13)
    with pytest.raises(RuntimeError, match=r"shape \(1000,\) in place: it is an inference tensor"):
        clipopt.clip_grad_norm_(params, 1.0)
    assert all(torch.equal(p.grad, torch.full((1000,), 5.0)) for p in params if p.grad is not None)
    with torch.inference_mode():  # where torch allows it, so does clipopt
        clipopt.clip_grad_norm_(params[1:2], 1.0)
        assert params[1].grad is not None
        assert params[1].grad.norm().item() == pytest.approx(1.0)


def test_custom_ops_pass_torch_opcheck() -> None:
    """The ops that ``torch.compile`` traces: schema, fake kernel and eager kernel agree."""
    tensors = [torch.randn(5000), torch.randn(3, 7)]
    for p in NORMS:
        torch.library.opcheck(_cpu._reduce_op, (tensors, p, 0))
    torch.library.opcheck(_cpu._scale_op, ([t.clone() for t in tensors], torch.tensor(0.5)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_shares_torchs_openmp_runtime() -> None:
    """A second OpenMP pool would fight torch's spinning workers for the cores."""
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line}
    assert len(runtimes) == 1, runtimes


def test_grads_are_read_once_each_and_none_left_out() -> None:
    """The C loop gives what the Python one does: present grads in order, the same
    objects, each ``.grad`` read once, and the getter's errors."""

    class Holder:
        reads = 0

        def __init__(self, grad: Tensor | None) -> None:
            self._grad = grad

        @property
        def grad(self) -> Tensor | None:
            Holder.reads += 1
            return self._grad

    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(5)]
    for i in (0, 2, 3):
        params[i].grad = torch.randn(3)
    listed: list[Any] = [*params, Holder(torch.ones(2)), Holder(None)]
    expected = [params[0].grad, params[2].grad, params[3].grad, listed[5].grad]
    Holder.reads = 0
    got = _cpu.grads_of(listed)
    assert Holder.reads == 2
    assert len(got) == 4 and all(a is b for a, b in zip(got, expected, strict=True))
    with _cpu.disabled():
        assert all(a is b for a, b in zip(_cpu.grads_of(listed), expected, strict=True))
    assert _cpu.grads_of([]) == []
    with pytest.raises(AttributeError, match="grad"):
        _cpu.grads_of([object()])  # type: ignore[list-item]


def test_any_of_type_checks_each_run_of_one_type() -> None:
    """As ``any(issubclass(type(o), cls) ...)``: a subclass anywhere in a long run of
    other types is found, with and without the C loop."""

    class Marked(Tensor):
        pass

    plain = [torch.zeros(1) for _ in range(5)]
    cases = [
        ([], False),
        (plain, False),
        ([*plain, torch.zeros(1).as_subclass(Marked)], True),
        ([torch.zeros(1).as_subclass(Marked), *plain], True),
        ([*plain, torch.nn.Parameter(torch.zeros(1)), *plain], False),
    ]
    for objects, expected in cases:
        assert _cpu.any_of_type(objects, Marked) is expected
        with _cpu.disabled():
            assert _cpu.any_of_type(objects, Marked) is expected
    assert _cpu.any_of_type([torch.nn.Parameter(torch.zeros(1))], Tensor)
