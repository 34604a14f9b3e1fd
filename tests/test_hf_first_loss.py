"""The first loss of a model imported from a Hugging Face folder is the `transformers` model's on the same batch:
LLaVA started by train.py from a folder with its own tokenizer (its <image> token at config.image_token_id), trained,
exported and loaded back; BERT's masked-LM loss and T5's loss with the padded vocabulary rows out of the softmax
(Config.mask_vocab_padding), as transformers computes them over its own vocabulary."""
from __future__ import annotations

import json
import math
import re
import types

import torch
import torch.nn.functional as F
import transformers
from test_hf_folders import first_losses, run_argv
from test_llava import hf_llava

import checkpoint
import data
import harness
import llava
import tools


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
