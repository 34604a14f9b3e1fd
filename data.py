"""The data module: corpus -> tokenizer -> Megatron indexed dataset -> GPT samples -> global batches.

Shared by every model (gpt, bert, t5, retro, mamba) and by train.py. It mirrors, in Megatron-LM:
  megatron/core/datasets/indexed_dataset.py  the .bin/.idx format      (write_indexed_dataset, IndexedDataset)
  megatron/core/datasets/gpt_dataset.py      token stream -> samples   (GPTDataset, global_batch; packed
                                             documents: get_ltor_masks_and_position_ids, Packing)
  tools/preprocess_data.py                   jsonl -> .bin/.idx        (`python data.py preprocess`)
  megatron/core/num_microbatches_calculator.py  the batch-size ramp-up   (batch_size)

    python data.py preprocess --output-prefix data/stdlib                # the default corpus, a fresh 8192 BPE
    python data.py preprocess --input corpus.jsonl --json-keys text --output-prefix data/my_text_document \
        --tokenizer-file tokenizer.json

The default corpus is the Python standard library's own source (no download, ever). A byte-level BPE
(HF `tokenizers`) trains on it in ~2 s. Every document is followed by the end-of-document token, like
preprocess_data.py --append-eod. A batch depends only on (seed, samples consumed before it), never on the parallel
layout.
"""
import argparse
import dataclasses
import fcntl
import hashlib
import itertools
import json
import os
import re
import struct
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


class DataError(ValueError):
    """Bad data input: a missing path, a malformed file. The message names the culprit."""


# ----------------------------------------------------------------------------- corpus

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_JSON_SUFFIXES = (".jsonl", ".json")
BLOCK_CHARS = 16384  # a single plain-text file is cut into documents of >= this many chars at blank lines


def default_corpus_files():
    """The stdlib's .py files, sorted, minus test directories and site-packages (~730 files, ~12 MB)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


def _read_text(path):
    """The file's text, or None if it is binary (a NUL byte, or not UTF-8)."""
    raw = Path(path).read_bytes()
    try:
        return None if b"\x00" in raw else raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_json_lines(path, json_keys):
    """Megatron's loose json: one object per line; a document = its json_keys' values joined by newline."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            for k in json_keys:
                if not isinstance(obj, dict) or not isinstance(obj.get(k), str):
                    raise DataError(f"{path}:{lineno}: no string value for key {k!r} in {line.strip()[:60]!r}")
            docs.append("\n".join(obj[k] for k in json_keys))
    return docs


def _split_blocks(text, block_chars=BLOCK_CHARS):
    """Cut at blank lines into pieces of >= block_chars (the last may be shorter); ''.join(pieces) == text."""
    cuts = [0]
    for m in re.finditer(r"\n[ \t]*\n", text):
        if m.end() - cuts[-1] >= block_chars and m.end() < len(text):
            cuts.append(m.end())
    cuts.append(len(text))
    return [text[a:b] for a, b in itertools.pairwise(cuts)]


def load_documents(data_path=None, json_keys=("text",)):
    """Documents (strings) from: None -> the stdlib corpus, one per file;
    a .jsonl/.json file -> one per line (json_keys' values joined by newline);
    any other text file -> one document, or blocks of >= BLOCK_CHARS chars cut at blank lines if it is longer
      (so one big book still gives a validation split);
    a directory -> every file under it, sorted and recursive, each read by the rules above except that a plain
      text file stays one document; binary files and hidden files/directories are skipped.
    Empty (whitespace-only) documents are dropped."""
    if data_path is None:
        docs = [Path(p).read_text(encoding="utf-8", errors="replace") for p in default_corpus_files()]
    else:
        path = Path(data_path)
        if not path.exists():
            raise DataError(f"data path {str(data_path)!r} does not exist")
        if path.is_dir():
            docs = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(n for n in filenames if not n.startswith(".")):
                    f = os.path.join(dirpath, name)
                    if name.endswith(_JSON_SUFFIXES):
                        docs += _read_json_lines(f, json_keys)
                    elif (text := _read_text(f)) is not None:
                        docs.append(text)
        elif path.suffix in _JSON_SUFFIXES:
            docs = _read_json_lines(path, json_keys)
        else:
            text = _read_text(path)
            if text is None:
                raise DataError(f"{data_path}: not a UTF-8 text file")
            docs = _split_blocks(text)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"no non-empty documents in {'the default corpus' if data_path is None else data_path}")
    return docs


# ----------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<pad>", "<cls>", "<sep>", "<mask>"] + [f"<extra_id_{i}>" for i in range(100)]


def _load_tokenizer(path):
    if not os.path.isfile(path):
        raise DataError(f"tokenizer file {str(path)!r} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on bad JSON)
        raise DataError(f"tokenizer file {str(path)!r} is unreadable: {str(e).splitlines()[0]}") from None


def get_tokenizer(documents, cache_path, vocab_size=8192, tokenizer_file=None):
    """Load tokenizer_file (adding any missing SPECIAL_TOKENS at the end of its vocab, as Megatron's BERT
    tokenizer adds T5 sentinels); else load cache_path if it exists with this vocab_size; else train a
    byte-level BPE on the documents (special tokens at ids 0..104) and save it to cache_path atomically."""
    if tokenizer_file is not None:
        tok = _load_tokenizer(tokenizer_file)
        tok.add_special_tokens([t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None])
        return tok
    if cache_path is not None and os.path.exists(cache_path):
        tok = _load_tokenizer(cache_path)
        if tok.get_vocab_size() == vocab_size:
            return tok
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise DataError(f"vocab_size {vocab_size} is too small: need >= {len(SPECIAL_TOKENS) + 256}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    if cache_path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        tmp = f"{cache_path}.tmp{os.getpid()}"
        tok.save(tmp)
        os.replace(tmp, cache_path)  # a killed run never leaves half a file behind
    return tok


def special_ids(tok):
    """{'eod', 'pad', 'cls', 'sep', 'mask': id, 'sentinels': [100 ids]}."""
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise DataError(f"tokenizer lacks special tokens {missing[:3]}{'...' if len(missing) > 3 else ''}")
    out = {n: ids[t] for n, t in zip(["eod", "pad", "cls", "sep", "mask"], SPECIAL_TOKENS)}
    return {**out, "sentinels": [ids[t] for t in SPECIAL_TOKENS[5:]]}


def tokenize_documents(tok, documents, chunk=256):
    """One int32 array per document: its tokens then eod. Special-token strings inside the text are encoded
    as plain text, so only our appended eod is ever an eod."""
    eod, arrays = special_ids(tok)["eod"], []
    saved, tok.encode_special_tokens = tok.encode_special_tokens, True
    try:
        for i in range(0, len(documents), chunk):
            for enc in tok.encode_batch(documents[i:i + chunk], add_special_tokens=False):
                arrays.append(np.array(enc.ids + [eod], dtype=np.int32))
    finally:
        tok.encode_special_tokens = saved
    return arrays


def build_token_cache(data_path, json_keys, tok, cache_prefix, documents=None):
    """Tokenize once: cache_prefix.bin/.idx plus cache_prefix.key (sha256 of the documents and tokenizer).
    A changed corpus or tokenizer changes the key and rebuilds. Pass `documents` if already loaded."""
    documents = load_documents(data_path, json_keys) if documents is None else documents
    h = hashlib.sha256(tok.to_str().encode())
    for d in documents:
        b = d.encode("utf-8", errors="surrogatepass")
        h.update(struct.pack("<Q", len(b)) + b)
    key, key_path = h.hexdigest(), f"{cache_prefix}.key"
    if os.path.exists(key_path) and Path(key_path).read_text().strip() == key:
        return IndexedDataset(cache_prefix)
    if os.path.exists(key_path):
        os.remove(key_path)  # invalidate first: a run killed mid-rebuild must not trust stale files
    write_indexed_dataset(cache_prefix, tokenize_documents(tok, documents), tok.get_vocab_size())
    Path(f"{key_path}.tmp").write_text(key + "\n")
    os.replace(f"{key_path}.tmp", key_path)
    return IndexedDataset(cache_prefix)


# ----------------------------------------------------------------------------- Megatron indexed dataset
# .idx: magic b"MMIDIDX\x00\x00" | <Q version=1 | <B dtype code | <Q sequence count S | <Q document count D
#       | int32 lengths[S] | int64 byte pointers[S] | int64 document indices[D]   (D = documents + 1, starts at 0)
# .bin: the raw token ids, sequence after sequence.

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = len(_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CODES = {np.dtype(t): c for c, t in DTYPES.items()}


def write_indexed_dataset(prefix, docs_token_ids, vocab_size):
    """prefix.bin + prefix.idx, one sequence per document (uint16 if vocab_size < 65500 else int32, as
    Megatron's DType.optimal_dtype). Both files are written to temporaries and renamed, .idx last."""
    dtype = np.dtype(np.uint16 if vocab_size < 65500 else np.int32)
    arrays = [np.asarray(a).reshape(-1) for a in docs_token_ids]
    for i, a in enumerate(arrays):
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            bad = a.min() if a.min() < 0 else a.max()
            raise DataError(f"document {i}: token id {bad} outside [0, {vocab_size})")
    lengths = np.array([a.size for a in arrays], dtype=np.int32)
    pointers = np.zeros(len(arrays), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * dtype.itemsize
    doc_idx = np.arange(len(arrays) + 1, dtype=np.int64)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f".tmp{os.getpid()}"
    with open(prefix + ".bin" + tmp, "wb") as f:
        for a in arrays:
            f.write(a.astype(dtype).tobytes())
    with open(prefix + ".idx" + tmp, "wb") as f:
        f.write(struct.pack("<9sQBQQ", _MAGIC, 1, _CODES[dtype], len(arrays), len(doc_idx)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    for ext in (".bin", ".idx"):  # .idx last: an .idx on disk always has its .bin
        os.replace(prefix + ext + tmp, prefix + ext)


class IndexedDataset:
    """Read-only view of prefix.bin/.idx (np.memmap). ds[i] is sequence i's tokens."""

    def __init__(self, prefix):
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        for p in (idx, bin_):
            if not os.path.isfile(p):
                raise DataError(f"{p}: file not found")
        size = os.path.getsize(idx)
        if size < _HEADER:
            raise DataError(f"{idx}: truncated header ({size} bytes, need {_HEADER})")
        with open(idx, "rb") as f:
            magic, version, code, n, d = struct.unpack("<9sQBQQ", f.read(_HEADER))
        if magic != _MAGIC:
            raise DataError(f"{idx}: bad magic {magic!r}, expected {_MAGIC!r} (not a Megatron .idx file)")
        if version != 1:
            raise DataError(f"{idx}: unsupported version {version}, expected 1")
        if code not in DTYPES:
            raise DataError(f"{idx}: unknown dtype code {code} (known: {sorted(DTYPES)})")
        expected = _HEADER + n * (4 + 8) + d * 8
        if size != expected:
            raise DataError(f"{idx}: {size} bytes, expected {expected} for {n} sequences and {d} document indices")
        self.dtype = np.dtype(DTYPES[code])
        self.sequence_lengths = np.fromfile(idx, np.int32, n, offset=_HEADER)
        self.sequence_pointers = np.fromfile(idx, np.int64, n, offset=_HEADER + 4 * n)
        self.document_indices = np.fromfile(idx, np.int64, d, offset=_HEADER + 12 * n)
        lengths = self.sequence_lengths.astype(np.int64)
        if (lengths < 0).any():
            raise DataError(f"{idx}: negative sequence length")
        if n and not np.array_equal(self.sequence_pointers, (np.cumsum(lengths) - lengths) * self.dtype.itemsize):
            raise DataError(f"{idx}: sequence pointers do not match the sequence lengths")
        di = self.document_indices
        if d < 1 or di[0] != 0 or di[-1] != n or (np.diff(di) < 0).any():
            raise DataError(f"{idx}: document indices must rise from 0 to {n} (the sequence count)")
        nbytes, bin_size = int(lengths.sum()) * self.dtype.itemsize, os.path.getsize(bin_)
        if bin_size != nbytes:
            raise DataError(f"{bin_}: {bin_size} bytes, but {idx} describes {nbytes}")
        self._bin = np.memmap(bin_, self.dtype, mode="r") if nbytes else np.empty(0, self.dtype)

    def __len__(self):
        return len(self.sequence_lengths)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        start = self.sequence_pointers[i] // self.dtype.itemsize
        return self._bin[start:start + self.sequence_lengths[i]]


# ----------------------------------------------------------------------------- GPT samples and batches

def split_documents(n_docs, valid_fraction=0.05, seed=1234):
    """Split document ids by a seeded permutation -> (train_ids, valid_ids), each sorted.
    At least one valid document when n_docs >= 2 and valid_fraction > 0, and at least one train document."""
    if n_docs < 1:
        raise DataError(f"need at least one document to split, got {n_docs}")
    if not 0 <= valid_fraction < 1:
        raise DataError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    n_valid = min(n_docs - 1, max(round(n_docs * valid_fraction), int(valid_fraction > 0)))
    perm = np.random.default_rng(seed).permutation(n_docs)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


class GPTDataset:
    """The chosen documents (with their eod) as one token stream, cut into samples of seq_length + 1 tokens.
    Like Megatron's, consecutive samples share one boundary token: sample k = stream[k*s : k*s + s + 1], so
    input = sample[:-1], label = sample[1:] and no token is wasted. The order of samples is a permutation
    seeded by seed + epoch; index i >= len(ds) lands in epoch i // len(ds) with its own fresh shuffle.
    (Megatron also shuffles the document order per epoch; here the per-epoch sample shuffle plays that role.)
    `source` is a list of token arrays or an IndexedDataset (document d = its sequence d, as Megatron's
    GPTDataset reads it)."""

    def __init__(self, source, doc_ids, seq_length, seed):
        if seq_length < 1:
            raise DataError(f"seq_length must be >= 1, got {seq_length}")
        doc_ids = [int(d) for d in doc_ids]
        bad = [d for d in doc_ids if not 0 <= d < len(source)]
        if bad:
            raise DataError(f"document id {bad[0]} out of range [0, {len(source)})")
        parts = [np.asarray(source[d]).astype(np.int64) for d in doc_ids]
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        self.seq_length, self.seed = seq_length, seed
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise DataError(f"{len(self.tokens)} tokens in {len(doc_ids)} documents: need >= seq_length + 1 "
                            f"= {seq_length + 1} for one sample")
        self._epoch, self._perm = None, None

    def __len__(self):
        return self.num_samples

    def _order(self, epoch):
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        return self._perm

    def __getitem__(self, i):
        if i < 0:
            raise IndexError(f"sample index {i} is negative")
        epoch, j = divmod(int(i), self.num_samples)
        k = int(self._order(epoch)[j]) * self.seq_length
        return self.tokens[k:k + self.seq_length + 1].copy()


def global_batch(dataset, *, start: int, size: int):
    """Samples start ... start + size - 1 as a LongTensor [size, seq_length + 1] (a step's global batch: start = the
    samples consumed before it, Megatron's consumed_train_samples; iteration x gbs without a ramp-up). Depends only on
    (seed, start): train.py slices it into micro-batches and DP shards, and resume needs only the consumed count."""
    if start < 0 or size < 1:
        raise DataError(f"bad global batch: start {start} / size {size}")
    return torch.from_numpy(np.stack([dataset[start + j] for j in range(size)]))


def batch_size(consumed: int, global_batch_size: int, rampup=None) -> int:
    """The global batch size of the step that starts after `consumed` samples: --global-batch-size, or during
    --rampup-batch-size START INCREMENT SAMPLES, Megatron's ramp (megatron/core/num_microbatches_calculator.py,
    RampupBatchsizeNumMicroBatchesCalculator): START + k x INCREMENT, k the whole number of SAMPLES / n
    samples consumed (n = (global_batch_size - START) / INCREMENT increments), until more than SAMPLES are."""
    if rampup is None:
        return global_batch_size
    start, increment, samples = rampup
    if consumed > samples:
        return global_batch_size
    per_increment = samples / ((global_batch_size - start) // increment)  # a float, as Megatron's
    return start + int(consumed / per_increment) * increment


@dataclass(frozen=True)
class Corpus:
    """What build_data finds and makes, passed on (args stay as parsed): the tokenizer, the model's vocabulary size
    (--vocab-size, else the tokenizer's), its end-of-document id (Megatron's tokenizer.eod), and the train and valid
    datasets (None for a post-training task, which makes its own samples: posttrain.py)."""
    tokenizer: Tokenizer
    vocab_size: int
    eod: int
    train: object = None
    valid: object = None


def build_data(args, dataset=None, tokenizer_file=None, vocab_size=None, samples: bool = True) -> Corpus:
    """train.py's data from the flags (--data-path, --json-keys, --split, --seq-length, --seed, --data-cache-dir):
    the tokenizer of `tokenizer_file` (else a BPE of `vocab_size`, default 8192, trained on the corpus), and the
    samples `dataset(source, doc_ids, args, tok, seed)` makes (the model file's hook; default GPT windows). Runs on
    every rank; a file lock lets one rank build the caches. samples=False (post-training tasks): the tokenizer only,
    `tokenizer_file`'s (a base run's) or else the BPE of the default corpus."""
    dataset = dataset or (lambda source, ids, args, tok, seed: GPTDataset(source, ids, args.seq_length, seed))
    cache = Path(args.data_cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # torchrun's ranks on one node: the first builds, the others read
        prefix = args.data_path if samples else None
        if prefix and not os.path.exists(prefix) and os.path.exists(prefix + ".idx"):  # Megatron .bin/.idx
            source = IndexedDataset(prefix)
            tok_file = tokenizer_file or prefix + ".tokenizer.json"  # data.py preprocess writes it there
            if not os.path.exists(tok_file):
                raise DataError(f"{prefix}.bin/.idx needs the tokenizer it was made with: pass --tokenizer-file")
            tok = get_tokenizer(None, None, tokenizer_file=tok_file)
            top = int(source._bin.max()) if len(source._bin) else 0
            if top >= tok.get_vocab_size():
                raise DataError(f"{prefix}.bin holds token id {top}, outside the tokenizer's "
                                f"vocabulary of {tok.get_vocab_size()} ({tok_file})")
        elif not samples and tokenizer_file:
            tok = get_tokenizer(None, None, tokenizer_file=tokenizer_file)
        else:
            docs = load_documents(prefix, tuple(args.json_keys))
            h = hashlib.sha256(str(len(docs)).encode())
            for d in docs:
                h.update(d.encode("utf-8", errors="surrogatepass"))
            key = h.hexdigest()[:16]
            v = vocab_size or 8192
            tok = get_tokenizer(docs, str(cache / f"{key}-bpe{v}.json"), v, tokenizer_file)
            tok_key = hashlib.sha256(tok.to_str().encode()).hexdigest()[:8]
            if samples:
                source = build_token_cache(None, None, tok, str(cache / f"{key}-{tok_key}-tokens"), documents=docs)
    n_tok = tok.get_vocab_size()
    if vocab_size is not None and vocab_size < n_tok:
        raise DataError(f"the tokenizer has {n_tok} tokens, more than the model's --vocab-size={vocab_size}"
                        f" (tokenizer: {tokenizer_file or 'trained BPE'})")
    corpus = Corpus(tok, vocab_size or n_tok, special_ids(tok)["eod"])
    if not samples:
        return corpus
    train_ids, valid_ids = split_documents(len(source), args.valid_fraction, seed=args.seed)
    train = dataset(source, train_ids, args, tok, args.seed)
    valid = dataset(source, valid_ids, args, tok, args.seed + 1) if len(valid_ids) else None
    if (valid is None or len(valid) == 0) and args.eval_iters > 0 and int(os.environ.get("RANK", 0)) == 0:
        print(f"WARNING: the validation set is empty (--split={args.split} leaves no validation document: a corpus of "
              "one document?): evaluation is off", flush=True)
    return dataclasses.replace(corpus, train=train, valid=valid if valid is not None and len(valid) else None)


# ----------------------------------------------------------------------------- packed documents
# A GPT sample is a window of the token stream, so it holds the end of one document, its eod, the next document...
# Megatron's --reset-position-ids / --reset-attention-mask / --eod-mask-loss make each document in the window see
# only itself (megatron/core/datasets/gpt_dataset.py `_get_ltor_masks_and_position_ids`): positions restart after
# each eod, attention is block-causal (a token attends to the earlier tokens of its own document), and the
# prediction made AT an eod (the next document's first token, from the previous document) carries no loss. The eod
# belongs to the document it ends. Megatron's mask is True = masked out; ours is SDPA's True = attend. The
# variable-length ("THD", cu_seqlens) form, torch.nn.attention.varlen.varlen_attn, is flash-attention only (CUDA):
# on CPU it raises NotImplementedError, so the dense block-causal mask is what runs here (O(s²) bools per sample).

def get_ltor_masks_and_position_ids(tokens, eod: int, reset_position_ids=False, reset_attention_mask=False,
                                    eod_mask_loss=False):
    """Input ids [b, s] -> (mask: bool [b, 1, s, s], True = attend, or None = plain causal; loss_mask: float [b, s],
    0 where the input token is eod under eod_mask_loss; position_ids: [b, s]). Vectorized; the same as Megatron's
    per-eod loop (tests/test_packing.py compares the two)."""
    b, s = tokens.shape
    is_eod = tokens == eod  # [b, s]
    loss_mask = (~is_eod if eod_mask_loss else torch.ones_like(is_eod)).to(torch.float32)
    doc = is_eod.long().cumsum(-1) - is_eod.long()  # [b, s] document index; an eod belongs to the document it ends
    pos = torch.arange(s, device=tokens.device).expand(b, s)
    if reset_position_ids:  # position - the index of the document's first token (the running max of the starts)
        starts = torch.where(torch.cat([torch.ones_like(doc[:, :1]), doc.diff(dim=-1)], -1) > 0, pos, 0)
        pos = pos - starts.cummax(-1).values
    mask = None
    if reset_attention_mask:  # block-causal: the same document, and not in the future
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
        mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # [b, 1, s, s]
    return mask, loss_mask, pos.contiguous()


@dataclass(frozen=True)
class Packing:
    """The packed-document flags with the tokenizer's eod id, for the GPT recipe (train.py next_token_loss):
    `pack(tokens)` -> (mask, loss_mask, position_ids); `num_loss_tokens(batch)` counts the loss tokens of a whole
    global batch [gbs, s+1] — the layout-free denominator of the loss rule (DESIGN.md §2)."""
    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def from_args(cls, args, eod: int):
        """None unless one of --reset-position-ids, --reset-attention-mask, --eod-mask-loss is set."""
        flags = {k: getattr(args, k, False) for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")}
        return cls(eod, **flags) if any(flags.values()) else None

    def __call__(self, tokens):
        return get_ltor_masks_and_position_ids(tokens, self.eod, self.reset_position_ids, self.reset_attention_mask,
                                               self.eod_mask_loss)

    def num_loss_tokens(self, batch) -> int:
        tokens = batch[:, :-1]
        return int((tokens != self.eod).sum()) if self.eod_mask_loss else tokens.numel()


# ----------------------------------------------------------------------------- preprocess CLI

def main(argv=None):
    p = argparse.ArgumentParser(prog="data.py", description="Megatron-style data preprocessing.")
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preprocess", help="tokenize a corpus into PREFIX.bin/.idx (tools/preprocess_data.py)")
    pre.add_argument("--input", default=None, help="file or directory (default: the Python stdlib corpus)")
    pre.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    pre.add_argument("--json-keys", nargs="+", default=["text"], help="keys to read from .jsonl/.json lines")
    tk = pre.add_mutually_exclusive_group()
    tk.add_argument("--tokenizer-file", default=None, help="a HF tokenizers tokenizer.json to use as is")
    tk.add_argument("--vocab-size", type=int, default=8192, help="train a byte-level BPE of this size")
    pre.add_argument("--tokenizer-cache", default=None, help="trained BPE path (default PREFIX.tokenizer.json)")
    args = p.parse_args(argv)
    try:
        docs = load_documents(args.input, tuple(args.json_keys))
        cache = args.tokenizer_cache or args.output_prefix + ".tokenizer.json"
        tok = get_tokenizer(docs, cache, args.vocab_size, args.tokenizer_file)
        arrays = tokenize_documents(tok, docs)
        write_indexed_dataset(args.output_prefix, arrays, tok.get_vocab_size())
    except DataError as e:
        print(f"data.py: error: {e}", file=sys.stderr)
        return 2
    n_tokens = sum(a.size for a in arrays)
    print(f"{args.output_prefix}.bin/.idx: {len(docs)} documents, {n_tokens} tokens, vocab {tok.get_vocab_size()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
