"""The yardstick every parallel test uses: train a model a few steps and compare with the single-process run.

`train_steps` is run both in a worker rank (on a shard of the model) and in the parent (on the whole model); it
returns the per-step losses, every parameter's full gradient after the first backward, and every full parameter
after the last optimizer step, under the parameters' global names. `assert_same` compares two such records.
`clipped_steps` (a rank's stage(s), train.py's loop: P.forward_backward over micro-batches, finish_grad_sync, clipping)
and `reference_steps` (one process: torch's AdamW and clip_grad_norm_) are the same loop for the DDP / distributed
optimizer, LoRA, MoE-routing and context-parallel tests; each keeps its own model, optimizer and records.
Those comparisons run with dropout 0; `model_dropout_masks_case` and `check_dropout_streams` check the dropout masks
themselves against Megatron's RNG rule (below), in any TP x PP layout.
"""
from __future__ import annotations

import contextlib

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


def train_steps(model, grid, batch, steps: int = 2, lr: float = 1e-3, loss_fn=None, eps: float = 1e-8, muon=False):
    """`steps` AdamW steps on `batch` (muon: parallel.Muon's steps, AdamW's settings for the rest); the loss is sum
    over tokens / number of tokens (DESIGN.md §2)."""
    opt = muon_optimizer(model, grid, lr, eps) if muon else \
        torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=eps, foreach=False)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad()
        if loss_fn is None:
            per_token = model(batch[:, :-1], labels=batch[:, 1:])  # [b, s]
            loss = per_token.sum() / per_token.numel()
        else:
            loss = loss_fn(model, batch)
        loss.backward()
        P.finalize_grads(model, grid)  # (parallel.Muon's finish_grad_sync, done here for either optimizer)
        losses.append(loss.detach().clone())
        if step == 0:
            grads = named_full(model, grid, grads=True)
        opt.step()
    return dict(losses=torch.stack(losses), grads=grads, params=named_full(model, grid))


def muon_optimizer(chunks, grid, lr: float = 1e-3, eps: float = 1e-8) -> P.Muon:
    """parallel.Muon with train.py's Muon defaults, and train_steps' AdamW settings for what Muon does not take."""
    return P.Muon(chunks, grid, momentum=0.95, nesterov=True, ns_steps=5, scale=0.2, lr=lr, betas=(0.9, 0.95),
                  eps=eps, weight_decay=0.1)


def forward_step(model, mb):
    """A micro-batch's summed token loss [] on the last stage; its output hidden states on any other."""
    out = model(mb[:, :-1], labels=mb[:, 1:])
    return out.sum() if model.post_process else out


def clipped_steps(chunks, grid, opt, micro, num_tokens, shape, dtype, clip, steps, first_step, count=False):
    """train.py's loop on this rank, `steps` times: zero_grad, forward_backward over `micro` (the loss divided by the
    global `num_tokens`), finish_grad_sync, clip_grad_norm(clip), step. `first_step(log)` runs after the first
    gradient sync (log: this rank's collectives in that forward-backward when `count`, else None) and returns a dict
    of records (its gradients, ...). Returns those plus losses [steps] (every rank: the last stage's, summed over
    dp x cp) and the clipping norms [steps]."""
    losses, norms, first = [], [], {}
    for step in range(steps):
        opt.zero_grad(len(micro))
        with P.count_collectives() if count else contextlib.nullcontext() as log:
            loss = P.forward_backward(chunks, micro, forward_step, num_tokens, grid, shape, dtype)
        opt.finish_grad_sync()
        if step == 0:
            first = first_step(log)
        norms.append(opt.clip_grad_norm(clip))
        opt.step()
        losses.append(P.all_reduce(torch.as_tensor(loss, dtype=torch.float64).reshape(1), grid.dp_cp)
                      if grid.pp.rank == grid.pp_size - 1 else torch.zeros(1, dtype=torch.float64))
    return dict(first, losses=P.all_reduce(torch.cat(losses), grid.pp), norms=torch.stack(norms))


def reference_steps(model, opt, micro, num_tokens, clip, steps, after_step=None):
    """The single process: `steps` of zero_grad, forward_backward_no_pipelining, torch's clip_grad_norm_ over the
    trainable parameters, opt.step (then `after_step(model)`). Returns losses, the first step's gradients, the norms
    and the final parameters (trainable ones, by name)."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses, norms, grads = [], [], None
    for step in range(steps):
        opt.zero_grad()
        losses.append(P.forward_backward_no_pipelining(model, micro, forward_step, num_tokens).reshape(1))
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip, foreach=False))
        opt.step()
        if after_step is not None:
            after_step(model)
    return dict(losses=torch.cat(losses), grads=grads, norms=torch.stack(norms),
                params={k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (an absolute floor of 1e-300 keeps all-zero tensors comparable)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


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


# --------------------------------------------------------------------------------------- dropout streams
# Megatron's RNG rule (DESIGN.md §2; megatron/core/tensor_parallel/random.py, training/initialize.py): the default
# stream is seeded seed + 100·pp_rank (same on every TP and DP rank); the model-parallel stream seed + 100·pp_rank +
# 2718 + tp_rank. Hidden dropout on replicated activations draws from the default stream; under sequence
# parallelism the activations are sequence shards and every hidden dropout (the embedding's included) draws from
# the model-parallel stream. With rope (no nn.Embedding positions) building a model draws nothing from the default
# stream (every parameter is initialized from its own generator), so a stage's masks in its first forward are
# exactly the first draws of those streams, which `megatron_masks` makes with a torch.Generator of that seed.
DROPOUT_CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                   vocab_size=101, max_position_embeddings=16, position_embedding_type="rope",
                   normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
                   hidden_dropout=0.5, attention_dropout=0.0, params_dtype=torch.float64, seed=1234)


class _NoStageOffset(P.RNGTracker):
    """Negative control: a tracker that forgets the 100·pp_rank offset (every stage draws the same streams)."""

    def __init__(self, seed, grid=None):
        super().__init__(seed, grid)
        self.seed = seed
        torch.manual_seed(seed)
        self.seeds = {"model-parallel-rng": seed + 2718 + (grid.tp.rank if grid is not None else 0)}


def model_dropout_masks_case(rank, n, tp, pp, sp, b=2, s=8, no_stage_offset=False, pos="rope"):
    """One training-mode forward of this rank's stage of a GPT with hidden dropout 0.5; returns its TP and PP rank
    and the keep-mask of every hidden dropout it ran, in order (parallel.dropout is wrapped to record them).
    pos: the position embedding type; "learned_absolute" takes the embedding's other path (positions added to the
    whole sequence, then split to shards under SP). Its nn.Embedding draws its initial weights from the default
    stream, so only the model-parallel stream's masks (SP) are still that stream's first draws."""
    import gpt

    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp))
    c = gpt.Config(**dict(DROPOUT_CFG, position_embedding_type=pos), sequence_parallel=sp)
    real_tracker = P.RNGTracker
    P.RNGTracker = _NoStageOffset if no_stage_offset else real_tracker
    try:
        (model,) = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers,
                                  grid)
    finally:
        P.RNGTracker = real_tracker
    model.train()
    masks, real = [], P.dropout

    def recording(x, p, training, rng=None, sharded=False):
        y = real(x, p, training, rng, sharded)
        if p > 0 and training:
            assert (x != 0).all(), "a zero activation would hide the mask"
            masks.append(y != 0)
        return y

    batch = make_batch(c.vocab_size, b, s, seed=3)
    P.dropout = recording
    try:
        if not model.pre_process:  # an inner stage's input: hidden states [s(/tp), b, h]
            shape = (s // tp if model.config.sequence_parallel else s, b, c.hidden_size)
            model.input_tensor = torch.randn(shape, dtype=c.params_dtype, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            model(batch[:, :-1], labels=batch[:, 1:] if model.post_process else None)
    finally:
        P.dropout = real
    return dict(tp=grid.tp.rank, pp=grid.pp.rank, masks=masks, drops=int(model.pre_process) + 2 * len(model.decoder.layers))


def megatron_masks(seed: int, like: list[torch.Tensor], p: float = 0.5) -> list[torch.Tensor]:
    """The keep-masks F.dropout(·, p) draws from a stream seeded `seed`, one per tensor of `like`, in turn."""
    g = torch.Generator().manual_seed(seed)
    return [torch.empty(m.shape, dtype=DROPOUT_CFG["params_dtype"]).bernoulli_(1 - p, generator=g) != 0 for m in like]


def check_dropout_streams(results: list[dict], sp: bool):
    """The recorded masks against Megatron's rule: TP ranks of a stage agree without SP and differ with it,
    pipeline stages differ, and every mask is the draw of the stream the rule names."""
    seed = DROPOUT_CFG["seed"]
    by = {(r["pp"], r["tp"]): r["masks"] for r in results}
    for r in results:  # the embedding's (first stage) and two per layer
        assert len(r["masks"]) == r["drops"], f"stage {r['pp']} tp rank {r['tp']}: {len(r['masks'])} hidden dropouts"
    for (pp, tp), masks in by.items():
        for i, (a, b) in enumerate(zip(masks, by[pp, 0]) if tp > 0 else ()):
            if sp:
                assert not torch.equal(a, b), (f"stage {pp}: under SP, TP ranks 0 and {tp} drew the same mask for "
                                               f"hidden dropout #{i} on their sequence shards")
            else:
                assert torch.equal(a, b), (f"stage {pp}: TP ranks 0 and {tp} drew different masks for hidden "
                                           f"dropout #{i} on replicated activations")
        if pp > 0:
            assert not torch.equal(masks[0], by[0, tp][0]), f"pipeline stages 0 and {pp} drew the same dropout masks"
    for (pp, tp), masks in by.items():  # and exactly the draws the rule names
        stream = seed + 100 * pp + (2718 + tp if sp else 0)
        want = megatron_masks(stream, masks)
        for i, (got, exp) in enumerate(zip(masks, want)):
            assert torch.equal(got, exp), (f"stage {pp} tp rank {tp}: hidden dropout #{i} is not the draw of the "
                                           f"{'model-parallel' if sp else 'default'} stream seeded {stream}")
