"""tools.py — what you do with a saved run: sample from it, merge its LoRA adapters, export it to Hugging Face or to
Megatron-core, score text with a reward model; and a Megatron-core checkpoint made a run.

Mirrors Megatron-LM's tools/ (tools/run_text_generation_server.py's generation, tools/checkpoint/ conversion). A
file of its own so that train.py is only the training loop. Each command loads the run in one process
(checkpoint.load_model: whatever layout it was saved at) and asks its model file (contract.py) what it can do.

    python tools.py sample --load runs/gpt --prompt "def "      # generated text (make sample)
    python tools.py sample --load runs/gpt-sft --chat --prompt "Add 2 and 3."    # an SFT model's answer
    python tools.py merge --load runs/gpt-lora --save runs/gpt-merged    # a LoRA run's adapters merged into its base
    python tools.py export --load runs/gpt --hf-out runs/gpt-hf          # a Hugging Face model directory
    python tools.py score --load runs/gpt-rm --data-path answers.jsonl   # a reward model's score of each record
    python tools.py export-megatron --load runs/gpt --save runs/gpt-mcore   # a Megatron-core torch_dist checkpoint
    python tools.py import-megatron --load runs/gpt-mcore --save runs/gpt-from-mcore --model gpt \
        --tokenizer-file runs/gpt/tokenizer.json    # a Megatron-core checkpoint as a run (architecture flags: see below)

sample --chat: --prompt is one user turn of the chat template the SFT task trains on (posttrain.py section 1), then
the assistant's header, `<|user|>\\n{prompt}\\n<|assistant|>\\n`, tokenized piece by piece as SFT's samples are; the
model answers until the end-of-document token, and only the answer is printed. A causal language model's (its model
file's sample_ids, contract.py); anything else is refused.
export writes what serving needs: the weights and config.json, the tokenizer with its special tokens (eos = the
end-of-document token), generation_config.json, and the same chat template as Jinja, so that
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` renders the text --chat feeds the model
(tests/test_serve_export.py: the same token ids and the same greedy answer in transformers).

export-megatron / import-megatron: Megatron-core's own distributed checkpoints (dist_checkpointing's torch_dist
format: metadata.json, common.pt, .metadata, *.distcp), read and written with torch.distributed.checkpoint alone —
Megatron-core need not be installed (convert.megatron_dist_state / to_megatron_dist: layer-stacked tensors, fused-norm
names, SwiGLU halves, expert stacks). export-megatron writes what `dist_checkpointing.load(gpt_model.sharded_state_dict(),
DIR)` loads into a Megatron-core GPTModel of the same architecture (--padded-vocab-size: Megatron's embedding rows,
which depend on its TP). import-megatron --load takes such a directory or a Megatron-LM --save directory (its
latest_checkpointed_iteration.txt) and writes a weights-only run at iteration 0, as merge does, that train.py starts
from (`--pretrained-checkpoint RUN`, or --finetune). The flags after --save are train.py's model flags (--model,
--num-layers, --hidden-size, --swiglu, ...): a bare dist_checkpointing.save does not record the architecture, so one
left out takes train.py's default (above: the default run's shape, runs/gpt's); a Megatron-LM checkpoint's common.pt
does ("args"), and its values are then the defaults (convert.megatron_lm_args). --tokenizer-file: its tokenizer
(default: the one train.py would train on the corpus). A tensor missing, left over or of another shape is refused by
name.

Bad input ends with one line `tools.py: error: ...`.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

import checkpoint
import convert
import data
import lora
import posttrain
from arguments import ArgumentParser, ConfigError, check_args, parse_args


def refuse_reward_model(run, load):
    """A reward model's output is a value, not next-token logits: it scores (tools.py score), it does not generate."""
    if run.args.task == "rm":
        raise ConfigError(f"--load {load} is a reward model (--task rm): it scores text (tools.py score), it does not "
                          "generate or export as a causal LM")


def sample(a):
    """The model's continuation of --prompt, or what the model file's sample() makes of it (T5: the masked span)."""
    if not a.prompt:
        raise ConfigError("--prompt is empty: give the text to continue")
    if a.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={a.max_new_tokens} must be >= 1")
    if a.temperature is not None and not (a.temperature >= 0 and math.isfinite(a.temperature)):
        raise ConfigError(f"--temperature={a.temperature} must be >= 0 (0 = greedy)")
    if a.top_k is not None and a.top_k < 1:
        raise ConfigError(f"--top-k={a.top_k} must be >= 1")
    run = checkpoint.load_model(a.load)
    refuse_reward_model(run, a.load)
    if a.chat and run.model_file.sample_ids is None:
        raise ConfigError(f"--load {a.load}: a --model {run.args.model} run cannot answer --chat: its model file "
                          "declares no sample_ids() (only a causal language model continues a chat prompt)")
    if run.model_file.sample is None:
        raise ConfigError(f"--load {a.load}: a --model {run.args.model} run cannot sample: "
                          + (run.model_file.unsupported("sample") or "its model file declares no sample()"))
    torch.manual_seed(a.seed)
    opts = {k: v for k, v in (("temperature", a.temperature), ("top_k", a.top_k)) if v is not None}
    if a.chat:
        answer = chat_answer(run, a.prompt, a.max_new_tokens, **opts)
        text = run.tok.decode(answer[:-1] if answer[-1:] == [data.special_ids(run.tok)["eod"]] else answer)
    else:
        text = run.model_file.sample(run.model.eval(), run.tok, a.prompt, a.max_new_tokens, **opts)
    print(text)
    return text


def chat_answer(run, prompt: str, max_new_tokens: int, **opts) -> list[int]:
    """sample --chat: the token ids of the model's answer to `prompt` as one user turn of the training chat template
    (posttrain.chat_prompt_ids: `<|user|>\\n{prompt}\\n<|assistant|>\\n`, tokenized as SFT's samples were), up to and
    including the end-of-document token that ends an assistant turn (or max_new_tokens of them)."""
    ids = posttrain.chat_prompt_ids([{"role": "user", "content": prompt}], run.tok)
    return run.model_file.sample_ids(run.model.eval(), run.tok, ids, max_new_tokens, **opts)


def merge(a):
    return checkpoint.save_merged(a.load, a.save)


def export(a):
    """A Hugging Face model directory of the run (a LoRA run: merged), which transformers loads offline and serves:
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the training chat template as Jinja
    (posttrain.chat_template_jinja), generation_config.json; eos is our end-of-document token (convert.save_hf). A
    setting Hugging Face's class cannot express is refused by name."""
    run = checkpoint.load_model(a.load)
    refuse_reward_model(run, a.load)
    if run.model_file.to_hf is None:
        raise convert.ExportError(f"export: --model {run.args.model} has no Hugging Face export here"
                                  + (f" ({why})" if (why := run.model_file.unsupported("export")) else ""))
    return convert.save_hf(a.hf_out, *run.model_file.to_hf(run.model.config, run.model.state_dict()), run.tok,
                           chat_template=posttrain.chat_template_jinja())


def import_megatron(a, model_flags):
    """A Megatron-core torch_dist checkpoint as a weights-only run at iteration 0 (as merge writes one): the model and
    tokenizer of the flags given (train.py's model flags; a Megatron-LM checkpoint's recorded args are their defaults,
    convert.megatron_lm_args), filled with the checkpoint's tensors, every name and shape checked
    (convert.megatron_dist_full)."""
    checkpoint.refuse_run_in(a.save, "import")
    args = check_args(parse_args(model_flags, saved=convert.megatron_lm_args(a.load)), world=1)
    model, tok, settings = checkpoint.model_from_flags(args)
    model.load_state_dict(convert.megatron_dist_full(a.load, model), strict=False)  # (cast to the model's dtype)
    return checkpoint.save_weights(model, tok, a.save, {**settings, "save": a.save})


def export_megatron(a):
    """The run (a LoRA run: merged) as a Megatron-core torch_dist checkpoint (convert.to_megatron_dist)."""
    if Path(a.save).is_dir() and any(Path(a.save).iterdir()):
        raise ConfigError(f"--save {a.save} is not empty: export into an empty directory")
    run = checkpoint.load_model(a.load)
    refuse_reward_model(run, a.load)
    return convert.to_megatron_dist(run.model.state_dict(), run.model.config, a.save, a.padded_vocab_size)


def score(a):
    """A reward model's (--task rm) reward of each record of an SFT file ({"prompt", "response"} or {"messages"}), one
    per line, in file order. One process, the whole model."""
    run = checkpoint.load_model(a.load, extend=posttrain.add_value_head)
    if run.args.task != "rm":
        raise ConfigError(f"--load {a.load} is a --task {run.args.task} run, not a reward model (--task rm)")
    eod, rewards = data.special_ids(run.tok)["eod"], []
    model = run.model.eval()
    for record in posttrain.load_records(a.data_path, "sft"):
        smp = posttrain.make_sample(record, "sft", run.tok, run.args.seq_length, eod, record["_where"])
        with torch.no_grad():
            out = posttrain.run_model(model, torch.from_numpy(smp)[None], (posttrain.CHOSEN,), value=True)
            values = posttrain.last_token_values(*out)
        rewards.append(float(values[0, 0]))
        print(f"{rewards[-1]:.6f}", flush=True)
    return rewards


def parse(argv):
    p = ArgumentParser(prog="tools.py", description="Sample from, merge, export or score a run train.py saved.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="print the model's continuation of a prompt")
    s.add_argument("--load", required=True, help="the run directory (train.py --save)")
    s.add_argument("--prompt", default="def ")
    s.add_argument("--max-new-tokens", type=int, default=200)
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
    e.add_argument("--hf-out", required=True, help="the directory to write")
    e.set_defaults(run=export)
    i = sub.add_parser("import-megatron", help="a Megatron-core torch_dist checkpoint as a run (weights only); "
                       "the model's flags (train.py's: --model, --num-layers, ...) follow")
    i.add_argument("--load", required=True, help="the Megatron-core checkpoint directory (metadata.json, .metadata)")
    i.add_argument("--save", required=True, help="an empty directory for the run")
    i.set_defaults(run=import_megatron)
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
    a, rest = p.parse_known_args(argv)
    if a.command != "import-megatron" and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return a, rest


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        a, model_flags = parse(argv)
        return a.run(a, model_flags) if a.command == "import-megatron" else a.run(a)
    except (ConfigError, data.DataError, convert.ExportError, convert.MegatronDistError, lora.LoRAError) as e:
        print(f"tools.py: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
