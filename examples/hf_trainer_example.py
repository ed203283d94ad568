"""Train a tiny GPT-2 with the Hugging Face Trainer, clipping with ClippedOptimizer.

The model is built from a config (nothing is downloaded) and learns a synthetic
sequence of token ids. The Trainer gets the wrapper and a scheduler through
``optimizers=(...)`` and ``max_grad_norm=0``: left at its default of 1.0 the Trainer
clips first, so the wrapper would measure the already-clipped norm and its own
``max_norm`` above 1.0 would never apply. The run stops at a checkpoint, and a fresh
Trainer resumes from it with ``resume_from_checkpoint``.
Run it with ``python examples/hf_trainer_example.py [--output-dir DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

import clipopt

# Above the Trainer's default max_grad_norm of 1.0, which would hide it, and below the
# norms of some of this model's steps, so the wrapper clips them.
MAX_NORM = 1.25
VOCAB = 64
SEQ_LEN = 16


class CountingSequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sequences ``start, start + 1, ...`` modulo the vocabulary: a pattern to learn."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(SEQ_LEN) + index * 7) % VOCAB
        return {"input_ids": ids, "labels": ids}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_layer=2,
        n_head=2,
        n_embd=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    # transformers reads the loss from the class name, in which GPT2LMHeadModel does not say
    # "ForCausalLM": it warned and guessed the right loss, but the Trainer, not told that
    # this loss shifts the labels, counted each row's first label as a target, so the
    # logged loss and the grads came out 15/16 of the true ones (SEQ_LEN - 1 of SEQ_LEN).
    model.loss_type = "ForCausalLM"
    return model


def unwrap(opt: Any) -> clipopt.ClippedOptimizer:
    """The ClippedOptimizer inside the AcceleratedOptimizer the Trainer steps."""
    while not isinstance(opt, clipopt.ClippedOptimizer):
        opt = opt.optimizer
    return opt


class RecordClipping(TrainerCallback):
    """Keeps the wrapper's pre-clip norm, the norm it left and the lr of every step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        opt = unwrap(kwargs["optimizer"])
        assert opt.last_norm is not None
        grads = [p.grad for p in kwargs["model"].parameters() if p.grad is not None]
        self.steps.append(
            {
                "grad_norm": opt.last_norm.item(),
                "clipped_norm": clipopt.get_total_norm(grads).item(),
                "lr": opt.param_groups[0]["lr"],
            }
        )


def build(
    output_dir: Path, max_steps: int, max_grad_norm: float = 0.0, **args: Any
) -> tuple[Trainer, RecordClipping]:
    """A Trainer over a fresh model, wrapper and scheduler."""
    model = tiny_gpt2()
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), MAX_NORM)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=max_steps)
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": max_steps,
        "per_device_train_batch_size": 8,
        # 0 disables the Trainer's clipping in this version (it tests `> 0`; None fails).
        "max_grad_norm": max_grad_norm,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    training_args = TrainingArguments(**(settings | args))
    record = RecordClipping()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=CountingSequences(),
        optimizers=(opt, sched),
        callbacks=[record],
    )
    return trainer, record


@contextlib.contextmanager
def no_save_progress_bar() -> Iterator[None]:
    """Without the "Writing model shards" progress bar of each save, which
    ``disable_tqdm`` does not reach: harmless, and the checkpoint is one small file."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def tied_head_not_reported_missing(model: torch.nn.Module) -> Iterator[None]:
    """Without the Trainer's "There were missing keys in the checkpoint model loaded:
    ['lm_head.weight']" while it resumes ``model``, as long as that warning is harmless.

    GPT-2's head is the token embedding's very tensor (tied), so the checkpoint stores it
    once, under the embedding's name, and loading that fills the head too. The Trainer
    warns because it expects such keys in ``_keys_to_ignore_on_save``, which GPT-2 leaves
    empty (it declares the tie in ``_tied_weights_keys``). The warning is dropped only
    while the head is still the embedding's tensor.
    """
    expected = "There were missing keys in the checkpoint model loaded: ['lm_head.weight']."

    def harmless(record: logging.LogRecord) -> bool:
        tied = model.get_parameter("lm_head.weight") is model.get_parameter(
            "transformer.wte.weight"
        )
        return not (tied and record.getMessage() == expected)

    trainer_logger = logging.getLogger("transformers.trainer")
    trainer_logger.addFilter(harmless)
    try:
        yield
    finally:
        trainer_logger.removeFilter(harmless)


def losses(trainer: Trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", type=Path, help="checkpoints go here (default: temp)")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or Path(tmp)
        half = args.steps // 2
        with no_save_progress_bar():
            first, _ = build(out, args.steps, save_strategy="steps", save_steps=half)
            first.train()
        # The resumed run saves nothing, but the Trainer warns when its save_steps differs
        # from the checkpoint's.
        resumed, record = build(out / "resumed", args.steps, save_steps=half)
        assert resumed.model is not None
        with tied_head_not_reported_missing(resumed.model):
            resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{half}"))
        steps, norm = int(unwrap(resumed.optimizer).step_count), record.steps[-1]["grad_norm"]
        print(f"first run: loss {losses(first)[0]:.4f} -> {losses(first)[-1]:.4f}")
        print(
            f"resumed at step {half}: {len(record.steps)} more steps to {losses(resumed)[-1]:.4f}"
        )
        print(f"wrapper steps {steps}, last grad norm {norm:.4f}")


if __name__ == "__main__":
    main()
