"""serving/server.py — an OpenAI-compatible HTTP server over engine.py, on one process or a tensor-parallel world.

`/v1/completions` and `/v1/chat/completions` (the run's chat template), streamed as server-sent events when asked,
`/v1/models` and `/health`: what vLLM's and Megatron's servers answer, so the official `openai` client, curl or any
OpenAI-speaking tool talks to a run of this repository. Completions take `echo` with `logprobs` and lists of prompts
(streamed interleaved), chat messages an image_url part (a base64 data URL) for a model file with image_inputs, and
`/tokenize`, `/detokenize`, `/tokenizer_info` answer as vLLM's (lm-eval's local-completions scores prompts here). A bad
request gets a 400 in OpenAI's error shape (serving/protocol.py) and the server goes on. A file of its own because it is
the only asynchronous code here: a reader of the engine should not have to read HTTP. Mirrors Megatron-LM's
`megatron/core/inference/text_generation_server` (a Flask server over the engine, rank 0 answering while every rank
runs the model) and vLLM's `vllm/entrypoints/openai/api_server.py` (the same routes and shapes).

How it runs. Every rank builds the model's shard (checkpoint.load_model at --tensor-model-parallel-size, saved at any
layout) and an identical serve.Engine, and runs the same loop in lock-step: each step, rank 0 takes the commands the
HTTP handlers queued (add a request, abort one), broadcasts them (torch.distributed's broadcast_object_list; an empty
list at least once a second, so an idle server's ranks never hit the collective timeout), and every rank applies them
and calls engine.step(). The model's collectives keep the ranks' logits identical, and each request carries the seed
rank 0 chose, so every rank samples the same tokens, finishes the same requests and frees the same blocks. Rank 0
alone answers HTTP (FastAPI on uvicorn, in the main thread; the engine loop in a thread beside it). SIGTERM or Ctrl-C:
uvicorn stops taking requests and drains, then rank 0 broadcasts "stop" and every rank exits 0.

Run:    make serve
        make serve NPROC=2 TP=2 ARGS="--port 8001"
        .venv/bin/python -m pytest -q tests/test_server.py tests/test_server_images.py
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
import uuid

import torch
import torch.distributed as dist
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse

import checkpoint
import data
from arguments import ArgumentParser
from config import ConfigError
from interop import tokenizer_files
from posttraining import quantization, recipes
from serving import engine as serve
from serving import protocol, speculative
from serving.protocol import OpenAIError, error_response


# ---------------------------------------------------------------------------------------------- the engine loop
class Loop:
    """The engine loop, the same on every rank. Rank 0's handlers `submit` commands with a callback that receives
    the request's events: ("accepted",), ("error", message), then ("token", text, logprob entry, finish reason)
    for each sampled token (finish reason None until the last). Stop strings are found here, on every rank alike: the
    text is decoded after each token, cut before the first stop string, and the request aborted in the engine."""

    def __init__(self, engine: serve.Engine, tok, world: int, rank: int):
        self.engine, self.tok, self.world, self.rank = engine, tok, world, rank
        self.inbox = queue.Queue()  # rank 0: lists of (command, callback) from the HTTP handlers
        self.callbacks = {}  # rank 0: request key -> callback
        self.live = {}  # engine request id -> [key, stop strings, text sent]
        self.ids = {}  # request key -> engine request id

    def submit(self, command: tuple, callback=None, more=()):
        """Queue a command (with `more` (command, callback) pairs applied in the same step: a request's n choices)."""
        self.inbox.put([(command, callback), *more])

    def commands(self) -> list[tuple]:
        """This step's commands: rank 0's queue (waiting up to a second when nothing runs), broadcast to all."""
        cmds = []
        if self.rank == 0:
            try:
                items = self.inbox.get(timeout=1.0) if not self.engine.has_unfinished() else self.inbox.get_nowait()
                while True:
                    for command, callback in items:
                        cmds.append(command)
                        if callback is not None:
                            self.callbacks[command[1]] = callback
                    items = self.inbox.get_nowait()
            except queue.Empty:
                pass
        if self.world > 1:
            box = [cmds]
            dist.broadcast_object_list(box, src=0)
            cmds = box[0]
        return cmds

    def emit(self, key: str, event: tuple):
        if key in self.callbacks:
            self.callbacks[key](event)
            if event[0] in ("error", "scored") or event[0] == "token" and event[3] is not None:
                del self.callbacks[key]

    @torch.no_grad()
    def score(self, ids: list[int], k: int) -> list[tuple]:
        """The prompt's own log-probabilities (vLLM's prompt_logprobs): one full forward, every rank alike (the
        model's collectives); for each token after the first, (token, its logprob, the k most probable
        [(token, logprob)]), log_softmax in float32 over the raw logits, as engine.token_logprobs."""
        model = self.engine.model
        x = torch.tensor([ids], device=next(model.parameters()).device)
        logp = torch.log_softmax(model(x)[0, :-1].float(), -1)  # [s-1, V]: position i predicts token i+1
        got = logp.gather(-1, x[0, 1:, None])[:, 0].tolist()
        top = logp.topk(k, -1) if k else None
        return [(t, v, list(zip(top.indices[i].tolist(), top.values[i].tolist())) if k else [])
                for i, (t, v) in enumerate(zip(ids[1:], got))]

    def apply(self, command: tuple):
        kind, key = command[0], command[1]
        if kind == "add":
            prompt, params, stops, *inputs = command[2:]  # (inputs: the model's own, for the prompt: an image)
            try:
                rid = self.engine.add_request(prompt, params, **(inputs[0] if inputs else {}))
            except ValueError as e:
                return self.emit(key, ("error", str(e)))
            self.live[rid], self.ids[key] = [key, stops, ""], rid
            self.emit(key, ("accepted",))
        elif kind == "score":  # echo with logprobs: the prompt scored, outside the running batch
            try:
                self.emit(key, ("scored", self.score(*command[2:])))
            except (ValueError, RuntimeError) as e:
                self.emit(key, ("error", str(e)))
        elif kind == "abort" and key in self.ids:  # a client that went away
            rid = self.ids.pop(key)
            self.engine.abort(rid)
            self.live.pop(rid, None)
            self.callbacks.pop(key, None)

    def advance(self, r: serve.Request, upto: int | None = None):
        """The text a request's token number `upto` (default: its last) adds (held back while it may be the start of
        a stop string or of a character whose bytes are not all out yet), and its end (then nothing of it stays)."""
        upto = len(r.output) if upto is None else upto
        rid, token, reason = r.id, r.output[upto - 1], r.finish_reason if upto == len(r.output) else None
        key, stops, sent = self.live[rid]
        finished = reason is not None
        ids = r.output[:upto - 1] if reason == "stop" else r.output[:upto]  # a stop token is not part of the text
        text = self.tok.decode(ids)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:  # a stop string: the text ends before it, and so does the request
            text, reason = text[:cut], "stop"
            if not finished:
                self.engine.abort(rid)
        safe = len(text)
        if reason is None:
            safe = len(text.rstrip("\ufffd"))
            held = max((n for s in stops for n in range(1, len(s)) if text[:safe].endswith(s[:n])), default=0)
            safe -= held
        delta = text[len(sent):safe] if text.startswith(sent) else ""
        self.live[rid][2] = sent + delta
        lp = None
        if getattr(r, "logprobs", None):
            logprob, top = r.logprobs[upto - 1]
            lp = (token, logprob, top)
        if reason is not None:
            del self.live[rid], self.ids[key]
        self.emit(key, ("token", delta, lp, reason))

    def run(self):
        """Step until rank 0 says stop."""
        while True:
            cmds = self.commands()
            if any(c[0] == "stop" for c in cmds):
                return
            for c in cmds:
                self.apply(c)
            for r in self.engine.step():
                for upto in range(len(r.output) - r.new + 1, len(r.output) + 1):  # (several: accepted drafts)
                    if r.id in self.live:
                        self.advance(r, upto)


# ---------------------------------------------------------------------------------------------- the routes
def make_app(loop: Loop, name: str, tok, context: int, image=None) -> FastAPI:
    """`image`: the model file's image_inputs for the served model (None: text only)."""
    app = FastAPI(title="mini-megatron")
    eod = tokenizer_files.special_ids(tok)["eod"]
    never = tuple(sorted(set(image[0]))) if image else ()  # image tokens: never fed back (a sampled one stops)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):  # pydantic's complaint (or malformed JSON) as OpenAI's 400
        e = exc.errors()[0]
        if e.get("type") == "json_invalid":
            return error_response(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
        param = ".".join(str(p) for p in e.get("loc", ())[1:]) or None
        return error_response(f"{param or 'body'}: {e.get('msg')}", param)

    @app.exception_handler(OpenAIError)
    async def refused(request, exc):
        return error_response(exc.message, exc.param, exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "mini-megatron",
                                            "max_model_len": context}]}

    def check_model(body):
        if body.model != name:
            raise OpenAIError(f"model {body.model!r} does not exist: this server serves {name!r}", "model")

    async def score(body: protocol.CompletionRequest, prompt: list[int], k: int) -> list[tuple]:
        """The prompt's log-probabilities (Loop.score, in the engine loop's thread, between two steps)."""
        check_model(body)
        if not 1 <= len(prompt) <= context:
            raise OpenAIError(f"prompt: {len(prompt)} tokens: echo scores 1 to {context} (the context)", "prompt")
        here = asyncio.get_running_loop()
        done = here.create_future()
        loop.submit(("score", uuid.uuid4().hex, prompt, k), lambda ev: here.call_soon_threadsafe(done.set_result, ev))
        ev = await done
        if ev[0] == "error":
            raise OpenAIError(ev[1], "prompt")
        return ev[1]

    async def submit(body: protocol.Sampling, prompt: list[int], stop_ids: list[int], logprobs: int | None,
                     inputs: dict):
        """Queue body.n requests for one prompt; (an asyncio.Queue of (choice, event), their keys) once every one
        is accepted, else OpenAIError with the engine's reason (what it refuses: a prompt too long, ...)."""
        check_model(body)
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if max_tokens is None:  # completions: OpenAI's 16; chat: what the context leaves
            max_tokens = 16 if isinstance(body, protocol.CompletionRequest) else max(context - len(prompt), 1)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops):
            raise OpenAIError("stop: an empty stop string", "stop")
        events, here, adds = asyncio.Queue(), asyncio.get_running_loop(), []
        for i in range(body.n):
            seed = body.seed + i if body.seed is not None else secrets.randbits(62)  # every rank samples alike
            params = serve.SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                                          top_p=body.top_p if body.top_p < 1 else None, seed=seed,
                                          stop=(*stop_ids, *never),
                                          **({"logprobs": logprobs} if logprobs is not None else {}))
            adds.append((("add", uuid.uuid4().hex, prompt, params, stops, inputs),
                         lambda ev, i=i: here.call_soon_threadsafe(events.put_nowait, (i, ev))))
        loop.submit(*adds[0], more=adds[1:])  # one step applies them all: each answers before any token comes
        keys, refusal = [command[1] for command, _ in adds], None
        for _ in keys:
            i, ev = await events.get()
            refusal = refusal or (ev[1] if ev[0] == "error" else None)
        if refusal is not None:
            for k in keys:
                loop.submit(("abort", k))
            raise OpenAIError(refusal, "messages" if isinstance(body, protocol.ChatRequest) else "prompt")
        return events, keys

    def text_of(token: int) -> str:  # a token's text; a piece of a character (or nothing): its vocabulary entry
        text = tok.decode([token])
        return text if text and "\ufffd" not in text else tok.id_to_token(token)

    def logprob_entry(lp, chat: bool):
        token, logprob, top = lp
        if chat:
            return {"token": text_of(token), "logprob": logprob, "bytes": list(text_of(token).encode()),
                    "top_logprobs": [{"token": text_of(t), "logprob": v, "bytes": list(text_of(t).encode())}
                                     for t, v in top]}
        return token, logprob, {text_of(t): v for t, v in top}

    async def answer(body, prompt, stop_ids, logprobs, chat: bool, echo: bool = False, several: bool = False,
                     inputs=None):
        """One prompt's response: body.n choices, streamed (`several`: its chunks and its keys, for `interleaved`) or
        whole. echo (completions): each choice begins with the prompt's text and, with logprobs, its tokens' (vLLM's
        shape: None for the first token, each top dict holding the prompt's own token too); max_tokens 0 then
        generates nothing, only the prompt is scored."""
        if (getattr(body, "max_completion_tokens", None) or body.max_tokens) == 0 and not echo:
            raise OpenAIError("max_tokens: 0 generates nothing: only with echo (the prompt scored)", "max_tokens")
        scored = await score(body, prompt, logprobs) if echo and logprobs is not None else None
        if body.max_tokens == 0:  # echo only: no engine request
            check_model(body)
            events, keys = None, [uuid.uuid4().hex for _ in range(body.n)]
        else:
            events, keys = await submit(body, prompt, stop_ids, logprobs, inputs or {})
        rid, created = ("chatcmpl-" if chat else "cmpl-") + keys[0], int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        want_lp = logprobs is not None
        echoed = tok.decode(prompt) if echo else ""  # an echoed choice's text begins with the prompt's
        offsets = [0] * len(keys)  # each choice's text so far, in characters (legacy logprobs' text_offset)

        def chunk(i, text, lps, reason, first=False):
            if chat:
                delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first \
                    else {}
                lp = {"content": [logprob_entry(x, True) for x in lps]} if want_lp else None
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            if first and echo:
                text = echoed + text
            return {"index": i, "text": text, "logprobs": legacy(i, lps, first) if want_lp else None,
                    "finish_reason": reason}

        def legacy(i, lps, first):
            entries = [logprob_entry(x, False) for x in lps]
            tokens = [text_of(t) for t, _, _ in entries]
            values, tops = [v for _, v, _ in entries], [top for _, _, top in entries]
            if first and echo:  # the prompt's tokens first: the first has no logprob (nothing precedes it)
                tokens = [text_of(t) for t in prompt] + tokens
                values = [None] + [v for _, v, _ in scored or ()] + values
                tops = [None] + [{**{text_of(t): v for t, v in top}, text_of(t0): v0} for t0, v0, top in scored
                                 or ()] + tops
            at = []
            for t in tokens:
                at.append(offsets[i])
                offsets[i] += len(t)
            return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": at}

        async def tokens():
            """(choice, text, logprob entry, finish reason) as the engine loop sends them, until every choice ends."""
            open_ = set(range(len(keys))) if events is not None else set()
            try:
                while open_:
                    i, ev = await events.get()
                    if ev[3] is not None:
                        open_.discard(i)
                    yield i, ev[1], ev[2], ev[3]
            finally:
                for i in open_:  # the client went away (or the handler failed): free the engine's blocks
                    loop.submit(("abort", keys[i]))

        usage = {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}
        if not body.stream:
            texts, lps, reasons = [""] * len(keys), [[] for _ in keys], [None] * len(keys)
            async for i, text, lp, reason in tokens():
                texts[i] += text
                lps[i] += [lp] if lp is not None else []
                reasons[i] = reason
                usage["completion_tokens"] += 1
            usage["total_tokens"] = len(prompt) + usage["completion_tokens"]
            choices = []
            for i in range(len(keys)):
                c = chunk(i, texts[i], lps[i], reasons[i] or "length", first=True)
                if chat:
                    c = {"index": i, "message": {"role": "assistant", "content": texts[i]},
                         "logprobs": c["logprobs"], "finish_reason": reasons[i]}
                choices.append(c)
            return {"id": rid, "object": kind, "created": created, "model": name, "choices": choices, "usage": usage}

        async def chunks():  # the streamed answer's chunks
            head = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": name}
            if chat:
                for i in range(len(keys)):
                    yield {**head, "choices": [chunk(i, "", [], None, first=True)]}
            elif echo:  # the prompt first, then the tokens (max_tokens 0: the prompt is the whole answer)
                for i in range(len(keys)):
                    yield {**head, "choices": [chunk(i, "", [], None if events is not None else "length", first=True)]}
            async for i, text, lp, reason in tokens():
                usage["completion_tokens"] += 1
                if text or reason is not None or lp is not None:
                    yield {**head, "choices": [chunk(i, text, [lp] if lp is not None else [], reason)]}
            if body.stream_options is not None and body.stream_options.include_usage:
                usage["total_tokens"] = len(prompt) + usage["completion_tokens"]
                yield {**head, "choices": [], "usage": usage}
        return (chunks(), keys) if several else sse(chunks())

    def sse(chunks) -> StreamingResponse:
        async def lines():
            try:
                async for c in chunks:
                    yield f"data: {json.dumps(c)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # (a client gone: its requests aborted now, not when the garbage collector finds them)
                await chunks.aclose()
        return StreamingResponse(lines(), media_type="text/event-stream")

    async def interleaved(streams, n: int):
        """Several prompts' streamed answers as one (vLLM's): chunks as they come, prompt i's choice j at index
        i * n + j, under one id; one usage chunk, summed."""
        ready, usage, rid = asyncio.Queue(), {}, "cmpl-" + uuid.uuid4().hex

        async def pump(i, chunks):
            try:
                async for c in chunks:
                    ready.put_nowait((i, c))
            finally:
                ready.put_nowait((i, None))
        tasks = [asyncio.create_task(pump(i, chunks)) for i, (chunks, _) in enumerate(streams)]
        try:
            for _ in tasks:
                while (got := await ready.get())[1] is not None:
                    i, c = got
                    if "usage" in c:
                        usage = {k: usage.get(k, 0) + v for k, v in c["usage"].items()}
                    else:
                        yield {**c, "id": rid, "choices": [{**x, "index": i * n + x["index"]} for x in c["choices"]]}
            if usage:
                yield {**c, "id": rid, "choices": [], "usage": usage}
        finally:  # the client went away: each prompt's requests aborted (its stream's own `finally`)
            for t in tasks:
                t.cancel()

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest):
        many = isinstance(body.prompt, list) and bool(body.prompt) and not isinstance(body.prompt[0], int)
        prompts = [tok.encode(p).ids if isinstance(p, str) else p for p in (body.prompt if many else [body.prompt])]
        if any(not 0 <= t < tok.get_vocab_size() for p in prompts for t in p):
            raise OpenAIError(f"prompt: token ids must be in [0, {tok.get_vocab_size()})", "prompt")
        if any(t in never for p in prompts for t in p):
            raise OpenAIError(f"prompt: token ids {list(never)} stand for an image: an image comes in a chat "
                              "message's image_url part", "prompt")
        if len(prompts) == 1:
            return await answer(body, prompts[0], [eod], body.logprobs, chat=False, echo=body.echo)
        # several prompts (lm-eval's batches): each answered as alone, choice i*n + j is prompt i's choice j
        if body.stream:
            got = await asyncio.gather(*(answer(body, p, [eod], body.logprobs, chat=False, echo=body.echo,
                                                several=True) for p in prompts), return_exceptions=True)
            if refused := next((g for g in got if isinstance(g, BaseException)), None):
                for _, keys in (g for g in got if not isinstance(g, BaseException)):
                    for k in keys:
                        loop.submit(("abort", k))
                raise refused
            return sse(interleaved(got, body.n))
        whole = await asyncio.gather(*(answer(body, p, [eod], body.logprobs, chat=False, echo=body.echo)
                                       for p in prompts))
        choices = [{**c, "index": i * body.n + c["index"]} for i, r in enumerate(whole) for c in r["choices"]]
        usage = {k: sum(r["usage"][k] for r in whole) for k in whole[0]["usage"]}
        return {**whole[0], "choices": choices, "usage": usage}

    @app.post("/tokenize")
    async def tokenize(body: protocol.TokenizeRequest):  # vLLM's: lm-eval's tokenizer_backend=remote counts with ours
        ids = tok.encode(body.prompt).ids
        return {"count": len(ids), "max_model_len": context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: protocol.DetokenizeRequest):
        return {"prompt": tok.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": "tokenizers.Tokenizer", "eos_token": tok.id_to_token(eod), "bos_token": None,
                "pad_token": tok.id_to_token(tokenizer_files.special_ids(tok)["pad"]), "model_max_length": context}

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest):
        messages, urls = [], {}  # a message's text parts joined by newlines (vLLM's), its images' URLs
        for i, m in enumerate(body.messages):
            parts = [protocol.TextPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            messages.append({"role": m.role, "content": "\n".join(p.text for p in parts if p.type == "text")})
            urls.update({(i, j): p.image_url.url for j, p in enumerate(parts) if p.type == "image_url"})
        if urls and image is None:
            raise OpenAIError(f"messages[{min(urls)[0]}]: an image_url part, but the served model takes text only "
                              "(its model file declares no image_inputs)", "messages")
        if len(urls) > 1:  # (vLLM's default limit for LLaVA too: the engine runs one image per prompt)
            raise OpenAIError(f"messages: {len(urls)} images: at most 1 image may be provided in one request",
                              "messages")
        inputs = {}
        for (i, j), url in urls.items():
            inputs = image[1](protocol.data_url_image(url, f"messages[{i}].content[{j}].image_url.url"))
        try:
            prompt = recipes.chat_prompt_ids(messages, tok, {i: image[0] for i, _ in urls})
        except ValueError as e:  # special-token text in a message
            raise OpenAIError(str(e), "messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await answer(body, prompt, tokenizer_files.chat_stop_ids(tok), logprobs, chat=True, inputs=inputs)

    return app


# ---------------------------------------------------------------------------------------------- the command
def parse_args(argv=None):
    p = ArgumentParser(description="Serve a saved run behind an OpenAI-compatible HTTP API (serving/server.py).")
    p.add_argument("--load", required=True, help="the run to serve (a directory train.py saved into)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model's name in the API (default: the run directory's name)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP degree (run under torchrun)")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP degree for an MoE run: world = TP x EP ranks, each running every request")
    p.add_argument("--max-batch", type=int, default=32, help="requests in the running batch at most (vLLM's "
                   "max_num_seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens one step runs at most (vLLM's "
                   "name and default): decodes first, then prompts' chunks fill the rest (chunked prefill)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV-cache block")
    p.add_argument("--num-blocks", type=int, help="blocks in the KV cache (default: a full batch of full contexts)")
    p.add_argument("--preemption", action="store_true", help="admit requests on their prompt's blocks and, when "
                   "the cache runs short, preempt the newest and recompute it later (vLLM's policy; default: each "
                   "request's worst case reserved at admission)")
    p.add_argument("--quantization", choices=sorted(quantization.SERVING), help="weight-only: the attention and MLP "
                   "linears in int8 or int4, one scale per 128 input features, dequantized per layer "
                   "(posttraining/quantization.py; default: the run's dtype)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="keep full KV blocks under their token "
                   "prefix, for later requests that begin alike (a shared system prompt computed once; not for "
                   "models with recurrent layers)")
    p.add_argument("--check-only", action="store_true", help="check the flags, the run and its layout for a world "
                   "of WORLD_SIZE, and the port, in this one process; no weights read (make serve runs it before "
                   "torchrun)")
    p.add_argument("--speculative-config", type=json.loads, metavar="JSON", help="speculative decoding, vLLM's "
                   "flag: {\"method\": \"mtp\" (the run's own MTP layers) or \"draft_model\", \"model\": RUN (a "
                   "smaller run, same tokenizer), \"num_speculative_tokens\": K}; greedy requests only "
                   "(serving/speculative.py)")
    p.add_argument("--speculative-model", metavar="RUN", help="a draft run for speculative decoding (vLLM's older "
                   "flag; \"mtp\": the run's own MTP layers)")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K", help="drafts a step (vLLM's older flag; "
                   "default 1 with --speculative-model)")
    return p.parse_args(argv)


def servable(run, a):
    """Refuse a run (its model None under --check-only) that this server cannot serve as asked."""
    if run.model_file.sample_ids is None and run.model_file.image_inputs is None:
        raise ConfigError(f"--load {a.load}: a --model {run.args.model} run cannot be served: only a causal language "
                          "model generates (its model file declares no sample_ids or image_inputs)")
    if a.enable_prefix_caching:
        run.model_file.refuse("prefix_caching", "--enable-prefix-caching")


def speculation(a) -> tuple[str, str | None, int] | None:
    """(method, draft run, K) from --speculative-config or --speculative-model / --num-speculative-tokens, or None."""
    conf = dict(a.speculative_config or {})
    if a.speculative_model is not None:
        conf.setdefault("method", "mtp" if a.speculative_model == "mtp" else "draft_model")
        conf.setdefault("model", None if a.speculative_model == "mtp" else a.speculative_model)
    if a.num_speculative_tokens is not None:
        conf.setdefault("num_speculative_tokens", a.num_speculative_tokens)
    if not conf:
        return None
    method, run, k = conf.get("method", "draft_model"), conf.get("model"), conf.get("num_speculative_tokens", 1)
    if (method, run is None) not in (("mtp", True), ("draft_model", False)) or set(conf) - {
            "method", "model", "num_speculative_tokens"} or not isinstance(k, int) or k < 1:
        raise ConfigError(f"speculative decoding {conf}: method \"mtp\" (no model) or \"draft_model\" with a "
                          "model RUN, num_speculative_tokens >= 1, nothing else")
    return method, run, k


def fail_fast(fn):
    """fn, but an exception in it ends the whole process (and torchrun's world) at once, its traceback printed: a
    server whose engine died must not go on accepting requests it will never answer."""
    def run():
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    return run


def main(argv=None):
    a = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    tp, ep = a.tensor_model_parallel_size, a.expert_model_parallel_size
    if tp < 1 or ep < 1 or tp * ep != world:
        raise ConfigError(f"--tensor-model-parallel-size {tp} x --expert-model-parallel-size {ep} must equal the "
                          f"world size {world} (torchrun --nproc_per_node)")
    for flag, v in (("--max-batch", a.max_batch), ("--block-size", a.block_size), ("--num-blocks", a.num_blocks)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v} must be >= 1")
    if a.max_num_batched_tokens < a.max_batch:  # (vLLM's check: every running request decodes a token a step)
        raise ConfigError(f"--max-num-batched-tokens ({a.max_num_batched_tokens}) must be greater than or equal to "
                          f"--max-batch ({a.max_batch}, vLLM's max_num_seqs)")
    spec = speculation(a)  # (method, draft run, K) or None
    if not 1 <= a.port <= 65535:
        raise ConfigError(f"--port {a.port} must be in 1..65535")
    if rank == 0:  # the address is free before the model loads and before "serving ... at" is said
        with socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
            try:
                s.bind((a.host, a.port))
            except OSError as e:
                raise ConfigError(f"--host {a.host} --port {a.port}: cannot listen there ({e.strerror or e}): another "
                                  "server on that port? pass --port N") from None
    if a.check_only:  # (make serve runs this in one process before torchrun starts the ranks)
        servable(checkpoint.load_model(a.load, tp=tp, ep=ep, reward_model=False, build=False), a)
        return 0
    if world > 1:
        dist.init_process_group("gloo")
        if rank:  # the ranks follow rank 0, which stops them itself after draining
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    run = checkpoint.load_model(a.load, tp=tp, ep=ep, reward_model=False)
    servable(run, a)
    if a.quantization:  # weight-only (vLLM's --quantization): the linears' weights replaced by codes and scales
        full = quantization.linear_weight_bytes(run.model)
        held = quantization.quantize_linears(run.model, a.quantization, quantization.SERVING)
        if rank == 0:
            print(f"linear weights in {a.quantization}: {held:,} bytes on rank 0 ({full:,} unquantized)", flush=True)
    context = run.model.config.max_position_embeddings
    blocks = a.num_blocks or a.max_batch * -(-context // a.block_size)
    drafter = None
    try:
        if spec:
            method, draft, k = spec
            if method == "draft_model":
                loaded = checkpoint.load_model(draft, tp=tp, ep=ep, reward_model=False, flag="--speculative-model")
                if loaded.tok.to_str() != run.tok.to_str():
                    raise ConfigError(f"--speculative-model {draft}: its tokenizer is not --load {a.load}'s (a draft "
                                      "model needs the same tokenizer)")
            drafter = speculative.MTP(run.model, k) if method == "mtp" else speculative.DraftModel(loaded.model, k)
        engine = serve.Engine(run.model, blocks, a.block_size, a.max_batch, a.preemption, a.enable_prefix_caching,
                              a.max_num_batched_tokens, speculator=drafter)
    except ValueError as e:  # (the drafter's refusals: no MTP layers, recurrent layers, another vocabulary)
        if not spec or isinstance(e, ConfigError):
            raise
        raise ConfigError(f"speculative decoding: {e}") from None
    loop = Loop(engine, run.tok, world, rank)
    if rank:
        loop.run()
    else:
        import uvicorn
        name = a.served_model_name or os.path.basename(os.path.normpath(a.load))
        worker = threading.Thread(target=fail_fast(loop.run), daemon=True)
        worker.start()
        print(f"serving {a.load} as {name!r} at http://{a.host}:{a.port}/v1 (TP {tp}, EP {ep}); Ctrl-C stops",
              flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn drains on them, then raises them again on its way
            signal.signal(sig, lambda *_: None)  # out: this handler lets the shutdown below run, and exit 0
        image = run.model_file.image_inputs and run.model_file.image_inputs(run.model.config)
        uvicorn.Server(uvicorn.Config(make_app(loop, name, run.tok, context, image), host=a.host, port=a.port,
                                      log_level="warning")).run()
        loop.submit(("stop", None))
        worker.join()
    if world > 1:
        dist.destroy_process_group()
    if rank == 0 and drafter is not None:
        print("speculative decoding: {drafted} tokens drafted, {accepted} accepted ({acceptance_rate:.1%}), "
              "{tokens_per_step:.2f} tokens a step".format(**drafter.stats()), flush=True)
    if rank == 0:
        print(f"stopped: every request answered, {world} rank(s) done", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ConfigError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
