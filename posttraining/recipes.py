"""posttraining/recipes.py — post-training tasks on the parallel backend: SFT, DPO, KTO, reward models: their datasets, chat
template, losses, the reference model and the reward model's value head.

Mirrors, in Megatron-LM, megatron/training (the finetune flow, --finetune / --pretrained-checkpoint); NeMo-Aligner
and Megatron-Bridge (DPO and reward-model training on Megatron-core); Hugging Face TRL for the loss definitions
(trl/trainer/dpo_trainer.py, kto_trainer.py, reward_trainer.py, and sft_trainer.py's completion-only loss and
packing); ms-swift's Megatron trainers (a frozen reference model's forward pass before the policy's).
Papers: Rafailov et al. 2023, "Direct Preference Optimization" (DPO); Mitchell 2023, "A note on DPO with noisy
preferences" (cDPO, label smoothing); Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization"; Ouyang et al. 2022, "Training language models to follow instructions" (InstructGPT's reward model,
the Bradley-Terry pairwise loss).

Run:    make train ARGS="--task sft"                       # generated example data from the stdlib (below)
        make train ARGS="--task dpo --data-path prefs.jsonl --pretrained-checkpoint runs/gpt"
        .venv/bin/python -m pytest -q tests/test_posttrain_data.py tests/test_posttrain.py

Dimension glossary
  N records (= samples)   R rows per sample (sft 3, dpo/rm/kto 5)   s --seq-length (a row holds s + 1 tokens)
  gbs global batch size

Section 1 (task data: the record formats, the chat template, the SAMPLE FORMAT, the example records), section 2 (task
losses and the reference model) and section 3 (what a task adds to the model: the frozen reference, the value head;
`setup_task`, which train.py calls once) each open with a header that says what they hold.
"""
from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import hashlib
import json
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import checkpoint
import data
import parallel as P
from data import DataError
from interop import tokenizer_files
from posttraining import lora

# ==== 1. Task data: JSON-lines records, chat template, samples, example data, datasets
# A JSON-lines file holds one record per line:
#   sft       {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}  or  {"prompt", "response"}
#   dpo, rm   {"prompt", "chosen", "rejected"}
#   kto       {"prompt", "completion", "label": true|false}
# A record becomes text through the chat template (CHAT_TEMPLATE), tokenized piece by piece, so the loss mask falls
# exactly on the assistant's tokens. A 2-turn conversation renders as (<|endoftext|> is the eod token itself):
#
#     <|system|>
#     You are terse.
#     <|user|>
#     Add 2 and 3.
#     <|assistant|>
#     5<|endoftext|><|user|>
#     And 4 and 4?
#     <|assistant|>
#     8<|endoftext|>
#
# The loss covers "5<|endoftext|>" and "8<|endoftext|>" only: each assistant turn ends with eod, which is part of the
# loss, so the model learns to stop (gpt.generate stops at eod). Role markers are plain text (BPE pieces, no new
# vocabulary); special-token strings inside a record's text are encoded as plain text, so only the template's eod is
# ever an eod. The same template serves the trained model: chat_prompt_ids is tools.py sample --chat's prompt (a user
# turn, then the assistant's header, tokenized piece by piece like a sample), and chat_template_jinja is it as a Jinja
# chat template, which tools.py export writes for transformers' apply_chat_template. transformers tokenizes the whole
# rendered string, not piece by piece: the same ids, except where a message starts or ends with whitespace or holds
# special-token text (tests/test_serve_export.py shows both).
# A run on a Hugging Face tokenizer folder with a chat template of its own (tokenizer_files.folder_tokenizer: Roles.chat_template)
# renders conversations with that template instead, exactly as transformers' apply_chat_template does
# (tokenizer_files.apply_chat_template), and encodes the render whole as its tokenize=True does (template_ids; encode_chat picks
# the path): the loss mask covers each assistant turn from the end of the template's render of the turns before it with
# add_generation_prompt to the end of its render through that turn (the content, then the template's end-of-turn
# text), found by these prefix renders; a template whose prefix render is not a prefix of the whole is refused, and so
# is a message holding a special token's text (encoded whole it would become that control token).
# A sample is a numpy int64 array [R, s+1] (the SAMPLE FORMAT): token rows right-padded with eod, 0/1 mask rows
# (mask[t] = 1 iff token t is a response token: input tok[:-1], labels tok[1:], loss mask mask[1:]) and the META row
# last (meta[0] = the KTO label; meta[1] = the index in the global batch, filled by the recipe). Samples are never
# truncated. KTO's kl row pairs the prompt with the NEXT record's completion in file order ((i + 1) mod N), the
# KTO paper's mismatched pairs for the reference point z0, fixed by the data so it cannot depend on the layout.
# SFT --packing puts several samples back to back (greedy, in order) in one row; every sample ends with eod, so
# data.get_ltor_masks_and_position_ids(reset_position_ids=True, reset_attention_mask=True) isolates them (a sample
# that does not end with its only eod, as many folders' templates write them, is refused).
# Without --data-path, example_records builds records from the stdlib's functions (ast): the prompt is an instruction,
# the signature and the docstring; the response is the true body; a rejected/undesirable answer is another function's
# body or the true body with its lines shuffled. Their samples are built once and cached in --data-cache-dir
# (example_samples).

TASKS = ("sft", "dpo", "kto", "rm")
EOD_TEXT = tokenizer_files.SPECIAL_TOKENS[0]  # "<|endoftext|>": a piece of exactly this text becomes the eod id
CHAT_TEMPLATE = {  # role -> the text before the turn's content; "end": after a system/user content (not assistant)
    "system": "<|system|>\n", "user": "<|user|>\n", "assistant": "<|assistant|>\n", "end": "\n"}
ROWS = {"sft": 3, "dpo": 5, "rm": 5, "kto": 5}  # R, the rows of one sample (the SAMPLE FORMAT)
INSTRUCTION = "Write the body of this Python function.\n\n"  # example_records' prompt starts with it
EXAMPLES_VERSION = 1  # of example_records and make_sample: it keys their cached samples; bump it when they change
EXAMPLE_WHERE = "example record {j} (--task {task}, seed {seed})"  # an example record's '_where'
_HOLDS_DEFS = (ast.stmt, ast.excepthandler, ast.match_case)  # the nodes whose children can be a def


def render_chat(messages):
    """[{'role', 'content'}, ...] -> [(text, is_assistant), ...]: the pieces that concatenate to the rendered text;
    each assistant turn is (content, True), (EOD_TEXT, True) after its (header, False)."""
    pieces = []
    for m in messages:
        pieces.append((CHAT_TEMPLATE[m["role"]], False))
        if m["role"] == "assistant":
            pieces += [(m["content"], True), (EOD_TEXT, True)]
        else:
            pieces.append((m["content"] + CHAT_TEMPLATE["end"], False))
    return pieces


def chat_prompt_ids(messages, tok, images=None):
    """The token ids of a conversation that ends with a user turn, then the assistant's header: what an SFT model
    answers (tools.py sample --chat), tokenized piece by piece exactly as its training samples were (_encode); with
    the tokenizer's own chat template, its render with add_generation_prompt=True encoded whole, as transformers'
    apply_chat_template(messages, add_generation_prompt=True) gives it. `images` {message index: token ids}: the ids
    that open that message's content (an image's tokens, the server's; before the text, where vLLM puts an image's
    placeholder that a template does not place), with this repository's template only."""
    if tokenizer_files.roles_of(tok).chat_template is not None:
        if images:
            raise DataError("an image in a chat message needs this repository's chat template (the run's tokenizer "
                            "has its own, which places no image tokens here)")
        _refuse_control_text(messages, tok, "the prompt")
        return tokenizer_files.encode_chat_text(tok, tokenizer_files.apply_chat_template(tok, messages, True)).ids
    eod, ids = tokenizer_files.special_ids(tok)["eod"], []
    for i, m in enumerate(messages):  # (piece by piece: the header's ids, the images', the content's)
        head, *rest = render_chat([m])
        ids += _encode([head], tok, eod)[0] + list((images or {}).get(i, ())) + _encode(rest, tok, eod)[0]
    return ids + _encode([(CHAT_TEMPLATE["assistant"], False)], tok, eod)[0]


def _refuse_control_text(messages, tok, where):
    """A message whose text holds a special token's text (<|eot_id|>) is refused: rendered by the template and encoded
    whole, as transformers does, that text would become the control token itself."""
    specials = tokenizer_files.special_token_texts(tok)
    for i, m in enumerate(messages):
        for key, value in m.items():
            hit = next((t for t in specials if isinstance(value, str) and t in value), None)
            if hit is not None:
                raise DataError(f"{where}: messages[{i}]['{key}'] holds the special token {hit!r} as text, which the "
                                "chat template's encoding (transformers' apply_chat_template) makes that control token")


def template_ids(messages, tok, where="a conversation"):
    """(ids, mask) lists of a conversation through the tokenizer's own chat template (tokenizer_files.apply_chat_template):
    ids = the whole render encoded as transformers' apply_chat_template(messages, tokenize=True) encodes it; mask = 1
    on each assistant turn, from where the template's render of messages[:k] with add_generation_prompt ends (the
    assistant's header written) to where its render of messages[:k+1] ends: the content and what the template
    writes after it before the next turn (its end-of-turn token, so the model learns to stop). A token is in the
    loss iff its characters (the tokenizer's offsets) overlap such a span. A template whose render of a prefix of the
    conversation is not a prefix of the whole render (one that rewrites earlier turns) cannot be masked so: refused."""
    _refuse_control_text(messages, tok, where)
    full, spans = tokenizer_files.apply_chat_template(tok, messages), []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tokenizer_files.apply_chat_template(tok, messages[:k], add_generation_prompt=True)
        turn = tokenizer_files.apply_chat_template(tok, messages[:k + 1])
        for part, what in ((head, f"messages[:{k}] with add_generation_prompt"), (turn, f"messages[:{k + 1}]")):
            if not full.startswith(part):
                raise DataError(f"{where}: the chat template's render of {what} is not a prefix of its render of the "
                                "whole conversation (it rewrites earlier turns), so the assistant's tokens cannot be "
                                "found")
        if len(turn) <= len(head):
            raise DataError(f"{where}: the chat template renders assistant messages[{k}] as no text after its header")
        spans.append((len(head), len(turn)))
    enc = tokenizer_files.encode_chat_text(tok, full)
    mask = [int(any(a <= s < b if s == e else (s < b and e > a) for a, b in spans)) for s, e in enc.offsets]
    return list(enc.ids), mask


def encode_chat(messages, tok, eod, where="a conversation"):
    """(ids, mask) lists of a conversation: through the tokenizer's own chat template if it has one (template_ids),
    else CHAT_TEMPLATE's pieces, each tokenized alone (render_chat, _encode)."""
    if tokenizer_files.roles_of(tok).chat_template is not None:
        return template_ids(messages, tok, where)
    return _encode(render_chat(messages), tok, eod)


def chat_template_jinja(template=CHAT_TEMPLATE, eod_text=EOD_TEXT):
    """render_chat as a Jinja2 chat template (tools.py export writes it to tokenizer_config.json), built from
    CHAT_TEMPLATE (`template`: another, for a test): `tokenizer.apply_chat_template(messages, tokenize=False)` is the
    text of render_chat(messages), and add_generation_prompt appends the assistant's header. An unknown role raises,
    as render_chat does. Every tag trims the whitespace around it ({%- -%}), so the template's own line breaks render
    nothing; its strings are JSON literals, which Jinja reads as the same strings."""
    headers = {role: template[role] for role in ("system", "user", "assistant")}
    return "\n".join([
        "{%- set headers = " + json.dumps(headers) + " -%}",
        "{%- for message in messages -%}",
        "{%- if message['role'] not in headers -%}",
        "{{- raise_exception('unknown role ' + message['role'] + ': expected system, user or assistant') -}}",
        "{%- endif -%}",
        "{{- headers[message['role']] + message['content'] -}}",
        "{%- if message['role'] == 'assistant' -%}{{- " + json.dumps(eod_text) + " -}}",
        "{%- else -%}{{- " + json.dumps(template["end"]) + " -}}{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{- headers['assistant'] -}}{%- endif -%}"])


def _messages(record, response_key="response"):
    """The conversation of a record: its messages, or a user prompt followed by the assistant's response."""
    if "messages" in record:
        return record["messages"]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record[response_key]}]


def _check_record(obj, task):
    """The first thing wrong with a parsed record, as a message (None if it is well formed)."""
    if not isinstance(obj, dict):
        return f"a record must be a JSON object, got {type(obj).__name__}"
    if task == "sft" and "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                return f"messages[{i}] needs a string 'content'"
            if m.get("role") not in ("system", "user", "assistant"):
                return f"messages[{i}] has role {m.get('role')!r}, expected system, user or assistant"
            if m["role"] == "assistant" and not m["content"]:
                return f"messages[{i}] is an empty assistant turn"
        return None if msgs[-1]["role"] == "assistant" else "a conversation must end with an assistant turn"
    keys = {"sft": ("prompt", "response"), "dpo": ("prompt", "chosen", "rejected"), "kto": ("prompt", "completion"),
            "rm": ("prompt", "chosen", "rejected")}[task]
    for k in keys:
        if k not in obj:
            has = {"sft": "messages, or prompt and response", "kto": "prompt, completion, label"}.get(task, ", ".join(keys))
            return f"missing key {k!r} (a {task} record has {has})"
        if not isinstance(obj[k], str):
            return f"{k!r} must be a string, got {type(obj[k]).__name__}"
        if k != "prompt" and not obj[k]:
            return f"empty {k!r}"
    if task == "kto" and not isinstance(obj.get("label"), bool):
        return f"'label' must be true or false, got {json.dumps(obj.get('label'))}"
    return None


def load_records(path, task):
    """A task's JSON-lines file -> records (dicts, each with '_where' = 'FILE:LINE'); blank lines are skipped."""
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    if not Path(path).is_file():
        raise DataError(f"--data-path {str(path)!r} is not a file (--task {task} reads a .jsonl file)")
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise DataError(f"{path}:{lineno}: not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            if (bad := _check_record(obj, task)) is not None:
                raise DataError(f"{path}:{lineno}: {bad}")
            records.append({**obj, "_where": f"{path}:{lineno}"})
    if not records:
        raise DataError(f"{path}: no records")
    return records


@contextmanager
def _plain_text(tok):
    """Within it, special-token strings in the text are encoded as plain text (as data.tokenize_documents does)."""
    saved, tok.encode_special_tokens = tok.encode_special_tokens, True
    try:
        yield tok
    finally:
        tok.encode_special_tokens = saved


def _encode(pieces, tok, eod):
    """Pieces -> (ids, mask) lists; a piece of exactly EOD_TEXT is the eod id, other text is plain text."""
    ids, mask = [], []
    with _plain_text(tok):
        for text, is_assistant in pieces:
            piece = [eod] if text == EOD_TEXT else tok.encode(text, add_special_tokens=False).ids
            ids += piece
            mask += [int(is_assistant)] * len(piece)
    return ids, mask


def _rows(messages, tok, seq_length, eod, where):
    """(tokens, mask) rows [2, s+1] of a conversation (encode_chat), right-padded with eod (mask 0); a sample never
    gets truncated."""
    ids, mask = encode_chat(messages, tok, eod, where)
    if len(ids) > seq_length + 1:
        raise DataError(f"{where}: {len(ids)} tokens, longer than --seq-length + 1 = {seq_length + 1}: samples are "
                        "never truncated (a cut response would teach the model to stop mid-answer); shorten it or "
                        "raise --seq-length")
    out = np.zeros((2, seq_length + 1), np.int64)
    out[0] = eod
    out[0, :len(ids)], out[1, :len(ids)] = ids, mask
    return out


def make_sample(record, task, tok, seq_length, eod, where):
    """One record -> np.int64 [R, s+1] (the SAMPLE FORMAT). KTO needs record['kl_completion'] (build_task_datasets
    sets it: the next record's completion)."""
    meta = np.zeros((1, seq_length + 1), np.int64)
    if task == "sft":
        return np.concatenate([_rows(_messages(record), tok, seq_length, eod, where), meta])
    if task in ("dpo", "rm"):
        pair = [_rows(_messages(record, k), tok, seq_length, eod, f"{where} ({k})")
                for k in ("chosen", "rejected")]
        return np.concatenate(pair + [meta])
    if task == "kto":
        meta[0, 0] = int(record["label"])
        if "kl_completion" not in record:
            raise DataError(f"{where}: a kto record needs 'kl_completion' (build_task_datasets sets the next one's)")
        main = _rows(_messages(record, "completion"), tok, seq_length, eod, where)
        kl = _rows(_messages(record, "kl_completion"), tok, seq_length, eod,
                   f"{where} (its prompt with the next record's completion, KTO's kl row)")
        return np.concatenate([main, kl, meta])
    raise DataError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")


def pack_sft(samples, seq_length, eod, wheres):
    """SFT samples [N, 3, s+1] -> packed [M, 3, s+1]: greedy, in order, each sample's tokens (ending with eod) back to
    back while they fit in s+1; the rest right-padded with eod. A sample with several eods (a multi-turn
    conversation) is refused: the reset attention mask would cut it at each eod."""
    packed, cur = [], np.zeros((2, 0), np.int64)
    for smp, where in zip(samples, wheres):
        n = int(np.nonzero(smp[1])[0].max()) + 1  # the last response token is the final eod: the sample's length
        if int((smp[0, :n] == eod).sum()) != 1 or smp[0, n - 1] != eod:  # (a tokenizer's own chat template may
            # write eod after every turn, or end the last one with other tokens: Zephyr's "</s>\n")
            raise DataError(f"{where}: --packing needs one assistant turn per conversation, and the sample's only eod "
                            "token at its end (the packed attention mask resets at every eod)")
        if cur.shape[1] + n > seq_length + 1:
            packed.append(cur)
            cur = np.zeros((2, 0), np.int64)
        cur = np.concatenate([cur, smp[:2, :n]], axis=1)
    packed.append(cur)
    out = np.zeros((len(packed), 3, seq_length + 1), np.int64)
    out[:, 0] = eod
    for i, p in enumerate(packed):
        out[i, :2, :p.shape[1]] = p
    return out


class TaskDataset:
    """Samples [N, R, s+1] in an order shuffled per epoch like data.GPTDataset (a permutation seeded by seed + epoch);
    ds[i] is np.int64 [R, s+1], for data.global_batch."""

    def __init__(self, samples, seed):
        self.samples, self.seed = np.asarray(samples, np.int64), seed
        if self.samples.ndim != 3 or len(self.samples) < 1:
            raise DataError(f"TaskDataset needs samples [N >= 1, R, s+1], got shape {self.samples.shape}")
        self.num_rows = self.samples.shape[1]
        self._epoch, self._perm = None, None

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        if i < 0:
            raise IndexError(f"sample index {i} is negative")
        epoch, j = divmod(int(i), len(self))
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng(self.seed + epoch).permutation(len(self))
        return self.samples[self._perm[j]].copy()


@lru_cache(maxsize=4)
def _functions(files):
    """(prompt, body) of every function with a docstring and a body of 1-30 lines in the files, in file order."""
    out = []
    for path in files:
        try:
            src = Path(path).read_text(encoding="utf-8")
            todo = [ast.parse(src)] if "def " in src else []  # parsing is most of the cost: skip files without a def
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # as ast counts lines
        for node in todo:  # ast.walk's breadth-first order, through statements only (a def sits in statement lists)
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, _HOLDS_DEFS)]
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
                continue
            doc, rest, ind = node.body[0], node.body[1:], node.col_offset
            if not rest or not 1 <= node.end_lineno - rest[0].lineno + 1 <= 30:
                continue
            seg = lines[node.lineno - 1:node.end_lineno]  # the def line(s) to the end; skip odd indentation
            if any("\t" in t or (t.strip() and not t.startswith(" " * ind)) for t in seg):
                continue
            head = "\n".join(t[ind:] for t in lines[node.lineno - 1:doc.end_lineno])
            body = "\n".join(t[ind:] for t in lines[rest[0].lineno - 1:node.end_lineno])
            if body.strip() in ("pass", "...", "raise NotImplementedError", "raise NotImplementedError()"):
                continue
            out.append((INSTRUCTION + head, body))
    return tuple(dict.fromkeys(out))  # without duplicates, in order


def _shuffled(body, rng):
    """The body's lines in another order, or None if every order gives the same text."""
    lines = body.split("\n")
    if len(set(lines)) < 2:
        return None
    while (new := "\n".join(rng.permutation(lines))) == body:
        pass
    return new


def _lengths(tok, texts):
    """Token counts of plain-text pieces, in one batch."""
    with _plain_text(tok):
        return [len(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def example_records(task, tok, seq_length, seed, files=None):
    """Records for `task` from the stdlib's functions (or `files`), in file order, only those whose samples fit
    s + 1 tokens. Deterministic for (task, seed). dpo/rm: rejected = another function's body or the true body's lines
    shuffled (a coin flip each); kto: unpaired, the label alternates (balanced) between the true body and a wrong one,
    and each record's kl row (its prompt, the next record's completion) fits too."""
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    funcs = _functions(tuple(files or data.default_corpus_files()))
    rng, cands = np.random.default_rng(seed), []
    for i, (prompt, body) in enumerate(funcs):  # the same draws for every task
        other = funcs[(i + 1 + int(rng.integers(max(1, len(funcs) - 1)))) % len(funcs)][1]
        shuffled = _shuffled(body, rng) if rng.random() < 0.5 else None
        cands.append((prompt, body, shuffled if shuffled is not None else other))
    if tokenizer_files.roles_of(tok).chat_template is not None:  # the tokenizer's own template: render and count each pair
        specials = tokenizer_files.special_token_texts(tok)

        @functools.cache
        def fits(i, answer):  # (a text holding a special token's is refused by template_ids: skipped here)
            if any(t in cands[i][0] or t in answer for t in specials):
                return False
            text = tokenizer_files.apply_chat_template(tok, _messages({"prompt": cands[i][0], "response": answer}))
            return len(tokenizer_files.encode_chat_text(tok, text).ids) <= seq_length + 1
    else:  # a sample's length adds up over its pieces: the headers and eod (h), the prompt's piece, the answer's piece
        h = sum(_lengths(tok, [CHAT_TEMPLATE["user"], CHAT_TEMPLATE["assistant"]])) + 1
        p_len = _lengths(tok, (p + CHAT_TEMPLATE["end"] for p, _, _ in cands))
        texts = sorted({t for c in cands for t in c[1:]})
        a_len = dict(zip(texts, _lengths(tok, texts)))
        fits = lambda i, answer: h + p_len[i] + a_len[answer] <= seq_length + 1  # noqa: E731
    records = []
    for i, (prompt, body, wrong) in enumerate(cands):
        if task == "sft" and fits(i, body):
            records.append({"prompt": prompt, "response": body})
        elif task in ("dpo", "rm") and wrong != body and fits(i, body) and fits(i, wrong):
            records.append({"prompt": prompt, "chosen": body, "rejected": wrong})
        elif task == "kto":
            good = len(records) % 2 == 0
            answer = body if good else wrong
            prev_kl_fits = not records or fits(records[-1]["i"], answer)  # the previous record's kl row
            if (good or answer != body) and fits(i, answer) and prev_kl_fits:
                records.append({"prompt": prompt, "completion": answer, "label": good, "i": i})
    while task == "kto" and len(records) > 1 and not fits(records[-1]["i"], records[0]["completion"]):
        records.pop()  # the last record's kl row wraps around to the first completion
    return [{**{k: v for k, v in r.items() if k != "i"}, "_where": EXAMPLE_WHERE.format(j=j, task=task, seed=seed)}
            for j, r in enumerate(records)]


def _samples(records, task, tok, s, eod):
    """Records -> samples [N, R, s+1]; a kto record's kl row takes the next record's completion, in file order."""
    if task == "kto":
        records = [{**r, "kl_completion": records[(i + 1) % len(records)]["completion"]} for i, r in enumerate(records)]
    return np.stack([make_sample(r, task, tok, s, eod, r["_where"]) for r in records])


def example_samples(args, tok, eod):
    """The samples [N, R, s+1] of example_records, cached in args.data_cache_dir like data.build_data's tokens: a
    file keyed by all that makes them (task, seed, s, the tokenizer, the stdlib's files, EXAMPLES_VERSION), written
    atomically under build_data's file lock, so one rank builds it and the others read it; a damaged one is refused."""
    task, s, seed, files = args.task, args.seq_length, args.seed, data.default_corpus_files()
    key = hashlib.sha256(repr((EXAMPLES_VERSION, task, seed, s, [(f, os.path.getsize(f)) for f in files])).encode()
                         + tokenizer_files.tokenizer_text(tok).encode()).hexdigest()[:16]  # (with its roles: a chat template)
    path = Path(args.data_cache_dir) / f"examples-{task}-s{s}-{key}.npy"  # int32 (token ids, 0/1 masks and labels)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # torchrun's ranks on one node: the first builds, the others read
        if path.exists():
            try:
                return np.load(path).astype(np.int64)
            except (ValueError, OSError, EOFError) as e:
                raise DataError(f"{path}: a damaged example-samples cache ({e}): delete it to rebuild") from None
        if not (records := example_records(task, tok, s, seed, files)):
            raise DataError(f"no example records for --task {task} fit --seq-length={s}: raise --seq-length")
        samples = _samples(records, task, tok, s, eod)
        with open(tmp := f"{path}.tmp{os.getpid()}", "wb") as f:
            np.save(f, samples.astype(np.int32))
        os.replace(tmp, path)  # a killed run never leaves half a file behind
    return samples


def split_by_prompt(samples, valid_fraction: float):
    """(train ids, valid ids) of samples [N, R, s+1], held out BY PROMPT: a sample is valid iff the hash of its prompt's
    tokens (row 0 before the first response token) maps below valid_fraction in [0, 1). So every stage of a pipeline
    (SFT -> DPO, RM, KTO) holds out the same prompts — an SFT run never trains on a prompt a later stage validates
    on — and all records of one prompt fall on one side. At least one of each when N >= 2 and valid_fraction > 0."""
    first = samples[:, 1].argmax(-1)  # [N] the first response token of row 0
    u = np.array([int.from_bytes(hashlib.sha256(samples[i, 0, :f].astype("<i8").tobytes()).digest()[:8], "little")
                  for i, f in enumerate(first)], dtype=np.float64) / 2.0 ** 64  # [N] uniform in [0, 1)
    valid = u < valid_fraction
    if len(u) >= 2 and valid_fraction > 0 and (valid.all() or not valid.any()):  # a tiny file, all on one side:
        valid = u < u.max() if valid.all() else u <= u.min()  # the extreme prompt moves over
    ids = np.arange(len(u))
    return ids[~valid], ids[valid]


def build_task_datasets(args, tok):
    """(train, valid or None) TaskDatasets for args.task from args.data_path's records or example_samples; the samples
    are split by prompt (split_by_prompt), then (SFT --packing) packed."""
    task, s, eod, seed = args.task, args.seq_length, tokenizer_files.special_ids(tok)["eod"], args.seed
    if args.data_path:
        records = load_records(args.data_path, task)
        samples, wheres = _samples(records, task, tok, s, eod), [r["_where"] for r in records]
    else:
        samples = example_samples(args, tok, eod)
        wheres = [EXAMPLE_WHERE.format(j=j, task=task, seed=seed) for j in range(len(samples))]
    out = []
    for ids, sd in zip(split_by_prompt(samples, args.valid_fraction), (seed, seed + 1)):
        part = samples[ids]
        if args.packing and len(ids):
            part = pack_sft(part, s, eod, [wheres[i] for i in ids])
        out.append(TaskDataset(part, sd) if len(part) else None)
    return out[0], out[1]


# ==== 2. Task losses and the reference model: losses, recipes, reference model, metrics
# One sample = an int64 tensor [R, s+1] (SAMPLE FORMAT, section 1): token rows, 0/1 mask rows (1 = a response token
# whose log-prob counts), and the last row META: meta[0] = KTO's label, meta[1] = the sample's index in its global
# batch (set by `number_samples`). For the model: input = tokens[:-1], labels = tokens[1:], loss mask = mask[1:].
# Dimension glossary: g global batch (samples)   b micro-batch (samples)   k sequences per sample in a pass
#                     s sequence length          h hidden
META = -1
CHOSEN, REJECTED = (0, 1), (2, 3)  # dpo, rm: (token row, mask row) of each side; kto: (0, 1) the sample, (2, 3) its KL
UNIT = {"sft": "masked tokens", "dpo": "pairs", "kto": "samples", "rm": "pairs"}  # the loss rule's units
SEQUENCES = {"sft": 1, "dpo": 2, "kto": 1, "rm": 2}  # sequences per sample in the policy's pass (tokens/s, FLOPs)


def wins(a, b):
    """1 where a ranks above b, 1/2 on a tie, else 0: a DPO policy starts equal to its reference (every implicit
    reward 0), so its preference accuracy starts at 50 % — the coin flip it must beat."""
    return (a > b).double() + 0.5 * (a == b).double()


def sequence_logps(token_losses, mask):
    """Per-token losses -log p [n, s] and the 0/1 loss mask [n, s] -> each sequence's response log-prob [n]."""
    return -(token_losses * mask).sum(-1)


def sft_loss(token_losses, mask):
    """The SUM of the response tokens' losses (a scalar): divided by the global count of response tokens."""
    return (token_losses * mask).sum()


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float, smoothing: float = 0.0):
    """Per-pair DPO losses [n] (Rafailov et al. 2023; TRL's `sigmoid` loss): h = beta·((pi_c − ref_c) − (pi_r − ref_r)),
    −(1 − eps)·logsigmoid(h) − eps·logsigmoid(−h); eps > 0: cDPO (Mitchell 2023), labels flipped with probability eps."""
    h = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    return -(1 - smoothing) * F.logsigmoid(h) - smoothing * F.logsigmoid(-h)


def kto_loss(pi, ref, z0, label, beta: float, w_d: float = 1.0, w_u: float = 1.0):
    """Per-sample KTO losses [n] (Ethayarajh et al. 2024; TRL's kto_trainer): r = pi − ref; desirable (label 1):
    w_d·(1 − sigmoid(beta·(r − z0))), undesirable: w_u·(1 − sigmoid(beta·(z0 − r))); z0 the detached reference point."""
    r = pi - ref
    return torch.where(label.bool(), w_d * (1 - torch.sigmoid(beta * (r - z0))), w_u * (1 - torch.sigmoid(beta * (z0 - r))))


def rm_loss(v_c, v_r):
    """Per-pair Bradley-Terry losses [n] (Ouyang et al. 2022): −logsigmoid(v_chosen − v_rejected)."""
    return -F.logsigmoid(v_c - v_r)


def number_samples(batch):
    """META[1] = each sample's index in its global batch [g, R, s+1] (in place): the key under which the reference
    passes store their values, whichever DP rank, micro-batch and pipeline schedule a sample lands in."""
    batch[:, META, 1] = torch.arange(batch.shape[0])
    return batch


def num_units(task: str, batch) -> int:
    """The global count that divides the summed loss (the one loss rule): response tokens (sft) or samples."""
    return int(batch[:, 1, 1:].sum()) if task == "sft" else batch.shape[0]


def _last_stage_values(model, out):
    """The value head's output [s(/tp), n, 1] -> [n, s]: under SP the sequence gathered, backward = split (each rank
    then holds the whole gradient and keeps its tokens' part; the head's own gradient is summed over TP)."""
    if model.config.sequence_parallel:
        out = P.gather_from_sp(out, P.tp_of(model.grid), tp_output_grad=False)
    return rearrange(out, "s n 1 -> n s")


def run_model(model, mb, sides, eod=None, value=False):
    """The model on the sequences `sides` ((token row, mask row) pairs) of micro-batch mb [b, R, s+1], stacked
    [(k b), s]. Last stage: (per-token losses [k, b, s], or values with the value head; the loss masks [k, b, s];
    a third, the values [k, b, s], where a value head sits beside the output); an inner stage: its output hidden
    states (the schedule sends them). eod: SFT packing, block-causal attention."""
    tokens = rearrange(mb[:, [t for t, _ in sides]], "b k t -> (k b) t")  # [(k b), s+1]
    inp, kw = tokens[:, :-1], {}
    if eod is not None:  # packed samples: positions restart and attention stays inside each (data.py)
        kw["mask"], _, kw["position_ids"] = data.get_ltor_masks_and_position_ids(inp, eod, True, True)
    out = model(inp, **kw) if value else model(inp, tokens[:, 1:], **kw)
    if not model.post_process:
        return out
    out, beside = out if isinstance(out, tuple) else (out, None)  # a value head beside the output (rl.add_critic)
    out = _last_stage_values(model, out) if value else out
    out = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out  # losses in >= float32
    mask = rearrange(mb[:, [m for _, m in sides], 1:], "b k s -> k b s").to(out.dtype)
    res = rearrange(out, "(k b) s -> k b s", k=len(sides)), mask
    if beside is None:
        return res
    return *res, rearrange(_last_stage_values(model, beside).to(out.dtype), "(k b) s -> k b s", k=len(sides))


def last_token_values(values, mask):
    """values [k, b, s], loss masks [k, b, s] -> [k, b]: each sequence's value where the model reads its last response
    token before the closing eod (the input position whose next token is the final masked one; always one of the s
    inputs, also when a sample fills all s+1 tokens)."""
    s = mask.shape[-1]
    last = s - 1 - mask.flip(-1).argmax(-1)  # [k, b] the last 1 of each loss mask
    return values.gather(-1, last[..., None])[..., 0]


class Task:
    """One post-training task on this rank's model chunks: per global batch, `prepare` numbers the samples, splits
    this DP rank's micro-batches, runs the reference passes (dpo, kto) and returns the policy's recipe for the
    schedule. The recipe(model, mb) returns the SUM of the micro-batch's unit losses on the last stage (its hidden
    states elsewhere); train.py divides by the global count of units.
    The reference model (dpo, kto): `ref_chunks` (a frozen copy, built and loaded like the policy), or with LoRA the
    policy itself inside lora.disabled. Its sequence log-probs come from a forward-only pass of the same micro-batches
    under the same pipeline schedule, kept on the last stage at each sample's META[1] index: no collective needed.
    KTO's z0 = max(0, mean over the GLOBAL batch of (policy − reference) log-prob of the KL rows), detached: one more
    forward-only pass of the policy, summed over DP (and the pipeline, whose last stage holds it).
    Forward-only passes run in eval mode (no dropout), as TRL's reference model."""

    METRICS = {"dpo": ["rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy"],
               "kto": ["kl", "rewards"], "rm": ["accuracy", "reward_margin"]}  # what metrics() reports, per task

    def __init__(self, args, chunks, grid, shape, dtype, eod: int, device="cpu", autocast=contextlib.nullcontext,
                 ref_chunks=None, corpus=None, iteration: int = 0):  # (rl.Task's: its prompts, its first step)
        self.a, self.kind, self.chunks, self.grid, self.eod = args, args.task, chunks, grid, eod
        self.shape, self.dtype, self.device, self.autocast = shape, dtype, device, autocast
        self.lora, self.sequences = args.lora_rank is not None, SEQUENCES.get(self.kind, 1)  # (GRPO, PPO: a prompt)
        self.ref_chunks = chunks if self.lora else ref_chunks
        if self.kind in ("dpo", "kto") and self.ref_chunks is None:
            raise ValueError(f"--task {self.kind} needs a reference model (ref_chunks) or LoRA adapters")
        self.sums, self.ref, self.z0 = {}, None, None

    # ---- one global batch
    def prepare(self, batch, split: str = "train"):
        """Global batch [g, R, s+1] -> (this DP rank's micro-batches, recipe(model, mb), global unit count, p2p shape)."""
        a, grid = self.a, self.grid
        if batch.shape[1] != ROWS[self.kind]:
            raise ValueError(f"--task {self.kind}: samples of {ROWS[self.kind]} rows expected, got {batch.shape[1]}")
        batch = number_samples(batch.clone())
        micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].to(self.device).split(a.micro_batch_size))
        if self.kind == "dpo":
            self.ref = self.forward_only(self.ref_chunks, micro, (CHOSEN, REJECTED), batch.shape[0], self.lora)
        elif self.kind == "kto":
            self.ref = self.forward_only(self.ref_chunks, micro, (CHOSEN, REJECTED), batch.shape[0], self.lora)
            kl = self.forward_only(self.chunks, micro, (REJECTED,), batch.shape[0])[:, 0]  # the policy's KL rows
            self.z0 = self.reference_point(kl - self.ref[:, 1], batch.shape[0])
            if (not dist.is_initialized() or dist.get_rank() == 0):
                self.record(split, kl=self.z0.reshape(1))
        t, b, h = self.shape
        return (micro, functools.partial(self.policy_step, split=split), num_units(self.kind, batch),
                (t, b * self.sequences, h))

    def reference_point(self, diff, g: int):
        """KTO's z0 from this rank's (policy − reference) KL-row log-probs at their indices [g] (0 elsewhere)."""
        total = diff.sum().reshape(1)
        for group in (self.grid.dp, self.grid.pp):  # each sample is held by one DP rank's last stage
            total = P.all_reduce(total, group)
        return (total / g).clamp_min(0)[0]

    @torch.no_grad()
    def forward_only(self, chunks, micro, sides, g: int, adapters_off: bool = False, per_token: bool = False,
                     values: bool = False, rewards: bool = False):
        """Sequence log-probs [g, k] of `sides` under `chunks` (forward-only schedule, eval mode), filled on the last
        stage at each sample's META[1] (zeros elsewhere); per_token: each token's log-prob [g, k, s] instead;
        values (per_token, a value head beside the output): (log-probs, the per-token values [g, k, s]); rewards (a
        reward model: chunks whose value head took the output's seat): each sequence's last-token value [g, k]."""
        out = torch.zeros(g, len(sides), *([micro[0].shape[-1] - 1] if per_token else []), dtype=torch.float64,
                          device=self.device)
        vals = torch.zeros_like(out) if values else None

        def step(model, mb):
            with self.autocast(), lora.disabled(model) if adapters_off else contextlib.nullcontext():
                res = run_model(model, mb, sides, value=rewards)
            if not model.post_process:
                return res
            logps = last_token_values(*res) if rewards else -res[0] if per_token else sequence_logps(*res)  # [k, b(, s)]
            out[mb[:, META, 1]] = rearrange(logps, "k b ... -> b k ...").double()
            if values:
                vals[mb[:, META, 1]] = rearrange(res[2], "k b s -> b k s").double()
            return torch.zeros((), device=self.device)
        was = [c.training for c in chunks]
        for c in chunks:
            c.eval()
        t, b, h = self.shape
        try:
            P.forward_backward(chunks, micro, step, 1, self.grid, (t, b * len(sides), h), self.dtype, forward_only=True)
        finally:
            for c, w in zip(chunks, was):
                c.train(w)
        return (out, vals) if values else out

    # ---- the policy's pass: the schedule's loss_func
    def policy_step(self, model, mb, split="train"):
        a, kind = self.a, self.kind
        if kind == "sft":
            res = run_model(model, mb, (CHOSEN,), eod=self.eod if a.packing else None)
            return sft_loss(*res) if model.post_process else res
        res = run_model(model, mb, (CHOSEN, REJECTED) if kind in ("dpo", "rm") else (CHOSEN,), value=kind == "rm")
        if not model.post_process:
            return res
        idx = mb[:, META, 1]
        if kind == "rm":
            v_c, v_r = last_token_values(*res)
            self.record(split, accuracy=wins(v_c, v_r), reward_margin=(v_c - v_r).detach())
            tied = getattr(model.output_layer, "weight", None)  # a last stage's copy of the tied embedding: a zero
            zero = 0 * tied.sum() if tied is not None and tied.requires_grad else 0  # gradient, summed with its twin's
            return rm_loss(v_c, v_r).sum() + zero
        logps = sequence_logps(*res)  # [k, b]
        ref = self.ref[idx].to(logps.dtype)  # [b, 2]
        if kind == "dpo":
            loss = dpo_loss(logps[0], logps[1], ref[:, 0], ref[:, 1], a.dpo_beta, a.dpo_label_smoothing)
            rc, rr = (a.dpo_beta * (logps[0] - ref[:, 0])).detach(), (a.dpo_beta * (logps[1] - ref[:, 1])).detach()
            self.record(split, rewards_chosen=rc, rewards_rejected=rr, reward_margin=rc - rr,
                        preference_accuracy=wins(rc, rr))
            return loss.sum()
        label = mb[:, META, 0]
        loss = kto_loss(logps[0], ref[:, 0], self.z0.to(logps.dtype), label, a.kto_beta, a.kto_desirable_weight,
                        a.kto_undesirable_weight)
        self.record(split, rewards=(a.kto_beta * (logps[0] - ref[:, 0])).detach())
        return loss.sum()

    # ---- metrics: sums and counts on the last stage (TP rank 0 of it), reduced over every rank when logged
    def record(self, split, **values):
        if self.grid.tp.rank != 0:
            return
        for k, v in values.items():
            s = self.sums.setdefault(split, {}).setdefault(k, torch.zeros(2, dtype=torch.float64))
            s += torch.stack([v.double().sum().cpu(), torch.tensor(float(v.numel()), dtype=torch.float64)])

    def metrics(self, split: str = "train", prefix: str = "") -> dict:
        """{prefix + name: mean} since the last call, over every sample of every rank: a collective (every rank calls
        it). sft: none (its loss is already per response token)."""
        names = self.METRICS.get(self.kind, [])
        mine = self.sums.pop(split, {})
        t = torch.stack([mine.get(k, torch.zeros(2, dtype=torch.float64)) for k in names]) if names else None
        if t is None:
            return {}
        if dist.is_initialized():
            t = t.to(self.device)
            dist.all_reduce(t)
        return {prefix + k: float(t[i, 0] / t[i, 1]) for i, k in enumerate(names) if t[i, 1] > 0}


# ==== 3. What a task adds to the model: the frozen reference (dpo, kto), the value head (rm)

class ValueHead(nn.Module):
    """A reward model's head (InstructGPT's): Linear h -> 1 on the last stage's final hidden states [s(/tp), b, h] ->
    values [s(/tp), b, 1], named `value_head.weight`, initialized from the seed like every parameter. Replicated over
    TP; under SP each rank sees its s/tp tokens, so its gradient is summed over TP (`sequence_parallel`)."""

    def __init__(self, c, grid, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, c.hidden_size, dtype=c.params_dtype, device=device))
        P.mark(self.weight, ("normal", c.init_method_std), sequence_parallel=c.sequence_parallel)
        setattr(self.weight, checkpoint.ADDED, True)  # a base checkpoint does not hold it
        P.init_params(self, c.seed, grid, rename=lambda name: f"value_head.{name}")

    def forward(self, x, labels=None):  # in the model's postprocess seat: the labels are not used
        return F.linear(x, self.weight)


def add_value_head(model):
    """A reward model: the value head takes the output layer's seat on the model's last stage (model.postprocess):
    forward returns values [s(/tp), b, 1] instead of logits or losses. The output layer is then unused: an untied one
    is frozen; a last stage's copy of the tied embedding stays trainable (its first-stage twin learns)."""
    model.value_head = ValueHead(model.config, model.grid, next(model.parameters()).device)
    model.postprocess = model.value_head.__call__
    w = getattr(model.output_layer, "weight", None)
    if w is not None and not getattr(w, "shared_embedding", False):
        w.requires_grad_(False)
    return model


def setup_task(args, start, chunks, build, mesh, reference: bool | None = None):
    """What --task adds to this rank's model chunks, before the optimizer is made: rm, the value head on the last
    stage; dpo and kto, the frozen reference model — without LoRA a copy built like the policy (`build()`: fresh
    chunks) and loaded with the weights the run started from (none: the seed's initialization, the policy's), with
    LoRA the policy itself with its adapters off (Task). Returns (reference chunks or None, its pointer for meta.json
    "reference_base": recorded at the start, and read back on resume so a resumed run rebuilds the same reference)."""
    if args.task == "rm":
        for c in chunks:
            if c.post_process:
                add_value_head(c)
    if not (args.task in ("dpo", "kto") if reference is None else reference):  # (posttraining/rl.py: GRPO's KL term)
        return None, None
    if start.resume is not None:  # resuming: the reference the run started with
        pointer = start.resume.meta["args"].get("reference_base")
        ref = None if pointer is None else checkpoint.recorded_base(pointer, args.load, who="the reference model")
    else:
        ref = start.base
        pointer = None if ref is None else checkpoint.pointer_to(ref)
    if args.lora_rank is not None:
        return None, pointer
    ref_chunks = [c.requires_grad_(False) for c in build()]  # the seed's init, or the checkpoint it started from
    if ref is not None:
        checkpoint.load_weights(ref, ref_chunks, mesh)
    return ref_chunks, pointer
