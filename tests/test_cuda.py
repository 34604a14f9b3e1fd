"""What only a CUDA GPU can show (skipped without one; CI has none — run on a lent GPU machine: bench/gpu_default_runs.sh):

  - the GPT model on CUDA equals the same model on CPU in float64 (loss and every gradient, 1e-10: float64 kernels
    differ only in summation order);
  - the FP8 GEMM on CUDA (cuBLASLt's real FP8 tensor-core GEMM via torch._scaled_mm) agrees with the CPU one on the
    same float8 operands within the tensor cores' accumulation bound, and refuses dimensions that are not multiples
    of 16 with a clear error;
  - train.py on CUDA logs the same losses as on CPU (float32, 1e-4: CUDA's fp32 attention and GEMM kernels sum in
    other orders), and --fp8 (delayed and tensorwise) and --bf16 train there to within 5% of float32.
NCCL itself needs two GPUs (it refuses two ranks on one device); the multi-rank paths are the gloo tests' business.
The Transformer Engine backend's test lives in test_fp8.py (it needs transformer_engine as well).
"""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
import torch

import gpt
import parallel as P
from equivalence import assert_same, make_batch, train_steps
from harness import ROOT, assert_close, metrics, tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
           vocab_size=384, max_position_embeddings=32, normalization="RMSNorm", position_embedding_type="rope",
           activation="silu", gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)


def test_gpt_on_cuda_equals_cpu_in_float64():
    """Loss, every gradient and the parameters after 2 AdamW steps (float64, 1e-10)."""
    cpu = gpt.Model(gpt.Config(**CFG)).double()
    gpu = copy.deepcopy(cpu).cuda()
    batch = make_batch(CFG["vocab_size"], 4, 32, 0)  # [b, s+1]
    ref = train_steps(cpu, None, batch)
    got = train_steps(gpu, None, batch.cuda())
    got = {k: (v.cpu() if torch.is_tensor(v) else {n: t.cpu() for n, t in v.items()}) for k, v in got.items()}
    assert_same(got, ref, 1e-10, "CUDA vs CPU")


def test_fp8_gemm_on_cuda_agrees_with_cpu_and_is_float8():
    """Same float8 operands on both: the CPU GEMM accumulates in fp32; Hopper's FP8 tensor cores accumulate with ~14
    mantissa bits between cuBLASLt's fp32 promotions (DeepSeek-V3 report, §3.3.2), so the bound per element is
    k·2^-13·(|X|·|W|ᵀ) of the dequantized operands (measured on an H200: 2.8e-4 of max |Y| for k = 128)."""
    g = torch.Generator().manual_seed(0)
    M, k, n = 64, 128, 48
    x, w = torch.randn(M, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    recipe = P.FP8Recipe("e4m3", "tensorwise")
    xq, sx = P.FP8TensorMeta(recipe, "input", ()).quantize(x)
    wq, sw = P.FP8TensorMeta(recipe, "weight", ()).quantize(w)
    assert xq.dtype == wq.dtype == torch.float8_e4m3fn
    y_cpu = P._scaled_mm(xq, wq.t(), sx, sw, torch.float32)
    y_gpu = P._scaled_mm(xq.cuda(), wq.cuda().t(), sx.cuda(), sw.cuda(), torch.float32).cpu()
    bound = k * 2.0**-13 * ((xq.double() / float(sx)).abs() @ (wq.double() / float(sw)).abs().t())  # [M, n]
    assert ((y_gpu.double() - y_cpu.double()).abs() <= bound).all()
    assert not torch.equal(y_gpu, y_gpu.round())  # a real product, not a cast of integers
    with pytest.raises(ValueError, match="multiple of 16"):
        P._scaled_mm(xq[:40].cuda(), wq.cuda().t(), sx, sw, torch.float32)


def run_train(argv, cuda: bool, nproc: int = 1):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "train.py"), *argv]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"train.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def corpus_and_cache(tmp_path_factory):
    from harness import SNIPPET
    d = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (d / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    return d, tmp_path_factory.mktemp("cache")


def test_train_on_cuda_equals_cpu(corpus_and_cache, tmp_path):
    corpus, cache = corpus_and_cache
    extra = ("--ffn-hidden-size", "128")
    out = run_train(tiny(corpus, cache, tmp_path / "gpu", *extra), cuda=True)
    assert "device cuda" in out, out[-2000:]
    run_train(tiny(corpus, cache, tmp_path / "cpu", *extra), cuda=False)
    (gpu, gv), (cpu, cv) = metrics(tmp_path / "gpu"), metrics(tmp_path / "cpu")
    assert cpu and cv and set(gpu) == set(cpu) and set(gv) == set(cv), (sorted(gpu), sorted(cpu), sorted(gv), sorted(cv))
    for it in cpu:
        assert_close(gpu[it]["loss"], cpu[it]["loss"], 1e-4, f"loss at iteration {it}")
    for it in cv:
        assert_close(gv[it], cv[it], 1e-4, f"validation loss at iteration {it}")


@pytest.mark.parametrize("flags", [("--fp8",), ("--fp8", "--fp8-recipe", "tensorwise"), ("--bf16",)])
def test_train_on_cuda_fp8_and_bf16(corpus_and_cache, tmp_path, flags):
    corpus, cache = corpus_and_cache
    run_train(tiny(corpus, cache, tmp_path / "run", "--ffn-hidden-size", "128", *flags), cuda=True)
    run_train(tiny(corpus, cache, tmp_path / "ref", "--ffn-hidden-size", "128"), cuda=True)
    (got, _), (ref, _) = metrics(tmp_path / "run"), metrics(tmp_path / "ref")
    last = max(ref)
    assert math.isfinite(got[last]["loss"]), f"{flags}: loss {got[last]['loss']} at iteration {last}"  # finite ...
    assert_close(got[last]["loss"], ref[last]["loss"], 5e-2, f"{flags} vs fp32 loss at iteration {last}")  # ... close


def test_batch_not_multiple_of_16_is_a_clear_error_under_fp8_on_cuda():
    model = gpt.Model(gpt.Config(**CFG)).cuda()
    P.fp8_enable(model, P.FP8Recipe())
    b = make_batch(CFG["vocab_size"], 1, 10, 0).cuda()  # 9 tokens
    with pytest.raises(ValueError, match="multiple of 16"):
        model(b[:, :-1], labels=b[:, 1:])
