"""serving/protocol.py — the OpenAI API's request shapes and error shape, as serving/server.py reads and answers them.

The bodies of /v1/completions and /v1/chat/completions (OpenAI's field names and limits; top_k is vLLM's extension;
unknown fields ignored, as vLLM ignores them), vLLM's /tokenize and /detokenize, a chat message's content as a
string or a list of parts (text, and image_url: a base64 data URL's image, decoded here; nothing is downloaded), and
OpenAI's error object. A file of its own so that serving/server.py holds the engine loop and the routes only.
Mirrors vLLM's `vllm/entrypoints/openai/protocol.py` (the request models) and its chat utilities' image loading
(`vllm/multimodal/image.py`: a data URL's base64 image through PIL).

Run:    .venv/bin/python -m pytest -q tests/test_server.py tests/test_server_images.py
"""
from __future__ import annotations

import base64
import io
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(message: str, param=None, status: int = 400) -> JSONResponse:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The sampling fields both routes share (OpenAI's names; top_k is vLLM's extension). Unknown fields are ignored,
    as vLLM ignores them."""
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class TokenizeRequest(BaseModel):  # vLLM's /tokenize (lm-eval's remote tokenizer)
    model_config = ConfigDict(extra="ignore")
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ImagePart(BaseModel):  # OpenAI's image_url content part: here a base64 data URL only
    type: Literal["image_url"]
    image_url: ImageURL


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


def data_url_image(url: str, param: str):
    """A base64 data URL's image (PIL), or OpenAIError saying why not; nothing is downloaded (an http(s) URL is
    refused)."""
    if url.startswith(("http://", "https://")):
        raise OpenAIError(f"{param}: {url[:60]!r}: only base64 data URLs (data:image/png;base64,...) are read: this "
                          "server downloads nothing", param)
    head, comma, payload = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and comma):
        raise OpenAIError(f"{param}: {url[:40]!r} is not a base64 data URL of an image (data:image/png;base64,...)",
                          param)
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
    except Exception as e:  # (bad base64, an image PIL does not read, a damaged one: whatever the decoder raises)
        why = "no image format PIL reads" if isinstance(e, UnidentifiedImageError) else f"{type(e).__name__}: {e}"
        raise OpenAIError(f"{param}: the data URL's image does not decode ({why})", param) from None
    return image


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
