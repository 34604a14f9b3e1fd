"""Muon (`--optimizer muon`, parallel.Muon): the Newton-Schulz orthogonalization against its definition
on the singular values, one step against the formula, and every layout against the single process.

Tolerances: float64 throughout. The orthogonalization against the SVD: 1e-10 relative (the SVD's own rounding). The
layouts: 1e-10 relative, as the AdamW layouts (tests/test_data_parallel.py): reduction order only, since each rank
orthogonalizes the whole matrix (its TP shards all-gathered) and keeps its own shard.
"""
from __future__ import annotations

import pytest
import torch
from test_data_parallel import CLIP, LLAMA, OPT, full_grads, merge
from test_moe import MOE

import arguments
import gpt
import parallel as P
import train
from equivalence import assert_same, clipped_steps, make_batch, reference_steps, rel_err

MUON = dict(momentum=0.95, nesterov=True, ns_steps=5, scale=0.2)


def quintic_on_singular_values(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The oracle: g = U·S·Vᵀ (SVD), each singular value s/‖g‖_F through a·s + b·s³ + c·s⁵ `steps` times."""
    a, b, c = P.NS_COEFFICIENTS
    u, s, vt = torch.linalg.svd(g, full_matrices=False)
    s = s / g.norm()
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag(s) @ vt


@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16)])
def test_newton_schulz_is_the_quintic_on_the_singular_values(shape):
    g = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = P.newton_schulz(g, steps=5, eps=0.0)
    assert rel_err(got, quintic_on_singular_values(g, 5)) < 1e-10
    # negative control: one iteration fewer is another matrix
    assert rel_err(got, quintic_on_singular_values(g, 4)) > 1e-2
    s = torch.linalg.svdvals(got)
    assert 0.6 < s.min() and s.max() < 1.3  # roughly orthogonal: what Muon is for


def test_one_step_is_the_formula():
    """A single process's first step: Muon's matrices follow p·(1 - lr·wd) - lr·0.2·√max(r, c)·NS(G + μ·G); the
    embedding (tied output) and the norms follow torch's AdamW."""
    cfg = dict(LLAMA, share_embeddings_and_output_weights=True)
    model = gpt.Model(gpt.Config(**cfg))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = P.Muon(model, None, **MUON, **OPT)
    batch = make_batch(cfg["vocab_size"], 4, 8, 5)
    opt.zero_grad()
    (model(batch[:, :-1], labels=batch[:, 1:]).mean()).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    lr, wd, mu = OPT["lr"], OPT["weight_decay"], MUON["momentum"]
    muon_names = [k for k, p in model.named_parameters() if P.muon_eligible(p)]
    assert muon_names and all("embedding" not in k for k in muon_names)
    assert {k.split(".")[-2] for k in muon_names} == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    for k, p in model.named_parameters():
        if k in muon_names:
            g = grads[k]
            want = before[k] * (1 - lr * wd) - lr * 0.2 * max(g.shape) ** 0.5 * P.newton_schulz(g + mu * g)
        else:  # AdamW's first step: m/√v = sign(g) (bias-corrected), decay on matrices only
            want = before[k] * (1 - lr * wd * (p.dim() > 1)) - lr * grads[k] / (grads[k].abs() + OPT["eps"])
        assert rel_err(p.detach(), want) < 1e-10, k


def muon_case(rank, n, tp, pp, sp, cfg=LLAMA, ep=1, etp=None, ddp=None, blockwise=False, b=8, s=8, steps=3, M=2):
    """n ranks at tp x pp x dp (x ep), train.py's loop (clipped_steps) with Muon: parallel.Muon on whole parameters,
    or with ddp ("overlap": DDP's all-reduced buckets; "distopt": its DP slices) parallel.DistributedMuon. blockwise:
    the negative control, each rank orthogonalizing its own shard alone (no all-gather)."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp), ep=ep, etp=etp)
    c = gpt.Config(**cfg, sequence_parallel=sp)
    chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid, 1)
    buffers = ddp and P.DDP(chunks, grid, bucket_size=3000, overlap=True, distributed_optimizer=ddp == "distopt")
    opt = P.DistributedMuon(buffers, **MUON, **OPT) if buffers else P.Muon(chunks, grid, **MUON, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].chunk(M))
    shape = (s // tp if sp and tp > 1 else s, micro[0].shape[0], c.hidden_size)
    if blockwise:  # the optimizer's step without the grid: no all-gather, each shard orthogonalized as it is
        step = opt.step

        def alone():  # (AdamW's parameters have no TP collective in their step either)
            opt.grid = None
            step()
            opt.grid = grid
        opt.step = alone
    grads = (lambda _: dict(grads=full_grads(chunks, buffers, grid))) if buffers else \
        (lambda _: dict(grads={m.global_name(k): P.gather_full(p.grad, p, grid).clone()
                               for m in chunks for k, p in m.named_parameters()}))
    out = clipped_steps(chunks, grid, opt, micro, batch[:, 1:].numel(), shape, c.params_dtype, CLIP, steps, grads)
    params = {m.global_name(k): P.gather_full(p.data, p, grid) for m in chunks for k, p in m.named_parameters()
              if not k == "output_layer.weight" or not c.share_embeddings_and_output_weights}
    return dict(out, params=params)


def reference(cfg=LLAMA, b=8, s=8, steps=3, M=2):
    model = gpt.Model(gpt.Config(**cfg))
    opt = P.Muon(model, None, **MUON, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    return reference_steps(model, opt, list(batch.chunk(M)), batch[:, 1:].numel(), CLIP, steps)


LAYOUTS = {  # name: (ranks, tp, pp, sp, ddp); dp = ranks / (tp·pp)
    "tp2-sp": (2, 2, 1, True, None), "tp2-sp-dp2": (4, 2, 1, True, None), "pp2-dp2": (4, 1, 2, False, None),
    "dp2": (2, 1, 1, False, None), "dp2-overlap": (2, 1, 1, False, "overlap"),
    "tp2-sp-dp2-distopt": (4, 2, 1, True, "distopt"), "pp2-dp2-distopt": (4, 1, 2, False, "distopt"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_muon_in_any_layout_equals_single_process(pool, name):
    n, tp, pp, sp, ddp = LAYOUTS[name]
    got, ref = merge(pool.run(muon_case, n, tp=tp, pp=pp, sp=sp, ddp=ddp)), reference(M=2 * n // (tp * pp))
    assert_same(got, ref, rtol=1e-10, what=f"muon {name}")
    assert rel_err(got["norms"], ref["norms"]) < 1e-10


MOE_LAYOUTS = {  # name: (tp, ep, etp, sp, ddp) on 4 ranks; experts' matrices are Muon's too, the router's as well
    "ep2-edp2-distopt": (1, 2, 1, False, "distopt"), "tp2-sp-ep2-etp2": (2, 2, 2, True, None),
    "tp2-ep2-etp1-distopt": (2, 2, 1, False, "distopt"),
}


@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_muon_with_experts_equals_single_process(pool, name):
    tp, ep, etp, sp, ddp = MOE_LAYOUTS[name]
    got = merge(pool.run(muon_case, 4, tp=tp, pp=1, sp=sp, cfg=MOE, ep=ep, etp=etp, ddp=ddp))
    ref = reference(cfg=MOE, M=2 * 4 // tp)
    assert_same(got, ref, rtol=1e-10, what=f"muon {name}")


def test_orthogonalizing_each_tp_shard_alone_is_not_the_single_process(pool):
    """The negative control: Megatron's 'blockwise' shortcut (each TP rank orthogonalizes its shard) is another
    optimizer; the all-gather is what makes TP exact."""
    got, ref = merge(pool.run(muon_case, 2, tp=2, pp=1, sp=True, blockwise=True)), reference()
    with pytest.raises(AssertionError, match="linear_"):
        assert_same(got, ref, rtol=1e-10, what="blockwise")


@pytest.mark.parametrize("flags, error", [
    (["--task", "sft"], "--optimizer muon is for pretraining whole weights .*not --task sft"),
    (["--lora-rank", "4", "--pretrained-checkpoint", "BASE"], "not LoRA's adapters"),
    (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec low is not represented here"),
])
def test_muon_refuses_what_it_does_not_do(flags, error):
    with pytest.raises(arguments.ConfigError, match=error):
        arguments.check_args(arguments.parse_args(["--optimizer", "muon", *flags]), world=1)


def test_medium_precision_runs_a_float32_update_in_bfloat16_and_leaves_float64_alone(monkeypatch):
    """--muon-fp32-matmul-prec medium: a float32 update's Newton-Schulz in bfloat16 (the same function on the update
    rounded to it) where the device multiplies bfloat16 natively, else as high (torch's "medium"); float64 is
    untouched, as Megatron's fp32 matmul precision leaves it; train.py passes the flag."""
    monkeypatch.setattr(P, "fast_bfloat16", lambda device: True)  # (this host's answer is P.fast_bfloat16's own)
    p = torch.nn.Parameter(torch.empty(24, 40))
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(5))
    medium, high = (P.orthogonalized(g, p, None, 5, 0.2, prec) for prec in ("medium", "high"))
    scale = 0.2 * 40 ** 0.5
    assert medium.dtype == torch.float32 and torch.equal(medium, P.newton_schulz(g.bfloat16(), 5).float() * scale)
    assert torch.equal(high, P.newton_schulz(g, 5) * scale)
    assert rel_err(medium, high) > 1e-2  # not the same matrix (the flag is used: bfloat16's rounding, amplified by
    s = torch.linalg.svdvals(medium / scale)  # the quintic's slope 3.4 at 0), and as orthogonal as float32's:
    assert 0.6 < s.min() and s.max() < 1.3, s
    g64 = g.double()
    assert torch.equal(P.orthogonalized(g64, p, None, 5, 0.2, "medium"), P.orthogonalized(g64, p, None, 5, 0.2))
    monkeypatch.setattr(P, "fast_bfloat16", lambda device: False)  # a host without bfloat16 GEMMs: float32
    assert torch.equal(P.orthogonalized(g, p, None, 5, 0.2, "medium"), high)
    args = arguments.check_args(arguments.parse_args(["--muon-fp32-matmul-prec", "medium"]), world=1)
    assert train.make_optimizer([gpt.Model(gpt.Config(**LLAMA))], None, args).precision == "medium"  # (DistributedMuon
    # takes the same keywords from the same dict)


MUON_LR = (gpt.TRAIN_DEFAULTS["lr"], gpt.TRAIN_DEFAULTS["min_lr"])  # gpt's, for its Muon
ADAM_LR = (3e-3, 3e-4)  # train.py's own


@pytest.mark.parametrize("flags, want", [
    ([], ("muon", *MUON_LR)),  # gpt's pretraining default (gpt.TRAIN_DEFAULTS), with the learning rates it names
    (["--use-distributed-optimizer"], ("muon", *MUON_LR)),
    (["--optimizer", "adam"], ("adam", *ADAM_LR)),  # another optimizer: train.py's learning rates, not gpt's
    (["--task", "dpo"], ("adam", *ADAM_LR)),  # post-training: AdamW unless told otherwise
    (["--task", "grpo"], ("adam", 3e-4, 3e-5)),  # (with the task's own learning rates)
    (["--lora-rank", "4", "--pretrained-checkpoint", "BASE"], ("adam", *ADAM_LR)),
    (["--model", "bert"], ("muon", 5e-3, 5e-4)),  # bert's own rates for Muon,
    (["--model", "bert", "--optimizer", "adam"], ("adam", 2.5e-4, 2.5e-5)),  # and for AdamW (bert.OPTIMIZER_DEFAULTS)
    (["--model", "t5", "--optimizer", "adam"], ("adam", *ADAM_LR)),  # none declared: train.py's
    (["--model", "llava", "--optimizer", "adam"], ("adam", 2e-3, 2e-4)),
    (["--model", "retro"], ("muon", 9e-3, 9e-4)),
    (["--optimizer", "adam", "--lr", "1e-3"], ("adam", 1e-3, 0.0)),  # a command's own --lr: Megatron's min-lr
])
def test_the_default_optimizer_and_its_learning_rates(flags, want):
    args = arguments.parse_args(flags)
    assert (args.optimizer, args.lr, args.min_lr) == want


def test_a_model_files_optimizer_settings_go_with_the_optimizer_it_names():
    """gpt's TRAIN_DEFAULTS set AdamW's beta2 for the parameters its Muon leaves to AdamW (embeddings, output layer,
    norms); another optimizer, a post-training task or another model file takes train.py's own (0.95), and a command's
    own wins. Without layer 3's reset (arguments.OPTIMIZER_SETTINGS) `--optimizer adam` would step with gpt's 0.99."""
    own = 0.95
    assert arguments.parse_args([]).adam_beta2 == gpt.TRAIN_DEFAULTS["adam_beta2"] != own
    for flags in (["--optimizer", "adam"], ["--task", "dpo"], ["--model", "bert"], ["--model", "retro"]):
        assert arguments.parse_args(flags).adam_beta2 == own, flags
    assert arguments.parse_args(["--adam-beta2", "0.9"]).adam_beta2 == 0.9
    assert arguments.parse_args(["--optimizer", "adam", "--adam-beta2", "0.99"]).adam_beta2 == 0.99


@pytest.mark.parametrize("model", ["gpt", "bert", "t5", "mamba", "retro", "llava"])
def test_muon_takes_the_hidden_matrices_and_nothing_else(model):
    """Muon's matrices in each model file's default model (learned positions where it has them): every 2-D weight
    but the word embedding and output layer (Megatron's is_embedding_or_output_parameter), the other lookup tables
    (positions, token types, T5's relative-position buckets) and BERT's binary classifier."""
    import config as contract
    mf = contract.model_file(model)
    flags = ["--model", model] + (["--position-embedding-type", "learned_absolute"] if model in ("gpt", "bert") else [])
    args = arguments.check_args(arguments.parse_args(flags), world=1)
    net = mf.Model(arguments.model_config(mf, args, 512))
    muon = {k for k, p in net.named_parameters() if P.muon_eligible(p)}
    matrices = {k for k, p in net.named_parameters() if p.dim() == 2}
    lookups_and_heads = {k for k in matrices if any(
        t in k for t in ("embedding", "relative_attention_bias", "binary_head", "output_layer"))}
    assert lookups_and_heads and muon == matrices - lookups_and_heads, sorted(muon ^ (matrices - lookups_and_heads))
    if model in ("gpt", "bert"):
        assert "embedding.position_embeddings.weight" in lookups_and_heads
    if model == "bert":  # (the negative control: these are matrices the rule must keep)
        assert {k for k in muon if "pooler" in k or "lm_head" in k} == {"pooler.dense.weight", "lm_head.dense.weight"}
