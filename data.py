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

The default corpus is the Python standard library's own source (no download, ever). A byte-level BPE (HF `tokenizers`;
every tokenizer is interop/tokenizer_files.py's) trains on it in ~2 s. Every document is followed by the
end-of-document token, like preprocess_data.py --append-eod. A batch depends only on (seed, samples consumed before
it), never on the parallel layout.
"""
import argparse
import dataclasses
import fcntl
import hashlib
import itertools
import json
import math
import os
import re
import struct
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from interop.tokenizer_files import (  # the tokenizers (DataError and note: the data layer's too)
    DataError,
    get_tokenizer,
    megatron_tokenizer,
    note,
    roles_of,
    special_ids,
    tokenizer_text,
)

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



def tokenize_documents(tok, documents, chunk=256):
    """One int32 array per document: its tokens then eod. Special-token strings inside the text are encoded
    as plain text, so only our appended eod is ever an eod. A tokenizer whose Roles say so (a Hugging Face folder's)
    adds what its post-processor adds (Megatron's HuggingFaceTokenizer: a bos token first)."""
    eod, arrays = special_ids(tok)["eod"], []
    wrap = roles_of(tok).add_special_tokens
    saved, tok.encode_special_tokens = tok.encode_special_tokens, True
    try:
        for i in range(0, len(documents), chunk):
            try:
                encoded = tok.encode_batch(documents[i:i + chunk], add_special_tokens=wrap)
            except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception: NullTokenizer's non-integers)
                bad = next(j for j in range(i, min(i + chunk, len(documents))) if _fails(tok, documents[j], wrap))
                raise DataError(f"document {bad} ({documents[bad][:40]!r}...): the {roles_of(tok).tokenizer_type or ''} "
                                f"tokenizer cannot encode it ({str(e).splitlines()[0]})") from None
            arrays += [np.array(enc.ids + [eod], dtype=np.int32) for enc in encoded]
    finally:
        tok.encode_special_tokens = saved
    return arrays


def _fails(tok, text, wrap) -> bool:
    try:
        tok.encode(text, add_special_tokens=wrap)
    except Exception:  # noqa: BLE001
        return True
    return False


def build_token_cache(data_path, json_keys, tok, cache_prefix, documents=None, mmap: bool = True):
    """Tokenize once: cache_prefix.bin/.idx plus cache_prefix.key (sha256 of the documents and tokenizer).
    A changed corpus or tokenizer changes the key and rebuilds. Pass `documents` if already loaded; mmap: as
    IndexedDataset's."""
    documents = load_documents(data_path, json_keys) if documents is None else documents
    h = hashlib.sha256(tokenizer_text(tok).encode())
    for d in documents:
        b = d.encode("utf-8", errors="surrogatepass")
        h.update(struct.pack("<Q", len(b)) + b)
    key, key_path = h.hexdigest(), f"{cache_prefix}.key"
    if os.path.exists(key_path) and Path(key_path).read_text().strip() == key:
        return IndexedDataset(cache_prefix, mmap)
    if os.path.exists(key_path):
        os.remove(key_path)  # invalidate first: a run killed mid-rebuild must not trust stale files
    write_indexed_dataset(cache_prefix, tokenize_documents(tok, documents), tok.get_vocab_size())
    Path(f"{key_path}.tmp").write_text(key + "\n")
    os.replace(f"{key_path}.tmp", key_path)
    return IndexedDataset(cache_prefix, mmap)


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
    """Read-only view of prefix.bin/.idx: the .bin memory-mapped (np.memmap), or with mmap=False (Megatron's
    --no-mmap-bin-files) read into memory once. ds[i] is sequence i's tokens, the same either way."""

    def __init__(self, prefix, mmap: bool = True):
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
        self._bin = np.empty(0, self.dtype) if not nbytes else np.memmap(bin_, self.dtype, mode="r") if mmap else \
            np.fromfile(bin_, self.dtype)

    def __len__(self):
        return len(self.sequence_lengths)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        start = self.sequence_pointers[i] // self.dtype.itemsize
        return self._bin[start:start + self.sequence_lengths[i]]


# ----------------------------------------------------------------------------- GPT samples and batches

def split_documents(n_docs, valid_fraction=0.05, seed=1234, test_fraction=0.0):
    """Split document ids by a seeded permutation -> (train_ids, valid_ids, test_ids), each sorted: --split's
    train,valid,test (Megatron's meaning: documents, not tokens, in these proportions; here drawn at random, Megatron
    takes consecutive ranges). At least one valid document when n_docs >= 2 and valid_fraction > 0, then at least one
    test document when one is left over and test_fraction > 0, and always at least one train document."""
    if n_docs < 1:
        raise DataError(f"need at least one document to split, got {n_docs}")
    if not (0 <= valid_fraction < 1 and 0 <= test_fraction < 1 and valid_fraction + test_fraction < 1):
        raise DataError(f"valid_fraction {valid_fraction} + test_fraction {test_fraction} must be in [0, 1)")
    n_valid = min(n_docs - 1, max(round(n_docs * valid_fraction), int(valid_fraction > 0)))
    n_test = min(n_docs - 1 - n_valid, max(round(n_docs * test_fraction), int(test_fraction > 0)))
    perm = np.random.default_rng(seed).permutation(n_docs)
    return np.sort(perm[n_valid + n_test:]), np.sort(perm[:n_valid]), np.sort(perm[n_valid:n_valid + n_test])


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


# ----------------------------------------------------------------------------- blends, mock data, build_data

def normalize(weights) -> list[float]:
    """Megatron's utils.normalize: w / sum(w) in float64."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


@dataclass(frozen=True)
class Blend:
    """--data-path as Megatron reads it (megatron/core/datasets/utils.py get_blend_from_list): its sources, and their
    weights (None: each weighs its size in samples)."""
    paths: tuple
    weights: tuple | None = None


def parse_blend(entries) -> Blend | None:
    """--data-path's entries -> Blend: one source `A`; several `A B C` (weighted by their sizes); or weight-source
    pairs `0.3 A 0.7 B` — an even count whose every other entry, from the first, is a number (Megatron's rule). A str
    is one source. A source is anything load_documents reads, or a Megatron PREFIX (.bin/.idx)."""
    if entries is None:
        return None
    entries = [entries] if isinstance(entries, str) else [str(e).strip() for e in entries]
    if not entries:
        return None
    if len(entries) % 2 == 0:
        numbers = [_number(e) for e in entries[::2]]
        if all(w is not None for w in numbers):
            bad = [(w, p) for w, p in zip(numbers, entries[1::2]) if not (math.isfinite(w) and w > 0)]
            if bad:
                raise DataError(f"--data-path: weight {bad[0][0]} of {bad[0][1]} must be > 0 (leave a source out "
                                "instead)")
            return Blend(tuple(entries[1::2]), tuple(numbers))
        if any(w is not None for w in numbers):
            raise DataError(f"--data-path {' '.join(entries)}: either weight-source pairs (0.3 A 0.7 B) or sources "
                            "only (A B), not a mix")
    return Blend(tuple(entries))


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


class BlendedDataset:
    """Megatron's BlendedDataset (megatron/core/datasets/blended_dataset.py): its sample i is sample
    dataset_sample_index[i] of dataset dataset_index[i], chosen by Megatron's greedy rule (helpers.cpp
    build_blending_indices): at sample i take the dataset whose count lags its share the most,
        d = argmax_d (w_d · max(i, 1) - n_d)    (the first on a tie),  n_d += 1,
    with the weights normalized (w / sum). The rule looks only at the samples before i, so the index grows on demand
    and sample i depends on the weights and i alone, never on the run's length or layout. A member dataset serves
    any index (its own epochs), as Megatron sizes its members to the blend. len(): the members' samples in all."""

    def __init__(self, datasets, weights):
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"a blend needs one weight per dataset: {len(datasets)} datasets, {len(weights)} weights")
        self.datasets, self.weights = list(datasets), normalize(weights)
        self.dataset_index, self.dataset_sample_index = [], []
        self._counts = [0] * len(datasets)

    def __len__(self):
        return sum(len(d) for d in self.datasets)

    def _grow(self, size: int):
        """Extend the blending index to `size` samples (Megatron's loop, continued from where it stopped)."""
        w, n = self.weights, self._counts
        for i in range(len(self.dataset_index), size):
            x = max(float(i), 1.0)
            d = max(range(len(w)), key=lambda k: (w[k] * x - n[k], -k))  # the first of equal errors
            self.dataset_index.append(d)
            self.dataset_sample_index.append(n[d])
            n[d] += 1

    def __getitem__(self, i):
        if i < 0:
            raise IndexError(f"sample index {i} is negative")
        if i >= len(self.dataset_index):
            self._grow(max(int(i) + 1, 2 * len(self.dataset_index), 1024))
        return self.datasets[self.dataset_index[i]][self.dataset_sample_index[i]]


MOCK_DOCUMENTS = 1000  # of Megatron's 100,000 (our GPTDataset holds its documents' token stream in memory)


class MockDocuments:
    """--mock-data's documents: Megatron's (gpt_dataset.py MockGPTLowLevelDataset) — document d is the tokens 1, 2,
    ..., L_d - 1 then eod, with the lengths L = numpy.random.default_rng(0).integers(1, 4096, 100000) — of which the
    first MOCK_DOCUMENTS."""

    def __init__(self, eod: int, n: int = MOCK_DOCUMENTS):
        self.eod = eod
        self.lengths = np.random.default_rng(0).integers(low=1, high=4096, size=100000, dtype=np.int32)[:n]

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, d):
        return np.concatenate([np.arange(self.lengths[d] - 1) + 1, [self.eod]]).astype(np.int64)


@dataclass(frozen=True)
class Corpus:
    """What build_data finds and makes, passed on (args stay as parsed): the tokenizer, the model's vocabulary size
    (--vocab-size, else the tokenizer's), its end-of-document id (Megatron's tokenizer.eod), and the train, valid and
    test datasets (None for a post-training task, which makes its own samples: posttraining/recipes.py; test: None without a test
    part in --split)."""
    tokenizer: Tokenizer
    vocab_size: int
    eod: int
    train: object = None
    valid: object = None
    test: object = None


def _is_prefix(path) -> bool:
    """A Megatron PREFIX: no file or directory of that name, but PREFIX.idx."""
    return not os.path.exists(path) and os.path.exists(path + ".idx")


def _documents_key(docs) -> str:
    h = hashlib.sha256(str(len(docs)).encode())
    for d in docs:
        h.update(d.encode("utf-8", errors="surrogatepass"))
    return h.hexdigest()[:16]


def _corpus_tokenizer(args, texts, prefixes, tokenizer_file, vocab_size, cache, samples):
    """The run's tokenizer: --tokenizer-type's (checked against the run it resumes), else `tokenizer_file`
    (--tokenizer-file, or the tokenizer.json of the run it starts from), else the one a Megatron PREFIX was made with
    (PREFIX.tokenizer.json, data.py preprocess's), else a BPE of `vocab_size` (8192) trained on the text sources
    (the default corpus when there is none)."""
    if args.tokenizer_type:
        tok = megatron_tokenizer(args)
        if tokenizer_file and tokenizer_file != args.tokenizer_file:  # the run it resumes or starts from
            saved = get_tokenizer(None, None, tokenizer_file=tokenizer_file)
            if saved.get_vocab() != tok.get_vocab() or roles_of(saved) != roles_of(tok):
                raise DataError(f"--tokenizer-type {args.tokenizer_type}: not the tokenizer of the run it starts from "
                                f"({tokenizer_file})")
        return tok
    if tokenizer_file:
        return get_tokenizer(None, None, tokenizer_file=tokenizer_file)
    if samples and prefixes:
        files = [p + ".tokenizer.json" for p in prefixes]  # data.py preprocess writes it there
        if not all(os.path.exists(f) for f in files):
            first = next(p for p, f in zip(prefixes, files) if not os.path.exists(f))
            raise DataError(f"{first}.bin/.idx needs the tokenizer it was made with: pass --tokenizer-file or "
                            "--tokenizer-type")
        toks = [get_tokenizer(None, None, tokenizer_file=f) for f in files]
        if any(tokenizer_text(t) != tokenizer_text(toks[0]) for t in toks):
            raise DataError(f"--data-path: {', '.join(prefixes)} were made with different tokenizers")
        return toks[0]
    docs = [d for p in texts for d in texts[p]] if samples and texts else load_documents(None)
    v = vocab_size or 8192
    return get_tokenizer(docs, str(cache / f"{_documents_key(docs)}-bpe{v}.json"), v)


def build_data(args, dataset=None, tokenizer_file=None, vocab_size=None, samples: bool = True) -> Corpus:
    """train.py's data from the flags (--data-path, --mock-data, --json-keys, --split, --seq-length, --seed,
    --data-cache-path, the tokenizer's): the tokenizer (_corpus_tokenizer), and each split's samples
    `dataset(source, doc_ids, args, tok, seed)` make (the model file's hook; default GPT windows). A blend of sources
    (parse_blend) splits each source's documents by --split and blends each split with Megatron's rule
    (BlendedDataset). Runs on every rank; a file lock lets one rank build the caches. samples=False (post-training
    tasks): the tokenizer only — --tokenizer-type's, `tokenizer_file`'s (a base run's), or the default corpus's BPE."""
    dataset = dataset or (lambda source, ids, args, tok, seed: GPTDataset(source, ids, args.seq_length, seed))
    mock = getattr(args, "mock_data", False)
    blend = parse_blend(args.data_path) if samples and not mock else None
    paths = list(blend.paths) if blend else [None] if samples and not mock else []
    cache = Path(args.data_cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # torchrun's ranks on one node: the first builds, the others read
        prefixes = [p for p in paths if p is not None and _is_prefix(p)]
        mmap = getattr(args, "mmap_bin_files", True)  # --no-mmap-bin-files: read the .bin files into memory
        indexed = {p: IndexedDataset(p, mmap) for p in prefixes}  # (a malformed one is named before its tokenizer)
        texts = {p: load_documents(p, tuple(args.json_keys)) for p in paths if p not in prefixes}
        tok = _corpus_tokenizer(args, texts, prefixes, tokenizer_file, vocab_size, cache, samples)
        tok_key = hashlib.sha256(tokenizer_text(tok).encode()).hexdigest()[:8]
        sources = [indexed[p] if p in prefixes else build_token_cache(
            None, None, tok, str(cache / f"{_documents_key(texts[p])}-{tok_key}-tokens"), documents=texts[p], mmap=mmap)
            for p in paths]
    n_tok = tok.get_vocab_size()
    for p, source in zip(paths, sources):
        top = int(source._bin.max()) if p in prefixes and len(source._bin) else 0
        if top >= n_tok:
            raise DataError(f"{p}.bin holds token id {top}, outside the tokenizer's vocabulary of {n_tok} "
                            f"({tokenizer_file or args.tokenizer_type or p + '.tokenizer.json'})")
    if args.tokenizer_type:  # Megatron's: the model's vocabulary is the tokenizer's
        if args.tokenizer_type != "NullTokenizer" and args.vocab_size is not None:
            note(f"--vocab-size {args.vocab_size} is not read with --tokenizer-type {args.tokenizer_type} (Megatron "
                 f"reads it for NullTokenizer only): the vocabulary is the tokenizer's {n_tok}")
        vocab_size = n_tok
    if vocab_size is not None and vocab_size < n_tok:
        raise DataError(f"the tokenizer has {n_tok} tokens, more than the model's --vocab-size={vocab_size}"
                        f" (tokenizer: {tokenizer_file or 'trained BPE'})")
    corpus = Corpus(tok, vocab_size or n_tok, special_ids(tok)["eod"])
    if not samples:
        return corpus
    if mock:
        sources = [MockDocuments(corpus.eod)]
        if n_tok < 4096:
            raise DataError(f"--mock-data: Megatron's mock documents count up to 4094, so the vocabulary must hold 4095 "
                            f"ids and eod; the tokenizer has {n_tok}")
        note(f"--mock-data: the first {MOCK_DOCUMENTS} of Megatron's 100,000 mock documents (tokens 1, 2, ..., then "
             "eod; numpy seed 0)")
    splits = [split_documents(len(s), args.valid_fraction, args.seed, getattr(args, "test_fraction", 0.0))
              for s in sources]
    made = []
    for k, (name, seed) in enumerate([("train", args.seed), ("valid", args.seed + 1), ("test", args.seed + 2)]):
        members = []
        for j, (source, ids) in enumerate(zip(sources, (s[k] for s in splits))):
            if len(ids):
                try:
                    members.append((j, dataset(source, ids, args, tok, seed)))
                except DataError as e:
                    where = f" of {paths[j]}" if len(paths) > 1 else ""
                    raise DataError(f"the {name} split{where} (--split {args.split}: {len(ids)} documents): {e}") \
                        from None
        members = [(j, ds) for j, ds in members if len(ds)]
        if len(members) > 1:  # Megatron: the given weights (normalized), else each member's size
            weights = [normalize(blend.weights)[j] for j, _ in members] if blend.weights else \
                [len(ds) for _, ds in members]
            made.append(BlendedDataset([ds for _, ds in members], weights))
        else:
            made.append(members[0][1] if members else None)
    train, valid, test = made
    if valid is None and args.eval_iters > 0 and int(os.environ.get("RANK", 0)) == 0:
        print(f"WARNING: the validation set is empty (--split={args.split} leaves no validation document: a corpus of "
              "one document?): evaluation is off", flush=True)
    return dataclasses.replace(corpus, train=train, valid=valid, test=test)


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
    """The packed-document flags with the tokenizer's eod id, for the GPT recipe (config.next_token_loss):
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
