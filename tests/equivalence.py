"""The yardstick every parallel test uses: train a model a few steps and compare with the single-process run.

`train_steps` is run both in a worker rank (on a shard of the model) and in the parent (on the whole model); it
returns the per-step losses, every parameter's full gradient after the first backward, and every full parameter
after the last optimizer step, under the parameters' global names. `assert_same` compares two such records.
"""
from __future__ import annotations

import torch

import parallel as P


def make_batch(vocab_size: int, b: int, s: int, seed: int = 0) -> torch.Tensor:
    """The global batch [b, s+1] of token ids; identical on every rank (it depends on the seed only)."""
    return torch.randint(0, vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))


def named_full(model, grid, grads=False) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.data
        if t is None:
            continue
        out[model.global_name(name) if hasattr(model, "global_name") else name] = P.gather_full(t, p, grid).clone()
    return out


def train_steps(model, grid, batch, steps: int = 2, lr: float = 1e-3, loss_fn=None, eps: float = 1e-8):
    """`steps` AdamW steps on `batch`; the loss is sum over tokens / number of tokens (DESIGN.md §2)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=eps, foreach=False)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if loss_fn is None:
            per_token = model(batch[:, :-1], labels=batch[:, 1:])  # [b, s]
            loss = per_token.sum() / per_token.numel()
        else:
            loss = loss_fn(model, batch)
        loss.backward()
        P.finalize_grads(model, grid)
        losses.append(loss.detach().clone())
        if step == 0:
            grads = named_full(model, grid, grads=True)
        opt.step()
    return dict(losses=torch.stack(losses), grads=grads, params=named_full(model, grid))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (an absolute floor of 1e-300 keeps all-zero tensors comparable)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def assert_same(got: dict, ref: dict, rtol: float, what: str = ""):
    """Losses, gradients and parameters agree to `rtol` relative; a failure names the worst tensor."""
    worst = []
    assert ref["grads"], f"{what}: the reference record has no gradients to compare"  # an empty record passes nothing
    for key in ("losses", "grads", "params"):
        if key == "losses":
            worst.append((rel_err(got[key], ref[key]), "loss"))
            continue
        assert set(got[key]) == set(ref[key]), f"{what}: {key} names differ: {set(got[key]) ^ set(ref[key])}"
        for name in ref[key]:
            assert got[key][name].shape == ref[key][name].shape, f"{what}: {key} {name} shape differs"
            worst.append((rel_err(got[key][name], ref[key][name]), f"{key[:-1]} {name}"))
    err, name = max(worst)
    assert err <= rtol, f"{what}: worst relative error {err:.3e} > {rtol:.0e} at {name}"
    return err
