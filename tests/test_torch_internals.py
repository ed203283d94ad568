"""The fence around torch's private APIs: only ``clipopt/_torch_internals.py`` names one,
and each internal gives what its public path gives.

``make test`` also runs the suite with ``CLIPOPT_DISABLE_TORCH_INTERNALS=1``, so every
public path runs on each torch the matrix covers; these tests compare both paths in one
process.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import clipopt
from clipopt import _torch_internals

PACKAGE = Path(clipopt.__file__).parent
FENCE = "_torch_internals.py"


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(
        part.startswith("_") and not part.startswith("__") for part in parts[1:]
    )


def private_torch_names(tree: ast.Module) -> list[str]:
    """Each place ``tree`` names a private torch API: an import from or of a torch module
    with a ``_``-prefixed part, an imported ``_`` name from torch, or a ``torch._...``
    attribute chain (reported once, at its longest)."""
    found: list[str] = []
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = ", ".join(a.name for a in node.names)
            module_private = _private(node.module)
            from_torch = node.module.split(".")[0] == "torch"
            if module_private or (
                from_torch and any(_private(f"torch.{a.name}") for a in node.names)
            ):
                found.append(f"from {node.module} import {names}")
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            value = node.value
            while isinstance(value, ast.Attribute):
                inner.add(id(value))
                value = value.value
            dotted = _dotted(node)
            if dotted is not None and _private(dotted):
                found.append(dotted)
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != FENCE)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_no_private_torch_name_outside_the_fence(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    assert private_torch_names(tree) == []


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@given(st.lists(st.sampled_from(DTYPES), max_size=12))
def test_grouping_matches_the_public_path(dtypes: list[torch.dtype]) -> None:
    tensors = [torch.ones(i + 1, dtype=d) for i, d in enumerate(dtypes)]
    found = _torch_internals.group_by_device_and_dtype(tensors)
    expected = _torch_internals._group_in_python(tensors)
    assert list(found) == list(expected)
    for key, (members, indices) in expected.items():
        assert found[key][1] == indices
        assert all(a is b for a, b in zip(found[key][0], members, strict=True))


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_foreach_norm_matches_vector_norm_bit_for_bit_on_cpu(p: float, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=generator).to(dtype) for n in (1, 37, 5000)]
    found = _torch_internals.foreach_norm(tensors, p, dtype=torch.float64)
    expected = [torch.linalg.vector_norm(t, p, dtype=torch.float64) for t in tensors]
    for a, b in zip(found, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def test_foreach_mul_and_clamp_match_the_per_tensor_ops() -> None:
    generator = torch.Generator().manual_seed(2)
    tensors = [torch.randn(n, generator=generator) for n in (3, 300)]
    scaled, clamped = [t.clone() for t in tensors], [t.clone() for t in tensors]
    coef = torch.tensor(0.3)
    _torch_internals.foreach_mul_(scaled, coef)
    _torch_internals.foreach_clamp_(clamped, 0.5)
    for t, s, c in zip(tensors, scaled, clamped, strict=True):
        assert torch.equal(s, t * coef)
        assert torch.equal(c, t.clamp(-0.5, 0.5))


def test_has_storage_says_yes_for_a_plain_tensor_where_it_can_say() -> None:
    expected = _torch_internals.available()["_has_storage"]
    assert _torch_internals.has_storage(torch.zeros(3)) is expected


def test_a_guard_tells_metadata_apart() -> None:
    guard = _torch_internals.tensor_guard([torch.zeros(2, 3)])
    if guard is None:
        assert not _torch_internals.available()["TensorGuards"]
        return
    assert guard.check(torch.ones(2, 3))
    assert not guard.check(torch.ones(2, 3, dtype=torch.float64))
    assert not guard.check(torch.ones(2, 3).t())


LAYOUTS = [
    ((16, 4), (2,), "shard0"),
    ((10, 3), (2, 2), "shard0_shard0"),
    ((9, 5), (2, 2), "strided"),
    ((7, 6), (3, 2), "strided"),
]


@pytest.mark.parametrize(("shape", "mesh_shape", "kind"), LAYOUTS)
def test_local_shape_and_offset_agrees_with_both_of_torchs_forms(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], kind: str
) -> None:
    """At every coordinate, the fence gives torch's own layout: its private form (by
    coordinate, 2.7 on) or its public module's form given the fence's stand-in mesh."""
    if _torch_internals.disabled():
        assert _torch_internals.local_shape_and_offset(shape, mesh_shape, [0], []) is None
        return
    from torch.distributed.tensor import _utils
    from torch.distributed.tensor.placement_types import Shard

    strided = _torch_internals.strided_shard_types()
    if kind == "shard0":
        placements: list[object] = [Shard(0)]
    elif kind == "shard0_shard0":
        placements = [Shard(0), Shard(0)]
    else:
        assert strided, "every supported torch has a strided shard"
        placements = [strided[0](0, split_factor=mesh_shape[1]), Shard(0)]
    private = getattr(_utils, "_compute_local_shape_and_global_offset", None)
    public_form = getattr(_utils, "compute_local_shape_and_global_offset", None)
    assert private is not None or public_form is not None
    for flat in range(mesh_shape[0] * mesh_shape[-1] if len(mesh_shape) > 1 else mesh_shape[0]):
        coordinate = list(divmod(flat, mesh_shape[1])) if len(mesh_shape) > 1 else [flat]
        found = _torch_internals.local_shape_and_offset(shape, mesh_shape, coordinate, placements)
        assert found is not None
        if private is not None:
            local, offset = private(shape, mesh_shape, coordinate, placements)
            assert found == (tuple(local), tuple(offset))
        else:  # 2.6: only the public module's form, given the stand-in mesh
            assert public_form is not None
            mesh = _torch_internals._MeshAt(mesh_shape, coordinate)
            local, offset = public_form(shape, mesh, placements)
            assert found == (tuple(local), tuple(offset))


_PROBE = """
import torch, clipopt
from clipopt import _torch_internals
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3).double())
opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters()), max_norm=0.1)
for _ in range(3):
    x = torch.randn(4, 7)
    model[1](model[0](x).double()).square().sum().backward()
    opt.step(); opt.zero_grad()
norms = [clipopt.get_total_norm([torch.randn(50).bfloat16(), torch.randn(9)], p) for p in
         (1.0, 2.0, float("inf"))]
print(sorted(k for k, v in _torch_internals.available().items() if v))
print([t.double().tolist() for t in norms], float(opt.last_norm))
print([p.double().sum().item() for p in model.parameters()])
"""


def _run_probe(disable: bool) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != _torch_internals.DISABLE_ENV}
    if disable:
        env[_torch_internals.DISABLE_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.splitlines()


def test_the_environment_variable_takes_every_public_path_with_the_same_answers() -> None:
    with_internals, without = _run_probe(False), _run_probe(True)
    assert without[0] == "[]"
    assert with_internals[0] != "[]"
    assert with_internals[1:] == without[1:]


def test_a_strided_shard_without_a_layout_rule_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the fence offers no strided shard, such a placement is refused, not read as a
    plain Shard (up to 2.13 it is a subclass of Shard)."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from clipopt._dist import _unit_rows

    class _StridedShard(Shard):  # stands in for torch's, unknown to the fence
        pass

    class _Fake:
        placements = (_StridedShard(0), Replicate())
        shape = (4, 4)
        device_mesh = "mesh"

    monkeypatch.setattr(_torch_internals, "strided_shard_types", tuple)
    with pytest.raises(ValueError, match="strided shard"):
        _unit_rows._check_placements(_Fake())  # type: ignore[arg-type]
