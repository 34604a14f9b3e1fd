"""The first loss of a model imported from a Hugging Face folder is the `transformers` model's on the same batch:
LLaVA started by train.py from a folder with its own tokenizer (its <image> token at config.image_token_id), trained,
exported and loaded back; BERT's masked-LM loss and T5's loss with the padded vocabulary rows out of the softmax
(Config.mask_vocab_padding), as transformers computes them over its own vocabulary."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import types

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_bert import hf_bert
from test_hf_folders import first_losses, run_argv
from test_llava import hf_llava
from test_t5 import hf_t5

import checkpoint
import data
import harness
import llava
import tools
from interop import convert, tokenizer_files


# ---------------------------------------------------------------------------------------------- LLaVA from a folder
def caption_tokenizer(path, vocab_size: int, image_id: int):
    """A word-level tokenizer of llava.py's captions (the default LLaVA task's data: CaptionDataset), built with the
    `tokenizers` library and saved as the folder's tokenizer.json + tokenizer_config.json: <unk>, <pad>, </s> (eos:
    the end of a caption), the captions' words, unused fillers, and <image> at `image_id` — vocab_size entries at
    most, as the model's embedding has."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = sorted({w for cap, _ in llava.all_captions() for w in re.findall(r"\w+|[^\w\s]", cap)})
    names = ["<unk>", "<pad>", "</s>", *words]
    names += [f"<unused_{i}>" for i in range(image_id - len(names))] + ["<image>"]
    assert len(names) <= vocab_size and names.index("<image>") == image_id
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<pad>", "</s>", "<image>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))


def test_llava_trains_from_a_folder_with_the_hugging_face_loss(tmp_path):
    """tools.py import-hf, then train.py 2 steps at TP 2 + SP on the default LLaVA task (CaptionDataset: image tokens,
    a caption, eod): the image tokens are the folder's <image> (config.image_token_id); the first step's loss is
    transformers' mean caption-token loss on the run's first global batch (same ids, pixels, labels; float32: rtol
    1e-5); the trained run exports to a folder transformers loads with our logits (float32: atol 1e-5)."""
    torch.manual_seed(0)
    live = hf_llava().float().eval()
    live.save_pretrained(tmp_path / "src")
    caption_tokenizer(tmp_path / "src", live.config.text_config.vocab_size, live.config.image_token_id)
    tools.import_hf(tmp_path / "src", tmp_path / "base")
    import train
    args = train.check_args(train.parse(run_argv(tmp_path / "base", tmp_path / "probe")), 1)
    start = checkpoint.plan_start(args)
    corpus = data.build_data(args, train.model_file(args.model).dataset, start.tokenizer_file, start.vocab_size)
    rows = torch.as_tensor(data.global_batch(corpus.train, start=0, size=4)).long()
    size = live.config.vision_config.image_size
    ids, pixels, labels, mask = llava.unpack(rows, types.SimpleNamespace(img_h=size, img_w=size,
                                                                         params_dtype=torch.float32))
    assert (ids == live.config.image_token_id).sum(1).tolist() == [16] * 4  # the folder's <image>, 16 per image
    with torch.no_grad():
        logits = live(input_ids=ids, pixel_values=pixels).logits
    m = mask.bool()
    want = F.cross_entropy(logits[m], labels[m]).item()
    harness.launch(2, run_argv(tmp_path / "base", tmp_path / "run", "--tensor-model-parallel-size", "2",
                               "--sequence-parallel"))
    got = first_losses(tmp_path / "run")[0]
    assert math.isclose(got, want, rel_tol=1e-5), (got, want)
    tools.main(["export", "--load", str(tmp_path / "run"), "--hf-out", str(tmp_path / "out")])
    back = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "out").float().eval()
    ours = checkpoint.load_model(tmp_path / "run").model.eval()
    with torch.no_grad():
        a, b = back(input_ids=ids, pixel_values=pixels).logits, ours(ids, pixels)[..., :logits.shape[-1]]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert (a - logits).abs().max() > 1e-4  # it trained: the export is not the starting folder


def test_an_image_token_the_tokenizer_lacks_is_refused(tmp_path):
    """Negative control: config.json's image_token_id must be a token of the folder's tokenizer (DataError naming
    it); the folder's own id is taken."""
    caption_tokenizer(tmp_path, 100, 99)
    tok = tokenizer_files.folder_tokenizer(tmp_path)
    args = types.SimpleNamespace(hf_architecture={"config": {"model_type": "llava", "image_token_id": 99}})
    assert llava.config_fields(args, tok) == {"image_token_index": 99} and tok.id_to_token(99) == "<image>"
    args.hf_architecture["config"]["image_token_id"] = 500
    with pytest.raises(data.DataError, match="no image token \\(image_token_id=500\\)"):
        llava.config_fields(args, tok)


# ---------------------------------------------------------------------------------------------- BERT, T5: the loss
def encoder_losses(family, mask: bool):
    """(ours, transformers') mean loss in float64 on one batch: BERT's masked-LM loss (BertForPreTraining's MLM
    part: cross-entropy of prediction_logits at the masked positions, labels -100 elsewhere, as its own loss code),
    T5's (T5ForConditionalGeneration(input_ids, labels): the decoder reads the labels shifted right). `mask`: the
    converted Config's mask_vocab_padding (the converters set it)."""
    import bert
    import t5
    g = torch.Generator().manual_seed(4)
    live = (hf_bert() if family == "bert" else hf_t5()).double().eval()
    mf = bert if family == "bert" else t5
    c, full = mf.HF_CONVERTERS[family](live, mf.Config, torch.float64)
    assert c.mask_vocab_padding and c.padded_vocab_size > c.vocab_size  # (300 -> 384: padded rows exist)
    ours = convert.load(mf.Model(dataclasses.replace(c, mask_vocab_padding=mask)), full).eval()
    ids = torch.randint(5, c.vocab_size, (2, 12), generator=g)
    labels = torch.randint(0, c.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        if family == "bert":
            picked = torch.rand(2, 12, generator=g) < 0.3  # the masked positions: the loss's tokens
            want = F.cross_entropy(live(input_ids=ids).prediction_logits[picked], labels[picked])
            got = ours(ids, torch.ones_like(ids), lm_labels=labels)[0][picked].mean()
        else:
            want = live(input_ids=ids, labels=labels).loss
            decoder_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], 1)  # decoder_start_token_id 0
            got = ours(ids, decoder_ids, lm_labels=labels).mean()
    return got.item(), want.item()


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_an_imported_encoders_loss_is_the_hugging_face_loss(family):
    """float64: BERT's equal to 1e-12 relative (summation order only); T5's to 1e-7, as transformers' T5LayerNorm
    takes its variance in float32 whatever the model's dtype (measured: 4e-9). Negative control: without
    mask_vocab_padding the 84 padded rows (logit 0) join the softmax and the loss differs (by > 1e-3 relative)."""
    got, want = encoder_losses(family, mask=True)
    assert math.isclose(got, want, rel_tol=1e-12 if family == "bert" else 1e-7), (got, want)
    got, want = encoder_losses(family, mask=False)
    assert not math.isclose(got, want, rel_tol=1e-3), (got, want)
