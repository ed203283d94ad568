"""Write ``format_1_adamw_zclip.pt``: a checkpoint of format 1 of the ``"clip"`` entry.

A ``ClippedOptimizer`` around AdamW with ``ZClip`` trains ``SAVED_AT`` steps on seeded
grads, and the file takes the parameters and ``opt.state_dict()`` then, what the
wrapper and the rule report then (``"recorded"``), and what the same run reports over
``CONTINUED`` more steps (``"continued"``). ``tests/test_checkpoint.py`` loads it with
``weights_only=True`` and checks both against a fresh wrapper. Run from the repository
root, ``python tests/data/make_format_1.py``, only when the format changes (with a new
file and a new format number).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import clipopt

SAVED_AT = 8
CONTINUED = 4
SPIKES = (6, 10)  # steps whose grads are 20x the others, for ZClip to clip
PATH = Path(__file__).with_name("format_1_adamw_zclip.pt")


def params() -> list[torch.nn.Parameter]:
    """The model: two tensors, fresh zeros (the checkpoint brings the trained ones)."""
    return [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))]


def wrapper(ps: list[torch.nn.Parameter]) -> clipopt.ClippedOptimizer:
    inner = torch.optim.AdamW(ps, lr=0.05, foreach=False)
    rule = clipopt.ZClip(max_grad_norm=None, warmup_steps=3)
    return clipopt.ClippedOptimizer(inner, max_norm=rule)


def set_grads(ps: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    scale = 20.0 if step in SPIKES else 0.2
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen) * scale


def readouts(opt: clipopt.ClippedOptimizer) -> dict[str, Tensor]:
    """What the wrapper and its rule report, copied. The file holds the rule's own
    ``clipped_count``, from before the wrapper counted; on this run the wrapper's count is
    the same (``format_2_adamw_zclip.pt`` holds both)."""
    rule = opt.rule
    assert rule is not None and opt.last_norm is not None and rule.last_threshold is not None
    return {
        "step_count": opt.step_count.clone(),
        "skip_count": opt.skip_count.clone(),
        "last_norm": opt.last_norm.clone(),
        "last_threshold": rule.last_threshold.clone(),
        "clipped_count": opt.clipped_count.clone(),
    }


def flat(ps: list[torch.nn.Parameter]) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ps])


def main(
    path: Path = PATH, report: Callable[[clipopt.ClippedOptimizer], dict[str, Tensor]] = readouts
) -> None:
    """Run, save at ``SAVED_AT``, run on, and write what ``report`` read at each point."""
    torch.manual_seed(0)
    ps = params()
    for p in ps:
        torch.nn.init.normal_(p)
    opt = wrapper(ps)
    for step in range(SAVED_AT):
        set_grads(ps, step)
        opt.step()
    saved: dict[str, Any] = {
        "params": flat(ps),
        "optimizer": copy.deepcopy(opt.state_dict()),  # its tensors are the live ones
        "recorded": report(opt),
    }
    continued: list[dict[str, Tensor]] = []
    for step in range(SAVED_AT, SAVED_AT + CONTINUED):
        set_grads(ps, step)
        opt.step()
        continued.append({"params": flat(ps), **report(opt)})
    saved["continued"] = {k: torch.stack([c[k] for c in continued]) for k in continued[0]}
    torch.save(saved, path)


if __name__ == "__main__":
    main()
