"""llava.py: Hugging Face parity, TP / SP / DP == single process with frozen towers, the caption data, train.py.

Tolerances (as in test_hf.py / test_tensor_parallel.py): float32 logits vs Hugging Face 1e-4 absolute (measured: 0 on
logits of magnitude ~0.5; taking the wrong ViT layer's output moves them by 9e-3); float64 layouts vs the single
process 1e-10 relative (only the order of reductions differs; measured <= 3e-14; the planted gather bug: 1.0).
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

import data
import llava
import parallel as P
import tools
from equivalence import assert_same, rel_err, train_steps
from harness import SNIPPET, metrics, torchrun
from interop import tokenizer_files


# --------------------------------------------------------------------------------------- 1. Hugging Face
def hf_llava(strategy="default", feature_layer=-2):
    torch.manual_seed(0)
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       image_size=16, patch_size=4, hidden_act="quick_gelu")
    tc = transformers.LlamaConfig(vocab_size=100, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vc, text_config=tc, image_token_id=99, vision_feature_select_strategy=strategy,
        vision_feature_layer=feature_layer)).eval()
    with torch.no_grad():  # HF initializes norms to 1 and biases to 0: random values, so a swapped one shows
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + ("norm" in name))
    return hf


def image_inputs(n, b=2, s=26, seed=1):
    """ids [b, s] with n image tokens (99) in a block at a different place in each row, pixels [b, 3, 16, 16]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 99, (b, s), generator=g)
    for r in range(b):
        ids[r, 3 * r:3 * r + n] = 99
    return ids, torch.randn(b, 3, 16, 16, generator=g)


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_from_hf_logits_match(strategy):
    hf = hf_llava(strategy)
    ours = llava.from_hf(hf).eval()
    assert ours.config.vision_num_layers == 2 and ours.config.drop_vision_class_token == (strategy == "default")
    ids, px = image_inputs(ours.config.num_image_tokens)
    with torch.no_grad():
        ref, got = hf(input_ids=ids, pixel_values=px).logits, ours(ids, px)
        moved = ours(ids, px.flip(0))  # the image matters: other pixels, other logits
    assert got.shape == ref.shape == (2, 26, 100)
    assert (got - ref).abs().max().item() < 1e-4
    assert (moved - got).abs().max().item() > 1e-2


def test_from_hf_detects_a_wrong_feature_layer():
    """The comparison can fail: our ViT built with all 3 layers (vision_feature_layer -1) vs HF's -2."""
    hf = hf_llava()
    ours = llava.from_hf(hf_llava(feature_layer=-1)).eval()
    ids, px = image_inputs(ours.config.num_image_tokens)
    with torch.no_grad():
        assert (ours(ids, px) - hf(input_ids=ids, pixel_values=px).logits).abs().max() > 1e-3


def test_bad_inputs_are_refused_with_their_values():
    with pytest.raises(ValueError, match="pipeline-model-parallel size 2: LLaVA's vision tower and projector are not split"):
        llava.Config().check_layout(tp=1, pp=2)
    with pytest.raises(ValueError, match="img_h=30 and img_w=32 must be multiples of patch_dim=8"):
        llava.Config(img_h=30)
    with pytest.raises(ValueError, match="vision_num_attention_heads=4 is not divisible by tensor-model-parallel size 8"):
        llava.Config(hidden_size=64, num_attention_heads=8).check_layout(tp=8)
    m = llava.Model(llava.Config(**SMALL))
    ids, px = small_batch(2, seed=0, cls=True)
    ids[0, -2] = m.config.image_token_index  # one image token too many
    with pytest.raises(ValueError, match=r"rows hold \[6, 5\] image tokens .* num_image_tokens=5"):
        m(ids[:, :-1], px)
    with pytest.raises(ValueError, match=r"expected \[b, 3, 8, 8\]"):
        m(ids[:, :-1], px[:, :, :4])
    hf = hf_llava(feature_layer=[-2, -1])
    with pytest.raises(ValueError, match=r"unsupported vision_feature_layer=\[-2, -1\]"):
        llava.from_hf(hf)


# --------------------------------------------------------------------------------------- 2. TP / SP / DP
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32, vocab_size=53,
             make_vocab_size_divisible_by=4, max_position_embeddings=12, position_embedding_type="rope",
             normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
             img_h=8, img_w=8, patch_dim=4, vision_num_layers=2, vision_hidden_size=16, vision_num_attention_heads=4,
             vision_ffn_hidden_size=24, image_token_index=50, hidden_dropout=0.0, attention_dropout=0.0,
             params_dtype=torch.float64, seed=5)  # the ViT: 4 patches + class = 5 tokens, padded to 6 or 8 under SP


def small_batch(b, seed, cls, s=12):
    """The global batch: rows [b, s+1] with 4 (+1 class) image tokens at a row-dependent offset; pixels [b, 3, 8, 8]."""
    g = torch.Generator().manual_seed(seed)
    n = 4 + cls
    ids = torch.randint(0, 50, (b, s + 1), generator=g)
    for r in range(b):
        ids[r, r % 3:r % 3 + n] = 50
    return ids, torch.randn(b, 3, 8, 8, generator=g, dtype=torch.float64)


def llava_case(rank, n, cfg, tp, sp, b, seed, gather_bug=False, muon=False):
    grid = P.Grid(tp=tp, dp=n // tp) if n > 1 else None
    model = llava.Model(llava.Config(**cfg, sequence_parallel=sp), grid)
    start = {k: v.clone() for k, v in model.named_parameters()}
    ids, px = small_batch(b, seed, cls=not cfg.get("drop_vision_class_token", False))
    count = (ids[:, 1:] != 50).sum()  # the global number of loss units: labels that are not image tokens (§2)
    dp, r = (grid.dp_size, grid.dp.rank) if grid is not None else (1, 0)
    real = P.gather_from_sp
    if gather_bug:  # negative control: the ViT's output gathered as if its gradient were partial (summed over TP)
        P.gather_from_sp = lambda x, g, tp_output_grad=True: real(x, g, True)
    try:
        rec = train_steps(model, grid, (ids.chunk(dp)[r], px.chunk(dp)[r]),
                          loss_fn=lambda m, bt: m(bt[0][:, :-1], bt[1], labels=bt[0][:, 1:]).sum() / count, muon=muon)
    finally:
        P.gather_from_sp = real
    rec["frozen"] = {model.global_name(k): (p.grad is None, torch.equal(p.detach(), start[k]))
                     for k, p in model.named_parameters() if not p.requires_grad}
    return rec if grid is None or grid.tp.rank == 0 else None


def run_layout(pool, cfg, tp, sp, b=4, seed=3, **kw):
    """(the layout's record, DP ranks' losses summed; the single process's record)."""
    ref = llava_case(0, 1, cfg, 1, False, b, seed, muon=kw.get("muon", False))
    res = [r for r in pool.run(llava_case, 4, cfg=cfg, tp=tp, sp=sp, b=b, seed=seed, **kw) if r is not None]
    return dict(res[0], losses=sum(r["losses"] for r in res)), ref


def check_frozen(got, ref, cfg):
    """A frozen tower's parameters: no .grad (not even zeros), the values they started with, in both runs."""
    want = {k for k in ref["params"] if (cfg.get("freeze_vision_model") and k.startswith("vision_model."))
            or (cfg.get("freeze_language_model") and not k.startswith("vision_"))}
    for rec in (got, ref):
        assert set(rec["frozen"]) == want
        assert all(no_grad and unchanged for no_grad, unchanged in rec["frozen"].values()), rec["frozen"]
        assert not want & set(rec["grads"])


@st.composite
def llava_layouts(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    cfg = dict(SMALL, num_query_groups=2 if tp < 4 else 4, drop_vision_class_token=draw(st.booleans()),
               freeze_vision_model=draw(st.booleans()),
               freeze_language_model=draw(st.booleans()), share_embeddings_and_output_weights=draw(st.booleans()))
    if cfg["freeze_vision_model"] and cfg["freeze_language_model"]:  # LLaVA's stage 1: only the projector trains
        cfg["share_embeddings_and_output_weights"] = False
    return tp, cfg, draw(st.booleans())


@given(llava_layouts())
def test_llava_parallel_equals_single_process_float64(pool, layout):
    tp, cfg, sp = layout
    got, ref = run_layout(pool, cfg, tp, sp)
    assert_same(got, ref, rtol=1e-10, what=f"tp={tp} dp={4 // tp} sp={sp} {cfg}")
    check_frozen(got, ref, cfg)


@pytest.mark.parametrize("tp,freeze", [(4, "freeze_language_model"), (2, "freeze_vision_model")])
def test_llava_sequence_parallel_equals_single_process_float64(pool, tp, freeze):
    """Always with SP and a frozen tower (the drawn layouts above may not reach them): the ViT's 5 tokens padded to 8
    (tp 4) or 6 (tp 2, with dp 2)."""
    cfg = dict(SMALL, num_query_groups=4, **{freeze: True})
    got, ref = run_layout(pool, cfg, tp, sp=True)
    assert_same(got, ref, rtol=1e-10, what=f"tp={tp} sp {freeze}")
    check_frozen(got, ref, cfg)


@pytest.mark.parametrize("tp,freeze", [(2, "freeze_vision_model"), (4, None)])
def test_muon_equals_single_process_float64(pool, tp, freeze):
    """--optimizer muon (parallel.Muon): the ViT's, projector's and LM's hidden matrices orthogonalized whole across
    TP; the ViT's position table, class token and patch convolution stay AdamW's; a frozen tower is in neither."""
    cfg = dict(SMALL, num_query_groups=4, **({freeze: True} if freeze else {}))
    got, ref = run_layout(pool, cfg, tp, sp=True, muon=True)
    assert_same(got, ref, rtol=1e-10, what=f"muon tp={tp} sp {freeze}")
    check_frozen(got, ref, cfg)


def optimizer_case(rank, n, cfg, tp, distopt, b=4, seed=3, steps=2):
    """train.py's path: parallel.forward_backward, then the plain optimizer (finalize_grads) or DDP + the distributed
    optimizer (ZeRO-1), 2 clipped AdamW steps. Returns the losses, the parameters and what the optimizer holds."""
    grid = P.Grid(tp=tp, dp=n // tp) if n > 1 else None
    model = llava.Model(llava.Config(**cfg), grid)
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = (P.DistributedOptimizer(P.DDP([model], grid, bucket_size=2000, overlap=True, distributed_optimizer=True), **kw)
           if distopt else P.Optimizer([model], grid, **kw))
    ids, px = small_batch(b, seed, cls=True)
    dp, r = (grid.dp_size, grid.dp.rank) if grid is not None else (1, 0)
    micro = list(zip(ids.chunk(dp)[r].chunk(2), px.chunk(dp)[r].chunk(2)))  # 2 micro-batches per DP rank
    count = int((ids[:, 1:] != 50).sum())
    losses = []
    for _ in range(steps):
        opt.zero_grad(len(micro))
        loss = P.forward_backward([model], micro, lambda m, mb: m(mb[0][:, :-1], mb[1], labels=mb[0][:, 1:]).sum(),
                                  count, grid, None, torch.float64)
        opt.finish_grad_sync()
        opt.clip_grad_norm(0.05)
        opt.step()
        losses.append(P.all_reduce(torch.as_tensor(loss).reshape(1), grid.dp) if grid else torch.as_tensor(loss))
    state = {id(p) for p in opt.full_state()}
    return dict(losses=torch.cat([x.reshape(1) for x in losses]),
                params={model.global_name(k): P.gather_full(p.data, p, grid) for k, p in model.named_parameters()},
                stateless=sorted(model.global_name(k) for k, p in model.named_parameters() if id(p) not in state))


@pytest.mark.parametrize("distopt", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
def test_frozen_tower_has_no_optimizer_state_and_dp_matches(pool, distopt):
    """tp 2 x dp 2, the ViT frozen, through parallel.forward_backward and train.py's optimizers (clipping active):
    the same losses and parameters as one process, and the optimizer holds state for exactly the trainable ones."""
    cfg = dict(SMALL, sequence_parallel=True, freeze_vision_model=True)
    ref = optimizer_case(0, 1, cfg, 1, False)
    got = pool.run(optimizer_case, 4, cfg=cfg, tp=2, distopt=distopt)[0]
    assert set(got["params"]) == set(ref["params"])
    worst = max([(rel_err(got["losses"], ref["losses"]), "loss")]
                + [(rel_err(got["params"][k], v), k) for k, v in ref["params"].items()])
    assert worst[0] <= 1e-10, f"tp=2 dp=2 distopt={distopt}: worst relative error {worst[0]:.1e} at {worst[1]}"
    vit = sorted(k for k in ref["params"] if k.startswith("vision_model."))
    assert got["stateless"] == ref["stateless"] == vit


def test_negative_control_gathering_vit_output_with_partial_grads_fails(pool):
    """Planted bug: the ViT output's SP gather reduce-scatters its gradient (tp_output_grad=True), as if the ranks held
    partial sums; they hold the same full gradient, so every ViT gradient comes out tp times too large."""
    got, ref = run_layout(pool, SMALL, 2, sp=True, gather_bug=True)  # (tp 2, dp 2)
    with pytest.raises(AssertionError, match="worst relative error .* at grad vision_model"):
        assert_same(got, ref, rtol=1e-10, what="gather bug")


# --------------------------------------------------------------------------------------- 3. the caption data
@pytest.fixture(scope="module")
def tok():
    return tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], None, vocab_size=384)


def test_caption_rows_draw_the_same_scene_and_mask_only_the_caption(tok):
    args = argparse.Namespace(seq_length=64, img_h=16, img_w=16, patch_dim=8, drop_vision_class_token=None)
    ds = llava.dataset(None, None, args, tok, seed=11)
    c, n, sp = ds.c, 5, tokenizer_files.special_ids(tok)
    assert c.image_token_index == tok.token_to_id(llava.IMAGE_TOKEN) and c.num_image_tokens == n
    batch = data.global_batch(ds, start=8, size=4)  # samples 8..11
    assert torch.equal(batch, data.global_batch(ds, start=8, size=4))
    assert not torch.equal(batch, data.global_batch(ds, start=12, size=4))
    ids, pixels, labels, mask = llava.unpack(batch, c)
    for row, i in enumerate(range(8, 12)):
        img, cap = llava.scene(11, i, 16, 16)
        cap_ids = tok.encode(cap).ids
        assert torch.equal(pixels[row], torch.from_numpy(img).double())
        assert ids[row, :n].eq(c.image_token_index).all() and tok.decode(ids[row, n:n + len(cap_ids)].tolist()) == cap
        assert labels[row][mask[row].bool()].tolist() == cap_ids + [sp["eod"]]  # the caption and eod, nothing else
        assert labels[row, n + len(cap_ids):].eq(sp["pad"]).all()
    shuffled = llava.unpack(batch, c, shift=1)[1]
    assert torch.equal(shuffled[:3], pixels[1:])  # the control: each sample gets the next sample's image
    loss_func, count = llava.batch_recipe(batch)
    assert count == int(mask.sum())
    model = llava.Model(llava.Config(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=384, img_h=16,
                                     img_w=16, patch_dim=8, vision_hidden_size=8, vision_num_layers=1,
                                     image_token_index=c.image_token_index, hidden_dropout=0.0, attention_dropout=0.0,
                                     position_embedding_type="rope", params_dtype=torch.float64))
    per_token = model(ids, pixels, labels=labels)
    assert torch.isclose(loss_func(model, batch), (per_token * mask).sum())
    assert per_token[:, :n - 1].eq(0).all()  # image tokens as labels carry no loss
    acc = llava.text_only_accuracy(tok)
    assert 0.3 < acc < 0.95  # some tokens follow from the text (' b' 'ottom'), colours and shapes do not
    with pytest.raises(data.DataError, match="--seq-length=16 cannot hold 5 image tokens"):
        llava.dataset(None, None, argparse.Namespace(**{**vars(args), "seq_length": 16}), tok, seed=11)


# --------------------------------------------------------------------------------------- 4. train.py
def test_train_py_tp2_sp_frozen_vit_distributed_optimizer_and_sample(tmp_path, capsys):
    """`make train MODEL=llava NPROC=2 TP=2`, small: SP on, the ViT frozen (no optimizer state: the checkpoint
    has none for it), evaluation with the caption metrics; then `tools.py sample` describes a scene."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    run = tmp_path / "run"
    torchrun(2, ["--model", "llava", "--data-path", str(corpus), "--data-cache-dir", str(tmp_path / "cache"),
                 "--vocab-size", "384", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "64", "--img-h", "16", "--img-w", "16", "--vision-hidden-size", "32",
                 "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "4", "--eval-interval", "2",
                 "--eval-iters", "1", "--log-interval", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--freeze-ViT", "--use-distributed-optimizer", "--save", str(run)])
    losses, val = metrics(run)
    assert sorted(losses) == [1, 2, 3, 4] and sorted(val) == [2, 4]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["caption_accuracy"] <= 1 and "caption_accuracy_shuffled" in r for r in recs if "val_loss" in r)
    text = tools.main(["sample", "--load", str(run), "--prompt", "3", "--max-new-tokens", "4"])
    lines = text.splitlines()
    assert len(lines[0]) == 16 and lines[8].startswith("scene 3: ") and lines[9].startswith("the model: ")  # 16/2 rows
