"""ClippedOptimizer inside the real frameworks: Lightning, Accelerate, the Hugging Face
Trainer and TensorBoard, at the versions constraints.txt pins.

Each framework's loop must train with the wrapper (the loss falls), schedule it (the lr
follows the scheduler step by step) and checkpoint and resume it bit-exactly with the
framework's own checkpointing. The double-clipping tests show the hazard the docs warn
about: a framework that clips before ``opt.step()`` hides the true norm from the
wrapper, and the recommended setting gives it back.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from example_modules import load_example

import clipopt

pytestmark = pytest.mark.integrations

lightning = pytest.importorskip("lightning")
accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tensorboard")

# A clipped norm is max_norm * (norm / (norm + 1e-6)), a hair below max_norm.
CLIP_SLACK = 1e-5


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Frameworks warn about CPU-only runs, missing workers and the like: noise here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def scheduled_lrs(
    lr: float, steps: int, make: Callable[[torch.optim.Optimizer], Any]
) -> list[float]:
    """The lr of each of ``steps`` steps under the scheduler ``make`` builds, on a bare SGD."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def assert_same_clip_state(a: clipopt.ClippedOptimizer, b: clipopt.ClippedOptimizer) -> None:
    assert a.last_norm is not None and b.last_norm is not None
    assert torch.equal(a.last_norm, b.last_norm)
    assert torch.equal(a.step_count, b.step_count)
    assert a.param_groups[0]["lr"] == b.param_groups[0]["lr"]


# Lightning -----------------------------------------------------------------------------


class TrueNorms(lightning.pytorch.Callback):
    """The grad norm each step had before anything clipped it.

    ``on_before_optimizer_step`` runs inside Lightning's closure after backward and
    before Lightning's own ``gradient_clip_val`` clipping.
    """

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(clipopt.get_total_norm(grads).item())


class ClippedNorms(lightning.pytorch.Callback):
    """The grad norm each step left behind (Lightning zeroes grads at the next step)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(clipopt.get_total_norm(grads).item())


def fit_lightning(
    root: Path, steps: int, ckpt_path: Path | None = None, **overrides: Any
) -> tuple[Any, Any]:
    example = load_example("lightning_example")
    lightning.seed_everything(0, verbose=False)
    model = example.Regressor(total_steps=8)
    trainer = example.trainer(root, steps, **overrides)
    trainer.fit(model, example.loader(), ckpt_path=ckpt_path)
    return model, trainer


def test_lightning_trains_and_schedules_the_wrapper(tmp_path: Path) -> None:
    model, trainer = fit_lightning(tmp_path, 8)
    history = model.history
    assert len(history) == 8 and int(model.clipped_optimizer().step_count) == 8
    assert history[-1]["loss"] < history[0]["loss"] / 2, history
    expected = scheduled_lrs(3e-2, 8, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 8))
    assert [row["lr"] for row in history] == pytest.approx(expected, rel=1e-12)
    assert float(trainer.logged_metrics["grad_norm"]) == pytest.approx(history[-1]["grad_norm"])


def test_lightning_checkpoint_resumes_bit_exactly(tmp_path: Path) -> None:
    # Saved where an epoch (4 batches) ends: from a checkpoint inside an epoch, Lightning
    # 2.6.6 restarts a plain DataLoader at its first batch, which no optimizer can undo.
    every_epoch = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", every_n_train_steps=4, save_top_k=-1
    )
    straight, _ = fit_lightning(
        tmp_path / "straight", 8, callbacks=[every_epoch], enable_checkpointing=True
    )
    ckpt = tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"
    saved = torch.load(ckpt, weights_only=True)["optimizer_states"][0]
    assert int(saved["clip"]["step_count"]) == 4
    resumed, _ = fit_lightning(tmp_path / "resumed", 8, ckpt_path=ckpt)
    assert len(resumed.history) == 4
    assert_same_params(straight, resumed)
    assert_same_clip_state(straight.clipped_optimizer(), resumed.clipped_optimizer())


@pytest.mark.parametrize("gradient_clip_val", [1.0, None])
def test_lightning_gradient_clip_val_hides_the_norm_from_the_wrapper(
    tmp_path: Path, gradient_clip_val: float | None
) -> None:
    true, left = TrueNorms(), ClippedNorms()
    model, _ = fit_lightning(
        tmp_path, 8, gradient_clip_val=gradient_clip_val, callbacks=[true, left]
    )
    seen = [row["grad_norm"] for row in model.history]
    max_norm = model.clipped_optimizer().defaults["clip_max_norm"]
    assert max_norm > 1.0 and sum(n > max_norm for n in true.norms) >= 2, true.norms
    if gradient_clip_val is not None:
        # Lightning clipped first: the wrapper saw at most 1.0, never clipped anything.
        assert max(seen) <= gradient_clip_val + CLIP_SLACK, seen
        assert left.norms == pytest.approx([min(n, gradient_clip_val) for n in true.norms])
    else:
        assert seen == pytest.approx(true.norms, rel=1e-6)
        assert left.norms == pytest.approx([min(n, max_norm) for n in true.norms], rel=1e-5)


# Accelerate ----------------------------------------------------------------------------


def accelerate_run(steps: int, state_in: Path | None = None) -> tuple[Any, Any, list[Any]]:
    """``steps`` steps on freshly prepared parts, after loading ``state_in`` if given."""
    example = load_example("accelerate_example")
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt, sched, data = example.parts(8, accelerator)
    if state_in is not None:
        accelerator.load_state(str(state_in))
    history = example.train(model, opt, sched, data, accelerator, steps)
    return model, opt, [accelerator, sched, history]


def test_accelerate_trains_and_schedules_the_wrapper() -> None:
    example = load_example("accelerate_example")
    _, opt, (_, _, history) = accelerate_run(8)
    assert isinstance(opt, accelerate.optimizer.AcceleratedOptimizer)
    assert int(example.unwrap(opt).step_count) == 8
    assert history[-1]["loss"] < history[0]["loss"] / 2, history
    expected = scheduled_lrs(3e-2, 8, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 8))
    assert [row["lr"] for row in history] == pytest.approx(expected, rel=1e-12)
    assert sum(row["grad_norm"] > example.MAX_NORM for row in history) >= 2


def test_accelerate_save_state_resumes_bit_exactly(tmp_path: Path) -> None:
    example = load_example("accelerate_example")
    straight, straight_opt, _ = accelerate_run(8)
    _, _, (accelerator, _, _) = accelerate_run(4)
    accelerator.save_state(str(tmp_path))
    # One epoch is 4 batches, so the resumed loop starts a fresh pass, as the first did.
    resumed, resumed_opt, _ = accelerate_run(4, state_in=tmp_path)
    assert_same_params(straight, resumed)
    assert_same_clip_state(example.unwrap(straight_opt), example.unwrap(resumed_opt))


# Hugging Face Trainer ------------------------------------------------------------------


def grad_norms_logged(trainer: Any) -> list[float]:
    """The norm the Trainer computes itself and logs as ``grad_norm`` each step."""
    return [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]


def test_hf_trainer_default_max_grad_norm_is_one_and_disabled_by_zero(tmp_path: Path) -> None:
    # The recommended setting depends on this version's semantics: `> 0` clips.
    assert transformers.TrainingArguments(output_dir=str(tmp_path)).max_grad_norm == 1.0
    example = load_example("hf_trainer_example")
    trainer, _ = example.build(tmp_path, 1)
    assert trainer.args.max_grad_norm == 0.0


def test_hf_trainer_trains_schedules_and_resumes_bit_exactly(tmp_path: Path) -> None:
    example = load_example("hf_trainer_example")
    straight, record = example.build(tmp_path / "straight", 8)
    straight.train()
    losses = example.losses(straight)
    assert losses[-1] < losses[0] - 0.2, losses
    expected = scheduled_lrs(
        3e-3, 8, lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.1, total_iters=8)
    )
    assert [row["lr"] for row in record.steps] == pytest.approx(expected, rel=1e-12)
    # With max_grad_norm=0 the Trainer still measures (never clips): the same norm.
    wrapper_norms = [row["grad_norm"] for row in record.steps]
    assert grad_norms_logged(straight) == pytest.approx(wrapper_norms, rel=1e-5)

    first, _ = example.build(tmp_path / "first", 8, save_strategy="steps", save_steps=4)
    first.train()
    checkpoint = tmp_path / "first" / "checkpoint-4"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert int(saved["clip"]["step_count"]) == 4
    resumed, resumed_record = example.build(tmp_path / "resumed", 8)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert len(resumed_record.steps) == 4
    assert resumed_record.steps == record.steps[4:]
    assert_same_params(straight.model, resumed.model)
    assert_same_clip_state(example.unwrap(straight.optimizer), example.unwrap(resumed.optimizer))


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_hf_trainer_max_grad_norm_hides_the_norm_from_the_wrapper(
    tmp_path: Path, max_grad_norm: float
) -> None:
    example = load_example("hf_trainer_example")
    trainer, record = example.build(tmp_path, 8, max_grad_norm=max_grad_norm)
    trainer.train()
    true_norms = grad_norms_logged(trainer)  # taken before the Trainer's clip
    seen = [row["grad_norm"] for row in record.steps]
    left = [row["clipped_norm"] for row in record.steps]
    assert example.MAX_NORM > 1.0 and sum(n > example.MAX_NORM for n in true_norms) >= 2
    if max_grad_norm:
        assert max(seen) <= max_grad_norm + CLIP_SLACK, seen
        assert left == pytest.approx([min(n, max_grad_norm) for n in true_norms], rel=1e-5)
    else:
        assert seen == pytest.approx(true_norms, rel=1e-5)
        assert left == pytest.approx([min(n, example.MAX_NORM) for n in true_norms], rel=1e-5)


# TensorBoard ---------------------------------------------------------------------------


def test_tensorboard_event_file_has_the_clip_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    example = load_example("tensorboard_logging")
    clipped = example.train(tmp_path, 12)
    events = EventAccumulator(str(tmp_path))
    events.Reload()

    def values(tag: str) -> list[float]:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == list(range(12)), tag
        return [s.value for s in scalars]

    norms, thresholds, flags = (values(f"clip/{t}") for t in ("grad_norm", "max_norm", "clipped"))
    assert thresholds == [example.MAX_NORM] * 12
    assert flags == [float(n > example.MAX_NORM) for n in norms]
    assert 0 < clipped == sum(flags) < 12
    losses = values("loss")
    assert losses[-1] < losses[0] and all(math.isfinite(n) for n in norms)
