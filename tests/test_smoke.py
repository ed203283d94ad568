import torch

import clipopt


def test_clip_grad_norm_matches_torch_on_linear() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 5)
    model(torch.randn(3, 10)).sum().mul(100).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    ours = clipopt.clip_grad_norm_(model.parameters(), 1.0)
    ours_grads = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.testing.assert_close(ours, theirs)
    for p, g in zip(model.parameters(), ours_grads, strict=True):
        torch.testing.assert_close(g, p.grad)
