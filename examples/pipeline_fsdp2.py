"""Clip a pipeline-parallel model by its whole norm: two stages, each sharded by FSDP2.

Four processes as (pp=2, dp=2): ranks 0 and 1 hold the first stage of a small
transformer (the embedding and a block), ranks 2 and 3 the second (a block and the
head), each stage sharded by FSDP2 over its two ranks, and ``torch.distributed.pipelining``
runs GPipe over the stages. Each stage has its own :class:`clipopt.ClippedOptimizer`;
``pp_mesh`` (the mesh of one rank per stage, torchtitan's name) makes each reduce its
stage's norm over its FSDP2 mesh and then sum the stages' squares, so every rank clips
by the whole model's norm and ZClip's state is the same on every rank. Without
``pp_mesh`` each stage would clip by its own norm.

Halfway through, every stage saves into one DCP checkpoint under the same names (the
model's and the flattened optimizer's keys are the stage's parameter names, and
``ClippedOptimizerState`` keys the clip state by stage), a fresh model and optimizer load
it and training goes on; the script checks that the resumed run ends bit for bit where an
uninterrupted one does.

Run on CPU (gloo) with four processes (without torchrun the script prints this command
and exits)::

    .venv/bin/torchrun --nproc_per_node=4 examples/pipeline_fsdp2.py
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import clipopt
from clipopt.distributed import ClippedOptimizerState

PP, DP = 2, 2
NPROC = PP * DP
STEPS, RESUME_AT = 6, 3
VOCAB, WIDTH, SEQ, BATCH, MICROBATCHES = 13, 8, 5, 8, 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # keys by parameter name
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each process, and ``init_process_group()`` reads."""


class Block(nn.Module):
    """A pre-norm transformer block: attention and an MLP, no dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class First(nn.Module):
    """Stage 0: token ids to hidden states."""

    def __init__(self, embed: nn.Embedding, block: Block) -> None:
        super().__init__()
        self.embed, self.block0 = embed, block

    def forward(self, tokens: Tensor) -> Tensor:
        return self.block0(self.embed(tokens))


class Last(nn.Module):
    """Stage 1: hidden states to logits, one row per token."""

    def __init__(self, block: Block, head: nn.Linear) -> None:
        super().__init__()
        self.block1, self.head = block, head

    def forward(self, x: Tensor) -> Tensor:
        # Rows of tokens into the head: a 3-D input would make its output a view, which
        # FSDP2 warns an in-place op could break.
        return self.head(self.block1(x).reshape(-1, WIDTH))


def build_stages() -> tuple[First, Last]:
    """Both stages of the model, with the same initial weights on every rank."""
    torch.manual_seed(0)
    embed, block0, block1 = nn.Embedding(VOCAB, WIDTH), Block(), Block()
    return First(embed, block0), Last(block1, nn.Linear(WIDTH, VOCAB))


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches(steps: int) -> list[tuple[Tensor, Tensor]]:
    """The global batches (tokens, next-token targets), the same on every rank."""
    g = torch.Generator().manual_seed(11)
    shape = (BATCH, SEQ)
    return [
        (torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g))
        for _ in range(steps)
    ]


def make_rule() -> clipopt.ZClip:
    return clipopt.ZClip(warmup_steps=2, z_thresh=1.0, max_grad_norm=0.5)


def make_optimizer(params: Any, pp_mesh: DeviceMesh | None) -> clipopt.ClippedOptimizer:
    inner = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return clipopt.ClippedOptimizer(inner, max_norm=make_rule(), pp_mesh=pp_mesh)


class Trainer:
    """This rank's stage, FSDP2 over its stage's ranks, its optimizer and the schedule."""

    def __init__(self, pp: DeviceMesh, dp: DeviceMesh) -> None:
        self.stage_index = pp.get_local_rank()
        self.module: nn.Module = build_stages()[self.stage_index]
        for child in self.module.children():
            fully_shard(child, mesh=dp)
        fully_shard(self.module, mesh=dp)
        self.optimizer = make_optimizer(self.module.named_parameters(), pp)
        stage = PipelineStage(
            self.module, self.stage_index, PP, torch.device("cpu"), group=pp.get_group()
        )
        self.schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn)
        share = BATCH // DP
        self.rows = slice(dp.get_local_rank() * share, (dp.get_local_rank() + 1) * share)

    def step(self, tokens: Tensor, targets: Tensor) -> Tensor:
        if self.stage_index == 0:
            self.schedule.step(tokens[self.rows])
        else:
            self.schedule.step(target=targets[self.rows])
        self.optimizer.step()
        self.optimizer.zero_grad()
        norm = self.optimizer.last_norm
        assert norm is not None
        return norm.clone()

    def state(self) -> dict[str, Any]:
        """What DCP saves and loads: the inner optimizer through torch's functions."""
        return {
            "model": get_model_state_dict(self.module),
            "optim": get_optimizer_state_dict(self.module, self.optimizer.optimizer, options=FLAT),
            "clip": ClippedOptimizerState(self.optimizer),
        }

    def load(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state["model"])
        set_optimizer_state_dict(
            self.module, self.optimizer.optimizer, state["optim"], options=FLAT
        )


def meshes() -> tuple[DeviceMesh, DeviceMesh]:
    """(pp, dp): ranks {0, 2} and {1, 3} join the stages, {0, 1} and {2, 3} shard one."""
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    return mesh["pp"], mesh["dp"]


def train(checkpoint: str | None = None, steps: int = STEPS) -> tuple[list[Tensor], Trainer]:
    """Train ``steps``; with ``checkpoint``, save after ``RESUME_AT`` steps and go on in a
    fresh model and optimizer loaded from it. Returns every step's norm and the trainer."""
    pp, dp = meshes()
    trainer = Trainer(pp, dp)
    norms = []
    for step, (tokens, targets) in enumerate(batches(steps)):
        if checkpoint is not None and step == RESUME_AT:
            dcp.save(trainer.state(), checkpoint_id=checkpoint)
            trainer = Trainer(pp, dp)
            state = trainer.state()
            dcp.load(state, checkpoint_id=checkpoint)
            trainer.load(state)
        norms.append(trainer.step(tokens, targets))
    return norms, trainer


def identical(a: Any, b: Any) -> bool:
    """Nested dicts of tensors and plain values, equal bit for bit."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
        )
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def run(checkpoint: str) -> list[float]:
    """Train straight through and with a resume; check they agree bit for bit."""
    norms, trainer = train()
    resumed_norms, resumed = train(checkpoint)
    same = all(torch.equal(a, b) for a, b in zip(norms, resumed_norms, strict=True))
    for a, b in zip(trainer.module.parameters(), resumed.module.parameters(), strict=True):
        same = same and torch.equal(a.to_local(), b.to_local())
    rule, resumed_rule = trainer.optimizer.rule, resumed.optimizer.rule
    assert rule is not None and resumed_rule is not None
    same = same and identical(rule.state_dict(), resumed_rule.state_dict())
    if not same:
        raise SystemExit(f"rank {dist.get_rank()}: the resumed run differs")
    return [float(n) for n in norms]  # reading the norms on the host is the point here


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
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    folder = [tempfile.mkdtemp(prefix="clipopt-pipeline-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(folder, src=0)
    try:
        norms = run(os.path.join(folder[0], "checkpoint"))
        text = " ".join(f"{n:.6f}" for n in norms)
        # One write per line: unbuffered ranks sharing a pipe would interleave text and "\n".
        print(f"rank {dist.get_rank()}: norms {text}; resumed bit for bit\n", end="", flush=True)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
