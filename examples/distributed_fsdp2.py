"""Clip the true global grad norm of an FSDP2 model: every rank prints the same ``last_norm``.

Each rank holds only a shard of every parameter (some shards are empty: the first layer
has fewer output rows than there are ranks), so a rank-local norm would be wrong.
:class:`clipopt.ClippedOptimizer` sees DTensor grads and reduces the norm across the mesh
with one ``all_reduce``; nothing FSDP-specific is passed.

Run on CPU (gloo) with two processes (without torchrun the script prints this command
and exits)::

    .venv/bin/torchrun --nproc_per_node=2 examples/distributed_fsdp2.py
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import clipopt

STEPS = 5
BATCH = 8
NPROC = 2
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each process, and ``init_process_group()`` reads."""


def build_model() -> nn.Sequential:
    """The same initial weights on every rank (FSDP2 shards them, it does not broadcast)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 1), nn.Tanh(), nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 4))


def shard(model: nn.Sequential) -> None:
    """FSDP2 over all ranks: each Linear is its own unit, then the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(steps: int = STEPS) -> torch.Tensor:
    """A few clipped AdamW steps on per-rank data; return the last pre-clip norm."""
    model = build_model()
    shard(model)
    optimizer = clipopt.ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=0.5
    )
    data = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(steps):
        inputs = torch.randn(BATCH, 16, generator=data)
        targets = torch.randn(BATCH, 4, generator=data)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    norm = optimizer.last_norm
    assert norm is not None
    return norm


def torchrun_command() -> str:
    """The command that launches this script: the torchrun beside this Python (the
    venv's), else the one on the PATH, with both paths as this run was given them."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if torchrun.is_file():
        shown = os.path.relpath(torchrun) if torchrun.is_relative_to(Path.cwd()) else torchrun
    else:
        shown = Path("torchrun")
    return f"{shown} --nproc_per_node={NPROC} {sys.argv[0]}"


def main() -> None:
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing and not dist.is_initialized():
        raise SystemExit(
            f"{sys.argv[0]} runs as {NPROC} processes that torchrun starts and tells their\n"
            f"rank ({', '.join(missing)} are not set here). Launch it with:\n\n"
            f"    {torchrun_command()}\n"
        )
    torch.set_num_threads(1)
    launched_here = not dist.is_initialized()
    if launched_here:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        norm = train()
        # Reading the norm on the host is this script's purpose, so it syncs once here.
        # One write per line: unbuffered ranks sharing a pipe would interleave text and "\n".
        print(f"rank {dist.get_rank()}: last_norm={norm.item():.6f}\n", end="", flush=True)
    finally:
        if launched_here:
            # Every rank done communicating before any closes its connections: under load,
            # gloo aborted a rank whose peer had torn down first.
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
