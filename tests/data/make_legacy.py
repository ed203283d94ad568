"""Writes the checkpoint and pickle files that later versions of clipopt must still load.

Run once with the version whose files they are (``python tests/data/make_legacy.py``);
the files are committed and never regenerated, since they stand for what users saved.
Each file holds what it was made from, and what that version computed next, so a test
can resume from it and compare.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

import clipopt

HERE = Path(__file__).parent
STEPS, RESUME_AT = 6, 3
POISONED = {"sgd-per-group": (1,), "adamw-fused": (1, 2)}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def backward(net: nn.Module, step: int, poisoned: tuple[int, ...] = (1,)) -> None:
    data = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 5, generator=data), torch.randn(16, 2, generator=data)
    loss = torch.nn.functional.mse_loss(net(x), y) * 100
    if step in poisoned:
        loss = loss * float("nan")  # a skipped step, so the counters are not all equal
    loss.backward()


def optimizer(net: nn.Module, case: str) -> clipopt.ClippedOptimizer:
    groups: list[dict[str, Any]] = [
        {"params": list(net[0].parameters())},
        {"params": list(net[2].parameters()), "max_norm": 0.02},
    ]
    if case == "adamw-fused":  # one threshold, so the clip folds into the fused kernel
        del groups[1]["max_norm"]
        inner: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
        return clipopt.ClippedOptimizer(inner, max_norm=0.05, nonfinite="skip")
    inner = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return clipopt.ClippedOptimizer(inner, max_norm=0.05, per_group=True, nonfinite="skip")


def run(case: str) -> None:
    net = model()
    opt = optimizer(net, case)
    checkpoint: dict[str, Any] = {}
    for step in range(STEPS):
        if step == RESUME_AT:
            checkpoint = {
                "model": {k: v.clone() for k, v in net.state_dict().items()},
                "optimizer": copy.deepcopy(opt.state_dict()),
            }
            with open(HERE / f"legacy_0.1.0_{case}.pickle", "wb") as f:
                pickle.dump({"model": net, "optimizer": opt}, f)
        opt.zero_grad()
        backward(net, step, POISONED[case])
        opt.step()
    checkpoint["final_model"] = net.state_dict()
    checkpoint["final_optimizer"] = opt.state_dict()
    torch.save(checkpoint, HERE / f"legacy_0.1.0_{case}.pt")


if __name__ == "__main__":
    for name in ("sgd-per-group", "adamw-fused"):
        run(name)
