"""Tests for data.py: Megatron's .bin/.idx format byte for byte, the tokenizer, corpus loading, splits,
GPT samples and global batches, the token cache and the preprocess CLI. Small synthetic corpora; fast."""
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import data  # the repo root is on sys.path via tests/conftest.py
from data import (
    DataError,
    GPTDataset,
    IndexedDataset,
    tokenize_documents,
)
from interop import tokenizer_files
from interop.tokenizer_files import get_tokenizer, special_ids

SOURCE = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n",
    "import os\n\nfor i in range(10):\n    print(f'{i}\\t→ ü', os.sep)  # ünïcode\n",
    "while True:\n\tbreak\n# <mask> and <|endoftext|> written as plain text\n",
] * 4


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer(SOURCE, None, vocab_size=400)


# ----------------------------------------------------------------------------- indexed dataset

@pytest.mark.parametrize("vocab_size, dtype", [(1000, np.uint16), (65499, np.uint16), (65500, np.int32)])
def test_indexed_dataset_round_trip(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab_size, size=n) for n in (5, 0, 17, 1, 300)]
    data.write_indexed_dataset(str(tmp_path / "ds"), docs, vocab_size)
    ds = IndexedDataset(str(tmp_path / "ds"))
    assert len(ds) == len(docs) and ds.dtype == dtype
    assert ds.sequence_lengths.tolist() == [5, 0, 17, 1, 300]
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    with pytest.raises(IndexError, match=rf"sequence {len(docs)} out of range \[0, {len(docs)}\)"):
        ds[len(docs)]
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]


@pytest.mark.parametrize("vocab_size, code, fmt", [(100, 8, "H"), (70000, 4, "i")])
def test_idx_bytes_are_megatron_layout(tmp_path, vocab_size, code, fmt):
    data.write_indexed_dataset(str(tmp_path / "ds"), [[1, 2, 3], [4, 5]], vocab_size)
    size = struct.calcsize("<" + fmt)
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", 2)
                + struct.pack("<Q", 3) + struct.pack("<2i", 3, 2) + struct.pack("<2q", 0, 3 * size)
                + struct.pack("<3q", 0, 1, 2))
    assert (tmp_path / "ds.idx").read_bytes() == expected
    assert (tmp_path / "ds.bin").read_bytes() == struct.pack(f"<5{fmt}", 1, 2, 3, 4, 5)


def test_megatron_reads_ours_and_we_read_megatrons(tmp_path):
    mid = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = [np.arange(10, 20), np.array([7]), np.arange(300, 340)]
    data.write_indexed_dataset(str(tmp_path / "ours"), docs, 1000)
    theirs = mid.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == 3 and theirs.document_indices.tolist() == [0, 1, 2, 3]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
    builder = mid.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.from_numpy(d))
        builder.end_document()
    builder.finalize(str(tmp_path / "meg.idx"))
    assert (tmp_path / "meg.idx").read_bytes() == (tmp_path / "ours.idx").read_bytes()
    ours = IndexedDataset(str(tmp_path / "meg"))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ours[i], d)


def _corrupt(kind, idx, bin_):
    raw = idx.read_bytes()
    if kind == "magic":
        idx.write_bytes(b"NOTANIDX\x00" + raw[9:])
    elif kind == "version":
        idx.write_bytes(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    elif kind == "dtype":
        idx.write_bytes(raw[:17] + b"\x09" + raw[18:])
    elif kind == "header":
        idx.write_bytes(raw[:20])
    elif kind == "truncated":
        idx.write_bytes(raw[:-8])
    elif kind == "trailing":
        idx.write_bytes(raw + b"\x00\x00")
    elif kind == "bin_short":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif kind == "pointers":
        idx.write_bytes(raw[:34 + 8] + struct.pack("<q", 4) + raw[34 + 16:])  # 2nd pointer of 2 sequences
    elif kind == "bin_missing":
        bin_.unlink()


@pytest.mark.parametrize("kind, message", [
    ("magic", "bad magic"), ("version", "unsupported version 2"), ("dtype", "unknown dtype code 9"),
    ("header", "truncated header"), ("truncated", "expected"), ("trailing", "expected"),
    ("bin_short", "describes"),
    ("pointers", "pointers do not match"), ("bin_missing", "not found"),
])
def test_malformed_idx_names_file(tmp_path, kind, message):
    data.write_indexed_dataset(str(tmp_path / "ds"), [[1, 2, 3], [4, 5]], 100)
    _corrupt(kind, tmp_path / "ds.idx", tmp_path / "ds.bin")
    with pytest.raises(DataError, match=message) as e:
        IndexedDataset(str(tmp_path / "ds"))
    assert str(tmp_path / "ds") in str(e.value)


def test_write_rejects_out_of_vocab_ids(tmp_path):
    with pytest.raises(DataError, match="token id 100 outside"):
        data.write_indexed_dataset(str(tmp_path / "ds"), [[1, 100]], 100)


# ----------------------------------------------------------------------------- tokenizer

def test_special_tokens_have_fixed_ids(tok):
    ids = special_ids(tok)
    assert [ids[k] for k in ("eod", "pad", "cls", "sep", "mask")] == [0, 1, 2, 3, 4]
    assert ids["sentinels"] == list(range(5, 105))
    assert tok.id_to_token(104) == "<extra_id_99>" and tok.get_vocab_size() == 400


def test_encode_decode_round_trip_and_eod(tok):
    arrays = tokenize_documents(tok, SOURCE[:3])
    eod, mask = special_ids(tok)["eod"], special_ids(tok)["mask"]
    for a, text in zip(arrays, SOURCE[:3]):
        assert a.dtype == np.int32 and a[-1] == eod and eod not in a[:-1] and mask not in a
        assert tok.decode(a[:-1].tolist()) == text
    assert tok.encode_special_tokens is False  # restored after tokenizing


def test_tokenizer_cache_and_file(tmp_path, tok):
    cache = tmp_path / "sub" / "tok.json"
    trained = get_tokenizer(SOURCE, str(cache), vocab_size=400)
    assert cache.exists() and os.listdir(cache.parent) == ["tok.json"]
    assert get_tokenizer(None, str(cache), vocab_size=400).to_str() == trained.to_str()  # loaded, not trained
    loaded = get_tokenizer(None, None, tokenizer_file=str(cache))
    assert loaded.encode(SOURCE[1]).ids == tok.encode(SOURCE[1]).ids
    with pytest.raises(DataError, match="nope.json"):
        get_tokenizer(SOURCE, None, tokenizer_file=str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json.*unreadable"):
        get_tokenizer(SOURCE, None, tokenizer_file=str(tmp_path / "bad.json"))
    with pytest.raises(DataError, match="vocab_size 300"):
        get_tokenizer(SOURCE, None, vocab_size=300)


def test_foreign_tokenizer_gets_missing_special_tokens(tmp_path):
    from tokenizers import Tokenizer, models
    foreign = Tokenizer(models.WordLevel({"hello": 0, "<|endoftext|>": 1, "world": 2}, unk_token="hello"))
    foreign.save(str(tmp_path / "foreign.json"))
    t = get_tokenizer(None, None, tokenizer_file=str(tmp_path / "foreign.json"))
    ids = special_ids(t)
    assert ids["eod"] == 1 and ids["pad"] == 3 and ids["sentinels"][-1] == 3 + 4 + 99


# ----------------------------------------------------------------------------- corpus

def test_load_documents_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.py").write_text("x = 1\n")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01binary")
    (tmp_path / "d.txt").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / "e.txt").write_text("  \n")
    (tmp_path / ".git" / "HEAD").write_text("ref: hidden")
    (tmp_path / "sub" / "f.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert data.load_documents(str(tmp_path)) == ["alpha", "x = 1\n", "one", "two"]


def test_load_documents_jsonl(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"title": "T", "text": "body"}) + "\n" + json.dumps({"title": "U", "text": "b2"}) + "\n")
    assert data.load_documents(str(p), ("title", "text")) == ["T\nbody", "U\nb2"]
    p.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:3: malformed JSON"):
        data.load_documents(str(p))
    p.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:2: .*'text'"):
        data.load_documents(str(p))


def test_load_documents_errors_and_single_file(tmp_path):
    with pytest.raises(DataError, match="missing_dir"):
        data.load_documents(str(tmp_path / "missing_dir"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n")
    with pytest.raises(DataError, match="no non-empty documents"):
        data.load_documents(str(tmp_path / "empty"))
    (tmp_path / "small.txt").write_text("para one\n\npara two\n")
    assert data.load_documents(str(tmp_path / "small.txt")) == ["para one\n\npara two\n"]
    big = "".join(f"paragraph {i} " + "w" * (i % 50) + "\n\n" for i in range(3000))
    (tmp_path / "big.txt").write_text(big)
    docs = data.load_documents(str(tmp_path / "big.txt"))
    assert "".join(docs) == big and len(docs) > 3
    assert all(len(d) >= data.BLOCK_CHARS for d in docs[:-1])


def test_default_corpus_files():
    files = data.default_corpus_files()
    assert len(files) > 500 and files == sorted(files) and all(f.endswith(".py") for f in files)
    parts = {p for f in files for p in Path(f).parts}
    assert not parts & {"test", "tests", "idle_test", "site-packages"}
    assert any(f.endswith(os.path.join("json", "decoder.py")) for f in files)
    assert 5e6 < sum(os.path.getsize(f) for f in files) < 5e7


# ----------------------------------------------------------------------------- split, samples, batches

@pytest.mark.parametrize("n", [2, 3, 20, 101])
def test_split_documents(n):
    train, valid, test = data.split_documents(n)
    assert len(valid) >= 1 and len(train) >= 1 and len(test) == 0
    assert sorted(np.concatenate([train, valid]).tolist()) == list(range(n))
    assert np.array_equal(data.split_documents(n)[1], valid)


def test_split_documents_seed_and_edges():
    a, b = data.split_documents(200, 0.1, seed=1)[1], data.split_documents(200, 0.1, seed=2)[1]
    assert len(a) == 20 and not np.array_equal(a, b)
    assert [x.tolist() for x in data.split_documents(1)] == [[0], [], []]
    with pytest.raises(DataError, match="valid_fraction"):
        data.split_documents(10, 1.5)


def _docs():
    lengths = [7, 30, 1, 12, 25, 9]
    starts = np.cumsum([0] + lengths[:-1]) + 1000
    return [np.arange(s, s + n) for s, n in zip(starts, lengths)]  # every token id unique


def test_gpt_samples_are_contiguous_windows():
    docs, s = _docs(), 5
    ids = [4, 0, 2, 1]
    ds = GPTDataset(docs, ids, seq_length=s, seed=3)
    stream = np.concatenate([docs[i] for i in ids])
    assert len(ds) == (len(stream) - 1) // s
    starts = []
    for i in range(len(ds)):
        x = ds[i]
        assert x.dtype == np.int64 and x.shape == (s + 1,)
        k = int(np.flatnonzero(stream == x[0])[0])
        np.testing.assert_array_equal(x, stream[k:k + s + 1])  # inputs x[:-1], labels x[1:] = shifted by one
        starts.append(k)
    assert sorted(starts) == list(range(0, len(ds) * s, s))  # each window once: every label predicted once
    assert starts != sorted(starts)  # shuffled


def test_gpt_order_seed_and_epochs(tmp_path):
    docs = _docs()
    def first(d, n):
        return [d[i][0] for i in range(n)]
    a, b, c = (GPTDataset(docs, range(6), 4, seed=sd) for sd in (7, 7, 8))
    n = len(a)
    assert first(a, n) == first(b, n) and first(a, n) != first(c, n)
    epoch2 = [a[n + j][0] for j in range(n)]
    assert sorted(epoch2) == sorted(first(a, n)) and epoch2 != first(a, n)
    assert epoch2 == [GPTDataset(docs, range(6), 4, seed=7)[n + j][0] for j in range(n)]
    data.write_indexed_dataset(str(tmp_path / "ds"), docs, 5000)
    from_idx = GPTDataset(IndexedDataset(str(tmp_path / "ds")), range(6), 4, seed=7)
    assert first(from_idx, 3 * n) == first(a, 3 * n)
    with pytest.raises(DataError, match="need >= seq_length"):
        GPTDataset(docs, [2], seq_length=4, seed=0)


def test_global_batch():
    """Samples [start, start + size): a function of (seed, start) only; a ramp-up's smaller batch is a prefix."""
    docs = _docs()
    ds = GPTDataset(docs, range(6), 4, seed=11)
    g = data.global_batch(ds, start=3 * 8, size=8)
    assert g.dtype == torch.int64 and g.shape == (8, 5)
    np.testing.assert_array_equal(g[2].numpy(), ds[3 * 8 + 2])
    assert torch.equal(g, data.global_batch(GPTDataset(docs, range(6), 4, seed=11), start=24, size=8))
    assert not torch.equal(g, data.global_batch(ds, start=4 * 8, size=8))
    assert torch.equal(data.global_batch(ds, start=26, size=3), g[2:5])
    with pytest.raises(TypeError):  # the start is a sample offset, never a positional iteration number
        data.global_batch(ds, 3, 8)


# ----------------------------------------------------------------------------- cache and CLI

def test_build_token_cache_reuses_and_rebuilds(tmp_path, tok, monkeypatch):
    (tmp_path / "corpus").mkdir()
    for i, text in enumerate(SOURCE[:3]):
        (tmp_path / "corpus" / f"{i}.py").write_text(text)
    prefix = str(tmp_path / "cache" / "tokens")
    ds = data.build_token_cache(str(tmp_path / "corpus"), ("text",), tok, prefix)
    expected = tokenize_documents(tok, SOURCE[:3])
    assert [ds[i].tolist() for i in range(len(ds))] == [a.tolist() for a in expected]

    def boom(*a, **k):
        raise AssertionError("re-tokenized")
    with monkeypatch.context() as m:
        m.setattr(data, "tokenize_documents", boom)
        assert len(data.build_token_cache(str(tmp_path / "corpus"), ("text",), tok, prefix)) == 3
        (tmp_path / "corpus" / "3.py").write_text("y = 2\n")
        with pytest.raises(AssertionError, match="re-tokenized"):
            data.build_token_cache(str(tmp_path / "corpus"), ("text",), tok, prefix)
    assert len(data.build_token_cache(str(tmp_path / "corpus"), ("text",), tok, prefix)) == 4


def test_no_mmap_bin_files_reads_the_same_tokens_into_memory(tmp_path, tok, monkeypatch):
    """--no-mmap-bin-files (IndexedDataset mmap=False): the .bin read into memory, each sequence equal to the mapped
    one's; the flag reaches the datasets build_data makes."""
    prefix = str(tmp_path / "docs")
    data.write_indexed_dataset(prefix, tokenize_documents(tok, SOURCE[:4]), tok.get_vocab_size())
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap=False)
    assert isinstance(mapped._bin, np.memmap) and not isinstance(read._bin, np.memmap)  # (the control: mapped is)
    assert all(np.array_equal(mapped[i], read[i]) for i in range(4)) and len(read) == 4
    import arguments
    opened = []  # (prefix, mmap) of each IndexedDataset build_data opens
    monkeypatch.setattr(data, "IndexedDataset", lambda p, mmap=True: opened.append((p, mmap)) or IndexedDataset(p, mmap))
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "text.txt").write_text(SOURCE[5])
    for flags, is_mapped in [([], True), (["--no-mmap-bin-files"], False)]:
        opened.clear()
        args = arguments.check_args(arguments.parse_args([
            "--data-path", prefix, str(tmp_path / "text.txt"), "--tokenizer-file", str(tmp_path / "tok.json"),
            "--data-cache-path", str(tmp_path / "cache"), "--seq-length", "8", "--vocab-size", "512", *flags]), 1)
        data.build_data(args, tokenizer_file=args.tokenizer_file)
        assert [m for _, m in opened] == [is_mapped, is_mapped] and opened[0][0] == prefix  # the PREFIX, the cache


def test_preprocess_cli(tmp_path, capsys, tok):
    texts = ["first doc\nline", "sëcond 文档", "third <sep> doc"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = str(tmp_path / "out" / "my_text_document")
    assert data.main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", out,
                      "--vocab-size", "380"]) == 0
    assert "3 documents" in capsys.readouterr().out
    trained = get_tokenizer(None, out + ".tokenizer.json", vocab_size=380)
    ds = IndexedDataset(out)
    assert [ds[i].tolist() for i in range(len(ds))] == [a.tolist() for a in tokenize_documents(trained, texts)]
    assert [trained.decode(ds[i][:-1].tolist()) for i in range(3)] == texts

    tok.save(str(tmp_path / "tok.json"))
    assert data.main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", out,
                      "--tokenizer-file", str(tmp_path / "tok.json")]) == 0
    assert [IndexedDataset(out)[i].tolist() for i in range(3)] == [a.tolist() for a in tokenize_documents(tok, texts)]
    assert data.main(["preprocess", "--input", str(tmp_path / "absent.jsonl"), "--output-prefix", out]) == 2
    assert "absent.jsonl" in capsys.readouterr().err


# ----------------------------------------------------------------------------- blends (--data-path A B, 0.3 A 0.7 B)

@pytest.mark.parametrize("entries, paths, weights", [
    ("one", ("one",), None), (["one"], ("one",), None), (["a", "b", "c"], ("a", "b", "c"), None),
    (["a", "b"], ("a", "b"), None), (["0.3", "a", "0.7", "b"], ("a", "b"), (0.3, 0.7)), (["30", "a"], ("a",), (30.0,))])
def test_parse_blend_reads_data_path_as_megatron(entries, paths, weights):
    assert data.parse_blend(entries) == data.Blend(paths, weights)
    mu = pytest.importorskip("megatron.core.datasets.utils")
    theirs = mu.get_blend_from_list([entries] if isinstance(entries, str) else entries)
    assert (tuple(theirs[0]), None if theirs[1] is None else tuple(theirs[1])) == (paths, weights)


@pytest.mark.parametrize("entries, message", [(["0.3", "a", "b", "c"], "not a mix"), (["0", "a", "1", "b"], "> 0"),
                                              (["-1", "a", "2", "b"], "must be > 0")])
def test_parse_blend_refuses(entries, message):
    with pytest.raises(DataError, match=message):
        data.parse_blend(entries)


class _Ids:
    """A stand-in member dataset: sample k is (its name, k)."""

    def __init__(self, name, n=10**9):
        self.name, self.n = name, n

    def __len__(self):
        return self.n

    def __getitem__(self, k):
        return (self.name, k)


def greedy_blend(weights, size, floor=1):
    """Megatron's blending rule written out (helpers.cpp build_blending_indices), the plain oracle."""
    w, n, out = [x / sum(weights) for x in weights], [0] * len(weights), []
    for i in range(size):
        errors = [w[d] * max(i, floor) - n[d] for d in range(len(w))]
        d = errors.index(max(errors))  # the first of equal errors
        out.append((d, n[d]))
        n[d] += 1
    return out


def test_blend_order_is_megatrons():
    blend = data.BlendedDataset([_Ids(0), _Ids(1)], [0.3, 0.7])
    # hand-checked: i=0 (i counts as 1): errors 0.3, 0.7 -> B; i=1: 0.3, -0.3 -> A; i=2: -0.4, 0.4 -> B; ...
    assert [blend[i][0] for i in range(10)] == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert [blend[i][1] for i in range(10)] == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")  # Megatron's C++ (built in its wheel)
    for weights in ([0.3, 0.7], [5.0, 1.0, 1.0, 3.0], [1 / 3, 1 / 3, 1 / 3], [2, 2]):
        w = np.array(data.normalize(weights))
        index, sample = np.zeros(5000, np.int16), np.zeros(5000, np.int64)
        helpers.build_blending_indices(index, sample, w, len(w), 5000, False)
        ours = data.BlendedDataset([_Ids(d) for d in range(len(w))], weights)
        got = [ours[i] for i in range(4999, -1, -1)][::-1]  # from the end first: the index grows on demand
        assert got == list(zip(index.tolist(), sample.tolist())) == greedy_blend(weights, 5000)
    # negative control: the rule with i instead of max(i, 1) starts with the first dataset, so the order differs
    assert greedy_blend([0.3, 0.7], 10, floor=0) != [blend[i] for i in range(10)]


def test_blend_weights_are_normalized_twice_as_megatron_builds_them():
    """Megatron's builder normalizes --data-path's weights, then its BlendedDataset normalizes them again; build_data
    does the same, so the sample order equals Megatron's BlendedDataset's own, built here on stand-in members."""
    bd = pytest.importorskip("megatron.core.datasets.blended_dataset")
    from types import SimpleNamespace

    class Member(_Ids):  # what Megatron's BlendedDataset asks of a member
        index_split = pytest.importorskip("megatron.core.datasets.utils").Split.train
        unique_identifiers = property(lambda self: {"member": self.name})

    raw = [0.1, 0.2, 0.7, 0.35]
    theirs = bd.BlendedDataset([Member(d) for d in range(4)], data.normalize(raw), 3000,  # (the builder's normalize)
                               SimpleNamespace(path_to_cache=None))
    index, sample = theirs.dataset_index, theirs.dataset_sample_index
    ours = data.BlendedDataset([_Ids(d) for d in range(4)], data.normalize(raw))
    assert [ours[i] for i in range(3000)] == list(zip(index.tolist(), sample.tolist()))


def _text_dir(path, word, n):
    path.mkdir()
    for i in range(n):
        (path / f"{i:02d}.txt").write_text(f"{word} {i} " * 40 + "\n")
    return path


def _args(tmp_path, data_path, split="90,5,5", **kw):
    import argparse
    a = dict(data_path=data_path, json_keys=["text"], data_cache_dir=str(tmp_path / "cache"), seq_length=16, seed=3,
             tokenizer_type=None, tokenizer_file=None, vocab_size=None, eval_iters=1, split=split, mock_data=False)
    a.update(kw)
    args = argparse.Namespace(**a)
    _, args.valid_fraction, args.test_fraction = arguments_split(split)
    return args


def arguments_split(split):
    import arguments
    return arguments.parse_split(split)


def test_build_data_blends_each_split_of_mixed_sources(tmp_path):
    """A blend of a text directory and a Megatron PREFIX (made with its own tokenizer by data.py preprocess): the
    tokenizer is the PREFIX's, each source is split by --split, each split blended by the weights."""
    a, b = _text_dir(tmp_path / "a", "alpha", 20), _text_dir(tmp_path / "b", "beta", 30)
    assert data.main(["preprocess", "--input", str(b), "--output-prefix", str(tmp_path / "b_doc"),
                      "--vocab-size", "400"]) == 0
    corpus = data.build_data(_args(tmp_path, ["0.25", str(a), "0.75", str(tmp_path / "b_doc")]), vocab_size=None)
    b_tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tmp_path / "b_doc.tokenizer.json"))
    assert corpus.tokenizer.get_vocab() == b_tok.get_vocab()
    for ds in (corpus.train, corpus.valid, corpus.test):
        assert isinstance(ds, data.BlendedDataset) and np.allclose(ds.weights, [0.25, 0.75], rtol=0, atol=1e-15)
    blend = corpus.train
    alpha = corpus.tokenizer.encode(" alpha").ids[0]
    assert sum(alpha in blend[i] for i in range(400)) in range(90, 111)  # ~ a quarter of the samples are alpha's
    assert all((alpha in blend[i]) == (blend.dataset_index[i] == 0) for i in range(400))
    assert len(corpus.test) > 0
    # sources only, no weights: each weighs its size in samples (Megatron's rule without weights)
    by_size = data.build_data(_args(tmp_path, [str(a), str(tmp_path / "b_doc")]), vocab_size=None).train
    assert by_size.weights == data.normalize([len(d) for d in by_size.datasets])


def test_three_part_split_holds_out_test_documents(tmp_path):
    train, valid, test = data.split_documents(100, 0.05, seed=7, test_fraction=0.01)
    assert (len(train), len(valid), len(test)) == (94, 5, 1)
    assert sorted(np.concatenate([train, valid, test]).tolist()) == list(range(100))
    # a two-part split is what it was before the test part existed: valid first in the seeded permutation
    perm = np.random.default_rng(7).permutation(100)
    assert data.split_documents(100, 0.05, seed=7)[1].tolist() == sorted(perm[:5].tolist())
    assert data.split_documents(3, 0.5, test_fraction=0.4)[0].size == 1  # one train document is always left
    corpus = data.build_data(_args(tmp_path, str(_text_dir(tmp_path / "a", "alpha", 20)), split="949,50,1"))
    assert corpus.test is not None and corpus.valid is not None
    no_test = data.build_data(_args(tmp_path, str(tmp_path / "a"), split="95,5"))
    assert no_test.test is None  # negative control


def test_mock_data_is_megatrons(tmp_path):
    gd = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from types import SimpleNamespace
    theirs = gd.MockGPTLowLevelDataset(SimpleNamespace(eod=7))
    ours = data.MockDocuments(7)
    assert len(ours) == data.MOCK_DOCUMENTS
    for d in (0, 1, 500, data.MOCK_DOCUMENTS - 1):
        np.testing.assert_array_equal(ours[d], theirs[d])
    assert not np.array_equal(ours[1], theirs[2])  # negative control


# ----------------------------------------------------------------------------- a blend through train.main

def test_blend_with_a_test_split_trains_end_to_end(tmp_path):
    """--data-path 0.3 A 0.7 B with --split 80,10,10: trains, evaluates valid, and logs test_loss once at the end."""
    import train
    a, b = _text_dir(tmp_path / "a", "alpha", 12), _text_dir(tmp_path / "b", "beta", 12)
    argv = ["--data-path", "0.3", str(a), "0.7", str(b), "--split", "80,10,10", "--data-cache-path",
            str(tmp_path / "cache"), "--vocab-size", "384", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "3",
            "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1", "--save", str(tmp_path / "run")]
    train.main(argv)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tests = [r for r in recs if "test_loss" in r]
    assert [r["iteration"] for r in tests] == [3] and 0 < tests[0]["test_loss"] < 10
    assert [r["iteration"] for r in recs if "val_loss" in r] == [2, 3]
    train.main(argv[:argv.index("--split") + 1] + ["90,10"] + argv[argv.index("--split") + 2:-1] + [
        str(tmp_path / "run2")])  # negative control: no test part, no test_loss
    assert not any("test_loss" in line for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines())


def test_build_data_refuses_in_one_line(tmp_path, tok):
    """A PREFIX without its tokenizer, two PREFIXes of different tokenizers, mock documents past the vocabulary."""
    docs = tokenize_documents(tok, SOURCE[:4])
    for name in ("p", "q"):
        data.write_indexed_dataset(str(tmp_path / name), docs, tok.get_vocab_size())
    with pytest.raises(DataError, match=r"p.bin/.idx needs the tokenizer it was made with: pass --tokenizer-file"):
        data.build_data(_args(tmp_path, [str(tmp_path / "p")]))
    tok.save(str(tmp_path / "p.tokenizer.json"))
    other = get_tokenizer(SOURCE[1:], None, vocab_size=390)
    other.save(str(tmp_path / "q.tokenizer.json"))
    with pytest.raises(DataError, match=r"--data-path: .*p, .*q were made with different tokenizers"):
        data.build_data(_args(tmp_path, [str(tmp_path / "p"), str(tmp_path / "q")]))
    tok.save(str(tmp_path / "q.tokenizer.json"))  # the control: the same tokenizer blends
    assert isinstance(data.build_data(_args(tmp_path, [str(tmp_path / "p"), str(tmp_path / "q")])).train,
                      data.BlendedDataset)
    with pytest.raises(DataError, match="--mock-data: Megatron's mock documents count up to 4094"):
        data.build_data(_args(tmp_path, None, mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100))
    assert len(data.build_data(_args(tmp_path, None, mock_data=True, tokenizer_type="NullTokenizer",
                                     vocab_size=4095)).train) > 0


@pytest.mark.parametrize("layout", [[], ["--pipeline-model-parallel-size", "2"]], ids=["dp2", "pp2"])
def test_blend_with_a_test_split_is_layout_free(tmp_path, layout):
    """Two ranks (data parallel, or a 2-stage pipeline: test_loss through the forward-only schedule) equal one process
    on a blend with a test part: each loss, val_loss and test_loss to 1e-5 relative (float32 sums in another order)."""
    import harness
    import train
    a, b = _text_dir(tmp_path / "a", "alpha", 12), _text_dir(tmp_path / "b", "beta", 12)
    argv = ["--data-path", "0.3", str(a), "0.7", str(b), "--split", "80,10,10", "--data-cache-path",
            str(tmp_path / "cache"), "--vocab-size", "384", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1"]
    train.main(argv + ["--save", str(tmp_path / "one")])
    harness.launch(2, argv + layout + ["--save", str(tmp_path / "two")])
    one, two = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "two"))
    keys = [(r["iteration"], k) for r in one for k in ("loss", "val_loss", "test_loss") if k in r]
    assert (2, "test_loss") in keys and len(one) == len(two)
    for r1, r2 in zip(one, two):
        for k in ("loss", "val_loss", "test_loss"):
            assert (k in r1) == (k in r2) and (k not in r1 or abs(r1[k] - r2[k]) <= 1e-5 * abs(r1[k])), (k, r1, r2)
