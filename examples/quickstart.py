"""Train a small regression model on synthetic data with ClippedOptimizer.

Every ``opt.step()`` clips the gradient norm to ``max_norm`` before AdamW updates the
weights; the pre-clip norm of the step is ``opt.last_norm``.
"""

import torch

import clipopt


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    max_norm = 25.0
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-2), max_norm)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    inputs = torch.randn(256, 16)
    targets = inputs @ torch.randn(16, 1) * 3.0
    for step in range(20):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        assert opt.last_norm is not None
        norm = opt.last_norm.item()  # printing is the only reason to read it on the host
        clipped = "clipped" if norm > max_norm else "kept"
        print(f"step {step:2d}  loss {loss.item():9.4f}  grad norm {norm:8.4f}  {clipped}")
    print(f"{int(opt.step_count)} steps, final lr {sched.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
