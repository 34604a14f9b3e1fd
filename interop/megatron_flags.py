"""interop/megatron_flags.py — Megatron-LM's flags that mean something else here: what runs instead, what is refused.

Mirrors the flags of Megatron-LM's megatron/training/arguments.py that name hardware, a kernel, a service or a
spelling this repository does not have. arguments.py's compatibility group registers them (`add_arguments`) and
check_args applies `derived` (their refusals, and what they set in other flags); train.setup prints `notes` once.

    .venv/bin/python train.py --use-flash-attn --no-rope-fusion --train-iters 2    (two `note:` lines at start)

Here: the flags (`add_arguments`), their tables (FALLBACKS: accepted, one note line; REFUSED: one line saying why),
Megatron's spellings of one setting (`check_one_spelling`), its --moe-layer-freq expression (`layer_freq`) and the
hybrid layer pattern its --hybrid-*-ratio flags allocate (`hybrid_allocation`, for mamba.py).
tests/test_megatron_flags.py checks every entry; tests/test_megatron_scripts.py runs Megatron's launch scripts' flags.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util

import torch

from config import ConfigError, model_file


def add_arguments(g):
    """Megatron's runtime and compatibility flags: kernels, fusions and processes (FALLBACKS: what runs instead)."""
    a = g.add_argument
    a("--attention-backend", default="auto", choices=["auto", "flash", "fused", "unfused", "local"],
      help="torch's scaled_dot_product_attention runs for each (it picks its own kernel)")
    a("--use-flash-attn", action="store_true", help="(accepted: scaled_dot_product_attention runs)")
    a("--recompute-activations", action="store_true", help="Megatron's --recompute-granularity selective")
    a("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false", help="(accepted: no fused "
      "softmax kernel here)")
    a("--no-rope-fusion", dest="apply_rope_fusion", action="store_false", help="(accepted: RoPE is torch ops here)")
    a("--cross-entropy-loss-fusion", action="store_true", help="(accepted: the cross-entropy is torch ops here)")
    a("--attention-softmax-in-fp32", action="store_true", help="(accepted: see FALLBACKS)")
    a("--use-mcore-models", action="store_true", help="(accepted: this is Megatron-core's model code)")
    a("--overlap-param-gather", action="store_true", help="(accepted with --use-distributed-optimizer and "
      "--overlap-grad-reduce: the parameters are all-gathered at the end of the step)")
    a("--grad-reduce-in-bf16", action="store_true", help="(accepted: gradients are reduced in fp32 here)")
    a("--calculate-per-token-loss", action="store_true", help="(accepted: always the loss rule here, DESIGN.md §2)")
    a("--distributed-backend", default=None, choices=["nccl", "gloo"],
      help="default: nccl on CUDA, gloo on CPU (nccl on CPU: gloo runs)")
    a("--distributed-timeout-minutes", type=int, default=10, help="the process group's timeout")
    a("--manual-gc", action="store_true", help="Python's automatic garbage collection off: collect every "
      "--manual-gc-interval iterations and around each evaluation")
    a("--manual-gc-interval", type=int, default=0, help="with --manual-gc (0: not between training iterations)")
    a("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
      help="with --manual-gc: no collection around evaluation")
    a("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
      help="CUDA: torch.cuda.empty_cache() after each forward-backward (1) and also after each optimizer step (2)")
    a("--decoupled-lr", type=float, default=None, help="the word embedding's and output layer's own learning rate "
      "(their schedule peaks at it), default: --lr")
    a("--decoupled-min-lr", type=float, default=None, help="their schedule's minimum (default: --min-lr)")
    a("--spec", nargs="*", default=None, help="a model file's own Megatron spec (its MEGATRON_SPECS) is accepted; "
      "any other is refused: the model file builds its layers (--model)")


def check_one_spelling(p: argparse.ArgumentParser, argv: list[str]):
    """A value flag with two spellings (Megatron's and an older one of ours: --rotary-scaling-factor and
    --yarn-rotary-scaling-factor; or a model's name for a shared flag: T5's --encoder-num-layers for --num-layers) is
    one setting: giving both is refused, not settled by their order."""
    spellings = {}  # dest -> every option string that sets it
    for act in p._actions:
        if act.nargs != 0 and not isinstance(act, (argparse.BooleanOptionalAction, argparse._HelpAction)):
            spellings.setdefault(act.dest, []).extend(act.option_strings)
    given = {t.split("=", 1)[0] for t in argv}  # (--flag and --flag=value)
    for options in spellings.values():
        typed = [o for o in options if o in given]
        if len(typed) > 1:
            raise ConfigError(f"{' and '.join(typed)} are two spellings of one flag: give one")


BALANCING = ["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]  # Megatron's load-balancing types


def layer_freq(text: str):
    """--moe-layer-freq: an integer N (every N-th layer is MoE) or a list of 0s and 1s, written as JSON or as Megatron's
    Python list expression: "([0]+[1]*3)*2" -> [0, 1, 1, 1, 0, 1, 1, 1]. Read from its syntax tree (integers,
    lists, + and *), never run: Megatron eval()s it."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult) and max(x for x in (left, right) if isinstance(x, int)) > 100_000:
                raise ValueError("a repeat count over 100000")
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"{type(node).__name__} is not an integer, a list, + or *")
    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a list expression of 0s and 1s ({e})"
                                         ) from None


def hybrid_allocation(n: int, attention_ratio: float, mlp_ratio: float) -> str:
    """--hybrid-attention-ratio / --hybrid-mlp-ratio: the hybrid layer pattern Megatron allocates for n layers
    (megatron/core/ssm/mamba_hybrid_layer_allocation.py, _allocate_auto): round(n·attention_ratio) attention layers
    "*" spread evenly between the Mamba layers "M" (a Mamba section of equal length before, between and after them),
    then round(n·mlp_ratio) of the Mamba layers turned into MLP layers "-", spread evenly and right-justified. Each
    placement walks the Mamba layers with a budget x, one layer costing 1: a layer is placed where the budget has
    fallen below 1/2, which then grows by the section length again."""
    layers, attention, mlp = ["M"] * n, round(n * attention_ratio), round(n * mlp_ratio)
    for symbol, section in (("*", (n - attention) / (attention + 1)), ("-", (n - attention - mlp) / max(mlp, 1))):
        x = section
        for i in range(n):
            if layers[i] == "M" and x < 0.5:
                layers[i], x = symbol, x + section
            elif layers[i] == "M":
                x -= 1
    return "".join(layers)


# Megatron-LM's launch scripts pass flags that name hardware, a kernel or a service this repository does not have, or
# that say what is always so here. Each is accepted with Megatron's meaning and default and, when given, says in one
# line at start (rank 0) what runs instead: FALLBACKS, flag -> (given(args) -> bool, the line, formatted with the
# flags). A flag whose meaning cannot be had here is refused in one line: REFUSED, flag -> (refused(args), why).
# tests/test_megatron_flags.py checks that every key is a flag, that a given one prints its line once (or is refused).
FALLBACKS = {
    "--attention-backend": (lambda a: a.attention_backend != "auto", "{attention_backend}: torch's "
                            "scaled_dot_product_attention runs (it picks its own kernel; Megatron's backends are "
                            "Transformer Engine's and its own)"),
    "--use-flash-attn": (lambda a: a.use_flash_attn, "torch's scaled_dot_product_attention runs (on CUDA it may pick "
                         "a flash kernel itself)"),
    "--transformer-impl": (lambda a: a.transformer_impl == "transformer_engine" and transformer_impl(a) == "local",
                           "{transformer_impl}: the local implementation runs (Transformer Engine runs here only as "
                           "--fp8's GEMMs, on CUDA with transformer_engine installed)"),
    "--fp8-param-gather": (lambda a: a.fp8_param_gather, "parameters keep their dtype and are gathered so; FP8 casts "
                           "are made inside the GEMMs"),
    "--distributed-backend": (lambda a: a.distributed_backend == "nccl" and not torch.cuda.is_available(),
                              "nccl: no CUDA here, gloo runs"),
    "--use-checkpoint-args": (lambda a: a.use_checkpoint_args is True, "on by default here: a run takes the model's "
                              "flags from the checkpoint it resumes or starts from unless given (train.parse)"),
    "--use-mcore-models": (lambda a: a.use_mcore_models, "this repository is Megatron-core's model code (Megatron's "
                           "own default; the flag is deprecated there)"),
    "--no-masked-softmax-fusion": (lambda a: not a.masked_softmax_fusion, "there is no fused scale-mask-softmax "
                                   "kernel here to turn off (scaled_dot_product_attention runs)"),
    "--no-rope-fusion": (lambda a: not a.apply_rope_fusion, "RoPE is plain torch ops here (transformer.py), never fused"),
    "--cross-entropy-loss-fusion": (lambda a: a.cross_entropy_loss_fusion, "the vocab-parallel cross-entropy runs as "
                                    "torch ops (parallel.vocab_parallel_cross_entropy), the same arithmetic"),
    "--attention-softmax-in-fp32": (lambda a: a.attention_softmax_in_fp32, "the softmax runs inside "
                                    "scaled_dot_product_attention, whose fused kernels accumulate in fp32"),
    "--overlap-param-gather": (lambda a: a.overlap_param_gather, "the distributed optimizer all-gathers the "
                               "parameters at the end of its step, not overlapped with the next forward"),
    "--grad-reduce-in-bf16": (lambda a: a.grad_reduce_in_bf16, "gradients are accumulated and reduced in fp32"),
    "--calculate-per-token-loss": (lambda a: a.calculate_per_token_loss, "always the loss rule here: the global "
                                   "batch's summed loss over its loss-token count (DESIGN.md §2)"),
    "--log-throughput": (lambda a: a.log_throughput, "tokens/s and tflops are always logged (metrics.jsonl)"),
    "--no-create-attention-mask-in-dataloader": (lambda a: not a.create_attention_mask_in_dataloader,
                                                 "samples never carry an attention mask here (causal attention "
                                                 "needs none; packed documents build theirs in the step)"),
    "--empty-unused-memory-level": (lambda a: a.empty_unused_memory_level > 0 and not torch.cuda.is_available(),
                                    "{empty_unused_memory_level}: no CUDA caching allocator here, nothing to empty"),
    "--profile": (lambda a: a.profile, "torch.profiler traces iterations [{profile_step_start}, {profile_step_end}) "
                  "of ranks {profile_ranks} into the TensorBoard directory (Megatron's default is an nsys capture "
                  "range; this is its --use-pytorch-profiler)"),
    "--moe-grouped-gemm": (lambda a: a.moe_grouped_gemm, "the local experts always run as one grouped GEMM here "
                           "(parallel.grouped_mm)"),
    "--num-query-groups": (lambda a: a.num_query_groups is not None and not a.group_query_attention,
                           "{num_query_groups} without --group-query-attention: grouped-query attention with "
                           "{num_query_groups} groups (Megatron reads --num-query-groups only with "
                           "--group-query-attention)"),
    "--no-position-embedding": (lambda a: not a.add_position_embedding, "the rotary positions stay; there is no "
                                "learned position table to drop (Megatron-core's meaning with rope)"),
    "--spec": (lambda a: a.spec is not None and own_spec(a), "Megatron's spec of the layers --model {model} "
               "builds (the model file's own code runs)"),
    "--multi-latent-attention": (lambda a: a.multi_latent_attention and not a.qk_layernorm, "the q and kv latents "
                                 "are normalised (DeepSeek's MLA; Megatron builds those norms only with "
                                 "--qk-layernorm)"),
}
REFUSED = {
    "--ckpt-format": (lambda a: a.ckpt_format != "torch_dist", "{ckpt_format}: checkpoints here are "
                      "torch.distributed.checkpoint directories in Megatron's layout (torch_dist, checkpoint.py)"),
    "--wandb-project": (lambda a: bool(a.wandb_project), "nothing leaves this machine: metrics go to metrics.jsonl "
                        "and TensorBoard (--tensorboard-dir)"),
    "--wandb-exp-name": (lambda a: bool(a.wandb_exp_name), "nothing leaves this machine: metrics go to "
                         "metrics.jsonl and TensorBoard (--tensorboard-dir)"),
    "--spec": (lambda a: a.spec is not None and not own_spec(a), "a layer spec names Megatron-core Python code; "
               "here the model file builds the layers: choose it with --model and its flags (train.py --model NAME "
               "--help)"),
    "--moe-router-load-balancing-type": (lambda a: a.moe_router_load_balancing_type not in BALANCING[:2] + ["none"],
                                         "{moe_router_load_balancing_type}: parallel.Router implements aux_loss, "
                                         "seq_aux_loss and none (not Sinkhorn routing or the global-batch loss)"),
    "--no-position-embedding": (lambda a: not a.add_position_embedding and a.position_embedding_type not in
                                ("rope", "yarn"), "is deprecated, and Megatron refuses it unless the positions are "
                                "rotary (--position-embedding-type is {position_embedding_type}): use "
                                "--position-embedding-type none"),
    "--overlap-param-gather": (lambda a: a.overlap_param_gather and not (a.use_distributed_optimizer and
                                                                         a.overlap_grad_reduce),
                               "needs --use-distributed-optimizer and --overlap-grad-reduce (as Megatron)"),
    "--decoupled-min-lr": (lambda a: a.decoupled_min_lr is not None and a.decoupled_lr is None,
                           "{decoupled_min_lr} acts only with --decoupled-lr"),
    "--profile": (lambda a: a.profile and a.profile_step_end <= a.profile_step_start,
                  "--profile-step-end={profile_step_end} must be after --profile-step-start={profile_step_start}"),
    "--decoupled-lr": (lambda a: a.decoupled_lr is not None and a.mtp_num_layers and a.position_embedding_type ==
                       "learned_absolute" and a.pipeline_model_parallel_size > 1 and (a.use_distributed_optimizer or
                                                                                      a.overlap_grad_reduce),
                       "with --mtp-num-layers, learned positions and pipelining under the bucketed optimizers: the "
                       "stages' shared-embedding bucket would mix learning rates (not implemented)"),
    "--recompute-activations": (lambda a: a.recompute_activations and a.recompute_granularity == "full",
                                "means --recompute-granularity selective, not the full one given"),
}


def own_spec(args) -> bool:
    """--spec names a Megatron spec whose layers the model file builds (its MEGATRON_SPECS)."""
    return tuple(args.spec or ()) in model_file(args.model).MEGATRON_SPECS


def transformer_impl(args) -> str:
    """What --transformer-impl runs: Transformer Engine only as --fp8's GEMMs, on CUDA with transformer_engine
    installed (parallel.fp8_enable); otherwise the local implementation (FALLBACKS says so once)."""
    te = args.fp8 and torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    return args.transformer_impl if te else "local"


def flag_line(flag: str, text: str, args) -> str:
    """'--flag VALUE: ...' for a text that starts with the flag's value ("{attention_backend}: ..."), else
    '--flag: ...'; the text formatted with the flags."""
    return flag + (" " if text.startswith("{") else ": ") + text.format(**vars(args))


def notes(args) -> list[str]:
    """The FALLBACKS lines of the flags given: what runs instead of each (train.setup prints them once, rank 0)."""
    return ["note: " + flag_line(flag, line, args) for flag, (given, line) in FALLBACKS.items() if given(args)]


def derived(args) -> dict:
    """The REFUSED flags' refusals, and what Megatron's flags whose meaning is another flag here derive: {flag: value}
    for check_args to fill in."""
    derived, balance = {}, args.moe_router_load_balancing_type
    if isinstance(balance, list):  # Megatron's nargs="+": several types would take a coefficient each
        if len(balance) > 1:
            raise ConfigError(f"--moe-router-load-balancing-type {' '.join(balance)}: one type at a time here (its "
                              "coefficient is --moe-aux-loss-coeff)")
        derived["moe_router_load_balancing_type"] = balance[0]
    view = argparse.Namespace(**{**vars(args), **derived})
    for flag, (refused, why) in REFUSED.items():
        if refused(view):
            raise ConfigError(flag_line(flag, why, view))
    if args.recompute_activations:
        derived["recompute_granularity"] = "selective"
    if args.group_query_attention and args.num_query_groups is None:
        derived["num_query_groups"] = 1  # Megatron's default
    yarn = [k for k in vars(args) if k.startswith("yarn_") and getattr(args, k) is not None]
    if args.multi_latent_attention and args.position_embedding_type == "rope" and yarn:
        derived["position_embedding_type"] = "yarn"  # Megatron's MLA: rope_type yarn unless --rope-type rope
    low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
    if args.decoupled_lr is not None and low > args.decoupled_lr:
        raise ConfigError(f"--decoupled-min-lr (default --min-lr) = {low} is larger than --decoupled-lr="
                          f"{args.decoupled_lr}")
    return derived
