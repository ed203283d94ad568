"""Log the pre-clip norm, the threshold and each clip event to TensorBoard.

Three scalars per step: ``clip/grad_norm`` (``opt.last_norm``, the norm before
clipping), ``clip/max_norm`` (the threshold the step used) and ``clip/clipped`` (1 when
the step scaled the grads down, else 0), plus the loss. Run it with
``python examples/tensorboard_logging.py [--logdir DIR]`` (a temp dir if none is given)
and point ``tensorboard --logdir DIR`` at the directory.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

import clipopt

MAX_NORM = 25.0


def log_step(writer: SummaryWriter, opt: clipopt.ClippedOptimizer, step: int) -> None:
    """Write this step's clip scalars."""
    assert opt.last_norm is not None and opt.last_clipped is not None
    norm = opt.last_norm.item()  # the host reads TensorBoard needs, once per step
    writer.add_scalar("clip/grad_norm", norm, step)
    writer.add_scalar("clip/max_norm", float(opt.param_groups[0]["clip_max_norm"]), step)
    writer.add_scalar("clip/clipped", int(opt.last_clipped), step)


def train(logdir: Path, steps: int) -> int:
    """Train the quick-start regressor, logging every step; the number of clipped steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-2), MAX_NORM)
    inputs = torch.randn(256, 16)
    targets = inputs @ torch.randn(16, 1) * 3.0
    with SummaryWriter(str(logdir)) as writer:
        for step in range(steps):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            writer.add_scalar("loss", loss.item(), step)
            log_step(writer, opt, step)
    return int(opt.clipped_count)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", type=Path, help="event files go here (default: temp)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        logdir = args.logdir or Path(tmp)
        clipped = train(logdir, args.steps)
        events = sorted(p.name for p in logdir.glob("events.out.tfevents.*"))
        print(f"{args.steps} steps, {clipped} clipped, event files: {len(events)}")


if __name__ == "__main__":
    main()
