"""arguments.py — train.py's command line: every flag (Megatron's names), their checks, and the model's Config.

Mirrors Megatron-LM's megatron/training/arguments.py (parse_args, validate_args) and core_transformer_config_from_args.
A file of its own because the flags are a reference a reader looks up by name, not part of the loop: train.py reads
top to bottom as the training loop, and `checkpoint.load_model` (tools.py, Retro's BERT embedder) rebuilds a model
from a run's saved flags with `model_config` without importing train.py.

The flags here are the ones every model shares; a model file adds its own (its `add_arguments`, Megatron's
extra_args_provider) and its defaults (`TRAIN_DEFAULTS`), read through config.model_file. Everything is validated
before any process group is made; a bad flag or combination raises ConfigError, which train.py prints as one line
`train.py: error: ...`. check_args returns the flags read-only (Args): what a run finds later (the tokenizer's
vocabulary, the checkpoint it starts from) is returned by whatever finds it and passed on, never written back here.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
from pathlib import Path

import yaml

import data
import scheduler
from config import TASKS as TASK_MODULES
from config import (
    ConfigError,  # noqa: F401 (re-exported: the error every flag check raises)
    default_model,
    model_file,
    model_files,
)
from interop import hf, megatron_flags, tokenizer_files
from interop.megatron_flags import notes, transformer_impl  # noqa: F401 (re-exported: train.py's)
from posttraining import lora

TASKS = ("pretrain", *TASK_MODULES)  # --task: pretraining, or a post-training task (config.TASKS: the module that runs
# it, posttraining/recipes.py's offline tasks or posttraining/rl.py's online RL)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, as strict as Megatron's: no abbreviations (--train-iter is not --train-iters), negative
    numbers read as numbers (then range-checked: --lr -1e-3 is "--lr=-0.001 must be >= 0"), and a bad flag raises
    ConfigError (train.py prints it as one line, on rank 0 only) instead of printing the usage and exiting on every
    rank. --help still prints the usage."""

    def __init__(self, *a, **kw):
        super().__init__(*a, allow_abbrev=False, **kw)
        # argparse reads "-1e-3" or "-inf" as an option unless it looks like a number to this pattern
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.I)

    def error(self, message):
        raise ConfigError(message)


class Args(argparse.Namespace):
    """The flags after check_args: read-only. Anything a run discovers later is returned by the function that finds
    it and passed on (data.Corpus, checkpoint.Start, ...), so args always say what was asked for."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __setattr__(self, name, value):
        raise AttributeError(f"args are read-only after check_args (args.{name} = {value!r}): return what you found "
                             "and pass it on")

    def __delattr__(self, name):
        raise AttributeError(f"args are read-only after check_args (del args.{name})")


# --task's own defaults where pretraining's do not suit: above a model file's TRAIN_DEFAULTS, below the checkpoint's
# flags and the command's own (resolve's layer 4). Online RL starts from an SFT'd model: a learning rate 10x below
# pretraining's, a short run, groups of 8 completions of 16 prompts a step, short rows (the shipped task's
# chat-rendered prompts are at most 34 tokens, its answers a few tokens and eod), one held-out batch every 20 steps
# (bench/README.md "Online RL" measured these).
ONLINE_RL = dict(lr=3e-4, min_lr=3e-5, lr_warmup_iters=3, train_iters=60, grpo_group_size=8, global_batch_size=16,
                 micro_batch_size=32, seq_length=48, rollout_max_new_tokens=8, log_interval=5, eval_interval=20,
                 eval_iters=1)
TASK_DEFAULTS = {"grpo": ONLINE_RL, "ppo": ONLINE_RL}


GROUPS = ("model", "data", "training", "parallel", "checkpoint", "logging", "post-training", "compatibility")


def parse_args(argv, saved=None, known_only: bool = False):
    """argv -> the flags (a plain Namespace; check_args validates them and makes them read-only): the flags of every
    group, then `resolve` gives each its value. The model's own flags and defaults come from its model file, so
    `--model X --help` lists them. `saved`: the flags of the checkpoint the run starts from that shape the model, as
    defaults the command line may override: a dict, or a function of the first pass's flags that finds them
    (train.py's checkpoint.saved_flags; Megatron's --use-checkpoint-args). known_only: ignore flags this parser does
    not know (a first pass, before the checkpoint names the model)."""
    if callable(saved):
        return resolve_with_checkpoint(argv, saved)
    p = ArgumentParser(prog="train.py", add_help=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Train a model (`make train` runs the defaults); tools.py samples, merges, exports "
                                   "and scores a saved run.")
    p.add_argument("--config", default=None, help="a YAML file {flag name: value} (examples/); flags on the command "
                   "line override it")
    p.add_argument("--model", default=(saved or {}).get("model") or default_model(),
                   help=f"the model file to train: {', '.join(model_files())}, or your own NAME.py on the Python path "
                        "(config.py)")
    for name, add in zip(GROUPS, (model_flags, data_flags, training_flags, parallel_flags, checkpoint_flags,
                                  logging_flags, posttraining_flags, compatibility_flags)):
        add(p.add_argument_group(f"{name} flags"))
    return resolve(p, argv, saved or {}, known_only)



def model_flags(g):
    """The model's shape (defaults: the `make train MODEL=gpt` run: a llama-style 4-layer model, ~5M parameters),
    its positions' scaling, activation recomputation, DeepSeek-V3's layers."""
    a = g.add_argument
    a("--num-layers", type=int, default=4)
    a("--hidden-size", type=int, default=256)
    a("--num-attention-heads", type=int, default=8)
    a("--num-query-groups", type=int, default=None, help="key/value heads of grouped-query attention (default: one "
      "per head). Megatron reads it only with --group-query-attention; here it also acts alone (a note says so)")
    a("--group-query-attention", action="store_true", help="grouped-query attention with --num-query-groups groups "
      "(Megatron's switch; without --num-query-groups: 1 group, Megatron's default)")
    a("--kv-channels", type=int, default=None, help="the head dim d (default: hidden size / heads)")
    a("--ffn-hidden-size", type=int, default=None, help="default 4h, or 8h/3 rounded up to 64 with --swiglu")
    a("--seq-length", type=int, default=128)
    a("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    a("--position-embedding-type", default="rope", help="one of the model's Config.POSITION_EMBEDDING_TYPES")
    a("--no-position-embedding", dest="add_position_embedding", action="store_false",
      help="Megatron's older spelling; with a rotary --position-embedding-type nothing changes (there is no learned "
           "position table), otherwise it is refused, as Megatron refuses it")
    a("--rotary-base", type=float, default=None, help="RoPE's base (default 10000)")
    a("--normalization", default="RMSNorm", choices=["LayerNorm", "RMSNorm"])
    a("--norm-epsilon", type=float, default=None, help="every norm's epsilon (default 1e-5)")
    a("--apply-layernorm-1p", action="store_true", help="zero-centered norm weights: every norm scales by 1 + weight, "
      "the weight starting at 0 (Megatron's layernorm_zero_centered_gamma)")
    a("--qk-layernorm", action=argparse.BooleanOptionalAction, default=False, help="a norm (--normalization) over each "
      "head's q and k before RoPE, in every self-attention; with --multi-latent-attention: its q and kv latents' norms")
    a("--swiglu", action=argparse.BooleanOptionalAction, default=True)
    a("--disable-bias-linear", action=argparse.BooleanOptionalAction, default=True)
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--hidden-dropout", type=float, default=0.0)
    a("--attention-dropout", type=float, default=0.0)
    a("--init-method-std", type=float, default=0.02)
    a("--make-vocab-size-divisible-by", type=int, default=128)
    # long context (transformer.py): position scaling and activation recomputation. Defaults None = the
    # Config's (as a run saved before these flags existed has them), so checkpoint.ARCH_FLAGS compares them as equal
    a("--rotary-percent", type=float, default=None, help="rotate this fraction of each head's dims (default 1.0)")
    a("--rotary-seq-len-interpolation-factor", dest="seq_len_interpolation_factor", type=float, default=None,
      help="linear position interpolation: positions / factor")
    a("--use-rope-scaling", dest="rope_scaling", action="store_true", default=None, help="Llama 3.x frequency scaling")
    a("--rope-scaling-factor", type=float, default=None, help="Llama 3.x scaling factor (default 8)")
    a("--rotary-scaling-factor", "--yarn-rotary-scaling-factor", dest="yarn_rotary_scaling_factor", type=float,
      default=None, help="YaRN: context extension factor (default 1)")
    a("--yarn-original-max-position-embeddings", type=int, default=None, help="YaRN: pre-training context (4096)")
    a("--yarn-beta-fast", type=float, default=None, help="YaRN: ramp starts at dims turning this often (32)")
    a("--yarn-beta-slow", type=float, default=None, help="YaRN: ramp ends at dims turning this often (1)")
    a("--mscale", "--yarn-mscale", dest="yarn_mscale", type=float, default=None,
      help="YaRN: attention concentration numerator (1)")
    a("--mscale-all-dim", "--yarn-mscale-all-dim", dest="yarn_mscale_all_dim", type=float, default=None,
      help="YaRN: attention concentration denominator (0)")
    a("--recompute-granularity", default=None, choices=["full", "selective"],
      help="full: whole layers; selective: the attention core softmax(QK^T)V")
    a("--recompute-method", default=None, choices=["uniform", "block"],
      help="full only: uniform = chunks of --recompute-num-layers layers; block = the first N layers of each stage")
    a("--recompute-num-layers", type=int, default=None)
    # DeepSeek-V3's layers (deepseek.py): multi-latent attention and multi-token prediction, with --model gpt
    a("--multi-latent-attention", action="store_true", help="MLA instead of grouped-query attention (needs rope)")
    a("--q-lora-rank", type=int, default=None, help="MLA: the query's low rank (default: one full q projection)")
    a("--kv-lora-rank", type=int, default=32, help="MLA: the keys' and values' shared latent dim")
    a("--qk-head-dim", type=int, default=128, help="MLA: q/k head dim without position")
    a("--qk-pos-emb-head-dim", type=int, default=64, help="MLA: the decoupled RoPE dims (one key for all heads)")
    a("--v-head-dim", type=int, default=128)
    a("--mtp-num-layers", type=int, default=None, help="multi-token prediction depths on the last stage (default: off)")
    a("--mtp-loss-scaling-factor", type=float, default=0.1, help="MTP: the loss enters backward as factor/D per depth")


def data_flags(g):
    """The data, its tokenizer and packed documents (data.py, interop/tokenizer_files.py)."""
    a = g.add_argument
    # data and tokenizer
    a("--data-path", nargs="+", default=None,
      help="a source (text file, directory, .jsonl, or a Megatron PREFIX of PREFIX.bin/.idx), several (each weighing "
           "its size), or weight-source pairs '0.3 A 0.7 B' (Megatron's blend); default: the Python stdlib sources")
    a("--mock-data", action="store_true", help="Megatron's synthetic documents 1, 2, ..., eod instead of --data-path")
    a("--json-keys", nargs="+", default=["text"])
    a("--split", default="95,5", help="train,valid[,test] weights of the documents (not tokens), e.g. 949,50,1; the "
                                      "test part is held out and evaluated once training ends (test_loss)")
    a("--tokenizer-type", default=None, choices=tokenizer_files.TOKENIZER_TYPES,
      help="Megatron's tokenizer from local files (--vocab-file, --merge-file, --tokenizer-model, or --vocab-size for "
           "NullTokenizer); default: --tokenizer-file, else a byte-level BPE trained on the corpus")
    a("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json, or BertWordPiece*'s vocab.txt")
    a("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    a("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a local folder with tokenizer.json")
    a("--tiktoken-pattern", default=None, choices=["v1", "v2"], help="TikTokenizer's regex (that type is refused)")
    a("--tokenizer-file", default=None, help="a HF tokenizers tokenizer.json (default: train a byte-level BPE)")
    a("--vocab-size", type=int, default=None, help="the BPE to train (default 8192), or the model's vocabulary; "
                                                   "NullTokenizer: its ids before eod (Megatron's)")
    a("--data-cache-path", "--data-cache-dir", dest="data_cache_dir", default="data_cache",
      help="the tokenizers and token caches built from the data (Megatron's --data-cache-path)")
    a("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
      help="Megatron's: read the .bin files (a PREFIX's, the token caches) into memory instead of memory-mapping them")
    a("--num-workers", type=int, default=None, help="Megatron's DataLoader worker processes (its default 2); here the "
                                                    "samples are read in the training process (a note says so)")
    a("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader", action="store_false",
      help="Megatron's: no attention mask in the samples (here the model always makes the causal mask itself)")
    # packed documents (data.Packing; megatron/core/datasets/gpt_dataset.py): the documents a sample holds, apart
    a("--reset-position-ids", action="store_true", help="positions restart at 0 after each end-of-document token")
    a("--reset-attention-mask", action="store_true",
      help="a token attends only to its own document (block-causal mask)")
    a("--eod-mask-loss", action="store_true", help="no loss on the prediction made at an end-of-document token")


def training_flags(g):
    """The batch, the training length, the learning-rate schedule, the optimizer, precision, FP8, the seed."""
    a = g.add_argument
    # training
    a("--micro-batch-size", type=int, default=16)
    a("--global-batch-size", type=int, default=None, help="default: --micro-batch-size x data-parallel size")
    a("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
      help="grow the global batch from START by INCREMENT over SAMPLES samples to --global-batch-size "
           "(sample-based training only)")
    # the training length and the learning-rate schedule (scheduler.py): iteration-based (--train-iters,
    # the default run's) or sample-based (--train-samples), never mixed (scheduler.check_schedule_args)
    a("--train-iters", type=int, default=500, help="the default run's length, unless --train-samples is given")
    a("--train-samples", type=int, default=None, help="sample-based training: this many samples")
    a("--lr", type=float, default=3e-3)
    a("--min-lr", type=float, default=3e-4,
      help="default: the default run's 3e-4, or Megatron's 0.0 when --lr is given")
    a("--lr-warmup-iters", type=int, default=30,
      help="the default run's warmup, unless --lr, --train-samples or --lr-warmup-fraction is given (then Megatron's "
           "default: 0)")
    a("--lr-warmup-samples", type=int, default=0)
    a("--lr-warmup-fraction", type=float, default=None, help="warmup over this fraction of the decay steps")
    a("--lr-warmup-init", type=float, default=0.0, help="the warmup's first learning rate")
    a("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
      help="default: cosine; WSD fitted to --exit-duration-in-mins where a pretraining run gives no --train-iters, "
           "--lr-decay-iters or --train-samples (scheduler.TimeFit: --train-iters is then the most it runs)")
    a("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    a("--lr-decay-samples", type=int, default=None, help="default: --train-samples")
    a("--lr-wsd-decay-style", default=None, choices=["exponential", "linear", "cosine", "minus_sqrt"],
      help="WSD's annealing phase (default exponential)")
    a("--lr-wsd-decay-iters", type=int, default=None, help="WSD: the annealing phase's iterations")
    a("--lr-wsd-decay-samples", type=int, default=None, help="WSD: the annealing phase's samples")
    a("--weight-decay", type=float, default=0.1)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.95)
    a("--adam-eps", type=float, default=1e-8)
    a("--optimizer", default="adam", choices=["adam", "muon"],
      help="muon: Muon for the hidden matrices, AdamW for embeddings, output layer, norms and biases. The default is "
           "the model file's for pretraining whole weights, adam for adapters (--lora-rank) and post-training tasks")
    a("--muon-momentum", type=float, default=0.95)
    a("--muon-use-nesterov", action=argparse.BooleanOptionalAction, default=True)
    a("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations per step")
    a("--muon-fp32-matmul-prec", default="high", choices=["low", "medium", "high"],
      help="Newton-Schulz on a float32 update: high in float32, medium in bfloat16 where the device multiplies it "
           "natively (Megatron's default; here a model file's TRAIN_DEFAULTS picks it where its default run measured "
           "it); low is refused")
    a("--muon-matched-adamw-rms", type=float, default=0.2,
      help="the update's scale: this x sqrt(max(rows, cols)) x --lr (0.2 matches AdamW's update RMS)")
    a("--clip-grad", type=float, default=1.0, help="global gradient-norm clip; 0 = off")
    a("--bf16", action="store_true", help="bfloat16 autocast (fp32 master weights)")
    a("--fp16", action="store_true", help="float16 autocast with dynamic loss scaling")
    a("--initial-loss-scale", type=float, default=2.0**16)
    a("--loss-scale-window", type=int, default=1000, help="grow the scale x2 after this many clean steps")
    a("--min-loss-scale", type=float, default=1.0)
    a("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
      help="stop with an error at a non-finite loss or gradient norm (fp16: after --loss-scale-window skipped steps "
           "in a row at --min-loss-scale), before the step and before any checkpoint of it")
    a("--skip-nonfinite-steps", action="store_true",
      help="with the check: skip such a step (counted as `skipped` in metrics.jsonl) instead of stopping")
    # FP8 (parallel.py section 11): real FP8 GEMMs in every Column/RowParallel linear, fp32 master weights
    a("--fp8", action="store_true", help="FP8 linears (inputs, weights, output grads cast to float8): --fp8-format "
      "hybrid")
    a("--fp8-format", default=None, choices=["e4m3", "hybrid"], help="FP8 linears in this format (Megatron's switch: "
      "giving it turns FP8 on); hybrid: e4m3 forward, e5m2 grads")
    a("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise"])
    a("--fp8-margin", type=int, default=0, help="scale = (fp8_max / amax) / 2^margin")
    a("--fp8-amax-history-len", type=int, default=1024)
    a("--fp8-amax-compute-algo", default="max", choices=["max", "most_recent"])
    a("--transformer-impl", default="local", choices=["local", "transformer_engine"],
      help="transformer_engine: TE's Linear + autocast for --fp8 (needs CUDA and transformer_engine; otherwise the "
           "local implementation runs, said once). Megatron's default is transformer_engine")
    a("--fp8-param-gather", action="store_true", help="(accepted: parameters keep their dtype; FP8 casts are made in "
      "the GEMMs)")
    a("--seed", type=int, default=1234)


def parallel_flags(g):
    """Tensor, pipeline, data, context and expert parallelism, and MoE's router (parallel.py)."""
    a = g.add_argument
    # parallelism
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--sequence-parallel", action="store_true")
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None, help="interleaved 1F1B: layers per chunk")
    a("--pipeline-trace", action="store_true", help="print each rank's F/B order of the first iteration")
    a("--use-distributed-optimizer", action="store_true", help="ZeRO-1: Adam state and master weights over DP")
    a("--overlap-grad-reduce", action="store_true", help="bucketed DP reduction launched during backward")
    a("--ddp-bucket-size", type=int, default=4_000_000, help="elements per gradient bucket")
    a("--use-megatron-fsdp", action="store_true", help="Megatron-FSDP: --data-parallel-sharding-strategy applies")
    a("--data-parallel-sharding-strategy", default="no_shard",
      choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
      help="no_shard: plain DP; optim: ZeRO-1 (= --use-distributed-optimizer); optim_grads: ZeRO-2, the gradients "
           "reduce-scattered too; optim_grads_params: ZeRO-3, the parameters too (parallel.py section 14)")
    a("--use-torch-fsdp2", action="store_true", help="torch's FSDP2 (fully_shard) over DP x CP (parallel.TorchFSDP2)")
    a("--expert-model-parallel-size", type=int, default=1, help="MoE: experts sharded over this many DP ranks")
    a("--expert-tensor-parallel-size", type=int, default=None, help="MoE: 1 or TP (default TP)")
    # context parallelism (parallel.py section 12): the sequence split over cp ranks, attention exchanges K/V
    a("--context-parallel-size", type=int, default=1, help="cp: each rank holds 2 of 2·cp sequence chunks")
    a("--cp-comm-type", default="p2p", choices=["p2p", "all_gather", "a2a"],
      help="p2p: ring attention; all_gather: all-gather K/V; a2a: Ulysses all-to-all (heads %% cp == 0)")
    # mixture of experts (parallel.py section 10)
    a("--num-experts", type=int, default=None, help="MoE layers with this many experts (default: dense MLPs)")
    a("--moe-router-topk", type=int, default=2)
    a("--moe-layer-freq", type=megatron_flags.layer_freq, default=1,
      help="every n-th layer is MoE, or a list like [1,0,1,0] or Megatron's \"([0]+[1]*3)\"")
    a("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    a("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    a("--moe-router-pre-softmax", action="store_true")
    a("--moe-router-load-balancing-type", nargs="+", default="aux_loss", choices=megatron_flags.BALANCING,
      help="aux_loss: the switch loss per micro-batch; seq_aux_loss: per sequence (DeepSeek-V2); none: no "
           "load-balancing loss; sinkhorn and global_aux_loss are refused")
    a("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
      help="with --moe-expert-capacity-factor: each expert drops its least probable tokens, or its last ones")
    a("--moe-grouped-gemm", action="store_true", help="(accepted: the local experts always run as one grouped GEMM)")
    a("--moe-aux-loss-coeff", type=float, default=1e-2, help="switch load-balancing loss (Megatron's default: 0)")
    a("--moe-z-loss-coeff", type=float, default=None)
    a("--moe-expert-capacity-factor", type=float, default=None, help="default: dropless")
    a("--moe-pad-expert-input-to-capacity", action="store_true")
    a("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"])
    a("--moe-shared-expert-intermediate-size", type=int, default=None)
    a("--moe-shared-expert-gate", action="store_true", help="the shared expert's output times a per-token sigmoid gate")
    # DeepSeek-V3 routing (gpt.Config's checks): groups, scaling, aux-loss-free balancing by an expert bias
    a("--moe-router-num-groups", type=int, default=None, help="group-limited routing: experts in this many groups")
    a("--moe-router-group-topk", type=int, default=None, help="group-limited routing: groups each token may use")
    a("--moe-router-topk-scaling-factor", type=float, default=None, help="the top-k routing weights times this")
    a("--moe-router-enable-expert-bias", action="store_true", default=None,  # None when off: as in older checkpoints
      help="aux-loss-free load balancing (sigmoid router)")
    a("--moe-router-bias-update-rate", type=float, default=1e-3, help="expert bias step after each optimizer step")


def checkpoint_flags(g):
    """Where a run saves, what it loads and when it stops (checkpoint.py)."""
    a = g.add_argument
    a("--save", default=None, help="run directory: checkpoints, metrics.jsonl, tensorboard/, loss.png")
    a("--load", default=None, help="resume from the latest checkpoint in this directory")
    a("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    a("--overwrite-save", action="store_true", help="allow --save to replace a run that this run does not resume")
    a("--save-interval", type=int, default=0, help="0 = only at the end")
    a("--check-only", action="store_true", help="check the flags, data and checkpoints for a world of WORLD_SIZE "
      "(environment; default 1) ranks, then exit: make train runs it before torchrun starts the ranks")
    a("--keep-last-checkpoints", type=int, default=None, help="after each save, delete all but the newest N "
      "checkpoints of --save (default: keep every one, as Megatron does)")
    a("--exit-interval", type=int, default=None, help="save and exit after this iteration number")
    a("--exit-duration-in-mins", type=float, default=None, help="save and exit after this many minutes of training")
    a("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=True,
      help="on SIGINT (Ctrl-C) or SIGTERM: finish the step, save, say how to resume, exit (a second one: at once)")
    a("--no-load-optim", action="store_true", help="resume a checkpoint's weights and iteration without its optimizer "
      "state: fresh Adam moments and loss scale, and the learning-rate schedule starts again (Megatron's)")
    a("--no-load-rng", action="store_true", help="resume without the checkpoint's RNG states (the seed's instead)")
    a("--override-opt_param-scheduler", action="store_true", help="resuming: take this command's learning-rate "
      "schedule where it differs from the checkpoint's (scheduler.resumed_schedule)")
    a("--use-checkpoint-opt_param-scheduler", action="store_true", help="resuming: continue the checkpoint's "
      "learning-rate schedule even where schedule flags are given (without them it continues anyway)")
    a("--use-checkpoint-args", action=argparse.BooleanOptionalAction, default=None,
      help="take the model's flags from the checkpoint a run resumes or starts from, unless given: on by default "
           "here; --no-use-checkpoint-args: the command line's only (they must match the checkpoint's)")
    a("--ckpt-format", default="torch_dist", choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
      help="torch_dist (torch.distributed.checkpoint, checkpoint.py); the others are refused")


def logging_flags(g):
    """Evaluation, logging and profiling (metrics.py)."""
    a = g.add_argument
    a("--eval-interval", type=int, default=100)
    a("--eval-iters", type=int, default=10)
    a("--log-interval", type=int, default=10)
    a("--tensorboard-dir", default=None, help="where TensorBoard's events go (default: the run directory's "
                                              "tensorboard/)")
    a("--wandb-project", default="", help="refused: nothing leaves this machine (metrics.jsonl, TensorBoard)")
    a("--wandb-exp-name", default="", help="refused, as --wandb-project")
    a("--profile", action="store_true", help="torch.profiler over iterations [--profile-step-start, "
      "--profile-step-end) of --profile-ranks, its trace in the TensorBoard directory")
    a("--profile-step-start", type=int, default=10)
    a("--profile-step-end", type=int, default=12)
    a("--profile-ranks", nargs="+", type=int, default=[0])
    a("--log-throughput", action="store_true", help="(accepted: tokens/s and tflops are always logged)")


def posttraining_flags(g):
    """LoRA, weights-only loading, the post-training tasks and online RL (posttraining/)."""
    a = g.add_argument
    # post-training (posttraining/lora.py, checkpoint.py): LoRA adapters on a frozen model; weights-only loading (--finetune)
    a("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank on the frozen model (default: off)")
    a("--lora-alpha", type=float, default=None, help="LoRA scale = alpha / rank (default: alpha = rank)")
    a("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    a("--lora-target-modules", nargs="+", default=list(lora.TARGETS), choices=lora.TARGETS)
    a("--quantize-base", default=None, choices=["nf4", "int8"], help="QLoRA: the frozen base's linears stored in NF4 "
      "or int8, dequantized per layer (posttraining/quantization.py; default: full precision)")
    a("--finetune", action="store_true", help="load only the model weights of --load (or --pretrained-checkpoint): "
                                              "iteration 0, a fresh optimizer and RNG (continued pretraining, SFT, LoRA)")
    a("--pretrained-checkpoint", default=None, help="the run to start from (weights only) while --load has no checkpoint "
      "(a Hugging Face folder: `tools.py import-hf` it first)")
    a("--hf-architecture", type=json.loads, default=None, help=argparse.SUPPRESS)  # set by a checkpoint only (interop/hf.py)
    # post-training tasks (posttraining/recipes.py): supervised fine-tuning, preference optimization, reward models
    a("--task", default="pretrain", choices=TASKS, help="sft: response tokens only; dpo / kto: against a frozen "
      "reference model (the starting weights); rm: a reward model (a value head, Bradley-Terry loss on pairs); "
      "grpo / ppo: online RL on the policy's own samples (posttraining/rl.py; ppo adds a value head beside the output)")
    a("--dpo-beta", type=float, default=0.1, help="DPO: the KL penalty's strength beta")
    a("--dpo-label-smoothing", type=float, default=0.0, help="cDPO: the assumed fraction of flipped preferences")
    a("--kto-beta", type=float, default=0.1, help="KTO: beta")
    a("--kto-desirable-weight", type=float, default=1.0, help="KTO: the weight of desirable samples' losses")
    a("--kto-undesirable-weight", type=float, default=1.0, help="KTO: the weight of undesirable samples' losses")
    a("--packing", action="store_true", help="SFT: several samples per sequence, attention kept within each")
    a("--grpo-group-size", type=int, default=4, help="GRPO, PPO: completions sampled per prompt, G (TRL's "
      "num_generations; PPO may take 1); the global batch counts prompts")
    a("--grpo-iterations", type=int, default=1, help="GRPO, PPO: optimizer steps on each batch of rollouts, mu (TRL's "
      "num_iterations): the old log-probs of the clipped ratio (PPO: and the old values) are those at rollout time")
    a("--grpo-clip-eps", type=float, default=0.2, help="GRPO, PPO: the ratio's clip range epsilon")
    a("--grpo-kl-beta", type=float, default=0.04, help="GRPO: the KL penalty to the frozen reference (0: no "
      "reference model)")
    a("--grpo-loss-average", default="token", choices=("token", "sequence"), help="GRPO: the loss's units: "
      "completion tokens (DAPO's) or completions, each its tokens' mean (the GRPO paper's)")
    a("--ppo-kl-coef", type=float, default=0.05, help="PPO: the per-token KL penalty to the frozen reference in the "
      "rewards, r_t = -coef (old_t - ref_t) (0: no reference model)")
    a("--ppo-gamma", type=float, default=1.0, help="PPO: GAE's discount gamma, in (0, 1]")
    a("--ppo-lambda", type=float, default=0.95, help="PPO: GAE's lambda, in [0, 1]")
    a("--ppo-vf-coef", type=float, default=0.1, help="PPO: the value loss's weight in the loss")
    a("--ppo-cliprange-value", type=float, default=0.2, help="PPO: how far a value may move from its rollout-time "
      "value before the clipped value loss takes over")
    a("--rollout-max-new-tokens", type=int, default=16, help="GRPO, PPO: the longest completion")
    a("--rollout-temperature", type=float, default=1.0, help="GRPO, PPO: the rollouts' sampling temperature")
    a("--rollout-top-p", type=float, default=1.0, help="GRPO, PPO: the rollouts' nucleus (1: off)")
    a("--reward-function", help="GRPO, PPO: FILE.py:NAME, NAME(prompt, completion, record) -> float (default: rl.py's "
      "bracket check of the shipped prompts)")
    a("--reward-model", help="GRPO, PPO: a reward model's run (--task rm) scores the completions instead")


def compatibility_flags(g):
    """Megatron's runtime and compatibility flags: kernels, fusions and processes (interop/megatron_flags.py: what
    runs instead of each, what is refused)."""
    megatron_flags.add_arguments(g)


# ---------------------------------------------------------------------------------------------- where a value comes from
# A flag's value comes from the first of these that sets it, the command line first (DESIGN.md §1 "Where a flag's
# value comes from" has the table; tests/test_arguments.py pins each adjacent pair):
#   7. the command line                        (argv)
#   6. --config FILE's YAML                    (config_argv: its tokens go before argv, so argv overrides them)
#   5. the checkpoint's saved flags            (checkpoint.saved_flags, through `saved`: the model's shape)
#   4. --task's TASK_DEFAULTS                  (above)
#   3. the model file's OPTIMIZER_DEFAULTS     (where --optimizer is not the one its TRAIN_DEFAULTS names: those, or
#                                               train.py's own OPTIMIZER_SETTINGS: --lr, --min-lr, --adam-beta2, ...)
#   2. the model file's TRAIN_DEFAULTS         (its default run)
#   1. the defaults registered here            (the *_flags groups)
# --model itself: the command line, the YAML, the checkpoint's, else config.default_model(). Last, four schedule flags
# (SCHEDULE_DEFAULTS, below) not given on the command line or in the YAML take layers 1-5's value or Megatron's,
# depending on what the command did give.


def resolve(p: argparse.ArgumentParser, argv: list[str], saved: dict, known_only: bool = False) -> argparse.Namespace:
    """The one place the layers above are applied, lowest first, on the parser `p` of every group's flags."""
    config = p.parse_known_args(argv)[0].config
    yaml_known = config_argv(p, config, known=True) if config else []
    model = p.parse_known_args(yaml_known + list(argv))[0].model
    mf = model_file(model)  # the model file: its own flags, then its defaults for everyone's
    next(act for act in p._actions if act.dest == "position_embedding_type").choices = \
        list(mf.Config.POSITION_EMBEDDING_TYPES)
    mf.add_arguments(p.add_argument_group(f"--model {model}'s own flags ({model}.py)"))
    own = {k: p.get_default(k) for k in OPTIMIZER_SETTINGS}  # train.py's own: AdamW's on the default shape
    p.set_defaults(**mf.TRAIN_DEFAULTS)  # 2.
    pre = p.parse_known_args(yaml_known + list(argv), argparse.Namespace(optimizer=UNSET))[0]
    task, optimizer = pre.task, pre.optimizer
    adapters = pre.lora_rank is not None or saved.get("lora_rank") is not None  # (a resumed LoRA run: the saved rank)
    if optimizer is UNSET:  # the model file's for pretraining whole weights; adapters and post-training: AdamW
        optimizer = p.get_default("optimizer") if task == "pretrain" and not adapters else "adam"
    if optimizer != mf.TRAIN_DEFAULTS.get("optimizer", optimizer):  # 3. a model file's rates suit the optimizer it names
        p.set_defaults(**{**own, **mf.OPTIMIZER_DEFAULTS.get(optimizer, {})})
    p.set_defaults(**TASK_DEFAULTS.get(task, {}), optimizer=optimizer)  # 4.
    dests = {act.dest for act in p._actions}
    p.set_defaults(**{k: v for k, v in saved.items() if k in dests})  # 5.
    p.add_argument("-h", "--help", action="help", help="show this message (with --model NAME: that model's own flags "
                   "too)")
    argv = (config_argv(p, config, known=known_only) if config else []) + list(argv)  # 6. and 7.
    megatron_flags.check_one_spelling(p, argv)
    unset = argparse.Namespace(**dict.fromkeys(scheduler.SCHEDULE_FLAGS, UNSET))  # argparse leaves them if not given
    got = vars(p.parse_known_args(argv, unset)[0] if known_only else p.parse_args(argv, unset))
    given = [k for k in scheduler.SCHEDULE_FLAGS if got[k] is not UNSET]  # (a resumed run: scheduler.resumed_schedule)
    got.update({k: p.get_default(k) for k in scheduler.SCHEDULE_FLAGS if got[k] is UNSET and k not in SCHEDULE_DEFAULTS})
    sample_based = got["train_samples"] is not None
    other = {"train_iters": None if sample_based else p.get_default("train_iters"),
             "lr_warmup_iters": 0 if sample_based or got["lr_warmup_fraction"] is not None or got["lr"] is not UNSET
             else p.get_default("lr_warmup_iters"),
             "lr": p.get_default("lr"), "min_lr": p.get_default("min_lr") if got["lr"] is UNSET else 0.0,
             "lr_decay_style": "WSD" if got["train_iters"] is UNSET and not sample_based and got["task"] == "pretrain"
             and got["lr_decay_iters"] is None and got["lr_wsd_decay_iters"] is None
             and got["exit_duration_in_mins"] is not None else p.get_default("lr_decay_style")}
    return argparse.Namespace(**{k: other[k] if v is UNSET else v for k, v in got.items()}, schedule_flags_given=given)


def resolve_with_checkpoint(argv: list[str], find) -> argparse.Namespace:
    """Layer 5 found from the command line: a first pass names the checkpoint (--load, --ckpt-step,
    --pretrained-checkpoint), `find` (checkpoint.saved_flags) reads its flags that shape the model, and the flags are
    parsed again with them. What the checkpoint set that the command line alone would not have is said in one line
    (rank 0). --no-use-checkpoint-args: the command line's only."""
    first = parse_args(argv, known_only=True)
    saved = find(first) if first.use_checkpoint_args is not False else {}
    args = parse_args(argv, saved)
    plain = vars(first) if saved else {}
    taken = {k: v for k, v in saved.items() if k in plain and plain[k] != v == getattr(args, k)}
    if taken and int(os.environ.get("RANK", "0")) == 0:
        print("from the checkpoint: " + ", ".join(f"--{k.replace('_', '-')} {brief(v)}" for k, v in taken.items()),
              flush=True)
    return args


def run_flags(saved: dict, model: str | None = None) -> dict:
    """A saved run's flags (a checkpoint's meta.json "args") over layers 1-4 of its model file: a flag the run saved
    before it existed takes its default (checkpoint.load_model, check_same_model). `model`: when `saved` names none."""
    return {**vars(parse_args(["--model", saved.get("model", model)])), **saved}



# The default run is iteration-based: --train-iters and --lr-warmup-iters take its values (500 or the model file's,
# and 30) only where a command asks for nothing else. A sample-based command (--train-samples) or a warmup fraction
# (--lr-warmup-fraction) leaves them at Megatron's defaults (None, 0), so Megatron's rules
# (scheduler.check_schedule_args) refuse only what a command itself mixes. Likewise --min-lr and the warmup: the
# default run's 3e-4 and 30 beside its --lr, Megatron's 0.0 and 0 beside a command's own --lr. And --optimizer: the
# model file's (gpt: muon) where whole weights are pretrained, adam where adapters or a post-training task train; a
# model file's --lr and --min-lr go with the optimizer it names (gpt: muon); another optimizer takes the model file's
# OPTIMIZER_DEFAULTS for it (bert: AdamW's own rates), else train.py's (AdamW's on the default shape). And the decay
# style: a pretraining run given no length (--train-iters, --lr-decay-iters, --train-samples) but a time
# (--exit-duration-in-mins, as make train gives) fits its schedule to the time: WSD (scheduler.TimeFit).
# What a model file's TRAIN_DEFAULTS set for the optimizer it names, and another optimizer takes from OPTIMIZER_DEFAULTS
# or train.py's own (layer 3 above)
OPTIMIZER_SETTINGS = ("lr", "min_lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay")
SCHEDULE_DEFAULTS = ("train_iters", "lr_warmup_iters", "lr", "min_lr", "lr_decay_style")
UNSET = "(not given)"


# The range of every numeric flag: (test, what it must be). A flag left at None (its default: derived or off) is not
# checked. Written so that NaN fails every test.
_AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
_AT_LEAST_0 = (lambda v: v >= 0, ">= 0")
_POSITIVE = (lambda v: v > 0, "> 0")
_FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
RANGES = {
    **dict.fromkeys(["num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by", "vocab_size",
                     "micro_batch_size", "global_batch_size", "train_iters", "lr_decay_iters", "loss_scale_window",
                     "train_samples", "lr_decay_samples",
                     "fp8_amax_history_len", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "ddp_bucket_size", "expert_model_parallel_size", "num_experts", "moe_router_topk",
                     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "exit_interval", "log_interval"],
                    _AT_LEAST_1),
    **dict.fromkeys(["lr_warmup_samples", "lr_warmup_init", "lr_wsd_decay_iters", "lr_wsd_decay_samples"],
                    _AT_LEAST_0),
    "lr_warmup_fraction": _FRACTION,
    **dict.fromkeys(["lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad", "init_method_std", "fp8_margin",
                     "moe_aux_loss_coeff", "moe_z_loss_coeff", "seed", "ckpt_step", "save_interval", "eval_interval",
                     "eval_iters"], _AT_LEAST_0),
    **dict.fromkeys(["adam_eps", "initial_loss_scale", "min_loss_scale", "exit_duration_in_mins",
                     "moe_expert_capacity_factor"], _POSITIVE),
    **dict.fromkeys(["adam_beta1", "adam_beta2", "hidden_dropout", "attention_dropout"], _FRACTION),
}

RANGES.update({  # long context
    **dict.fromkeys(["recompute_num_layers", "yarn_original_max_position_embeddings"], _AT_LEAST_1),
    **dict.fromkeys(["rotary_percent", "yarn_beta_fast", "yarn_beta_slow"], _POSITIVE),
    **dict.fromkeys(["yarn_mscale", "yarn_mscale_all_dim"], _AT_LEAST_0),
    **dict.fromkeys(["seq_len_interpolation_factor", "rope_scaling_factor", "yarn_rotary_scaling_factor"],
                    (lambda v: v >= 1, ">= 1"))})


RANGES.update({**dict.fromkeys(["kv_channels", "distributed_timeout_minutes"], _AT_LEAST_1),  # Megatron's flags
                **dict.fromkeys(["rotary_base", "norm_epsilon"], _POSITIVE),
                **dict.fromkeys(["decoupled_lr", "decoupled_min_lr", "manual_gc_interval", "profile_step_start"],
                                _AT_LEAST_0)})


def check_long_context_args(args):
    """Position scaling and recomputation flags that only make sense together (Megatron's validate_args rules)."""
    pos = args.position_embedding_type
    yarn = [f"--{k.replace('_', '-')}" for k in vars(args) if k.startswith("yarn_") and getattr(args, k) is not None]
    if yarn and pos != "yarn":
        raise ConfigError(f"{', '.join(yarn)} need --position-embedding-type yarn (it is {pos})")
    if (args.rope_scaling or args.rope_scaling_factor is not None) and pos != "rope":
        raise ConfigError(f"--use-rope-scaling/--rope-scaling-factor need --position-embedding-type rope (it is {pos})")
    if args.rope_scaling_factor is not None and not args.rope_scaling:
        raise ConfigError(f"--rope-scaling-factor={args.rope_scaling_factor} acts only with --use-rope-scaling")
    if (args.rotary_percent is not None or args.seq_len_interpolation_factor is not None) and pos not in ("rope",
                                                                                                          "yarn"):
        raise ConfigError(f"--rotary-percent/--rotary-seq-len-interpolation-factor need a rotary "
                          f"--position-embedding-type (it is {pos})")
    g, m, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if g != "full" and (m is not None or n is not None):
        raise ConfigError(f"--recompute-method={m} / --recompute-num-layers={n} need --recompute-granularity full "
                          f"(it is {g})")
    if g == "full" and (m is None or n is None):
        raise ConfigError(f"--recompute-granularity full needs --recompute-method (uniform|block) and "
                          f"--recompute-num-layers (got {m}, {n})")
    per_stage = args.num_layers // (args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size)
    if n is not None and n > per_stage:
        raise ConfigError(f"--recompute-num-layers={n} > the {per_stage} layers of a pipeline stage (chunk)")


RANGES.update(keep_last_checkpoints=_AT_LEAST_1)
RANGES.update(lora_rank=_AT_LEAST_1, lora_alpha=_POSITIVE, lora_dropout=_FRACTION)  # post-training flags
RANGES.update(**dict.fromkeys(["dpo_beta", "kto_beta", "kto_desirable_weight", "kto_undesirable_weight"], _POSITIVE),
              dpo_label_smoothing=(lambda v: 0 <= v <= 0.5, "in [0, 0.5] (cDPO: the fraction of flipped labels)"))


def parse_split(split: str) -> list[float]:
    """--split 'train,valid[,test]' -> the three normalized fractions (Megatron's parse_and_normalize_split: missing
    parts are 0; quotes and spaces, as a shell script may leave them, are ignored)."""
    try:
        w = [float(x) for x in re.sub(r"[\s'\"]", "", split).split(",")]
        assert 1 <= len(w) <= 3 and all(math.isfinite(x) and x >= 0 for x in w) and w[0] > 0
    except (ValueError, AssertionError):
        raise ConfigError(f"--split={split!r}: expected train,valid[,test] weights like 949,50,1 (train > 0)") from None
    w += [0.0] * (3 - len(w))
    return [x / sum(w) for x in w]


def check_data_args(args) -> tuple[float, float, str | list | None, str | None]:
    """The data and tokenizer flags (data.py and interop/tokenizer_files.py read them): --split's parts, the sources,
    the tokenizer type and the files it needs. Returns (valid_fraction, test_fraction, data_path, tokenizer_type):
    data_path is one source (a str, as the post-training tasks read it) or a blend's entries (a list); tokenizer_type
    is filled in from --vocab-file if not given. check_args sets them on its copy."""
    _, valid_fraction, test_fraction = parse_split(args.split)
    data_path = args.data_path
    if args.mock_data and args.data_path:
        raise ConfigError("--mock-data and --data-path are two data sources: pass one (as Megatron asserts)")
    if isinstance(data_path, list):
        try:
            blend = data.parse_blend(data_path)
        except data.DataError as e:
            raise ConfigError(str(e)) from None
        data_path = blend.paths[0] if blend and len(blend.paths) == 1 and blend.weights is None else data_path or None
    if isinstance(data_path, list) and args.task != "pretrain":
        raise ConfigError(f"--task {args.task} reads one JSON-lines file: --data-path has {len(data_path)} entries")
    if test_fraction > 0 and args.task != "pretrain":
        raise ConfigError(f"--split={args.split}: --task {args.task} splits its records into train and valid only")
    if args.mock_data and args.task != "pretrain":
        raise ConfigError(f"--mock-data makes pretraining documents: --task {args.task} needs records")
    if not args.create_attention_mask_in_dataloader and args.reset_attention_mask:
        raise ConfigError("--no-create-attention-mask-in-dataloader with --reset-attention-mask: Megatron then has no "
                          "block-causal mask to pass on; drop one of them")
    kind = args.tokenizer_type
    if kind is None and args.vocab_file is not None:  # Megatron's pretraining scripts default the type
        try:
            kind = tokenizer_files.vocab_file_type(args.vocab_file)
        except data.DataError as e:
            raise ConfigError(str(e)) from None
        data.note(f"the tokenizer type is {kind}: --vocab-file {args.vocab_file} without --tokenizer-type (Megatron's "
                  "pretraining scripts default it so for this kind of vocabulary)")
    if kind in tokenizer_files.REFUSED_TOKENIZERS:
        raise ConfigError(f"--tokenizer-type {kind}: {tokenizer_files.REFUSED_TOKENIZERS[kind]}")
    if kind is not None and args.tokenizer_file is not None:
        raise ConfigError(f"--tokenizer-type {kind} and --tokenizer-file {args.tokenizer_file} are two tokenizers: "
                          "pass one")
    needs = tokenizer_files.TOKENIZER_FILES.get(kind, ())
    missing = [f"--{f.replace('_', '-')}" for f in needs if getattr(args, f) is None]
    if missing:
        raise ConfigError(f"--tokenizer-type {kind} needs {' and '.join(missing)}")
    for f in (f for f in needs if f != "vocab_size"):  # local files only: a hub name is not fetched
        path, folder = Path(getattr(args, f)), kind == "HuggingFaceTokenizer"  # a folder; a .model or vocab a file
        if not (path.is_dir() if folder else path.is_file()):
            raise ConfigError(f"--tokenizer-type {kind}: --{f.replace('_', '-')} {str(path)!r} is not a local "
                              f"{'folder' if folder else 'file'} (nothing is downloaded at run time)")
    unread = [f"--{f.replace('_', '-')}" for f in ("vocab_file", "merge_file", "tokenizer_model")
              if getattr(args, f) is not None and f not in needs]
    if unread:  # Megatron does not read them either
        data.note(f"{', '.join(unread)}: not read " + (f"by --tokenizer-type {kind}" if kind else
                                                        "without --tokenizer-type (the tokenizer is ours)"))
    if args.num_workers is not None and args.num_workers < 0:
        raise ConfigError(f"--num-workers={args.num_workers} must be >= 0")
    if args.num_workers is not None:
        data.note(f"--num-workers {args.num_workers}: no DataLoader worker processes here; each rank reads its samples "
                  "in its training process (the batches are the same)")
    if args.tiktoken_pattern is not None:
        data.note(f"--tiktoken-pattern {args.tiktoken_pattern} is read by TikTokenizer only (as in Megatron), not by "
                  f"--tokenizer-type {kind}")
    return valid_fraction, test_fraction, data_path, kind


def check_task_args(args, mf):
    """A post-training task (posttraining/recipes.py) runs on the decoders' next-token path: what it does not cover."""
    task, cp = args.task, args.context_parallel_size
    if args.packing and task != "sft":
        raise ConfigError(f"--packing packs SFT samples: it needs --task sft (it is {task})")
    if args.packing:
        mf.refuse("sft_packing", "--packing")
    if task == "pretrain":
        return
    mf.refuse("post_training", f"--task {task}")
    if task in ("grpo", "ppo"):
        ppo = task == "ppo"
        for flag, bad in (("grpo_group_size", args.grpo_group_size < (1 if ppo else 2)),
                          ("grpo_iterations", args.grpo_iterations < 1),
                          ("grpo_clip_eps", not args.grpo_clip_eps > 0), ("grpo_kl_beta", not args.grpo_kl_beta >= 0),
                          ("rollout_max_new_tokens", not 1 <= args.rollout_max_new_tokens < args.seq_length),
                          ("rollout_temperature", not args.rollout_temperature >= 0),
                          ("rollout_top_p", not 0 < args.rollout_top_p <= 1),
                          ("ppo_kl_coef", not args.ppo_kl_coef >= 0), ("ppo_gamma", not 0 < args.ppo_gamma <= 1),
                          ("ppo_lambda", not 0 <= args.ppo_lambda <= 1), ("ppo_vf_coef", not args.ppo_vf_coef >= 0),
                          ("ppo_cliprange_value", not args.ppo_cliprange_value > 0)):
            if bad:
                raise ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)} is out of range (group size "
                                  f">= {1 if ppo else 2}, iterations >= 1, clip > 0, beta >= 0, 1 <= new tokens < "
                                  "--seq-length, temperature >= 0, top-p in (0, 1]; PPO: kl coef >= 0, gamma in "
                                  "(0, 1], lambda in [0, 1], vf coef >= 0, cliprange value > 0)")
        if ppo and args.grpo_loss_average != "token":
            raise ConfigError(f"--grpo-loss-average={args.grpo_loss_average} with --task ppo: PPO's loss averages "
                              "over completion tokens (token)")
    if cp > 1:
        raise ConfigError(f"--task {task} with --context-parallel-size={cp}: a task's per-sequence log-probs and "
                          "the reward model's last token are not gathered over cp ranks")
    if args.mtp_num_layers:
        raise ConfigError(f"--task {task} with --mtp-num-layers={args.mtp_num_layers}: multi-token prediction is a "
                          "pretraining loss")
    packing = [f for f in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(args, f)]
    if packing:
        raise ConfigError(f"--{packing[0].replace('_', '-')} is pretraining's document packing; --task {task} "
                          "builds its own masks (--packing for sft)")


def config_argv(p: argparse.ArgumentParser, path: str, known: bool = False) -> list[str]:
    """--config FILE: a YAML mapping {flag name: value} -> the command-line tokens it stands for, so that argparse
    checks every value as if typed. Keys are flag names without the dashes (`lora-rank: 8` or `lora_rank: 8`);
    true/false for switches, a list for a many-valued flag; null leaves the default. Unknown keys: ConfigError
    (known=True skips them: the first pass, before the model file has added its flags)."""
    try:
        body = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: {' '.join(str(e).split())}") from None
    if not isinstance(body, dict | None):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, found a {type(body).__name__}")
    actions = {o: act for act in p._actions for o in act.option_strings if o not in ("--config", "-h", "--help")}
    out = []
    for key, v in (body or {}).items():
        flag = "--" + str(key).replace("_", "-")
        act = actions.get(flag)
        if act is None and known:
            continue
        if act is None:
            near = difflib.get_close_matches(flag, actions, n=1)
            raise ConfigError(f"--config {path}: unknown key {key!r} (no flag {flag}"
                              + (f"; did you mean {near[0][2:]!r}?)" if near else ")"))
        if act.nargs == 0:  # a switch: store_true, or --x / --no-x
            if not isinstance(v, bool):
                raise ConfigError(f"--config {path}: {key}: expected true or false, found {v!r}")
            out += [flag] if v else ([f"--no-{flag[2:]}"] if f"--no-{flag[2:]}" in actions else [])
        elif v is not None:
            many = act.nargs in ("+", "*") or isinstance(act.nargs, int)  # a list: --rampup-batch-size's 3
            vals = [str(x) for x in v] if many and isinstance(v, list) else [json.dumps(v) if isinstance(v, list) else str(v)]
            out += [flag, *vals]
    return out
RANGES.update({**dict.fromkeys(["q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                                "mtp_num_layers"], _AT_LEAST_1), "mtp_loss_scaling_factor": _AT_LEAST_0})  # deepseek.py


def check_fsdp_args(args, world: int) -> dict:
    """--use-megatron-fsdp's strategies: no_shard is plain DP, optim the distributed optimizer (ZeRO-1); optim_grads
    (ZeRO-2) and optim_grads_params (ZeRO-3) are parallel.FSDP (use_fsdp). --use-torch-fsdp2: parallel.TorchFSDP2
    (torch's fully_shard over DP x CP). What they do not compose with is refused by name. Returns the flags they set."""
    s = args.data_parallel_sharding_strategy
    fsdp2 = {"--use-megatron-fsdp": args.use_megatron_fsdp,
             "one process (it shards over DP x CP: run under torchrun)": world == 1,
             "--tensor-model-parallel-size > 1": args.tensor_model_parallel_size > 1,
             "--pipeline-model-parallel-size > 1": args.pipeline_model_parallel_size > 1,
             "--num-experts (MoE)": bool(args.num_experts),
             "--optimizer muon (torch's AdamW steps the shards: add --optimizer adam)": args.optimizer == "muon",
             "--fp16": args.fp16, "--fp8": args.fp8, "--lora-rank": args.lora_rank is not None,
             f"--task {args.task}": args.task != "pretrain", "--decoupled-lr": args.decoupled_lr is not None,
             "--use-distributed-optimizer / --overlap-grad-reduce": args.use_distributed_optimizer
             or args.overlap_grad_reduce, "--recompute-granularity full": args.recompute_granularity == "full"}
    for flag, on in fsdp2.items() if args.use_torch_fsdp2 else ():
        if on:
            raise ConfigError(f"--use-torch-fsdp2 with {flag} is not supported (not composed)")
    if s != "no_shard" and not args.use_megatron_fsdp:
        raise ConfigError(f"--data-parallel-sharding-strategy {s} is Megatron-FSDP's: add --use-megatron-fsdp")
    fsdp = args.use_megatron_fsdp and s in ("optim_grads", "optim_grads_params")
    refused = {"--fp16": args.fp16, "--decoupled-lr": args.decoupled_lr is not None, "--fp8": args.fp8,
               "--lora-rank": args.lora_rank is not None, f"--task {args.task}": args.task != "pretrain",
               "--recompute-granularity full": s == "optim_grads_params" and args.recompute_granularity == "full",
               # ZeRO-3 frees the parameters at build; only a load with the optimizer gathers them (optimizer_over)
               "--finetune / --no-load-optim / --pretrained-checkpoint": s == "optim_grads_params" and (
                   args.finetune or args.no_load_optim or args.pretrained_checkpoint is not None)}
    for flag, on in refused.items() if fsdp else ():
        if on:
            raise ConfigError(f"--data-parallel-sharding-strategy {s} with {flag} is not supported (not composed)")
    return dict(use_fsdp=fsdp, use_distributed_optimizer=args.use_distributed_optimizer or (args.use_megatron_fsdp
                                                                                           and s == "optim"))


def check_args(args, world: int) -> Args:
    """Every flag and combination, before any process group exists. Returns the flags read-only (Args), with the
    derived ones filled in: the data-parallel size, the micro-batches per step, the virtual pipeline size, ..."""
    args = argparse.Namespace(**vars(args))  # the caller's namespace is left as it was
    mf = model_file(args.model)
    for name, (ok, must) in RANGES.items():
        v = getattr(args, name, None)
        if v is not None and not (ok(v) and math.isfinite(v)):
            raise ConfigError(f"--{name.replace('_', '-')}={v} must be {'finite' if ok(v) else must}")
    vars(args).update(mf.derived_flags(args))  # what the model file derives from its flags (a Mamba pattern)
    freq = args.moe_layer_freq
    if not (isinstance(freq, int) and freq >= 1 or isinstance(freq, list) and freq and all(x in (0, 1) for x in freq)):
        raise ConfigError(f"--moe-layer-freq={freq} must be an integer >= 1 or a list of 0s and 1s")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ConfigError(f"--min-loss-scale={args.min_loss_scale} is larger than --initial-loss-scale="
                          f"{args.initial_loss_scale}")
    if args.skip_nonfinite_steps and not args.check_for_nan_in_loss_and_grad:
        raise ConfigError("--skip-nonfinite-steps acts on what --check-for-nan-in-loss-and-grad finds: "
                          "drop --no-check-for-nan-in-loss-and-grad")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive")
    args.fp8 = args.fp8 or args.fp8_format is not None  # Megatron turns FP8 on by --fp8-format; ours: --fp8 = hybrid
    args.fp8_format = args.fp8_format or ("hybrid" if args.fp8 else None)
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
    vars(args).update(megatron_flags.derived(args))  # Megatron's flags: their refusals, what they set
    if args.profile and not (args.save or args.tensorboard_dir):
        raise ConfigError("--profile writes its trace into the TensorBoard directory: give --save or --tensorboard-dir")
    check_long_context_args(args)
    vars(args).update(check_fsdp_args(args, world))  # --use-megatron-fsdp's strategies: what they set
    args.use_ddp = args.use_distributed_optimizer or args.overlap_grad_reduce or args.use_fsdp
    if args.optimizer == "muon" and (args.task != "pretrain" or args.lora_rank is not None):
        raise ConfigError("--optimizer muon is for pretraining whole weights (the hidden layers' matrices), not "
                          + (f"--task {args.task}" if args.task != "pretrain" else "LoRA's adapters (--lora-rank)"))
    if args.muon_fp32_matmul_prec == "low":
        raise ConfigError("--muon-fp32-matmul-prec low is not represented here (high: float32 Newton-Schulz; medium: "
                          "bfloat16)")
    if args.use_ddp and args.fp16:
        raise ConfigError("--fp16 with --use-distributed-optimizer/--overlap-grad-reduce is not supported; use --bf16")
    cp = args.context_parallel_size
    if cp < 1:
        raise ConfigError(f"--context-parallel-size={cp} must be >= 1")
    if world % (tp * pp * cp):
        raise ConfigError(f"world size {world} is not divisible by tensor x pipeline parallel size {tp} x {pp}"
                          + (f" x context-parallel size {cp}" if cp > 1 else ""))
    args.world_size, args.data_parallel_size = world, world // (tp * pp * cp)
    step_rows = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:  # Megatron's default: one micro-batch per data-parallel rank
        args.global_batch_size = step_rows
    rl_task = args.task in ("grpo", "ppo")
    group = args.grpo_group_size if rl_task else 1  # GRPO, PPO: a global batch of prompts, G rows each
    if (args.global_batch_size * group) % step_rows or args.global_batch_size % args.data_parallel_size:
        raise ConfigError(f"--global-batch-size={args.global_batch_size}" + (f" x --grpo-group-size={group}" if
                          group > 1 else "") + f" is not divisible by --micro-batch-size x data-parallel size = "
                          f"{args.micro_batch_size} x {args.data_parallel_size} = {step_rows}")
    if rl_task and args.rampup_batch_size:
        raise ConfigError(f"--rampup-batch-size with --task {args.task}: the ramp counts prompts, not rows (not "
                          "supported)")
    args.num_micro_batches = args.global_batch_size * group // step_rows  # after the ramp-up, if any
    if vp > 1 and args.num_micro_batches % pp:
        raise ConfigError(f"interleaved pipelining needs the number of micro-batches {args.num_micro_batches} "
                          f"(global batch / (micro batch x dp)) to be a multiple of pp={pp}")
    args.train_iters, args.lr_decay_iters, args.lr_decay_samples, args.lr_wsd_decay_style = \
        scheduler.check_schedule_args(args, vp > 1)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length={args.seq_length} > --max-position-embeddings={args.max_position_embeddings}")
    ep, dp = args.expert_model_parallel_size, args.data_parallel_size
    if ep < 1 or dp % ep:  # a layout question; num_experts % ep is the model's (Config.check_layout)
        raise ConfigError(f"--expert-model-parallel-size={ep} must divide the data-parallel size {dp}")
    if args.expert_tensor_parallel_size not in (None, 1, tp):
        raise ConfigError(f"--expert-tensor-parallel-size={args.expert_tensor_parallel_size} must be 1 or TP={tp}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length={args.seq_length} divisible by TP={tp}")
    if cp > 1:  # context parallelism (parallel.py section 12): what it does not split
        mf.refuse("context_parallel", f"--context-parallel-size={cp}")
        if args.seq_length % (2 * cp):
            raise ConfigError(f"--context-parallel-size={cp} needs --seq-length={args.seq_length} divisible by "
                              f"2 x cp = {2 * cp} (each rank holds 2 of 2·cp chunks)")
        if args.sequence_parallel and args.seq_length // cp % tp:
            raise ConfigError(f"--sequence-parallel with --context-parallel-size={cp} needs --seq-length="
                              f"{args.seq_length} divisible by cp x TP = {cp * tp}")
        if args.reset_attention_mask:  # the split attention takes a key (padding) mask, not a [s, s] one
            raise ConfigError(f"--reset-attention-mask with --context-parallel-size={cp}: the block-causal mask of "
                              "packed documents is not split over cp ranks")
        if args.recompute_granularity == "selective":
            raise ConfigError(f"--recompute-granularity selective with --context-parallel-size={cp}: the split "
                              "attention is not recomputed (use full)")
    args.valid_fraction, args.test_fraction, args.data_path, args.tokenizer_type = check_data_args(args)
    if args.finetune and not (args.load or args.pretrained_checkpoint):
        raise ConfigError("--finetune loads a checkpoint's weights: pass --load DIR or --pretrained-checkpoint DIR")
    if args.lora_rank is not None and not (args.load or args.pretrained_checkpoint):
        raise ConfigError(f"--lora-rank={args.lora_rank} adapts a trained model: pass --pretrained-checkpoint DIR "
                          "(or --finetune --load DIR), or --load a LoRA run to resume it")
    if args.quantize_base and args.lora_rank is None:
        raise ConfigError(f"--quantize-base {args.quantize_base} stores a LoRA run's frozen base quantized (QLoRA): "
                          "add --lora-rank R")
    if args.quantize_base and args.fp8:
        raise ConfigError(f"--quantize-base {args.quantize_base} with --fp8: a linear runs one GEMM, FP8's or the "
                          "dequantized base's; drop one")
    if args.lora_rank is not None and args.num_experts and {"linear_fc1", "linear_fc2"} & set(args.lora_target_modules):
        raise ConfigError("--lora-rank with --num-experts: adapters on MoE experts are not supported; pass "
                          "--lora-target-modules linear_qkv linear_proj")
    packing = [f for f in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(args, f)]
    if packing:
        mf.refuse("document_packing", f"--{packing[0].replace('_', '-')}")
    if args.reset_position_ids and args.position_embedding_type == "none":
        raise ConfigError("--reset-position-ids with --position-embedding-type none: there are no positions to reset")
    if args.multi_latent_attention:
        mf.refuse("multi_latent_attention", "--multi-latent-attention")
    if args.mtp_num_layers:
        mf.refuse("multi_token_prediction", f"--mtp-num-layers={args.mtp_num_layers}")
    check_task_args(args, mf)
    # The model's own checks (layer counts, sizes divisible by TP) now, before the data (Retro: its database) is built.
    # The vocabulary comes with the data; no check but TP's divisibility of the padded size reads it: a stand-in
    c = model_config(mf, args, vocab_size=args.vocab_size or tp * args.make_vocab_size_divisible_by)
    try:
        c.check_context_parallel(cp, tp)  # attention dropout, MoE, a2a's heads (config.Config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Args(**vars(args))


# The flags that shape the weights: a checkpoint records them, a run resumed or started from it takes them (checkpoint.py)
ARCH_FLAGS = ["model", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "position_embedding_type", "normalization", "swiglu", "disable_bias_linear", "vocab_size",
              "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "max_position_embeddings"]
ARCH_FLAGS += ["rotary_percent", "seq_len_interpolation_factor", "rope_scaling", "rope_scaling_factor",  # position
               "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",  # scaling
               "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim"]
ARCH_FLAGS += ["multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",  # DeepSeek-V3's
               "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers"]  # layers (deepseek.py)
ARCH_FLAGS += ["moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",  # MoE routing
               "moe_router_enable_expert_bias"]
ARCH_FLAGS += ["kv_channels", "rotary_base", "norm_epsilon", "apply_layernorm_1p", "qk_layernorm"]  # Megatron's
ARCH_FLAGS += ["hf_architecture"]  # a model imported from a Hugging Face folder: its config.json and tensors (interop/hf.py)


def flags_of(c, mf) -> dict:
    """{flag: value} saying what the Config `c` of an imported model says (interop/hf.py), where a carried flag (ARCH_FLAGS)
    spells it and its value is not what the defaults already give: what the import records, so a run's printed flags
    show the model's shape."""
    defaults = vars(parse_args(["--model", mf.name]))
    plain = model_config(mf, Args(**defaults))  # what the defaults make (their vocabulary: an imported one may not
    # hold a model file's default special ids, e.g. LLaVA's image token)
    always = {"max_position_embeddings"}  # check_args fills it from --seq-length when it is not given
    return {k: v for k, v in hf.spelled(c, defaults).items() if v != defaults[k] and k in {*ARCH_FLAGS, *mf.ARCH_FLAGS}
            and (not hasattr(plain, k) or getattr(plain, k) != v or k in always)}


def _imported_config(mf, flagged, args):
    """The Config of a run on an imported model: its architecture (hf.architecture of the recorded config.json), the
    run's own fields (hf.RUN_FIELDS: dropout, sequence parallelism, ...) from the flags (`flagged`: the Config the
    flags alone give). A flag the command line set against the architecture is refused by name."""
    c = hf.architecture(args.hf_architecture, mf)
    defaults = vars(parse_args(["--model", mf.name]))
    recorded = flags_of(c, mf)  # what the import wrote: a run's flags hold these unless its command line changed them
    for k, v in hf.spelled(c, defaults).items():
        if getattr(args, k, v) not in (v, recorded.get(k, defaults[k])):
            raise ConfigError(f"--{k.replace('_', '-')} {getattr(args, k)}: the model's architecture comes from its "
                              f"Hugging Face config.json ({k}={v}); drop the flag")
    return dataclasses.replace(c, **{k: getattr(flagged, k) for k in hf.RUN_FIELDS if hasattr(flagged, k)})


def model_config(mf, args, vocab_size: int | None = None, tok=None):
    """The model's Config from the flags, as Megatron's core_transformer_config_from_args: every flag whose name is
    a Config field is copied, plus the few whose meaning differs, plus the fields the model file derives itself
    (its config_fields(args, tok)). `vocab_size`: the run's (data.Corpus's), default --vocab-size."""
    fields = {f.name for f in dataclasses.fields(mf.Config)}
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    f = args.ffn_hidden_size or (64 * math.ceil(8 * args.hidden_size / 3 / 64) if args.swiglu else 4 * args.hidden_size)
    megatron = dict(layernorm_epsilon=getattr(args, "norm_epsilon", None),  # Megatron's names for two fields
                    layernorm_zero_centered_gamma=getattr(args, "apply_layernorm_1p", None))
    kw.update({k: v for k, v in megatron.items() if v is not None})  # (getattr: a run saved before the flags)
    kw.update(ffn_hidden_size=f, activation="silu" if args.swiglu else "gelu", gated_linear_unit=args.swiglu,
              add_bias_linear=not args.disable_bias_linear,
              share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
              **({"vocab_size": vocab_size} if vocab_size is not None else {}), **mf.config_fields(args, tok))
    try:
        c = mf.Config(**{k: v for k, v in kw.items() if k in fields})
        if getattr(args, "hf_architecture", None):  # a model imported from a Hugging Face folder (interop/hf.py)
            c = _imported_config(mf, c, args)
        tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
        c.check_layout(tp, pp, ep)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return c


def brief(value) -> str:
    """A flag's value as printed: a recorded Hugging Face architecture by its model_type, not its tensor list."""
    if isinstance(value, dict) and "config" in value and "tensors" in value:
        return f"<{value['config'].get('model_type')} config.json, {len(value['tensors'])} tensors>"
    return str(value)


def print_args(args, summary: str):
    """Megatron's argument dump at start (rank 0), with one line on the model, the layout and the data."""
    print("------------------------ arguments ------------------------")
    for k, v in sorted(vars(args).items()):
        print(f"  {k} {'.' * (44 - len(k))} {brief(v)}")
    print(f"  ({summary})")
    print("-------------------- end of arguments ---------------------", flush=True)
