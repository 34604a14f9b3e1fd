"""llava.py — LLaVA, a vision-language model: a CLIP ViT encoder, an MLP projector, and gpt.py's decoder.

  image [b, 3, H, W] -> patches (conv1) + class token + learned positions -> ln_pre -> ViT layers (pre-LN,
  bidirectional, quick-GELU) -> drop the class token (or keep it) -> projector (fc1, GeLU, fc2) -> one embedding per
  image token, spliced into the word embeddings where input_ids holds the image token -> the GPT/Llama decoder.
Mirrors Megatron-LM's megatron/core/models/multimodal/llava_model.py (LLaVAModel: drop_vision_class_token, freeze,
image_token_index), models/vision/clip_vit_model.py (CLIPViTModel: conv1, class_token, position_embeddings, ln_pre,
decoder) and models/vision/multimodal_projector.py (vision_projection.encoder.linear_fc1/fc2), with their parameter
names; the language model's are gpt.py's. `from_hf` loads a `transformers` LlavaForConditionalGeneration.
Papers: Liu et al. 2023, "Visual Instruction Tuning" (LLaVA, arXiv:2304.08485); Radford et al. 2021 (CLIP,
        arXiv:2103.00020); Dosovitskiy et al. 2020 (ViT, arXiv:2010.11929).

Run:    make train MODEL=llava        (or: .venv/bin/python train.py --model llava ...; see README)

Image tokens as Hugging Face's processor writes them (one per image embedding, replaced by it; Megatron's form: §4),
what TP and SP split, the data recipe and its text-only bound: DESIGN.md §9, "LLaVA".

Dimension glossary (on top of gpt.py's b, s, h, V)
  H, W image height, width    p patch size (patch_dim)    P = (H/p)·(W/p) patches    sv = P + 1 ViT tokens (class)
  hv ViT hidden    n_img image embeddings per image: P (class token dropped) or P + 1
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import types
import zlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import data
import gpt
import parallel as P
import transformer
from interop import convert, hf, tokenizer_files

IMAGE_TOKEN = "<extra_id_99>"  # the placeholder: our tokenizers have no <image>, so the last T5 sentinel serves


@dataclass
class Config(gpt.Config):
    """gpt.Config (the language model) + the vision tower and LLaVA's own fields (Megatron's LLaVAModel names)."""
    UNSUPPORTED: ClassVar[dict] = {
        "pipeline_parallel": "LLaVA's vision tower and projector are not split into pipeline stages",
        "context_parallel": "LLaVA splices the image's embeddings into the whole text sequence before the decoder; "
                            "that splice is not split over cp ranks",
        "document_packing": "LLaVA's samples are an image and its caption (CaptionDataset), not packed documents",
        "post_training": "the post-training tasks' samples have no images", **gpt.DEEPSEEK_UNSUPPORTED}
    img_h: int = 32
    img_w: int = 32
    patch_dim: int = 8
    vision_num_layers: int = 2  # the layers whose output is used (Hugging Face's vision_feature_layer cuts there)
    vision_hidden_size: int = 128
    vision_num_attention_heads: int = 4
    vision_ffn_hidden_size: int | None = None  # None = 4·hv
    vision_activation: str = "quick_gelu"  # CLIP's
    vision_layernorm_epsilon: float = 1e-5
    drop_vision_class_token: bool = False  # Megatron's --disable-vision-class-token (Hugging Face's "default")
    image_token_index: int = tokenizer_files.SPECIAL_TOKENS.index(IMAGE_TOKEN)  # the id in our BPE (train.py: the tokenizer's)
    freeze_language_model: bool = False  # --freeze-LM: embedding, decoder, output layer
    freeze_vision_model: bool = False  # --freeze-ViT

    def __post_init__(self):
        super().__post_init__()
        sizes = ("img_h", "img_w", "patch_dim", "vision_num_layers", "vision_hidden_size", "vision_num_attention_heads")
        if small := {f: getattr(self, f) for f in sizes if getattr(self, f) < 1}:
            raise ValueError(f"{small} must be >= 1")
        self.vision_ffn_hidden_size = self.vision_ffn_hidden_size or 4 * self.vision_hidden_size
        if self.img_h % self.patch_dim or self.img_w % self.patch_dim:
            raise ValueError(f"img_h={self.img_h} and img_w={self.img_w} must be multiples of patch_dim={self.patch_dim}")
        if self.vision_hidden_size % self.vision_num_attention_heads:
            raise ValueError(f"vision_hidden_size={self.vision_hidden_size} is not divisible by "
                             f"vision_num_attention_heads={self.vision_num_attention_heads}")
        if self.vision_activation not in transformer.ACTIVATIONS:
            raise ValueError(f"vision_activation={self.vision_activation!r} is not one of {tuple(transformer.ACTIVATIONS)}")
        if not 0 <= self.image_token_index < self.vocab_size:
            raise ValueError(f"image_token_index={self.image_token_index} is outside vocab_size={self.vocab_size}")

    @property
    def num_image_tokens(self) -> int:
        """n_img: the image embeddings (and image tokens) per image."""
        return (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim) + (not self.drop_vision_class_token)

    def vision_config(self) -> gpt.Config:
        """The ViT's layers as transformer.py builds them: LayerNorm, biases, no gating, no positions of their own."""
        return gpt.Config(
            num_layers=self.vision_num_layers, hidden_size=self.vision_hidden_size,
            num_attention_heads=self.vision_num_attention_heads, ffn_hidden_size=self.vision_ffn_hidden_size,
            position_embedding_type="none", normalization="LayerNorm", layernorm_epsilon=self.vision_layernorm_epsilon,
            activation=self.vision_activation, gated_linear_unit=False, add_bias_linear=True,
            hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
            init_method_std=self.init_method_std, sequence_parallel=self.sequence_parallel,
            params_dtype=self.params_dtype, seed=self.seed)

    def tp_split_sizes(self):
        return super().tp_split_sizes() + [("vision_num_attention_heads", self.vision_num_attention_heads),
                                           ("vision_ffn_hidden_size", self.vision_ffn_hidden_size),
                                           ("hidden_size (the projector's fc1)", self.hidden_size)]


# ---------------------------------------------------------------------------------------------- the two towers
class CLIPViT(nn.Module):
    """pixels [b, 3, H, W] -> image features [n_img, b, hv] (the output of the last layer, no final norm)."""

    def __init__(self, c: Config, grid, rng):
        super().__init__()
        vc, hv, p = c.vision_config(), c.vision_hidden_size, c.patch_dim
        self.c, self.tp = c, P.tp_of(grid)
        self.seq_length = (c.img_h // p) * (c.img_w // p) + 1  # sv: patches + the class token
        self.conv1 = P.mark(nn.Parameter(torch.empty(hv, 3, p, p, dtype=c.params_dtype)), ("normal", c.init_method_std))
        self.class_token = P.mark(nn.Parameter(torch.empty(1, 1, hv, dtype=c.params_dtype)), ("normal", c.init_method_std))
        self.position_embeddings = nn.Embedding(self.seq_length, hv, dtype=c.params_dtype)
        P.mark(self.position_embeddings.weight, ("normal", c.init_method_std))
        self.ln_pre = transformer.Norm(dataclasses.replace(vc, sequence_parallel=False))  # sees the whole sequence
        self.decoder = transformer.Decoder(vc, grid, rng, c.vision_num_layers, post_process=False)

    def forward(self, pixels):
        c, sv = self.c, self.seq_length
        x = rearrange(F.conv2d(pixels, self.conv1, stride=c.patch_dim), "b hv gh gw -> b (gh gw) hv")  # patches
        x = torch.cat([self.class_token.expand(len(x), -1, -1), x], dim=1)  # [b, sv, hv]
        x = self.ln_pre(x + self.position_embeddings.weight)
        tp = self.tp.size if (self.tp is not None and c.sequence_parallel) else 1
        pad = -sv % tp  # SP splits the sequence: pad it to a multiple of tp with rows no query attends to
        x = rearrange(F.pad(x, (0, 0, 0, pad)), "b s hv -> s b hv")
        if c.sequence_parallel:
            x = P.scatter_to_sp(x, self.tp)  # [(sv + pad)/tp, b, hv]
        keys = (torch.arange(sv + pad, device=x.device) < sv)[None, None, None, :]  # [1, 1, 1, sv+pad]: bidirectional
        x = self.decoder(x, mask=keys)
        if c.sequence_parallel:  # every rank goes on with the whole sequence; backward keeps this rank's slice
            x = P.gather_from_sp(x, self.tp, tp_output_grad=False)  # [sv + pad, b, hv]
        return x[int(c.drop_vision_class_token):sv]  # [n_img, b, hv]


class ProjectorMLP(nn.Module):
    """hv -> h -> h (column-, then row-parallel), GeLU between: Megatron's MultimodalProjector "mlp" (HF's
    multi_modal_projector linear_1 / linear_2)."""

    def __init__(self, c: Config, grid):
        super().__init__()
        kw = dict(grid=grid, bias=True, std=c.init_method_std, dtype=c.params_dtype)
        self.linear_fc1 = P.ColumnParallelLinear(c.vision_hidden_size, c.hidden_size, **kw)
        self.linear_fc2 = P.RowParallelLinear(c.hidden_size, c.hidden_size, **kw)

    def forward(self, x):  # [n_img, b, hv] (replicated) -> [n_img, b, h] (replicated)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class MultimodalProjector(nn.Module):
    def __init__(self, c: Config, grid):
        super().__init__()
        self.encoder = ProjectorMLP(c, grid)

    def forward(self, x):
        return self.encoder(x)


# ---------------------------------------------------------------------------------------------- the model
class Model(gpt.Model):
    """LLaVA. forward(input_ids [b, s], pixel_values [b, 3, H, W], labels [b, s] = None) -> logits [b, s,
    vocab_size], or the per-token loss [b, s], zero where the label is an image token. Each row of input_ids holds
    exactly num_image_tokens image tokens (image_token_index), which become its image's embeddings in order.
    gpt.Model's skeleton; build_decoder adds the towers (`vision_model`, `vision_projection`) before the decoder."""

    def __init__(self, config: Config, grid=None, pre_process=True, post_process=True, layer_offset=0,
                 num_layers=None):
        super().__init__(config, grid, pre_process, post_process, layer_offset, num_layers)  # (the whole model only)
        c = self.config
        frozen = ([self.embedding, self.decoder] + ([self.output_layer] if hasattr(self, "output_layer") else [])
                  if c.freeze_language_model else []) + ([self.vision_model] if c.freeze_vision_model else [])
        for module in frozen:  # Megatron's LLaVAModel.freeze: no gradient is computed, no optimizer state is kept
            module.requires_grad_(False)

    def build_decoder(self, c: Config, grid, layer_offset: int, num_layers: int) -> nn.Module:
        self.vision_model = CLIPViT(c, grid, self.rng)
        self.vision_projection = MultimodalProjector(c, grid)
        return super().build_decoder(c, grid, layer_offset, num_layers)

    def encode_images(self, pixel_values):
        """[b, 3, H, W] -> the projected image embeddings [b, n_img, h]."""
        c = self.config
        if tuple(pixel_values.shape[1:]) != (3, c.img_h, c.img_w):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected [b, 3, {c.img_h}, {c.img_w}]")
        x = self.vision_model(pixel_values.to(c.params_dtype))  # [n_img, b, hv]
        return rearrange(self.vision_projection(x), "n b h -> b n h")

    def embed(self, input_ids, images, position_ids):
        """gpt.Embedding with the image rows spliced in: ids, positions [b, s], images [k, n_img, h] -> [s(/tp), b, h].
        Each row holds one image's tokens (k = b), or serving/engine.py's packed row (b = 1) those of its k prefills' images."""
        c, b = self.config, input_ids.shape[0]
        is_image = input_ids == c.image_token_index  # [b, s]
        k, counts = 0 if images is None else images.shape[0], is_image.sum(1)
        if k != b and b != 1 or not bool((counts == c.num_image_tokens * (1 if k == b else k)).all()):
            raise ValueError(f"rows hold {counts.tolist()} image tokens (id {c.image_token_index}); each of the {k} "
                             f"images gives num_image_tokens={c.num_image_tokens} embeddings")
        x = self.embedding.word_embeddings(input_ids.masked_fill(is_image, 0))  # [b, s, h] (Megatron: image tokens 0)
        x = x.masked_scatter(is_image[..., None], images.to(x.dtype)) if k else x  # row by row, in order
        return self.embedding(input_ids, position_ids, words=x)

    def forward(self, input_ids, pixel_values=None, labels=None, position_ids=None, mask=None, inference_context=None):
        """position_ids, mask, inference_context: as gpt.Model.forward's (a KV cache; serving/engine.py's packed rows, whose
        pixel_values [k, 3, H, W] are the images of the row's prefills in order, None when it has no image token)."""
        self.check_input(input_ids, position_ids=position_ids)  # (before the embedding reads its positions' rows)
        s, t = input_ids.shape[1], inference_context.sequence_len_offset if inference_context is not None else 0
        position_ids = torch.arange(t, t + s, device=input_ids.device)[None] if position_ids is None else position_ids
        x = self.embed(input_ids, None if pixel_values is None else self.encode_images(pixel_values), position_ids)
        out = super().forward(input_ids, labels, position_ids, mask, inference_context, decoder_input=x)  # gpt's
        return out if labels is None else out * (labels != self.config.image_token_index)


# ---------------------------------------------------------------------------------------------- the data: shapes
# A scene is 1 or 2 objects, each a colour, a shape and a quadrant of the image (distinct quadrants); its caption
# names them in reading order, e.g. " top left: red circle; bottom right: blue square.", so the image determines it.
# Everything comes from the generator seeded (seed, sample index): a sample is the same in every layout, and its
# image can be drawn again anywhere.
COLOURS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0), "purple": (1, 0, 1),
           "white": (1, 1, 1)}
SHAPES = ("square", "circle", "triangle")
QUADRANTS = (("top", "left"), ("top", "right"), ("bottom", "left"), ("bottom", "right"))


def caption(objects) -> str:
    return " " + "; ".join(f"{v} {hz}: {col} {shape}" for col, shape, (v, hz) in objects) + "."


def scene(seed: int, index: int, img_h: int = 32, img_w: int = 32):
    """(image float32 [3, H, W] in [-1, 1], caption) of sample `index` of the stream `seed`."""
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(1, 3))
    quads = np.sort(rng.choice(4, n, replace=False))
    objects = [(list(COLOURS)[rng.integers(6)], SHAPES[rng.integers(3)], QUADRANTS[q]) for q in quads]
    img = np.zeros((3, img_h, img_w), np.float32)
    yy, xx = np.mgrid[0:img_h, 0:img_w]
    for (col, shape, _), q in zip(objects, quads):
        r = min(img_h, img_w) / 8 * rng.uniform(0.7, 1.2)  # a quadrant's quarter, give or take
        cy = img_h / 4 * (1 + 2 * (q // 2)) + rng.uniform(-1, 1) * img_h / 16
        cx = img_w / 4 * (1 + 2 * (q % 2)) + rng.uniform(-1, 1) * img_w / 16
        dy, dx = yy - cy, xx - cx
        inside = {"square": (abs(dy) <= r) & (abs(dx) <= r), "circle": dy**2 + dx**2 <= r**2,
                  "triangle": (abs(dy) <= r) & (abs(dx) <= (dy + r) / 2)}[shape]
        img[:, inside] = np.asarray(COLOURS[col], np.float32)[:, None]
    img += rng.normal(0, 0.05, img.shape).astype(np.float32)
    return img * 2 - 1, caption(objects)


def all_captions():
    """Every caption the scenes make, with its probability (1 or 2 objects w.p. 1/2, all else uniform)."""
    one = list(itertools.product(COLOURS, SHAPES))  # 18
    for q1, a in itertools.product(range(4), one):
        yield caption([(*a, QUADRANTS[q1])]), 1 / 2 / 4 / 18
    for (q1, q2), a, b in itertools.product(itertools.combinations(range(4), 2), one, one):
        yield caption([(*a, QUADRANTS[q1]), (*b, QUADRANTS[q2])]), 1 / 2 / 6 / 18 / 18


def text_only_accuracy(tok) -> float:
    """The best caption-token accuracy (eod included) of any predictor that does not see the image: at every
    prefix it names the most probable next token, computed exactly over all captions. The baseline a model that
    looks at the image must beat."""
    eod, prefix, caps = tokenizer_files.special_ids(tok)["eod"], {}, list(all_captions())
    seqs = [(e.ids + [eod], p) for e, (_, p) in zip(tok.encode_batch([c for c, _ in caps]), caps)]
    for ids, p in seqs:
        for i, t in enumerate(ids):
            nxt = prefix.setdefault(tuple(ids[:i]), {})
            nxt[t] = nxt.get(t, 0) + p
    best = lambda ids, i: max(prefix[tuple(ids[:i])], key=prefix[tuple(ids[:i])].get)  # the likeliest next token
    return sum(p * (best(ids, i) == t) for ids, p in seqs for i, t in enumerate(ids)) / sum(p * len(i) for i, p in seqs)


class CaptionDataset:
    """Sample i: one int64 row [seed, i, tokens (s + 1), loss_mask (s)] with tokens = n_img image tokens, the
    caption, eod, padding; loss_mask marks the labels (tokens[1:]) that are caption tokens or eod. The image is not
    stored: the recipe draws it again from (seed, i). The stream is endless; `len` only bounds train.py's report."""

    def __init__(self, source, doc_ids, args, tok, seed):
        sp = tokenizer_files.special_ids(tok)
        kw = {f: getattr(args, f) for f in ("img_h", "img_w", "patch_dim", "drop_vision_class_token")
              if getattr(args, f) is not None}
        self.c = Config(**kw, **config_fields(args, tok))
        self.tok, self.seed, self.s, self.eod, self.pad = tok, seed, args.seq_length, sp["eod"], sp["pad"]
        longest = max(len(e.ids) for e in tok.encode_batch([c for c, _ in all_captions()]))
        if self.c.num_image_tokens + longest + 1 > self.s + 1:
            raise data.DataError(f"--seq-length={self.s} cannot hold {self.c.num_image_tokens} image tokens + the "
                                 f"longest caption ({longest} tokens) + eod: use >= {self.c.num_image_tokens + longest}")

    def __len__(self):
        return 1_000_000

    def __getitem__(self, i):
        n, s = self.c.num_image_tokens, self.s
        _, cap = scene(self.seed, int(i), self.c.img_h, self.c.img_w)
        ids = [self.c.image_token_index] * n + self.tok.encode(cap).ids + [self.eod]
        tokens = np.array(ids + [self.pad] * (s + 1 - len(ids)), np.int64)
        mask = np.zeros(s, np.int64)
        mask[n - 1:len(ids) - 1] = 1  # labels tokens[n:len(ids)]: the caption and eod
        return np.concatenate([[self.seed, int(i)], tokens, mask])


dataset = CaptionDataset  # train.py: dataset(source, doc_ids, args, tok, seed)
# serving/server.py: (one image's tokens, a PIL image -> pixel_values [3, H, W]: PIL's bicubic resize, [-1, 1] as scene's)
image_inputs = lambda c: ([c.image_token_index] * c.num_image_tokens, lambda img: {"pixel_values": torch.from_numpy(
    np.asarray(img.convert("RGB").resize((c.img_w, c.img_h)), np.float32).transpose(2, 0, 1) / 255 * 2 - 1)})


def unpack(mb, c: Config, shift: int = 0):
    """A micro-batch of rows [b, 2 + (s + 1) + s] -> (input_ids [b, s], pixel_values [b, 3, H, W], labels [b, s],
    loss_mask [b, s]). shift = 1 draws each sample's image from the next sample instead (the shuffled control)."""
    s = (mb.shape[1] - 3) // 2
    pixels = np.stack([scene(int(seed), int(i) + shift, c.img_h, c.img_w)[0] for seed, i in mb[:, :2].tolist()])
    tokens = mb[:, 2:s + 3]
    return tokens[:, :-1], torch.from_numpy(pixels).to(mb.device, c.params_dtype), tokens[:, 1:], mb[:, s + 3:]


def loss_func(model, mb):
    """The SUM of the micro-batch's caption-token losses (DESIGN.md §2: divided by the global count)."""
    ids, pixels, labels, mask = unpack(mb, model.config)
    loss = model(ids, pixels, labels=labels)
    return (loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss).mul(mask).sum()


def batch_recipe(batch, args=None, corpus=None):
    return loss_func, int(batch[:, (batch.shape[1] - 3) // 2 + 3:].sum())  # the loss-mask columns' count


@torch.no_grad()
def caption_hits(model, mb, shift: int = 0) -> tuple[int, int]:
    """(correct, total) argmax predictions of the caption tokens and eod."""
    ids, pixels, labels, mask = unpack(mb, model.config, shift)
    m = mask.bool()
    return int((model(ids, pixels).argmax(-1)[m] == labels[m]).sum()), int(m.sum())


def eval_counts(model, mb) -> dict:
    """Held-out caption accuracy with each sample's own image, and with the next sample's image instead."""
    return {"caption_accuracy": caption_hits(model, mb), "caption_accuracy_shuffled": caption_hits(model, mb, 1)}


# ---------------------------------------------------------------------------------------------- train.py's hooks
def add_arguments(p):
    """Megatron's --freeze-LM, --freeze-ViT, --disable-vision-class-token (examples/multimodal) and --img-h, --img-w,
    --patch-dim; the ViT's size is ours (Megatron fixes it per --vision-model-type). None = not given: the Config's."""
    p.add_argument("--freeze-LM", dest="freeze_language_model", action="store_true", default=None,
                   help="freeze the language model")
    p.add_argument("--freeze-ViT", dest="freeze_vision_model", action="store_true", default=None,
                   help="freeze the vision tower")
    p.add_argument("--disable-vision-class-token", dest="drop_vision_class_token",
                   action=argparse.BooleanOptionalAction, default=None, help="drop the ViT's class token")
    for name in ("img-h", "img-w", "patch-dim", "vision-num-layers", "vision-hidden-size",
                 "vision-num-attention-heads", "vision-ffn-hidden-size"):
        p.add_argument(f"--{name}", type=int, default=None, help="(default: llava.Config's)")


# The flags that shape the weights; and frozen towers keep no optimizer state, so a resume cannot change what is frozen
ARCH_FLAGS = ("img_h", "img_w", "patch_dim", "vision_num_layers", "vision_hidden_size", "vision_num_attention_heads",
              "vision_ffn_hidden_size", "drop_vision_class_token", "freeze_language_model", "freeze_vision_model")


def config_fields(args, tok) -> dict:
    """The image token's id: the run's tokenizer's IMAGE_TOKEN, or an imported folder's config.json image_token_id
    (interop/hf.py), which its tokenizer must hold (its <image>). tok None (not known yet): the Config's default."""
    arch = getattr(args, "hf_architecture", None)
    i = hf.config_view(arch["config"]).image_token_id if arch else tok and tok.token_to_id(IMAGE_TOKEN)
    if tok is not None and (i is None or tok.id_to_token(i) is None):
        raise data.DataError(f"the tokenizer has no image token ({f'image_token_id={i}' if arch else IMAGE_TOKEN})")
    return {} if i is None else {"image_token_index": i}


# `make train MODEL=llava`: Muon for the hidden matrices at 3x AdamW's 2e-3 (bench/README.md "Levers for the other
# default runs" measured both); --optimizer adam takes AdamW's own rates
TRAIN_DEFAULTS = dict(seq_length=36, num_layers=2, hidden_size=128, num_attention_heads=4, drop_vision_class_token=True,
                      micro_batch_size=32, global_batch_size=32, train_iters=600, optimizer="muon", lr=6e-3,
                      min_lr=6e-4, eval_interval=100, eval_iters=4)
OPTIMIZER_DEFAULTS = dict(adam=dict(lr=2e-3, min_lr=2e-4))


def ascii_image(img) -> str:
    """The image [3, H, W] in [-1, 1] as letters, one per 2 x 1 pixels: the colour's initial, '.' for black."""
    names = {v: k[0].upper() if k == "white" else k[0] for k, v in COLOURS.items()}
    rgb = (img[:, ::2, :] > 0).astype(int)
    return "\n".join("".join(names.get(tuple(px), ".") for px in row) for row in rgb.transpose(1, 2, 0))


def sample(model: Model, tok, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None) -> str:
    """tools.py sample for LLaVA: the prompt picks a scene (a number, or any text hashed), drawn as letters; the
    model describes it after its image tokens (greedy at temperature 0)."""
    c = model.config
    index = int(prompt) if prompt.strip().isdigit() else zlib.crc32(prompt.encode())
    img, truth = scene(7, index, c.img_h, c.img_w)
    pixels = torch.from_numpy(img)[None].to(c.params_dtype)
    ids = torch.full((1, c.num_image_tokens), c.image_token_index)
    def next_logits(ids):  # the last position's logits [1, V]; never another image token
        return model(ids, pixels)[:, -1].index_fill(-1, torch.tensor([c.image_token_index]), float("-inf"))

    out = gpt.generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                       eod=tokenizer_files.special_ids(tok)["eod"], next_logits=next_logits)
    said = tok.decode(out[0, c.num_image_tokens:].tolist())
    return f"{ascii_image(img)}\nscene {index}: {truth.strip()}\nthe model: {said.strip()}"


# ---------------------------------------------------------------------------------------------- checkpoints (interop/convert.py)
_V, _O = r"model\.vision_tower\.", "vision_model."
_VL = _V + r"encoder\.layers\.(\d+)\."  # a CLIP layer (ours: vision_model.decoder.layers.i, a transformer.py layer)
HF_RENAMES = [  # LlavaForConditionalGeneration's vision tower and projector -> ours (its Llama: gpt.py's)
    (_V + r"embeddings\.patch_embedding\.weight", _O + "conv1"),
    (_V + r"embeddings\.class_embedding", _O + "class_token", lambda t: t.reshape(1, 1, -1)),
    (_V + r"embeddings\.position_embedding\.weight", _O + "position_embeddings.weight"),
    (_V + r"pre_layrnorm\.(\w+)", _O + r"ln_pre.\1"), (_V + r"post_layernorm\.\w+", None),  # (unused: see hf_to_ours)
    (_VL + r"self_attn\.([qkv])_proj\.(\w+)", _O + r"decoder.layers.\1.self_attention.linear_qkv.\3:\2"),
    *[(_VL + a + r"\.(\w+)", _O + rf"decoder.layers.\1.{b}.\2") for a, b in [
        (r"self_attn\.out_proj", "self_attention.linear_proj"), ("layer_norm1", "input_layernorm"),
        ("layer_norm2", "pre_mlp_layernorm"), (r"mlp\.fc1", "mlp.linear_fc1"), (r"mlp\.fc2", "mlp.linear_fc2")]],
    (r"model\.multi_modal_projector\.linear_([12])\.(\w+)", r"vision_projection.encoder.linear_fc\1.\2")]


def hf_to_ours(src, Config, dtype=None) -> tuple:
    """(Config, full state dict) of a `transformers` LlavaForConditionalGeneration: a CLIP vision tower, the 2-layer
    projector, a Llama (gpt.py's converter). Hugging Face takes the image features from
    hidden_states[vision_feature_layer] (index 0 = the embeddings after pre_layrnorm), so our ViT keeps exactly the
    layers before it (Megatron's conversion does the same) and CLIP's post_layernorm, unused, is left out;
    vision_feature_select_strategy "default" drops the class token, "full" keeps it."""
    hc, sd = src.config, src.state_dict()
    vc, layer, strategy = hc.vision_config, hc.vision_feature_layer, hc.vision_feature_select_strategy
    refuse = [why for bad, why in [
        (vc.model_type != "clip_vision_model", f"vision model_type {vc.model_type!r} (clip_vision_model is)"),
        (not isinstance(layer, int), f"vision_feature_layer={layer} (one layer is supported, not a list)"),
        (strategy not in ("default", "full"), f"vision_feature_select_strategy={strategy!r}"),
        (hc.projector_hidden_act != "gelu", f"projector_hidden_act={hc.projector_hidden_act!r} (gelu is)"),
        (not getattr(hc, "multimodal_projector_bias", True), "a projector without biases"),
        (vc.hidden_act not in ("quick_gelu", "gelu"), f"vision hidden_act={vc.hidden_act!r}"),
        (vc.num_channels != 3, f"num_channels={vc.num_channels}")] if bad]
    if refuse:
        raise ValueError(f"llava.from_hf: unsupported {refuse[0]}")
    L = vc.num_hidden_layers
    used = layer if layer >= 0 else L + 1 + layer  # hidden_states has L + 1 entries
    if not 1 <= used <= L:
        raise ValueError(f"llava.from_hf: vision_feature_layer={layer} selects {used} of {L} layers (1..{L} are supported)")
    vis = ("model.vision_tower.", "model.multi_modal_projector.")
    text = {k.replace("model.language_model.", "model.", 1): v for k, v in sd.items() if not k.startswith(vis)}
    c, full = gpt.HF_CONVERTERS["llama"](types.SimpleNamespace(config=hc.text_config, parameters=src.parameters,
                                                               state_dict=lambda: text),
                                         lambda **kw: Config(**kw, image_token_index=hc.image_token_id), dtype)
    c = dataclasses.replace(c, img_h=vc.image_size, img_w=vc.image_size,
                            patch_dim=vc.patch_size, vision_num_layers=used, vision_hidden_size=vc.hidden_size,
                            vision_num_attention_heads=vc.num_attention_heads, vision_ffn_hidden_size=vc.intermediate_size,
                            vision_activation=vc.hidden_act, vision_layernorm_epsilon=vc.layer_norm_eps,
                            drop_vision_class_token=strategy == "default")
    unused = lambda k: (m := re.match(_VL, k)) is not None and int(m[1]) >= used  # the layers past the selected one
    vision = {k: v for k, v in sd.items() if k.startswith(vis) and not unused(k)}
    per_head = lambda *t: convert.per_group(*t, groups=vc.num_attention_heads)
    return c, {**full, **convert.joined(convert.renamed(vision, HF_RENAMES, "llava.from_hf"), ("q", "k", "v"), per_head)}


HF_CONVERTERS = {"llava": hf_to_ours}  # model_type -> converter (interop/hf.py)
HF_LAYOUTS = {"llava": {"renames": [(r"^language_model\.lm_head\.", "lm_head."),  # stored -> live names (interop/hf.py)
                                    (r"^language_model\.model\.", "model.language_model."),
                                    (r"^vision_tower\.", "model.vision_tower."),
                                    (r"^multi_modal_projector\.", "model.multi_modal_projector.")]}}
from_hf = convert.hf_loader(Model, Config, HF_CONVERTERS, "llava")  # a LlavaForConditionalGeneration -> Model
