"""Train a small regression model on synthetic data, clipping with clipopt each step."""

import torch

import clipopt


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = torch.randn(256, 16)
    targets = inputs @ torch.randn(16, 1) * 3.0
    max_norm = 5.0
    for step in range(20):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        norm = clipopt.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        clipped = "clipped" if norm > max_norm else "kept"
        print(f"step {step:2d}  loss {loss.item():9.4f}  grad norm {norm.item():8.4f}  {clipped}")


if __name__ == "__main__":
    main()
