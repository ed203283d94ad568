"""clipopt's wings and modules import only downward.

The package has layers of units, each a top-level module or a wing (a subpackage with
one job); a unit may import only units of lower layers. Inside a wing, modules have
floors of their own, and a module may import only its wing's lower floors (the wing's
``__init__`` sits above them all). Every ``import`` counts, at the top, inside functions
and under ``TYPE_CHECKING``, so a cycle cannot hide behind a deferred import. A new
top-level module or wing module must be given a place here; a new clip rule needs none.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import clipopt

PACKAGE = Path(clipopt.__file__).parent

UNIT_LAYERS: list[set[str]] = [
    # errors, argument checks
    {"_errors", "_validation"},
    {"_kernels"},  # one rank's norms and scales
    {"_dist", "_wrapper"},  # norms across ranks; the wrapper's plumbing and step hooks
    # the clip rules; torch.nn.utils' names; several optimizers stepped as one
    {"rules", "functional"},
    {"_step"},  # one clipped step: measure, decide, apply, and its saved entry
    {"optimizer"},  # ClippedOptimizer
    {"distributed"},  # the distributed names and DCP checkpoints
    {"__init__"},
]
WING_FLOORS: dict[str, list[set[str]]] = {
    # the norms, then the scales that use them
    "_kernels": [{"_norms"}, {"_scale"}],
    # collectives and meshes; the pipeline stages; the reductions and AGC's units; where a
    # step under DeepSpeed's ZeRO optimizer is reduced
    "_dist": [
        {"_mesh"},
        {"_stages"},
        {"_reduce", "_units"},
        {"_deepspeed"},
    ],
    # the protocol, the unit-wise protocol, then every rule (a module not named is a rule)
    "rules": [{"_base"}, {"_unit"}, set()],
    # how a step measures, non-finite verdicts, the fold, the saved entry; the step top to
    # bottom
    "_step": [{"_measure", "_nonfinite", "_fold", "_saved"}, {"_clip_step"}],
}
RULES_FLOOR = 2  # where a module of rules/ that WING_FLOORS does not name sits
LAYER_OF = {unit: index for index, units in enumerate(UNIT_LAYERS) for unit in units}


def _modules() -> list[str]:
    """Every clipopt module, dotted below ``clipopt`` (``_step._decide``, ``rules``)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        names.append(
            ".".join(parts[:-1]) if parts[-1] == "__init__" and parts[:-1] else ".".join(parts)
        )
    return names


def _source(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imported(tree: ast.Module, package: str = "") -> set[str]:
    """The clipopt modules a module's source imports, anywhere in it, dotted below
    ``clipopt``; ``package`` is the importing module's package, for relative imports."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "clipopt":
                    found.add(alias.name.partition(".")[2] or "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = ".".join(p for p in (base, node.module or "") if p)
            elif node.module == "clipopt" or (node.module or "").startswith("clipopt."):
                module = node.module.partition(".")[2] if node.module else ""
            else:
                continue
            for alias in node.names:  # a name may be a module (from clipopt._step import _fold)
                candidate = f"{module}.{alias.name}" if module else alias.name
                if _source(candidate).exists():
                    found.add(candidate)
                else:
                    found.add(module or "__init__")
    return found


def _place(module: str) -> tuple[int, int]:
    """(the layer of the module's unit, its floor inside a wing; -1 for a unit itself)."""
    unit, _, inner = module.partition(".")
    if not inner:
        return LAYER_OF[unit], len(WING_FLOORS.get(unit, []))  # a wing's __init__: on top
    floors = WING_FLOORS[unit]
    for floor, names in enumerate(floors):
        if inner in names:
            return LAYER_OF[unit], floor
    assert unit == "rules", f"clipopt.{module} has no floor in WING_FLOORS[{unit!r}]"
    return LAYER_OF[unit], RULES_FLOOR


def test_every_module_has_a_place() -> None:
    for module in _modules():
        unit = module.partition(".")[0]
        assert unit in LAYER_OF, f"clipopt.{module}: {unit} has no layer in UNIT_LAYERS"
        _place(module)


@pytest.mark.parametrize("module", _modules())
def test_imports_point_only_downward(module: str) -> None:
    tree = ast.parse(_source(module).read_text(encoding="utf-8"), filename=str(module))
    package = module if _source(module).name == "__init__.py" else module.rpartition(".")[0]
    layer, floor = _place(module)
    unit = module.partition(".")[0]
    upward = []
    for target in _imported(tree, package):
        target_layer, target_floor = _place(target)
        if target.partition(".")[0] == unit:
            if target_floor >= floor:
                upward.append(f"{target} (floor {target_floor} of {unit}, this is {floor})")
        elif target_layer >= layer:
            upward.append(f"{target} (layer {target_layer}, this is {layer})")
    assert not upward, f"clipopt.{module} imports {upward}"


BENCHMARKS = PACKAGE.parent / "benchmarks"
BENCHMARK_LAYERS: list[set[str]] = [
    {"__init__", "common", "markdown"},  # the harness: layouts, timing, results; JSON to md
    {"host", "rules", "compiled", "gpu_compile", "dryrun"},  # sections on the harness
    {"targets"},  # the goals, over the harness's rows and host's
    {"run"},  # every section, and main
]


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.stem)
def test_benchmark_modules_import_only_downward(path: Path) -> None:
    layer_of = {name: i for i, names in enumerate(BENCHMARK_LAYERS) for name in names}
    assert path.stem in layer_of, f"benchmarks/{path.name} has no layer in BENCHMARK_LAYERS"
    upward = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            targets = [node.module.split(".")[1]] if node.module else []
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")]
        upward += [t for t in targets if layer_of.get(t, 99) >= layer_of[path.stem]]
    assert not upward, f"benchmarks/{path.name} imports {upward}"
