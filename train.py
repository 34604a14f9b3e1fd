"""train.py — the command line, data -> batches, the flat training loop, checkpoints and logging.

Mirrors Megatron-LM's megatron/training/arguments.py (the flag names), training.py (pretrain, train_step: gradient
accumulation, clipping, the optimizer step, evaluation), checkpointing.py (iter_0000100/, latest_checkpointed_iteration
.txt) and optimizer/grad_scaler.py (dynamic loss scaling). Like nanoGPT's train.py: one flat loop you can read.

    make train MODEL=gpt                                       # the default run below: ~9 min on 2 CPU cores
    python train.py --save runs/gpt                            # the same, without make
    python train.py --train-iters 50 --num-layers 2 --save runs/tiny --data-path my.jsonl --json-keys text
    torchrun --nproc_per_node 2 train.py --tensor-model-parallel-size 2 --sequence-parallel --save runs/tp2
    torchrun --nproc_per_node 2 train.py --save runs/dp2       # DP = world / (TP x PP) = 2
    python train.py --load runs/gpt --save runs/gpt --train-iters 2000   # resume (any TP layout)
    python train.py sample --load runs/gpt --prompt "def "     # print generated text

Everything is validated (flags, layout, data, tokenizer) before any process group is made, and bad input ends with
one line `train.py: error: ...`. Data order depends only on (seed, iteration): each DP rank slices the same global batch.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import data
import parallel as P

MODELS = ("gpt", "bert", "t5", "retro", "mamba")  # --model NAME imports NAME.py (the model-file contract)


class ConfigError(ValueError):
    """A bad flag or combination; the message names the values."""


# ============================================================================================================
# 1. Arguments — Megatron's flag names (megatron/training/arguments.py)
# ============================================================================================================
def parse_args(argv):
    p = argparse.ArgumentParser(prog="train.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="gpt", choices=MODELS)
    # model (defaults: the `make train MODEL=gpt` run: a llama-style 4-layer model, ~5M parameters)
    a("--num-layers", type=int, default=4)
    a("--hidden-size", type=int, default=256)
    a("--num-attention-heads", type=int, default=8)
    a("--num-query-groups", type=int, default=None)
    a("--ffn-hidden-size", type=int, default=None, help="default 4h, or 8h/3 rounded up to 64 with --swiglu")
    a("--seq-length", type=int, default=128)
    a("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    a("--position-embedding-type", default="rope", choices=["learned_absolute", "rope", "none"])
    a("--normalization", default="RMSNorm", choices=["LayerNorm", "RMSNorm"])
    a("--swiglu", action=argparse.BooleanOptionalAction, default=True)
    a("--disable-bias-linear", action=argparse.BooleanOptionalAction, default=True)
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--hidden-dropout", type=float, default=0.0)
    a("--attention-dropout", type=float, default=0.0)
    a("--init-method-std", type=float, default=0.02)
    a("--make-vocab-size-divisible-by", type=int, default=128)
    # data and tokenizer
    a("--data-path", default=None, help="text file, directory, .jsonl, or a Megatron PREFIX (PREFIX.bin/.idx); "
                                        "default: the Python stdlib sources")
    a("--json-keys", nargs="+", default=["text"])
    a("--split", default="95,5", help="train,valid weights; documents are split, not tokens")
    a("--tokenizer-file", default=None, help="a HF tokenizers tokenizer.json (default: train a byte-level BPE)")
    a("--vocab-size", type=int, default=None, help="the BPE to train (default 8192), or the model's vocabulary")
    a("--data-cache-dir", default="data_cache")
    # training
    a("--micro-batch-size", type=int, default=16)
    a("--global-batch-size", type=int, default=16)
    a("--train-iters", type=int, default=500)
    a("--lr", type=float, default=3e-3)
    a("--min-lr", type=float, default=3e-4)
    a("--lr-warmup-iters", type=int, default=30)
    a("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine"])
    a("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    a("--weight-decay", type=float, default=0.1)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.95)
    a("--adam-eps", type=float, default=1e-8)
    a("--clip-grad", type=float, default=1.0, help="global gradient-norm clip; 0 = off")
    a("--bf16", action="store_true", help="bfloat16 autocast (fp32 master weights)")
    a("--fp16", action="store_true", help="float16 autocast with dynamic loss scaling")
    a("--initial-loss-scale", type=float, default=2.0**16)
    a("--loss-scale-window", type=int, default=1000, help="grow the scale x2 after this many clean steps")
    a("--min-loss-scale", type=float, default=1.0)
    # FP8 (parallel.py section 11): real FP8 GEMMs in every Column/RowParallel linear, fp32 master weights
    a("--fp8", action="store_true", help="FP8 linears (inputs, weights, output grads cast to float8)")
    a("--fp8-format", default="hybrid", choices=["e4m3", "hybrid"], help="hybrid: e4m3 forward, e5m2 grads")
    a("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise"])
    a("--fp8-margin", type=int, default=0, help="scale = (fp8_max / amax) / 2^margin")
    a("--fp8-amax-history-len", type=int, default=1024)
    a("--fp8-amax-compute-algo", default="max", choices=["max", "most_recent"])
    a("--transformer-impl", default="local", choices=["local", "transformer_engine"],
      help="transformer_engine: TE's Linear + autocast for --fp8 (needs CUDA and transformer_engine)")
    a("--seed", type=int, default=1234)
    # parallelism
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--sequence-parallel", action="store_true")
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None, help="interleaved 1F1B: layers per chunk")
    a("--pipeline-trace", action="store_true", help="print each rank's F/B order of the first iteration")
    a("--use-distributed-optimizer", action="store_true", help="ZeRO-1: Adam state and master weights over DP")
    a("--overlap-grad-reduce", action="store_true", help="bucketed DP reduction launched during backward")
    a("--ddp-bucket-size", type=int, default=4_000_000, help="elements per gradient bucket")
    a("--expert-model-parallel-size", type=int, default=1, help="MoE: experts sharded over this many DP ranks")
    a("--expert-tensor-parallel-size", type=int, default=None, help="MoE: 1 or TP (default TP)")
    # mixture of experts (parallel.py section 10)
    a("--num-experts", type=int, default=None, help="MoE layers with this many experts (default: dense MLPs)")
    a("--moe-router-topk", type=int, default=2)
    a("--moe-layer-freq", type=json.loads, default=1, help="every n-th layer is MoE, or a list like [1,0,1,0]")
    a("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    a("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    a("--moe-router-pre-softmax", action="store_true")
    a("--moe-aux-loss-coeff", type=float, default=1e-2, help="switch load-balancing loss (Megatron's default: 0)")
    a("--moe-z-loss-coeff", type=float, default=None)
    a("--moe-expert-capacity-factor", type=float, default=None, help="default: dropless")
    a("--moe-pad-expert-input-to-capacity", action="store_true")
    a("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"])
    a("--moe-shared-expert-intermediate-size", type=int, default=None)
    # checkpoints, evaluation, logging
    a("--save", default=None, help="run directory: checkpoints, metrics.jsonl, tensorboard/, loss.png")
    a("--load", default=None, help="resume from the latest checkpoint in this directory")
    a("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    a("--save-interval", type=int, default=0, help="0 = only at the end")
    a("--exit-interval", type=int, default=None, help="save and exit after this iteration number")
    a("--exit-duration-in-mins", type=float, default=None, help="save and exit after this many minutes of training")
    a("--eval-interval", type=int, default=100)
    a("--eval-iters", type=int, default=10)
    a("--log-interval", type=int, default=10)
    a("--bert-no-binary-head", action="store_true", help="BERT: masked LM only, no sentence-order head")
    a("--retro-chunk-length", type=int, default=None, help="Retro: chunk length m (default 64)")
    a("--retro-num-neighbors", type=int, default=None, help="Retro: neighbours k per chunk (default 2)")
    a("--retro-encoder-num-layers", type=int, default=None, help="Retro: neighbour encoder layers (default 2)")
    a("--retro-bert-load", default=None, help="Retro: embed chunks with this BERT run (train.py --model bert --save "
                                               "DIR; same tokenizer) instead of the deterministic bag of tokens")
    # Mamba (mamba.py): the hybrid stack and the mixer's dimensions (Megatron's flag names)
    a("--hybrid-layer-pattern", default=None, help='Mamba: e.g. "M-M*-M" (M mamba, * attention, - MLP, | stage)')
    for name in ("state-dim", "head-dim", "num-groups", "num-heads", "chunk-size"):
        a(f"--mamba-{name}", type=int, default=None)
    model = p.parse_known_args(argv)[0].model  # a model file may bring its own defaults (BERT: its architecture)
    if Path(__file__).with_name(f"{model}.py").exists():
        p.set_defaults(**getattr(importlib.import_module(model), "TRAIN_DEFAULTS", {}))
    return p.parse_args(argv)


def check_args(args, world: int):
    """Every flag and combination, before any process group exists. Fills the derived fields."""
    for name in ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "global_batch_size", "train_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "log_interval"]:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for name in ["hidden_dropout", "attention_dropout"]:
        if not 0 <= getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be in [0, 1)")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive")
    if args.transformer_impl == "transformer_engine" and not args.fp8:
        raise ConfigError("--transformer-impl transformer_engine is the backend of --fp8 here: add --fp8")
    if args.fp8 and args.fp16:
        raise ConfigError("--fp8 with --fp16 is not supported (use --bf16 or fp32 master weights)")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr={args.min_lr} is larger than --lr={args.lr}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vp, per = 1, args.num_layers_per_virtual_pipeline_stage
    if per is not None:
        if pp == 1 or per < 1 or args.num_layers % (pp * per):
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage={per} needs pipeline parallelism and "
                              f"--num-layers={args.num_layers} divisible by pp x it = {pp} x {per}")
        vp = args.num_layers // (pp * per)
    args.virtual_pipeline_model_parallel_size = vp
    args.use_ddp = args.use_distributed_optimizer or args.overlap_grad_reduce
    if args.use_ddp and args.fp16:
        raise ConfigError("--fp16 with --use-distributed-optimizer/--overlap-grad-reduce is not supported; use --bf16")
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by tensor x pipeline parallel size {tp} x {pp}")
    args.world_size, args.data_parallel_size = world, world // (tp * pp)
    step_rows = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % step_rows:
        raise ConfigError(f"--global-batch-size={args.global_batch_size} is not divisible by --micro-batch-size x "
                          f"data-parallel size = {args.micro_batch_size} x {args.data_parallel_size} = {step_rows}")
    args.num_micro_batches = args.global_batch_size // step_rows
    if vp > 1 and args.num_micro_batches % pp:
        raise ConfigError(f"interleaved pipelining needs the number of micro-batches {args.num_micro_batches} "
                          f"(global batch / (micro batch x dp)) to be a multiple of pp={pp}")
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length={args.seq_length} > --max-position-embeddings={args.max_position_embeddings}")
    ep, dp = args.expert_model_parallel_size, args.data_parallel_size
    if ep < 1 or dp % ep or (args.num_experts or ep) % ep:
        raise ConfigError(f"--expert-model-parallel-size={ep} must divide the data-parallel size {dp} and "
                          f"--num-experts={args.num_experts}")
    if args.expert_tensor_parallel_size not in (None, 1, tp):
        raise ConfigError(f"--expert-tensor-parallel-size={args.expert_tensor_parallel_size} must be 1 or TP={tp}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length={args.seq_length} divisible by TP={tp}")
    try:
        w = [float(x) for x in args.split.split(",")]
        args.valid_fraction = w[1] / sum(w)
        assert len(w) in (2, 3) and min(w) >= 0 and args.valid_fraction < 1
    except (ValueError, IndexError, AssertionError, ZeroDivisionError):
        raise ConfigError(f"--split={args.split!r}: expected 'train,valid' weights like 95,5") from None
    args.model_module = import_model(args.model)


def import_model(name):
    if not Path(__file__).with_name(f"{name}.py").exists():
        raise ConfigError(f"--model {name}: not available yet ({name}.py does not exist)")
    return importlib.import_module(name)


def model_config(module, args):
    """The model's Config from the flags, as Megatron's core_transformer_config_from_args: every flag whose name is
    a Config field is copied, plus the few whose meaning differs."""
    fields = {f.name for f in dataclasses.fields(module.Config)}
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    f = args.ffn_hidden_size or (64 * math.ceil(8 * args.hidden_size / 3 / 64) if args.swiglu else 4 * args.hidden_size)
    kw.update(ffn_hidden_size=f, activation="silu" if args.swiglu else "gelu", gated_linear_unit=args.swiglu,
              add_bias_linear=not args.disable_bias_linear,
              share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
              add_binary_head=not args.bert_no_binary_head)
    try:
        c = module.Config(**{k: v for k, v in kw.items() if k in fields})
        c.check_layout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return c


# ============================================================================================================
# 2. Data — corpus -> tokenizer -> token cache -> document split -> datasets (data.py does the work)
# ============================================================================================================
def next_token_loss(model, mb):
    """The GPT recipe: micro-batch [b, s+1] -> the SUM of its b·s next-token losses (a scalar)."""
    return model(mb[:, :-1], mb[:, 1:]).float().sum()


def batch_recipe(module, batch, args):
    """(loss_func(model, mb) -> the SUM of its losses, the global count that divides it) for one global batch.
    A model file may bring batch_recipe(batch) (BERT: divided by the masked tokens) or loss_func(model, mb)."""
    if hasattr(module, "batch_recipe"):
        return module.batch_recipe(batch)
    return getattr(module, "loss_func", next_token_loss), batch.shape[0] * args.seq_length


def build_data(args):
    """(tokenizer, train dataset, valid dataset). Runs on every rank; a file lock lets one rank build the caches."""
    cache = Path(args.data_cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # torchrun's ranks on one node: the first builds, the others read
        prefix = args.data_path
        if prefix and not os.path.exists(prefix) and os.path.exists(prefix + ".idx"):  # Megatron .bin/.idx
            source = data.IndexedDataset(prefix)
            tok_file = args.tokenizer_file or prefix + ".tokenizer.json"  # data.py preprocess writes it there
            if not os.path.exists(tok_file):
                raise data.DataError(f"{prefix}.bin/.idx needs the tokenizer it was made with: pass --tokenizer-file")
            tok = data.get_tokenizer(None, None, tokenizer_file=tok_file)
            top = int(source._bin.max()) if len(source._bin) else 0
            if top >= tok.get_vocab_size():
                raise data.DataError(f"{prefix}.bin holds token id {top}, outside the tokenizer's "
                                     f"vocabulary of {tok.get_vocab_size()} ({tok_file})")
        else:
            docs = data.load_documents(prefix, tuple(args.json_keys))
            h = hashlib.sha256(str(len(docs)).encode())
            for d in docs:
                h.update(d.encode("utf-8", errors="surrogatepass"))
            key = h.hexdigest()[:16]
            v = args.vocab_size or 8192
            tok = data.get_tokenizer(docs, str(cache / f"{key}-bpe{v}.json"), v, args.tokenizer_file)
            tok_key = hashlib.sha256(tok.to_str().encode()).hexdigest()[:8]
            source = data.build_token_cache(None, None, tok, str(cache / f"{key}-{tok_key}-tokens"), documents=docs)
    n_tok = tok.get_vocab_size()
    if args.vocab_size is not None and args.vocab_size < n_tok:
        raise data.DataError(f"the tokenizer has {n_tok} tokens, more than the model's --vocab-size={args.vocab_size}"
                             f" (tokenizer: {args.tokenizer_file or 'trained BPE'})")
    args.vocab_size = args.vocab_size or n_tok
    train_ids, valid_ids = data.split_documents(len(source), args.valid_fraction, seed=args.seed)
    make = getattr(args.model_module, "dataset", None)  # a model file may bring its samples (BERT: MLM + SOP)
    make = make or (lambda source, ids, args, tok, seed: data.GPTDataset(source, ids, args.seq_length, seed))
    train = make(source, train_ids, args, tok, args.seed)
    valid = make(source, valid_ids, args, tok, args.seed + 1) if len(valid_ids) else None
    return tok, train, valid


# ============================================================================================================
# 3. Optimizer pieces: learning-rate schedule, global gradient-norm clipping, dynamic loss scaling
# ============================================================================================================
def learning_rate(it: int, args) -> float:
    """LR for iteration `it` (0-based): linear warmup, then constant / linear / cosine decay to --min-lr
    (megatron/core/optimizer_param_scheduler.py)."""
    warm, decay = args.lr_warmup_iters, args.lr_decay_iters or args.train_iters
    if it < warm:
        return args.lr * (it + 1) / warm
    if it >= decay:
        return args.min_lr
    ratio = (it - warm) / max(1, decay - warm)
    coeff = {"constant": 1.0, "linear": 1.0 - ratio, "cosine": 0.5 * (1.0 + math.cos(math.pi * ratio))}
    return args.min_lr + coeff[args.lr_decay_style] * (args.lr - args.min_lr)


def clip_grad_norm(params, max_norm: float, grid) -> float:
    """Clip by the global L2 norm, counting every parameter exactly once: a TP-replicated grad (identical on every TP
    rank after finalize_grads) only on TP rank 0, the last stage's copy of the tied embedding not at all; then the
    squares are summed over TP x PP (and MoE experts over EP, where ranks hold different experts). Grads are
    already summed over DP, so DP ranks agree without communication. Returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    sq = torch.zeros(2, dtype=torch.float64, device=params[0].device)  # [dense, MoE expert]
    for p in params:
        duplicate = (not getattr(p, "tensor_model_parallel", False) and grid is not None and grid.tp.rank > 0) or (
            getattr(p, "shared_embedding", False) and grid is not None and grid.pp.rank > 0)
        if not duplicate:
            sq[int(getattr(p, "expert_parallel", False))] += p.grad.double().square().sum()
    if grid is not None:
        sq = P._all_reduce(sq, grid.mp)  # tensor x pipeline parallel: one model replica
        if grid.ep_size > 1:  # each EP rank holds different experts
            sq[1:] = P._all_reduce(sq[1:], grid.ep)
    norm = float(sq.sum().sqrt())
    if max_norm > 0 and norm > max_norm:
        for p in params:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def moe_metrics(model, load) -> dict:
    """MoE logging: tokens per expert over the log window [MoE layers][E] (all DP ranks), the worst layer's
    max/min expert load, and the layers' mean aux losses (last micro-batch, without their coefficients)."""
    routers = [m for m in model.modules() if isinstance(m, P.Router)]
    mean = lambda k: sum(float(r.stats[k]) for r in routers) / len(routers)
    return dict(moe_tokens_per_expert=load.long().tolist(),
                moe_load_max_over_min=float((load.max(1).values / load.min(1).values.clamp_min(1)).max()),
                load_balancing_loss=mean("load_balancing_loss"), z_loss=mean("z_loss"))


class LossScaler:
    """fp16 dynamic loss scaling (megatron/core/optimizer/grad_scaler.py, hysteresis 1): backward runs on
    loss x scale; a step whose grads hold inf/nan on any rank is skipped and halves the scale; `window` clean steps
    in a row double it. With fp32/bf16 the scale is 1 and nothing is ever skipped."""

    def __init__(self, args):
        self.enabled, self.window, self.min = args.fp16, args.loss_scale_window, args.min_loss_scale
        self.scale, self.clean = (args.initial_loss_scale if args.fp16 else 1.0), 0

    def unscale_and_check(self, params) -> bool:
        """Divide the grads by the scale; True if any rank found inf/nan (then the step must be skipped)."""
        if not self.enabled:
            return False
        bad = torch.zeros(1)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / self.scale)
                bad += (~torch.isfinite(p.grad)).any().float().cpu()
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        overflow = bool(bad.item() > 0)
        if overflow:
            self.scale, self.clean = max(self.scale / 2, self.min), 0
        else:
            self.clean += 1
            if self.clean % self.window == 0:
                self.scale *= 2
        return overflow


# ============================================================================================================
# 4. Checkpoints — torch.distributed.checkpoint, sharded; Megatron's directory layout (checkpointing.py)
#
#   SAVE/iter_0000100/  .metadata  __0_0.distcp ...  (DCP: each TP slice written once, by its owner)
#                       rng_rank0.pt ...              (per-rank RNG states)     meta.json (iteration, flags, scaler)
#   SAVE/latest_checkpointed_iteration.txt            written (atomically) only after iter_.../ is complete
#   TP-sharded tensors are saved as DTensors with their global shape, so DCP reads them back at any TP size.
#   A strided shard (SwiGLU fc1: [gate_r; up_r] on rank r) is viewed as [2, f/tp, h] of a global [2, f, h].
# ============================================================================================================
def checkpoint_state(chunks, optimizer, mesh, fp8: bool = True):
    """{'model': {global name: tensor}, 'optimizer': {global name: {exp_avg, exp_avg_sq, step}}} as views of
    the live tensors, so dcp.load writes straight into them. Pipeline stages save disjoint names (a last stage's
    copy of the tied embedding saves the same values under the same name: DCP keeps one). With `fp8`, also
    'fp8': {global weight name.role.amax_history / .scale} of every FP8 linear: the delayed recipe's state, the
    same on every TP and DP rank (amaxes are reduced), so it loads at any layout."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def as_dtensor(t, p, dim):
        if mesh is None or not getattr(p, "tensor_model_parallel", False):
            return t
        return DTensor.from_local(t, mesh, [Replicate(), Shard(dim)], run_check=False)

    def view(t, p):
        dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
        if isinstance(stride, (list, tuple)):  # per-segment shards (Mamba's in_proj [z_r, x_r, B_r, C_r, dt_r]):
            n = sum(stride) // t.shape[dim]  # one entry per segment, each a plain Shard (Megatron does the same)
            return {f"segment{i}": as_dtensor(seg, p, dim) for i, seg in enumerate(t.split([k // n for k in stride], dim))}
        if stride > 1:
            t, dim = t.unflatten(dim, (stride, -1)), dim + 1  # [.., stride, rows/stride, ..]
        return as_dtensor(t, p, dim)

    state = {"model": {}, "optimizer": {}}
    sharded = isinstance(optimizer, P.DistributedOptimizer)
    full = optimizer.full_state() if sharded else None  # DP slices gathered per parameter
    for model in chunks:
        gname = model.global_name if hasattr(model, "global_name") else (lambda name: name)
        for name, m in model.named_modules() if fp8 else ():
            if isinstance(getattr(m, "fp8", None), P.FP8LinearMeta):
                for role, t in zip(("input", "weight", "grad_output"), m.fp8.tensors()):
                    prefix = f"{gname(name + '.weight')}.{role}"
                    state.setdefault("fp8", {}).update({prefix + ".amax_history": t.amax_history,
                                                        prefix + ".scale": t.scale})
        for name, p in model.named_parameters():
            g = gname(name)
            state["model"][g] = view(p.data, p)
            if optimizer is not None:
                ea, eas, step = (*full[p], torch.tensor(float(optimizer.step_count))) if sharded else (
                    optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"], optimizer.state[p]["step"])
                state["optimizer"][g] = {"exp_avg": view(ea, p), "exp_avg_sq": view(eas, p), "step": step}
    return state


def _barrier():
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _quiet_dcp():  # DCP warns that it runs "in no_dist mode" when there is no process group: that is intended
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def save_checkpoint(args, it, chunks, optimizer, scaler, mesh):
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = Path(args.save) / f"iter_{it:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
    _barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    with _quiet_dcp():
        dcp.save(checkpoint_state(chunks, optimizer, mesh), checkpoint_id=str(tmp))
    rng = {"torch": torch.get_rng_state(), "tracker": [c.rng.states for c in chunks],
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, tmp / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        meta = {"iteration": it, "loss_scale": scaler.scale, "clean_steps": scaler.clean,
                "args": {k: v for k, v in vars(args).items() if k != "model_module"}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = Path(args.save) / "latest_checkpointed_iteration.txt"
        pointer.with_suffix(".tmp").write_text(f"{it}\n")
        os.replace(pointer.with_suffix(".tmp"), pointer)  # the commit point
    _barrier()


def find_checkpoint(load_dir, step=None):
    """(directory, meta) of the checkpoint to load, or None when load_dir has no checkpoint yet."""
    pointer = Path(load_dir) / "latest_checkpointed_iteration.txt"
    if step is None and not pointer.exists():
        return None
    it = step if step is not None else int(pointer.read_text().strip())
    d = Path(load_dir) / f"iter_{it:07d}"
    if not (d / "meta.json").exists():
        raise ConfigError(f"--load {load_dir}: checkpoint {d} is missing or incomplete")
    return d, json.loads((d / "meta.json").read_text())


ARCH_FLAGS = ["model", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "position_embedding_type", "normalization", "swiglu", "disable_bias_linear", "vocab_size",
              "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "max_position_embeddings"]


def load_checkpoint(ckpt, chunks, optimizer, scaler, mesh, layout, fp8_args=None):
    """`fp8_args` (this run's --fp8* flags, or None): the FP8 scaling state is loaded when the checkpoint was saved
    with the same ones; otherwise scaling starts afresh."""
    path, meta = ckpt
    keys = ["fp8", "fp8_format", "fp8_recipe", "fp8_amax_history_len"]
    fp8 = fp8_args is not None and all(meta["args"].get(k) == fp8_args[k] for k in keys)
    if fp8_args is not None and not fp8 and (dist.get_rank() if dist.is_initialized() else 0) == 0:
        saved = {k: meta["args"].get(k) for k in keys}
        print(f"note: {path} was saved with other FP8 settings ({saved}): FP8 scaling starts afresh")
    state = checkpoint_state(chunks, optimizer, mesh, fp8)
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(path))
    if isinstance(optimizer, P.DistributedOptimizer):  # keep this rank's slices of the loaded moments
        optimizer.load_full_state()
        optimizer.step_count = int(next(iter(state["optimizer"].values()))["step"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    same_layout = all(meta["args"].get(k) == v for k, v in layout.items())
    if same_layout:  # RNG streams are per rank: they carry over only to the same layout (as in Megatron)
        rng = torch.load(path / f"rng_rank{rank}.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        for c, states in zip(chunks, rng["tracker"]):
            c.rng.states = states
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    if optimizer is not None:
        scaler.scale, scaler.clean = meta["loss_scale"], meta["clean_steps"]
    return meta["iteration"], same_layout


# ============================================================================================================
# 5. Logging: progress bar (rank 0), metrics.jsonl, TensorBoard, loss.png
# ============================================================================================================
class Logger:
    def __init__(self, run_dir, rank, start, total, resume):
        self.on = rank == 0
        if not self.on:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        old = self.path.read_text().splitlines() if resume and self.path.exists() else []
        keep = [line for line in old if json.loads(line)["iteration"] <= start]  # drop lines past the checkpoint
        self.path.write_text("".join(line + "\n" for line in keep))
        self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=start + 1)
        self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, mininterval=1.0)

    def log(self, rec):
        if not self.on:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        for k, v in rec.items():
            if k != "iteration" and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, rec["iteration"])
        if "val_loss" in rec:
            self.bar.write(f"iteration {rec['iteration']}: validation loss {rec['val_loss']:.4f}")
        else:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", gnorm=f"{rec['grad_norm']:.3f}",
                                 tok_s=f"{rec['tokens_per_s']:.0f}")

    def close(self):
        if not self.on:
            return
        self.bar.close()
        self.tb.close()
        recs = [json.loads(line) for line in self.path.read_text().splitlines()]
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        tr = [r for r in recs if "loss" in r]
        va = [r for r in recs if "val_loss" in r]
        ax.plot([r["iteration"] for r in tr], [r["loss"] for r in tr], label="train")
        ax.plot([r["iteration"] for r in va], [r["val_loss"] for r in va], "o-", label="validation")
        ax.set(xlabel="iteration", ylabel="loss (nats/token)", title=str(self.dir))
        ax.legend()
        fig.savefig(self.dir / "loss.png", dpi=100, bbox_inches="tight")
        plt.close(fig)


# ============================================================================================================
# 6. Training
# ============================================================================================================
def setup(args):
    """Validate everything, then make the process group, the grid and the model. Returns a dict of the pieces."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_args(args, world)
    ckpt = find_checkpoint(args.load, args.ckpt_step) if args.load else None
    if ckpt is not None:
        if args.tokenizer_file is None and (Path(args.load) / "tokenizer.json").exists():
            args.tokenizer_file = str(Path(args.load) / "tokenizer.json")  # the tokenizer the model was trained with
        if args.vocab_size is None:
            args.vocab_size = ckpt[1]["args"]["vocab_size"]
    tok, train_ds, valid_ds = build_data(args)
    config = model_config(args.model_module, args)
    if ckpt is not None:
        diff = {k: (ckpt[1]["args"].get(k), getattr(args, k)) for k in ARCH_FLAGS
                if ckpt[1]["args"].get(k) != getattr(args, k)}
        if diff:
            raise ConfigError(f"--load {args.load}: the checkpoint's model differs: "
                              + ", ".join(f"{k}={a} in the checkpoint, {b} now" for k, (a, b) in diff.items()))
    # ---- nothing above made a process group; everything below may
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    mesh, tp, pp, dp = None, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size
    if world > 1:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        from torch.distributed.device_mesh import DeviceMesh
        mesh = DeviceMesh(device.type, torch.arange(world).view(pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        mesh = mesh["dp", "tp"]  # this pipeline stage's ranks: checkpoint shards are laid out over them
    else:
        torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores this process may use (taskset, cgroups)
    grid = P.Grid(tp=tp, pp=pp, dp=dp, ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
    if pp == 1:
        chunks = [args.model_module.Model(config, grid).to(device)]
    else:  # this rank's pipeline stage (v chunks of it with the interleaved schedule)
        make = lambda pre, post, offset, n: args.model_module.Model(
            config, grid, pre_process=pre, post_process=post, layer_offset=offset, num_layers=n).to(device)
        chunks = P.build_chunks(make, config.num_layers, grid, args.virtual_pipeline_model_parallel_size)
    model = torch.nn.ModuleList(chunks)  # all of this rank's parameters, for the optimizer and the audits
    model.layout_args = {k: getattr(args, k) for k in ["world_size", "tensor_model_parallel_size",
                                                       "pipeline_model_parallel_size"]}
    return dict(tok=tok, train=train_ds, valid=valid_ds, grid=grid, model=model, chunks=chunks, mesh=mesh,
                device=device, ckpt=ckpt, config=config, rank=dist.get_rank() if dist.is_initialized() else 0)


def make_optimizer(model, args, chunks=None, grid=None):
    """AdamW; no weight decay on biases and norm weights (Megatron's default param groups). State is created
    up front so a checkpoint can be loaded into it. With --use-distributed-optimizer / --overlap-grad-reduce:
    parallel.DDP's bucketed gradients and parallel.DistributedOptimizer (the same AdamW, sharded over DP)."""
    if getattr(args, "use_ddp", False):
        ddp = P.DDP(chunks, grid, bucket_size=args.ddp_bucket_size, overlap=args.overlap_grad_reduce,
                    distributed_optimizer=args.use_distributed_optimizer)
        return P.DistributedOptimizer(ddp, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                      weight_decay=args.weight_decay)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr,
                            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return opt


def print_config(args, s):
    n_params = sum(p.numel() for p in s["model"].parameters())  # this rank's
    print("------------------------ arguments ------------------------")
    for k, v in sorted(vars(args).items()):
        if k != "model_module":
            print(f"  {k} {'.' * (44 - len(k))} {v}")
    print(f"  (rank 0 holds {n_params:,} parameters; {s['grid']}; {len(s['train'])} train samples of "
          f"{args.seq_length} tokens, {len(s['valid']) if s['valid'] else 0} valid; device {s['device']})")
    print("-------------------- end of arguments ---------------------", flush=True)


@torch.no_grad()
def evaluate(s, valid, args, stage_step, autocast):
    """{'val_loss': mean loss per token over --eval-iters fixed global batches of the validation set (the same ones
    each time), plus the model file's eval_counts(model, mb) -> {name: (hits, total)} as ratios (BERT: MLM accuracy;
    without pipelining)}. A pipeline evaluates with the forward-only schedule."""
    chunks, grid, device = s["chunks"], s["grid"], s["device"]
    for c in chunks:
        c.eval()
    extra = getattr(args.model_module, "eval_counts", None) if grid.pp_size == 1 else None
    total, counts = torch.zeros(1, dtype=torch.float64, device=device), {}
    for k in range(args.eval_iters):
        batch = data.global_batch(valid, k, args.global_batch_size)
        recipe, num_tokens = batch_recipe(args.model_module, batch, args)
        micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].to(device).split(args.micro_batch_size))
        with autocast():
            loss = P.forward_backward(chunks, micro, lambda m, mb: stage_step(m, mb, recipe), num_tokens, grid,
                                      s["p2p_shape"], s["config"].params_dtype, forward_only=True)
        total += torch.as_tensor(loss, dtype=torch.float64, device=device)
        for mb in micro if extra else []:
            for name, hits in extra(chunks[0], mb).items():
                counts[name] = counts.get(name, 0) + torch.tensor(hits, dtype=torch.float64, device=device)
    total = torch.cat([total] + list(counts.values()))
    for g in (grid.pp, grid.dp):  # the last stage holds the loss; each DP rank its part
        total = P._all_reduce(total, g)
    for c in chunks:
        c.train()
    return dict(val_loss=float(total[0]) / args.eval_iters,
                **{name: float(total[1 + 2 * i] / total[2 + 2 * i]) for i, name in enumerate(counts)})


def stage_step(model, mb, recipe):
    """The schedule's contract: the SUM of the micro-batch's token losses on the last stage; on any other
    pipeline stage the stage's output hidden states. The recipe calls the model once; a forward hook catches an
    inner stage's output (what the recipe then does with it is discarded)."""
    if model.post_process:
        return recipe(model, mb)
    out = []
    hook = model.register_forward_hook(lambda m, i, o: out.append(o))
    try:
        recipe(model, mb)
    finally:
        hook.remove()
    return out[0]


def train(args):
    s = setup(args)
    fp8 = P.fp8_enable(s["model"], P.FP8Recipe(args.fp8_format, args.fp8_recipe, args.fp8_margin,
                                               args.fp8_amax_history_len, args.fp8_amax_compute_algo),
                       s["grid"], args.transformer_impl) if args.fp8 else None
    model, chunks, grid, device, rank = s["model"], s["chunks"], s["grid"], s["device"], s["rank"]
    if fp8 is not None and args.num_experts and rank == 0:
        print("note: --fp8 covers the attention and MLP linears; the routed MoE experts keep the parameters' dtype")
    optimizer, scaler = make_optimizer(model, args, chunks, grid), LossScaler(args)
    ddp = optimizer.ddp if isinstance(optimizer, P.DistributedOptimizer) else None
    tp = args.tensor_model_parallel_size
    s["p2p_shape"] = (args.seq_length // tp if s["config"].sequence_parallel and tp > 1 else args.seq_length,
                      args.micro_batch_size, s["config"].hidden_size)  # [s(/tp), b, h] between pipeline stages
    start = 0
    if s["ckpt"] is not None:
        start, rng_restored = load_checkpoint(s["ckpt"], chunks, optimizer, scaler, s["mesh"], model.layout_args,
                                              {k: getattr(args, k) for k in ["fp8", "fp8_format", "fp8_recipe",
                                                                             "fp8_amax_history_len"]} if fp8 else None)
        if rank == 0:
            print(f"resumed from {s['ckpt'][0]} at iteration {start}"
                  + ("" if rng_restored else " (different layout: RNG streams not restored)"))
    elif args.load and rank == 0:
        print(f"WARNING: no checkpoint in --load {args.load}; starting from scratch")
    if rank == 0:
        print_config(args, s)
    run_dir = args.save or time.strftime(f"runs/{args.model}-%Y%m%d-%H%M%S")  # no --save: a fresh directory
    if rank == 0 and args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        s["tok"].save(str(Path(args.save) / "tokenizer.json"))
    log = Logger(run_dir, rank, start, args.train_iters, resume=s["ckpt"] is not None)
    amp = torch.bfloat16 if args.bf16 else torch.float16
    autocast = lambda: torch.autocast(device.type, dtype=amp, enabled=args.bf16 or args.fp16)
    recipe = None  # set per global batch: (loss_func, the count of its loss tokens), see batch_recipe

    def loss_func(model, mb):  # the schedule's contract: see stage_step
        with autocast():
            return stage_step(model, mb, recipe)
    tokens_per_batch = args.global_batch_size * args.seq_length
    params = list(model.parameters())
    t0 = time.time()
    window, it = dict(loss=0.0, n=0, t=t0, skipped=0), start
    for it in range(start, args.train_iters):
        # ---- one global batch; this DP rank's rows; micro-batches (data.global_batch is layout-free)
        batch = data.global_batch(s["train"], it, args.global_batch_size)  # [gbs, s+1]
        recipe, num_tokens = batch_recipe(args.model_module, batch, args)  # loss tokens of the whole global batch
        mine = batch.chunk(grid.dp_size)[grid.dp.rank].to(device)  # [gbs/dp, s+1]
        micro_batches = mine.split(args.micro_batch_size)  # num_micro_batches x [mbs, s+1]
        if ddp is not None:
            optimizer.lr = learning_rate(it, args)
            optimizer.zero_grad(len(micro_batches))
        else:
            for g in optimizer.param_groups:
                g["lr"] = learning_rate(it, args)
            optimizer.zero_grad(set_to_none=False)
        trace = [] if args.pipeline_trace and it == start else None
        # fp16: backward runs on loss x scale, as sum / (num_tokens / scale), so MoE aux losses are scaled too
        loss = P.forward_backward(chunks, micro_batches, loss_func, num_tokens / scaler.scale, grid, s["p2p_shape"],
                                  s["config"].params_dtype, trace=trace) / scaler.scale
        if trace is not None:
            print(f"pipeline trace, rank {rank} (stage {grid.pp.rank}): "
                  + " ".join(f"{k}{mb}" + (f".{v}" if len(chunks) > 1 else "") for k, mb, v in trace), flush=True)
        if ddp is not None:
            ddp.finish_grad_sync()  # wait for the buckets; SP norm grads over TP; tied embedding over stages
        else:
            P.finalize_grads(chunks, grid)  # SP norm grads over TP; tied embedding over stages; sum over DP
        load = P.moe_load(model)  # MoE: tokens per expert [MoE layers, E] routed in this step, this DP rank
        if load is not None:
            window["moe_load"] = window.get("moe_load", 0) + P._all_reduce(load.to(device), grid.dp).cpu()
        skipped = scaler.unscale_and_check(params)
        if ddp is not None:
            grad_norm = float(optimizer.clip_grad_norm(args.clip_grad))
        else:
            grad_norm = float("nan") if skipped else clip_grad_norm(params, args.clip_grad, grid)
        if not skipped:
            optimizer.step()
        if fp8 is not None:
            fp8.update()  # delayed scaling: this step's amaxes (reduced over TP x DP) -> next step's scales
        loss = torch.as_tensor(loss, dtype=torch.float64, device=device).reshape(1)
        for g in (grid.pp, grid.dp):  # the last stage holds the loss; each DP rank its part of the global mean
            loss = P._all_reduce(loss, g)
        window["loss"] += float(loss)
        window["n"] += 1
        window["skipped"] += skipped
        n = it + 1  # iterations done (Megatron counts from 1)
        t_end = time.time()
        if rank == 0:
            log.bar.update(1)
        if n % args.log_interval == 0 or n == args.train_iters:
            dt = time.time() - window["t"]
            rec = dict(iteration=n, loss=window["loss"] / window["n"], lr=learning_rate(it, args), grad_norm=grad_norm,
                       tokens_per_s=window["n"] * tokens_per_batch / dt, skipped=window["skipped"])
            if args.fp16:
                rec["loss_scale"] = scaler.scale
            if "moe_load" in window:
                rec.update(moe_metrics(model, window["moe_load"]))
            log.log(rec)
            window = dict(loss=0.0, n=0, t=time.time(), skipped=0)
        stop = args.exit_interval is not None and n % args.exit_interval == 0
        if args.exit_duration_in_mins is not None:  # every rank must agree, or some would wait in a collective
            late = torch.tensor([float(time.time() - t0 > 60 * args.exit_duration_in_mins)])
            if dist.is_initialized():
                dist.all_reduce(late, op=dist.ReduceOp.MAX)
            if late.item() > 0 and n < args.train_iters:
                stop = True
                if rank == 0:
                    log.bar.write(f"--exit-duration-in-mins={args.exit_duration_in_mins} reached: stopping at {n}")
        if s["valid"] is not None and args.eval_iters > 0 and (
                (args.eval_interval and n % args.eval_interval == 0) or n == args.train_iters or stop):
            log.log(dict(iteration=n, **evaluate(s, s["valid"], args, stage_step, autocast)))
        if args.save and ((args.save_interval and n % args.save_interval == 0) or n == args.train_iters or stop):
            save_checkpoint(args, n, chunks, optimizer, scaler, s["mesh"])
        if stop:
            break
        window["t"] += time.time() - t_end  # tokens/s counts training time only, not evaluation or saving
    log.close()
    if rank == 0:
        secs = time.time() - t0
        done = max(0, n - start) if args.train_iters > start else 0
        print(f"done: {done} iterations in {secs:.0f} s ({done * tokens_per_batch / secs:.0f} "
              f"tokens/s with evaluation and saving); metrics, tensorboard/ and loss.png in {run_dir}", flush=True)
    return s


# ============================================================================================================
# 7. Loading a run for inference; sampling
# ============================================================================================================
def load_model(load_dir, step=None, flag="--load"):
    """A saved run for inference in one process (TP = PP = 1): (model, its flags, its tokenizer, (checkpoint
    directory, meta)). `train.py sample` and Retro's BERT chunk embedder (retrieval.ChunkEmbedder.load) read runs so."""
    ckpt = find_checkpoint(load_dir, step)
    if ckpt is None:
        raise ConfigError(f"{flag} {load_dir}: no checkpoint there (no latest_checkpointed_iteration.txt)")
    args = argparse.Namespace(**ckpt[1]["args"])
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    tok = data.get_tokenizer(None, None, tokenizer_file=str(Path(load_dir) / "tokenizer.json"))
    module = args.model_module = import_model(args.model)
    model = module.Model(model_config(module, args))
    with _quiet_dcp():
        dcp.load({"model": checkpoint_state([model], None, None)["model"]}, checkpoint_id=str(ckpt[0]))
    return model, args, tok, ckpt


def sample(argv):
    p = argparse.ArgumentParser(prog="train.py sample")
    p.add_argument("--load", required=True)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model, args, tok, _ = load_model(a.load)
    module = args.model_module
    torch.manual_seed(a.seed)
    if hasattr(module, "sample_text"):  # a model file with its own notion of a sample (T5: fill a masked span)
        text = module.sample_text(model, tok, a.prompt, a.max_new_tokens)
    else:
        ids = torch.tensor([tok.encode(a.prompt).ids])
        out = module.generate(model, ids, a.max_new_tokens, a.temperature, a.top_k, eod=data.special_ids(tok)["eod"])
        text = tok.decode(out[0].tolist())
    print(text)
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["sample"]:
            return sample(argv[1:])
        train(parse_args(argv))
    except (ConfigError, data.DataError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
