"""Write ``format_2_adamw_zclip.pt``: a checkpoint of format 2 of the ``"clip"`` entry.

The run of ``make_format_1.py`` (AdamW with ``ZClip``, the same seeded grads and steps),
by the version that writes format 2, which adds the clip readouts: what the wrapper
reports (``"recorded"``, ``"continued"``) includes ``last_clipped_norm``,
``last_clipped`` and the wrapper's ``clipped_count``. ``tests/test_checkpoint.py`` loads
it with ``weights_only=True``. Run from the repository root,
``python tests/data/make_format_2.py``, only when the format changes.
"""

from __future__ import annotations

from pathlib import Path

import make_format_1
from torch import Tensor

import clipopt

PATH = Path(__file__).with_name("format_2_adamw_zclip.pt")


def readouts(opt: clipopt.ClippedOptimizer) -> dict[str, Tensor]:
    """What the wrapper reports, copied."""
    rule = opt.rule
    assert rule is not None and rule.last_threshold is not None
    values = {
        "step_count": opt.step_count,
        "skip_count": opt.skip_count,
        "last_norm": opt.last_norm,
        "last_threshold": rule.last_threshold,
        "last_clipped_norm": opt.last_clipped_norm,
        "last_clipped": opt.last_clipped,
        "clipped_count": opt.clipped_count,
    }
    assert all(v is not None for v in values.values())
    return {k: v.clone() for k, v in values.items() if v is not None}


if __name__ == "__main__":
    make_format_1.main(PATH, readouts)
