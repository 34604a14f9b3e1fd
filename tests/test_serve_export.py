"""tools.py export writes a Hugging Face directory that is ready to serve, and it serves what tools.py sample --chat
does: a tiny Llama-style GPT (train.py's defaults: RoPE, RMSNorm, SwiGLU) fine-tuned (--task sft, from scratch, a few
iterations) on short chat records, exported and loaded back offline with transformers' Auto classes.

  - the special tokens: eos (config.json, generation_config.json, the tokenizer) is our end-of-document token, pad is
    <pad>, bos is the eod token too (convert.hf_token_ids says why), and the tokenizer adds none of them to a text;
  - the chat template: `apply_chat_template(messages, tokenize=False)` is exactly the text of recipes.render_chat's
    pieces, for several conversations, with and without add_generation_prompt; a template without the "\\n" after a
    user's content is caught by the same comparison (negative control);
  - `apply_chat_template([user turn], add_generation_prompt=True)` gives the token ids --chat feeds the model;
  - HF's greedy `generate` from those ids gives exactly the token ids of our `sample --chat --temperature 0`, stopping
    at the same eos;
  - --chat is refused in one line for a model that cannot sample (BERT) and for a reward model;
  - a GPT-2 directory gets the same files (its longest input is n_positions, Llama's max_position_embeddings).

Where the two tokenizations differ. Training (recipes._encode) tokenizes the template piece by piece: the header
"<|user|>\\n", then the content with its "\\n", then "<|assistant|>\\n"; transformers renders the whole string, then
tokenizes it once. The byte-level BPE's pre-tokenizer splits text into words and runs of whitespace before merging,
so the two agree when a piece boundary is also a word boundary, which is the case for a content without leading or
trailing whitespace. A content that starts with whitespace (an indented line) lets the whole string merge the
header's "\\n" with the indentation ("\\n   " is one token of this vocabulary), which the pieces never do; one that
ends with whitespace can likewise merge with the "\\n" after it in a vocabulary that has such a merge (this tiny one
has none, so only the leading case is shown). And special-token text inside a message ("<|endoftext|>") is plain text
in training (so only the template's eod is ever an eod) but the special token in transformers, unless
apply_chat_template(..., sanitize_control_tokens=True). Both are asserted below as documented differences.

Tolerance: the exported model's logits match ours to 1e-5 relative (float32, the same ops in another order, as
tests/test_export.py; measured bit-equal here), and every greedy step's top-2 logit gap is more than 10x the largest
logit difference, so no near tie can flip the argmax between the two: the token-for-token equality is not luck.
--chat on the other causal LM (mamba.py's sample_ids, its recurrent step) is checked against gpt.generate's
recompute oracle.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import checkpoint
import gpt
import mamba
import tools
import train
from equivalence import rel_err
from harness import SNIPPET
from interop import convert, tokenizer_files
from posttraining import recipes

SYSTEM, USER, ANSWER = ({"role": r, "content": c} for r, c in [("system", "You add."), ("user", "3 + 4"),
                                                               ("assistant", "7")])
CONVERSATIONS = {  # name -> messages; each is rendered with and without the generation prompt
    "system, user, assistant": [SYSTEM, USER, ANSWER],
    "two turns": [USER, ANSWER, {"role": "user", "content": "5 + 1"}, {"role": "assistant", "content": "6"}],
    "one user turn": [USER],
    "system, a turn, then a user": [SYSTEM, USER, ANSWER, {"role": "user", "content": "2 + 2"}],
}
PROMPTS = ["3 + 4", "6 + 1"]  # --chat prompts without leading or trailing whitespace
MAX_NEW = 12  # the prompt (28 tokens) and the answer stay within 48 positions, where ours slides no window


def tiny(tok_file, save, *extra, iters=1):
    return ["--tokenizer-file", str(tok_file), "--vocab-size", "384", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "48", "--micro-batch-size", "8", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2",
            "--log-interval", "100", "--eval-iters", "0", "--data-cache-dir", str(save.parent / "cache"), "--save",
            str(save), *extra]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An SFT run (30 iterations from scratch on records "i + j" -> "i + j = k"), its export, and the tokenizer file
    they share. The model's answers are not sums yet, but it has learned to end them with eod: answers stop."""
    root = tmp_path_factory.mktemp("serve")
    tok_file = root / "tokenizer.json"
    tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], str(tok_file), 384)
    sums = [{"prompt": f"{i} + {j}", "response": f"{i} + {j} = {i + j}"} for i in range(8) for j in range(8)]
    train.main(tiny(tok_file, root / "sft", "--task", "sft", "--data-path", str(write_jsonl(root / "sft.jsonl", sums)),
                    iters=30))
    tools.main(["export", "--load", str(root / "sft"), "--hf-out", str(root / "hf")])
    return root


@pytest.fixture(scope="module")
def hf(runs):
    """(tokenizer, model) of the exported directory, loaded by transformers' Auto classes without the network."""
    tok = transformers.AutoTokenizer.from_pretrained(runs / "hf", local_files_only=True)
    return tok, transformers.AutoModelForCausalLM.from_pretrained(runs / "hf", local_files_only=True).eval()


def test_the_export_carries_our_special_tokens(runs, hf):
    tok, model = hf
    ours = checkpoint.load_model(runs / "sft").tok
    eod, pad = tokenizer_files.special_ids(ours)["eod"], tokenizer_files.special_ids(ours)["pad"]
    assert {p.name for p in (runs / "hf").iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                        "tokenizer_config.json", "generation_config.json"}
    config = transformers.AutoConfig.from_pretrained(runs / "hf", local_files_only=True)
    for where in (config, model.generation_config):
        assert (where.eos_token_id, where.bos_token_id, where.pad_token_id) == (eod, eod, pad)
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|endoftext|>", "<|endoftext|>", "<pad>")
    assert (tok.eos_token_id, tok.pad_token_id, tok.model_max_length) == (eod, pad, 48)
    text = "def add(a, b):\n    return a + b  # x"
    assert tok(text)["input_ids"] == ours.encode(text).ids  # nothing added: no bos, no eos
    assert tok.decode(ours.encode(text).ids) == ours.decode(ours.encode(text).ids) == text


def template_mismatches(tok, chat_template=None) -> list[str]:
    """Each conversation x add_generation_prompt where transformers' rendering is not the text of render_chat's
    pieces (plus the assistant's header for the generation prompt): 'name: transformers ... != render_chat ...'."""
    bad = []
    for name, messages in CONVERSATIONS.items():
        for prompt in (False, True):
            want = "".join(text for text, _ in recipes.render_chat(messages))
            want += recipes.CHAT_TEMPLATE["assistant"] if prompt else ""
            got = tok.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                          add_generation_prompt=prompt)
            if got != want:
                bad.append(f"{name} (add_generation_prompt={prompt}): transformers {got!r} != render_chat {want!r}")
    return bad


def test_the_chat_template_renders_as_training_does(hf):
    tok, _ = hf
    assert tok.chat_template == recipes.chat_template_jinja()
    assert template_mismatches(tok) == []
    with pytest.raises(Exception, match="unknown role tool"):  # render_chat knows no other roles either
        tok.apply_chat_template([{"role": "tool", "content": "7"}], tokenize=False)


def test_negative_control_a_template_without_the_newline_after_the_user_is_caught(hf):
    tok, _ = hf
    broken = recipes.chat_template_jinja(dict(recipes.CHAT_TEMPLATE, end=""))
    bad = template_mismatches(tok, broken)
    assert len(bad) == 2 * len(CONVERSATIONS), bad  # every conversation has a system or user turn
    assert bad[0] == (r"system, user, assistant (add_generation_prompt=False): transformers "
                      r"'<|system|>\nYou add.<|user|>\n3 + 4<|assistant|>\n7<|endoftext|>' != render_chat "
                      r"'<|system|>\nYou add.\n<|user|>\n3 + 4\n<|assistant|>\n7<|endoftext|>'")


def test_the_generation_prompt_is_the_chat_prompt_our_training_tokenizes(runs, hf):
    tok = hf[0]
    ours = checkpoint.load_model(runs / "sft").tok

    def both(content, **kw):
        messages = [{"role": "user", "content": content}]
        return (recipes.chat_prompt_ids(messages, ours),
                tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kw))
    for content in [*PROMPTS, "def f(a):\n    return a\n", "x = {'a': 1}"]:  # no leading or trailing whitespace
        a, b = both(content)
        assert a == b, content
    # the documented differences: the same text, other tokens
    ids, hf_ids = both("    return a")  # leading indentation: the header's "\n" merges with it in the whole string
    assert ids != hf_ids and ours.decode(ids) == tok.decode(hf_ids)
    assert "\n   " in [ours.id_to_token(i).replace("Ċ", "\n").replace("Ġ", " ") for i in hf_ids]
    ids, hf_ids = both("3 <|endoftext|> 4")  # special-token text: plain text in training, eod in transformers...
    assert tokenizer_files.special_ids(ours)["eod"] in hf_ids and tokenizer_files.special_ids(ours)["eod"] not in ids
    assert both("3 <|endoftext|> 4", sanitize_control_tokens=True) == (ids, ids)  # ...unless sanitized


@pytest.mark.parametrize("prompt", PROMPTS)
def test_hf_greedy_generate_answers_as_sample_chat(runs, hf, prompt, capsys):
    tok, model = hf
    run = checkpoint.load_model(runs / "sft")
    eod = tokenizer_files.special_ids(run.tok)["eod"]
    answer = tools.chat_answer(run, prompt, MAX_NEW, temperature=0)
    assert answer[-1] == eod and len(answer) < MAX_NEW  # it stopped at the eos, not at the limit
    inputs = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                     return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    # the logits of the whole sequence agree, and no greedy step is a near tie
    full = torch.tensor([ids + answer])
    with torch.no_grad():
        got, ref = run.model.eval()(full), model(full).logits
    assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    steps = got[0, len(ids) - 1:-1].double()
    top2 = steps.topk(2, -1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 10 * float((got - ref).abs().max())
    # HF's greedy generate (its generation_config: eos = our eod) gives the same new tokens, stopping there too
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    assert out[0, len(ids):].tolist() == answer
    # and tools.py sample --chat prints that answer, decoded without the eod
    capsys.readouterr()
    text = tools.main(["sample", "--load", str(runs / "sft"), "--chat", "--prompt", prompt, "--temperature", "0",
                       "--max-new-tokens", str(MAX_NEW)])
    assert text == tok.decode(answer, skip_special_tokens=True) == run.tok.decode(answer[:-1])
    assert capsys.readouterr().out == text + "\n"


def one_line_error(argv, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit, match="^2$"):
        tools.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tools.py: error: "), err
    return err[0]


def test_chat_is_refused_for_a_model_that_cannot_sample_and_for_a_reward_model(runs, capsys):
    docs = runs / "docs"
    docs.mkdir()
    for i in range(20):
        (docs / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    prefs = write_jsonl(runs / "prefs.jsonl", [{"prompt": f"{i} + 1", "chosen": str(i + 1), "rejected": "0"}
                                               for i in range(8)])
    tok_file = runs / "tokenizer.json"
    train.main(tiny(tok_file, runs / "bert", "--model", "bert", "--data-path", str(docs)))
    train.main(tiny(tok_file, runs / "rm", "--task", "rm", "--data-path", str(prefs)))
    chat = ["sample", "--chat", "--prompt", "3 + 4", "--load"]
    assert one_line_error(chat + [str(runs / "bert")], capsys) == (
        f"tools.py: error: --load {runs / 'bert'}: a --model bert run cannot answer --chat: its model file declares "
        "no sample_ids() (only a causal language model continues a chat prompt)")
    assert one_line_error(chat + [str(runs / "rm")], capsys) == (
        f"tools.py: error: --load {runs / 'rm'} is a reward model (--task rm): it scores text (tools.py score), it "
        "does not generate or export as a causal LM")


def test_the_other_causal_lm_answers_a_chat_prompt_through_its_recurrent_step(runs):
    """mamba.py's sample_ids (the recurrent step, O(1) per Mamba token) gives the greedy tokens of the whole hybrid's
    forward pass at each step (gpt.generate's recompute oracle) after a --chat prompt."""
    tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(runs / "tokenizer.json"))
    model = mamba.Model(mamba.Config(hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=384,
                                     max_position_embeddings=48, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
                                     mamba_chunk_size=4, init_method_std=0.5, hybrid_layer_pattern="M*-")).eval()
    ids = recipes.chat_prompt_ids([USER], tok)
    got = mamba.sample_ids(model, tok, ids, 8, temperature=0)
    ref = gpt.generate(model, torch.tensor([ids]), 8, temperature=0, eod=tokenizer_files.special_ids(tok)["eod"], use_cache=False)
    assert got == ref[0, len(ids):].tolist() and len(got) == 8


def test_a_gpt2_directory_gets_the_same_serving_files(runs, tmp_path):
    """GPT-2's config names the longest input n_positions (Llama's max_position_embeddings): tokenizer_config.json's
    model_max_length comes from either, and config.json's token ids are ours in both."""
    from test_export import GPT2

    tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(runs / "tokenizer.json"))
    model = gpt.Model(gpt.Config(**dict(GPT2, vocab_size=384)))
    convert.save_hf(tmp_path, *convert.gpt_to_hf(model.config, model.state_dict()), tok,
                    chat_template=recipes.chat_template_jinja())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["eos_token_id"] == tokenizer_files.special_ids(tok)["eod"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert hf_tok.model_max_length == config["n_positions"] == 64 and hf_tok.eos_token == "<|endoftext|>"
