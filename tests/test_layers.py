"""clipopt's modules import only downward: each may import only modules of lower layers.

Every ``import`` counts, at the top, inside functions and under ``TYPE_CHECKING``, so a
cycle cannot hide behind a deferred import. A new module must be given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import clipopt

PACKAGE = Path(clipopt.__file__).parent

LAYERS: list[set[str]] = [
    {"_errors", "_validation", "_native", "_torch_internals"},  # no clipopt imports
    # the C kernels' Python side; recognising torch's DCP calls; torch.optim's step hooks
    {"_cpu", "_torch_dcp", "_hooks"},
    # partial norms of CPU grads by torch ops; kept groupings; DTensor shards
    {"_torch_norms", "_plan", "_mesh"},
    # local norms, scales; collectives; where each unit (AGC's rows) lies on this rank
    {"_kernels", "_collective", "_unit_rows"},
    # across ranks, of the total, per tensor and per unit; settings; skips; the rule protocol
    {"_reduce", "_per_tensor", "_units", "_clip_state", "_nonfinite", "_rule"},
    # the API; the step; the fold; one module per rule
    {"functional", "_step", "_fused", "_adagc", "_agc", "_autoclip", "_zclip", "_spike_skip"},
    # the wrapper; the rules' facade; per-tensor norms; what a checkpoint or 0.1.0 gives;
    # a rule's coefficients in a step (on the step's dataclasses)
    {"_wrapper", "rules", "_monitor", "_saved", "_rule_step"},
    {"_decide"},  # the step's measure -> decide, on the wrapper's configuration
    {"optimizer"},  # ClippedOptimizer
    {"_checkpoint"},  # DCP helpers on the wrapper
    {"distributed"},  # the facade of the distributed names
    {"__init__"},
]
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}


def _module_names() -> list[str]:
    return sorted(path.stem for path in PACKAGE.glob("*.py"))


def _imported(tree: ast.Module) -> set[str]:
    """The clipopt modules a module's source imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "clipopt":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from .x import y
                target = node.module
            elif node.module == "clipopt" or (node.module or "").startswith("clipopt."):
                target = node.module[len("clipopt.") :] if node.module != "clipopt" else None
            else:
                continue
            if target:
                found.add(target.split(".")[0])
            else:
                found.update(
                    alias.name if alias.name in LAYER_OF else "__init__" for alias in node.names
                )
    return found


def test_every_module_has_a_layer() -> None:
    assert set(_module_names()) <= set(LAYER_OF), set(_module_names()) - set(LAYER_OF)


@pytest.mark.parametrize("name", _module_names())
def test_imports_point_only_to_lower_layers(name: str) -> None:
    tree = ast.parse((PACKAGE / f"{name}.py").read_text(), filename=f"{name}.py")
    upward = {
        target: LAYER_OF.get(target)
        for target in _imported(tree)
        if LAYER_OF.get(target, len(LAYERS)) >= LAYER_OF[name]
    }
    assert not upward, f"clipopt.{name} (layer {LAYER_OF[name]}) imports {upward}"


def test_the_check_sees_deferred_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from clipopt.optimizer import ClippedOptimizer\n"
        "def f():\n    from clipopt import _wrapper\n    import clipopt.distributed\n"
        "from . import _step\n"
    )
    assert _imported(ast.parse(source)) == {"optimizer", "_wrapper", "distributed", "_step"}
