"""Megatron-LM's example launch scripts run here, scaled down: each script's flags exactly as the script passes them to
its entry point (Megatron-LM core_v0.15.3: examples/gpt3, bert, t5, llama, mixtral, mamba and the DeepSeek-V2-Lite
config of examples/post_training), with only SHRINK's flags changed (sizes, lengths, counts of iterations and samples,
parallel degrees) and the paths filled in (a corpus, tokenizer files made here: nothing is downloaded). Megatron picks
the model by its entry script (pretrain_gpt.py, ...): here that is --model (ENTRY).

Each script trains on warm ranks (harness.launch: torchrun's environment) at its shrunk layout; every flag of it is
accepted, and each one that runs differently here prints its one note line (interop/megatron_flags.py, data.note). The
GPT-3 script asks for a batch-size ramp-up with --train-iters, which Megatron refuses (validate_args: "expected no
batch-size rampup for iteration-based training"); here too, in one line, and the same script trains once
--train-iters is replaced by --train-samples.

The tokenizer each run makes from its script's data flags is saved with it as Megatron reads those files
(test_scripts_tokenizers_and_splits_as_megatron_reads_them; tests/test_tokenizers.py checks each type's ids).

DESIGN.md §11's table (honoured / fallback / refused, per script) is what these runs show; this file checks it:
refresh it with  .venv/bin/python tests/test_megatron_scripts.py --fix-design-table
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shlex
import textwrap
from pathlib import Path

import pytest

import harness

ROOT = Path(__file__).resolve().parents[1]

ENTRY = {"pretrain_gpt.py": "gpt", "pretrain_bert.py": "bert", "pretrain_t5.py": "t5", "pretrain_mamba.py": "mamba"}

GPT3 = "examples/gpt3/train_gpt3_175b_distributed.sh"
DEEPSEEK = "examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh"
# The flags of each script, as it passes them to its entry point (its shell variables replaced by the values the script
# sets, its paths by {placeholders}; comments and torchrun's own flags left out).
SCRIPTS = {
    GPT3: ("pretrain_gpt.py", """
        --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
        --attention-backend auto
        --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 --train-iters 500000
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
        --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
        --data-path {data} --vocab-file {vocab_json} --merge-file {merges} --split 949,50,1
        --log-interval 100 --save-interval 10000 --eval-interval 1000 --save {ckpt} --load {ckpt} --eval-iters 10
        --tensorboard-dir {tb}"""),
    "examples/bert/train_bert_340m_distributed.sh": ("pretrain_bert.py", """
        --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 --max-position-embeddings 512
        --attention-backend auto
        --micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --weight-decay 1e-2 --clip-grad 1.0 --fp16
        --lr 0.0001 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1.0e-5 --weight-decay 1e-2
        --lr-warmup-fraction .01 --clip-grad 1.0
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
        --data-path {data} --vocab-file {vocab_txt} --split 949,50,1
        --log-interval 100 --save-interval 10000 --eval-interval 1000 --save {ckpt} --load {ckpt} --eval-iters 10
        --tensorboard-dir {tb}"""),
    "examples/t5/train_t5_220m_distributed.sh": ("pretrain_t5.py", """
        --encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12 --kv-channels 64
        --ffn-hidden-size 3072 --encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512
        --micro-batch-size 64 --global-batch-size 512 --lr 0.0001 --train-iters 1000000 --lr-decay-iters 1000000
        --lr-decay-style linear --min-lr 0.00001 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16
        --vocab-extra-ids 100 --init-method-std 0.015 --transformer-impl transformer_engine
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --attention-backend auto
        --data-path {data} --vocab-file {vocab_txt} --tokenizer-type BertWordPieceCase --split 99982,9,9
        --log-interval 100 --tensorboard-dir {tb} --save-interval 500 --eval-interval 1000 --eval-iters 10
        --distributed-backend nccl --save {ckpt} --load {ckpt}"""),
    "examples/llama/train_llama3_8b_h100_fp8.sh": ("pretrain_gpt.py", """
        --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
        --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
        --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
        --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
        --untie-embeddings-and-output-weights --disable-bias-linear
        --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
        --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
        --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
        --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
        --empty-unused-memory-level 1 --exit-duration-in-mins 235
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
        --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
        --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {cache} --tiktoken-pattern v2
        --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
        --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
        --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
        --save {ckpt} --load {ckpt} --tensorboard-dir {tb}"""),
    "examples/mixtral/train_mixtral_8x7b_distributed.sh": ("pretrain_gpt.py", """
        --use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
        --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
        --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
        --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
        --no-position-embedding --rotary-base 1000000
        --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
        --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
        --tokenizer-type Llama2Tokenizer --tokenizer-model {spm} --data-path {data} --split 99990,8,2
        --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
        --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
        --use-distributed-optimizer --sequence-parallel
        --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save {ckpt} --load {ckpt}
        --tensorboard-dir {tb} --no-load-optim --no-load-rng"""),
    "examples/mamba/train.sh": ("pretrain_mamba.py", """
        --tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1
        --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce --untie-embeddings-and-output-weights
        --init-method-std 0.02 --position-embedding-type none --num-layers 48 --hidden-size 1024
        --num-attention-heads 16 --group-query-attention --num-query-groups 8 --hybrid-attention-ratio 0.08
        --hybrid-mlp-ratio 0.5 --seq-length 4096 --max-position-embeddings 4096 --train-samples 73242188
        --lr-warmup-samples 50000 --lr-decay-samples 73192188 --save {ckpt} --load {ckpt} --data-path {data}
        --data-cache-path {cache} --split 99,1,0 --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {spm}
        --distributed-backend nccl --micro-batch-size 4 --global-batch-size 32 --lr 2.5e-4 --min-lr 2.5e-5
        --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
        --disable-bias-linear --normalization RMSNorm --adam-beta1 0.9 --adam-beta2 0.95 --log-interval 10
        --save-interval 2000 --eval-interval 2000 --eval-iters 32 --bf16 --use-mcore-models
        --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec
        --no-create-attention-mask-in-dataloader --tensorboard-dir {tb}"""),
    DEEPSEEK: ("pretrain_gpt.py", """
        --save-interval 100000 --attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 1 --bf16
        --no-masked-softmax-fusion --disable-bias-linear --untie-embeddings-and-output-weights
        --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
        --num-layers 27 --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16 --kv-channels 16
        --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 --qk-head-dim 128 --qk-layernorm
        --qk-pos-emb-head-dim 64 --num-experts 64 --moe-layer-freq ([0]+[1]*26) --moe-ffn-hidden-size 1408
        --moe-grouped-gemm --moe-router-score-function softmax --moe-router-topk 6 --moe-router-topk-scaling-factor 1.0
        --moe-router-pre-softmax --moe-shared-expert-intermediate-size 2816 --moe-aux-loss-coeff 1e-3
        --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs --moe-router-load-balancing-type seq_aux_loss
        --seq-length 1024 --max-position-embeddings 1024 --tokenizer-type HuggingFaceTokenizer
        --make-vocab-size-divisible-by 3200 --attention-softmax-in-fp32 --use-mcore-models --rotary-percent 1.0
        --rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 --sequence-parallel"""),
}
# The DeepSeek-V2-Lite file is a model config: the post-training launcher that sources it adds the tokenizer folder,
# the data and the training length.
LAUNCHER = {DEEPSEEK: "--tokenizer-model {hf} --data-path {data} --global-batch-size 8 --train-iters 3 --lr 1e-4 "
                      "--save {ckpt} --load {ckpt} --tensorboard-dir {tb}"}

# What the test shrinks, and nothing else: sizes, lengths, counts of iterations and samples, parallel degrees, each
# replaced where the script gives the flag (PER_SCRIPT: a script's own, over SHRINK).
SHRINK = {
    "--num-layers": "2", "--encoder-num-layers": "2", "--decoder-num-layers": "2", "--hidden-size": "64",
    "--num-attention-heads": "4", "--kv-channels": "16", "--ffn-hidden-size": "128", "--num-query-groups": "2",
    "--seq-length": "32", "--encoder-seq-length": "32", "--decoder-seq-length": "16", "--max-position-embeddings": "64",
    "--global-batch-size": "8", "--train-iters": "3", "--lr-decay-iters": "3", "--lr-warmup-iters": "1",
    "--train-samples": "24", "--lr-decay-samples": "20", "--lr-warmup-samples": "4", "--log-interval": "1",
    "--save-interval": "3", "--eval-interval": "3", "--eval-iters": "1", "--tensor-model-parallel-size": "1",
    "--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "1", "--vocab-size": "4096",
    "--num-experts": "4", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "32",
    "--moe-shared-expert-intermediate-size": "64", "--kv-lora-rank": "32", "--v-head-dim": "16", "--qk-head-dim": "16",
    "--qk-pos-emb-head-dim": "8", "--moe-layer-freq": "([0]+[1]*1)", "--profile-step-start": "1",
    "--profile-step-end": "2",
}
PER_SCRIPT = {  # world size (ranks), and the script's own shrunk values
    GPT3: (2, {"--pipeline-model-parallel-size": "2", "--rampup-batch-size": "4 4 16"}),
    "examples/bert/train_bert_340m_distributed.sh": (2, {"--tensor-model-parallel-size": "2", "--micro-batch-size": "2"}),
    "examples/t5/train_t5_220m_distributed.sh": (1, {"--micro-batch-size": "2"}),
    "examples/llama/train_llama3_8b_h100_fp8.sh": (2, {}),
    "examples/mixtral/train_mixtral_8x7b_distributed.sh": (4, {"--pipeline-model-parallel-size": "2",
                                                               "--expert-model-parallel-size": "2"}),
    "examples/mamba/train.sh": (2, {"--num-layers": "4", "--micro-batch-size": "2",
                                    "--hidden-size": "256"}),  # 8 Mamba heads for its 8 groups (Megatron's default)
    DEEPSEEK: (2, {}),
}


def flag_values(text: str) -> list[tuple[str, list[str]]]:
    """[(flag, its values)] of a flag string, in order."""
    out = []
    for word in shlex.split(text):
        if word.startswith("--"):
            out.append((word, []))
        else:
            out[-1][1].append(word)
    return out


def script_flags(script: str, paths: dict) -> list[tuple[str, list[str]]]:
    entry, text = SCRIPTS[script]
    return flag_values(text.format(**paths) + " " + LAUNCHER.get(script, "").format(**paths))


def shrunk_argv(script: str, paths: dict, swap: dict | None = None) -> list[str]:
    """The script's flags with SHRINK's values (and `swap`: flag -> (new flag, its values), a flag replaced), as
    train.py's argv after --model (the entry script's model)."""
    shrink = {**SHRINK, **PER_SCRIPT[script][1]}
    argv = ["--model", ENTRY[SCRIPTS[script][0]]]
    for flag, values in script_flags(script, paths):
        flag, values = (swap or {}).get(flag, (flag, values))
        argv += [flag, *(shrink[flag].split() if flag in shrink and values else values)]
    return argv


def train_in(script: str, argv: list[str]) -> str:
    """train.py argv at the script's world size (1: this process; more: warm ranks); rank 0's output."""
    world = PER_SCRIPT[script][0]
    if world > 1:
        return harness.launch(world, argv, timeout=240)[0]
    import train
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train.main(argv) in (0, None)
    return out.getvalue()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A corpus (DESIGN.md's paragraphs, one document each) and every tokenizer file the scripts name, made here:
    GPT-2's vocab.json + merges.txt, a WordPiece vocab.txt, a SentencePiece .model (Llama's settings) and a Hugging
    Face folder."""
    from test_tokenizers import hf_folder
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp("megatron_scripts")
    texts = [p for p in (ROOT / "DESIGN.md").read_text(encoding="utf-8").split("\n\n") if len(p) > 200][:120]
    (d / "corpus").mkdir()
    for i, t in enumerate(texts):
        (d / "corpus" / f"{i:03d}.txt").write_text(t, encoding="utf-8")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    vocab_json, merges = bpe.model.save(str(d))
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer, wp.pre_tokenizer = normalizers.BertNormalizer(lowercase=False), pre_tokenizers.BertPreTokenizer()
    wp.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=600, special_tokens=[
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    (d / "wp").mkdir()
    vocab_txt = wp.model.save(str(d / "wp"))[0]
    spm = pytest.importorskip("sentencepiece")
    (d / "corpus.txt").write_text("\n".join(texts), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "llama"), vocab_size=600,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, minloglevel=2)
    return dict(data=str(d / "corpus"), vocab_json=vocab_json, merges=merges, vocab_txt=vocab_txt,
                spm=str(d / "llama.model"), hf=str(hf_folder(d / "hf")), root=d)


def run_paths(paths: dict, script: str) -> dict:
    """The paths, with the script's own checkpoint, TensorBoard and cache directories."""
    base = paths["root"] / re.sub(r"\W", "_", script)
    return {**paths, "ckpt": str(base / "ckpt"), "tb": str(base / "tb"), "cache": str(base / "cache")}


NOTE = re.compile(r"^note: (--[\w-]+)", re.M)


@pytest.fixture(scope="module")
def runs(paths):
    """Every script trained once (GPT-3's with --train-samples for its --train-iters): {script: (argv, output,
    the refusal of the script as written or None)}."""
    import arguments
    import train
    out = {}
    for script in SCRIPTS:
        p = run_paths(paths, script)
        refusal = None
        try:
            arguments.check_args(train.parse(shrunk_argv(script, p)), PER_SCRIPT[script][0])
        except arguments.ConfigError as e:
            refusal = str(e)
        swap = {"--train-iters": ("--train-samples", ["32"]), "--lr-decay-iters": ("--lr-decay-samples", ["24"])}
        argv = shrunk_argv(script, p, swap if refusal else None)
        out[script] = (argv, train_in(script, argv), refusal)
    return out


def groups(script: str, paths: dict, output: str, refusal: str | None) -> dict:
    """The script's flags as its run showed them: refused (named by the refusal), fallback (a note line names it),
    honoured (the rest: Megatron's meaning, no note)."""
    flags = list(dict.fromkeys(f for f, _ in script_flags(script, run_paths(paths, script))))
    refused = re.findall(r"^--[\w-]+", refusal or "")
    noted = set(NOTE.findall(output))
    fallback = [f for f in flags if f in noted and f not in refused]
    return dict(honoured=[f for f in flags if f not in refused + fallback], fallback=fallback, refused=refused)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_trains_scaled_down(runs, paths, script):
    """The script's run: every iteration's loss finite, an evaluation, its checkpoint and TensorBoard events where the
    script put them, and each flag that runs differently here said once, in its note line (interop/megatron_flags.py)."""
    import arguments
    import train
    argv, output, _ = runs[script]
    p = run_paths(paths, script)
    args = arguments.check_args(train.parse(argv), PER_SCRIPT[script][0])
    recs = [json.loads(line) for line in (Path(p["ckpt"]) / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in recs if "loss" in r]  # every --log-interval iterations, and the last
    assert logged[-1]["iteration"] == args.train_iters >= 3, output
    assert all(math.isfinite(r["loss"]) for r in logged), (logged, output)
    assert any("val_loss" in r for r in recs)
    assert (Path(p["ckpt"]) / f"iter_{args.train_iters:07d}").is_dir()
    assert list(Path(p["tb"]).rglob("events.out.tfevents.*"))  # --tensorboard-dir
    for line in arguments.notes(args):
        assert output.count(line) == 1, (line, output)


def test_only_sizes_and_layouts_are_shrunk(paths):
    """The argv of each run is the script's flags in the script's order; a value differs only for a SHRINK flag."""
    for script in SCRIPTS:
        ours = flag_values(" ".join(shlex.quote(w) for w in shrunk_argv(script, run_paths(paths, script))))
        theirs = script_flags(script, run_paths(paths, script))
        assert [f for f, _ in ours[1:]] == [f for f, _ in theirs]
        shrink = {**SHRINK, **PER_SCRIPT[script][1]}
        assert all(a == b or f in shrink for (f, a), (_, b) in zip(ours[1:], theirs)), script


def test_a_flag_removed_from_the_parser_fails_the_script(paths, monkeypatch):
    """Negative control of 'every flag is accepted': the T5 script parses, and fails in one line once the parser
    lacks one of its flags (--vocab-extra-ids)."""
    import argparse

    import arguments
    import train
    argv = shrunk_argv("examples/t5/train_t5_220m_distributed.sh", run_paths(paths, "t5"))
    assert train.parse(argv).vocab_extra_ids == 100
    add = argparse._ActionsContainer.add_argument  # (parsers and argument groups alike)
    monkeypatch.setattr(argparse._ActionsContainer, "add_argument",
                        lambda self, *names, **kw: None if "--vocab-extra-ids" in names else add(self, *names, **kw))
    with pytest.raises(arguments.ConfigError, match="unrecognized arguments: --vocab-extra-ids 100"):
        train.parse(argv)


def test_gpt3_script_is_refused_as_megatron_refuses_it(runs):
    """Megatron's own validate_args refuses --rampup-batch-size with --train-iters; the other scripts run as written."""
    refusal = runs[GPT3][2]
    assert refusal.startswith("--rampup-batch-size is for sample-based training") and "Megatron refuses" in refusal
    assert [s for s, (_, _, r) in runs.items() if r is not None] == [GPT3]


BEGIN, END = "<!-- megatron-scripts: begin (tests/test_megatron_scripts.py) -->", "<!-- megatron-scripts: end -->"


def design_table(runs, paths) -> str:
    """DESIGN.md §11's per-script lists, from the runs."""
    lines = []
    for script, (_, output, refusal) in runs.items():
        g = groups(script, paths, output, refusal)
        lines.append(f"**{script}** ({SCRIPTS[script][0]}: `--model {ENTRY[SCRIPTS[script][0]]}`)")
        for name, flags in g.items():
            if flags:
                why = (" (with --train-iters, as Megatron refuses it; with --train-samples the script trains)"
                       if name == "refused" else "")
                text = f"- {name}: " + ", ".join(f"`{f}`" for f in flags) + why
                lines += textwrap.wrap(text, 120, subsequent_indent="  ", break_on_hyphens=False)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def test_design_table_is_what_the_runs_show(runs, paths):
    """DESIGN.md §11 lists each script's flags as its run shows them (MEGATRON_TABLE=fix writes it)."""
    path = ROOT / "DESIGN.md"
    text = path.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN + "\n")
    body, tail = rest.split(END)
    want = design_table(runs, paths)
    if os.environ.get("MEGATRON_TABLE") == "fix":
        path.write_text(head + BEGIN + "\n" + want + END + tail, encoding="utf-8")
    assert body == want, "DESIGN.md §11 is stale: MEGATRON_TABLE=fix .venv/bin/python -m pytest -q " \
                         "tests/test_megatron_scripts.py -k design_table"


LLAMA3, BERT, T5 = ("examples/llama/train_llama3_8b_h100_fp8.sh", "examples/bert/train_bert_340m_distributed.sh",
                    "examples/t5/train_t5_220m_distributed.sh")


def test_scripts_tokenizers_and_splits_as_megatron_reads_them(runs, paths, capsys):
    """The tokenizer each run made from its script's data flags, saved with the run (tests/test_tokenizers.py checks
    each type's ids against its oracle): GPT-3's --vocab-file + --merge-file (GPT2BPETokenizer, the GPT scripts'
    default type), which tools.py sample reads back; BERT's --vocab-file alone (BertWordPieceLowerCase: its [CLS],
    [SEP], [MASK], [PAD]); T5's BertWordPieceCase, with the span sentinels after [BOS], [EOS] as Megatron's
    --vocab-extra-ids 100 puts them; Llama-3's --mock-data on NullTokenizer (--vocab-size 4096: the mock documents
    count to 4094). The splits (949,50,1 and 99982,9,9) leave a test document: Megatron's end-of-training test runs."""
    import tools
    from interop import tokenizer_files

    def run_dir(script):
        return Path(run_paths(paths, script)["ckpt"])

    def records(script):
        return [json.loads(line) for line in (run_dir(script) / "metrics.jsonl").read_text().splitlines()]

    def last(script):
        return max(r["iteration"] for r in records(script) if "loss" in r)

    for script in (GPT3, BERT, T5):
        assert [r["iteration"] for r in records(script) if "test_loss" in r] == [last(script)], script
    gpt3 = run_dir(GPT3)
    assert json.loads((gpt3 / "tokenizer.roles.json").read_text())["tokenizer_type"] == "GPT2BPETokenizer"
    saved = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(gpt3 / "tokenizer.json"))
    assert tokenizer_files.special_ids(saved)["eod"] == json.loads(open(paths["vocab_json"]).read())["<|endoftext|>"]
    capsys.readouterr()
    tools.main(["sample", "--load", str(gpt3), "--prompt", "the model", "--max-new-tokens", "4"])
    assert capsys.readouterr().out.startswith("the model")
    roles = json.loads((run_dir(BERT) / "tokenizer.roles.json").read_text())
    assert (roles["tokenizer_type"], roles["cls"], roles["eod"]) == ("BertWordPieceLowerCase", "[CLS]", "[EOS]")
    saved = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(run_dir(T5) / "tokenizer.json"))
    V = sum(1 for _ in open(paths["vocab_txt"], encoding="utf-8"))
    assert tokenizer_files.special_ids(saved)["sentinels"] == list(range(V + 2, V + 102))
    assert [r["iteration"] for r in records(LLAMA3) if "loss" in r] == list(range(1, last(LLAMA3) + 1))
    output = runs[LLAMA3][1]
    assert "--mock-data: the first 1000 of Megatron's 100,000 mock documents" in output and "--num-workers 1" in output
    it = last(LLAMA3)
    assert json.loads((run_dir(LLAMA3) / f"iter_{it:07d}" / "meta.json").read_text())["args"]["vocab_size"] == \
        4096 + 1 + 104
