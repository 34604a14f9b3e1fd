"""serving/server.py serving a LLaVA run (llava.py) whose chat messages carry images: OpenAI's image_url content
parts, base64 data URLs.

  - greedy: the server's answer to a message with an image (a PNG of one of llava.scene's pictures) is the one-process
    oracle's: gpt.generate with the whole forward each step (the image spliced into its tokens), the prompt built by
    hand (the chat template's user header, the image's tokens, the text, the assistant's header) and the pixels
    decoded from the same PNG, scaled to [-1, 1] as llava.scene's training images are; negative controls: another
    image, or the same image scaled to [0, 1], gives another answer;
  - refused with a 400 in OpenAI's error shape, the server serving on: an http(s) URL (nothing is downloaded),
    malformed base64, a data URL that is no image, another media type, two images in one request, and the image
    token's id in a completions prompt (it would reach the model without its image).
(The refusal of image parts by a text-only run: tests/test_server.py.) Tolerance: tokens exactly, as test_server.py
(the oracle's top-2 logit gap above 1e-3 at every greedy step).
"""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_server import GAP, MAX, Server, save_run

import checkpoint
import gpt
import llava
from harness import server_fixture
from interop import tokenizer_files
from posttraining import recipes

FLAGS = ["--model", "llava", "--img-h", "16", "--img-w", "16", "--patch-dim", "8", "--vision-num-layers", "1",
         "--vision-hidden-size", "32", "--vision-num-attention-heads", "4", "--disable-vision-class-token"]
QUESTION = "What is in the picture?"


def png(index: int) -> bytes:
    """llava.scene's picture `index` (16 x 16) as PNG bytes, its [-1, 1] floats made 8-bit."""
    img, _ = llava.scene(7, index, 16, 16)
    rgb = np.round((img.transpose(1, 2, 0) + 1) / 2 * 255).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def data_url(raw: bytes, media="image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def message(url: str, *more) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, *more, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return save_run(tmp_path_factory.mktemp("llava-server"), "llava", *FLAGS)


@pytest.fixture(scope="module")
def loaded(run):
    return checkpoint.load_model(run)


server = server_fixture(Server)  # the file's server on its `run`


def oracle(loaded, raw: bytes, low: float = -1.0) -> str:
    """The greedy answer to message(raw's image) in one process: the prompt's ids by hand, the PNG's pixels scaled
    to [low, 1], the whole forward each step; it stops at the chat's stop ids (and at an image token, which the
    server never feeds back)."""
    model, tok, c = loaded.model.eval(), loaded.tok, loaded.model.config
    enc = lambda text: tok.encode(text, add_special_tokens=False).ids
    ids = (enc(recipes.CHAT_TEMPLATE["user"]) + [c.image_token_index] * c.num_image_tokens + enc(QUESTION + "\n")
           + enc(recipes.CHAT_TEMPLATE["assistant"]))
    rgb = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"), np.float32) / 255
    px = torch.from_numpy(rgb * (1 - low) + low).permute(2, 0, 1)[None]  # [1, 3, H, W]
    stops = tokenizer_files.chat_stop_ids(tok) + [c.image_token_index]
    with torch.no_grad():
        out = gpt.generate(model, torch.tensor([ids]), MAX, temperature=0, eod=stops,
                           next_logits=lambda x: model(x, px)[:, -1])
        top2 = model(out[:, :-1], px)[0, len(ids) - 1:].topk(2, -1).values
    assert (top2[:, 0] - top2[:, 1]).min() > GAP, "a near tie in the oracle: pick another picture"
    new = out[0, len(ids):].tolist()
    return tok.decode(new[:-1] if new[-1] in stops else new)


def chat(server, messages) -> str:
    r = server.client.chat.completions.create(model="llava", messages=messages, max_tokens=MAX, temperature=0)
    return r.choices[0].message.content


def test_an_image_part_is_the_one_process_answer(server, loaded):
    a, b = png(3), png(11)
    got = chat(server, message(data_url(a)))
    assert got == oracle(loaded, a)
    assert oracle(loaded, b) != got, "another picture, the same answer: the image does not reach the model"
    assert oracle(loaded, a, low=0.0) != got, "pixels in [0, 1], the same answer: the scaling is not checked"
    assert chat(server, message(data_url(b))) == oracle(loaded, b)


@pytest.mark.parametrize("url, why", [
    ("https://example.com/cat.png", "only base64 data URLs"),
    ("data:image/png;base64,not base64!", "does not decode"),
    (data_url(b"hello, not a picture"), "does not decode"),
    (data_url(png(3), "text/plain"), "is not a base64 data URL of an image"),
    (data_url(png(3)[:80]), "image file is truncated"),
], ids=["http", "bad base64", "not an image", "not image/", "truncated png"])
def test_a_bad_image_gets_400_and_the_server_goes_on(server, url, why):
    status, err = server.post("chat/completions", json.dumps({"model": "llava", "messages": message(url)}).encode())
    assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert why in err["error"]["message"] and "messages[0].content[0].image_url.url" in err["error"]["message"], err
    assert chat(server, [{"role": "user", "content": "hi"}]) is not None  # still serving


def test_two_images_and_a_bare_image_token_are_refused(server, loaded):
    two = message(data_url(png(3)), {"type": "image_url", "image_url": {"url": data_url(png(4))}})
    status, err = server.post("chat/completions", json.dumps({"model": "llava", "messages": two}).encode())
    assert status == 400 and "at most 1 image" in err["error"]["message"], err
    image_id = loaded.model.config.image_token_index
    status, err = server.post("completions", json.dumps({"model": "llava", "prompt": [5, image_id]}).encode())
    assert status == 400 and err["error"]["param"] == "prompt" and "stand for an image" in err["error"]["message"]
    assert chat(server, message(data_url(png(3)))) == oracle(loaded, png(3))  # still serving
