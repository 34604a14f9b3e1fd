"""Long context: RoPE scalings (transformer.py) against Hugging Face and Megatron, and activation recomputation
(transformer.py) against the model without it.

1. Scalings. gpt.from_hf of a random-weight LlamaForCausalLM with rope_parameters "linear", "llama3" and "yarn"
   (several key sets) gives HF's logits at 3x original_max_position_embeddings. Tolerance 1e-4 in float32, as
   tests/test_hf.py: the same float32 ops in other orders (measured 0 to 1.5e-7); the negative control, the same
   weights with unscaled rope, misses by 5e-3 to 8e-3. A rope_type or key we cannot represent is refused, naming
   it. The vectorised formulas are checked against a plain loop (llama3's three branches) and Megatron's own
   functions (llama3 scaling; YaRN's range, ramp and mscale; partial rotation).
2. Recomputation changes no number: losses, every gradient and the parameters after 2 steps are torch.equal
   (float32, dropout 0.3 ON) with and without it — full (uniform, block) and selective, under TP 2 + SP, PP 2 and
   PP 2 x VP 2; MoE and FP8 (delayed) in one process; any depth / method / N drawn by hypothesis — because the
   recompute replays the RNG streams (torch's default and the tracker's) saved at forward. Call counts prove the
   recompute ran (Megatron's uniform / block / selective semantics). Negative control: the same runs with the
   replay disabled draw other dropout masks, and the comparison fails.
3. Flags: arguments.py refuses bad combinations with one line; the flags reach the Config; the position-scaling
   flags are in checkpoint.ARCH_FLAGS, the recompute ones are not.

Run:    .venv/bin/python -m pytest -q tests/test_long_context.py
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from test_pipeline import train_pipelined

import gpt
import parallel as P
import transformer
import transformer as rope
from equivalence import make_batch, named_full, train_steps

# --------------------------------------------------------------------------------------- 1. scalings vs HF
ORIG = 32  # original_max_position_embeddings of the HF models; the tests run at 3·ORIG
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
    "llama3-factors": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                       "original_max_position_embeddings": ORIG},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
             "attention_factor": 0.1 * math.log(4.0) + 1.0},  # = the implied one: accepted
    "yarn-mscale-only": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "mscale": 0.8},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "beta_fast": 16,
                      "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-old-key": {"type": "yarn", "factor": 3.0, "original_max_position_embeddings": ORIG, "truncate": False},
}


def hf_llama(rope_parameters, head_dim=16):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4 * ORIG,
        rope_parameters=dict(rope_parameters, rope_theta=500.0))).eval()


@pytest.mark.parametrize("name", list(SCALINGS))
def test_from_hf_scaled_rope_logits_match_past_original_length(name):
    hf = hf_llama(SCALINGS[name])
    ours = gpt.from_hf(hf).eval()
    ids = make_batch(300, 2, 3 * ORIG - 1, seed=1)  # [2, 96]: three times the original context
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
        err = (got - ref).abs().max().item()
        assert err < 1e-4, f"{name}: {err:.2e}"
        plain = gpt.Model(dataclasses.replace(ours.config, position_embedding_type="rope", rope_scaling=False,
                                              seq_len_interpolation_factor=None))
        plain.load_state_dict(ours.state_dict())
        miss = (plain.eval()(ids) - ref).abs().max().item()  # negative control: the same weights, unscaled rope
    assert miss > 1e-3, f"{name}: unscaled rope agrees with HF to {miss:.1e}: the test could not see a scaling bug"


@pytest.mark.parametrize("params,named", [
    ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
    ({"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}, "longrope"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "extra": 1}, "extra"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "attention_factor": 2.0},
     "attention_factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_from_hf_refuses_rope_it_cannot_represent(params, named):
    hf = hf_llama({"rope_type": "default"})
    hf.config.rope_parameters = dict(params, rope_theta=500.0)  # set after construction: HF validates some types
    with pytest.raises(ValueError, match=named) as e:
        gpt.from_hf(hf)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------- the formulas themselves
def test_llama3_vectorised_equals_three_branch_loop():
    inv = 1.0 / (500.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    f, lo, hi, L = 8.0, 1.0, 4.0, 256
    want = []
    for t in inv.tolist():  # Meta's reference: by wavelength, keep / divide / blend
        wavelen = 2 * math.pi / t
        if wavelen < L / hi:
            want.append(t)
        elif wavelen > L / lo:
            want.append(t / f)
        else:
            s = (L / wavelen - lo) / (hi - lo)
            want.append((1 - s) * t / f + s * t)
    got = rope.llama3_inv_freq(inv, f, lo, hi, L)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=0)
    assert (got == inv).any() and (got == inv / f).any() and ((got != inv) & (got != inv / f)).any()  # all 3 cases


def test_scalings_equal_megatrons_functions():
    """Megatron's own code (pure functions and methods; its modules move tensors to CUDA in forward)."""
    emb = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    yarn = pytest.importorskip("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    d, base = 64, 10000.0
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    meg = emb.RotaryEmbedding._apply_scaling(None, inv.clone(), factor=8.0)  # its defaults: 1, 4, 8192
    assert torch.equal(rope.llama3_inv_freq(inv, 8.0, 1.0, 4.0, 8192), meg)
    for bf, bs, L, f, m, mad in [(32, 1, 4096, 40.0, 1.0, 0.0), (16, 2, 128, 4.0, 0.707, 1.0)]:
        assert rope.yarn_correction_range(bf, bs, d, base, L) == yarn._yarn_find_correction_range(bf, bs, d, base, L)
        low, high = yarn._yarn_find_correction_range(bf, bs, d, base, L)
        mask = 1.0 - yarn._yarn_linear_ramp_mask(low, high, d // 2)  # Megatron: inter·(1 − mask) + extra·mask
        want = (inv / f) * (1 - mask) + inv * mask
        assert torch.allclose(rope.yarn_inv_freq(inv, base, f, L, bf, bs), want, rtol=1e-6, atol=0)
        assert rope.yarn_mscale(f, m, mad) == yarn._yarn_get_concentration_factor(f, m, mad)
    x = torch.randn(5, 2, 3, 16, dtype=torch.float64)  # partial rotation: the first 8 of 16 dims
    freqs = torch.randn(5, 1, 1, 8, dtype=torch.float64)
    want = utils._apply_rotary_pos_emb_bshd(x, freqs)
    assert torch.allclose(rope.apply_rope(x, (freqs.cos(), freqs.sin())), want, rtol=0, atol=1e-14)


def test_rotary_percent_rotates_only_the_first_dims():
    c = gpt.Config(num_layers=1, hidden_size=64, num_attention_heads=2, position_embedding_type="rope",
                   rotary_percent=0.25)  # d = 32, r = 8
    cos, sin = gpt.Model.rope(type("M", (), {"config": c})(), 10, None)
    assert cos.shape == (10, 1, 1, 8)
    x = torch.randn(10, 1, 2, 32)
    y = rope.apply_rope(x, (cos, sin))
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., :8], x[..., :8])
    with pytest.raises(ValueError, match="rotary_percent=0.01"):
        gpt.Config(num_layers=1, hidden_size=64, num_attention_heads=2, rotary_percent=0.01)


# --------------------------------------------------------------------------------------- 2. recomputation
RC = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=101,
          max_position_embeddings=16, position_embedding_type="rope", normalization="RMSNorm", activation="silu",
          gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.3, attention_dropout=0.3,
          params_dtype=torch.float32)
FULL = dict(recompute_granularity="full")
RECOMPUTE = {"none": {}, "selective": dict(recompute_granularity="selective"),
             "uniform-2": dict(FULL, recompute_method="uniform", recompute_num_layers=2),
             "uniform-3": dict(FULL, recompute_method="uniform", recompute_num_layers=3),
             "block-1": dict(FULL, recompute_method="block", recompute_num_layers=1)}


def expected_calls(name, L):
    """(layer forwards, attention-core calls) per training step of a stage of L layers: every layer runs once
    forward; full recomputation runs its recomputed layers again in backward, selective only the attention core."""
    again = {"none": 0, "selective": 0, "block-1": min(1, L)}.get(name, L)  # uniform: every layer, in chunks
    return L + again, L + (L if name == "selective" else again)


def recompute_case(rank, n, tp, pp, sp, names, vp=1, no_replay=False, cfg=RC, steps=2):
    """Train each recompute setting `steps` steps from the same start (dropout on), in a tp x pp (x vp) layout; per
    setting its record (losses, full gradients, parameters), how often layers and attention cores ran, and the
    layers of one model chunk (recomputation acts per chunk, as Megatron's per TransformerBlock)."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp)) if n > 1 else None
    calls = {"layer": 0, "core": 0}
    real = (transformer.TransformerLayer.forward, transformer.Attention.core_attention, transformer.set_rng_state)

    def layer(self, *a, **k):
        calls["layer"] += 1
        return real[0](self, *a, **k)

    def core(self, *a, **k):
        calls["core"] += 1
        return real[1](self, *a, **k)

    transformer.TransformerLayer.forward, transformer.Attention.core_attention = layer, core
    if no_replay:  # negative control: the recompute draws from wherever the streams are at backward time
        transformer.set_rng_state = lambda rng, device, state: None
    out = {}
    try:
        for name in names:
            calls.update(layer=0, core=0)
            c = dict(cfg, **RECOMPUTE[name])
            if pp == 1:
                model = gpt.Model(gpt.Config(**c, sequence_parallel=sp), grid)
                rec = train_steps(model, grid, make_batch(c["vocab_size"], 4, 8, seed=5), steps=steps)
                L = len(model.decoder.layers)
            else:
                rec = train_pipelined(grid, c, sp, vp, M=2, b=4, s=8, steps=steps)
                rec = {k: rec[k] for k in ("losses", "grads", "params")}
                L = c["num_layers"] // (pp * vp)
            out[name] = dict(rec, calls=(calls["layer"], calls["core"]), L=L, chunks=vp)
    finally:
        transformer.TransformerLayer.forward, transformer.Attention.core_attention, transformer.set_rng_state = real
    return out


def bit_identical(a, b) -> bool:
    assert set(a["grads"]) == set(b["grads"]) and a["grads"], "records of different models"
    return torch.equal(a["losses"], b["losses"]) and all(
        torch.equal(a[k][name], b[k][name]) for k in ("grads", "params") for name in b[k])


LAYOUTS = {"tp2-sp": dict(tp=2, pp=1, sp=True), "pp2": dict(tp=1, pp=2, sp=False),
           "pp2-vp2": dict(tp=1, pp=2, sp=False, vp=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recompute_changes_no_number(pool, layout):
    """float32, dropout 0.3 (hidden and attention): every setting's losses, gradients and parameters after 2 steps
    are torch.equal to the run without recomputation, on every rank; and the recomputation did run (call counts)."""
    names = [k for k in RECOMPUTE if not (layout != "tp2-sp" and k == "uniform-3")]  # 3 > a stage's 2 layers
    for r, res in enumerate(pool.run(recompute_case, 2, **LAYOUTS[layout], names=names)):
        for name in names:
            chunks, micro = res[name]["chunks"], 1 if layout == "tp2-sp" else 2  # pipelines: 2 micro-batches
            want = tuple(2 * micro * chunks * x for x in expected_calls(name, res[name]["L"]))  # two steps
            assert res[name]["calls"] == want, f"{layout} rank {r} {name}: (layer, core) calls {res[name]['calls']}"
            assert bit_identical(res[name], res["none"]), f"{layout} rank {r}: {name} changed a number"


def test_recompute_without_rng_replay_changes_numbers(pool):
    """Negative control: the recompute without the saved RNG states draws other dropout masks, so the gradients
    differ from the run without recomputation — the comparison above can fail."""
    names = ["none", "selective", "uniform-2"]
    for layout in LAYOUTS.values():
        for r, res in enumerate(pool.run(recompute_case, 2, **layout, names=names, no_replay=True, steps=1)):
            for name in names[1:]:
                assert not bit_identical(res[name], res["none"]), f"{layout} rank {r}: {name} matched without replay"


def test_recompute_moe_single_process():
    """MoE layers (router, aux loss injected in backward) under full recomputation: bit-identical too."""
    cfg = dict(RC, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, hidden_dropout=0.3)
    res = recompute_case(0, 1, 1, 1, False, ["none", "uniform-2"], cfg=cfg)
    assert bit_identical(res["uniform-2"], res["none"]), "MoE: full recomputation changed a number"


# --------------------------------------------------------------------------------------- 3. flags
@pytest.mark.parametrize("flags,expect", [
    (["--recompute-method", "block"], "--recompute-method=block / --recompute-num-layers=None need "
                                      "--recompute-granularity full (it is None)"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "need --recompute-granularity full"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3",
      "--pipeline-model-parallel-size", "2"], "--recompute-num-layers=3 > the 2 layers of a pipeline stage"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     "--recompute-num-layers=0 must be >= 1"),
    (["--recompute-granularity", "everything"], "invalid choice: 'everything'"),
    (["--yarn-beta-fast", "16"], "--yarn-beta-fast need --position-embedding-type yarn (it is rope)"),
    (["--rope-scaling-factor", "4", "--use-rope-scaling", "--position-embedding-type", "yarn"],
     "need --position-embedding-type rope (it is yarn)"),
    (["--rope-scaling-factor", "4"], "--rope-scaling-factor=4.0 acts only with --use-rope-scaling"),
    (["--use-rope-scaling", "--rope-scaling-factor", "0.5"], "--rope-scaling-factor=0.5 must be >= 1"),
    (["--rotary-percent", "0.3"], "rotary_percent=0.3 must be in (0, 1] and rotate an even number"),
    (["--rotary-percent", "0.5", "--position-embedding-type", "learned_absolute"], "need a rotary"),
    (["--position-embedding-type", "yarn", "--rotary-seq-len-interpolation-factor", "2"],
     "does not apply to yarn"),
])
def test_bad_long_context_flags_give_one_line(flags, expect):
    import arguments

    with pytest.raises(arguments.ConfigError) as e:
        arguments.check_args(arguments.parse_args(flags), 2 if "--pipeline-model-parallel-size" in flags else 1)
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_long_context_flags_reach_the_config():
    import arguments
    import checkpoint
    import config as contract

    a = arguments.parse_args(["--position-embedding-type", "yarn", "--yarn-rotary-scaling-factor", "4",
                              "--yarn-original-max-position-embeddings", "64", "--rotary-percent", "0.5",
                              "--recompute-granularity", "full", "--recompute-method", "block",
                              "--recompute-num-layers", "2"])
    a = arguments.check_args(a, 1)
    c = arguments.model_config(contract.model_file(a.model), a, vocab_size=1000)
    assert (c.position_embedding_type, c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings,
            c.rotary_percent, c.recompute_method, c.recompute_num_layers) == ("yarn", 4.0, 64, 0.5, "block", 2)
    assert c.yarn_beta_fast == 32.0  # an unset flag leaves the Config default
    b = arguments.parse_args(["--use-rope-scaling", "--rope-scaling-factor", "16"])
    b = arguments.check_args(b, 1)
    c = arguments.model_config(contract.model_file(b.model), b, vocab_size=1000)
    assert c.rope_scaling and c.rope_scaling_factor == 16.0
    flags = set(checkpoint.ARCH_FLAGS)
    assert {"rotary_percent", "rope_scaling", "yarn_rotary_scaling_factor", "seq_len_interpolation_factor"} <= flags
    assert not any(k.startswith("recompute") for k in flags)  # recomputation changes no number: not architecture
    assert all(k in vars(a) for k in flags), "an ARCH_FLAGS entry is no flag's dest"


def test_recompute_fp8_delayed_single_process():
    """FP8 delayed scaling records amaxes only in grad mode (DESIGN.md §5): under recomputation the no-grad forward
    records none and the recompute records the same values in backward, so the scales, and every number, agree."""
    def run(name):
        model = gpt.Model(gpt.Config(**dict(RC, **RECOMPUTE[name])))
        state = P.fp8_enable(model, P.FP8Recipe("hybrid", "delayed"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch, losses = make_batch(RC["vocab_size"], 4, 8, seed=5), []
        for step in range(3):
            opt.zero_grad()
            loss = model(batch[:, :-1], labels=batch[:, 1:]).mean()
            loss.backward()
            state.update()
            losses.append(loss.detach())
            if step == 0:
                grads = named_full(model, None, grads=True)
            opt.step()
        return dict(losses=torch.stack(losses), grads=grads, params=named_full(model, None))

    ref = run("none")
    for name in ("uniform-2", "selective"):
        assert bit_identical(run(name), ref), f"FP8 delayed: {name} changed a number"


@pytest.mark.parametrize("model", ["t5", "mamba", "retro"])
def test_full_recompute_refused_where_the_stack_is_not_decoder(model):
    """Their stacks do not run transformer.Decoder.forward, so full recomputation would silently do nothing there."""
    import importlib

    cls = importlib.import_module(model).Config
    with pytest.raises(ValueError, match=f"'full' is not implemented for {model}'s layer stack"):
        cls(num_layers=6, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    cls(num_layers=6, recompute_granularity="selective")  # their attention is transformer.Attention


@st.composite
def recompute_settings(draw):
    L = draw(st.integers(1, 4))
    g = draw(st.sampled_from(["full", "selective"]))
    extra = {} if g == "selective" else dict(recompute_method=draw(st.sampled_from(["uniform", "block"])),
                                             recompute_num_layers=draw(st.integers(1, L)))
    return L, dict(recompute_granularity=g, **extra), draw(st.sampled_from([0.0, 0.2])), draw(st.booleans())


@given(recompute_settings())
def test_recompute_any_setting_single_process(setting):
    """Any depth, method and N (one process, float32, 1 step; gated or plain MLP, dropout on or off): bit-identical."""
    L, rc, p, gated = setting
    cfg = dict(RC, num_layers=L, hidden_dropout=p, attention_dropout=p, gated_linear_unit=gated)
    recs = []
    for extra in ({}, rc):
        model = gpt.Model(gpt.Config(**cfg, **extra))
        recs.append(train_steps(model, None, make_batch(RC["vocab_size"], 2, 8, seed=L), steps=1))
    assert bit_identical(recs[1], recs[0]), f"{setting}"
