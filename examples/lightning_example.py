"""Train a small regressor with Lightning, clipping with ClippedOptimizer.

``configure_optimizers`` returns the wrapper and a per-step scheduler; the pre-clip norm
of every step is logged as ``grad_norm`` with ``self.log``. Run it with
``python examples/lightning_example.py [--root DIR]``: logs go to DIR (a temp dir if
none is given), and the last lines printed are the first and last losses and norms.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import clipopt

MAX_NORM = 5.0


def dataset(n: int = 256) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(n, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator) * 3.0
    return TensorDataset(inputs, targets)


def loader(batch_size: int = 64) -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(dataset(), batch_size=batch_size)


class Regressor(L.LightningModule):
    def __init__(self, max_norm: float = MAX_NORM, lr: float = 3e-2, total_steps: int = 40):
        super().__init__()
        self.max_norm, self.lr, self.total_steps = max_norm, lr, total_steps
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        self.history: list[dict[str, float]] = []  # loss, pre-clip norm and lr of each step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        self.log("train_loss", loss)
        # Read the lr here: Lightning steps a per-step scheduler before on_train_batch_end.
        lr = self.clipped_optimizer().param_groups[0]["lr"]
        self.history.append({"loss": loss.item(), "lr": lr})
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        opt = self.clipped_optimizer()
        assert opt.last_norm is not None
        self.log("grad_norm", opt.last_norm)
        self.history[-1]["grad_norm"] = opt.last_norm.item()

    def clipped_optimizer(self) -> clipopt.ClippedOptimizer:
        """The wrapper inside the LightningOptimizer that ``self.optimizers()`` returns."""
        lightning_optimizer = self.optimizers()
        assert not isinstance(lightning_optimizer, list)
        opt = lightning_optimizer.optimizer
        assert isinstance(opt, clipopt.ClippedOptimizer)
        return opt

    def configure_optimizers(self) -> Any:
        opt = clipopt.ClippedOptimizer(
            torch.optim.AdamW(self.parameters(), lr=self.lr), max_norm=self.max_norm
        )
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(root: Path, max_steps: int, **overrides: Any) -> L.Trainer:
    settings: dict[str, Any] = {
        "max_steps": max_steps,
        "accelerator": "cpu",
        "devices": 1,
        "default_root_dir": str(root),
        "logger": L.pytorch.loggers.CSVLogger(str(root)),
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        # Left off (None): Lightning would clip inside its closure, before the wrapper's
        # step, so the wrapper would measure and log the already-clipped norm.
        "gradient_clip_val": None,
    }
    return L.Trainer(**(settings | overrides))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, help="log directory (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or Path(tmp)
        L.seed_everything(0, verbose=False)
        model = Regressor(total_steps=args.steps)
        fit = trainer(root, args.steps)
        fit.fit(model, loader())
        for step in (0, len(model.history) - 1):
            row = model.history[step]
            print(f"step {step:2d}  loss {row['loss']:9.4f}  grad norm {row['grad_norm']:8.4f}")
        opt = model.clipped_optimizer()
        print(f"{int(opt.step_count)} steps, final lr {opt.param_groups[0]['lr']:.2e}")


if __name__ == "__main__":
    main()
