"""Quantized weights (posttraining/quantization.py): NF4 against its published code book, the int formats, the bytes.

  - NF4: a weight made of code-book values times its block's absmax gets exactly those codes back, and dequantizes
    to them within the double quantization's step on the absmax; any weight dequantizes within half the code book's
    widest gap of its block's absmax (plus that step); the stored bytes of the default model's linears are
    4.1-4.5 bits a weight;
  - int8 (row-wise) and int4 (groups of 128): within half a step of the scale, 8-8.5 and 4.25-4.5 bits a weight.
Tolerances: exact codes; error bounds as derived above with 1e-6 relative slack (float32 arithmetic).
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_lora import CFG, CLIP, LLAMA, OPT, adapt, lora_case, losses, merge_results, tiny

import checkpoint
import gpt
import parallel as P
import train
from equivalence import assert_same, make_batch, reference_steps, rel_err
from posttraining import lora
from posttraining import quantization as Q


def nf4_codes(q: Q.NF4Weight) -> torch.Tensor:
    return Q._unpack4(q.codes)


def test_nf4_code_book_values_get_their_codes_back_exactly():
    g = torch.Generator().manual_seed(0)
    want = torch.randint(0, 16, (48, 128), generator=g)  # 96 blocks of 64, every code
    want[:, 0], want[:, 64] = 15, 0  # each block holds +1 or -1 times its scale: its absmax is the scale exactly
    a = torch.rand(48, 2, generator=g) + 0.5  # each block's absmax
    w = Q.NF4[want] * a.repeat_interleave(64, 1)
    q = Q.NF4Weight(w)
    assert torch.equal(nf4_codes(q).view(48, 128), want)
    step = q.absmax_scale.max() / 2  # the double quantization's rounding of the absmax: at most half a step
    assert 0 < (q.absmax() - a.reshape(-1)).abs().max() <= step * (1 + 1e-6)
    assert (q.dequantize() - w).abs().max() <= step * (1 + 1e-6)


def test_nf4_round_trip_error_is_within_half_the_widest_gap():
    w = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) ** 3  # heavy-tailed; 3000 = 46.9 blocks
    q = Q.NF4Weight(w)
    a = w.reshape(-1)
    a = torch.nn.functional.pad(a, (0, -len(a) % 64)).view(-1, 64).abs().amax(1).repeat_interleave(64)[:3000]
    half_gap = (Q.NF4[1:] - Q.NF4[:-1]).max() / 2  # 0.152: between -1 and -0.696
    bound = half_gap * a + q.absmax_scale.max() / 2
    err = (q.dequantize() - w).reshape(-1).abs()
    assert (err <= bound * (1 + 1e-6)).all(), float((err - bound).max())
    assert err.max() > 0.5 * (half_gap * a).max() * 0.1  # the check above is not vacuous: rounding does happen


def test_int_formats_round_trip_within_half_a_step():
    w = torch.randn(64, 300, generator=torch.Generator().manual_seed(2))
    for fmt, bits, top in (("int8", 8, 127), ("int4", 4, 7)):
        q = Q.SERVING[fmt](w)
        scale = q.scale.repeat_interleave(128, 1)[:, :300]
        assert ((q.dequantize() - w).abs() <= scale / 2 * (1 + 1e-6)).all(), fmt
        codes = (Q._unpack4(q.codes) if bits == 4 else q.codes.long()) - (top + 1)  # stored offset: unsigned
        assert codes.abs().max() == top, fmt  # a group's absmax maps to +-top, nothing beyond
    q = Q.FORMATS["int8"](w)  # QLoRA's int8 base: bitsandbytes' row-wise absmax
    assert q.scale.shape == (64, 1) and torch.allclose(q.scale[:, 0], w.abs().amax(1) / 127)


@pytest.mark.parametrize("make", [Q.FORMATS["nf4"], Q.FORMATS["int8"], Q.SERVING["int4"]], ids=["nf4", "int8", "int4"])
def test_a_tp_shard_holds_its_slice_of_the_whole_weights_values(make):
    """The codes of the whole weight, sliced as parallel.shard slices it (rows, rows with SwiGLU's stride 2, columns):
    every layout holds the same dequantized values, bit for bit."""
    w = torch.randn(48, 320, generator=torch.Generator().manual_seed(3))
    whole = make(w).dequantize()
    for dim, stride in ((0, 1), (0, 2), (1, 1)):
        for r in range(2):
            assert torch.equal(make(w, (dim, stride, r, 2)).dequantize(), P.shard(whole, dim, stride, r, 2))


def test_bytes_of_the_default_models_linears():
    """The default run's linears (h 256, SwiGLU 704; `make train`), one layer of them: their bytes."""
    model = gpt.Model(gpt.Config(num_layers=1, hidden_size=256, num_attention_heads=8, ffn_hidden_size=704,
                                 vocab_size=256, gated_linear_unit=True, activation="silu", add_bias_linear=False))
    numel = sum(m.weight.numel() for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in lora.TARGETS)
    assert Q.linear_weight_bytes(model) == 4 * numel  # float32
    for fmt, lo, hi in (("nf4", 4.1, 4.5), ("int8", 8.0, 8.5)):
        m = copy.deepcopy(model)
        assert Q.quantize_linears(m, fmt) == Q.linear_weight_bytes(m)
        bits = 8 * Q.linear_weight_bytes(m) / numel
        assert lo <= bits <= hi, (fmt, bits)
    m = copy.deepcopy(model)
    Q.quantize_linears(m, "int4", Q.SERVING)
    assert 4.25 <= 8 * Q.linear_weight_bytes(m) / numel <= 4.5


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_served_model_runs_the_dequantized_weights(fmt):
    """server.py --quantization: the quantized model's logits are those of the same model holding the dequantized
    weights, bit for bit, and the engine's greedy tokens too; the linears' bytes are 8.25 / 4.25 bits a weight."""
    from serving import engine as serve
    from serving import server

    assert server.parse_args(["--load", "RUN", "--quantization", fmt]).quantization == fmt
    model = gpt.Model(gpt.Config(**dict(LLAMA, params_dtype=torch.float32, hidden_size=128, num_layers=2,
                                        ffn_hidden_size=256))).eval()
    fake = copy.deepcopy(model)
    full = Q.linear_weight_bytes(model)
    assert 32 * Q.quantize_linears(model, fmt, Q.SERVING) / full == {"int8": 8.25, "int4": 4.25}[fmt]
    Q.fake_quantize(fake, fmt, Q.SERVING)
    ids = make_batch(211, 2, 12, 4)[:, :-1]
    with torch.no_grad():
        assert torch.equal(model(ids), fake(ids))
    params = serve.SamplingParams(max_tokens=6, temperature=0)
    assert serve.generate_one(model, ids[0].tolist(), params) == serve.generate_one(fake, ids[0].tolist(), params)


# --------------------------------------------------------------------------------------- QLoRA against one process
def qlora_reference(cfg, M, fmt, b=8, s=8, steps=2):
    """One process, plain LoRA (test_lora.reference) on the dequantized base: each linear's weight W := deq(quant(W))
    (fmt None: the full-precision base)."""
    model = adapt(gpt.Model(gpt.Config(**cfg)))
    if fmt is not None:
        Q.fake_quantize(model, fmt)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    return reference_steps(model, opt, list(batch.chunk(M)), batch[:, 1:].numel(), CLIP, steps)


@pytest.mark.parametrize("fmt,n,cfg,tp,pp,sp,distopt", [
    ("nf4", 1, LLAMA, 1, 1, False, None),  # one process: QLoRA = LoRA on the dequantized base
    ("int8", 2, LLAMA, 2, 1, True, None),  # tp 2 (sequence parallel)
    ("nf4", 2, LLAMA, 2, 1, False, None),  # tp 2
    ("nf4", 4, CFG, 2, 1, True, True),  # tp 2 (sequence parallel, biases) x dp 2, distributed optimizer
    ("int8", 4, LLAMA, 1, 2, False, True),  # pp 2 x dp 2, distributed optimizer
], ids=["nf4-tp1", "int8-tp2-sp", "nf4-tp2", "nf4-tp2-sp-dp2-distopt", "int8-pp2-dp2-distopt"])
def test_qlora_training_equals_single_process(pool, fmt, n, cfg, tp, pp, sp, distopt):
    """Losses, every adapter's first gradient, the clipped norms and the adapters after 2 AdamW steps (float64)."""
    got = merge_results(pool.run(lora_case, n, cfg=cfg, tp=tp, pp=pp, vp=1, M=2, sp=sp, distopt=distopt, quantize=fmt))
    ref = qlora_reference(cfg, 2 * (n // (tp * pp)), fmt)
    assert_same(got, ref, rtol=1e-10, what=f"QLoRA {fmt} n={n} tp={tp} pp={pp} sp={sp} distopt={distopt}")
    assert rel_err(got["norms"], ref["norms"]) < 1e-10, (got["norms"], ref["norms"])


def test_negative_control_qlora_against_the_full_precision_base_fails(pool):
    got = merge_results(pool.run(lora_case, 2, cfg=LLAMA, tp=2, pp=1, vp=1, M=2, sp=False, distopt=None,
                                 quantize="nf4"))
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_same(got, qlora_reference(LLAMA, 2, None), rtol=1e-10, what="QLoRA against LoRA on the unquantized base")


# --------------------------------------------------------------------------------------- through train.py
@pytest.fixture(scope="module")
def base_run(corpus, cache, tmp_path_factory):
    """A tiny pretrained run (test_lora.tiny's shape, 4 iterations): the base the QLoRA runs below adapt."""
    base = tmp_path_factory.mktemp("base")
    train.main(tiny(corpus, cache, base))
    return corpus, cache, base


QLORA = ["--lora-rank", "4", "--lora-alpha", "8", "--quantize-base", "nf4", "--pretrained-checkpoint"]  # + the base


def test_qlora_run_resumes_and_tp2_matches_one_process(base_run, tmp_path, capsys):
    """`make train ARGS="--lora-rank 8 --quantize-base nf4 --pretrained-checkpoint runs/gpt"` in small: the base held
    in NF4 (4.1-4.5 bits a weight), adapters only in the checkpoint, stop + resume = uninterrupted; at TP 2 + SP the
    losses within 1e-5 of one process (float32, the order of reductions only: the ranks hold the whole weight's codes)."""
    from harness import torchrun

    corpus, cache, base = base_run
    whole, run = tmp_path / "whole", tmp_path / "run"
    train.main(tiny(corpus, cache, whole, *QLORA, str(base), "--load", str(whole), iters=4))
    said = capsys.readouterr().out
    held, full = (int(x.replace(",", "")) for x in re.search(r"in nf4: ([\d,]+) bytes .*full precision: ([\d,]+)",
                                                            said).groups())
    assert 4.1 <= 32 * held / full <= 4.5, (held, full)
    train.main(tiny(corpus, cache, run, *QLORA, str(base), "--load", str(run), iters=2))
    train.main(tiny(corpus, cache, run, "--load", str(run), iters=4))  # --quantize-base nf4 from the checkpoint
    assert losses(run) == losses(whole)
    saved = dcp.FileSystemReader(str(run / "iter_0000004")).read_metadata().state_dict_metadata
    assert saved and all(".lora." in k for k in saved if k.startswith("model.")), "the checkpoint holds non-adapters"
    adapted, merged = checkpoint.load_model(whole, merge=False).model, checkpoint.load_model(whole).model
    plain = checkpoint.load_model(base).model
    w = "decoder.layers.0.self_attention.linear_qkv.weight"
    ids = make_batch(384, 2, 16, 3)[:, :-1]
    with torch.no_grad():  # the adapters sit on the dequantized base, and merge into it
        assert torch.equal(adapted.get_parameter(w), Q.NF4Weight(plain.get_parameter(w)).dequantize())
        assert rel_err(merged(ids), adapted(ids)) < 1e-5
    torchrun(2, tiny(corpus, cache, tmp_path / "tp2", *QLORA, str(base), "--tensor-model-parallel-size", "2",
                     "--sequence-parallel", iters=4))
    one, two = losses(whole), losses(tmp_path / "tp2")
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    assert all(abs(one[k] - two[k]) <= 1e-5 * abs(one[k]) for k in one), (one, two)
    lora_run = tmp_path / "lora"  # the same run on the full-precision base: close, but not the same numbers
    train.main(tiny(corpus, cache, lora_run, *QLORA[:4], "--pretrained-checkpoint", str(base), iters=4))
    assert 0 < abs(losses(lora_run)[4] - one[4]) < 0.05 * one[4], (losses(lora_run), one)


@pytest.mark.parametrize("case,expect", [
    (["--quantize-base", "nf4"], "--quantize-base nf4 stores a LoRA run's frozen base quantized (QLoRA): add --lora-rank"),
    (["--quantize-base", "nf4", "--lora-rank", "2", "--fp8", "--load", "BASE"], "--quantize-base nf4 with --fp8"),
    (["--quantize-base", "int4", "--lora-rank", "2"], "argument --quantize-base: invalid choice: 'int4'"),
])
def test_quantize_base_refusals_are_one_line(base_run, tmp_path, capsys, case, expect):
    corpus, cache, base = base_run
    with pytest.raises(SystemExit) as e:
        train.main(tiny(corpus, cache, tmp_path / "run", *[str(base) if a == "BASE" else a for a in case]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and expect in err[0], err


# --------------------------------------------------------------------------------------- AWQ
def test_awq_scales_keep_the_model_and_beat_round_to_nearest():
    """awq_scale folds s into the weights and 1/s into the op before them: the full-precision logits stay (float64,
    1e-12); each scaled linear's int4 output error on its calibration inputs is at most round-to-nearest's (a = 0 is
    on the grid), and below it where a few input channels are large (the case AWQ is for)."""
    cfg = dict(LLAMA, hidden_size=128, ffn_hidden_size=256, num_layers=2)
    model = gpt.Model(gpt.Config(**cfg))
    with torch.no_grad():  # a few outlier input channels, as trained LLMs have (AWQ's observation)
        for m in model.modules():
            if hasattr(m, "input_layernorm"):
                m.input_layernorm.weight[:4] = 20.0
    ids = make_batch(211, 8, 15, 6)[:, :-1]
    x = {}
    lin = model.decoder.layers[0].self_attention.linear_qkv
    h = lin.register_forward_hook(lambda mod, inp, out: x.update(x=inp[0].reshape(-1, 128)))
    with torch.no_grad():
        before = model(ids)
    h.remove()
    w0 = lin.weight.detach().clone()
    chosen = Q.awq_scale(model, ids.split(4))
    with torch.no_grad():
        assert rel_err(model(ids), before) < 1e-12
    assert len(chosen) == 3 * 2 and chosen["decoder.layers.0.self_attention.linear_qkv"] > 0

    def err(w, s):  # int4 output error of weights w·s on inputs x/s
        return float(((x["x"] / s) @ Q.SERVING["int4"](w * s).dequantize().T - x["x"] @ w0.T).pow(2).mean())

    s = (lin.weight.detach() / w0)[0]  # the chosen per-channel scale (W := W·s)
    assert err(w0, s) < 0.9 * err(w0, torch.ones(128, dtype=torch.float64))


@pytest.mark.parametrize("group", [None, 96])
def test_awq_clip_lowers_the_output_error_and_is_the_best_on_its_grid(group):
    """awq_clip on a layer with outlier weights (a few per group, as trained LLMs have): int4 of the clipped fc2 gives
    outputs closer to the unclipped full-precision fc2's on its calibration inputs than int4 of it unclipped (the same
    bits); each row's and group's chosen ratio is the one of smallest error on the grid (the plain oracle: each ratio
    tried in turn, by hand; 1e-5 relative: the sums' order); linear_qkv is left as it was (AutoAWQ skips q and k).
    `group`: the int4 searched for and applied — None: the export's (128 here); 96, which does not divide fc2's 256
    input features: groups of 96, 96 and 64, as IntWeight pads the last (the bench's int4 at 128 on a width of 704).
    Negative control: a ratio one grid step off the chosen one has a larger error somewhere (the grid is not flat)."""
    cfg = dict(LLAMA, hidden_size=128, ffn_hidden_size=256, num_layers=2)
    model = gpt.Model(gpt.Config(**cfg))
    fc2, qkv = model.decoder.layers[0].mlp.linear_fc2, model.decoder.layers[0].self_attention.linear_qkv
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        fc2.weight.view(-1)[torch.randperm(fc2.weight.numel(), generator=g)[:200]] *= 12.0
    ids, x = make_batch(211, 8, 15, 6)[:, :-1], {}
    h = fc2.register_forward_hook(lambda mod, inp, out: x.update(x=inp[0].reshape(-1, 256).detach().clone()))
    with torch.no_grad():
        model(ids)
    h.remove()
    w0, qkv0 = fc2.weight.detach().clone(), qkv.weight.detach().clone()
    chosen, g = Q.awq_clip(model, ids.split(4), group=group), group or 128  # (g: the int4 group from here on)
    assert set(chosen) == {f"decoder.layers.{i}.{n}" for i in (0, 1) for n in ("self_attention.linear_proj",
                                                                             "mlp.linear_fc1", "mlp.linear_fc2")}
    assert torch.equal(qkv.weight, qkv0)
    r, ref, ngroups = chosen["decoder.layers.0.mlp.linear_fc2"], x["x"] @ w0.T, -(-256 // g)  # [128 rows, groups]
    err = lambda w: float((x["x"] @ Q.IntWeight(w, 4, g).dequantize().T - ref).pow(2).mean())
    clipped, plain = err(fc2.weight.detach()), err(w0)
    assert r.shape == (128, ngroups) and r.min() < 1.0 and clipped < 0.9 * plain, (clipped, plain)
    grid = (1 - torch.arange(10) / 20).tolist()  # AutoAWQ's: 20 points, shrinking to half at most (float32's values)

    def group_err(row, grp, ratio):  # int4 of one row's group clipped at ratio x its absmax: its outputs' error
        w, xs = w0[row, g * grp:g * (grp + 1)], x["x"][:, g * grp:g * (grp + 1)]
        t = ratio * float(w.abs().max())
        q = Q.IntWeight(w.clamp(-t, t)[None], 4, g).dequantize()[0]
        return float((xs @ q - xs @ w).pow(2).mean())
    worse = 0
    for row in range(0, 128, 8):
        for grp in range(ngroups):
            errs = [group_err(row, grp, ratio) for ratio in grid]
            k = grid.index(float(r[row, grp]))  # the chosen ratio: the smallest error (float32's summation order aside)
            assert errs[k] <= min(errs) * (1 + 1e-5), (row, grp, grid[k], errs)
            worse += errs[min(k + 1, 9)] > errs[k] or errs[max(k - 1, 0)] > errs[k]  # (the negative control)
    assert worse > 0


def test_awq_export_loads_in_transformers_with_our_logits(corpus, cache, tmp_path):
    """tools.py export --quantization awq: a compressed-tensors pack-quantized folder; transformers' logits equal
    ours on the same AWQ-int4 weights, clipped (float32, 1e-4). --no-awq-apply-clip writes the same scales for q, k
    and v (never clipped) and larger ones than the clipped export's for the other linears somewhere (never smaller)."""
    import transformers

    import tools

    run = tmp_path / "run"
    train.main(tiny(corpus, cache, run, "--hidden-size", "128", iters=2))
    tools.main(["export", "--load", str(run), "--hf-out", str(tmp_path / "hf"), "--quantization", "awq"])
    config = (tmp_path / "hf" / "config.json").read_text()
    assert '"format": "pack-quantized"' in config and '"group_size": 128' in config
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = tools.awq_scaled(checkpoint.load_model(run), run)
    Q.quantize_linears(ours, "int4", Q.SERVING)
    ids = make_batch(384, 2, 16, 3)[:, :-1]
    with torch.no_grad():
        assert rel_err(hf_model(ids).logits, ours(ids)) < 1e-4
    from safetensors.torch import load_file
    tools.main(["export", "--load", str(run), "--hf-out", str(tmp_path / "plain"), "--quantization", "awq",
                "--no-awq-apply-clip"])
    clipped, plain = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "plain"))
    scales = [k for k in clipped if k.endswith("weight_scale")]
    qkv = [k for k in scales if re.search(r"\.[qkv]_proj\.", k)]
    assert len(qkv) == 3 * 2 and all(torch.equal(clipped[k], plain[k]) for k in qkv)
    assert all((clipped[k] <= plain[k]).all() for k in scales) and any((clipped[k] < plain[k]).any() for k in scales)
