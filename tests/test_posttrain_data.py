"""posttraining/recipes.py section 1, the task data: chat template, records, samples (the SAMPLE FORMAT), SFT packing, the
epoch-shuffled TaskDataset, the generated example records and build_task_datasets.

  - the chat template renders the module docstring's 2-turn example exactly, and the loss mask covers exactly the
    assistant's tokens and each turn's eod;
  - every task's sample has its R rows, eod right-padding, the META row last; a too-long sample is refused, never
    truncated; each malformed record is refused with a one-line "FILE:LINE: ..." error;
  - a packed SFT row, through data.get_ltor_masks_and_position_ids(reset_position_ids, reset_attention_mask), gives
    each of its samples exactly the per-token losses it has alone (tiny gpt.Model, float64, 1e-12 relative: masked
    keys add exact zeros to the softmax sums, so the two differ only in the order of reductions); without the reset
    attention mask the comparison fails (the negative control);
  - example_records is deterministic, its samples fit, DPO's rejected answers mix shuffled lines and other bodies,
    KTO's labels are balanced and its kl rows hold the next record's completion;
  - without --data-path the example samples are cached in --data-cache-dir: the second build reads them (the
    generator is not called) and equals a fresh build exactly; another --seq-length rebuilds; a damaged cache file is
    refused with one line naming it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import gpt
from equivalence import rel_err
from interop import tokenizer_files
from posttraining import recipes as PT

MODULES = ("textwrap", "shlex", "colorsys", "bisect", "heapq", "fnmatch", "posixpath", "genericpath", "ntpath",
           "calendar", "_pydecimal", "fractions", "datetime", "ipaddress", "inspect")  # ~530 documented functions
FILES = tuple(f for f in data.default_corpus_files() if f.rsplit("/", 1)[-1][:-3] in MODULES)
S = 128  # --seq-length in these tests (the default)


@pytest.fixture(scope="module")
def tok():
    return tokenizer_files.get_tokenizer([open(f, encoding="utf-8").read() for f in FILES], None, vocab_size=1024)


@pytest.fixture(scope="module")
def eod(tok):
    return tokenizer_files.special_ids(tok)["eod"]


TWO_TURNS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Add 2 and 3."},
             {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 and 4?"},
             {"role": "assistant", "content": "8"}]


def decode(tok, ids):
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


# --------------------------------------------------------------------------------------- template and samples
def test_chat_template_renders_the_docstring_example(tok, eod):
    pieces = PT.render_chat(TWO_TURNS)
    text = "".join(t for t, _ in pieces)
    comment = "\n".join(line[2:] for line in Path(PT.__file__).read_text().splitlines() if line.startswith("#"))
    block = comment.split("exactly on the assistant's tokens. A 2-turn conversation renders as")[1]  # section 1's
    documented = "\n".join(line[4:] for line in block.split("\n\n")[1].split("\n"))
    assert text == documented and text.endswith("8<|endoftext|>")  # the documented rendering, exactly
    assert "".join(t for t, a in pieces if a) == "5<|endoftext|>8<|endoftext|>"
    smp = PT.make_sample({"messages": TWO_TURNS}, "sft", tok, S, eod, "x:1")
    assert smp.dtype == np.int64 and smp.shape == (3, S + 1)
    tokens, mask, meta = smp
    assert decode(tok, tokens[mask == 1]) == "5<|endoftext|>8<|endoftext|>"
    n = int(np.nonzero(mask)[0].max()) + 1  # the sample ends with the last turn's eod
    assert decode(tok, tokens[:n]) == text and (tokens[n:] == eod).all() and (mask[n:] == 0).all()
    assert not meta.any()


def test_special_token_text_in_a_record_is_plain_text(tok, eod):
    smp = PT.make_sample({"prompt": "say <|endoftext|>", "response": "<|endoftext|>!"}, "sft", tok, S, eod, "x:1")
    n = int(np.nonzero(smp[1])[0].max()) + 1
    assert int((smp[0, :n] == eod).sum()) == 1  # only the template's eod is an eod


@pytest.mark.parametrize("task", ["dpo", "rm", "kto"])
def test_sample_rows_per_task(tok, eod, task):
    rec = {"prompt": "Add 2 and 3.", "chosen": "5", "rejected": "six", "completion": "five", "label": True,
           "kl_completion": "seven"}
    tokens, mask, tokens2, mask2, meta = PT.make_sample(rec, task, tok, S, eod, "x:1")
    answers = ("5", "six") if task != "kto" else ("five", "seven")
    for t, m, answer in [(tokens, mask, answers[0]), (tokens2, mask2, answers[1])]:
        assert decode(tok, t[m == 1]) == answer + "<|endoftext|>"
        assert decode(tok, t[:int(np.nonzero(m)[0].max()) + 1]).startswith("<|user|>\nAdd 2 and 3.\n<|assistant|>\n")
    assert meta[0] == (task == "kto") and not meta[1:].any()


def test_too_long_sample_is_refused_not_truncated(tok, eod):
    with pytest.raises(data.DataError, match=r"^f.jsonl:7: \d+ tokens, longer than --seq-length \+ 1 = 17: samples "
                                             r"are never truncated .* shorten it or raise --seq-length$"):
        PT.make_sample({"prompt": "hello " * 20, "response": "ok"}, "sft", tok, 16, eod, "f.jsonl:7")


BAD = [  # (task, line, the error after "FILE:2: ")
    ("sft", '{"prompt": "a", "response": "b"', "malformed JSON"),
    ("dpo", '{"prompt": "a", "rejected": "b"}', "missing key 'chosen'"),
    ("rm", '{"prompt": "a", "chosen": 3, "rejected": "b"}', "'chosen' must be a string, got int"),
    ("sft", '{"prompt": "a", "response": ""}', "empty 'response'"),
    ("dpo", '{"prompt": "a", "chosen": "b", "rejected": ""}', "empty 'rejected'"),
    ("kto", '{"prompt": "a", "completion": ""}', "empty 'completion'"),
    ("kto", '{"prompt": "a", "completion": "b", "label": 1}', "'label' must be true or false, got 1"),
    ("kto", '{"prompt": "a", "completion": "b"}', "'label' must be true or false, got null"),
    ("sft", '{"messages": [{"role": "bot", "content": "b"}]}', "messages[0] has role 'bot'"),
    ("sft", '{"messages": [{"role": "user", "content": "b"}]}', "must end with an assistant turn"),
    ("sft", '{"messages": [{"role": "user", "content": 5}]}', "messages[0] needs a string 'content'"),
    ("sft", '["a", "b"]', "a record must be a JSON object, got list"),
]


@pytest.mark.parametrize("task,line,msg", BAD, ids=[b[2][:24] for b in BAD])
def test_bad_record_is_refused_with_file_and_line(tmp_path, task, line, msg):
    good = {"sft": '{"prompt": "a", "response": "b"}', "dpo": '{"prompt": "a", "chosen": "b", "rejected": "c"}',
            "kto": '{"prompt": "a", "completion": "b", "label": false}'}
    path = tmp_path / "f.jsonl"
    path.write_text(good.get(task, good["dpo"]) + "\n" + line + "\n")
    with pytest.raises(data.DataError, match=r"^\S+f\.jsonl:2: ") as e:
        PT.load_records(path, task)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_unreadable_data_path_is_refused(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff"}\n')
    with pytest.raises(data.DataError, match=r"f\.jsonl:2: not UTF-8 text$"):
        PT.load_records(path, "sft")
    with pytest.raises(data.DataError, match="is not a file"):
        PT.load_records(tmp_path, "sft")
    path.write_text("\n\n")
    with pytest.raises(data.DataError, match="f.jsonl: no records$"):
        PT.load_records(path, "sft")


def test_records_from_a_file(tmp_path, tok, eod):
    lines = [{"prompt": f"q{i}", "completion": f"answer {i}", "label": i % 2 == 0} for i in range(5)]
    path = tmp_path / "kto.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in lines[2:]))
    recs = PT.load_records(path, "kto")
    assert [r["_where"] for r in recs] == [f"{path}:{n}" for n in (1, 2, 4, 5, 6)]  # blank line 3 skipped
    args = argparse.Namespace(task="kto", data_path=str(path), seq_length=S, seed=3, valid_fraction=0.2, packing=False)
    train, valid = PT.build_task_datasets(args, tok)
    assert (len(train), len(valid), train.num_rows) == (4, 1, 5)
    got = {decode(tok, s[0][s[1] == 1]): (decode(tok, s[2][s[3] == 1]), int(s[4, 0]))
           for s in [train[i] for i in range(4)] + [valid[0]]}
    for i, r in enumerate(lines):  # kl row: the NEXT record's completion, in file order, across the split
        assert got[r["completion"] + "<|endoftext|>"] == (lines[(i + 1) % 5]["completion"] + "<|endoftext|>", i % 2 == 0)


# --------------------------------------------------------------------------------------- the dataset
def test_task_dataset_shuffles_per_epoch_like_gpt_dataset():
    samples = np.arange(7 * 3 * 5).reshape(7, 3, 5)
    ds = PT.TaskDataset(samples, seed=11)
    assert len(ds) == 7 and ds.num_rows == 3 and ds[0].dtype == np.int64
    for epoch in range(2):  # each epoch a permutation seeded by seed + epoch, as data.GPTDataset
        perm = np.random.default_rng(11 + epoch).permutation(7)
        assert all(np.array_equal(ds[7 * epoch + j], samples[perm[j]]) for j in range(7))
    batch = data.global_batch(ds, start=3 * 4, size=4)  # epochs 1 and 2
    assert batch.shape == (4, 3, 5) and batch.dtype == torch.int64


# --------------------------------------------------------------------------------------- SFT packing
def packed_row(tok, eod):
    recs = [{"prompt": "Add 2 and 3.", "response": "5"}, {"prompt": "Name a colour.", "response": "Red, or blue."},
            {"prompt": "Say hi", "response": "hi there"}, {"prompt": "x" * 40, "response": "too long to fit: next row"}]
    samples = np.stack([PT.make_sample(r, "sft", tok, S, eod, f"f:{i}") for i, r in enumerate(recs)])
    packed = PT.pack_sft(samples, S, eod, [f"f:{i}" for i in range(4)])
    assert packed.shape == (2, 3, S + 1) and packed.dtype == np.int64
    lengths = [int(np.nonzero(s[1])[0].max()) + 1 for s in samples]
    assert sum(lengths[:3]) <= S + 1 < sum(lengths)  # greedy, in order: three fit, the fourth opens row 2
    assert np.array_equal(packed[1, :2, :lengths[3]], samples[3, :2, :lengths[3]]) and not packed[:, 2].any()
    return packed[0], samples[:3], lengths[:3]


@pytest.mark.parametrize("reset_attention_mask", [True, False], ids=["isolated", "negative-control"])
def test_packed_samples_equal_samples_alone(tok, eod, reset_attention_mask):
    torch.manual_seed(0)
    model = gpt.Model(gpt.Config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                 vocab_size=tok.get_vocab_size(), max_position_embeddings=S, hidden_dropout=0.0,
                                 attention_dropout=0.0, params_dtype=torch.float64))
    row, samples, lengths = packed_row(tok, eod)
    tokens, mask = torch.from_numpy(row[0])[None], torch.from_numpy(row[1])[None]
    attn, _, pos = data.get_ltor_masks_and_position_ids(tokens[:, :-1], eod, reset_position_ids=True,
                                                        reset_attention_mask=reset_attention_mask)
    with torch.no_grad():
        packed = model(tokens[:, :-1], tokens[:, 1:], position_ids=pos, mask=attn)[0] * mask[0, 1:]  # [s]
        alone, a = torch.zeros_like(packed), 0
        for smp, n in zip(samples, lengths):
            t, m = torch.from_numpy(smp[0, :n])[None], torch.from_numpy(smp[1, :n])
            alone[a:a + n - 1] = model(t[:, :-1], t[:, 1:])[0] * m[1:]
            a += n
    assert int(mask[0, 1:].sum()) == sum(int(s[1].sum()) for s in samples)  # every response token, once
    err = rel_err(packed, alone)
    if reset_attention_mask:
        assert err <= 1e-12, f"packed vs alone: {err:.3e}"  # measured 1.2e-16
    else:
        assert err > 1e-6, f"the plain causal mask went unnoticed ({err:.3e})"  # measured 1.0e-3


def test_packing_refuses_a_multi_turn_conversation(tok, eod):
    smp = PT.make_sample({"messages": TWO_TURNS}, "sft", tok, S, eod, "f:3")
    with pytest.raises(data.DataError, match="^f:3: --packing needs one assistant turn per conversation"):
        PT.pack_sft(smp[None], S, eod, ["f:3"])


# --------------------------------------------------------------------------------------- example records
def test_example_records(tok, eod):
    recs = {t: PT.example_records(t, tok, S, seed=5, files=FILES) for t in PT.TASKS}
    assert recs["sft"] == PT.example_records("sft", tok, S, seed=5, files=FILES)  # deterministic
    assert min(len(r) for r in recs.values()) >= 30, {t: len(r) for t, r in recs.items()}
    for task, rs in recs.items():
        if task == "kto":
            rs = [{**r, "kl_completion": rs[(i + 1) % len(rs)]["completion"]} for i, r in enumerate(rs)]
        for r in rs:  # every sample fits (make_sample raises otherwise)
            assert r["prompt"].startswith(PT.INSTRUCTION + "def ") or r["prompt"].startswith(PT.INSTRUCTION + "async")
            PT.make_sample(r, task, tok, S, eod, r["_where"])
    dpo = recs["dpo"]
    shuffled = sum(sorted(r["chosen"].split("\n")) == sorted(r["rejected"].split("\n")) for r in dpo)
    assert 0.2 * len(dpo) < shuffled < 0.8 * len(dpo) and all(r["chosen"] != r["rejected"] for r in dpo)
    labels = [r["label"] for r in recs["kto"]]
    assert abs(2 * sum(labels) - len(labels)) <= 2


def test_build_packed_sft_from_a_file(tmp_path, tok, eod):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(40)))
    args = argparse.Namespace(task="sft", data_path=str(path), seq_length=S, seed=5, valid_fraction=0.1, packing=False)
    plain = PT.build_task_datasets(args, tok)
    packed = PT.build_task_datasets(argparse.Namespace(**{**vars(args), "packing": True}), tok)
    assert (len(plain[0]), len(plain[1])) == (38, 2) and len(packed[0]) < 38 // 4 and len(packed[1]) == 1  # by prompt
    for p, q in zip(plain, packed):  # the same response tokens, in the split's order
        got = np.concatenate([q.samples[i, 0][q.samples[i, 1] == 1] for i in range(len(q))])
        assert np.array_equal(got, np.concatenate([s[0][s[1] == 1] for s in p.samples]))


@pytest.mark.parametrize("task", PT.TASKS)
def test_build_from_example_records(monkeypatch, tmp_path, tok, task):
    """Without --data-path: the generated example records (here from FILES instead of the whole stdlib), built once
    and then read from the cache."""
    monkeypatch.setattr(data, "default_corpus_files", lambda: list(FILES))
    args = argparse.Namespace(task=task, data_path=None, seq_length=S, seed=5, valid_fraction=0.05, packing=False,
                              data_cache_dir=str(tmp_path))
    train, valid = PT.build_task_datasets(args, tok)
    records = PT.example_records(task, tok, S, seed=5, files=FILES)
    n = len(records)
    assert len(train) + len(valid) == n and train.num_rows == PT.ROWS[task] and 0 < len(valid) < 0.15 * n  # ~5 % by prompt
    assert data.global_batch(train, start=0, size=8).shape == (8, PT.ROWS[task], S + 1)
    fresh = PT._samples(records, task, tok, S, eod=tokenizer_files.special_ids(tok)["eod"])  # [N, R, s+1], no cache
    assert len(list(tmp_path.glob("examples-*.npy"))) == 1
    monkeypatch.setattr(PT, "example_records", lambda *a, **k: pytest.fail("the cache was not used"))
    cached = PT.example_samples(args, tok, tokenizer_files.special_ids(tok)["eod"])
    assert cached.dtype == np.int64 and np.array_equal(cached, fresh)  # exactly a fresh build
    train2, valid2 = PT.build_task_datasets(args, tok)
    assert np.array_equal(train2.samples, train.samples) and np.array_equal(valid2.samples, valid.samples)


def test_example_samples_cache_key_and_damage(monkeypatch, tmp_path, tok, eod):
    monkeypatch.setattr(data, "default_corpus_files", lambda: list(FILES))
    calls, generate = [], PT.example_records
    monkeypatch.setattr(PT, "example_records", lambda *a, **k: calls.append(a[2]) or generate(*a, **k))
    args = argparse.Namespace(task="sft", seq_length=S, seed=5, data_cache_dir=str(tmp_path))
    first = PT.example_samples(args, tok, eod)
    assert np.array_equal(PT.example_samples(args, tok, eod), first) and calls == [S]
    other = PT.example_samples(argparse.Namespace(**{**vars(args), "seq_length": S // 2}), tok, eod)
    assert calls == [S, S // 2] and other.shape[2] == S // 2 + 1  # another --seq-length: another key, a rebuild
    assert len(other) < len(first) and np.array_equal(PT.example_samples(args, tok, eod), first)
    path = next(p for p in tmp_path.glob("examples-sft-*.npy") if f"-s{S}-" in p.name)
    path.write_bytes(path.read_bytes()[:1000])  # a cut-off file (the cache itself is written atomically)
    with pytest.raises(data.DataError, match=f"^{path}: a damaged example-samples cache .*delete it to rebuild$"):
        PT.example_samples(args, tok, eod)


def test_split_by_prompt_holds_out_the_same_prompts_in_every_task(tok, eod):
    """SFT and DPO records of the same prompts, in opposite orders, hold out the same prompts (an SFT run never trains
    on a prompt the DPO stage validates on); a split by position (data.split_documents) would not."""
    prompts = [f"Write f{i}." for i in range(60)]
    sft = [{"prompt": p, "response": f"return {i}", "_where": "x"} for i, p in enumerate(prompts)]
    dpo = [{"prompt": p, "chosen": "return 1", "rejected": "pass", "_where": "x"} for p in reversed(prompts)]
    held = []
    for records, task in ((sft, "sft"), (dpo, "dpo")):
        _, valid = PT.split_by_prompt(PT._samples(records, task, tok, S, eod), 0.2)
        held.append({records[i]["prompt"] for i in valid})
    assert held[0] == held[1] and 0 < len(held[0]) < len(prompts)
    by_position = [{records[i]["prompt"] for i in data.split_documents(60, 0.2, 5)[1]} for records in (sft, dpo)]
    assert by_position[0] != by_position[1]  # the negative control: what a split by position would hold out
