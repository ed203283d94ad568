"""The frameworks page's OLMo-core recipe, run inside OLMo-core 3.0.0 (one process).

OLMo-core 3.0.0 needs ``torch<2.14``, so it cannot join the suite's venv (torch 2.14.1);
``make olmo-core-check`` runs this in a venv of its own with torch 2.13.0. It checks
that the config's ``build()`` returns the wrapper around OLMo-core's AdamW; that three
steps give torch's ``clip_grad_norm_`` + the same AdamW to 1e-6 (norm: torch 2.13.0
sums in float32 and may differ in the last bit) and to rounding (parameters); that
OLMo-core's own ``TransformerTrainModule`` (the recipe's subclass) and ``Checkpointer``
save and load the clip state, so that a resumed run is the uninterrupted one bit for
bit; and that a ``SkipStepAdamW`` is refused.
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig, SkipStepAdamWConfig
from olmo_core.train.checkpoint import Checkpointer
from olmo_core.train.train_module import TransformerTrainModule

import clipopt
from clipopt.distributed import ClippedOptimizerState


@dataclass
class ClippedAdamWConfig(AdamWConfig):
    # A ClassVar, not a field: OptimConfig.build passes every field to AdamW(...).
    clip_max_norm: ClassVar[Any] = 1.0

    def build(self, model: torch.nn.Module, strict: bool = True) -> Any:
        return clipopt.ClippedOptimizer(super().build(model, strict), self.clip_max_norm)


class ClippedTrainModule(TransformerTrainModule):
    """The train module's state dict with the clip state beside "model" and "optim"."""

    def state_dict(self, *, optim: bool | None = None) -> dict[str, Any]:
        return self._with_clip(super().state_dict(optim=optim))

    def state_dict_to_save(self, *, optim: bool | None = None) -> dict[str, Any]:
        return self._with_clip(super().state_dict_to_save(optim=optim))

    def state_dict_to_load(self, metadata: Any, *, optim: bool | None = None) -> dict[str, Any]:
        return self._with_clip(super().state_dict_to_load(metadata, optim=optim))

    def _with_clip(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if "optim" in state_dict:
            state_dict["clip"] = ClippedOptimizerState(self.optim)
        return state_dict


def check_norms() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    opt = ClippedAdamWConfig(lr=1e-2, weight_decay=0.1).build(model)
    assert isinstance(opt, clipopt.ClippedOptimizer), type(opt)
    bare = AdamWConfig(lr=1e-2, weight_decay=0.1).build(ref)
    x = torch.randn(16, 4)
    for _ in range(3):
        for net, optimizer in ((model, opt), (ref, bare)):
            optimizer.zero_grad()
            (net(x) ** 2).sum().mul(50).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        bare.step()
        opt.step()
        # clipopt sums float32 blocks in float64, torch in float32: the last bit may differ.
        assert torch.allclose(opt.last_norm, norm, rtol=1e-6, atol=0), (opt.last_norm, norm)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    print(f"norm {float(opt.last_norm):.6g} as torch's clip_grad_norm_ (1e-6)", end="; ")


def train_module() -> ClippedTrainModule:
    torch.manual_seed(0)
    model = TransformerConfig.llama_like(vocab_size=32, d_model=16, n_layers=1, n_heads=2).build()
    ClippedAdamWConfig.clip_max_norm = clipopt.AutoClip(percentile=50.0)
    return ClippedTrainModule(
        model,
        optim=ClippedAdamWConfig(lr=1e-2, weight_decay=0.1),
        rank_microbatch_size=32,
        max_sequence_length=8,
        max_grad_norm=None,  # the wrapper clips, once, on the global norm
    )


def steps(module: ClippedTrainModule, seeds: range) -> list[torch.Tensor]:
    norms = []
    for seed in seeds:
        tokens = torch.randint(32, (4, 8), generator=torch.Generator().manual_seed(seed))
        module.zero_grads()
        module.model(tokens).float().pow(2).mean().backward()
        module.optim.step()
        norms.append(module.optim.last_norm.clone())
    return norms


def check_checkpoints() -> None:
    module = train_module()
    steps(module, range(3))
    folder = tempfile.mkdtemp()
    checkpointer = Checkpointer(work_dir=folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without a 'clip' entry")  # none is lost
        checkpointer.save(f"{folder}/step3", module, {})
        resumed = train_module()
        checkpointer.load(f"{folder}/step3", resumed)
    for name in ("step_count", "last_norm"):
        ours, theirs = getattr(resumed.optim, name), getattr(module.optim, name)
        assert torch.equal(ours, theirs), (name, ours, theirs)
    norms, resumed_norms = steps(module, range(3, 6)), steps(resumed, range(3, 6))
    for a, b in zip(norms, resumed_norms, strict=True):
        assert torch.equal(a, b), (a, b)
    for a, b in zip(module.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert int(resumed.optim.step_count) == 6, resumed.optim.step_count
    print(
        "TransformerTrainModule + Checkpointer: AutoClip's state and the AdamW resume bit for "
        f"bit (step_count {int(resumed.optim.step_count)})",
        end="; ",
    )


def check_skip_step_refused() -> None:
    model = torch.nn.Linear(2, 2)
    try:
        clipopt.ClippedOptimizer(SkipStepAdamWConfig(lr=1e-3).build(model), 1.0)
    except TypeError as error:
        assert "skip_spikes=clipopt.SpikeSkip()" in str(error), error
    else:
        raise AssertionError("a SkipStepAdamW was wrapped")
    print("SkipStepAdamW refused")


def main() -> None:
    print("OLMo-core recipe:", end=" ")
    check_norms()
    check_checkpoints()
    check_skip_step_refused()


if __name__ == "__main__":
    main()
