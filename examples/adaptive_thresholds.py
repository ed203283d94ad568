"""Train one small model under a fixed threshold and each adaptive rule, and plot them.

One command, about eight seconds on 2 busy CPU cores (``python examples/adaptive_thresholds.py``):

1. a small MLP learns a synthetic regression with SGD and momentum. A few batches have their
   targets blown up (``SPIKES``), which makes the gradient norm jump by about two orders
   of magnitude, as a bad batch does in a real run;
2. the same run (same initialisation, same batches) is trained once per setting in
   ``SETTINGS``: a fixed ``max_norm``, :class:`clipopt.AutoClip`, :class:`clipopt.ZClip`,
   :class:`clipopt.AdaGC` and :class:`clipopt.SpikeSkip`;
3. each step records the pre-clip norm (``opt.last_norm``), the threshold the step used
   (``rule.last_threshold`` for a global rule) and the post-clip norm
   (``opt.last_clipped_norm``, the norm of the grads the inner optimizer stepped with),
   and every step the loss on clean held-out data; it prints one summary line per
   setting, with the wrapper's ``clipped_count``;
4. it saves one PNG (needs matplotlib: ``pip install clipopt[plot]``) with a panel of
   norms per setting and one of the held-out losses.

The ``.item()`` calls are the example's own, for printing and plotting; the clipped
steps themselves read nothing on the host.

``--plot PATH`` (default ``adaptive-out/adaptive_thresholds.png``) is where the PNG goes.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import clipopt

STEPS = 400
SPIKES = (60, 140, 141, 220, 300, 370)
"""The steps whose batch has outlier targets (x100); 140 and 141 are back to back."""
FIXED_MAX_NORM = 1.0
LR = 0.05


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: the same for every setting."""
    data = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=data)
    y = torch.sin(x @ torch.linspace(-1.0, 1.0, 16).unsqueeze(1)) + 0.05 * torch.randn(
        64, 1, generator=data
    )
    return x, (y * 100.0 if step in SPIKES else y)


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(-1 % 2**31)
    x = torch.randn(512, 16, generator=data)
    return x, torch.sin(x @ torch.linspace(-1.0, 1.0, 16).unsqueeze(1))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip


@dataclass(frozen=True)
class Setting:
    """A label and how to wrap the inner optimizer."""

    label: str
    wrap: Callable[[torch.optim.Optimizer], clipopt.ClippedOptimizer]


UNCLIPPED = Setting("no clipping", lambda o: clipopt.ClippedOptimizer(o, math.inf))
"""The baseline: its losses are drawn beside the others' (no panel of its own)."""
SETTINGS = (
    Setting(
        f"fixed max_norm={FIXED_MAX_NORM:g}",
        lambda o: clipopt.ClippedOptimizer(o, FIXED_MAX_NORM),
    ),
    Setting("AutoClip(percentile=10)", lambda o: clipopt.ClippedOptimizer(o, clipopt.AutoClip())),
    Setting(
        "ZClip(max_grad_norm=None)",
        lambda o: clipopt.ClippedOptimizer(o, clipopt.ZClip(max_grad_norm=None)),
    ),
    Setting(
        "AdaGC(warmup_steps=25)",
        lambda o: clipopt.ClippedOptimizer(o, clipopt.AdaGC(warmup_steps=25)),
    ),
    Setting(
        "SpikeSkip(window=64)",
        lambda o: clipopt.ClippedOptimizer(
            o, math.inf, skip_spikes=clipopt.SpikeSkip(window=64, sigma=6.0)
        ),
    ),
)


@dataclass
class Record:
    """Per step: pre-clip norm, threshold (nan where there is no global one), post-clip
    norm (nan when the step was skipped), held-out loss."""

    label: str
    pre: list[float] = field(default_factory=list)
    threshold: list[float] = field(default_factory=list)
    post: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    clipped: int = 0
    skipped: int = 0


def threshold_of(opt: clipopt.ClippedOptimizer) -> float:
    """The global threshold of the last step; nan where none applied (no clipping, a
    per-tensor rule, a ZClip step that is no spike)."""
    if opt.rule is None:
        value = float(opt.defaults["clip_max_norm"])
    else:
        last = opt.rule.last_threshold
        value = float(last) if last is not None and last.dim() == 0 else math.nan
    return value if math.isfinite(value) else math.nan


def train(setting: Setting) -> Record:
    net = model()
    opt = setting.wrap(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    x_eval, y_eval = held_out()
    record = Record(setting.label)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        skipped_before = int(opt.skip_count)
        opt.step()
        assert opt.last_norm is not None
        skipped = int(opt.skip_count) > skipped_before
        assert opt.last_clipped_norm is not None
        record.pre.append(float(opt.last_norm))
        record.threshold.append(threshold_of(opt))
        record.post.append(math.nan if skipped else float(opt.last_clipped_norm))
        record.skipped += skipped
        with torch.no_grad():
            record.loss.append(float(torch.nn.functional.mse_loss(net(x_eval), y_eval)))
    record.clipped = int(opt.clipped_count)
    return record


def plot(records: list[Record], baseline: Record, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install clipopt[plot]): no plot")
        return
    rows = len(records) + 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 1.9 * rows), dpi=100, sharex=True)
    steps = range(STEPS)
    for ax, record in zip(axes, records, strict=False):
        ax.plot(steps, record.pre, lw=0.8, color="tab:gray", label="pre-clip norm")
        ax.plot(steps, record.post, lw=0.8, color="tab:blue", label="post-clip norm")
        finite = sum(not math.isnan(t) for t in record.threshold)
        marker = "." if finite < STEPS // 2 else None  # isolated thresholds show as dots
        ax.plot(steps, record.threshold, lw=1.0, ls="--", marker=marker, ms=4, color="tab:red",
                label="threshold")  # fmt: skip
        skipped = [s for s in steps if math.isnan(record.post[s])]
        ax.scatter(skipped, [record.pre[s] for s in skipped], marker="x", color="black",
                   zorder=3, label="skipped step")  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylim(0.05, 2e3)
        ax.set_ylabel("grad norm")
        ax.set_title(record.label, fontsize=9, loc="left")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="upper center", ncol=4, frameon=False)
    loss_ax = axes[-1]
    for record in [baseline, *records]:
        style = {"color": "black", "ls": ":"} if record is baseline else {}
        loss_ax.plot(steps, record.loss, lw=1.0, label=record.label, **style)
    loss_ax.set_yscale("log")
    loss_ax.set_ylim(0.04, 3.0)  # the unclipped run leaves the top at its first spike
    loss_ax.set_ylabel("held-out loss")
    loss_ax.set_xlabel("step")
    loss_ax.legend(fontsize=7, loc="upper right", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})  # no version stamp: the same bytes each run
    plt.close(fig)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> list[Record]:
    """Train every setting, print their summaries, plot them; return their records, the
    unclipped baseline's first."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=Path("adaptive-out/adaptive_thresholds.png"))
    args = parser.parse_args(argv)
    # One thread: this model is too small to gain from more, and where other jobs keep the
    # cores busy, threads that wait on each other made the run six to ten times slower
    # (48 to 82 s against 8 s on 2 busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        baseline, *records = [train(setting) for setting in (UNCLIPPED, *SETTINGS)]
    finally:
        torch.set_num_threads(threads)  # as it was for the caller (the test suite's process)
    for record in [baseline, *records]:
        print(
            f"{record.label:28s} clipped {record.clipped:3d}  skipped {record.skipped:3d}  "
            f"held-out loss {record.loss[0]:.4f} -> {min(record.loss):.4f} (best) "
            f"-> {record.loss[-1]:.4f} (last)"
        )
    plot(records, baseline, args.plot)
    return [baseline, *records]


if __name__ == "__main__":
    main()
