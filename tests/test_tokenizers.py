"""Tests for Megatron's --tokenizer-type here (interop/tokenizer_files.py "Megatron's tokenizer types"): each type's
token ids against an oracle, its special tokens mapped to the data layer's roles, its files read offline, and the
types that cannot be read here refused in one line. Every tokenizer file is made in the test itself (nothing is
downloaded).

Oracles (exact: token ids are integers, compared with ==):
  GPT2BPETokenizer       a plain-Python GPT-2 BPE written out below (GPT-2's regex, bytes as characters, merges by
                         rank: the algorithm of Megatron's gpt2_tokenization.py), on files a tiny BPE training saved
  BertWordPiece*         transformers' legacy pure-Python BasicTokenizer + WordpieceTokenizer (the code Megatron's
                         bert_tokenization.py is), with Megatron's 200-character word limit
  HuggingFaceTokenizer   transformers.AutoTokenizer.from_pretrained(folder), which Megatron's type calls
  NullTokenizer          megatron-core's own NullTokenizer
"""
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import regex

import arguments
import data
from arguments import ConfigError
from data import DataError
from interop import tokenizer_files

TEXTS = ["Hello world, it's 2024!", "  leading spaces\tand tabs\n\nnew lines ", "ünïcödé naïve café 文字",
         "don't stop <|endoftext|> here", "x" * 30 + " aaa" * 5, "Punctuation... (brackets) [CLS] #hash"]
CORPUS = [t * 3 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog " * 4, "def add(a, b): return a + b"]


def megatron_args(**kw):
    """The flags megatron_tokenizer reads."""
    base = dict(tokenizer_type=None, vocab_file=None, merge_file=None, tokenizer_model=None, vocab_size=None)
    return SimpleNamespace(**{**base, **kw})


# ---------------------------------------------------------------------------------------------- GPT2BPETokenizer
@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """vocab.json + merges.txt of a tiny byte-level BPE (HF tokenizers' trainer; the model's own save)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    d = tmp_path_factory.mktemp("gpt2")
    vocab, merges = tok.model.save(str(d))
    return vocab, merges


def _bytes_to_unicode():
    """GPT-2's table: each byte as a printable character (the visible ASCII/Latin-1 ones as themselves)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs, cs, n = bs + [b], cs + [256 + n], n + 1
    return dict(zip(bs, map(chr, cs)))


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_oracle(text, vocab_file, merge_file, pattern=GPT2_PATTERN):
    """GPT-2's encoder written out: split by the regex, map bytes to characters, then merge the lowest-ranked adjacent
    pair until none is in merges.txt (rank = its line, after the #version line)."""
    vocab = json.loads(open(vocab_file, encoding="utf-8").read())
    lines = open(merge_file, encoding="utf-8").read().split("\n")
    ranks = {tuple(m.split()): r for r, m in enumerate(x for x in lines if x and not x.startswith("#version"))}
    table, ids = _bytes_to_unicode(), []
    for piece in regex.findall(pattern, text):
        word = [table[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pair = min(zip(word, word[1:]), key=lambda p: ranks.get(p, float("inf")))
            if pair not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == pair:
                    merged, i = merged + [word[i] + word[i + 1]], i + 2
                else:
                    merged, i = merged + [word[i]], i + 1
            word = merged
        ids += [vocab[t] for t in word]
    return ids


def test_gpt2_bpe_matches_the_written_out_encoder(gpt2_files):
    vocab, merges = gpt2_files
    tok = tokenizer_files.megatron_tokenizer(megatron_args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                                                           merge_file=merges))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == gpt2_oracle(text, vocab, merges), text
        assert tok.decode(gpt2_oracle(text, vocab, merges)) == text
    # negative control: a regex that does not keep a word's leading space with it (" ?") gives other ids
    detached = GPT2_PATTERN.replace(" ?", "")
    assert any(gpt2_oracle(t, vocab, merges, pattern=detached) != gpt2_oracle(t, vocab, merges) for t in TEXTS)
    # roles: eod is the vocabulary's <|endoftext|>; the roles GPT-2 lacks come after its vocabulary
    V = len(json.loads(open(vocab).read()))
    sp = tokenizer_files.special_ids(tok)
    assert sp["eod"] == json.loads(open(vocab).read())["<|endoftext|>"]
    assert sorted([sp["pad"], sp["cls"], sp["sep"], sp["mask"], *sp["sentinels"]]) == list(range(V, V + 104))
    # a document: its tokens (the text <|endoftext|> inside it as plain text, as Megatron encodes it), then eod
    doc = data.tokenize_documents(tok, [TEXTS[3]])[0].tolist()
    assert doc == gpt2_oracle(TEXTS[3], vocab, merges) + [sp["eod"]] and doc.count(sp["eod"]) == 1


def test_gpt2_bpe_file_errors(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    with pytest.raises(DataError, match="--merge-file .*nope.txt.*no such file"):
        tokenizer_files.byte_level_bpe(vocab, str(tmp_path / "nope.txt"))
    v = json.loads(open(vocab).read())
    del v["<|endoftext|>"]
    (tmp_path / "v.json").write_text(json.dumps(v))
    with pytest.raises(DataError, match="has no <|endoftext|>"):
        tokenizer_files.byte_level_bpe(str(tmp_path / "v.json"), merges)


# ---------------------------------------------------------------------------------------------- BertWordPiece*
@pytest.fixture(scope="module")
def vocab_txt(tmp_path_factory):
    """A WordPiece vocab.txt (HF tokenizers' trainer on CORPUS, BERT's special tokens first)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS + [t.lower() for t in CORPUS], trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    d = tmp_path_factory.mktemp("bert")
    return tok.model.save(str(d))[0]


def wordpiece_oracle(text, vocab_file, lower_case, max_chars=200):
    """transformers' pure-Python BERT tokenizer (the code of Megatron's bert_tokenization.py), ids by line number."""
    legacy = pytest.importorskip("transformers.models.bert.tokenization_bert_legacy")
    vocab = {t.rstrip("\n"): i for i, t in enumerate(open(vocab_file, encoding="utf-8"))}
    basic = legacy.BasicTokenizer(do_lower_case=lower_case, never_split=None, tokenize_chinese_chars=True)
    pieces = legacy.WordpieceTokenizer(vocab, unk_token="[UNK]", max_input_chars_per_word=max_chars)
    return [vocab[p] for w in basic.tokenize(text) for p in pieces.tokenize(w)]


@pytest.mark.parametrize("kind, lower", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_wordpiece_matches_bert_tokenization(vocab_txt, kind, lower):
    tok = tokenizer_files.megatron_tokenizer(megatron_args(tokenizer_type=kind, vocab_file=vocab_txt))
    long_word = "x" * 150  # Megatron cuts words of up to 200 characters; transformers' default gives up at 100
    for text in TEXTS + [long_word, "Café\u0000 control\u200b chars"]:
        assert tok.encode(text, add_special_tokens=False).ids == wordpiece_oracle(text, vocab_txt, lower), text
    assert wordpiece_oracle(long_word, vocab_txt, lower, max_chars=100) != wordpiece_oracle(long_word, vocab_txt, lower)
    # negative control: the other case gives other ids
    assert any(wordpiece_oracle(t, vocab_txt, not lower) != wordpiece_oracle(t, vocab_txt, lower) for t in TEXTS)
    # Megatron's additions, in its order: [BOS], [EOS], then (--vocab-extra-ids 0 here) our 100 sentinels
    V = sum(1 for _ in open(vocab_txt, encoding="utf-8"))
    vocab = {t.rstrip("\n"): i for i, t in enumerate(open(vocab_txt, encoding="utf-8"))}
    sp = tokenizer_files.special_ids(tok)
    assert [tok.token_to_id("[BOS]"), sp["eod"]] == [V, V + 1] and tok.id_to_token(sp["eod"]) == "[EOS]"
    assert sp["sentinels"] == list(range(V + 2, V + 102)) and tok.get_vocab_size() == V + 102
    assert [sp[r] for r in ("pad", "cls", "sep", "mask")] == [vocab[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]")]


def test_wordpiece_extra_ids_and_missing_specials(vocab_txt, tmp_path):
    tok = tokenizer_files.wordpiece_tokenizer(vocab_txt, True, extra_ids=3)  # --vocab-extra-ids 3: Megatron's sentinels
    V = sum(1 for _ in open(vocab_txt, encoding="utf-8"))
    assert [tok.token_to_id(t) for t in ("[BOS]", "[EOS]", "<extra_id_0>", "<extra_id_2>")] == [V, V + 1, V + 2, V + 4]
    (tmp_path / "v.txt").write_text("[PAD]\n[UNK]\n[SEP]\na\n")
    with pytest.raises(DataError, match=r"lacks \[CLS\], \[MASK\]"):
        tokenizer_files.wordpiece_tokenizer(str(tmp_path / "v.txt"), True)


# ---------------------------------------------------------------------------------------------- HuggingFaceTokenizer
def hf_folder(path, post_processor=True, config=None):
    """A Hugging Face tokenizer folder: a byte-level BPE with <s>, </s>, <pad>, a post-processor that puts <s> first
    (as Llama's does), and tokenizer_config.json naming them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=350, special_tokens=["<s>", "</s>", "<pad>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    pad = {"__type": "AddedToken", "content": "<pad>", "special": True}  # (the older files' form of a token)
    cfg = config if config is not None else dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>",
                                                 eos_token="</s>", pad_token=pad)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_hf_folder_matches_autotokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = hf_folder(tmp_path / "hf")
    tok = tokenizer_files.megatron_tokenizer(megatron_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder)))
    ref = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    sp = tokenizer_files.special_ids(tok)
    assert (sp["eod"], sp["pad"]) == (ref.eos_token_id, ref.pad_token_id) == (1, 2)
    docs = data.tokenize_documents(tok, TEXTS)
    for text, doc in zip(TEXTS, docs):  # Megatron's document: tokenize(text) = the tokenizer's input_ids, then eod
        assert doc.tolist() == ref(text).input_ids + [ref.eos_token_id], text
    assert ref(TEXTS[0]).input_ids[0] == ref.bos_token_id == 0  # (the post-processor's <s>)
    # negative control: without the folder's post-processor the documents would lack <s>
    assert tok.encode(TEXTS[0], add_special_tokens=False).ids != ref(TEXTS[0]).input_ids
    assert len(ref) == 350 and tok.get_vocab_size() == 350 + 103  # + cls, sep, mask, 100 sentinels (no pad: it has one)


def test_hf_folder_refusals(tmp_path):
    with pytest.raises(DataError, match="'meta-llama/Llama-3.1-8B' is not a local folder .*nothing is downloaded"):
        tokenizer_files.folder_tokenizer("meta-llama/Llama-3.1-8B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no tokenizer.json there"):
        tokenizer_files.folder_tokenizer(str(tmp_path / "empty"))
    folder = hf_folder(tmp_path / "noeos", config={"bos_token": "<s>"})
    with pytest.raises(DataError, match="names no eos_token"):
        tokenizer_files.folder_tokenizer(str(folder))


# ---------------------------------------------------------------------------------------------- NullTokenizer
def test_null_tokenizer_matches_megatron():
    null = pytest.importorskip("megatron.core.tokenizers.text.libraries.null_tokenizer")
    ref, tok = null.NullTokenizer(50), tokenizer_files.megatron_tokenizer(megatron_args(tokenizer_type="NullTokenizer",
                                                                              vocab_size=50))
    for text in ["3 1 4 1 5 9 2 6", "0", "49 48 0\n"]:
        assert tok.encode(text, add_special_tokens=False).ids == ref.text_to_ids(text)
    sp = tokenizer_files.special_ids(tok)
    assert sp["eod"] == ref.eod == 50 and tok.get_vocab_size() == ref.vocab_size + 104  # + the roles it lacks
    assert tok.decode([3, 1, 4]) == ref.ids_to_text([3, 1, 4])
    # negative control: text that is no token id fails, naming the document
    with pytest.raises(DataError, match=r"document 1 \('1 two 3'.*cannot encode"):
        data.tokenize_documents(tok, ["1 2", "1 two 3"])
    with pytest.raises(DataError, match="document 0"):
        data.tokenize_documents(tok, ["50"])  # id 50 is eod, not a document's token


# ----------------------------------------------------------------------- Llama2Tokenizer, GPTSentencePieceTokenizer
SPM_TEXTS = TEXTS + ["    four spaces then code()", "a   b\t\tc", "1234567 89", "<s> </s> <unk> <0x41>", "", " ",
                     "ＡＢＣ full width\u00a0nbsp", "x" * 40] + CORPUS


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    """SentencePiece models trained here: Llama's settings (BPE, byte fallback, identity normalization, digits split,
    whitespace-only pieces) and a unigram model with the default NFKC normalization and whitespace cleanup."""
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("spm")
    code = [Path(data.__file__).read_text(encoding="utf-8"), Path(arguments.__file__).read_text(encoding="utf-8")]
    (d / "corpus.txt").write_text("\n".join(CORPUS * 20 + code), encoding="utf-8")  # code: runs of spaces
    common = dict(input=str(d / "corpus.txt"), vocab_size=800, byte_fallback=True, minloglevel=2)
    spm.SentencePieceTrainer.train(model_prefix=str(d / "llama"), model_type="bpe", normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
                                   **common)
    spm.SentencePieceTrainer.train(model_prefix=str(d / "unigram"), model_type="unigram", **common)
    return {k: str(d / f"{k}.model") for k in ("llama", "unigram")}


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPTSentencePieceTokenizer"])
@pytest.mark.parametrize("model", ["llama", "unigram"])
def test_sentencepiece_matches_sentencepiece(spm_models, kind, model):
    """Token ids (==) and decoded text equal sentencepiece's own encoder's (Megatron's types call it); Llama2Tokenizer
    puts bos first (Megatron's tokenize(bos=True)); eod is the eos piece. A unigram model is checked on text that
    spells no control or byte piece ("</s>": one token here, several in SentencePiece; tokenizer_files.sentencepiece_tokenizer),
    and where two segmentations score exactly the same (a run of "x"), the tie may break the other way: then the
    pieces are the same multiset with the same total score."""
    spm = pytest.importorskip("sentencepiece")
    ref = spm.SentencePieceProcessor(model_file=spm_models[model])
    tok = tokenizer_files.megatron_tokenizer(megatron_args(tokenizer_type=kind, tokenizer_model=spm_models[model]))
    bos = [ref.bos_id()] if kind == "Llama2Tokenizer" else []
    for text in SPM_TEXTS if model == "llama" else [t for t in SPM_TEXTS if "<" not in t]:
        got, want = data.tokenize_documents(tok, [text])[0].tolist()[:-1], bos + ref.encode(text)  # [-1]: eod
        if model == "unigram" and got != want:  # a tie between equally scored segmentations
            assert sorted(got) == sorted(want) and text == "x" * 40, text
        else:
            assert got == want, text
        assert tok.decode(ref.encode(text)) == ref.decode(ref.encode(text)), text
    assert tokenizer_files.special_ids(tok)["eod"] == ref.eos_id() == tok.token_to_id("</s>")
    assert data.tokenize_documents(tok, ["x"])[0].tolist()[-1] == ref.eos_id()


def test_sentencepiece_negative_controls(spm_models, tmp_path):
    """The word split matters (a split before every "▁", as Hugging Face's Metaspace does, breaks a run of spaces that
    Llama's model keeps whole), and a damaged file is refused in one line."""
    spm = pytest.importorskip("sentencepiece")
    ref = spm.SentencePieceProcessor(model_file=spm_models["llama"])
    tok = tokenizer_files.sentencepiece_tokenizer(spm_models["llama"], "GPTSentencePieceTokenizer")
    assert all(tok.encode(t).ids == ref.encode(t) for t in SPM_TEXTS)
    from tokenizers import pre_tokenizers
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    assert "    four spaces then code()" in [t for t in SPM_TEXTS if tok.encode(t).ids != ref.encode(t)]
    (tmp_path / "bad.model").write_bytes(b"\x00not a model")
    with pytest.raises(DataError, match="bad.model is not a SentencePiece model"):
        tokenizer_files.sentencepiece_tokenizer(str(tmp_path / "bad.model"), "Llama2Tokenizer")


# ---------------------------------------------------------------------------------------------- roles, saved runs
def test_roles_are_saved_beside_tokenizer_json(vocab_txt, tmp_path):
    tok = tokenizer_files.megatron_tokenizer(megatron_args(tokenizer_type="BertWordPieceCase", vocab_file=vocab_txt))
    tokenizer_files.save_tokenizer(tok, tmp_path / "tokenizer.json")
    assert json.loads((tmp_path / "tokenizer.roles.json").read_text())["cls"] == "[CLS]"
    again = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert tokenizer_files.special_ids(again) == tokenizer_files.special_ids(tok) and again.get_vocab() == tok.get_vocab()
    # negative control: tokenizer.json alone (a user's --tokenizer-file) takes SPECIAL_TOKENS' spellings
    (tmp_path / "tokenizer.roles.json").unlink()
    plain = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert tokenizer_files.special_ids(plain)["cls"] != tokenizer_files.special_ids(tok)["cls"] == tok.token_to_id("[CLS]")
    ours = tokenizer_files.get_tokenizer(CORPUS, None, vocab_size=400)
    tokenizer_files.save_tokenizer(ours, tmp_path / "tokenizer.json")
    assert not (tmp_path / "tokenizer.roles.json").exists()


# ---------------------------------------------------------------------------------------------- the flags
def check(argv):
    return arguments.check_args(arguments.parse_args(argv), 1)


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/nonexistent/t.model"],
     "--tokenizer-model '/nonexistent/t.model' is not a local file"),
    (["--tokenizer-type", "GPTSentencePieceTokenizer"], "GPTSentencePieceTokenizer needs --tokenizer-model"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "adds the encoders. special tokens"),
    (["--tokenizer-type", "TikTokenizer"], "needs the tiktoken library"),
    (["--tokenizer-type", "SFTTokenizer"], "its own chat template"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"], "GPT2BPETokenizer needs --merge-file"),
    (["--tokenizer-type", "NullTokenizer"], "NullTokenizer needs --vocab-size"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "d", "--tokenizer-file", "t.json"],
     "are two tokenizers"),
    (["--vocab-file", "/nonexistent/vocab.txt"], "--vocab-file '/nonexistent/vocab.txt' does not exist"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "deepseek-ai/DeepSeek-V2-Lite"],
     "--tokenizer-model 'deepseek-ai/DeepSeek-V2-Lite' is not a local folder \\(nothing is downloaded"),
    (["--tokenizer-type", "BertWordPieceCase", "--vocab-file", "/nonexistent/v.txt"],
     "--vocab-file '/nonexistent/v.txt' is not a local file"),
])
def test_tokenizer_flags_refused_in_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        check(argv)


def test_vocab_file_alone_takes_megatron_scripts_default(gpt2_files, vocab_txt, capsys):
    assert check(["--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1]]).tokenizer_type == "GPT2BPETokenizer"
    assert check(["--vocab-file", vocab_txt]).tokenizer_type == "BertWordPieceLowerCase"
    out = capsys.readouterr().out
    assert "the tokenizer type is BertWordPieceLowerCase: --vocab-file" in out
    assert "the tokenizer type is GPT2BPETokenizer: --vocab-file" in out
    args = check(["--tokenizer-type", "NullTokenizer", "--vocab-size", "9", "--tiktoken-pattern", "v2"])
    assert "--tiktoken-pattern v2 is read by TikTokenizer only" in capsys.readouterr().out
    assert args.tiktoken_pattern == "v2"


def test_num_workers_is_accepted_with_a_note(capsys):
    assert check(["--num-workers", "1"]).num_workers == 1
    assert "--num-workers 1: no DataLoader worker processes here" in capsys.readouterr().out
    assert check([]).num_workers is None and "num-workers" not in capsys.readouterr().out  # not given: no note
    with pytest.raises(ConfigError, match="--num-workers=-1 must be >= 0"):
        check(["--num-workers", "-1"])


def test_data_cache_path_is_megatrons_name_for_data_cache_dir():
    assert check(["--data-cache-path", "x"]).data_cache_dir == "x" == check(["--data-cache-dir", "x"]).data_cache_dir
    assert check([]).data_cache_dir == "data_cache"


@pytest.mark.parametrize("split, fractions", [("949,50,1", (0.949, 0.05, 0.001)), ("'99,1,0'", (0.99, 0.01, 0.0)),
                                              ("95,5", (0.95, 0.05, 0.0)), ("969, 30, 1", (0.969, 0.03, 0.001)),
                                              ("100", (1.0, 0.0, 0.0))])
def test_split_parses_as_megatron(split, fractions):
    args = check(["--split", split])
    assert np.allclose((1 - args.valid_fraction - args.test_fraction, args.valid_fraction, args.test_fraction),
                       fractions, rtol=1e-12)  # (float division: equal to rounding)


@pytest.mark.parametrize("split", ["0,5", "95,5,1,1", "a,b", "95,-5", "95;5", "inf,1"])
def test_bad_split_is_refused(split):
    with pytest.raises(ConfigError, match=r"--split=.*expected train,valid\[,test\] weights"):
        check(["--split", split])


# ---------------------------------------------------------------------------------------------- Megatron's scripts
# The data flags of Megatron's GPT-3, BERT, T5 and Llama-3 (--mock-data) scripts train in tests/test_megatron_scripts.py
# (test_scripts_tokenizers_and_splits_as_megatron_reads_them: each run's saved tokenizer and its test split); the
# Llama-3 script's real-data branch (a PREFIX made with a Hugging Face folder) trains here.
def _tiny(tmp_path, *extra):
    return ["--data-cache-path", str(tmp_path / "cache"), "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
            "--eval-iters", "1", "--log-interval", "1", *extra]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_llama3_scripts_real_data_flags_train(tmp_path, capsys):
    """train_llama3_8b_h100_fp8.sh's real-data branch: a PREFIX (tokens + eod per document, as Megatron's
    preprocess_data.py writes it with the same tokenizer), --tokenizer-type HuggingFaceTokenizer on a local folder,
    and --vocab-size, which Megatron does not read for this type (a note says so; the vocabulary is the folder's)."""
    import train
    folder = hf_folder(tmp_path / "hf")
    tok = tokenizer_files.megatron_tokenizer(megatron_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder)))
    prefix = str(tmp_path / "llama_text_document")
    data.write_indexed_dataset(prefix, data.tokenize_documents(tok, CORPUS * 3), tok.get_vocab_size())
    run = tmp_path / "run"
    train.main(_tiny(tmp_path, "--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                     str(folder), "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
                     "--no-mmap-bin-files", "--num-workers", "1", "--vocab-size", "128256", "--save", str(run)))
    out = capsys.readouterr().out
    assert "--vocab-size 128256 is not read with --tokenizer-type HuggingFaceTokenizer" in out
    assert [r["iteration"] for r in _records(run) if "loss" in r] == [1, 2]
    assert json.loads((run / "iter_0000002" / "meta.json").read_text())["args"]["vocab_size"] == tok.get_vocab_size()
    roles = json.loads((run / "tokenizer.roles.json").read_text())
    assert (roles["tokenizer_type"], roles["eod"], roles["add_special_tokens"]) == ("HuggingFaceTokenizer", "</s>", True)


@pytest.mark.parametrize("argv, message", [
    (["--mock-data", "--data-path", "a"], "--mock-data and --data-path are two data sources"),
    (["--data-path", "0.3", "a", "b", "c"], "not a mix"),
    (["--data-path", "0.3", "a", "-1", "b"], "weight -1.0 of b must be > 0"),
    (["--task", "sft", "--data-path", "a.jsonl", "b.jsonl"], "--task sft reads one JSON-lines file: --data-path has 2"),
    (["--task", "sft", "--split", "90,5,5"], "--task sft splits its records into train and valid only"),
    (["--task", "dpo", "--mock-data"], "--mock-data makes pretraining documents: --task dpo needs records"),
    (["--no-create-attention-mask-in-dataloader", "--reset-attention-mask"], "no block-causal mask to pass on"),
])
def test_data_flags_refused_in_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        check(argv)


def test_data_flags_accepted(capsys):
    """The cases next to the refusals above (their negative controls): one source stays a str, a blend a list."""
    assert check(["--data-path", "a"]).data_path == "a" and check(["--mock-data"]).data_path is None
    assert check(["--data-path", "0.3", "a", "0.7", "b"]).data_path == ["0.3", "a", "0.7", "b"]
    assert check(["--task", "sft", "--split", "90,10,0"]).test_fraction == 0
    assert check(["--no-create-attention-mask-in-dataloader"]).create_attention_mask_in_dataloader is False
    capsys.readouterr()
    check(["--merge-file", "m.txt"])
    assert "--merge-file: not read without --tokenizer-type (the tokenizer is ours)" in capsys.readouterr().out
