"""LoRA (posttraining/lora.py) against the single process, the merge, --finetune / --pretrained-checkpoint, and --config.

  - the tensor-parallel adapter layer (column / row parallel, with and without sequence parallelism) equals the
    one-process oracle lora.reference: output and the gradients of x, A, B;
  - LoRA training under TP / SP / PP / DP / the distributed optimizer equals the single process: the loss, every
    adapter's gradient after the first backward, the clipped gradient norm and every adapter after 2 AdamW steps;
    the base weights stay bit-for-bit what they were and the optimizer holds the adapters only;
  - merged weights (W + (alpha/r)·B·A, each TP rank its slice) give the adapted model's logits, at TP 1 and 2;
  - through train.py: LoRA on a pretrained run, resume (adapters only in the checkpoint, the base found by its
    pointer), merge, --finetune; and bad input ends in one line.
Tolerances: float64, 1e-10 relative for layouts against one process (the order of reductions only, DESIGN.md §2; measured
~1e-15), 1e-10 for merged against adapted logits (W + c·B·A is one rounding per weight; measured ~1e-16).
Negative control: the SP adapter without its `sequence_parallel` mark (its A's gradient then stays a per-rank partial
sum) fails the comparison with "worst relative error".
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import checkpoint
import gpt
import parallel as P
import tools
import train
import transformer
from equivalence import assert_same, clipped_steps, make_batch, reference_steps, rel_err
from posttraining import lora, quantization

CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=211,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
LLAMA = dict(CFG, position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True,
             add_bias_linear=False, share_embeddings_and_output_weights=False)
OPT = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
RANK, ALPHA, CLIP = 4, 8.0, 0.05  # CLIP: small enough that clipping is active, so the norm's correctness matters


def adapt(model, b_std=0.05):
    """LoRA on every target; B drawn like A (layout-free, from its global name) instead of 0, so that A's gradient is
    not 0 at the first step and the comparison sees both factors."""
    lora.apply_lora(model, lora.TARGETS, RANK, ALPHA)
    for m in model.modules():
        if isinstance(m, lora.LoRA):
            m.B.init = ("normal", b_std)
    lora.init_adapters(model)
    return model


# --------------------------------------------------------------------------------------- 1. the layer and its oracle
def layer_case(rank, n, sp, column, s=8, b=2, i=12, o=16):
    """One adapted TP linear on full tensors W, A, B, x drawn from fixed seeds; returns the full output and the full
    gradients of x, A and B (the shards gathered) for the parent to hold against lora.reference."""
    grid = P.Grid(tp=n, pp=1, dp=1) if n > 1 else None
    tp, r = P.tp_of(grid), (grid.tp.rank if grid else 0)
    g = torch.Generator().manual_seed(0)
    W, A, B = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((o, i), (RANK, i), (o, RANK)))
    x, dy = torch.randn(s, b, i, generator=g, dtype=torch.float64), torch.randn(s, b, o, generator=g, dtype=torch.float64)
    cls = P.ColumnParallelLinear if column else P.RowParallelLinear
    base = cls(i, o, grid, bias=False, sequence_parallel=sp, dtype=torch.float64)
    base.lora = lora.LoRA(base, RANK, ALPHA)
    base.lora_hook = base.register_forward_hook(lora._add_adapter)
    with torch.no_grad():
        for p, full in ((base.weight, W), (base.lora.A, A), (base.lora.B, B)):
            p.copy_(P.shard(full, p.partition_dim, p.partition_stride, r, n))
    x_in = (x.chunk(n, 0)[r] if sp else x) if column else x.chunk(n, -1)[r]  # this rank's input
    x_in = x_in.clone().requires_grad_()
    y = base(x_in)
    dy_local = (dy.chunk(n, -1)[r] if column else dy.chunk(n, 0)[r] if sp else dy)
    y.backward(dy_local)
    P.finalize_grads(base, grid)  # sums the `sequence_parallel` adapter grads over TP
    y = y.detach()
    y_full = P._gather(y, tp, -1) if column else (P._gather(y, tp, 0) if sp else y)
    dx = (P._gather(x_in.grad, tp, 0) if sp else x_in.grad) if column else P._gather(x_in.grad, tp, -1)
    return dict(y=y_full, dx=dx, dA=P.gather_full(base.lora.A.grad, base.lora.A, grid),
                dB=P.gather_full(base.lora.B.grad, base.lora.B, grid))


@pytest.mark.parametrize("column", [True, False], ids=["column", "row"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_adapter_layer_equals_the_oracle(pool, column, sp):
    got = pool.run(layer_case, 2, sp=sp, column=column)[0]
    ref = pool.run(layer_case, 1, sp=False, column=column)[0]  # one process: no collective at all
    g = torch.Generator().manual_seed(0)
    W, A, B = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((16, 12), (RANK, 12), (16, RANK)))
    x = torch.randn(8, 2, 12, generator=g, dtype=torch.float64, requires_grad=True)
    A.requires_grad_(), B.requires_grad_()
    y = lora.reference(x, W, A, B, ALPHA)  # the plain formula
    y.backward(torch.randn(8, 2, 16, generator=g, dtype=torch.float64))
    oracle = dict(y=y.detach(), dx=x.grad, dA=A.grad, dB=B.grad)
    for k, want in oracle.items():
        assert rel_err(ref[k], want) < 1e-12, f"one process, {k}: {rel_err(ref[k], want):.1e}"
        assert rel_err(got[k], want) < 1e-12, f"tp=2 sp={sp}, {k}: {rel_err(got[k], want):.1e}"


def dropout_case(rank, n, sp, column, s=8, b=2, i=12, o=16):
    """The keep-mask --lora-dropout draws on this rank (parallel.dropout wrapped to record it)."""
    grid = P.Grid(tp=n, pp=1, dp=1)
    cls = P.ColumnParallelLinear if column else P.RowParallelLinear
    base = cls(i, o, grid, bias=False, sequence_parallel=sp, dtype=torch.float64)
    base.lora = lora.LoRA(base, RANK, ALPHA, dropout=0.5, rng=P.RNGTracker(1234, grid))
    shape = (s // n if sp else s, b, i) if column else (s, b, i // n)
    x, masks, real = torch.ones(shape, dtype=torch.float64), [], P.dropout
    P.dropout = lambda x, p, training, rng=None, sharded=False: masks.append(real(x, p, training, rng, sharded) != 0) or x
    try:
        base.lora(x)
    finally:
        P.dropout = real
    return masks[0]


@pytest.mark.parametrize("sp,column,same", [(False, True, True), (True, True, False), (False, False, False)],
                         ids=["column-replicated-input", "column-sp", "row"])
def test_lora_dropout_masks_follow_the_rng_rule(pool, sp, column, same):
    """Megatron's RNG rule (DESIGN.md §2): TP ranks drop the same elements of a replicated input (or the ranks' adapter
    terms would disagree) and different ones of their shards (sequence or hidden dim)."""
    a, b = pool.run(dropout_case, 2, sp=sp, column=column)
    assert torch.equal(a, b) == same


# --------------------------------------------------------------------------------------- 2. training, any layout
def lora_case(rank, n, cfg, tp, pp, vp, M, sp, distopt, b=8, s=8, steps=2, drop_sp_mark=False, quantize=None):
    """distopt None: the plain P.Optimizer; else DDP + P.DistributedOptimizer (the train.py interface). quantize:
    the base's linears stored in that format (QLoRA, posttraining/quantization.py; tests/test_quantization.py)."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp))
    c = gpt.Config(**cfg, sequence_parallel=sp)
    chunks = [adapt(m) for m in P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl),
                                               c.num_layers, grid, vp)]
    for ch in chunks if quantize else []:
        quantization.quantize_linears(ch, quantize)
    if drop_sp_mark:  # negative control: A's partial (per sequence shard) gradient is then never summed over TP
        for m in (m for ch in chunks for m in ch.modules() if isinstance(m, lora.LoRA) and m.column):
            m.A.sequence_parallel = False
    base = [p.detach().clone() for ch in chunks for p in ch.parameters() if not lora.is_adapter(p)]
    if distopt is None:
        ddp, opt = None, P.Optimizer(chunks, grid, **OPT)
        held = list(opt.adam.state)
    else:
        ddp = P.DDP(chunks, grid, bucket_size=2000, overlap=True, distributed_optimizer=distopt)
        opt, held = P.DistributedOptimizer(ddp, **OPT), [p for bk in ddp.buckets for p in bk.params]
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].chunk(M))
    shape = (s // tp if sp else s, micro[0].shape[0], c.hidden_size)
    out = clipped_steps(chunks, grid, opt, micro, batch[:, 1:].numel(), shape, c.params_dtype, CLIP, steps,
                        lambda _: dict(grads=adapter_grads(chunks, ddp, grid)))
    now = [p for ch in chunks for p in ch.parameters() if not lora.is_adapter(p)]
    return dict(out, params={m.global_name(k): P.gather_full(p.data, p, grid) for m in chunks for k, p in m.named_parameters()
                        if lora.is_adapter(p)},
                base_unchanged=len(now) == len(base) and all(torch.equal(a, b) for a, b in zip(now, base)),
                base_frozen=not any(p.requires_grad or p.grad is not None for p in now),
                only_adapters_held=bool(held) and all(lora.is_adapter(p) for p in held))


def adapter_grads(chunks, ddp, grid):
    """Every adapter's whole gradient: DDP's buffer (DP slices all-gathered for the distributed optimizer), TP shards."""
    if ddp is not None:
        buf = ddp.grad_buffer.clone()
        for bk in ddp.buckets if ddp.distopt and ddp.dp.size > 1 else []:
            P.all_gather_single(buf[bk.start:bk.end], ddp.grad_buffer[ddp.owned(bk)].clone(), group=ddp.dp.pg)
        at, off = {}, 0
        for bk in ddp.buckets:
            off = bk.start
            for p in bk.params:
                at[id(p)], off = buf[off:off + p.numel()].view_as(p), off + p.numel()
    return {m.global_name(k): P.gather_full(at[id(p)] if ddp is not None else p.grad, p, grid).clone()
            for m in chunks for k, p in m.named_parameters() if lora.is_adapter(p)}


def reference(cfg, M, b=8, s=8, steps=2):
    """One process: the adapted model, torch.optim.AdamW on the adapters alone, torch's clip_grad_norm_."""
    model = adapt(gpt.Model(gpt.Config(**cfg)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, foreach=False, **OPT)  # every adapter is a matrix: all decay
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    return reference_steps(model, opt, list(batch.chunk(M)), batch[:, 1:].numel(), CLIP, steps)


def merge_results(results):
    out = dict(grads={}, params={})
    for r in results:
        out["grads"].update(r["grads"])
        out["params"].update(r["params"])
        assert r["base_unchanged"] and r["base_frozen"], "a base weight changed, or has a gradient"
        assert r["only_adapters_held"], "the optimizer holds a parameter that is not an adapter"
    return dict(out, losses=results[0]["losses"], norms=results[0]["norms"])


@pytest.mark.parametrize("n,cfg,tp,pp,vp,M,sp,distopt", [
    (2, LLAMA, 2, 1, 1, 2, False, None),  # tp 2, the plain optimizer
    (4, CFG, 2, 1, 1, 2, True, True),  # tp 2 (sequence parallel) x dp 2, distributed optimizer
    (4, LLAMA, 1, 2, 1, 2, False, True),  # pp 2 x dp 2, distributed optimizer
    (4, CFG, 2, 2, 1, 2, True, None),  # tp 2 (sequence parallel) x pp 2, tied embedding across stages (frozen)
    (4, LLAMA, 1, 2, 2, 2, False, False),  # interleaved pp 2 x dp 2, bucketed DDP
], ids=["tp2", "tp2-sp-dp2-distopt", "pp2-dp2-distopt", "tp2-sp-pp2", "vpp-dp2-ddp"])
def test_lora_training_equals_single_process(pool, n, cfg, tp, pp, vp, M, sp, distopt):
    got = merge_results(pool.run(lora_case, n, cfg=cfg, tp=tp, pp=pp, vp=vp, M=M, sp=sp, distopt=distopt))
    dp = n // (tp * pp)
    ref = reference(cfg, M * dp)
    assert len(ref["grads"]) == 4 * 2 * cfg["num_layers"]  # A and B of 4 linears per layer
    assert_same(got, ref, rtol=1e-10, what=f"LoRA n={n} tp={tp} pp={pp} vp={vp} sp={sp} distopt={distopt}")
    assert rel_err(got["norms"], ref["norms"]) < 1e-10, (got["norms"], ref["norms"])
    assert ref["norms"].min() > CLIP  # clipping was active at every step


def test_negative_control_sp_adapter_without_its_tp_sum_fails(pool):
    got = merge_results(pool.run(lora_case, 2, cfg=LLAMA, tp=2, pp=1, vp=1, M=1, sp=True, distopt=None,
                                 drop_sp_mark=True))
    with pytest.raises(AssertionError, match="worst relative error .* at grad .*lora.A"):
        assert_same(got, reference(LLAMA, 1), rtol=1e-10, what="SP adapter, A not summed over TP")


# --------------------------------------------------------------------------------------- 3. merge
def merge_case(rank, n, cfg, b=2, s=8):
    """Logits [b, s, V] of the adapted model, then of the merged one (every rank its slice), and the merged weights."""
    grid = P.Grid(tp=n, pp=1, dp=1)
    model = gpt.Model(gpt.Config(**cfg, sequence_parallel=n > 1), grid)
    ids = make_batch(cfg["vocab_size"], b, s, 5)[:, :-1]
    with torch.no_grad():
        plain = model(ids)
        adapted = adapt(model, b_std=0.2)(ids)
        merged = lora.merge(model)(ids)
    return dict(plain=plain, adapted=adapted, merged=merged, left=[k for k, _ in model.named_parameters() if "lora" in k],
                weights={k: P.gather_full(p.data, p, grid) for k, p in model.named_parameters()})


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt2-like", "llama-like"])
def test_merged_weights_give_the_adapted_logits_at_tp1_and_tp2(pool, cfg):
    one = pool.run(merge_case, 1, cfg=cfg)[0]
    two = pool.run(merge_case, 2, cfg=cfg)[0]
    assert rel_err(one["adapted"], one["plain"]) > 1e-3  # the adapters do change the model
    for r in (one, two):
        assert not r["left"]
        assert rel_err(r["merged"], r["adapted"]) < 1e-10
        assert rel_err(r["adapted"], one["adapted"]) < 1e-10  # the adapters are layout-free
    for k, w in one["weights"].items():  # the TP 2 merge of sharded adapters gives the same full weights
        assert rel_err(two["weights"][k], w) < 1e-12, k


def test_adapters_start_at_the_base_model():
    """B = 0 (the paper's init): before training, the adapted model is the base model exactly."""
    model = gpt.Model(gpt.Config(**LLAMA))
    ids = make_batch(211, 2, 8, 5)[:, :-1]
    with torch.no_grad():
        before = model(ids)
        lora.apply_lora(model, ["linear_qkv", "linear_fc2"], RANK, ALPHA)
        assert torch.equal(model(ids), before)
    assert all(not p.requires_grad for k, p in model.named_parameters() if ".lora." not in k)
    assert sorted({k.split(".")[-3] for k, p in model.named_parameters() if p.requires_grad}) == ["linear_fc2", "linear_qkv"]


def test_lora_target_that_does_not_exist_is_refused():
    model = gpt.Model(gpt.Config(**dict(LLAMA, num_experts=2, moe_router_topk=1)))
    with pytest.raises(ValueError, match="not one of linear_qkv, linear_proj, linear_fc1, linear_fc2"):
        lora.apply_lora(model, ["linear_qkvv"], RANK)
    with pytest.raises(ValueError, match="experts.linear_fc1 is not a tensor-parallel linear"):
        lora.apply_lora(model, ["linear_fc1"], RANK)
    mlp = transformer.MLP(gpt.Config(**LLAMA))  # a module without attention
    with pytest.raises(ValueError, match="'linear_qkv': this model has no such linear .it has: linear_fc1, linear_fc2."):
        lora.apply_lora(mlp, ["linear_fc2", "linear_qkv"], RANK)


# --------------------------------------------------------------------------------------- 4. through train.py
def tiny(corpus, cache, save, *extra, iters=4):
    return ["--data-path", str(corpus), "--data-cache-dir", str(cache), "--vocab-size", "384",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "3e-3",
            "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--save", str(save), *extra]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    from harness import SNIPPET

    corpus = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (corpus / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    cache, base = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("base")
    train.main(tiny(corpus, cache, base))
    return corpus, cache, base


@pytest.fixture(scope="module")
def lora_whole(base_run, tmp_path_factory):
    """An uninterrupted single-process LoRA run of 4 iterations on the base run: the reference of the tests below."""
    corpus, cache, base = base_run
    whole = tmp_path_factory.mktemp("whole")
    train.main(tiny(corpus, cache, whole, *LORA_FLAGS, str(base), "--load", str(whole), iters=4))
    return whole


LORA_FLAGS = ["--lora-rank", "4", "--lora-alpha", "8", "--pretrained-checkpoint"]  # + the base run


def losses(run):
    return {r["iteration"]: r["loss"] for r in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_lora_run_resumes_merges_and_finetunes(base_run, lora_whole, tmp_path, capsys):
    corpus, cache, base = base_run
    run = tmp_path / "lora"
    train.main(tiny(corpus, cache, run, *LORA_FLAGS, str(base), "--load", str(run), iters=2))  # starts from the base's weights
    train.main(tiny(corpus, cache, run, "--load", str(run), iters=4))  # resumes the adapters (their flags and the
    # base's pointer from the checkpoint; the optimizer AdamW, an adapter run's, not the model file's Muon)
    assert losses(run) == losses(lora_whole)  # stop + resume = uninterrupted
    meta = json.loads((run / "iter_0000004" / "meta.json").read_text())
    assert meta["lora_base"]["path"] == str((base / "iter_0000004").resolve())
    model, args, _, _, _ = checkpoint.load_model(run, merge=False)
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(run / "iter_0000004")).read_metadata().state_dict_metadata
    assert saved and all(".lora." in k for k in saved if k.startswith("model.")), "the checkpoint holds non-adapters"
    assert any(".lora." in k for k in saved if k.startswith("optimizer."))
    ids = make_batch(384, 2, 16, 3)[:, :-1]
    with torch.no_grad():
        adapted = model(ids)
    tools.main(["merge", "--load", str(run), "--save", str(tmp_path / "merged")])
    merged, margs, _, _, _ = checkpoint.load_model(tmp_path / "merged")
    with torch.no_grad():
        assert rel_err(merged(ids), adapted) < 1e-5  # float32: one rounding of W + c·B·A per weight
    assert margs.lora_rank is None and not any(".lora." in k for k, _ in merged.named_parameters())
    tools.main(["export", "--load", str(run), "--hf-out", str(tmp_path / "hf")])  # a LoRA run exports merged
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert rel_err(hf(ids).logits, adapted) < 1e-5  # float32 (tests/test_export.py)
    # --finetune from the merged weights: iteration 0, a new optimizer (a merged checkpoint holds none)
    train.main(tiny(corpus, cache, tmp_path / "ft", "--finetune", "--load", str(tmp_path / "merged"), iters=1))
    assert (tmp_path / "ft" / "iter_0000001").is_dir()
    with pytest.raises(SystemExit):  # resuming it instead: refused in one line
        train.main(tiny(corpus, cache, tmp_path / "merged", "--load", str(tmp_path / "merged"), iters=8))
    assert "holds model weights only" in capsys.readouterr().err


def test_torchrun_tp2_sp_lora_matches_one_process_and_merges_at_tp1(base_run, lora_whole, tmp_path):
    """`make train NPROC=2 TP=2 ARGS="--lora-rank 8 --pretrained-checkpoint ..."` in small: float32, 1e-5 relative
    (reduction order only; measured ~1e-7); the TP-sharded adapters then load in one process (tools.py merge)."""
    from harness import torchrun

    corpus, cache, base = base_run
    torchrun(2, tiny(corpus, cache, tmp_path / "tp2", *LORA_FLAGS, str(base), "--tensor-model-parallel-size", "2",
                     "--sequence-parallel", iters=4))
    one, two = losses(lora_whole), losses(tmp_path / "tp2")
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    assert all(abs(one[k] - two[k]) <= 1e-5 * abs(one[k]) for k in one), (one, two)
    tools.main(["merge", "--load", str(tmp_path / "tp2"), "--save", str(tmp_path / "merged")])
    ids = make_batch(384, 2, 16, 3)[:, :-1]
    with torch.no_grad():
        a, b = checkpoint.load_model(lora_whole)[0](ids), checkpoint.load_model(tmp_path / "merged")[0](ids)
    assert rel_err(b, a) < 1e-5


def test_base_changed_under_a_lora_run_is_refused(base_run, tmp_path, capsys):
    corpus, cache, base = base_run
    import shutil

    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    run = tmp_path / "lora"
    train.main(tiny(corpus, cache, run, "--lora-rank", "2", "--pretrained-checkpoint", str(copy), "--load", str(run),
                    iters=1))
    d = copy / "iter_0000004"  # overwritten by another consistent checkpoint: files and manifest agree, but differ
    (d / "meta.json").write_text((d / "meta.json").read_text().replace('"iteration": 4', '"iteration":  4'))
    checkpoint.write_manifest(d)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(tiny(corpus, cache, run, "--lora-rank", "2", "--load", str(run), iters=2))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the one the adapters were trained on" in err[0], err


@pytest.mark.parametrize("case,expect", [
    (["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "linear_foo"],
     "invalid choice: 'linear_foo' (choose from 'linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2')"),
    (["--finetune"], "--finetune loads a checkpoint's weights: pass --load DIR or --pretrained-checkpoint DIR"),
    (["--finetune", "--load", "EMPTY"], "--finetune: --load"),
    (["--lora-rank", "4"], "--lora-rank=4 adapts a trained model"),
    (["--lora-rank", "0", "--load", "EMPTY"], "--lora-rank=0 must be >= 1"),
    (["--config", "BADYAML"], "unknown key 'lora-rnak' (no flag --lora-rnak; did you mean 'lora-rank'?)"),
    (["--config", "NOTMAP"], "expected a mapping of flag names to values, found a list"),
    (["--lora-rank", "2", "--load", "BASE"], "a run without adapters: add --finetune"),
    (["--lora-rank", "2", "--load", "EMPTY"], "has no checkpoint, so there is no model to adapt"),
    (["--pretrained-checkpoint", "EMPTY"], "--pretrained-checkpoint EMPTYDIR: no checkpoint there"),
    (["--finetune", "--load", "BASE", "--save", "BASE"], "is the run whose weights this run starts from"),
    (["--lora-rank", "2", "--num-experts", "2", "--load", "EMPTY"], "adapters on MoE experts are not supported"),
])
def test_bad_input_gives_one_clear_error(base_run, tmp_path, capsys, case, expect):
    corpus, cache, base = base_run
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.yaml").write_text("lora-rnak: 8\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    subst = {"EMPTY": str(tmp_path / "empty"), "BADYAML": str(tmp_path / "bad.yaml"), "NOTMAP": str(tmp_path / "list.yaml"),
             "BASE": str(base)}
    with pytest.raises(SystemExit) as e:
        train.main(tiny(corpus, cache, tmp_path / "run", *[subst.get(a, a) for a in case]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and expect.replace("EMPTYDIR", subst["EMPTY"]) in err[0], err


def test_config_yaml_sets_flags_and_the_command_line_overrides_it(tmp_path):
    (tmp_path / "run.yaml").write_text("lora-rank: 8\nlora_alpha: 16\nswiglu: false\nlora-target-modules: [linear_qkv]\n"
                                       "moe-layer-freq: [1, 0]\ntrain-iters: 7\nvocab-size: null\n")
    from arguments import parse_args

    a = parse_args(["--config", str(tmp_path / "run.yaml"), "--train-iters", "9"])
    assert (a.lora_rank, a.lora_alpha, a.swiglu, a.lora_target_modules, a.moe_layer_freq, a.train_iters,
            a.vocab_size) == (8, 16.0, False, ["linear_qkv"], [1, 0], 9, None)
    for example in sorted((Path(__file__).parent.parent / "examples").glob("*.yaml")):  # the examples parse
        parse_args(["--config", str(example)])

