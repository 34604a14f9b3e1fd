"""FP8 (parallel.py section 11): the FP8 GEMM against float64 within the formats' bounds, the delayed-scaling recipe
on a scripted sequence, FP8 under TP/SP equal to FP8 on one process, and the Transformer Engine backend.

Error bound of one cast (round to nearest): |q(t)/s − t| ≤ u·|t| + η/s, with u = 2^-(m+1) the unit roundoff of m
mantissa bits (e4m3: 2^-4, e5m2: 2^-3) and η half the smallest subnormal (e4m3: 2^-10, e5m2: 2^-17): values below
the normal range keep an absolute error. A GEMM of two casts then errs by at most, element-wise,
    |Ŷ − Y| ≤ eX·(|W| + eW)ᵀ + |X|·eWᵀ + k·2^-23·|X̂|·|Ŵ|ᵀ     (eX, eW the per-element cast bounds; fp32 accumulation)
Tolerance of the TP test: given equal scales (the amax all-reduce) the casts are bit-equal and only the order of
sums differs, so 1e-5 relative (the float32 rule, DESIGN.md §2; measured ≤ 3.1e-7: _scaled_mm accumulates in fp32).
The models run with float64 master weights and activations: an FP8 cast is a step function, and in float32 a
1-ulp difference from another summation order (or a scale 1 ulp apart, amaxes of such tensors) sometimes moves a
value across an FP8 rounding boundary — measured: tp 4 + sp, grads 2e-2 apart after one step. In float64 only the
GEMMs' own fp32 accumulation differs between layouts, and with these shapes no cast flips. Tensorwise (current)
scaling re-derives every scale from the live tensor and compounds such flips (measured in float64: grad-output
scales 4e-5 apart after two steps), so the property test uses delayed scaling; tensorwise serves the negative control.
"""
from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch

import gpt
import parallel as P
import train
from equivalence import assert_same, make_batch, named_full, train_steps
from harness import metrics, tiny, torchrun

U = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}  # unit roundoff 2^-(mantissa bits + 1)
ETA = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}  # half the smallest subnormal


def gemm_bound(a, b, da, db, sa, sb):  # a [M, k], b [k, n] (float64), their fp8 dtypes and scales -> [M, n]
    ea, eb = U[da] * a.abs() + ETA[da] / sa, U[db] * b.abs() + ETA[db] / sb
    acc = a.shape[1] * 2.0**-23 * ((a.abs() + ea) @ (b.abs() + eb))
    return ea @ (b.abs() + eb) + a.abs() @ eb + acc


# --------------------------------------------------------------------------------------- 1. the FP8 GEMM
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_gemm_within_format_bound_forward_and_backward(fmt):
    g = torch.Generator().manual_seed(0)
    M, k, n = 48, 64, 40
    x = (torch.randn(M, k, generator=g) * torch.logspace(-3, 1, k)).requires_grad_()  # many magnitudes
    w = (torch.randn(n, k, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(M, n, generator=g) * 1e-3
    layer = P.ColumnParallelLinear(k, n, bias=False)
    layer.weight.data.copy_(w.detach())
    state = P.fp8_enable(layer, P.FP8Recipe(format=fmt, recipe="tensorwise"))
    meta = layer.linear_impl
    y = layer(x)
    xq, wq, sx, sw = y.grad_fn.next_functions[0][0].saved_tensors  # _FP8Linear's (under the reshape's view)
    y.backward(dy)
    # the saved operands really are float8, on the e4m3 grid: dequantized, they reproduce the GEMM output
    assert xq.dtype == wq.dtype == torch.float8_e4m3fn and meta.grad_output.dtype == P.FP8_DTYPES[
        "e5m2" if fmt == "hybrid" else "e4m3"] and state.tensors()[0] is meta.input
    assert float(sx) == float(448.0 / x.detach().abs().max()) and float(sw) == float(448.0 / w.detach().abs().max())
    deq = (xq.double() / float(sx)) @ (wq.double() / float(sw)).t()
    assert float((y.detach().double() - deq).abs().max() / deq.abs().max()) < 1e-6  # fp32 accumulation only
    # float64 reference and the bound
    X, W, dY = x.detach().double(), w.detach().double(), dy.double()
    e4, dg = torch.float8_e4m3fn, meta.grad_output.dtype
    sg = float(P.FP8TensorMeta(meta.grad_output.recipe, "grad_output", ()).compute_scale(dy.abs().max()))
    checks = [("Y", y, X @ W.t(), gemm_bound(X, W.t(), e4, e4, float(sx), float(sw))),
              ("dX", x.grad, dY @ W, gemm_bound(dY, W, dg, e4, sg, float(sw))),
              ("dW", layer.weight.grad, dY.t() @ X, gemm_bound(dY.t(), X, dg, e4, sg, float(sx)))]
    for name, got, ref, bound in checks:
        err = (got.detach().double() - ref).abs()
        assert (err <= bound).all(), f"{name}: error {float((err - bound).max()):.3e} above the {fmt} bound"
        # and it is FP8 error, not fp32 rounding: well above fp32's 2^-24, of the order of the format's u
        rel = float(err.max() / ref.abs().max())
        assert rel > 1e-3, f"{name}: relative error {rel:.1e} is too small to come from an FP8 cast"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("da,db", [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e4m3fn)])
def test_cpu_gemm_equals_torch_scaled_mm(da, db, out_dtype):
    """On CPU, _scaled_mm is the fp32 GEMM of the FP8 values times 1/sa·1/sb (CPU torch._scaled_mm runs thousands
    of times slower). Reference: torch._scaled_mm itself, on tiny shapes; both layouts of each operand as the
    backward passes them. The FP8×FP8 products are exact in fp32, so only the fp32 rounding of the sums (and of the
    scale products) differs: element-wise within the summation bound 2·(k+2)·2^-24·(|a|·|b|)/(sa·sb) of the two
    orders together, and in norm within 1e-6 of the output (measured ≤ 2e-7). bf16 (and float64) outputs are the
    fp32 result cast, so they differ at most where the two fp32 results straddle a rounding boundary: by one bf16
    ulp (2^-8 relative) and in ≤ 1 % of the elements (measured: 1 of 2048). The reference is oneDNN's FP8 kernel
    on a CPU with AMX; without AMX torch scales the operands before an fp32 matmul (bit-equal to (a/sa)@(b/sb))."""
    g = torch.Generator().manual_seed(1)
    for M, k, n, transposed in [(32, 48, 16, False), (16, 64, 32, True)]:
        a = (torch.randn(M, k, generator=g) * torch.logspace(-2, 2, k)).clamp(-440, 440).to(da)
        b = (torch.randn(n, k, generator=g) * 30).clamp(-440, 440).to(db)
        b = b.t() if not transposed else b.t().contiguous()  # column-major (forward, dX) or row-major (dW's xq)
        sa, sb = torch.tensor(3.7e2), torch.tensor(0.021)  # quantization scales: dequantize by 1/sa, 1/sb
        ref_dtype = torch.float32 if out_dtype == torch.float64 else out_dtype
        ref = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=1 / sa, scale_b=1 / sb,
                               out_dtype=ref_dtype).double()
        got = P._scaled_mm(a, b, sa, sb, out_dtype)
        assert got.dtype == out_dtype and got.shape == (M, n)
        got, err = got.double(), (got.double() - ref).abs()
        if out_dtype == torch.bfloat16:
            assert (err <= 2.0**-8 * ref.abs()).all() and float((err > 0).double().mean()) <= 0.01
        else:
            bound = 2 * (k + 2) * 2.0**-24 * (a.double().abs() @ b.double().abs()) / float(sa * sb)
            assert (err <= bound).all(), float((err - bound).max())
            assert float(err.norm() / ref.norm()) < 1e-6


def test_cpu_fp8_linear_does_not_call_torch_scaled_mm(monkeypatch):
    """The CPU forward and backward go through the fp32 GEMM, never CPU torch._scaled_mm (oneDNN's FP8 kernel on
    AMX CPUs: thousands of times slower); the result is the same as with it, to fp32 rounding."""
    x, w = torch.randn(32, 16, requires_grad=True), torch.randn(24, 16, requires_grad=True)
    meta = P.FP8LinearMeta(P.FP8Recipe("hybrid", "tensorwise"), ())
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: (_ for _ in ()).throw(AssertionError("called")))
    y = meta(x, w, None)
    xq, wq, sx, sw = y.grad_fn.next_functions[0][0].saved_tensors  # _FP8Linear's (under the view)
    y.backward(torch.ones_like(y))
    assert x.grad is not None and w.grad is not None
    ref = real(xq, wq.t(), scale_a=1 / sx, scale_b=1 / sw, out_dtype=torch.float32)
    assert float((y.detach() - ref).norm() / ref.norm()) < 1e-6


def test_cast_is_not_float32_rounding():
    """The cast saturates at fp8_max and rounds to 3 (e4m3) / 2 (e5m2) mantissa bits."""
    t = torch.tensor([1.0 + 2**-4 + 2**-6, 1.0 + 2**-3 + 2**-5, 1000.0, -3e-3, 9e-4])
    m = P.FP8TensorMeta(P.FP8Recipe(format="e4m3", recipe="delayed"), "input", ())  # scale 1 before any update
    q, s = m.quantize(t)
    assert q.dtype == torch.float8_e4m3fn and float(s) == 1.0
    assert q.float().tolist() == [1.125, 1.125, 448.0, -2.0**-8, 0.0]  # rounds to 3 bits; saturates; subnormal 2^-9 steps
    m5 = P.FP8TensorMeta(P.FP8Recipe(format="hybrid"), "grad_output", ())
    assert m5.quantize(torch.tensor([1.0 + 2**-3 + 2**-5]))[0].float().item() == 1.25


# --------------------------------------------------------------------------------------- 2. delayed scaling
@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 1)])
def test_delayed_scaling_follows_the_recipe(algo, margin):
    layer = P.ColumnParallelLinear(16, 16, bias=False)
    torch.nn.init.normal_(layer.weight, std=0.02)
    state = P.fp8_enable(layer, P.FP8Recipe(format="hybrid", recipe="delayed", margin=margin, amax_history_len=3,
                                           amax_compute_algo=algo))
    meta = layer.linear_impl.input
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25, 4.0]
    history, scale = [], 1.0
    for a in amaxes:
        x = torch.full((4, 16), a / 2)
        x[1, 3] = -a  # amax = a
        q, used = meta.quantize(x)
        assert float(used) == scale, "a step casts with the scale computed after the previous step"
        layer(x).sum().backward()
        state.update()
        history = ([a] + history)[:3]  # the last 3 amaxes, newest first
        amax = max(history) if algo == "max" else history[0]
        scale = 448.0 / amax / 2**margin
        assert float(meta.scale) == scale
        assert meta.amax_history.tolist() == [0.0] + (history + [0.0, 0.0])[:2]  # [0] collects the next step
    assert float(layer.linear_impl.grad_output.scale) == 57344.0 / 1.0 / 2**margin  # e5m2: dy = ones


def test_training_forwards_record_amaxes_and_eval_forwards_do_not():
    """Every FP8 tensor of a model takes its amax from the training forward and backward, and an eval (no-grad)
    forward records nothing. Caught: asked inside the autograd Function's forward, where grad mode is always off,
    no input or weight amax was ever recorded, and their delayed scales stayed 1."""
    model = gpt.Model(gpt.Config(**CFG))
    state = P.fp8_enable(model, P.FP8Recipe("hybrid", "delayed"))
    with torch.no_grad():
        model(BATCH[:, :-1])
    assert all(float(t.amax_history.abs().max()) == 0 for t in state.tensors())
    model(BATCH[:, :-1], labels=BATCH[:, 1:]).mean().backward()
    state.update()
    assert len(state.tensors()) == 2 * 4 * 3
    for t in state.tensors():  # history[1]: the step just recorded (update rolled it there)
        assert float(t.amax_history[1]) > 0 and float(t.scale) != 1.0


def test_tensorwise_uses_the_current_amax_and_update_is_a_no_op():
    layer = P.ColumnParallelLinear(16, 8, bias=False)
    state = P.fp8_enable(layer, P.FP8Recipe(format="e4m3", recipe="tensorwise"))
    for a in [3.0, 0.1]:
        q, s = layer.linear_impl.input.quantize(torch.full((2, 16), a))
        assert float(s) == pytest.approx(448.0 / a, rel=1e-7) and q.float().abs().max() == 448.0
        state.update()


# --------------------------------------------------------------------------------------- 3. FP8 under TP == single
CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
           vocab_size=201, max_position_embeddings=16, position_embedding_type="rope", normalization="RMSNorm",
           activation="silu", gated_linear_unit=True, add_bias_linear=False, share_embeddings_and_output_weights=False,
           hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)


def fp8_train(model, grid, batch, recipe, steps=2):
    """A calibration step (delayed scaling starts from scale 1: gradients would underflow), then `steps` AdamW steps
    with state.update() after each; returns (losses, the last step's grads, the final params — full and named),
    and every FP8 scale. Under DP each rank takes its rows; the loss divides by the global token count (§2)."""
    state = P.fp8_enable(model, recipe, grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # not Adam: g/(|g| + eps) amplifies fp32 noise in tiny grads
    dp = grid.dp if grid is not None else None
    mine = batch.chunk(dp.size)[dp.rank] if dp is not None else batch
    losses = []
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        per_token = model(mine[:, :-1], labels=mine[:, 1:])
        loss = per_token.sum() / (batch.shape[0] * per_token.shape[1])
        loss.backward()
        P.finalize_grads(model, grid)  # SP norm grads over TP, sum over DP
        state.update()
        if step > 0:
            losses.append(P.all_reduce(loss.detach(), dp))
            grads = named_full(model, grid, grads=True)
            opt.step()
    scales = torch.stack([t.scale for t in state.tensors()])
    return dict(losses=torch.stack(losses), grads=grads, params=named_full(model, grid)), scales


def fp8_tp_case(rank, n, tp, sp, recipe, reduce=True):
    grid = P.Grid(tp=tp, dp=n // tp)
    model = gpt.Model(gpt.Config(**CFG, sequence_parallel=sp), grid)
    saved = P._reduce_max
    if not reduce:
        P._reduce_max = lambda t, groups: t
    try:
        return fp8_train(model, grid, BATCH, recipe)
    finally:
        P._reduce_max = saved


BATCH = make_batch(CFG["vocab_size"], 4, 8, 3)


# one 4-rank world (starting ranks dominates the time): tp 4, and tp 2 x dp 2 (the amax reduction over DP too)
@pytest.mark.parametrize("tp,sp,recipe", [(2, True, P.FP8Recipe("hybrid", "delayed", amax_history_len=4)),
                                          (4, False, P.FP8Recipe("e4m3", "delayed", amax_compute_algo="most_recent")),
                                          (4, True, P.FP8Recipe("hybrid", "delayed", margin=1))])
def test_fp8_tensor_parallel_equals_fp8_single_process(pool, tp, sp, recipe):
    res = pool.run(fp8_tp_case, 4, tp=tp, sp=sp, recipe=recipe)
    ref, ref_scales = fp8_train(gpt.Model(gpt.Config(**CFG)), None, BATCH, recipe)
    for _, scales in res:
        assert torch.equal(scales, res[0][1]), "every rank must cast with the same scales (the amax all-reduce)"
        # and with the single process's, up to fp32 rounding of amaxes of tensors summed in another order
        # (measured: at most 4 of the 24 scales differ, by <= 1.6e-7)
        assert float(((scales - ref_scales).abs() / ref_scales).max()) < 1e-6
    assert_same(res[0][0], ref, rtol=1e-5, what=f"fp8 tp={tp} sp={sp}")


def test_without_the_amax_reduction_ranks_disagree(pool):
    """Negative control: each rank scaling by its own shard's amax breaks the equality with the single process."""
    recipe = P.FP8Recipe("e4m3", "tensorwise")
    res = pool.run(fp8_tp_case, 4, tp=2, sp=True, recipe=recipe, reduce=False)
    ref, _ = fp8_train(gpt.Model(gpt.Config(**CFG)), None, BATCH, recipe)
    assert not torch.equal(res[0][1], res[1][1])
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_same(res[0][0], ref, rtol=1e-5)


def test_fp8_really_differs_from_fp32():
    """The comparison above can fail: the FP8 loss differs from the plain (float64) one beyond 1e-5."""
    batch = BATCH
    fp8, _ = fp8_train(gpt.Model(gpt.Config(**CFG)), None, batch, P.FP8Recipe("hybrid", "tensorwise"))
    model = gpt.Model(gpt.Config(**CFG))
    with torch.no_grad():
        per_token = model(batch[:, :-1], labels=batch[:, 1:])
    fp32_loss = per_token.sum() / per_token.numel()
    assert abs(float(fp8["losses"][0]) - float(fp32_loss)) / float(fp32_loss) > 1e-5
    assert abs(float(fp8["losses"][0]) - float(fp32_loss)) / float(fp32_loss) < 2e-2  # but close


# --------------------------------------------------------------------------------------- 5. Transformer Engine
HAVE_TE = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(HAVE_TE, reason="CUDA and transformer_engine are present")
def test_transformer_engine_without_cuda_or_te_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU and the transformer_engine package"):
        P.fp8_enable(gpt.Model(gpt.Config(**CFG)), P.FP8Recipe(), impl="transformer_engine")


def fake_transformer_engine(monkeypatch) -> list:
    """Stand-ins for transformer_engine.pytorch.{Linear, autocast} and transformer_engine.common.recipe, with the
    signatures of TE 2.20.2 (pytorch/module/linear.py, pytorch/quantization.py, common/recipe/__init__.py). The
    Linear multiplies in full precision and records, per call, the autocast it ran in and the weight it used."""
    mods = {n: types.ModuleType(n) for n in ("transformer_engine", "transformer_engine.pytorch",
                                             "transformer_engine.common", "transformer_engine.common.recipe")}
    te, pt, common, recipe = mods.values()
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    te.pytorch, te.common, common.recipe = pt, common, recipe
    recipe.Format = enum.Enum("Format", ["E4M3", "HYBRID"])

    class DelayedScaling:
        def __init__(self, margin=0, fp8_format=recipe.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"):
            self.kw = dict(margin=margin, fp8_format=fp8_format, amax_history_len=amax_history_len,
                           amax_compute_algo=amax_compute_algo)

    class Float8CurrentScaling:
        def __init__(self, fp8_format=recipe.Format.HYBRID):
            self.kw = dict(fp8_format=fp8_format)

    active, calls = [], []

    class autocast:
        def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
            self.enabled, self.recipe, self.group = enabled, recipe, amax_reduction_group

        def __enter__(self):
            active.append(self)

        def __exit__(self, *exc):
            active.pop()

    class Linear(torch.nn.Module):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda"):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
            self.has_bias = bias

        def forward(self, inp):
            calls.append((active[-1] if active else None, self.weight, self.has_bias))
            return torch.nn.functional.linear(inp, self.weight)

    recipe.DelayedScaling, recipe.Float8CurrentScaling, pt.autocast, pt.Linear = (DelayedScaling, Float8CurrentScaling,
                                                                                  autocast, Linear)
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    return calls


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_transformer_engine_adapter_wiring(monkeypatch, recipe):
    """Runs without a GPU or TE: the TE backend's adapter against the stand-ins above. Every FP8 linear (not the
    output layer) computes through te.Linear with OUR weight Parameter, inside an autocast with our recipe's
    settings; the model's parameters are unchanged (no second copy), and since the stand-in multiplies in full
    precision, losses, every gradient and the parameters after 2 AdamW steps equal the model without FP8 (float64,
    1e-12: F.linear with and without a fused bias round differently). The real TE run is the test below."""
    calls = fake_transformer_engine(monkeypatch)
    cfg = dict(CFG, params_dtype=torch.float32, add_bias_linear=True)
    batch = make_batch(CFG["vocab_size"], 4, 8, 1)
    fp8 = P.FP8Recipe("hybrid", recipe, margin=1, amax_history_len=7, amax_compute_algo="most_recent")
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(ValueError, match="params_dtype torch.float64"):
            P.fp8_enable(gpt.Model(gpt.Config(**CFG)), fp8, impl="transformer_engine")
        model, ref = gpt.Model(gpt.Config(**cfg)), gpt.Model(gpt.Config(**cfg))
        P.fp8_enable(model, fp8, impl="transformer_engine")
    ref.double(), model.double()  # after the dtype check: the stand-in computes in whatever dtype it is given
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert_same(train_steps(model, None, batch), train_steps(ref, None, batch), rtol=1e-12, what=recipe)
    linears = [m for n, m in model.named_modules()
               if isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear)) and not n.endswith("output_layer")]
    assert linears and len(calls) == 2 * len(linears) and {id(w) for _, w, _ in calls} == {id(m.weight) for m in linears}
    want = dict(fp8_format=sys.modules["transformer_engine.common.recipe"].Format.HYBRID)
    if recipe == "delayed":
        want.update(margin=1, amax_history_len=7, amax_compute_algo="most_recent")
    for ctx, _, bias in calls:
        assert ctx is not None and ctx.enabled and ctx.group is None and ctx.recipe.kw == want and not bias
        assert type(ctx.recipe).__name__ == ("DelayedScaling" if recipe == "delayed" else "Float8CurrentScaling")


@pytest.mark.skipif(not HAVE_TE, reason="needs CUDA and transformer_engine")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_transformer_engine_backend_matches_local_fp8(recipe):
    """TE's FP8 Linear vs ours, float32 weights (TE takes no float64), 3 AdamW steps: losses within 2 % at every
    step (the two cast and accumulate differently; TE's delayed recipe starts from scale 1 and updates per forward);
    with tensorwise scaling the first step's fc2 gradient within 10 % (norm)."""
    batch = make_batch(CFG["vocab_size"], 16, 16, 3).cuda()
    cfg = dict(CFG, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, params_dtype=torch.float32)
    out = {}
    for impl in ("local", "transformer_engine"):
        model = gpt.Model(gpt.Config(**cfg)).cuda()
        P.fp8_enable(model, P.FP8Recipe("hybrid", recipe), impl=impl)
        out[impl] = train_steps(model, None, batch, steps=3)
    for a, b in zip(out["local"]["losses"], out["transformer_engine"]["losses"]):
        assert abs(float(a) - float(b)) / float(a) < 2e-2, (recipe, out["local"]["losses"], out["transformer_engine"]["losses"])
    if recipe == "tensorwise":
        g1, g2 = (out[i]["grads"]["decoder.layers.0.mlp.linear_fc2.weight"] for i in out)
        assert float((g1 - g2).norm() / g2.norm()) < 0.1


# --------------------------------------------------------------------------------------- 6. train.py --fp8 at TP=2
def test_train_fp8_tp2_torchrun_logs_the_single_process_losses(request, tmp_path):
    """`train.py --fp8` (hybrid, delayed; float32 weights) under torchrun at TP=2 logs the single process's losses
    over 10 iterations (4 layers, h 64, seq 32, micro-batch 4, global batch 8) to 1e-3. Not exact and not 1e-5: in
    float32 a 1-ulp difference from TP's other summation order (in a value, or in an amax, hence a scale) can move
    a value across an FP8 rounding boundary, and after such a flip the two runs drift apart as two float32 runs
    of different summation order do, faster at a higher learning rate (section 3's property test runs in float64
    for that reason). Measured on the 2-core CPU: iterations 1-6 bit-equal, then ≤ 1.2e-4 (lr 3e-3 from
    iteration 2); with train.py's default warm-up, 20 iterations: 1-9 bit-equal, ≤ 2.5e-4 by iteration 20 —
    the same 2.5e-4 as with CPU torch._scaled_mm before parallel._scaled_mm's fp32 GEMM of the FP8 values."""
    text, cache_dir = request.getfixturevalue("corpus"), request.getfixturevalue("cache")  # (conftest.py's fixtures)
    size = ("--fp8", "--num-layers", "4", "--micro-batch-size", "4", "--eval-interval", "100")
    train.main(tiny(text, cache_dir, tmp_path / "one", *size, iters=10))
    torchrun(2, tiny(text, cache_dir, tmp_path / "tp2", *size, "--tensor-model-parallel-size", "2", iters=10))
    (ref, _), (got, _) = metrics(tmp_path / "one"), metrics(tmp_path / "tp2")
    assert sorted(got) == sorted(ref) == list(range(1, 11))
    worst = max(abs(got[i]["loss"] - ref[i]["loss"]) / ref[i]["loss"] for i in ref)
    assert worst <= 1e-3, (worst, ref, got)
    assert ref[10]["loss"] < ref[1]["loss"]  # it learns
