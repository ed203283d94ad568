"""Train a small model with ClippedOptimizer, checkpoint it, resume it, plot its norms.

One command (``make demo``), a few seconds on a CPU:

1. a small MLP learns a synthetic regression; every ``SPIKE_EVERY``-th batch has its
   targets blown up, the kind of outlier batch that throws a run off, and its gradient
   norm jumps by orders of magnitude;
2. ``ClippedOptimizer`` wraps AdamW and clips every step to ``MAX_NORM`` first, with a
   OneCycle LR schedule on top; on a terminal a progress bar shows the pre-clip norm
   ``opt.last_norm`` and how many steps were clipped (``opt.clipped_count``), and each
   phase ends in one summary line (the only output when stdout is not a terminal);
3. halfway through it saves model, optimizer (its counts with it) and scheduler with
   ``torch.save``, loads them with ``torch.load(weights_only=True)`` into fresh objects,
   trains the second half again, and checks that the parameters and norms are
   bit-identical to the uninterrupted run's;
4. it draws the pre-clip norm against the threshold per step as a PNG (needs
   matplotlib: ``pip install clipopt[plot]``; without it the plot is skipped).

``--out DIR`` (default ``quickstart-out``) gets the checkpoint and the plot.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import clipopt

STEPS = 60
RESUME_AT = 30
MAX_NORM = 5.0
SPIKE_EVERY = 12
"""Batches 11, 23, 35, ... have outlier targets (x100)."""
SPIKES = [step for step in range(STEPS) if step % SPIKE_EVERY == SPIKE_EVERY - 1]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, the same whichever run asks: resuming sees the same data."""
    data = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=data)
    y = x @ torch.linspace(-1.0, 1.0, 16).unsqueeze(1) + 0.1 * torch.randn(64, 1, generator=data)
    if step in SPIKES:
        y = y * 100.0
    return x, y


def build() -> tuple[torch.nn.Module, clipopt.ClippedOptimizer, Any]:
    """Model, clipped optimizer and scheduler, freshly initialised (the same every time)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), MAX_NORM)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-2, total_steps=STEPS)
    return model, opt, sched


@dataclass
class Phase:
    """Steps ``start`` to ``stop - 1`` of one run: each step's pre-clip norm and loss, and
    how many of the run's steps were clipped before ``start`` and by its end (the
    optimizer's ``clipped_count``)."""

    label: str
    start: int
    stop: int
    clipped_before: int
    norms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    clipped_after: int = 0

    @property
    def clipped(self) -> int:
        """Steps of this phase that the clip scaled."""
        return self.clipped_after - self.clipped_before

    def summary(self, steps_taken: int) -> str:
        outliers = ", ".join(
            f"{norm:.0f}" for step, norm in enumerate(self.norms, self.start) if step in SPIKES
        )
        total = self.clipped_after
        return (
            f"{self.label:8s} steps {self.start:2d}-{self.stop - 1:2d}  clipped {self.clipped:2d} "
            f"({total}/{steps_taken} so far)  outlier norms {outliers} -> {MAX_NORM:g}"
        )


def progress_bar(phase: Phase) -> Any:
    """A tqdm bar over the whole run, starting at the phase's first step, on a terminal
    only: anywhere else (a pipe, a test, CI) the summary lines are the whole output."""
    if not sys.stdout.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=STEPS,
        initial=phase.start,
        desc=phase.label,
        unit="step",
        file=sys.stdout,
        leave=False,  # the summary line replaces it
        postfix=f"clipped {phase.clipped_before}/{phase.start}",
    )


def train(model: torch.nn.Module, opt: clipopt.ClippedOptimizer, sched: Any, phase: Phase) -> Phase:
    """Train ``phase``'s steps, recording each one's pre-clip norm and loss."""
    bar = progress_bar(phase)
    for step in range(phase.start, phase.stop):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # clips to MAX_NORM, then AdamW steps
        sched.step()
        assert opt.last_norm is not None
        phase.norms.append(opt.last_norm.item())  # the only host read: for printing, the plot
        phase.losses.append(loss.item())
        if bar is not None:
            clipped = int(opt.clipped_count)  # on the device until read, as last_norm
            shown = f"norm {phase.norms[-1]:.3g}, clipped {clipped}/{int(opt.step_count)}"
            bar.set_postfix_str(shown, refresh=False)
            bar.update()
    if bar is not None:
        bar.close()
    phase.clipped_after = int(opt.clipped_count)
    print(phase.summary(int(opt.step_count)))
    return phase


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
    ax.scatter(SPIKES, [norms[s] for s in SPIKES], color="tab:orange", zorder=3, label="outlier")
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
    print(
        f"clipping to max_norm {MAX_NORM:g}; outlier batches (targets x100) at steps "
        + ", ".join(map(str, SPIKES))
    )

    # The uninterrupted run, saving a checkpoint on the way.
    model, opt, sched = build()
    first = train(model, opt, sched, Phase("run", 0, RESUME_AT, clipped_before=0))
    # The optimizer's state dict holds its step_count and clipped_count.
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    torch.save(state, checkpoint)
    print(f"saved    {checkpoint} at step {int(opt.step_count)} ({first.clipped} clipped)")
    second = train(model, opt, sched, Phase("run", RESUME_AT, STEPS, first.clipped_after))
    ordinary = [
        loss for step, loss in enumerate(first.losses + second.losses) if step not in SPIKES
    ]
    print(
        f"done     loss {ordinary[0]:.3g} -> {ordinary[-1]:.3g} on ordinary batches, "
        f"final lr {sched.get_last_lr()[0]:.2e}"
    )

    # Fresh objects, the checkpoint loaded, the second half again.
    model2, opt2, sched2 = build()
    saved = torch.load(checkpoint, weights_only=True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    start = int(opt2.step_count)  # restored from the checkpoint, as the lr schedule is
    clipped = int(opt2.clipped_count)  # so is the count of clipped steps
    print(f"resumed  {checkpoint} at step {start} ({clipped} clipped)")
    resumed = train(model2, opt2, sched2, Phase("resumed", start, STEPS, clipped))
    pairs = zip(model.parameters(), model2.parameters(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs) and resumed.norms == second.norms
    print(f"resume check: parameters and norms bit-identical to the uninterrupted run: {same}")
    if not same:
        raise SystemExit("the resumed run diverged from the uninterrupted one")

    plot(first.norms + second.norms, args.plot or args.out / "norms.png")


if __name__ == "__main__":
    main()
