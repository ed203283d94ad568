"""Train a small model with ClippedOptimizer, checkpoint it, resume it, plot its norms.

One command (``make demo``), well under a minute on a CPU:

1. a small MLP learns a synthetic regression; every ``SPIKE_EVERY``-th batch has its
   targets blown up, the kind of outlier batch that throws a run off, and its gradient
   norm jumps by orders of magnitude;
2. ``ClippedOptimizer`` wraps AdamW and clips every step to ``MAX_NORM`` first, with a
   OneCycle LR schedule on top; the progress bar (plain lines when stdout is not a
   terminal) shows the loss, the pre-clip norm ``opt.last_norm`` and how often it clipped;
3. halfway through it saves model, optimizer and scheduler with ``torch.save``, loads
   them with ``torch.load(weights_only=True)`` into fresh objects, trains the second half
   again, and checks that the parameters are bit-identical to the uninterrupted run's;
4. it draws the pre-clip norm against the threshold per step as a PNG (needs
   matplotlib: ``pip install clipopt[plot]``; without it the plot is skipped).

``--out DIR`` (default ``quickstart-out``) gets the checkpoint and the plot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

import clipopt

STEPS = 60
RESUME_AT = 30
MAX_NORM = 5.0
SPIKE_EVERY = 12
"""Batches 11, 23, 35, ... have outlier targets (x100)."""


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, the same whichever run asks: resuming sees the same data."""
    data = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=data)
    y = x @ torch.linspace(-1.0, 1.0, 16).unsqueeze(1) + 0.1 * torch.randn(64, 1, generator=data)
    if step % SPIKE_EVERY == SPIKE_EVERY - 1:
        y = y * 100.0
    return x, y


def build() -> tuple[torch.nn.Module, clipopt.ClippedOptimizer, Any]:
    """Model, clipped optimizer and scheduler, freshly initialised (the same every time)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), MAX_NORM)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-2, total_steps=STEPS)
    return model, opt, sched


class Progress:
    """A tqdm bar on a terminal; otherwise (a pipe, a test, CI) one plain line per step."""

    def __init__(self, start: int, stop: int, label: str, norms: list[float]) -> None:
        self.bar: Any = None
        if sys.stdout.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                desc = f"{label} steps {start}-{stop - 1}"
                self.bar = tqdm(range(start, stop), desc=desc, unit="step", file=sys.stdout)
        self.label, self.norms = label, norms

    def update(self, step: int, loss: float) -> None:
        """Show ``step``, whose pre-clip norm is the last of ``norms``."""
        norm = self.norms[-1]
        clipped = norm > MAX_NORM
        share = f"{sum(n > MAX_NORM for n in self.norms)}/{len(self.norms)}"  # so far
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3g}", norm=f"{norm:.3g}", clipped=share)
            self.bar.update()
        else:
            verdict = "clipped" if clipped else "kept"
            print(
                f"{self.label} step {step:2d}  loss {loss:10.4f}  grad norm {norm:10.4f}  "
                f"{verdict:7s}  clipped {share}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(
    model: torch.nn.Module,
    opt: clipopt.ClippedOptimizer,
    sched: Any,
    start: int,
    stop: int,
    label: str,
    norms: list[float],
) -> None:
    """Steps ``start`` to ``stop - 1``, appending each step's pre-clip norm to ``norms``."""
    progress = Progress(start, stop, label, norms)
    for step in range(start, stop):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # clips to MAX_NORM, then AdamW steps
        sched.step()
        assert opt.last_norm is not None
        norms.append(opt.last_norm.item())  # the only host read: for printing and the plot
        progress.update(step, loss.item())
    progress.close()


def plot(norms: list[float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install clipopt[plot]): no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    steps = range(len(norms))
    ax.plot(steps, norms, marker=".", lw=1, label="pre-clip gradient norm (opt.last_norm)")
    ax.axhline(MAX_NORM, color="tab:red", ls="--", lw=1, label=f"max_norm = {MAX_NORM:g}")
    spikes = [s for s in steps if s % SPIKE_EVERY == SPIKE_EVERY - 1]
    ax.scatter(spikes, [norms[s] for s in spikes], color="tab:orange", zorder=3, label="outlier")
    ax.set_yscale("log")
    ax.set_ylim(0.2, 3e4)  # headroom above the spikes for the legend
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    ax.set_title("Every step above the dashed line was clipped to it")
    ax.legend(fontsize=8, loc="upper left", ncol=3, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})  # no version stamp: the same bytes each run
    plt.close(fig)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("quickstart-out"))
    parser.add_argument("--plot", type=Path, help="where the PNG goes (default: OUT/norms.png)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out / "checkpoint.pt"

    # The uninterrupted run, saving a checkpoint on the way.
    model, opt, sched = build()
    norms: list[float] = []
    train(model, opt, sched, 0, RESUME_AT, "run", norms)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    torch.save(state, checkpoint)
    train(model, opt, sched, RESUME_AT, STEPS, "run", norms)
    clipped = sum(n > MAX_NORM for n in norms)
    print(f"{STEPS} steps, {clipped} clipped, final lr {sched.get_last_lr()[0]:.2e}")

    # Fresh objects, the checkpoint loaded, the second half again.
    model2, opt2, sched2 = build()
    saved = torch.load(checkpoint, weights_only=True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    print(f"resumed from {checkpoint} at step {int(opt2.step_count)}")
    resumed: list[float] = []
    train(model2, opt2, sched2, RESUME_AT, STEPS, "resumed", resumed)
    pairs = zip(model.parameters(), model2.parameters(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    same = same and resumed == norms[RESUME_AT:]
    print(f"resume check: parameters and norms bit-identical to the uninterrupted run: {same}")
    if not same:
        raise SystemExit("the resumed run diverged from the uninterrupted one")

    plot(norms, args.plot or args.out / "norms.png")


if __name__ == "__main__":
    main()
