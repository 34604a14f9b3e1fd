"""posttraining/quantization.py — frozen linear weights stored in fewer bits, dequantized per layer when it runs.

Two uses: QLoRA's base (train.py --lora-rank R --quantize-base nf4|int8: the frozen base in NF4 or int8, adapters
trained on top, posttraining/lora.py) and weight-only serving (serving/server.py --quantization int8|int4).
Mirrors bitsandbytes' storage (bitsandbytes/functional.py quantize_4bit(quant_type="nf4", blocksize=64,
compress_statistics=True) and Int8Params' row-wise absmax) as PEFT's QLoRA uses it, and the group-wise symmetric
int4/int8 weights of vLLM's and Megatron's inference paths (scales per 128 input features of each output row).
Paper: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (NF4, double quantization).
Written here in torch ops rather than torchao's NF4Tensor: DESIGN.md §1, "Post-training", says why.

Run:    .venv/bin/python -m pytest -q tests/test_quantization.py
        make train RUN=runs/gpt-qlora ARGS="--lora-rank 8 --quantize-base nf4 --pretrained-checkpoint runs/gpt"

Formats (w [o, i], one TP rank's shard: each rank quantizes the shard it holds, DESIGN.md says why)
  nf4    w flattened, blocks of 64: code = the nearest of NF4's 16 values to w / absmax(block), two codes a byte;
         the absmaxes double-quantized: (absmax - mean) in int8, one fp32 scale per 256 of them, one fp32 mean.
         4 + 8/64 + 32/(64·256) = 4.127 bits a weight (plus the mean).
  int8   one fp32 scale per output row (bitsandbytes' row-wise absmax): round(w / scale), scale = absmax / 127.
  int4   group-wise: one fp32 scale per 128 input features of a row, codes in [-8, 7], two a byte (4.25 bits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import parallel as P
from posttraining import lora

# The NF4 code book as published (QLoRA's appendix E; bitsandbytes' float32 values): quantiles of N(0, 1) scaled
# to [-1, 1], with an exact 0. A value is coded by the nearest of them: the boundaries are the midpoints.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044006, 0.5626170039176941,
                    0.7229568362236023, 1.0])
TINY = torch.finfo(torch.float32).tiny  # divides an all-zero block's values (they code as 0) without a NaN


def _pack4(codes: torch.Tensor) -> torch.Tensor:  # [..., 2n] values in 0..15 -> [..., n] uint8, first code high
    c = codes.to(torch.uint8)
    return c[..., 0::2] << 4 | c[..., 1::2]


def _unpack4(packed: torch.Tensor) -> torch.Tensor:  # [..., n] uint8 -> [..., 2n] long
    return torch.stack([packed >> 4, packed & 15], -1).flatten(-2).long()


class Quantized(nn.Module):
    """A frozen weight's quantized storage (non-persistent buffers: a checkpoint never holds them; the run quantizes
    its base's weights again when it loads them). dequantize() -> the weight [o, i] in its dtype."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.shape, self.dtype = tuple(w.shape), w.dtype

    def store(self, **tensors):
        for k, t in tensors.items():
            self.register_buffer(k, t, persistent=False)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class NF4Weight(Quantized):
    def __init__(self, w: torch.Tensor, block: int = 64, scale_block: int = 256):
        super().__init__(w)
        self.block, self.scale_block, n = block, scale_block, w.numel()
        blocks = F.pad(w.detach().reshape(-1).float(), (0, -n % block)).view(-1, block)  # [n/64, 64]
        absmax = blocks.abs().amax(1)  # [n/64]
        bounds = (NF4[1:] + NF4[:-1]) / 2  # the 15 midpoints
        codes = torch.bucketize(blocks / absmax.clamp_min(TINY)[:, None], bounds)  # [n/64, 64] in 0..15
        mean = absmax.mean()
        c = F.pad(absmax - mean, (0, -len(absmax) % scale_block)).view(-1, scale_block)  # [n/64/256, 256]
        scale = c.abs().amax(1) / 127  # the second level: fp32
        q = torch.round(c / scale.clamp_min(TINY)[:, None]).to(torch.int8).view(-1)[:len(absmax)]
        self.store(codes=_pack4(codes.view(-1)), absmax_q=q, absmax_scale=scale, absmax_mean=mean)

    def absmax(self) -> torch.Tensor:  # [n/64] fp32: the double quantization undone
        q = F.pad(self.absmax_q.float(), (0, -len(self.absmax_q) % self.scale_block)).view(-1, self.scale_block)
        return (q * self.absmax_scale[:, None]).view(-1)[:len(self.absmax_q)] + self.absmax_mean

    def dequantize(self) -> torch.Tensor:
        values = NF4.to(self.codes.device)[_unpack4(self.codes)].view(-1, self.block) * self.absmax()[:, None]
        return values.view(-1)[:_numel(self.shape)].view(self.shape).to(self.dtype)


class IntWeight(Quantized):
    """Symmetric integer codes with one fp32 scale per `group` input features of each row (group None: the row)."""

    def __init__(self, w: torch.Tensor, bits: int, group: int | None = None):
        super().__init__(w)
        o, i = w.shape
        self.bits, self.group, top = bits, group or i, 2 ** (bits - 1) - 1
        g = F.pad(w.detach().float(), (0, -i % self.group)).view(o, -1, self.group)  # [o, i/group, group]
        scale = g.abs().amax(-1) / top  # [o, i/group]
        codes = torch.round(g / scale.clamp_min(TINY)[..., None]).clamp(-top - 1, top).view(o, -1)
        self.store(codes=_pack4(codes + 8) if bits == 4 else codes.to(torch.int8), scale=scale)

    def dequantize(self) -> torch.Tensor:
        codes = _unpack4(self.codes) - 8 if self.bits == 4 else self.codes
        o, i = self.shape
        w = codes.view(o, -1, self.group).float() * self.scale[..., None]
        return w.view(o, -1)[:, :i].to(self.dtype)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


FORMATS = {"nf4": NF4Weight, "int8": lambda w: IntWeight(w, 8), "int4": lambda w: IntWeight(w, 4, 128)}
SERVING = {"int8": lambda w: IntWeight(w, 8, 128), "int4": lambda w: IntWeight(w, 4, 128)}  # group-wise


class _DequantizedLinear(torch.autograd.Function):
    """y = x·deq(W)ᵀ + b with W frozen: the weight is dequantized in forward and again in backward (for dx), so
    between them a layer holds its codes only, never its full-precision weight (QLoRA's memory saving)."""

    @staticmethod
    def forward(ctx, x, weight: Quantized, bias):
        ctx.weight = weight
        return F.linear(x, weight.dequantize().to(x.dtype), bias)

    @staticmethod
    def backward(ctx, dy):
        dx = dy.matmul(ctx.weight.dequantize().to(dy.dtype)) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, db


def quantized_linear(x, weight: Quantized, bias):  # a layer's linear_impl (parallel.py section 4's GEMM hook)
    return _DequantizedLinear.apply(x, weight, bias)


@torch.no_grad()
def quantize_linears(model: nn.Module, fmt: str, formats=FORMATS, targets=lora.TARGETS) -> int:
    """Replace the weight of every tensor-parallel linear named in `targets` (the attention's and MLP's; embeddings
    and the output layer stay, as in QLoRA) by its `formats[fmt]` storage, run through quantized_linear. Each rank
    quantizes the shard it holds. Returns the bytes of the quantized weights on this rank."""
    total = 0
    for name, m in model.named_modules():
        if (name.rsplit(".", 1)[-1] in targets and isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear))
                and isinstance(m.weight, nn.Parameter)):
            w = m.weight.detach()
            del m.weight  # (the Parameter: nothing else holds it, so its memory is freed)
            m.weight = formats[fmt](w)
            m.linear_impl = quantized_linear
            total += m.weight.nbytes()
    return total


def linear_weight_bytes(model: nn.Module, targets=lora.TARGETS) -> int:
    """Bytes of the weights of the `targets` linears as stored (quantized or not): the memory quantization saves."""
    return sum(m.weight.nbytes() if isinstance(m.weight, Quantized) else m.weight.numel() * m.weight.element_size()
               for name, m in model.named_modules()
               if name.rsplit(".", 1)[-1] in targets and isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear))
               and m.weight is not None)


@torch.no_grad()
def fake_quantize(model: nn.Module, fmt: str, formats=FORMATS, targets=lora.TARGETS):
    """Each targeted weight W := deq(quant(W)), kept in full precision: the base a QLoRA run's adapters were trained
    on, which they are merged into (as PEFT's merge on a 4-bit model dequantizes first)."""
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear)):
            m.weight.copy_(formats[fmt](m.weight).dequantize())
