"""Megatron-LM's launch-script flags: each is honoured, or accepted with one note line saying what runs instead
(interop/megatron_flags.py's FALLBACKS), or refused in one line saying why (its REFUSED).

  - every FALLBACKS / REFUSED key is a flag of the parser; each FALLBACKS flag, given, yields exactly its one note
    line (and none when not given); each REFUSED flag, given as refused, fails with its one line (ConfigError);
  - a tiny training run prints each given flag's note once and writes its TensorBoard events to --tensorboard-dir;
  - honoured flags against an oracle: --qk-layernorm and --kv-channels against Megatron-core's GPTModel on the same
    weights (float64, tolerance 1e-10: only reduction order differs, as tests/test_megatron_parity.py), with a
    negative control (the same weights without the q/k norms differ by far); --apply-layernorm-1p against the
    written-out formula (Megatron's only zero-centered norm on CPU needs apex); --norm-epsilon, --rotary-base,
    --group-query-attention, --recompute-activations into the Config / flags; Mamba's --hybrid-*-ratio against
    Megatron's own allocation function; T5's encoder/decoder flags.
"""
from __future__ import annotations

import argparse

import pytest
import test_data_parallel as tdp
import test_megatron_parity as mp
import torch
import torch.nn.functional as F

import arguments
import config as contract
import gpt
import transformer
from equivalence import clipped_steps, make_batch, reference_steps, rel_err
from harness import metrics, tiny
from interop import megatron_flags


def checked(argv: list[str], world: int = 1):
    return arguments.check_args(arguments.parse_args(argv), world)


# argv that makes each FALLBACKS flag's note appear (a CPU machine: no CUDA, no Transformer Engine)
GIVEN = {
    "--attention-backend": ["--attention-backend", "flash"],
    "--use-flash-attn": ["--use-flash-attn"],
    "--transformer-impl": ["--transformer-impl", "transformer_engine"],
    "--fp8-param-gather": ["--fp8-param-gather"],
    "--distributed-backend": ["--distributed-backend", "nccl"],
    "--use-checkpoint-args": ["--use-checkpoint-args"],
    "--use-mcore-models": ["--use-mcore-models"],
    "--no-masked-softmax-fusion": ["--no-masked-softmax-fusion"],
    "--no-rope-fusion": ["--no-rope-fusion"],
    "--cross-entropy-loss-fusion": ["--cross-entropy-loss-fusion"],
    "--attention-softmax-in-fp32": ["--attention-softmax-in-fp32"],
    "--overlap-param-gather": ["--overlap-param-gather", "--use-distributed-optimizer", "--overlap-grad-reduce"],
    "--grad-reduce-in-bf16": ["--grad-reduce-in-bf16"],
    "--calculate-per-token-loss": ["--calculate-per-token-loss"],
    "--log-throughput": ["--log-throughput"],
    "--no-create-attention-mask-in-dataloader": ["--no-create-attention-mask-in-dataloader"],
    "--empty-unused-memory-level": ["--empty-unused-memory-level", "1"],
    "--profile": ["--profile", "--tensorboard-dir", "tb"],  # (the trace's directory: refused without one)
    "--moe-grouped-gemm": ["--moe-grouped-gemm"],
    "--num-query-groups": ["--num-query-groups", "2"],
    "--no-position-embedding": ["--no-position-embedding"],
    "--spec": ["--model", "mamba", "--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"],
    "--multi-latent-attention": ["--no-qk-layernorm", "--multi-latent-attention", "--q-lora-rank", "16",  # (gpt's is on)
                                 "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
                                 "--v-head-dim", "16"],
}
# argv that each REFUSED flag refuses, and a piece of its line
REFUSE = {
    "--ckpt-format": (["--ckpt-format", "torch"], "--ckpt-format torch: checkpoints here are"),
    "--wandb-project": (["--wandb-project", "p"], "--wandb-project: nothing leaves this machine"),
    "--wandb-exp-name": (["--wandb-exp-name", "e"], "--wandb-exp-name: nothing leaves this machine"),
    "--spec": (["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
               "--spec: a layer spec names Megatron-core Python code"),
    "--moe-router-load-balancing-type": (["--moe-router-load-balancing-type", "sinkhorn"],
                                         "--moe-router-load-balancing-type sinkhorn: parallel.Router implements"),
    "--no-position-embedding": (["--no-position-embedding", "--position-embedding-type", "learned_absolute"],
                                "--no-position-embedding: is deprecated"),
    "--overlap-param-gather": (["--overlap-param-gather"], "--overlap-param-gather: needs --use-distributed-optimizer"),
    "--decoupled-min-lr": (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr 1e-05 acts only with --decoupled-lr"),
    "--profile": (["--profile", "--profile-step-start", "3", "--profile-step-end", "3"],
                  "--profile: --profile-step-end=3 must be after --profile-step-start=3"),
    "--decoupled-lr": (["--decoupled-lr", "1e-3", "--mtp-num-layers", "1", "--position-embedding-type",
                        "learned_absolute", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
                       "--decoupled-lr: with --mtp-num-layers, learned positions and pipelining"),
    "--recompute-activations": (["--recompute-activations", "--recompute-granularity", "full"],
                                "--recompute-activations: means --recompute-granularity selective"),
}


def parser_flags(model: str) -> set[str]:
    """Every option string of train.py's parser with --model `model` (its own flags too)."""
    seen = set()
    real = argparse.ArgumentParser.parse_args

    def spy(self, argv=None, namespace=None):
        seen.update(o for act in self._actions for o in act.option_strings)
        return real(self, argv, namespace)

    argparse.ArgumentParser.parse_args = spy
    try:
        arguments.parse_args(["--model", model])
    finally:
        argparse.ArgumentParser.parse_args = real
    return seen


def test_every_table_key_is_a_flag_and_has_a_case():
    flags = parser_flags("gpt") | parser_flags("mamba")
    for table in (megatron_flags.FALLBACKS, megatron_flags.REFUSED):
        assert set(table) <= flags, set(table) - flags
    assert set(GIVEN) == set(megatron_flags.FALLBACKS), set(GIVEN) ^ set(megatron_flags.FALLBACKS)
    assert set(REFUSE) == set(megatron_flags.REFUSED), set(REFUSE) ^ set(megatron_flags.REFUSED)


def test_the_default_run_has_no_notes():
    assert megatron_flags.notes(checked([])) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the notes of --transformer-impl, nccl: a CPU machine's")
@pytest.mark.parametrize("flag", sorted(megatron_flags.FALLBACKS))
def test_each_fallback_flag_gives_its_one_note(flag):
    world = 2 if flag == "--overlap-param-gather" else 1
    lines = megatron_flags.notes(checked(GIVEN[flag], world))
    mine = [ln for ln in lines if ln.startswith(f"note: {flag} ") or ln.startswith(f"note: {flag}:")]
    assert len(mine) == 1 and "\n" not in mine[0], lines
    assert "{" not in mine[0], mine  # formatted with the flags


@pytest.mark.parametrize("flag", sorted(megatron_flags.REFUSED))
def test_each_refused_flag_fails_with_its_one_line(flag):
    argv, expect = REFUSE[flag]
    world = 2 if "--pipeline-model-parallel-size" in argv else 1
    with pytest.raises(arguments.ConfigError) as e:
        checked(argv, world)
    assert str(e.value).startswith(expect) and "\n" not in str(e.value), str(e.value)


def test_a_run_prints_each_note_once_and_writes_tensorboard_where_told(corpus, cache, tmp_path, capsys):
    import train
    tb = tmp_path / "tb"
    train.main(tiny(corpus, cache, tmp_path / "run", "--use-flash-attn", "--no-rope-fusion", "--tensorboard-dir",
                    str(tb), iters=1))
    out = capsys.readouterr().out
    for flag in ("--use-flash-attn", "--no-rope-fusion"):
        assert out.count(f"note: {flag}:") == 1, out
    assert any(p.name.startswith("events.out.tfevents") for p in tb.iterdir())
    assert not (tmp_path / "run" / "tensorboard").exists()  # not the default directory as well


# ---------------------------------------------------------------------------------------------- honoured flags
def test_model_flags_reach_the_config():
    args = checked(["--kv-channels", "16", "--qk-layernorm", "--apply-layernorm-1p", "--norm-epsilon", "1e-6",
                    "--rotary-base", "500000", "--group-query-attention", "--recompute-activations", "--num-experts",
                    "4", "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"])
    c = arguments.model_config(contract.model_file("gpt"), args, vocab_size=300)
    assert (c.kv_channels, c.qk_layernorm, c.layernorm_zero_centered_gamma) == (16, True, True)
    assert (c.moe_shared_expert_intermediate_size, c.moe_shared_expert_gate) == (32, True)
    assert (c.layernorm_epsilon, c.rotary_base, c.num_query_groups) == (1e-6, 500000.0, 1)  # Megatron's GQA default
    assert args.recompute_granularity == "selective"
    assert checked([]).qk_layernorm  # (gpt's TRAIN_DEFAULTS; Megatron's default is off)
    plain = arguments.model_config(contract.model_file("gpt"), checked(["--no-qk-layernorm"]), vocab_size=300)
    assert (plain.qk_layernorm, plain.layernorm_zero_centered_gamma, plain.layernorm_epsilon) == (False, False, 1e-5)
    assert not plain.moe_shared_expert_gate
    assert checked(["--group-query-attention", "--num-query-groups", "2"]).num_query_groups == 2


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_is_the_norm_with_one_plus_its_weight(normalization):
    """Oracle (Megatron's FusedLayerNorm / TE's zero_centered_gamma, written out): the norm of x with weight 1 + w.
    Tolerance 1e-12 in float64 (the same ops). Negative control: weight w itself differs by far."""
    c = gpt.Config(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16, normalization=normalization,
                   layernorm_zero_centered_gamma=True, layernorm_epsilon=1e-6, params_dtype=torch.float64)
    norm = transformer.Norm(c)
    assert torch.equal(norm.weight, torch.zeros(8, dtype=torch.float64))  # starts at 0: the plain norm
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    x = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    w = norm.weight.detach()
    if normalization == "LayerNorm":
        centred = x - x.mean(-1, keepdim=True)
        ref = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w) + norm.bias.detach()
    else:
        ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert (norm(x) - ref).abs().max() < 1e-12
    wrong = F.rms_norm(x, (8,), w, 1e-6) if normalization == "RMSNorm" else F.layer_norm(x, (8,), w, None, 1e-6)
    assert (wrong - ref).abs().max() > 0.1


QK = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=12, ffn_hidden_size=48,
          vocab_size=250, make_vocab_size_divisible_by=8, max_position_embeddings=16, position_embedding_type="rope",
          normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
          share_embeddings_and_output_weights=False, layernorm_epsilon=1e-6)


def qk_case(rank, n, tp, qk_layernorm=True, drop_qk_norms=False, b=2, s=12, seed=7):
    """Megatron-core's GPTModel (local spec with qk_layernorm) and ours (Config.qk_layernorm, kv_channels != h/n)
    from one seeded full state dict; logits, per-token loss and every gradient (test_megatron_parity's helpers).
    drop_qk_norms (negative control): ours built without q/k norms, from the same dict less them."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import parallel as P
    cfg = {**QK, "qk_layernorm": qk_layernorm}
    c = gpt.Config(**cfg, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
    grid = P.Grid(tp=tp, dp=n // tp)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (b, s + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    weights = torch.rand(b, s, generator=gen, dtype=torch.float64)
    with mp.megatron_on_cpu(tp, seed):
        mc = GPTModel(mp.megatron_transformer_config(c, tp, qk_layernorm=qk_layernorm),
                      get_gpt_layer_local_spec(normalization=c.normalization, qk_layernorm=qk_layernorm),
                      vocab_size=c.padded_vocab_size, max_sequence_length=c.max_position_embeddings,
                      share_embeddings_and_output_weights=False, position_embedding_type="rope",
                      rotary_base=c.rotary_base, parallel_output=True)
        full = mp.seeded_full_state(mc, tp, seed)
        mp.load_into_megatron(mc, full, tp, gated=True)
        position_ids = torch.arange(s).expand(b, s)
        ref = {"logits": mp.gather_logits(mc(inputs, position_ids, mp.causal_mask(s)), tp)[..., :c.vocab_size]}
        loss = mc(inputs, position_ids, mp.causal_mask(s), labels=labels)
        (loss * weights).sum().backward()
        if tp > 1:  # Megatron's finalize_model_grads sums the q/k norms' partial grads over TP (its
            from megatron.core import parallel_state as ps  # _allreduce_non_tensor_model_parallel_grads)
            for name, p in mc.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        ref |= {"loss": loss.detach(), "grads": mp.gather_megatron(mc, tp, gated=True)}
        if drop_qk_norms:
            c = gpt.Config(**{**cfg, "qk_layernorm": False}, hidden_dropout=0.0, attention_dropout=0.0,
                           params_dtype=torch.float64)
            full = {k: v for k, v in full.items() if "q_layernorm" not in k and "k_layernorm" not in k}
            ref["grads"] = {k: v for k, v in ref["grads"].items() if k in full}
        ours = gpt.from_megatron(full, c, grid)
        got = {"logits": ours(inputs).detach()}
        loss = ours(inputs, labels=labels)
        (loss * weights).sum().backward()
        if tp > 1:  # the q/k norms' weights see n/tp heads per rank: their partial grads are summed over TP
            P.finalize_grads(ours, grid)
        got |= {"loss": loss.detach(), "grads": mp.named_full(ours, grid, grads=True)}
    return (got, ref) if rank == 0 else None


@pytest.mark.parametrize("tp", [1, 2])
def test_qk_layernorm_and_kv_channels_match_megatron(pool, tp):
    got, ref = pool.run(qk_case, mp.WORLD, tp=tp)[0]
    assert any("q_layernorm" in k for k in got["grads"])
    mp.assert_parity(mp.compare(got, ref), f"qk-layernorm kv-channels=12 tp={tp}")


def test_qk_layernorm_negative_control(pool):
    got, ref = pool.run(qk_case, mp.WORLD, tp=1, drop_qk_norms=True)[0]
    errs = mp.compare(got, ref)
    assert errs["logits"] > 1e-3 and errs["loss"] > 1e-3, errs


# ---------------------------------------------------------------------------------------------- Mamba, T5
@pytest.mark.parametrize("n, attention, mlp", [(7, 1 / 7, 3 / 7), (24, 0.08, 0.5), (10, 0.0, 0.3), (5, 0.2, 0.0),
                                               (52, 0.08, 0.5)])
def test_mamba_ratios_allocate_as_megatron(n, attention, mlp):
    from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, _allocate_auto
    ref = "".join(_allocate_auto(n, attention, mlp))
    assert Symbols.MAMBA == "M" and Symbols.ATTENTION == "*" and Symbols.MLP == "-"
    assert megatron_flags.hybrid_allocation(n, attention, mlp) == ref
    args = checked(["--model", "mamba", "--num-layers", str(n), "--hybrid-attention-ratio", str(attention),
                    "--hybrid-mlp-ratio", str(mlp)])
    assert args.hybrid_layer_pattern == ref  # the default pattern gives way to the ratios


def test_mamba_pattern_must_agree_with_the_ratios():
    ok = checked(["--model", "mamba", "--num-layers", "7", "--hybrid-layer-pattern", "*M-M-M-",
                  "--hybrid-attention-ratio", str(1 / 7), "--hybrid-mlp-ratio", str(3 / 7)])
    assert ok.hybrid_layer_pattern == "*M-M-M-"  # the same counts: the pattern's order runs
    with pytest.raises(arguments.ConfigError, match="Megatron requires the same counts"):
        checked(["--model", "mamba", "--num-layers", "7", "--hybrid-layer-pattern", "**M-M-M",
                 "--hybrid-attention-ratio", str(1 / 7), "--hybrid-mlp-ratio", str(3 / 7)])


def test_t5_encoder_and_decoder_flags():
    import t5
    args = checked(["--model", "t5", "--encoder-num-layers", "3", "--decoder-num-layers", "2",
                    "--encoder-seq-length", "64", "--decoder-seq-length", "48", "--vocab-extra-ids", "100"])
    assert (args.num_layers, args.decoder_num_layers, args.seq_length) == (3, 2, 64)
    c = arguments.model_config(contract.model_file("t5"), args, vocab_size=300)
    assert (c.encoder_num_layers, c.decoder_num_layers, c.decoder_seq_length) == (3, 2, 48)
    model = t5.Model(c)
    assert len(model.encoder.layers) == 3 and len(model.decoder.layers) == 2
    for argv in (["--encoder-num-layers", "3", "--num-layers", "2"], ["--seq-length", "32", "--encoder-seq-length=64"]):
        with pytest.raises(arguments.ConfigError, match="two spellings of one flag: give one"):  # as Megatron
            checked(["--model", "t5", *argv])
    with pytest.raises(arguments.ConfigError, match="--decoder-seq-length=4 is shorter than"):
        t5.target_length(checked(["--model", "t5", "--decoder-seq-length", "4"]))
    with pytest.raises(arguments.ConfigError, match="--vocab-extra-ids=1:"):
        t5.target_length(checked(["--model", "t5", "--vocab-extra-ids", "1"]))


# ---------------------------------------------------------------------------------------------- checkpoint flags
def test_resume_flags_no_load_optim_no_load_rng_use_checkpoint_args(corpus, cache, tmp_path, capsys, monkeypatch):
    """A run saved with --kv-channels 8 (not h/n = 16), resumed without the flag: --use-checkpoint-args (on by
    default) takes it from the checkpoint; --no-use-checkpoint-args takes the command line's and is refused as another
    model. --no-load-optim: no optimizer state is loaded and the learning-rate schedule starts again (iteration 3
    gets iteration 1's lr, the warmup's first), the iteration goes on; --no-load-rng: no RNG state file is read.
    Negative control: a plain resume loads both and continues the schedule."""
    import checkpoint
    import parallel as P
    import train
    run = tmp_path / "run"
    train.main(tiny(corpus, cache, run, "--kv-channels", "8", iters=2))
    first, _ = metrics(run)
    with pytest.raises(SystemExit):
        train.main(tiny(corpus, cache, run, "--load", str(run), "--no-use-checkpoint-args", iters=3))
    assert "kv_channels" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(checkpoint, "read_rng", lambda *a, real=checkpoint.read_rng: calls.append("rng") or real(*a))
    for cls in (P.Optimizer, P.DistributedOptimizer):
        real = cls.load_full_state
        monkeypatch.setattr(cls, "load_full_state", lambda self, real=real: calls.append("optim") or real(self))
    fresh = tmp_path / "fresh"
    train.main(tiny(corpus, cache, fresh, "--load", str(run), "--no-load-optim", "--no-load-rng", iters=3))
    assert "--no-load-optim: a fresh optimizer" in capsys.readouterr().out and "optim" not in calls
    got, _ = metrics(fresh)
    assert got[3]["lr"] == first[1]["lr"] != first[2]["lr"]
    verified, calls[:] = calls.count("rng"), []  # (find_checkpoint reads the RNG files to verify them)
    plain = tmp_path / "plain"
    train.main(tiny(corpus, cache, plain, "--load", str(run), iters=3))
    assert calls.count("optim") == 1 and calls.count("rng") == verified + 1  # + the one load_checkpoint restores
    got, _ = metrics(plain)
    assert got[3]["lr"] != first[1]["lr"]


@pytest.mark.parametrize("text, expect", [("2", 2), ("[1,0,1]", [1, 0, 1]), ("([0]+[1]*3)*2", [0, 1, 1, 1] * 2)])
def test_moe_layer_freq_reads_megatrons_expression(text, expect):
    assert megatron_flags.layer_freq(text) == expect


def test_moe_layer_freq_never_runs_its_text():
    with pytest.raises(argparse.ArgumentTypeError, match="not an integer or a list expression"):
        megatron_flags.layer_freq("__import__('os').getcwd()")


# ---------------------------------------------------------------------------------------------- MoE flags
def router_grad(x, balance: str, b: int):
    """d(the router's load-balancing loss)/d(router weight) on tokens x [(s b), h]: the main loss is 0·probs."""
    import parallel as P
    c = gpt.Config(hidden_size=x.shape[-1], num_attention_heads=1, params_dtype=torch.float64, add_bias_linear=False,
                   num_experts=6, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_router_load_balancing_type=balance)
    r = P.Router(c)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    probs, _ = r(x, b)
    (probs.sum() * 0).backward()
    return r.weight.grad


def test_seq_aux_loss_is_the_mean_of_each_sequences_aux_loss():
    """Oracle (Megatron's _apply_seq_aux_loss: the switch loss of each sequence, summed, / b): the gradient of
    seq_aux_loss on b = 3 sequences equals the mean of the aux_loss gradients of each sequence alone (float64, 1e-12).
    Negative control: aux_loss over the whole micro-batch differs."""
    s, b, h = 10, 3, 8
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = router_grad(x.reshape(s * b, h), "seq_aux_loss", b)
    want = sum(router_grad(x[:, j], "aux_loss", 1) for j in range(b)) / b
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    whole = router_grad(x.reshape(s * b, h), "aux_loss", b)
    assert (whole - want).abs().max() > 1e-3 * want.abs().max()
    assert torch.equal(router_grad(x.reshape(s * b, h), "none", b), torch.zeros(6, h, dtype=torch.float64))


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_token_drop_policy_keeps_the_most_probable_or_the_first_tokens(policy):
    """Oracle, a loop per expert (Megatron's drop_and_pad: "probs" keeps its C most probable routed tokens,
    "position" its first C routed ones). T = 12 tokens, E = 3, top-2, capacity factor 0.5: C = ceil(12·2/3·0.5) = 4."""
    import types

    import parallel as P
    T, E, C = 12, 3, 4
    c = types.SimpleNamespace(moe_router_topk=2, moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy,
                              moe_pad_expert_input_to_capacity=False)
    g = torch.Generator().manual_seed(1)
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter(1, torch.rand(T, E, generator=g).topk(2, -1).indices, True)
    probs = torch.rand(T, E, generator=g, dtype=torch.float64) * rmap
    _, kept, _ = P.MoELayer._drop(types.SimpleNamespace(c=c, sp=None, E=E), probs, rmap)
    want = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        routed = [t for t in range(T) if rmap[t, e]]
        order = sorted(routed, key=lambda t: -probs[t, e]) if policy == "probs" else routed
        want[order[:C], e] = True
    assert torch.equal(kept, want)
    assert int(rmap.sum()) > int(want.sum())  # some tokens were dropped: the choice mattered


# ---------------------------------------------------------------------------------------------- --decoupled-lr
DLR = 5e-3  # the word embedding's and output layer's learning rate (the others: test_data_parallel.OPT's 1e-3)


def decoupled_case(rank, n, distopt, steps=3):
    """test_data_parallel's dp_case at dp = n with --decoupled-lr: the plain optimizer (distopt None) or DDP's buckets
    (the decoupled parameters in buckets of their own) with or without the distributed optimizer."""
    import parallel as P
    grid = P.Grid(dp=n)
    c = gpt.Config(**tdp.LLAMA)
    chunks = [gpt.Model(c, grid)]
    if distopt is None:
        opt = P.Optimizer(chunks, grid, **tdp.OPT, decoupled_lr=DLR)
    else:
        own = lambda p: getattr(p, "is_embedding_or_output_parameter", False)  # noqa: E731 (train.make_optimizer's)
        ddp = P.DDP(chunks, grid, bucket_size=3000, overlap=True, distributed_optimizer=distopt, own_bucket=own)
        opt = P.DistributedOptimizer(ddp, **tdp.OPT, decoupled_lr=DLR)
    batch = make_batch(c.vocab_size, 8, 8, 11)
    micro = list(batch.chunk(n)[rank].chunk(2))
    out = clipped_steps(chunks, grid, opt, micro, batch[:, 1:].numel(), (8, 4, c.hidden_size), c.params_dtype,
                        tdp.CLIP, steps, lambda _: {})
    return dict(out, params={k: P.gather_full(p.data, p, grid) for k, p in chunks[0].named_parameters()})


def decoupled_reference(dlr: float, steps=3):
    """The single process: torch.optim.AdamW with the embedding and output weights in groups at `dlr`."""
    model = gpt.Model(gpt.Config(**tdp.LLAMA))
    own = {"embedding.word_embeddings.weight", "output_layer.weight"}
    named = list(model.named_parameters())
    groups = [{"params": [p for k, p in named if (k in own) == mine and (p.dim() > 1) == wd],
               "weight_decay": tdp.OPT["weight_decay"] if wd else 0.0, "lr": dlr if mine else tdp.OPT["lr"]}
              for mine in (False, True) for wd in (False, True)]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], foreach=False, **tdp.OPT)
    batch = make_batch(model.config.vocab_size, 8, 8, 11)
    return reference_steps(model, opt, list(batch.chunk(4)), batch[:, 1:].numel(), tdp.CLIP, steps)


@pytest.mark.parametrize("distopt", [None, False, True], ids=["plain", "ddp", "distopt"])
def test_decoupled_lr_trains_embedding_and_output_at_their_own_rate(pool, distopt):
    """Oracle: torch's AdamW with those parameters in groups at --decoupled-lr (float64, 1e-10: reduction order).
    Negative control: the reference without it (everything at --lr) differs by far in those parameters."""
    got = pool.run(decoupled_case, 2, distopt=distopt)[0]
    ref = decoupled_reference(DLR)
    for k, v in ref["params"].items():
        assert rel_err(got["params"][k], v) < 1e-10, k
    plain = decoupled_reference(1e-3)
    assert rel_err(got["params"]["output_layer.weight"], plain["params"]["output_layer.weight"]) > 1e-4


def test_decoupled_lr_follows_the_schedule_from_its_own_peak_and_minimum():
    """Written out (linear decay, 2 warmup iterations of 10, Megatron's schedule counted in samples of applied steps:
    the rate after `it` steps of --global-batch-size): --decoupled-lr 1e-2 to --decoupled-min-lr 1e-4 beside --lr 1e-3
    to --min-lr 1e-5; a schedule that starts again (--no-load-optim: progress.lr_steps 0) warms up from 0 again."""
    import types

    import scheduler
    args = checked(["--lr", "1e-3", "--min-lr", "1e-5", "--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-4",
                    "--lr-warmup-iters", "2", "--train-iters", "10", "--lr-decay-style", "linear"])
    optimizer = types.SimpleNamespace(lr=None, decoupled_lr=None)
    want = {0: (0.0, 0.0), 1: (5e-4, 5e-3), 2: (1e-3, 1e-2), 6: (1e-5 + 0.5 * (1e-3 - 1e-5), 1e-4 + 0.5 * (1e-2 - 1e-4)),
            10: (1e-5, 1e-4)}
    for it, (lr, dlr) in want.items():
        scheduler.set_learning_rates(optimizer, it * args.global_batch_size, args)
        assert optimizer.lr == pytest.approx(lr, rel=1e-12, abs=0) and \
            optimizer.decoupled_lr == pytest.approx(dlr, rel=1e-12, abs=0)


def test_manual_gc_and_profile(corpus, cache, tmp_path, monkeypatch):
    """--manual-gc: automatic collection is off during the loop (and on again after); --profile: torch.profiler's
    trace of iterations [0, 1) lands in --tensorboard-dir. Negative control: a plain run leaves gc on, writes no trace."""
    import gc

    import train
    seen, real = [], train.train_step
    monkeypatch.setattr(train, "train_step", lambda run, it: seen.append(gc.isenabled()) or real(run, it))
    tb = tmp_path / "tb"
    train.main(tiny(corpus, cache, tmp_path / "run", "--manual-gc", "--manual-gc-interval", "1", "--profile",
                    "--profile-step-start", "0", "--profile-step-end", "1", "--tensorboard-dir", str(tb), iters=2))
    assert seen == [False, False] and gc.isenabled()
    assert any(p.name.endswith(".pt.trace.json") for p in tb.rglob("*")), list(tb.rglob("*"))
    seen.clear()
    train.main(tiny(corpus, cache, tmp_path / "plain", "--tensorboard-dir", str(tmp_path / "tb2"), iters=1))
    assert seen == [True] and not any(p.name.endswith(".pt.trace.json") for p in (tmp_path / "tb2").rglob("*"))


def test_t5_script_model_flags_train(corpus, cache, tmp_path, capsys):
    """examples/t5/train_t5_220m_distributed.sh's model flags, sizes scaled down (encoder 2 layers, decoder 1, kv
    channels 8 != h/n = 16): a run trains with them and prints --transformer-impl's note once."""
    import train
    base = tiny(corpus, cache, tmp_path / "run", iters=2)
    for flag in ("--num-layers", "--seq-length"):  # the script's T5 spellings instead
        i = base.index(flag)
        del base[i:i + 2]
    script = ["--model", "t5", "--encoder-num-layers", "2", "--decoder-num-layers", "1", "--kv-channels", "8",
              "--ffn-hidden-size", "128", "--encoder-seq-length", "32", "--decoder-seq-length", "16",
              "--max-position-embeddings", "32", "--vocab-extra-ids", "100", "--init-method-std", "0.015",
              "--transformer-impl", "transformer_engine", "--attention-backend", "auto"]
    run = train.train(train.parse(base + script))
    out = capsys.readouterr().out
    assert out.count("note: --transformer-impl transformer_engine:") == 1 and "note: --attention-backend" not in out
    got, _ = metrics(tmp_path / "run")
    assert sorted(got) == [1, 2] and all(r["loss"] == r["loss"] for r in got.values())
    assert (run.config.encoder_num_layers, run.config.decoder_num_layers) == (2, 1)
    assert (run.config.kv_channels, run.config.decoder_seq_length) == (8, 16)


def test_mamba_script_model_flags_train(corpus, cache, tmp_path, capsys):
    """examples/mamba/train.sh's model and runtime flags, sizes scaled down (13 layers: the ratios 0.08 and 0.5
    allocate 1 attention and 6 MLP layers, Megatron's _allocate_auto), on 1 process: the run trains, each given
    FALLBACKS flag says its line once, and the pattern that ran is Megatron's allocation."""
    from megatron.core.ssm.mamba_hybrid_layer_allocation import _allocate_auto

    import train
    base = tiny(corpus, cache, tmp_path / "run", iters=1)
    i = base.index("--num-layers")
    del base[i:i + 2]
    script = ["--model", "mamba", "--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce",
              "--untie-embeddings-and-output-weights", "--init-method-std", "0.02", "--position-embedding-type", "none",
              "--num-layers", "13", "--group-query-attention", "--num-query-groups", "2",
              "--hybrid-attention-ratio", "0.08", "--hybrid-mlp-ratio", "0.5", "--max-position-embeddings", "32",
              "--distributed-backend", "nccl", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
              "--disable-bias-linear", "--normalization", "RMSNorm", "--use-mcore-models",
              "--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec",
              "--no-create-attention-mask-in-dataloader", "--tensorboard-dir", str(tmp_path / "tb"),
              "--mamba-num-groups", "1", "--mamba-head-dim", "16"]  # (sizes: hidden 64 has 8 heads of 16)
    run = train.train(train.parse(base + script))
    out = capsys.readouterr().out
    for flag in ("--overlap-param-gather", "--distributed-backend", "--use-mcore-models", "--spec",
                 "--no-create-attention-mask-in-dataloader"):
        assert sum(ln.startswith(f"note: {flag}") for ln in out.splitlines()) == 1, (flag, out)
    assert run.args.hybrid_layer_pattern == "".join(_allocate_auto(13, 0.08, 0.5))
    assert run.args.hybrid_layer_pattern.count("*") == 1 and run.args.num_query_groups == 2
    got, _ = metrics(tmp_path / "run")
    assert sorted(got) == [1] and got[1]["loss"] == got[1]["loss"]


def test_profile_without_a_directory_is_refused():
    """No --save (a run that writes no files) and no --tensorboard-dir: the trace would have nowhere to go."""
    with pytest.raises(arguments.ConfigError, match="^--profile writes its trace into the TensorBoard directory: give "
                       "--save or --tensorboard-dir$"):
        checked(["--profile"], 1)
