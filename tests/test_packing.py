"""Packed documents (Megatron's --reset-position-ids, --reset-attention-mask, --eod-mask-loss; data.Packing and
train.py's GPT recipe): several documents in one sequence, each seen exactly as if it were alone.

  - the masks, loss mask and positions equal Megatron-core's `_get_ltor_masks_and_position_ids` sample by sample;
  - Megatron-core's GPTModel given those positions and mask computes the same logits, masked per-token loss and
    gradients as ours (GPT-2-like, learned positions, TP 1 and 2; our model with a plain causal mask fails, logits
    off by ~7e-1). Not with RoPE: Megatron's GPTModel rotates by 0..s-1 whatever position_ids say,
    which the block-causal mask makes equal in exact arithmetic but not in float32 angles (DESIGN.md §4);
  - a packed batch gives each document exactly the per-token losses it has alone, and its summed loss the gradient
    of the documents' summed losses alone (GPT with learned and with rotary positions, float64); a plain causal mask
    fails that comparison (the negative control);
  - through train.py's recipe (batch_recipe, stage_step, parallel.forward_backward), a packed batch under TP + SP,
    PP and DP trains exactly as the single process: losses, every gradient, parameters after 2 AdamW steps, with
    the global count of loss tokens as the denominator (DESIGN.md §2); a count taken from a DP rank's own rows fails;
  - the flags' checks in arguments.py.
Tolerances: float64 1e-10 relative (DESIGN.md §2): packed vs alone differ only in the order of reductions (masked
keys add exact zeros to the softmax sums, longer matmuls add the same terms in another order); layouts vs one
process only in the order of TP/DP sums. Measured: packed vs alone ≤ 8e-16 (learned and RoPE).
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_pipeline import _named, merge

import arguments
import config as contract
import data
import gpt
import parallel as P
import train
from equivalence import assert_same, named_full, rel_err

EOD = 0
f64 = torch.float64
GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
           vocab_size=101, make_vocab_size_divisible_by=4, max_position_embeddings=24, hidden_dropout=0.0,
           attention_dropout=0.0, params_dtype=f64)
LLAMA = dict(GPT, position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True,
             add_bias_linear=False, share_embeddings_and_output_weights=False)
FLAGS = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def packed_batch(b, s, seed, max_doc=9):
    """[b, s+1] rows, each a window of a stream of documents (ids 1..100, each followed by EOD), as GPTDataset
    cuts them: a row starts and ends mid-document, and may hold two EODs in a row (an empty document)."""
    g = torch.Generator().manual_seed(seed)
    stream = []
    while len(stream) < b * (s + 1) + max_doc:
        n = int(torch.randint(0, max_doc, (1,), generator=g))
        stream += torch.randint(1, GPT["vocab_size"], (n,), generator=g).tolist() + [EOD]
    start = int(torch.randint(0, max_doc, (1,), generator=g))
    return torch.tensor(stream[start:start + b * (s + 1)]).view(b, s + 1)


def documents(row):
    """A row [s+1] cut after each EOD: the pieces (input = piece[:-1], labels = piece[1:]) and their input offsets."""
    ends = (row[:-1] == EOD).nonzero().flatten().tolist()
    starts = [0] + [e + 1 for e in ends]
    return [(a, row[a:e + 1]) for a, e in zip(starts, ends + [len(row) - 1])]


# --------------------------------------------------------------------------------------- 1. masks and positions
def test_masks_and_positions_equal_megatron():
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids as megatron

    tokens = packed_batch(6, 16, seed=1)[:, :-1]
    tokens[0, 0], tokens[1, -1], tokens[2, 3:5] = EOD, EOD, EOD  # an EOD first, last, and two in a row
    for flags in [FLAGS, dict(FLAGS, reset_position_ids=False), dict(reset_attention_mask=True),
                  dict(eod_mask_loss=True)]:
        mask, loss_mask, pos = data.get_ltor_masks_and_position_ids(tokens, EOD, **flags)
        for r, row in enumerate(tokens):
            m, lm, p = megatron(row.clone(), EOD, flags.get("reset_position_ids", False),
                                flags.get("reset_attention_mask", False), flags.get("eod_mask_loss", False), True)
            assert torch.equal(loss_mask[r], lm) and torch.equal(pos[r], p), (flags, r)
            if flags.get("reset_attention_mask"):  # Megatron's True = masked out; ours True = attend
                assert torch.equal(mask[r], ~m), (flags, r)
            else:
                assert mask is None and torch.equal(~m[0], torch.ones(16, 16, dtype=torch.bool).tril())
    hand = torch.tensor([[5, 6, EOD, 7, 8, EOD, EOD, 9]])  # the rule, readably
    mask, loss_mask, pos = data.get_ltor_masks_and_position_ids(hand, EOD, **FLAGS)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 0, 0]] and loss_mask.tolist() == [[1, 1, 0, 1, 1, 0, 0, 1]]
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]  # 8 sees 7 and itself


# --------------------------------------------------------------------------------------- 2. packed == alone
def packed_vs_alone(cfg, pack):
    """(per-token losses, gradients) of a packed batch's loss sum under `pack`, and of its documents run alone."""
    model = gpt.Model(gpt.Config(**cfg))
    batch = packed_batch(3, 20, seed=5)
    model.zero_grad()
    loss = contract.next_token_loss(model, batch, pack)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    mask, loss_mask, pos = pack(batch[:, :-1])
    with torch.no_grad():
        per_token = model(batch[:, :-1], batch[:, 1:], position_ids=pos, mask=mask) * loss_mask
    model.zero_grad()
    alone, total, n_docs = torch.zeros_like(per_token), 0.0, 0
    for r, row in enumerate(batch):
        for a, piece in documents(row):
            if len(piece) < 2:
                continue
            out = model(piece[None, :-1], piece[None, 1:])[0]  # [len - 1]: the document alone, from position 0
            out.sum().backward()
            alone[r, a:a + len(piece) - 1] = out.detach()
            total, n_docs = total + float(out.detach().sum()), n_docs + 1
    assert n_docs >= 6, f"only {n_docs} documents in the packed batch"
    sums = (loss.detach(), torch.tensor(total, dtype=f64))
    return sums, per_token, alone, got, {n: p.grad for n, p in model.named_parameters()}


def assert_packed_equals_alone(cfg, pack):
    sums, per_token, alone, got, ref = packed_vs_alone(cfg, pack)
    worst = max([(rel_err(*sums), "summed loss"), (rel_err(per_token, alone), "per-token loss")]
                + [(rel_err(got[n], ref[n]), n) for n in ref])
    assert worst[0] <= 1e-10, f"packed vs alone: worst relative error {worst[0]:.3e} > 1e-10 at {worst[1]}"


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["learned", "rope"])
def test_packed_documents_equal_documents_alone(cfg):
    assert_packed_equals_alone(cfg, data.Packing(EOD, **FLAGS))


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["learned", "rope"])
def test_plain_causal_mask_is_caught(cfg):
    """Negative control: with positions reset and EOD predictions masked but a plain causal mask, tokens see the
    previous documents in their window and the comparison fails."""
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_packed_equals_alone(cfg, data.Packing(EOD, reset_position_ids=True, eod_mask_loss=True))


def megatron_packed_case(rank, n, tp, seed=7, plain_mask=False):
    """A packed batch through Megatron-core's GPTModel (learned positions; position_ids and its True = masked
    attention mask from `_get_ltor_masks_and_position_ids`) and through ours (data.Packing), from one state dict."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids as megatron_masks
    from test_megatron_parity import (
        GPT2_LIKE,
        gather_logits,
        gather_megatron,
        load_into_megatron,
        megatron_gpt,
        megatron_on_cpu,
        seeded_full_state,
    )

    cfg = dict(GPT2_LIKE, vocab_size=GPT["vocab_size"], hidden_dropout=0.0, attention_dropout=0.0, params_dtype=f64)
    c, grid, batch = gpt.Config(**cfg), P.Grid(tp=tp, dp=n // tp), packed_batch(2, 16, seed=3)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    rows = [megatron_masks(row.clone(), EOD, True, True, True, True) for row in inputs]
    mega_mask, mega_loss_mask, mega_pos = (torch.stack(t) for t in zip(*rows))  # [b, 1, s, s], [b, s], [b, s]
    with megatron_on_cpu(tp, seed):
        mc = megatron_gpt(c, tp)
        full = seeded_full_state(mc, tp, seed)
        load_into_megatron(mc, full, tp, c.gated_linear_unit)
        ours = gpt.from_megatron(full, c, grid)
        logits = gather_logits(mc(inputs, mega_pos, mega_mask), tp)[..., : c.vocab_size]
        loss = mc(inputs, mega_pos, mega_mask, labels=labels) * mega_loss_mask  # [b, s]
        loss.sum().backward()
        ref = dict(logits=logits.detach(), loss=loss.detach(), grads=gather_megatron(mc, tp, c.gated_linear_unit))
        mask, loss_mask, pos = data.Packing(EOD, **FLAGS)(inputs)
        mask = None if plain_mask else mask  # negative control: ours causal, Megatron block-causal
        out = ours(inputs, position_ids=pos, mask=mask).detach()
        loss = contract.next_token_loss(ours, batch, data.Packing(EOD, **FLAGS))
        loss.backward()
        got = dict(logits=out, loss=ours(inputs, labels, position_ids=pos, mask=mask).detach() * loss_mask,
                   grads=named_full(ours, grid, grads=True))
    return (got, ref) if rank == 0 else None


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_batch_matches_megatron(pool, tp):
    """Megatron-core's own GPTModel on the same packed batch: logits, masked per-token loss, every gradient."""
    from test_megatron_parity import WORLD, assert_parity, compare

    got, ref = pool.run(megatron_packed_case, WORLD, tp=tp)[0]
    assert_parity(compare(got, ref), f"packed gpt2-like tp={tp}")


def test_plain_causal_mask_against_megatron_is_caught(pool):
    from test_megatron_parity import WORLD, assert_parity, compare

    got, ref = pool.run(megatron_packed_case, WORLD, tp=1, plain_mask=True)[0]
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_parity(compare(got, ref), "packed gpt2-like, our mask plain causal")


# --------------------------------------------------------------------------------------- 3. layouts == one process
def train_packed(grid, cfg, sp, vp, M, steps=2, local_count=False):
    """`steps` AdamW steps on one packed global batch, through train.py's recipe and parallel.forward_backward."""
    c = gpt.Config(**cfg, sequence_parallel=sp)
    chunks = P.build_chunks(lambda pre, post, off, n: gpt.Model(c, grid, pre, post, off, n), c.num_layers, grid, vp)
    opt = torch.optim.AdamW([p for m in chunks for p in m.parameters()], lr=1e-3, betas=(0.9, 0.95),
                            weight_decay=0.1, foreach=False)
    batch = packed_batch(8, 16, seed=11)
    args, corpus = argparse.Namespace(seq_length=16, **FLAGS), data.Corpus(None, GPT["vocab_size"], EOD)
    recipe, num_tokens = contract.next_token_recipe(batch, args, corpus)  # the loss tokens of the whole global batch
    assert num_tokens == int((batch[:, :-1] != EOD).sum()) < batch[:, :-1].numel()
    dp, tp = (grid.dp_size, grid.tp_size) if grid is not None else (1, 1)
    local = batch.chunk(dp)[grid.dp.rank if grid is not None else 0]
    if local_count:  # negative control: the DP rank's own loss tokens, scaled to the batch, as the denominator
        num_tokens = contract.next_token_recipe(local, args, corpus)[1] * dp
    shape = (16 // tp if chunks[0].config.sequence_parallel else 16, local.shape[0] // M, c.hidden_size)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = P.forward_backward(chunks, list(local.chunk(M)), lambda m, mb: train.stage_step(m, mb, recipe),
                                  num_tokens, grid, shape, f64)
        P.finalize_grads(chunks, grid)
        if grid is not None:
            loss = P.all_reduce(torch.as_tensor(loss, dtype=f64), grid.dp_cp)
        losses.append(torch.as_tensor(loss).detach().clone())
        grads = _named(chunks, grid, True) if step == 0 else grads
        opt.step()
    return dict(losses=torch.stack(losses), grads=grads, params=_named(chunks, grid, False),
                last=bool(chunks[-1].post_process))


def packed_case(rank, n, cfg, tp, pp, vp, M, sp, local_count=False):
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp))
    rec = train_packed(grid, cfg, sp, vp, M, local_count=local_count)
    return rec if grid.tp.rank == 0 and grid.dp.rank == 0 else None


@pytest.mark.parametrize("cfg,tp,pp,vp,M,sp,n", [
    (GPT, 2, 1, 1, 2, True, 2), (LLAMA, 1, 2, 1, 4, False, 2), (GPT, 1, 1, 1, 2, False, 2),
    (LLAMA, 2, 2, 1, 2, True, 4)], ids=["tp2-sp", "pp2", "dp2", "tp2-sp-pp2"])
def test_packed_training_under_layouts_equals_single_process(pool, cfg, tp, pp, vp, M, sp, n):
    got = merge(pool.run(packed_case, n, cfg=cfg, tp=tp, pp=pp, vp=vp, M=M, sp=sp))
    ref = train_packed(None, cfg, False, 1, 4)
    assert_same(got, ref, rtol=1e-10, what=f"packed, tp={tp} pp={pp} dp={n // (tp * pp)} sp={sp}")


def test_count_from_a_dp_ranks_own_rows_is_caught(pool):
    """Negative control: each DP rank dividing by its own loss-token count (×dp) instead of the global one."""
    got = merge(pool.run(packed_case, 2, cfg=GPT, tp=1, pp=1, vp=1, M=2, sp=False, local_count=True))
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_same(got, train_packed(None, GPT, False, 1, 4), rtol=1e-10, what="per-rank count")


# --------------------------------------------------------------------------------------- 4. flags
@pytest.mark.parametrize("argv,expect", [
    (["--model", "mamba", "--reset-attention-mask"], "--model mamba with --reset-attention-mask: Mamba's scan carries"),
    (["--reset-position-ids", "--position-embedding-type", "none"], "no positions to reset")])
def test_bad_packing_flags_are_refused(argv, expect):
    with pytest.raises(arguments.ConfigError, match=expect):
        arguments.check_args(arguments.parse_args(argv), 1)


def test_recipe_packs_only_with_the_flags():
    batch = packed_batch(4, 8, seed=2)
    plain, corpus = argparse.Namespace(seq_length=8, reset_position_ids=False, reset_attention_mask=False,
                                       eod_mask_loss=False), data.Corpus(None, GPT["vocab_size"], EOD)
    assert contract.next_token_recipe(batch, plain, corpus) == (contract.next_token_loss, 32)
    recipe, count = contract.next_token_recipe(batch, argparse.Namespace(**{**vars(plain), "reset_attention_mask": True}),
                                               corpus)
    assert recipe.keywords["pack"] == data.Packing(EOD, reset_attention_mask=True) and count == 32


def test_train_py_trains_on_packed_documents(tmp_path, monkeypatch):
    """End to end: the flags reach the recipe with the tokenizer's eod id, and every global batch (train and
    validation) is divided by its own count of loss tokens, fewer than its tokens (each row holds EODs)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"m{i:02d}.py").write_text(f"def f{i}(a):\n    return a * {i}\n")
    counts, real = [], data.Packing.num_loss_tokens
    monkeypatch.setattr(data.Packing, "num_loss_tokens", lambda self, batch: counts.append(
        (self.eod, real(self, batch), batch[:, :-1].numel())) or counts[-1][1])
    train.main(["--data-path", str(corpus), "--data-cache-dir", str(tmp_path / "cache"), "--vocab-size", "384",
                "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
                "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "2",
                "--eval-iters", "1", "--log-interval", "1", "--split", "70,30", "--save", str(tmp_path / "run"), *(
                    f"--{f.replace('_', '-')}" for f in FLAGS)])
    assert len(counts) == 3 and all(eod == EOD and 0 < n < total for eod, n, total in counts), counts
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(torch.isfinite(torch.tensor(list(json.loads(x).values()))).all() for x in lines)
