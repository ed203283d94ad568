"""The frameworks page's OLMo-core recipe, run inside OLMo-core 3.0.0 (one process).

OLMo-core 3.0.0 needs ``torch<2.14``, so it cannot join the suite's venv (torch 2.14.1);
``make olmo-core-check`` runs this in a venv of its own with torch 2.13.0. It checks
that the config's ``build()`` returns the wrapper around OLMo-core's AdamW, that three
steps give torch's ``clip_grad_norm_`` + the same AdamW exactly (norm) and to rounding
(parameters), that the clip state survives torch's DCP functions with OLMo-core's
flattened layout, and that a ``SkipStepAdamW`` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from olmo_core.optim import AdamWConfig, SkipStepAdamWConfig
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import clipopt

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # as OLMo-core's checkpointer


@dataclass
class ClippedAdamWConfig(AdamWConfig):
    # A ClassVar, not a field: OptimConfig.build passes every field to AdamW(...).
    clip_max_norm: ClassVar[float] = 1.0

    def build(self, model: torch.nn.Module, strict: bool = True) -> Any:
        return clipopt.ClippedOptimizer(super().build(model, strict), self.clip_max_norm)


def main() -> None:
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
        assert torch.equal(opt.last_norm, norm), (opt.last_norm, norm)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    saved = get_optimizer_state_dict(model, opt, options=FLAT)
    fresh = ClippedAdamWConfig(lr=1e-2, weight_decay=0.1).build(model)
    set_optimizer_state_dict(model, fresh, saved, options=FLAT)
    assert int(fresh.step_count) == 3, fresh.step_count
    assert torch.equal(fresh.last_norm, opt.last_norm), (fresh.last_norm, opt.last_norm)
    try:
        clipopt.ClippedOptimizer(SkipStepAdamWConfig(lr=1e-3).build(model), 1.0)
    except TypeError as error:
        assert "skip_spikes=clipopt.SpikeSkip()" in str(error), error
    else:
        raise AssertionError("a SkipStepAdamW was wrapped")
    print(
        f"OLMo-core recipe: {type(opt).__name__} around {type(opt.optimizer).__name__}, "
        f"norm {float(opt.last_norm):.6g} as torch's, step_count {int(fresh.step_count)} and "
        "last_norm through torch's DCP functions, SkipStepAdamW refused"
    )


if __name__ == "__main__":
    main()
