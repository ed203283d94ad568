"""Train a small regressor with Hugging Face Accelerate, clipping with ClippedOptimizer.

``accelerator.prepare`` takes the wrapper like any optimizer; the loop does not call
``accelerator.clip_grad_norm_``, since the wrapper's ``step()`` already clips (calling
both would clip twice, and ``last_norm`` would be the norm after the first clip).
Run it with ``python examples/accelerate_example.py``; it prints the first and last
steps and saves and reloads the whole state with ``accelerator.save_state`` on the way.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import clipopt

MAX_NORM = 5.0


Batches = DataLoader[tuple[torch.Tensor, ...]]
Scheduler = torch.optim.lr_scheduler.LRScheduler


def parts(
    total_steps: int, accelerator: Accelerator
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Scheduler, Batches]:
    """Model, wrapper, scheduler and data, each built afresh and prepared."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-2), MAX_NORM)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator) * 3.0
    data = DataLoader(TensorDataset(inputs, targets), batch_size=64)
    return accelerator.prepare(model, opt, sched, data)  # type: ignore[no-any-return]


def unwrap(opt: torch.optim.Optimizer) -> clipopt.ClippedOptimizer:
    """The ClippedOptimizer inside accelerate's AcceleratedOptimizer."""
    inner = getattr(opt, "optimizer", None)
    assert isinstance(inner, clipopt.ClippedOptimizer)
    return inner


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Scheduler,
    data: Batches,
    accelerator: Accelerator,
    steps: int,
) -> list[dict[str, float]]:
    """``steps`` steps over ``data`` in order, cycling; the loss, norm and lr of each."""
    history = []
    batches = iter(())  # type: ignore[var-annotated]
    for _ in range(steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(data)
            batch = next(batches)
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad()
        norm = unwrap(opt).last_norm
        assert norm is not None
        history.append({"loss": loss.item(), "grad_norm": norm.item(), "lr": lr})
    return history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=True)
    model, opt, sched, data = parts(args.steps, accelerator)
    history = train(model, opt, sched, data, accelerator, args.steps // 2)
    with tempfile.TemporaryDirectory() as tmp:
        accelerator.save_state(str(Path(tmp) / "state"))
        accelerator.load_state(str(Path(tmp) / "state"))
    # One epoch is 4 batches and the steps so far are a whole number of epochs, so the
    # loop may start a fresh pass over the data.
    history += train(model, opt, sched, data, accelerator, args.steps - args.steps // 2)
    for step in (0, len(history) - 1):
        row = history[step]
        print(f"step {step:2d}  loss {row['loss']:9.4f}  grad norm {row['grad_norm']:8.4f}")
    print(f"{int(unwrap(opt).step_count)} steps, final lr {sched.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
