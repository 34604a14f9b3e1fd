"""tools.py — what you do with a saved run: sample from it, merge its LoRA adapters, export it to Hugging Face or to
Megatron-core, score text with a reward model; and a Megatron-core checkpoint made a run.

Mirrors Megatron-LM's tools/ (tools/run_text_generation_server.py's generation, tools/checkpoint/ conversion). A
file of its own so that train.py is only the training loop. Each command loads the run in one process
(checkpoint.load_model: whatever layout it was saved at) and asks its model file (config.py) what it can do.

    python tools.py sample --load runs/gpt --prompt "def "      # generated text (make sample)
    python tools.py sample --load runs/gpt-sft --chat --prompt "Add 2 and 3."    # an SFT model's answer
    python tools.py merge --load runs/gpt-lora --save runs/gpt-merged    # a LoRA run's adapters merged into its base
    python tools.py export --load runs/gpt --hf-out runs/gpt-hf          # a Hugging Face model directory
    python tools.py score --load runs/gpt-rm --data-path answers.jsonl   # a reward model's score of each record
    python tools.py export-megatron --load runs/gpt --save runs/gpt-mcore   # a Megatron-core torch_dist checkpoint
    python tools.py import-megatron --load runs/gpt-mcore --save runs/gpt-from-mcore --model gpt \
        --tokenizer-file runs/gpt/tokenizer.json    # a Megatron-core checkpoint as a run (architecture flags: see below)
    python tools.py eval --load runs/gpt --hf runs/gpt-hf --limit 10     # lm-eval on the shipped tasks (make eval)
    python tools.py plan --gpus 16 --num-layers 24 --hidden-size 2048 --num-attention-heads 16  # layouts (planning/)

sample --chat: one user turn in the chat template SFT trains on (or a Hugging Face folder's own), only the answer
printed; export: what serving needs (weights, config.json, the tokenizer, the chat template as Jinja) — DESIGN.md §1,
"Post-training". export-megatron / import-megatron: Megatron-core's torch_dist checkpoints, written and read with
torch.distributed.checkpoint alone; import-megatron's flags after --save are train.py's model flags — DESIGN.md §8,
"Megatron-core checkpoints". plan: DESIGN.md §12.
Bad input ends with one line `tools.py: error: ...`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

import checkpoint
import data
from arguments import Args, ArgumentParser, ConfigError, check_args, flags_of, model_config, parse_args, run_flags
from config import model_file
from interop import convert, hf, tokenizer_files
from planning import planner, timing
from posttraining import lora, quantization, recipes


def sample(a):
    """The model's continuation of --prompt, or what the model file's sample() makes of it (T5: the masked span)."""
    if not a.prompt:
        raise ConfigError("--prompt is empty: give the text to continue")
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={a.max_new_tokens} must be >= 1")
    if a.temperature is not None and not (a.temperature >= 0 and math.isfinite(a.temperature)):
        raise ConfigError(f"--temperature={a.temperature} must be >= 0 (0 = greedy)")
    if a.top_k is not None and a.top_k < 1:
        raise ConfigError(f"--top-k={a.top_k} must be >= 1")
    run = checkpoint.load_model(a.load, reward_model=False)  # a reward model's output is a value, not logits
    if a.chat and run.model_file.sample_ids is None:
        raise ConfigError(f"--load {a.load}: a --model {run.args.model} run cannot answer --chat: its model file "
                          "declares no sample_ids() (only a causal language model continues a chat prompt)")
    if run.model_file.sample is None:
        raise ConfigError(f"--load {a.load}: a --model {run.args.model} run cannot sample: "
                          + (run.model_file.unsupported("sample") or "its model file declares no sample()"))
    context = run.model.config.max_position_embeddings
    prompt = len(recipes.chat_prompt_ids([{"role": "user", "content": a.prompt}], run.tok) if a.chat
                 else run.tok.encode(a.prompt).ids)
    room = context - prompt if run.model_file.sample_ids is not None else context  # (a causal LM's prompt is context)
    new = min(200, room) if a.max_new_tokens is None else a.max_new_tokens
    if new > room or new < 1:  # past it the window slides and each token costs a whole recompute (the server refuses)
        raise ConfigError(f"--max-new-tokens={a.max_new_tokens} with a {prompt}-token prompt: more than the model's "
                          f"context (--max-position-embeddings {context}) leaves; at most {max(room, 0)}")
    torch.manual_seed(a.seed)
    opts = {k: v for k, v in (("temperature", a.temperature), ("top_k", a.top_k)) if v is not None}
    if a.chat:
        answer = chat_answer(run, a.prompt, new, **opts)
        text = run.tok.decode(answer[:-1] if answer[-1:] and answer[-1] in tokenizer_files.chat_stop_ids(run.tok) else answer)
    else:
        text = run.model_file.sample(run.model.eval(), run.tok, a.prompt, new, **opts)
    print(text)
    return text


def chat_answer(run, prompt: str, max_new_tokens: int, **opts) -> list[int]:
    """sample --chat: the token ids of the model's answer to `prompt` as one user turn of the training chat template
    (recipes.chat_prompt_ids: `<|user|>\\n{prompt}\\n<|assistant|>\\n`, tokenized as SFT's samples were; a Hugging
    Face tokenizer folder's own template with add_generation_prompt), up to and including the token that ends an
    assistant turn (tokenizer_files.chat_stop_ids: the end-of-document token, or the template's end-of-turn token), or
    max_new_tokens of them."""
    ids = recipes.chat_prompt_ids([{"role": "user", "content": prompt}], run.tok)
    return run.model_file.sample_ids(run.model.eval(), run.tok, ids, max_new_tokens, **opts,
                                     stop=tokenizer_files.chat_stop_ids(run.tok))


def merge(a):
    out = checkpoint.save_merged(a.load, a.save)
    print(f"merged {a.load}'s adapters into {out} (model weights only); sample it: python tools.py sample --load {out};"
          f" train on: python train.py --finetune --load {out} --save RUN")
    return out


def export(a):
    """A Hugging Face model directory of the run (a LoRA run: merged), which transformers loads offline and serves:
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the training chat template as Jinja
    (recipes.chat_template_jinja, or the run's tokenizer folder's own template), generation_config.json; eos is our
    end-of-document token (convert.save_hf). A
    setting Hugging Face's class cannot express is refused by name."""
    if a.hf_out is None and a.peft_out is None:
        raise ConfigError("export: pass --hf-out DIR (the model), --peft-out DIR (a LoRA run's adapters), or both")
    for flag, d in (("--hf-out", a.hf_out), ("--peft-out", a.peft_out)):
        if d is not None and Path(d).exists() and (not Path(d).is_dir() or any(Path(d).iterdir())) and not a.overwrite:
            raise ConfigError(f"{flag} {d} is not an empty directory: export into a new one, or pass --overwrite to "
                              "replace the files it writes there")
    if a.peft_out is not None:
        export_peft(a)
        print(f"exported {a.load}'s adapters to {a.peft_out} (a PEFT folder); load it: "
              f"peft.PeftModel.from_pretrained(the exported base model, {str(a.peft_out)!r})")
    if a.hf_out is None:
        return a.peft_out
    out = export_model(a)
    print(f"exported {a.load} to {out} (config.json, model.safetensors, tokenizer); load it: transformers."
          f"AutoModelForCausalLM.from_pretrained({str(out)!r}), or serve it: python tools.py serve --load {a.load}")
    return out


def awq_scaled(run, load_dir, samples: int = 16, clip: bool = True, group: int | None = None):
    """The run's model with AWQ's scales folded in and, with `clip`, its weights clipped (still full precision: int4
    round-to-nearest of it, one scale per `group` input features, is AWQ-int4), both searched on its first `samples`
    training samples for that int4 (quantization.awq_scale, awq_clip; group None: the export's)."""
    corpus = data.build_data(run.args, run.model_file.dataset, Path(load_dir) / "tokenizer.json", run.args.vocab_size)
    batches = data.global_batch(corpus.train, start=0, size=samples)[:, :-1].split(4)
    quantization.awq_scale(run.model, batches, group=group)
    if clip:
        quantization.awq_clip(run.model, batches, group=group)
    return run.model


def export_model(a):
    run = checkpoint.load_model(a.load, reward_model=False)  # a reward model's output is a value, not logits
    if getattr(a, "quantization", None) and run.args.hf_architecture:
        raise convert.ExportError("export --quantization awq: a model imported from a Hugging Face folder exports "
                                  "in that folder's layout, unquantized here")
    if run.args.hf_architecture:  # imported from a Hugging Face folder: that folder's layout again (interop/hf.py)
        out, left = hf.export_folder(run.args.hf_architecture, run.model.state_dict(), run.tok, a.hf_out,
                                     getattr(torch, a.dtype) if a.dtype else None)
        if left:
            print(f"note: not written, the model never reads them (transformers initialises them): {', '.join(left)}")
        return out
    if run.model_file.to_hf is None:
        raise convert.ExportError(f"export: --model {run.args.model} has no Hugging Face export here"
                                  + (f" ({why})" if (why := run.model_file.unsupported("export")) else ""))
    if getattr(a, "quantization", None) == "awq":
        awq_scaled(run, a.load, clip=getattr(a, "awq_apply_clip", True))
    out = convert.save_hf(a.hf_out, *run.model_file.to_hf(run.model.config, run.model.state_dict()), run.tok,
                          chat_template=tokenizer_files.roles_of(run.tok).chat_template or recipes.chat_template_jinja())
    if getattr(a, "quantization", None) == "awq" and not quantization.to_compressed_tensors(out):
        raise convert.ExportError("export --quantization awq: the folder has no Llama-style *_proj linears to quantize "
                                  "(Conv1D layers are not written as compressed-tensors here)")
    return out


def import_hf(path, save_dir, dtype=torch.float32):
    """tools.py import-hf: the folder as a checkpoint of ours (iteration 0, weights only, as tools.py merge writes)
    in `save_dir`, with the folder's tokenizer beside it (tokenizer). Returns the run directory."""
    folder = hf.read_folder(path)
    out = Path(save_dir)
    if out.is_dir() and any(checkpoint.ITER_DIR.fullmatch(p.name) for p in out.iterdir()):
        raise ConfigError(f"--save {out} holds a run already: import into an empty directory")
    if not (folder.path / "tokenizer.json").is_file():
        raise ConfigError(f"{folder.path}: no tokenizer.json (the fast tokenizer's file: AutoTokenizer."
                          "from_pretrained(DIR).save_pretrained(DIR) writes one)")
    mf, c, full = hf.convert(folder.config, hf.file_state(folder, "real"), dtype)
    tok = hf.tokenizer(folder.path)
    if tok.get_vocab_size() > c.padded_vocab_size:
        raise ConfigError(f"{folder.path}: its tokenizer has {tok.get_vocab_size()} tokens, more than the model's "
                          f"{c.padded_vocab_size} embedding rows")
    settings = run_flags({"model": mf.name, **flags_of(c, mf), "hf_architecture": hf.arch_of(folder),
                          "vocab_size": c.vocab_size, "load": None, "save": str(out)})
    built = model_config(mf, Args(**settings), c.vocab_size, tok)  # the Config a run on it builds: must be this one
    differ = [f.name for f in dataclasses.fields(c)
              if f.name not in hf.RUN_FIELDS and getattr(built, f.name) != getattr(c, f.name)]
    if differ:
        raise ConfigError(f"{folder.path}: a run would build another model ({', '.join(differ)} differ)")
    model = mf.Model(dataclasses.replace(built, params_dtype=dtype))
    convert.load(model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()})
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files.save_tokenizer(tok, out / "tokenizer.json")
    checkpoint.save_checkpoint(out, 0, [model], None, checkpoint.Scale(), None, settings)
    return out


def import_megatron(a, model_flags):
    """A Megatron-core torch_dist checkpoint as a weights-only run at iteration 0 (as merge writes one): the model and
    tokenizer of the flags given (train.py's model flags; a Megatron-LM checkpoint's recorded args are their defaults,
    convert.megatron_lm_args), filled with the checkpoint's tensors, every name and shape checked
    (convert.megatron_dist_full)."""
    checkpoint.refuse_run_in(a.save, "import")
    args = check_args(parse_args(model_flags, saved=convert.megatron_lm_args(a.load)), world=1)
    model, tok, settings = checkpoint.model_from_flags(args)
    model.load_state_dict(convert.megatron_dist_full(a.load, model), strict=False)  # (cast to the model's dtype)
    out = checkpoint.save_weights(model, tok, a.save, {**settings, "save": a.save})
    return said(out, f"imported {a.load} into {out}; sample it: python tools.py sample --load {out}; train on: "
                f"python train.py --finetune --load {out} --save RUN")


def export_megatron(a):
    """The run (a LoRA run: merged) as a Megatron-core torch_dist checkpoint (convert.to_megatron_dist)."""
    if Path(a.save).is_dir() and any(Path(a.save).iterdir()):
        raise ConfigError(f"--save {a.save} is not empty: export into an empty directory")
    run = checkpoint.load_model(a.load, reward_model=False)  # a reward model's output is a value, not logits
    out = convert.to_megatron_dist(run.model.state_dict(), run.model.config, a.save, a.padded_vocab_size)
    return said(out, f"exported {a.load} to {out} (Megatron-core torch_dist); Megatron-LM loads it with --load {out} "
                "and the run's model flags")


def export_peft(a):
    """A LoRA run's adapters as a PEFT folder (hf.peft_state: exact, row by row) for the Hugging Face model its base
    exports to: an imported model's own folder (`tools.py export --load BASE --hf-out DIR`), or what the model file's
    exporter writes; `peft.PeftModel.from_pretrained(that model, --peft-out)` computes our adapted model's logits."""
    run = checkpoint.load_model(a.load, merge=False)
    if "lora_base" not in run.ckpt.meta:
        raise ConfigError(f"--peft-out: --load {a.load} is not a LoRA run (no adapters)")
    adapters = {f"{n}.weight": (m.lora.A, m.lora.B) for n, m in run.model.named_modules()
                if isinstance(getattr(m, "lora", None), lora.LoRA)}
    arch = run.args.hf_architecture
    if arch:
        trace = hf.import_trace(arch)
        layout = run.model_file.HF_LAYOUTS.get(arch["config"].get("model_type"), {})
        rename = lambda k: hf.live_name(layout, k)  # noqa: E731
    elif run.model_file.to_hf is not None:
        base = {k: v for k, v in run.model.state_dict().items() if ".lora." not in k}
        trace, rename = hf.export_trace(run.model_file.to_hf, run.model.config, base), lambda k: k
    else:
        raise convert.ExportError(f"export: --model {run.args.model} has no Hugging Face export here")
    state, fields = hf.peft_state(trace, adapters, rename)
    rank = run.args.lora_rank
    return hf.save_peft(a.peft_out, state, fields, rank, run.args.lora_alpha or rank, run.args.lora_dropout)


def score(a):
    """A reward model's (--task rm) reward of each record of an SFT file ({"prompt", "response"} or {"messages"}), one
    per line, in file order. One process, the whole model."""
    run = checkpoint.load_model(a.load, extend=recipes.add_value_head, reward_model=True)
    eod, rewards = tokenizer_files.special_ids(run.tok)["eod"], []
    model = run.model.eval()
    for record in recipes.load_records(a.data_path, "sft"):
        smp = recipes.make_sample(record, "sft", run.tok, run.args.seq_length, eod, record["_where"])
        with torch.no_grad():
            out = recipes.run_model(model, torch.from_numpy(smp)[None], (recipes.CHOSEN,), value=True)
            values = recipes.last_token_values(*out)
        rewards.append(float(values[0, 0]))
        print(f"{rewards[-1]:.6f}", flush=True)
    return rewards


APPS = {"serve": "an OpenAI-compatible HTTP server for a run (serving/server.py; torchrun it for TP > 1)",
        "rl": "the shipped RL task: --sft-out FILE writes its SFT records, --eval RUN a run's held-out reward"}


def plan(a, model_flags):
    """The layouts of --gpus GPUs that fit, fastest first; with layout flags, that layout's memory and time
    (planning/planner.py). The model is train.py's flags (or a Megatron script's); 16-bit on a GPU (--fp16, else bf16),
    the run's on cpu."""
    args = parse_args(model_flags)
    c = model_config(model_file(args.model), args)
    gpu = timing.cpu_gpu() if a.gpu == "cpu" else timing.GPUS[a.gpu]
    dtype = "fp16" if args.fp16 else "bf16" if args.bf16 or a.gpu != "cpu" else "fp32"
    accounting = "cpu" if a.gpu == "cpu" else "gpu"
    try:
        single = any(f.split("=")[0] in planner.LAYOUT_FLAGS for f in model_flags)
        if single:
            entries = [planner.evaluate(c, planner.layout_of(args, c, a.gpus, dtype), gpu, accounting)]
        else:
            entries = planner.plan(c, gpu, a.gpus, args.seq_length, args.global_batch_size or
                                   args.micro_batch_size * a.gpus, dtype, accounting, top=a.top)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not entries:
        raise ConfigError(f"no layout of {a.gpus} x {gpu.name} fits this model")
    if a.plot:
        planner.plot(entries[0], a.plot)
    print(json.dumps(entries[0] if single else {"layouts": entries}, indent=1)
          if a.json else planner.report(entries, gpu, a.gpus))


def parse(argv):
    p = ArgumentParser(prog="tools.py", description="Sample from, merge, export or score a run train.py saved.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="print the model's continuation of a prompt")
    s.add_argument("--load", required=True, help="the run directory (train.py --save)")
    s.add_argument("--prompt", default="def ")
    s.add_argument("--max-new-tokens", type=int, default=None, help="at most what the context leaves (default: 200, "
                   "or fewer where the context ends)")
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model file's sample())")
    s.add_argument("--top-k", type=int, default=None, help="sample among the k most likely (default: the model's)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--chat", action="store_true", help="answer --prompt as a user turn of the chat template the SFT "
                   "task trains on; print the answer only (a causal language model)")
    s.set_defaults(run=sample)
    m = sub.add_parser("merge", help="a LoRA run's adapters merged into its base: a plain checkpoint")
    m.add_argument("--load", required=True, help="the LoRA run")
    m.add_argument("--save", required=True, help="an empty directory for the merged checkpoint")
    m.set_defaults(run=merge)
    e = sub.add_parser("export", help="a Hugging Face model directory (weights, tokenizer, chat template)")
    e.add_argument("--load", required=True)
    e.add_argument("--hf-out", default=None, help="the directory to write the model to")
    e.add_argument("--peft-out", default=None, help="a LoRA run: the directory to write its adapters to, as a PEFT "
                   "folder for the exported base model")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"],
                   help="of the written weights (default: an imported model's dtype in its folder, else the run's)")
    e.add_argument("--overwrite", action="store_true", help="write into a directory that is not empty")
    e.add_argument("--quantization", choices=["awq"], help="AWQ int4 (posttraining/quantization.py): scales searched "
                   "on the run's training samples, weights written in compressed-tensors' pack-quantized format")
    e.add_argument("--awq-apply-clip", action=argparse.BooleanOptionalAction, default=True, help="AWQ's weight "
                   "clipping search (AutoAWQ's and llm-compressor's apply_clip); --no-awq-apply-clip: scales only")
    e.set_defaults(run=export)
    i = sub.add_parser("import-hf", help="a local Hugging Face folder as a checkpoint any run starts from (interop/hf.py)")
    i.add_argument("--hf", required=True, help="the folder: config.json, *.safetensors, tokenizer.json")
    i.add_argument("--save", required=True, help="an empty directory for the checkpoint")
    i.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="of the imported weights")
    i.set_defaults(run=lambda a: said(import_hf(a.hf, a.save, getattr(torch, a.dtype)), f"imported {a.hf} into "
                   f"{a.save}; start a run from it: python train.py --pretrained-checkpoint {a.save} --save RUN ..."))
    g = sub.add_parser("import-megatron", help="a Megatron-core torch_dist checkpoint as a run (weights only); "
                       "the model's flags (train.py's: --model, --num-layers, ...) follow")
    g.add_argument("--load", required=True, help="the Megatron-core checkpoint directory (metadata.json, .metadata)")
    g.add_argument("--save", required=True, help="an empty directory for the run")
    g.set_defaults(run=import_megatron)
    x = sub.add_parser("export-megatron", help="a run as a Megatron-core torch_dist checkpoint")
    x.add_argument("--load", required=True, help="the run directory")
    x.add_argument("--save", required=True, help="an empty directory for the Megatron-core checkpoint")
    x.add_argument("--padded-vocab-size", type=int, default=None, help="Megatron's embedding rows (default: the "
                   "run's padded vocabulary; Megatron pads to make_vocab_size_divisible_by x TP)")
    x.set_defaults(run=export_megatron)
    c = sub.add_parser("score", help="a reward model's (--task rm) score of each record of a JSON-lines file")
    c.add_argument("--load", required=True, help="the reward model's run")
    c.add_argument("--data-path", required=True, help="a JSON-lines file of prompts with responses")
    c.set_defaults(run=score)
    n = sub.add_parser("plan", help="rank the layouts of N GPUs that fit a model by predicted throughput (planning/); "
                       "train.py's model flags follow (layout flags: that layout's memory and time)")
    n.add_argument("--gpu", default="a100-80gb", choices=["a100-80gb", "h100-80gb", "h200", "cpu"],
                   help="cpu: this machine, its measured GEMM rate, one process a rank")
    n.add_argument("--gpus", type=int, default=8, help="the GPUs (cpu: processes)")
    n.add_argument("--top", type=int, default=10, help="how many ranked layouts to print")
    n.add_argument("--json", action="store_true", help="print JSON: memory_bytes, tflops_per_gpu, "
                   "seconds_per_iteration and the layout's Megatron flags ({\"layouts\": [...]} when ranking)")
    n.add_argument("--plot", default=None, help="a PNG bar chart of the (best) layout's memory per GPU")
    n.set_defaults(run=plan)
    for name, what in APPS.items():  # their own parsers take the rest of the line (tools.py serve --help)
        sub.add_parser(name, help=what, add_help=False)
    a, rest = p.parse_known_args(argv)
    if a.command not in ("import-megatron", "plan") and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return a, rest


def said(out, line: str):
    print(line)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] == "serve":
            from serving import server
            return server.main(argv[1:])
        if argv and argv[0] == "rl":
            from posttraining import rl
            return rl.main(argv[1:])
        if argv and argv[0] == "eval":
            from evaluation import evaluate
            return evaluate.main(argv[1:])
        if argv and argv[0] == "eval-tasks":
            from evaluation import tasks
            return tasks.main(argv[1:])
        a, model_flags = parse(argv)
        return a.run(a, model_flags) if a.command in ("import-megatron", "plan") else a.run(a)
    except (ConfigError, data.DataError, convert.MegatronDistError) as e:  # (ExportError, LoRAError: ConfigErrors)
        print(f"tools.py: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    result = main()  # a command's result (the sampled text, the folder written) is for Python callers; the shell gets
    sys.exit(result if isinstance(result, int) else 0)  # 0 (serve and rl return their exit status)
