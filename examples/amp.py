"""ClippedOptimizer under autocast and ``torch.amp.GradScaler``: the clip sees true grads.

One command, a few seconds on a CPU: ``python examples/amp.py`` (``--device cuda`` on a
GPU; the default is CUDA when there is one). On CUDA the forward runs under float16
autocast; on CPU under bfloat16 autocast. Either way the loss goes through a
``GradScaler``, which multiplies it by a large scale before ``backward()``, so the grads
``backward()`` leaves are the true grads times that scale.

``ClippedOptimizer`` declares ``_step_supports_amp_scaling = False``, so
``scaler.step(opt)`` unscales the grads *before* it calls ``opt.step()``: the wrapper clips
the true grads, and ``opt.last_norm`` is the true, unscaled norm. Every step this script
checks that: it copies the scaled grads, divides them by the scale itself, takes their
norm with ``clipopt.get_total_norm`` and compares it with ``last_norm`` bit for bit (the
scale is a power of two, so dividing by it is exact). It also shows what the norm of the
scaled grads was: what a clip placed before ``scaler.step`` without ``unscale_`` sees.

On CPU a scaler is not needed for bfloat16 (its range is float32's); it runs here so that
the same lines run on both devices.
"""

from __future__ import annotations

import argparse

import torch

import clipopt

MAX_NORM = 0.25


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    device = args.device
    dtype = torch.float16 if device == "cuda" else torch.bfloat16

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)
    ).to(device)
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), MAX_NORM)
    scaler = torch.amp.GradScaler(device)
    print(f"device {device}, autocast {str(dtype).removeprefix('torch.')}, max_norm {MAX_NORM}")

    data = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=data).to(device)
    y = torch.randn(256, 8, generator=data).to(device) * 3.0
    for step in range(args.steps):
        with torch.autocast(device, dtype=dtype):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()

        # Not needed for training: the reference the check below compares with.
        scale = scaler.get_scale()
        scaled = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        scaled_norm = clipopt.get_total_norm(scaled).item()
        true_norm = clipopt.get_total_norm([g / scale for g in scaled])

        scaler.step(opt)  # unscales the grads, then opt.step() clips and steps
        scaler.update()
        assert opt.last_norm is not None
        exact = torch.equal(opt.last_norm, true_norm)
        after = clipopt.get_total_norm(p.grad for p in model.parameters()).item()
        print(
            f"step {step:2d}  loss {loss.item():7.4f}  scale {scale:6.0f}  "
            f"scaled-grad norm {scaled_norm:9.1f}  last_norm {opt.last_norm.item():.4f}  "
            f"clipped to {after:.4f}  unscaled norm matches: {exact}"
        )
        if not exact:
            raise SystemExit("last_norm is not the norm of the unscaled grads")
    print(f"{int(opt.step_count)} steps, every clip on the unscaled grads")


if __name__ == "__main__":
    main()
