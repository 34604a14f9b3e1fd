"""posttraining/quantization.py — frozen linear weights stored in fewer bits, dequantized per layer when it runs.

Two uses: QLoRA's base (train.py --lora-rank R --quantize-base nf4|int8: the frozen base in NF4 or int8, adapters
trained on top, posttraining/lora.py) and weight-only serving (serving/server.py --quantization int8|int4).
Mirrors bitsandbytes' storage (bitsandbytes/functional.py quantize_4bit(quant_type="nf4", blocksize=64,
compress_statistics=True) and Int8Params' row-wise absmax) as PEFT's QLoRA uses it, and the group-wise symmetric
int4/int8 weights of vLLM's and Megatron's inference paths (scales per 128 input features of each output row).
Papers: Dettmers et al. 2023, "QLoRA" (NF4, double quantization); Lin et al. 2024, "AWQ" (AutoAWQ's auto_scale
and auto_clip, written out as llm-compressor's compressed-tensors pack-quantized folders, which transformers loads).
Written here in torch ops rather than torchao's NF4Tensor: DESIGN.md §1, "Post-training", says why.

Run:    .venv/bin/python -m pytest -q tests/test_quantization.py
        make train RUN=runs/gpt-qlora ARGS="--lora-rank 8 --quantize-base nf4 --pretrained-checkpoint runs/gpt"
        .venv/bin/python tools.py export --load runs/gpt --hf-out runs/gpt-awq --quantization awq

Formats (w [o, i] whole; under TP each rank keeps its shard of the codes and all the scales: DESIGN.md)
  nf4    w flattened, blocks of 64: code = the nearest of NF4's 16 values to w / absmax(block), two codes a byte;
         the absmaxes double-quantized: (absmax - mean) in int8, one fp32 scale per 256 of them, one fp32 mean.
         4 + 8/64 + 32/(64·256) = 4.127 bits a weight (plus the mean).
  int8   round(w / scale), scale = absmax / 127: per output row for a QLoRA base (bitsandbytes'), per 128 to serve.
  int4   group-wise: one fp32 scale per 128 input features of a row, codes in [-8, 7], two a byte (4.25 bits).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
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
WHOLE = (-1, 1, 0, 1)  # parallel.shard's (dim, stride, rank, size) of an unsharded weight
TINY = torch.finfo(torch.float32).tiny  # divides an all-zero block's values (they code as 0) without a NaN


def _pack4(codes: torch.Tensor) -> torch.Tensor:  # values in 0..15 -> uint8 [ceil(n/2)], two a byte, first high
    c = F.pad(codes.reshape(-1), (0, codes.numel() % 2)).to(torch.uint8)
    return c[0::2] << 4 | c[1::2]


def _unpack4(packed: torch.Tensor) -> torch.Tensor:  # uint8 [n/2] -> long [n] (the pad too)
    return torch.stack([packed >> 4, packed & 15], -1).view(-1).long()


class Quantized(nn.Module):
    """A frozen weight's quantized storage: this rank's codes [o, i] of its shard (`shard` = parallel.shard's
    (dim, stride, rank, size)) of the whole weight `full` quantized at once, and the whole weight's scales (small,
    the same on every rank), so any layout holds the same values. Buffers, not persistent: a checkpoint never holds
    them (a run quantizes its base again when it loads it). dequantize() -> this rank's weight in its dtype."""
    bits = 4

    def __init__(self, full: torch.Tensor, shard=WHOLE):
        super().__init__()
        (o, i), (dim, stride, rank, size) = full.shape, shard
        codes, scales = self.encode(full.detach().float())  # [o, i] in 0..2^bits-1; {name: tensor}
        rows, cols = torch.arange(o, device=full.device), torch.arange(i, device=full.device)  # global indices
        rows, cols = (P.shard(rows, 0, stride, rank, size) if dim == 0 else rows,
                      P.shard(cols, 0, stride, rank, size) if dim == 1 else cols)
        codes = codes[rows][:, cols]
        self.full_shape, self.shape, self.dtype = (o, i), tuple(codes.shape), full.dtype
        for k, t in dict(codes=_pack4(codes) if self.bits == 4 else codes.to(torch.uint8), **scales,
                         rows=rows.int() if size > 1 else None, cols=cols.int() if size > 1 else None).items():
            self.register_buffer(k, t, persistent=False)

    def dequantize(self) -> torch.Tensor:
        o, i = self.shape
        codes = (_unpack4(self.codes)[:o * i] if self.bits == 4 else self.codes.long()).view(o, i)
        if self.rows is None and self.cols is None:  # the whole weight: scales repeated, no index arithmetic
            return (self.values(codes) * self.whole_scales()).to(self.dtype)
        rows = self.rows.long() if self.rows is not None else torch.arange(o, device=codes.device)
        cols = self.cols.long() if self.cols is not None else torch.arange(i, device=codes.device)
        return (self.values(codes) * self.scale_of(rows[:, None], cols[None, :])).to(self.dtype)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class NF4Weight(Quantized):
    """NF4: the whole weight flattened (row-major), blocks of 64, the absmaxes double-quantized."""
    BLOCK, SCALE_BLOCK = 64, 256

    def encode(self, w):
        n, block = w.numel(), self.BLOCK
        blocks = F.pad(w.reshape(-1), (0, -n % block)).view(-1, block)  # [n/64, 64]
        absmax = blocks.abs().amax(1)  # [n/64]
        bounds = ((NF4[1:] + NF4[:-1]) / 2).to(w.device)  # a value codes as the nearest of the 16
        codes = torch.bucketize(blocks / absmax.clamp_min(TINY)[:, None], bounds)
        mean = absmax.mean()
        c = F.pad(absmax - mean, (0, -len(absmax) % self.SCALE_BLOCK)).view(-1, self.SCALE_BLOCK)  # [n/64/256, 256]
        scale = c.abs().amax(1) / 127  # the second level: fp32
        q = torch.round(c / scale.clamp_min(TINY)[:, None]).to(torch.int8).view(-1)[:len(absmax)]
        return codes.view(-1)[:n].view(w.shape), dict(absmax_q=q, absmax_scale=scale, absmax_mean=mean)

    def absmax(self) -> torch.Tensor:  # [n/64] fp32: the double quantization undone
        q = F.pad(self.absmax_q.float(), (0, -len(self.absmax_q) % self.SCALE_BLOCK)).view(-1, self.SCALE_BLOCK)
        return (q * self.absmax_scale[:, None]).view(-1)[:len(self.absmax_q)] + self.absmax_mean

    def values(self, codes):
        return NF4.to(codes.device)[codes]

    def scale_of(self, rows, cols):  # each element's block absmax
        return self.absmax()[(rows * self.full_shape[1] + cols) // self.BLOCK]

    def whole_scales(self):
        return self.absmax().repeat_interleave(self.BLOCK)[:self.shape[0] * self.shape[1]].view(self.shape)


class IntWeight(Quantized):
    """Symmetric integer codes with one fp32 scale per `group` input features of each row (group None: the row)."""

    def __init__(self, full: torch.Tensor, bits: int, group: int | None = None, shard=WHOLE):
        self.bits, self.group = bits, group or full.shape[1]
        super().__init__(full, shard)

    def encode(self, w):
        (o, i), top = w.shape, 2 ** (self.bits - 1) - 1
        g = F.pad(w, (0, -i % self.group)).view(o, -1, self.group)  # [o, i/group, group]
        scale = g.abs().amax(-1) / top  # [o, i/group]
        codes = torch.round(g / scale.clamp_min(TINY)[..., None]).clamp(-top - 1, top).view(o, -1)[:, :i]
        return codes + 2 ** (self.bits - 1), dict(scale=scale)  # stored unsigned: offset by 8 (int4) or 128 (int8)

    def values(self, codes):
        return (codes - 2 ** (self.bits - 1)).float()

    def scale_of(self, rows, cols):
        return self.scale[rows, cols // self.group]

    def whole_scales(self):
        return self.scale.repeat_interleave(self.group, 1)[:, :self.shape[1]]


FORMATS = {"nf4": NF4Weight, "int8": lambda w, shard=WHOLE: IntWeight(w, 8, None, shard)}  # QLoRA's base
GROUP = 128  # serving's input features a scale (vLLM's and AWQ's)
SERVING = {"int8": lambda w, shard=WHOLE: IntWeight(w, 8, GROUP, shard),  # weight-only, group-wise
           "int4": lambda w, shard=WHOLE: IntWeight(w, 4, GROUP, shard)}


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


def _whole(w: nn.Parameter, tp) -> torch.Tensor:
    """The whole weight from the TP ranks' shards of it (`tp`: the layer's group; once, when it is quantized)."""
    if tp is None or not getattr(w, "tensor_model_parallel", False):
        return w
    parts = [torch.empty_like(w) for _ in range(tp.size)]
    dist.all_gather(parts, w.contiguous(), group=tp.pg)
    return P.unshard(parts, w.partition_dim, w.partition_stride)


def _targets(model, targets):
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in targets
            and isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear)) and m.weight is not None]


@torch.no_grad()
def quantize_linears(model: nn.Module, fmt: str, formats=FORMATS, targets=lora.TARGETS) -> int:
    """Replace the weight of every tensor-parallel linear named in `targets` (the attention's and MLP's; embeddings
    and the output layer stay, as in QLoRA) by its `formats[fmt]` storage, run through quantized_linear: the whole
    weight (gathered over TP) quantized, this rank's shard of the codes kept. Returns this rank's bytes of them."""
    for m in _targets(model, targets):
        if isinstance(m.weight, nn.Parameter):
            w, tp = m.weight, m.tp
            shard = (w.partition_dim, w.partition_stride, tp.rank, tp.size) if tp else WHOLE
            del m.weight  # (the Parameter: nothing else holds it, so its memory is freed)
            m.weight, m.linear_impl = formats[fmt](_whole(w, tp), shard), quantized_linear
    return linear_weight_bytes(model, targets)


def linear_weight_bytes(model: nn.Module, targets=lora.TARGETS) -> int:
    """Bytes of the weights of the `targets` linears as stored (quantized or not): the memory quantization saves."""
    return sum(m.weight.nbytes() if isinstance(m.weight, Quantized) else m.weight.numel() * m.weight.element_size()
               for m in _targets(model, targets))


@torch.no_grad()
def fake_quantize(model: nn.Module, fmt: str, formats=FORMATS, targets=lora.TARGETS):
    """Each targeted weight W := deq(quant(W)), kept in full precision: the base a QLoRA run's adapters were trained
    on, which they are merged into (as PEFT's merge on a 4-bit model dequantizes first)."""
    for m in _targets(model, targets):
        w, tp = m.weight, m.tp
        shard = (w.partition_dim, w.partition_stride, tp.rank, tp.size) if tp else WHOLE
        w.copy_(formats[fmt](_whole(w, tp), shard).dequantize())


# ---------------------------------------------------------------------------------------------- AWQ
@torch.no_grad()
def awq_scale(model: nn.Module, batches, group: int | None = None, grid: int = 20) -> dict[str, float]:
    """AWQ (Lin et al. 2024; AutoAWQ's auto_scale): per input channel scales s that protect the channels with large
    activations before int4 round-to-nearest. For each linear whose input a preceding op can absorb — linear_qkv
    (input_layernorm), linear_fc1 (pre_mlp_layernorm), SwiGLU's linear_fc2 (fc1's `up` rows) — on the inputs x the
    calibration `batches` ([b, s] token ids) give it: s = mean|x|^a, a in [0, 1) on `grid` points, the one whose
    deq(quant(W·s))·(x/s) is closest to W·x, quant the int4 of one scale per `group` input features (None:
    export_group's, as the export writes it); then W := W·s and the preceding op := op / s (the fp model unchanged).
    One process (TP 1), the model's own eval forward. Returns each scaled linear's chosen a."""
    inputs, hooks = {}, []
    groups = []  # (name, linear, absorb(s)): the op before it divides by s
    for name, m in model.named_modules():
        layer = getattr(m, "self_attention", None), getattr(m, "mlp", None)
        if hasattr(m, "input_layernorm") and isinstance(getattr(layer[0], "linear_qkv", None), P.ColumnParallelLinear):
            groups.append((f"{name}.self_attention.linear_qkv", layer[0].linear_qkv, m.input_layernorm))
        if hasattr(m, "pre_mlp_layernorm") and isinstance(getattr(layer[1], "linear_fc1", None), P.ColumnParallelLinear):
            groups.append((f"{name}.mlp.linear_fc1", layer[1].linear_fc1, m.pre_mlp_layernorm))
            if getattr(m.mlp, "gated", False):  # act(gate)·up: up's rows (and bias) scale fc2's input channels
                groups.append((f"{name}.mlp.linear_fc2", layer[1].linear_fc2, m.mlp.linear_fc1))
    groups = [(n, lin, [t.chunk(2)[1] if isinstance(prev, P.ColumnParallelLinear) else t  # fc1: its up half
                        for t in (prev.weight, getattr(prev, "bias", None)) if t is not None]) for n, lin, prev in groups]
    group = group or export_group([m.weight.shape[1] for m in _targets(model, lora.TARGETS)])
    for name, lin, _ in groups:
        hooks.append(lin.register_forward_hook(
            lambda mod, inp, out, name=name: inputs.setdefault(name, []).append(inp[0].reshape(-1, inp[0].shape[-1]))))
    model.eval()
    for ids in batches:
        model(ids)
    for h in hooks:
        h.remove()
    chosen = {}
    for name, lin, prev in groups:
        x = torch.cat(inputs[name]).float()  # [tokens, i]
        w = lin.weight.float()
        y, mean, best = x @ w.T, x.abs().mean(0), None
        for a in torch.arange(grid) / grid:
            s = mean.pow(a).clamp_min(1e-4)
            s = s / (s.max() * s.min()).sqrt()
            err = ((x / s) @ IntWeight(w * s, 4, group).dequantize().T - y).pow(2).mean()
            if best is None or err < best[0]:
                best = err, float(a), s
        _, chosen[name], s = best
        lin.weight.mul_(s.to(lin.weight.dtype))
        for t in prev:  # a norm's weight (and bias), or fc1's up rows
            t.div_((s[:, None] if t.dim() == 2 else s).to(t.dtype))
    return chosen


def export_group(widths, group: int = 128) -> int:
    """The int4 group size of an export: `group` halved until it divides every linear's input width (a small model's:
    smaller), one for all of them, as to_compressed_tensors writes it."""
    while any(w % group for w in widths):
        group //= 2
    return group


@torch.no_grad()
def awq_clip(model: nn.Module, batches, grid: int = 20, max_shrink: float = 0.5, tokens: int = 512,
             group: int | None = None) -> dict:
    """AWQ's weight clipping (Lin et al. 2024; AutoAWQ's auto_clip), after awq_scale: for each output row and int4
    group (`group` input features; None: export_group's) of linear_proj, linear_fc1 and linear_fc2 — not linear_qkv:
    q·k amplifies q's and k's errors, and AutoAWQ skips a fused Wqkv — the clip t = r·absmax(group), r = 1 - k/grid
    for k < max_shrink·grid, whose int4 round-to-nearest of clamp(w, -t, t) gives the group's outputs closest (mean
    square) to w's on the calibration `batches`' inputs (every k-th token, about `tokens` of them); the first such r
    on ties. Then W := clamp(W, -t, t), so int4 of it scales by t/7. Returns each clipped linear's r [o, groups]."""
    names = ("linear_proj", "linear_fc1", "linear_fc2")
    linears = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names + ("linear_qkv",)
               and isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear)) and m.weight is not None}
    group = group or export_group([m.weight.shape[1] for m in linears.values()])
    linears = {n: m for n, m in linears.items() if not n.endswith("linear_qkv")}
    inputs, hooks = {}, [m.register_forward_hook(lambda mod, inp, out, n=n: inputs.setdefault(n, []).append(
        inp[0].reshape(-1, inp[0].shape[-1]))) for n, m in linears.items()]
    model.eval()
    for ids in batches:
        model(ids)
    for h in hooks:
        h.remove()
    ratios, chosen = 1 - torch.arange(int(max_shrink * grid)) / grid, {}
    for name, lin in linears.items():
        x = torch.cat(inputs[name]).float()
        x, (o, i) = x[::max(1, len(x) // tokens)], lin.weight.shape
        pad = (0, -i % group)  # zeros: a width `group` does not divide ends in a short group, as IntWeight's does
        x, wg = F.pad(x, pad).view(len(x), -1, group), F.pad(lin.weight.float(), pad).view(o, -1, group)  # [t|o, g, group]
        ref, top, errs = torch.einsum("tgk,ogk->otg", x, wg), wg.abs().amax(-1, keepdim=True), []
        for r in ratios:
            q = IntWeight(torch.clamp(wg, -r * top, r * top).view(o, -1), 4, group).dequantize().view(o, -1, group)
            errs.append((torch.einsum("tgk,ogk->otg", x, q) - ref).pow(2).mean(1))  # [o, groups]
        chosen[name] = ratios[torch.stack(errs).argmin(0)]  # (argmin: the first of equal errors)
        t = (chosen[name][..., None] * top).to(lin.weight.dtype)
        lin.weight.copy_(torch.clamp(F.pad(lin.weight, pad).view(o, -1, group), -t, t).view(o, -1)[:, :i])
    return chosen


def to_compressed_tensors(folder, group: int = 128) -> int:
    """A Hugging Face folder's decoder linears (`*.layers.*_proj.weight`) rewritten as compressed-tensors'
    pack-quantized int4 (symmetric, one scale per `group` input features, halved until it divides every linear's;
    what llm-compressor's AWQ writes and transformers loads with compressed-tensors installed): weight_packed int32
    [o, i/8] (8 codes + 8 a word, the first in the low bits), weight_scale [o, i/group], weight_shape; config.json's
    quantization_config says so.
    Returns how many linears it quantized (0: none there, the folder unchanged)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    state, out = load_file(path), {}
    linears = [k for k in state if ".layers." in k and k.endswith("_proj.weight")]
    group = export_group([state[k].shape[1] for k in linears], group)
    for k, w in state.items():
        if ".layers." in k and k.endswith("_proj.weight"):
            q, p = IntWeight(w, 4, group), k[:-len("weight")]
            codes = _unpack4(q.codes)[:w.numel()].view(w.shape).int()  # code + 8, in 0..15
            word = sum(codes[:, j::8].long() << (4 * j) for j in range(8))  # [o, i/8] in 0..2^32-1
            out[p + "weight_packed"] = torch.where(word >= 2**31, word - 2**32, word).int()  # the same bits
            out[p + "weight_scale"], out[p + "weight_shape"] = q.scale.to(w.dtype), torch.tensor(w.shape)
        else:
            out[k] = w
    done = sum(k.endswith("weight_packed") for k in out)
    if not done:
        return 0
    save_file(out, path, metadata={"format": "pt"})
    config = json.loads((Path(folder) / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                  "group_size": group, "dynamic": False}}},
        "ignore": ["lm_head"]}
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2))
    return done
