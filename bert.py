"""bert.py — BERT: only what it adds to the transformer of gpt.py.

  token-type embeddings (gpt.Embedding with num_tokentypes), bidirectional attention with a padding mask,
  the masked-LM head (dense -> GeLU -> LayerNorm -> output layer tied to the word embeddings, with a bias),
  the pooler + binary head (next-sentence / sentence-order prediction), and the MLM + SOP data recipe.
Mirrors Megatron-LM's megatron/core/models/bert/bert_model.py, bert_lm_head.py, pooler.py and
megatron/core/datasets/bert_dataset.py, masked_dataset.py (same parameter names: embedding.tokentype_embeddings,
lm_head.dense, lm_head.layer_norm, output_layer.bias, pooler.dense, binary_head; `from_megatron` loads a BertModel).
Papers: Devlin et al. 2018, "BERT" (MLM, NSP); Lan et al. 2019, "ALBERT" (SOP: sentence order instead of NSP).

Run:    make train MODEL=bert        (or: .venv/bin/python train.py --model bert ...)

Pre-LN (Megatron-core's, the default) or post-LN (original BERT's, from Hugging Face): DESIGN.md §9, "BERT".

Dimension glossary: gpt.py's (b batch, s sequence, h hidden, V vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import data
import gpt
import metrics
import parallel as P
import transformer
from interop import convert, tokenizer_files


@dataclass
class Config(gpt.Config):
    """gpt.Config + BERT's fields. The inherited defaults (learned positions, LayerNorm, GeLU, tied output) are BERT's."""
    UNSUPPORTED: ClassVar[dict] = {
        "document_packing": "BERT's samples are sentence pairs with their own padding mask (BertDataset), not windows "
                            "of packed documents",
        "post_training": "the post-training tasks score the next-token log-probs of a causal decoder; BERT is a "
                         "bidirectional masked LM", **gpt.DEEPSEEK_UNSUPPORTED}
    add_binary_head: bool = True  # False = Megatron's --bert-no-binary-head
    num_tokentypes: int | None = None  # None = 2 with the binary head, else 0 (Megatron's rule)

    def __post_init__(self):
        if self.num_tokentypes is None:
            self.num_tokentypes = 2 if self.add_binary_head else 0
        if self.add_binary_head and self.num_tokentypes < 2:
            raise ValueError(f"the binary head needs num_tokentypes >= 2 (segments A and B), got {self.num_tokentypes}")
        super().__post_init__()

    def check_context_parallel(self, cp: int, tp: int = 1):
        if cp > 1 and self.add_binary_head:
            raise ValueError(f"BERT's binary head pools [CLS], which only cp rank 0 holds: context-parallel size {cp} "
                             "needs add_binary_head=False (--bert-no-binary-head)")
        super().check_context_parallel(cp, tp)


def _linear(c: Config, i: int, o: int, sequence_parallel=False) -> nn.Linear:
    """A replicated Linear (Megatron's get_linear_layer). Under SP, one that sees s/tp tokens has partial grads."""
    m = nn.Linear(i, o, dtype=c.params_dtype)
    P.mark(m.weight, ("normal", c.init_method_std), sequence_parallel=sequence_parallel)
    P.mark(m.bias, ("zeros",), sequence_parallel=sequence_parallel)
    return m


class BertLMHead(nn.Module):
    """[s(/tp), b, h] -> dense -> GeLU -> LayerNorm -> [s(/tp), b, h]; the output layer follows."""

    def __init__(self, c: Config):
        super().__init__()
        self.dense = _linear(c, c.hidden_size, c.hidden_size, sequence_parallel=c.sequence_parallel)
        self.layer_norm = transformer.Norm(c)

    def forward(self, x):
        return self.layer_norm(F.gelu(self.dense(x)))


class Pooler(nn.Module):
    """tanh(dense(h[CLS])): [s(/tp), b, h] -> [b, h]. Under SP every rank gathers the sequence, then pools the same."""

    def __init__(self, c: Config, grid=None):
        super().__init__()
        self.dense, self.tp, self.sp = _linear(c, c.hidden_size, c.hidden_size), P.tp_of(grid), c.sequence_parallel

    def forward(self, x):
        if self.sp:  # every rank goes on with the same full tensor: backward keeps this rank's slice of the grad
            x = P.gather_from_sp(x, self.tp, tp_output_grad=False)
        return torch.tanh(self.dense(x[0]))


class Model(gpt.Model):
    """BERT. forward(input_ids [b, s], attention_mask [b, s] (1 = real token), tokentype_ids [b, s], lm_labels [b, s])
    -> (lm_logits [b, s, vocab_size] or lm_loss [b, s], binary_logits [b, 2] or None). Pipeline stages as gpt.Model;
    every stage needs attention_mask (stages > 0 read their hidden states from `self.input_tensor`)."""

    def build_output_layer(self, c: Config, grid):  # gpt's output layer, with a bias, and BERT's heads
        super().build_output_layer(c, grid)
        tp = grid.tp_size if grid is not None else 1
        self.lm_head = BertLMHead(c)
        self.output_layer.bias = P.mark(nn.Parameter(torch.empty(c.padded_vocab_size // tp, dtype=c.params_dtype)),
                                        ("zeros",), partition_dim=0)
        if c.add_binary_head:
            self.pooler = Pooler(c, grid)
            self.binary_head = _linear(c, c.hidden_size, 2)
            self.binary_head.weight.hidden_matrix = False  # a classifier, as the output layer: AdamW's under Muon

    def logits(self, x):  # the masked-LM head, then gpt's (tied) output layer, with its bias
        return super().logits(self.lm_head(x))

    def encode(self, input_ids, attention_mask=None, tokentype_ids=None):
        """The encoder's hidden states [s(/tp), b, h], after the final norm on the last stage: what the heads read."""
        self.check_input(input_ids)
        c = self.config
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        mask = (attention_mask > 0.5)[:, None, None, :]  # [b, 1, 1, s] True = attend: padded keys are never seen
        if tokentype_ids is not None and c.num_tokentypes == 0:
            raise ValueError("tokentype_ids given, but the model has num_tokentypes=0 (no binary head)")
        if tokentype_ids is None and c.num_tokentypes > 0:
            tokentype_ids = torch.zeros_like(input_ids)  # Hugging Face's default: all segment A
        # context parallelism: this rank's 2 of 2·cp chunks [b, s/cp], the key mask's columns in cp order (parallel.py)
        input_ids, _, position_ids, rope, mask = P.get_batch_on_this_cp_rank(
            self.grid, input_ids, None, None, self.rope(input_ids.shape[1], input_ids.device), mask)
        if self.pre_process:
            x = self.embedding(input_ids, position_ids, P.cp_split(self.grid, tokentype_ids))  # [s(/cp)(/tp), b, h]
        else:
            x = self.input_tensor
        return self.decoder(x, rope=rope, mask=mask)  # not causal: a mask

    def forward(self, input_ids, attention_mask=None, tokentype_ids=None, lm_labels=None):
        x = self.encode(input_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return x
        binary_logits = self.binary_head(self.pooler(x)) if self.config.add_binary_head else None  # [b, 2]
        return self.postprocess(x, P.cp_split(self.grid, lm_labels)), binary_logits


# ---------------------------------------------------------------------------------------------- the loss
def loss_func(model, mb, num_masked, num_seqs):
    """The schedule's per-micro-batch SUM for the global-batch rule (DESIGN.md §2), to be divided by num_masked:
        loss = Σ masked-LM token losses / num_masked + Σ binary losses / num_seqs      (global counts)
    so this returns Σ lm + Σ binary · num_masked / num_seqs. mb: int [b, 6, s] (ROWS); on inner pipeline stages
    it returns the hidden states."""
    types = mb[:, TYPES] if model.config.num_tokentypes > 0 else None
    out = model(mb[:, TEXT], mb[:, PADDING_MASK], types, lm_labels=mb[:, LABELS])
    if not model.post_process:
        return out
    lm_loss, binary_logits = (_fp32(t) for t in out)
    total = (lm_loss * P.cp_split(model.grid, mb[:, LOSS_MASK])).sum()  # (this cp rank's tokens)
    if binary_logits is not None:
        sop = F.cross_entropy(binary_logits, mb[:, IS_RANDOM, 0], reduction="sum")
        total = total + sop * (float(num_masked) / float(num_seqs))
    return total


def _fp32(t):  # losses in at least float32 (bf16/fp16 runs), float64 stays float64
    return t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t


def num_masked_tokens(batch) -> int:
    """The masked-LM loss tokens of a (global) batch [B, 6, s]: the denominator of the loss."""
    return int(batch[:, LOSS_MASK].sum())


# ---------------------------------------------------------------------------------------------- the data recipe
ROWS = ("text", "types", "padding_mask", "labels", "loss_mask", "is_random")  # Megatron's BERT sample keys
TEXT, TYPES, PADDING_MASK, LABELS, LOSS_MASK, IS_RANDOM = range(len(ROWS))
# A sample is one int64 array [6, s], so GPT's batching (data.global_batch, DP and micro-batch slicing) carries it.


def make_bert_sample(tokens, seq_length, special, rng, random_ids, binary_head=True, masking_probability=0.15,
                     word_starts=None):
    """One sample from a span of a document's tokens (no eod): [cls] A [sep] B [sep] pad..., int64 [6, s].

    Sentence order (SOP, as Megatron's BERTMaskedWordPieceDataset): the span is cut at a random point into A and B
    (consecutive text); with probability 1/2 they are swapped and is_random = 1. Masked LM: round(15%) of the real,
    non-special tokens are predicted (at least 1); each is replaced by [mask] 80%, kept 10%, a random token from
    `random_ids` 10%. word_starts (bool [V]): whole-word masking — whole words are picked until the count is reached.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    n_extra = 3 if binary_head else 2
    if len(tokens) + n_extra > seq_length or len(tokens) < (2 if binary_head else 1):
        raise ValueError(f"a span of {len(tokens)} tokens does not fit seq_length={seq_length} "
                         f"(needs 1..{seq_length - n_extra}, and >= 2 with the binary head)")
    cls, sep, pad, msk = special["cls"], special["sep"], special["pad"], special["mask"]
    is_random = 0
    if binary_head:
        cut = int(rng.integers(1, len(tokens)))
        a, b = tokens[:cut], tokens[cut:]
        if rng.random() < 0.5:
            a, b, is_random = b, a, 1
        text = np.concatenate([[cls], a, [sep], b, [sep]])
        types = np.concatenate([np.zeros(len(a) + 2, np.int64), np.ones(len(b) + 1, np.int64)])
    else:
        text, types = np.concatenate([[cls], tokens, [sep]]), np.zeros(len(tokens) + 2, np.int64)
    n = len(text)
    candidates = np.flatnonzero((text != cls) & (text != sep))
    if word_starts is None:
        words = [candidates[i:i + 1] for i in range(len(candidates))]
    else:  # a word = a run of adjacent candidate positions that starts at a word-start token
        new = word_starts[text[candidates[1:]]] | (np.diff(candidates) != 1)
        words = np.split(candidates, np.flatnonzero(new) + 1)
    n_predict = max(1, int(round(len(candidates) * masking_probability)))
    picked = []
    for w in rng.permutation(len(words)):
        if len(picked) + len(words[w]) > n_predict and picked:
            continue
        picked.extend(words[w])
        if len(picked) >= n_predict:
            break
    picked = np.sort(np.array(picked, dtype=np.int64))
    labels, loss_mask, masked = text.copy(), np.zeros(n, np.int64), text.copy()
    loss_mask[picked] = 1
    r = rng.random(len(picked))
    masked[picked[r < 0.8]] = msk  # 80% [mask]; 0.8 <= r < 0.9 keeps the token (10%)
    rand = picked[r >= 0.9]  # 10% a random token
    masked[rand] = random_ids[rng.integers(0, len(random_ids), len(rand))]
    out = np.zeros((len(ROWS), seq_length), np.int64)
    out[TEXT], out[LABELS] = pad, pad
    out[TEXT, :n], out[TYPES, :n], out[PADDING_MASK, :n] = masked, types, 1
    out[LABELS, :n], out[LOSS_MASK, :n], out[IS_RANDOM] = labels, loss_mask, is_random
    return out


class BertDataset:
    """BERT samples from tokenized documents: each document (minus its eod) is cut into spans of up to
    seq_length − 3 tokens (one sample each); with probability short_seq_prob a sample keeps only a random shorter
    prefix (Megatron's short_seq_prob), so batches hold padding. Sample i is deterministic in (seed, i) — the span
    order is a permutation seeded by seed + epoch, the masking an RNG seeded by (seed, i) — never the layout."""

    def __init__(self, source, doc_ids, seq_length, seed, special, vocab_size, binary_head=True,
                 short_seq_prob=0.1, masking_probability=0.15, word_starts=None):
        self.source, self.seq_length, self.seed, self.special = source, seq_length, seed, special
        self.binary_head, self.short_seq_prob, self.p, self.word_starts = (binary_head, short_seq_prob,
                                                                           masking_probability, word_starts)
        self.max_len, self.min_len = seq_length - (3 if binary_head else 2), 2 if binary_head else 1
        if self.max_len < self.min_len:
            raise ValueError(f"seq_length={seq_length} is too short for a BERT sample")
        specials = [v for k, v in special.items() if k != "sentinels"] + list(special.get("sentinels", []))
        self.random_ids = np.setdiff1d(np.arange(vocab_size), specials)
        spans = []
        for d in doc_ids:
            n = len(source[int(d)])
            n -= int(n > 0 and source[int(d)][-1] == special["eod"])
            spans += [(int(d), s, min(self.max_len, n - s)) for s in range(0, n, self.max_len)
                      if n - s >= self.min_len]
        if not spans:
            raise ValueError(f"no span of >= {self.min_len} tokens in {len(doc_ids)} documents")
        self.spans = np.array(spans, dtype=np.int64)  # (document, start, length)
        self._epoch, self._perm = None, None

    def __len__(self):
        return len(self.spans)

    def __getitem__(self, i):
        epoch, j = divmod(int(i), len(self.spans))
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng(self.seed + epoch).permutation(len(self.spans))
        d, start, length = self.spans[self._perm[j]]
        rng = np.random.default_rng([self.seed, int(i)])
        if rng.random() < self.short_seq_prob and length > self.min_len:
            length = int(rng.integers(self.min_len, length))
        tokens = self.source[int(d)][start:start + length]
        return make_bert_sample(tokens, self.seq_length, self.special, rng, self.random_ids, self.binary_head,
                                self.p, self.word_starts)


def mlm_batch(dataset: BertDataset, iteration: int, global_batch_size: int) -> torch.Tensor:
    """The global batch of `iteration`: int64 [global_batch_size, 6, s], a function of (seed, iteration) only."""
    return data.global_batch(dataset, start=iteration * global_batch_size, size=global_batch_size)


# ---------------------------------------------------------------------------------------------- train.py's hooks
# `make train MODEL=bert`: BERT's LayerNorm / GeLU / biases, but RoPE; Muon at 5e-3 (why: DESIGN.md §9, "BERT")
TRAIN_DEFAULTS = dict(position_embedding_type="rope", normalization="LayerNorm", swiglu=False,
                      disable_bias_linear=False, optimizer="muon", lr=5e-3, min_lr=5e-4)
OPTIMIZER_DEFAULTS = dict(adam=dict(lr=2.5e-4, min_lr=2.5e-5))


def add_arguments(p):
    """BERT's own flag (Megatron's)."""
    p.add_argument("--bert-no-binary-head", action="store_true", help="masked LM only, no sentence-order head")


ARCH_FLAGS = ("bert_no_binary_head",)  # the binary head's weights exist or not


def config_fields(args, tok) -> dict:
    return {"add_binary_head": not args.bert_no_binary_head}


def dataset(source, doc_ids, args, tok, seed) -> BertDataset:
    return BertDataset(source, doc_ids, args.seq_length, seed, tokenizer_files.special_ids(tok), tok.get_vocab_size(),
                       binary_head=not args.bert_no_binary_head)


def batch_recipe(batch, args=None, corpus=None):
    """(loss_func(model, mb) -> SUM, its divisor: the masked tokens of the global batch [B, 6, s])."""
    num_masked, num_seqs = num_masked_tokens(batch), batch.shape[0]
    return (lambda model, mb: loss_func(model, mb, num_masked, num_seqs)), num_masked


def flops(c: Config, B: int, s: int) -> float:
    """Model FLOPs of one iteration on B sequences of s tokens: our count, not Megatron's GPT formula (DESIGN.md
    §6): bidirectional attention over the full s x s square, the LM head and logits on every token, the pooler and
    binary head once per sequence. metrics.py's conventions (forward multiply-adds x 2 x 3)."""
    h = c.hidden_size
    per_token = (sum(metrics.self_attention_flops(c, s, causal=False) + metrics.mlp_flops(c, c.is_moe_layer(i))
                     for i in range(c.num_layers)) + h * h + h * c.padded_vocab_size)
    per_sequence = h * h + h * 2 if c.add_binary_head else 0
    return 3 * 2 * B * (s * per_token + per_sequence)


@torch.no_grad()
def sample(model: Model, tok, prompt: str, max_new_tokens: int = 0, temperature: float = 0.0, top_k: int | None = None
           ) -> str:
    """tools.py sample for BERT (a masked LM: it fills blanks, it does not continue text): every <mask> in the prompt
    (one appended if it has none) replaced by the model's prediction — the most likely token at temperature 0, else
    one sampled (top-k) — as pretraining saw it: [CLS] prompt [SEP]; never a special token (it would print as
    nothing). max_new_tokens is not used."""
    sp = tokenizer_files.special_ids(tok)
    ids = tok.encode(prompt, add_special_tokens=False).ids  # "<mask>" in the text is the mask token
    if sp["mask"] not in ids:
        ids.append(sp["mask"])
    ids = torch.tensor([[sp["cls"], *ids, sp["sep"]]])
    logits, _ = model.eval()(ids)  # [1, s, V]
    at = (ids[0] == sp["mask"]).nonzero()[:, 0]
    filled = ids[0].clone()
    specials = [sp[r] for r in tokenizer_files.ROLES] + sp["sentinels"]
    filled[at] = gpt.sample_next(logits[0, at].index_fill(-1, torch.tensor(specials), -torch.inf), temperature,
                                 top_k)[:, 0]
    shown = [f"[{tok.decode([int(t)])}]" if i in at else tok.decode([int(t)]) for i, t in enumerate(filled[1:-1], 1)]
    return "".join(shown)


def eval_counts(model, mb) -> dict:
    return {"mlm_accuracy": mlm_accuracy(model, mb)}


@torch.no_grad()
def mlm_accuracy(model, batch) -> tuple[int, int]:
    """(correct, total) masked-token predictions of a batch [B, 6, s] (argmax over the real vocabulary)."""
    types = batch[:, TYPES] if model.config.num_tokentypes > 0 else None
    logits, _ = model(batch[:, TEXT], batch[:, PADDING_MASK], types)
    m, labels = P.cp_split(model.grid, batch[:, LOSS_MASK]).bool(), P.cp_split(model.grid, batch[:, LABELS])
    return int((logits.argmax(-1)[m] == labels[m]).sum()), int(m.sum())


# ---------------------------------------------------------------------------------------------- checkpoints (interop/convert.py)
_H, _O = r"bert\.encoder\.layer\.(\d+)\.", r"decoder.layers.\1."
HF_RENAMES = [  # BertForPreTraining (BertForMaskedLM: no binary head) -> ours; post-LN: layer i's input_layernorm is LN_emb
    # (i = 0) or layer i-1's output LayerNorm (hf_to_ours moves the last one to decoder.final_layernorm)
    (r"bert\.embeddings\.(word|position)_embeddings\.weight", r"embedding.\1_embeddings.weight"),
    (r"bert\.embeddings\.token_type_embeddings\.weight", "embedding.tokentype_embeddings.weight"),
    (r"bert\.embeddings\.LayerNorm\.(\w+)", r"decoder.layers.0.input_layernorm.\1"),
    (_H + r"output\.LayerNorm\.(\w+)", lambda m: f"decoder.layers.{int(m[1]) + 1}.input_layernorm.{m[2]}"),
    (_H + r"attention\.self\.(query|key|value)\.(\w+)", _O + r"self_attention.linear_qkv.\3:\2"),
    (_H + r"attention\.output\.dense\.(\w+)", _O + r"self_attention.linear_proj.\2"),
    (_H + r"attention\.output\.LayerNorm\.(\w+)", _O + r"pre_mlp_layernorm.\2"),
    (_H + r"intermediate\.dense\.(\w+)", _O + r"mlp.linear_fc1.\2"), (_H + r"output\.dense\.(\w+)", _O + r"mlp.linear_fc2.\2"),
    (r"cls\.predictions\.transform\.dense\.(\w+)", r"lm_head.dense.\1"),
    (r"cls\.predictions\.transform\.LayerNorm\.(\w+)", r"lm_head.layer_norm.\1"),
    (r"cls\.predictions\.bias", "output_layer.bias"), (r"cls\.predictions\.decoder\.bias", None),  # (the same bias)
    (r"cls\.predictions\.decoder\.weight", "output_layer.weight"),
    (r"bert\.pooler\.dense\.(\w+)", r"pooler.dense.\1"), (r"cls\.seq_relationship\.(\w+)", r"binary_head.\1")]


def hf_to_ours(src, Config, dtype=None) -> tuple:
    """(Config, full state dict) of a `transformers` BertForPreTraining or BertForMaskedLM (logits match)."""
    hc = src.config
    convert.refuse("bert.from_hf", convert.unlike(hc, dict(model_type="bert", position_embedding_type="absolute")))
    full = convert.renamed(src.state_dict(), HF_RENAMES, "bert.from_hf")
    L = hc.num_hidden_layers
    full = {k.replace(f"decoder.layers.{L}.input_layernorm.", "decoder.final_layernorm."): v for k, v in full.items()}
    c = convert.config_from(Config, src, dtype, dict(convert.HF_FIELDS, layernorm_epsilon="layer_norm_eps",
                                                     num_tokentypes="type_vocab_size"),
                            activation={"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}[hc.hidden_act],
                            add_binary_head="binary_head.weight" in full, apply_residual_connection_post_layernorm=True,
                            share_embeddings_and_output_weights=bool(getattr(hc, "tie_word_embeddings", True)))
    qkv = lambda *t: convert.per_group(*t, groups=c.num_attention_heads)  # [q; k; v] -> per head [q_h; k_h; v_h]
    return c, convert.vocab(c, convert.joined(full, ("query", "key", "value"), qkv))


HF_CONVERTERS = {"bert": hf_to_ours}  # model_type -> converter (interop/hf.py)
from_hf = convert.hf_loader(Model, Config, HF_CONVERTERS, "bert")  # a BertForPreTraining (BertForMaskedLM) -> Model


def from_megatron(state_dict: dict, config: Config, grid=None) -> Model:
    """A Model with the weights of a Megatron-core BertModel, from its full state dict. Names and layouts are
    Megatron's but one: its layer stack is `encoder`, ours (gpt.Model's) `decoder`. Megatron's own mask masks padded
    queries as well as keys: their rows differ from ours, real tokens' do not."""
    full = convert.megatron_state(state_dict, config, lambda k: "decoder." + k[8:] if k.startswith("encoder.") else k)
    return convert.load(Model(config, grid), full)
