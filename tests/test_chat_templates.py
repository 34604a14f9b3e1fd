"""A Hugging Face tokenizer folder's own chat template (interop/tokenizer_files.py: folder_chat_template, render_chat_template,
apply_chat_template, chat_stop_ids; posttraining/recipes.py: template_ids, encode_chat, chat_prompt_ids) against transformers'
`AutoTokenizer.from_pretrained(folder).apply_chat_template`, on real-world templates written here as data: Llama 3
Instruct's, Qwen2.5's ChatML with its default system prompt, Mistral's [INST], Zephyr's (an eos after every turn, no
generation tags), and Llama 3's with {% generation %} tags (as assistant-only-loss recipes write it).

  - for several conversations (system, multi-turn, a prompt with add_generation_prompt) the rendered text is
    byte-identical and the token ids identical (integers: exact) to transformers' tokenize=False / tokenize=True;
  - the SFT loss mask covers exactly each assistant turn's content and what the template writes after it up to the
    next turn: equal to transformers' return_assistant_tokens_mask for the template with generation tags, else to
    spans found independently (the text between the template's assistant header and the next header, mapped to
    tokens through transformers' own char_to_token);
  - negative controls: trim_blocks off, or the template without its bos_token variable, renders other text; encoding
    with the post-processor (add_special_tokens) gives other ids; a mask without the end-of-turn token differs;
  - a DPO and an SFT file built through recipes.build_task_datasets on tokenizer_files.megatron_tokenizer(--tokenizer-type
    HuggingFaceTokenizer) give transformers' ids; without --data-path, example_records counts each candidate through
    the template exactly (the longest drops out at a tighter --seq-length, nothing else); --packing takes only samples
    that end with their only eod; the template survives save_tokenizer and a reload; export's tokenizer_config renders
    the same text in transformers; sample --chat's stop ids (eod, and the template's end-of-turn token);
  - a tiny SFT run (train.py, 2 iterations) on such a folder keeps the template in its checkpoint; sample --chat and
    export use it (the exported folder's apply_chat_template gives the --chat prompt's ids; generation_config's
    eos_token_id lists the stop ids);
  - refusals: a template that rewrites earlier turns, special-token text inside a message, a template that refuses
    the roles, a list of templates without "default".
"""
from __future__ import annotations

import argparse
import json
import re
import types

import numpy as np
import pytest
import torch

import data
import gpt
from interop import convert, tokenizer_files
from posttraining import recipes as PT

transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")

# ------------------------------------------------------------------------------------------------ the templates
LLAMA3 = (  # Meta-Llama-3-8B-Instruct's tokenizer_config.json "chat_template"
    r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    r"message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    r"{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

MISTRAL = (  # Mistral-7B-Instruct-v0.1's
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>
' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>
' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>
'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""  # zephyr-7b-beta's: the line breaks inside its strings are real ones

LLAMA3_GENERATION = (  # Llama 3's with the assistant's text in {% generation %} (transformers' assistant mask)
    r"{{ bos_token }}{% for message in messages %}"
    r"{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    r"{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    r"{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
FOLDERS = {  # name -> (template, the tokenizer's special tokens, tokenizer_config's named tokens, bos post-processor,
    #                   the text that starts an assistant turn's loss span, the text that ends it)
    "llama3": (LLAMA3, LLAMA3_SPECIALS, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"), True,
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "qwen25": (QWEN25, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>"), False, "<|im_start|>assistant\n",
               "<|im_end|>\n"),
    "mistral": (MISTRAL, ["<unk>", "<s>", "</s>"], dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), False,
                " [/INST]", "</s>"),
    "zephyr": (ZEPHYR, ["<unk>", "<s>", "</s>"], dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), False,
               "<|assistant|>\n", "</s>\n"),
    "llama3_generation": (LLAMA3_GENERATION, LLAMA3_SPECIALS, dict(bos_token="<|begin_of_text|>",
                          eos_token="<|eot_id|>"), True, "<|start_header_id|>assistant<|end_header_id|>\n\n",
                          "<|eot_id|>"),
}

SYSTEM = {"role": "system", "content": "You are terse."}
U1, A1 = {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}
U2, A2 = {"role": "user", "content": "  And 4 and 4? ünïcödé 文字 🙂\n"}, {"role": "assistant", "content": "It is 8.\n"}
CONVERSATIONS = {"single": [SYSTEM, U1, A1], "multi": [SYSTEM, U1, A1, U2, A2], "no system": [U1, A1, U2, A2]}
PROMPTS = {"prompt": [U1], "system prompt": [SYSTEM, U1], "multi prompt": [SYSTEM, U1, A1, U2]}
ALTERNATING = ("mistral",)  # refuses a system message

CORPUS = ["You are terse. Add 2 and 3. And 4 and 4? It is 8. The answer is 5.", "ünïcödé 文字 🙂 [INST] [/INST] <|user|>",
          "def add(a, b):\n    return a + b\n" * 3, "the quick brown fox jumps over the lazy dog " * 4]


@pytest.fixture(scope="module")
def base_bpe():
    """A small byte-level BPE (JSON text), to which each folder adds its template's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return tok.to_str()


def make_folder(path, base_bpe, name, config_extra=None, jinja_file=False):
    """A Hugging Face tokenizer folder for FOLDERS[name]: tokenizer.json (the BPE, its special tokens, Llama 3's bos
    post-processor where it has one) and tokenizer_config.json (the template, the named special tokens)."""
    from tokenizers import Tokenizer, processors
    template, specials, named, bos_first, *_ = FOLDERS[name]
    tok = Tokenizer.from_str(base_bpe)
    tok.add_special_tokens(specials)
    if bos_first:
        bos = named["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", **named, **(config_extra or {}))
    if jinja_file:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config.setdefault("chat_template", template)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def ours(path):
    """The run's tokenizer of a folder: --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH."""
    return tokenizer_files.megatron_tokenizer(argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path),
                                                      vocab_file=None, merge_file=None, vocab_size=None))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, base_bpe):
    """name -> (our tokenizer: tokenizer_files.megatron_tokenizer --tokenizer-type HuggingFaceTokenizer, transformers')."""
    out = {}
    for name in FOLDERS:
        path = make_folder(tmp_path_factory.mktemp(name), base_bpe, name, jinja_file=name == "qwen25")
        out[name] = ours(path), transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return out


def conversations(name):
    return {k: c for k, c in CONVERSATIONS.items() if not (name in ALTERNATING and c[0]["role"] == "system")}


def prompts(name):
    return {k: c for k, c in PROMPTS.items() if not (name in ALTERNATING and c[0]["role"] == "system")}


def ref_ids(ref, messages, **kw):
    return list(ref.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


# ------------------------------------------------------------------------------------------ text and token ids
def check_texts(render, ref, name):
    """render(messages, add_generation_prompt) equals transformers' text for every conversation and prompt."""
    for msgs in conversations(name).values():
        assert render(msgs, False) == ref.apply_chat_template(msgs, tokenize=False)
    for msgs in prompts(name).values():
        assert render(msgs, True) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name", FOLDERS)
def test_rendered_text_and_ids_equal_transformers(folders, name):
    tok, ref = folders[name]
    roles = tokenizer_files.roles_of(tok)
    assert roles.chat_template == FOLDERS[name][0] and roles.chat_tokens == FOLDERS[name][2]
    check_texts(lambda m, g: tokenizer_files.apply_chat_template(tok, m, g), ref, name)
    for msgs in conversations(name).values():
        ids, mask = PT.encode_chat(msgs, tok, tokenizer_files.special_ids(tok)["eod"])
        assert ids == ref_ids(ref, msgs) and len(mask) == len(ids)
    for msgs in prompts(name).values():  # tools.py sample --chat's prompt
        assert PT.chat_prompt_ids(msgs, tok) == ref_ids(ref, msgs, add_generation_prompt=True)


def test_negative_controls_trim_blocks_and_bos(folders):
    """The equality above fails when trim_blocks is off (Zephyr's tags then leave their line breaks) and when the
    template's bos_token is not the folder's (Llama 3's starts with it)."""
    _, ref = folders["zephyr"]
    loose = jinja2.sandbox.ImmutableSandboxedEnvironment(lstrip_blocks=True).from_string(ZEPHYR)
    tokens = FOLDERS["zephyr"][2]
    with pytest.raises(AssertionError):
        check_texts(lambda m, g: loose.render(messages=m, add_generation_prompt=g, **tokens), ref, "zephyr")
    check_texts(lambda m, g: tokenizer_files.render_chat_template(ZEPHYR, m, g, **tokens), ref, "zephyr")  # (the control's twin)
    _, ref = folders["llama3"]
    with pytest.raises(AssertionError):
        check_texts(lambda m, g: tokenizer_files.render_chat_template(LLAMA3, m, g, bos_token=""), ref, "llama3")


def test_negative_control_post_processor_ids(folders):
    """Encoding the rendered text with the folder's post-processor (add_special_tokens=True) doubles Llama 3's bos:
    not transformers' ids."""
    tok, ref = folders["llama3"]
    msgs = CONVERSATIONS["single"]
    with pytest.raises(AssertionError):
        assert tok.encode(tokenizer_files.apply_chat_template(tok, msgs)).ids == ref_ids(ref, msgs)


# ------------------------------------------------------------------------------------------------ the loss mask
def independent_mask(ref, text, start, end, with_end=True):
    """The tokens (transformers' char_to_token) of each span from the end of an assistant header `start` to the end
    of the next end-of-turn text `end` (with_end=False: to its start): the loss mask found without our code."""
    enc = ref(text, add_special_tokens=False)
    mask = [0] * len(enc["input_ids"])
    for m in re.finditer(re.escape(start), text):
        stop = text.index(end, m.end()) + (len(end) if with_end else 0)
        for c in range(m.end(), stop):
            mask[enc.char_to_token(c)] = 1
    return mask


@pytest.mark.parametrize("name", FOLDERS)
def test_sft_mask_covers_exactly_the_assistant_turns(folders, name):
    tok, ref = folders[name]
    *_, start, end = FOLDERS[name]
    for msgs in conversations(name).values():
        ids, mask = PT.template_ids(msgs, tok)
        text = ref.apply_chat_template(msgs, tokenize=False)
        assert mask == independent_mask(ref, text, start, end)
        answers = [m["content"].strip() if name.startswith("llama3") else m["content"] for m in msgs
                   if m["role"] == "assistant"]
        assert tok.decode([i for i, k in zip(ids, mask) if k], skip_special_tokens=False) == "".join(
            a + end for a in answers)  # (the decoded loss tokens: each answer, then its end-of-turn text)
        wrong = independent_mask(ref, text, start, end, with_end=False)  # without the end-of-turn token
        with pytest.raises(AssertionError):  # negative control: a mask that stops before the end-of-turn token
            assert mask == wrong


def test_mask_equals_transformers_generation_mask(folders):
    """For the template with {% generation %} tags, transformers' return_assistant_tokens_mask is the same mask."""
    tok, ref = folders["llama3_generation"]
    for msgs in CONVERSATIONS.values():
        out = ref.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = PT.template_ids(msgs, tok)
        assert (ids, mask) == (list(out["input_ids"]), list(out["assistant_masks"]))
        assert sum(mask) > 0


# --------------------------------------------------------------------------------------- through the data path
def test_dpo_and_sft_samples_from_a_file_have_transformers_ids(folders, tmp_path):
    tok, ref = folders["qwen25"]
    eod, S = tokenizer_files.special_ids(tok)["eod"], 96
    prefs = [{"prompt": f"Add {i} and 3.", "chosen": f"{i + 3}", "rejected": f"It is {i}."} for i in range(4)]
    sft = [{"messages": CONVERSATIONS["multi"]}, {"prompt": "Add 1 and 1.", "response": "2"}]
    for task, records in (("dpo", prefs), ("sft", sft)):
        path = tmp_path / f"{task}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        args = argparse.Namespace(task=task, data_path=str(path), seq_length=S, seed=0, valid_fraction=0.0,
                                  packing=False)
        train, _ = PT.build_task_datasets(args, tok)
        got = sorted(train.samples[:, :-1].tolist())
        want = []
        for r in records:
            sides = [PT._messages(r, k) for k in ("chosen", "rejected")] if task == "dpo" else [PT._messages(r)]
            rows = []
            for msgs in sides:
                ids = ref_ids(ref, msgs)
                _, mask = PT.template_ids(msgs, tok)
                rows += [ids + [eod] * (S + 1 - len(ids)), mask + [0] * (S + 1 - len(ids))]
            want.append(rows)
        assert got == sorted(want)


def test_example_records_fit_through_the_template(folders):
    """Without --data-path: example_records counts each candidate through the folder's template (Qwen2.5's adds a
    default system prompt), so every record it keeps makes a sample of at most s + 1 tokens, and some are kept."""
    tok, ref = folders["qwen25"]
    files = tuple(f for f in data.default_corpus_files() if f.rsplit("/", 1)[-1] in ("colorsys.py", "bisect.py"))
    eod, S = tokenizer_files.special_ids(tok)["eod"], 1536  # (a 400-token BPE: about a token a character)
    for task in ("sft", "dpo"):
        records = PT.example_records(task, tok, S, 0, files)
        assert records
        for r in records:  # (make_sample refuses a sample longer than S + 1)
            smp = PT.make_sample(r, task, tok, S, eod, r["_where"])
            n = int(smp[1].nonzero()[0].max()) + 1
            assert smp[0, :n].tolist() == ref_ids(ref, PT._messages(r, "chosen" if task == "dpo" else "response"))
    lengths = {r["prompt"]: len(ref_ids(ref, PT._messages(r))) for r in PT.example_records("sft", tok, S, 0, files)}
    tight = max(lengths.values()) - 2  # the longest no longer fits (its length > tight + 1), the others do
    kept = {r["prompt"] for r in PT.example_records("sft", tok, tight, 0, files)}
    assert kept == {p for p, n in lengths.items() if n <= tight + 1} and 0 < len(kept) < len(lengths)


def test_packing_needs_samples_that_end_with_their_only_eod(folders, tmp_path, base_bpe):
    """Mistral writes eos after the answer only: its samples pack. Llama 3 ends every turn with its eos <|eot_id|>,
    and a Mistral whose eos is followed by a space ends the sample after it: the packed attention mask resets at
    every eod, so both are refused."""
    spaced = make_folder(tmp_path / "spaced", base_bpe, "mistral",
                         config_extra={"chat_template": MISTRAL.replace("eos_token}}", "eos_token + ' ' }}")})
    for tok, ok in ((folders["mistral"][0], True), (folders["llama3"][0], False), (ours(spaced), False)):
        eod = tokenizer_files.special_ids(tok)["eod"]
        smp = np.stack([PT.make_sample({"prompt": "Add 2 and 3.", "response": "5"}, "sft", tok, 64, eod, f"f:{i}")
                        for i in range(2)])
        if ok:
            packed = PT.pack_sft(smp, 64, eod, ["f:0", "f:1"])
            n = [int(s[1].nonzero()[0].max()) + 1 for s in smp]
            assert packed.shape == (1, 3, 65) and packed[0, 0, :sum(n)].tolist() == smp[0, 0, :n[0]].tolist() + \
                smp[1, 0, :n[1]].tolist()
        else:
            with pytest.raises(data.DataError, match="f:0: --packing needs one assistant turn per conversation, and the "
                                                     "sample's only eod token at its end"):
                PT.pack_sft(smp, 64, eod, ["f:0", "f:1"])


def test_template_survives_save_and_reload(folders, tmp_path):
    tok, ref = folders["llama3"]
    tokenizer_files.save_tokenizer(tok, tmp_path / "tokenizer.json")  # as train.py saves a run's tokenizer
    again = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert tokenizer_files.roles_of(again) == tokenizer_files.roles_of(tok)
    msgs = CONVERSATIONS["multi"]
    assert PT.encode_chat(msgs, again, tokenizer_files.special_ids(again)["eod"])[0] == ref_ids(ref, msgs)


def test_export_tokenizer_config_renders_the_same(folders, tmp_path):
    """tools.py export writes the run's own template with the folder's named tokens (convert.hf_tokenizer_config):
    transformers renders the exported folder as the original; generation_config's eos lists the stop ids."""
    for name in ("llama3", "qwen25"):
        tok, ref = folders[name]
        out = tmp_path / name
        out.mkdir()
        tok.save(str(out / "tokenizer.json"))
        config = convert.hf_tokenizer_config(tok, 128, tokenizer_files.roles_of(tok).chat_template)
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        exported = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        for msgs in conversations(name).values():
            assert exported.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)
    assert convert.hf_token_ids(folders["llama3"][0])["bos_token_id"] == folders["llama3"][1].bos_token_id


def test_chat_stop_ids(folders):
    """sample --chat stops at eod and at the token the template writes after an answer, when that is another one."""
    ids = {name: [tok.id_to_token(i) for i in tokenizer_files.chat_stop_ids(tok)] for name, (tok, _) in folders.items()}
    assert ids == {"llama3": ["<|eot_id|>"], "qwen25": ["<|endoftext|>", "<|im_end|>"], "mistral": ["</s>"],
                   "zephyr": ["</s>"], "llama3_generation": ["<|eot_id|>"]}


def test_generate_stops_at_any_stop_id():
    """gpt.generate with a list of stop ids ends at the first one sampled (greedy on fixed logits)."""
    model = types.SimpleNamespace(training=False, eval=lambda: None, train=lambda mode: None,
                                  config=types.SimpleNamespace(max_position_embeddings=64))
    order = iter([3, 7, 5, 9])
    logits = lambda ids: torch.nn.functional.one_hot(torch.tensor([next(order)]), 10).double() * 10  # noqa: E731
    out = gpt.generate(model, torch.tensor([[1]]), 10, 0.0, eod=[5, 7], next_logits=logits)
    assert out.tolist() == [[1, 3, 7]]


# ----------------------------------------------------------------------------------------------------- refusals
def test_refusals(folders, tmp_path, base_bpe):
    tok, _ = folders["llama3"]
    with pytest.raises(data.DataError, match=r"x:1: messages\[1\]\['content'\] holds the special token '<\|eot_id\|>'"):
        PT.template_ids([U1, {"role": "assistant", "content": "5<|eot_id|>"}], tok, "x:1")
    tok, _ = folders["mistral"]
    with pytest.raises(data.DataError, match="refuses the conversation: Conversation roles must alternate"):
        PT.template_ids(CONVERSATIONS["single"], tok)
    last = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} <end>{% endif %}\n{% endfor %}"
    rewrites = make_folder(tmp_path / "rewrites", base_bpe, "zephyr", config_extra={"chat_template": last})
    with pytest.raises(data.DataError, match=r"y:2: the chat template.s render of messages\[:1\] with "
                       r"add_generation_prompt is not a prefix of its render of the whole conversation \(it rewrites"):
        PT.template_ids(CONVERSATIONS["no system"], tokenizer_files.folder_tokenizer(rewrites), "y:2")
    listed = make_folder(tmp_path / "listed", base_bpe, "zephyr",
                         config_extra={"chat_template": [{"name": "tool_use", "template": ZEPHYR}]})
    with pytest.raises(data.DataError, match=r"chat templates \['tool_use'\] have none named 'default'"):
        tokenizer_files.folder_tokenizer(listed)
    named = make_folder(tmp_path / "named", base_bpe, "zephyr",
                        config_extra={"chat_template": [{"name": "default", "template": ZEPHYR}]})
    assert tokenizer_files.roles_of(tokenizer_files.folder_tokenizer(named)).chat_template == ZEPHYR


# ------------------------------------------------------------------------------------ a run, sample --chat, export
def test_sft_run_samples_and_exports_with_the_folders_template(tmp_path, base_bpe, capsys):
    """train.py --task sft on a folder with Qwen2.5's template (2 iterations, tiny), then: the run's saved tokenizer
    keeps the template; sample --chat prompts with transformers' ids and stops at a stop id or the limit; export
    writes the template, the folder's named tokens and both stop ids (generation_config's eos_token_id), and the
    exported folder's apply_chat_template gives the --chat prompt's ids."""
    import checkpoint
    import tools
    import train
    folder = make_folder(tmp_path / "qwen", base_bpe, "qwen25")
    records = [{"prompt": f"Add {i} and {j}.", "response": f"It is {i + j}."} for i in range(4) for j in range(4)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = tmp_path / "run"
    train.main(["--task", "sft", "--data-path", str(path), "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", str(folder), "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                "2", "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2",
                "--lr", "1e-3", "--log-interval", "100", "--eval-iters", "0", "--data-cache-dir", str(tmp_path / "c"),
                "--save", str(run)])
    loaded = checkpoint.load_model(run)
    assert tokenizer_files.roles_of(loaded.tok).chat_template == QWEN25
    ref = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    prompt = [{"role": "user", "content": "Add 2 and 3."}]
    stops = tokenizer_files.chat_stop_ids(loaded.tok)
    answer = tools.chat_answer(loaded, prompt[0]["content"], 5, temperature=0)
    assert answer[-1] in stops or (len(answer) == 5 and not set(answer) & set(stops))
    tools.main(["export", "--load", str(run), "--hf-out", str(tmp_path / "hf")])
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert exported.chat_template == QWEN25
    assert ref_ids(exported, prompt, add_generation_prompt=True) == ref_ids(ref, prompt, add_generation_prompt=True) \
        == PT.chat_prompt_ids(prompt, loaded.tok)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == stops == [ref.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
