"""serving/server.py driven over HTTP by the official `openai` client, as a user's program would, on one process and at TP 2.

  - greedy completions and chat completions are the tokens gpt.generate gives each prompt alone (the sequential
    oracle, on the saved run loaded in one process), decoded; eight clients at once (continuous batching through HTTP)
    each get their own prompt's answer; and the same at TP 2 (torchrun, two ranks in lock-step, rank 0 answering); the
    loop on warm ranks (TP 2, EP 2, a Mamba hybrid, TP 2 with preemption, with prefix caching, a hybrid with chunked
    prefill) gives the oracle's tokens;
  - streaming (server-sent events): the deltas join into the non-streamed text; the usage chunk counts the tokens; a
    list of prompts streams interleaved, each index's text the non-streamed choice's (one usage chunk, one [DONE]);
  - stop strings cut the text before the first stop and end the request with finish_reason "stop"; a seeded sampled
    request is reproducible and n=2 gives two choices;
  - bad requests get a 400 in OpenAI's error shape (an unknown model, a prompt longer than the context, a negative
    max_tokens, a wrong type, malformed JSON, an empty message list, a token id = the vocabulary size) and the
    server answers the next request; a non-streamed usage's total_tokens is prompt + completion; an image_url part
    is refused by a text-only run (tests/test_server_images.py serves images to a LLaVA run);
  - echo with logprobs scores each prompt token as a full forward's log-softmax (also at TP 2), in vLLM's shape, for
    a batch of token-id prompts as lm-eval sends it; lm-eval's remote tokenizer reads the server's;
  - the engine loop keeps nothing of a request once it has ended (by length, stop, refusal or its client's abort);
  - SIGTERM stops the server: it exits 0 (at TP 2, every rank leaves cleanly; torchrun itself exits 1 on a signal).
Tolerance: tokens are compared exactly. The server's logits come from a packed batch (and at TP 2 from split matmuls),
the oracle's from one sequence's forward: float32 sums in another order, ~1e-6 apart. So the prompts are checked to
have a top-2 logit gap above 1e-3 at every greedy step of the oracle, and a flipped argmax cannot be luck.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

import checkpoint
import gpt
from arguments import parse_args
from harness import SNIPPET, free_port, server_fixture
from interop import tokenizer_files
from posttraining import recipes
from serving import engine as serve

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
PROMPTS = ["def add(a, b):", "import os", "class Point:", "    return", "x = [", "for i in range(", "# a", "if x"]
MAX = 10  # new tokens per greedy request
GAP = 1e-3  # the smallest top-2 logit gap an oracle step may have (see the module docstring)


def save_run(root: Path, name: str, *flags) -> Path:
    """A tiny GPT saved as a run (random weights, init std 0.3 so greedy decoding does not repeat one token)."""
    if not (root / "tokenizer.json").exists():
        tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], str(root / "tokenizer.json"), 384)
    torch.manual_seed(0)
    args = parse_args(["--tokenizer-file", str(root / "tokenizer.json"), "--vocab-size", "384", "--num-layers", "2",
                       "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                       "--max-position-embeddings", "64", "--init-method-std", "0.3",
                       "--data-cache-dir", str(root / "cache"), *flags])
    model, tok, settings = checkpoint.model_from_flags(args)
    return checkpoint.save_weights(model, tok, root / name, settings)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="module")
def run(root):
    return save_run(root, "run")


def make_oracle(run):
    """prompt ids -> (the greedy tokens gpt.generate gives them alone, stopping at `stop`), as text."""
    loaded = checkpoint.load_model(run)
    model, tok = loaded.model.eval(), loaded.tok

    def answer(ids, stop, max_tokens=MAX):
        out = gpt.generate(model, torch.tensor([ids]), max_tokens, temperature=0, eod=stop, use_cache=False)
        new = out[0, len(ids):].tolist()
        with torch.no_grad():
            logits = model(out[:, :-1])[0, len(ids) - 1:]  # [new, V] what each new token was the argmax of
        top2 = logits.topk(2, -1).values
        assert (top2[:, 0] - top2[:, 1]).min() > GAP, "a near tie in the oracle: pick another prompt"
        return tok.decode(new[:-1] if new[-1] in stop else new), "stop" if new[-1] in stop else "length"
    return answer, tok


@pytest.fixture(scope="module")
def oracle(run):
    return make_oracle(run)


class Server:
    """serving/server.py (or torchrun of it) in a subprocess, up once /health answers."""

    def __init__(self, run, world=1, *extra):
        self.port = free_port()
        argv = ["tools.py", "serve", "--load", str(run), "--port", str(self.port), *extra]
        if world > 1:
            argv = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), *argv,
                    "--tensor-model-parallel-size", str(world)]
        self.proc = subprocess.Popen([PY, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        deadline = time.monotonic() + 120
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                out = self.proc.stdout.read()  # (its head too: a rank's own error comes before torchrun's report)
                raise AssertionError(f"server did not come up:\n{out[:2500]}\n...\n{out[-3500:]}")
            time.sleep(0.1)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=120,
                                    max_retries=0)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return json.load(r) == {"status": "ok"}
        except OSError:
            return False

    def post(self, route: str, body: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/{route}", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def stop(self) -> tuple[int, str]:
        """SIGTERM (to torchrun, which passes it on), then the exit code and the output."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError("the server did not stop within 60 s of SIGTERM") from None
        return self.proc.returncode, out


server = server_fixture(Server)  # the file's server on its `run`


def complete(client, prompt, **kw):
    r = client.completions.create(model="run", prompt=prompt, max_tokens=kw.pop("max_tokens", MAX), temperature=0,
                                  **kw)
    return r.choices[0].text, r.choices[0].finish_reason


def assert_serves_the_oracle(client, oracle):
    answer, tok = oracle
    eod = tokenizer_files.special_ids(tok)["eod"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: one running batch
        got = list(pool.map(lambda p: complete(client, p), PROMPTS))
    assert got == [answer(tok.encode(p).ids, [eod]) for p in PROMPTS]


def test_completions_are_the_sequential_oracle(server, oracle):
    assert_serves_the_oracle(server.client, oracle)


def test_chat_uses_the_runs_template(server, oracle):
    answer, tok = oracle
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "3 + 4"}]
    r = server.client.chat.completions.create(model="run", messages=messages, max_tokens=MAX, temperature=0)
    want = answer(recipes.chat_prompt_ids(messages, tok), tokenizer_files.chat_stop_ids(tok))
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == want
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(recipes.chat_prompt_ids(messages, tok))


def test_streaming_joins_into_the_same_text(server):
    text, _ = complete(server.client, PROMPTS[0])
    chunks = list(server.client.completions.create(model="run", prompt=PROMPTS[0], max_tokens=MAX, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == MAX and chunks[-2].choices[0].finish_reason == "length"
    chat = list(server.client.chat.completions.create(
        model="run", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].choices[0].finish_reason is not None
    whole = server.client.chat.completions.create(model="run", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=MAX, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chat) == whole.choices[0].message.content


def test_several_prompts_stream_interleaved(server):
    """A list of prompts streamed (vLLM's): prompt i's choice j comes at index i * n + j, the prompts' chunks
    interleaved (they run in one batch), under one id, then one usage chunk summing them and one [DONE]; each
    index's text joins into the non-streamed answer's choice of that index."""
    body = {"model": "run", "prompt": PROMPTS[:2], "max_tokens": MAX, "temperature": 0, "n": 2}
    whole = server.client.completions.create(**body)
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    order = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
             for i in set(order)}
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 4, texts
    assert order != sorted(order), "the prompts' chunks came one prompt after the other"
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[-2] and not chunks[-1]["choices"]
    assert chunks[-1]["usage"] == {"prompt_tokens": whole.usage.prompt_tokens, "completion_tokens": 4 * MAX,
                                   "total_tokens": whole.usage.prompt_tokens + 4 * MAX}


def test_image_parts_are_refused_by_a_text_only_run(server, oracle):
    """A text-only run refuses an image_url part with a 400 saying why; content as a list of text parts is the
    text joined by newlines (vLLM's)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"model": "run", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    status, err = server.post("chat/completions", json.dumps(body).encode())
    assert status == 400 and "the served model takes text only" in err["error"]["message"], err
    parts = [{"type": "text", "text": "3 +"}, {"type": "text", "text": "4"}]
    got = [server.client.chat.completions.create(model="run", messages=[{"role": "user", "content": c}],
                                                 max_tokens=MAX, temperature=0).choices[0].message.content
           for c in (parts, "3 +\n4")]
    assert got[0] == got[1]


def test_stop_strings_seeds_and_n(server):
    text, _ = complete(server.client, PROMPTS[2])
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from the middle of the greedy answer
    assert stop.strip(), f"pick another prompt: {text!r}"
    cut, reason = complete(server.client, PROMPTS[2], stop=[stop])
    assert (cut, reason) == (text[:text.index(stop)], "stop")
    sampled = [server.client.completions.create(model="run", prompt="x", max_tokens=MAX, temperature=1.0, top_p=0.9,
                                                seed=7, n=2) for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert len(sampled[0].choices) == 2 and sampled[0].usage.completion_tokens == 2 * MAX


def test_logprobs_are_the_engines(server, run):
    """logprobs (completions: the legacy shape, chat: OpenAI's content list): the sampled tokens' log-probabilities and
    the top ones are serve.generate_one's, from the raw logits (float32: 1e-5 absolute, the packed batch's sums)."""
    loaded = checkpoint.load_model(run)
    ids = loaded.tok.encode(PROMPTS[1]).ids
    want = []
    serve.generate_one(loaded.model, ids, serve.SamplingParams(max_tokens=4, temperature=0, logprobs=2), want)
    r = server.client.completions.create(model="run", prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and max(abs(a - b) for a, (b, _) in zip(lp.token_logprobs, want)) < 1e-5
    for got, (_, top) in zip(lp.top_logprobs, want):  # (two tokens of one text would share a key: at most 2)
        assert sorted(got.values(), reverse=True) == pytest.approx([v for _, v in top][:len(got)], abs=1e-5)
    chat = server.client.chat.completions.create(model="run", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 1 and c.logprob <= 0 for c in content)
    # greedy: the sampled token is the most probable one
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6) for c in content)


@pytest.mark.parametrize("body, param", [
    ({"model": "gpt-4", "prompt": "x"}, "model"),
    ({"model": "run", "prompt": "x " * 80}, "prompt"),  # longer than the 64 positions of the context
    ({"model": "run", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "run", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "run", "prompt": [10**6]}, "prompt"),
    ({"model": "run"}, "prompt"),
    (b"{not json", None),
], ids=["unknown model", "too long", "negative max_tokens", "wrong type", "token out of range", "no prompt",
        "malformed JSON"])
def test_bad_requests_get_400_and_the_server_goes_on(server, body, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, err = server.post("completions", raw)
    assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param, err
    assert complete(server.client, "x", max_tokens=2)[1] == "length"  # still serving


def test_the_vocabulary_edge_is_refused_and_usage_adds_up(server, oracle):
    """A token id equal to the vocabulary size is refused (400, param "prompt"), the last id is served; a
    non-streamed answer's usage: total_tokens = prompt_tokens + completion_tokens, for completions and chat. (Mutants
    checked: the range check `<= vocabulary size` passes the first, or kills the engine thread; the non-streamed
    total left at the prompt's count fails the second.)"""
    _, tok = oracle
    v = tok.get_vocab_size()
    status, err = server.post("completions", json.dumps({"model": "run", "prompt": [5, v]}).encode())
    assert status == 400 and err["error"]["param"] == "prompt" and f"[0, {v})" in err["error"]["message"], err
    r = server.client.completions.create(model="run", prompt=[5, v - 1], max_tokens=3, temperature=0)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (2, 3, 5)
    messages = [{"role": "user", "content": "hi"}]
    c = server.client.chat.completions.create(model="run", messages=messages, max_tokens=4, temperature=0, n=2)
    prompt = len(recipes.chat_prompt_ids(messages, tok))
    assert c.usage.prompt_tokens == prompt and 2 <= c.usage.completion_tokens <= 8
    assert c.usage.total_tokens == prompt + c.usage.completion_tokens


def test_the_loop_keeps_nothing_after_requests_end(run, oracle):
    """server.Loop (one process, no HTTP) over requests ended every way: by length, by the end-of-document id, by a
    stop string, refused (too long), aborted by their client: once all have ended, neither the loop (callbacks,
    live requests, keys) nor the engine holds anything of them. (Mutant checked: `advance` not dropping a finished
    request's key fails it.)"""
    from serving import server
    answer, tok = oracle
    loaded = checkpoint.load_model(run)
    loop = server.Loop(serve.Engine(loaded.model, 32, 8, 4), loaded.tok, 1, 0)
    eod = tokenizer_files.special_ids(tok)["eod"]
    text, _ = answer(tok.encode(PROMPTS[2]).ids, [eod])
    ended, gone = [], [f"gone{i}" for i in range(3)]
    work = [(f"p{i}-{j}", PROMPTS[i], []) for i in range(len(PROMPTS)) for j in range(2)]
    work += [("cut", PROMPTS[2], [text[4:6]]), ("long", "x " * 80, [])] + [(k, PROMPTS[0], []) for k in gone]

    def on(key, ev):
        if ev[0] == "accepted" and key in gone:
            loop.submit(("abort", key))  # the client went away
        if ev[0] == "error" or ev[0] == "token" and ev[3] is not None:
            ended.append((key, ev[0] if ev[0] == "error" else ev[3]))
            if len(ended) == len(work) - len(gone):
                loop.submit(("stop", None))
    for key, prompt, stops in work:
        params = serve.SamplingParams(max_tokens=MAX, temperature=0, seed=0, stop=(eod,))
        loop.submit(("add", key, tok.encode(prompt).ids, params, stops), lambda ev, key=key: on(key, ev))
    loop.run()
    assert ("cut", "stop") in ended and ("long", "error") in ended and len(ended) == len(work) - len(gone)
    assert loop.callbacks == {} and loop.live == {} and loop.ids == {} and loop.inbox.empty()
    assert loop.engine.requests == {} and not loop.engine.has_unfinished()


def full_forward_logprobs(model, ids) -> list[float]:
    """Each prompt token's log-probability after the ones before it: one forward, log_softmax over the vocabulary."""
    with torch.no_grad():
        logp = torch.log_softmax(model.eval()(torch.tensor([ids]))[0].float(), -1)  # [s, V]
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def assert_close(got, want, tol=1e-5):
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < tol, (got, want)


def test_echo_scores_the_prompt_as_a_full_forward(server, run):
    """echo with logprobs (lm-eval's loglikelihood requests: a batch of token-id prompts, max_tokens 1; or 0): each
    prompt token's log-probability is a full forward's log-softmax, in vLLM's shape: None for the first token, each
    top dict holding the prompt's own token, text the prompt's, text_offset where each token starts. (float32: the
    server's forward and this one run the same ops on the same weights in two processes, ~1e-7 apart; 1e-5 leaves
    room for another thread count's summation order. Negative control: the scores shifted by one token fail.)"""
    loaded = checkpoint.load_model(run)
    texts = [PROMPTS[0] + "\n" + PROMPTS[3] + " a + b", PROMPTS[5] + "10):"]
    ids = [loaded.tok.encode(t).ids for t in texts]
    body = {"model": "run", "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    status, r = server.post("completions", json.dumps(body).encode())
    assert status == 200 and [c["index"] for c in r["choices"]] == [0, 1], r
    for p, c in zip(ids, r["choices"]):
        lp, want = c["logprobs"], full_forward_logprobs(loaded.model, p)
        assert len(lp["token_logprobs"]) == len(p) + 1 and lp["token_logprobs"][0] is None  # + the generated one
        assert_close(lp["token_logprobs"][1:len(p)], want)
        with pytest.raises(AssertionError):  # off by one: another token's score
            assert_close(lp["token_logprobs"][2:len(p)], want[:-1])
        assert lp["top_logprobs"][0] is None and all(
            lp["tokens"][i] in top and max(top.values()) >= lp["token_logprobs"][i] - 1e-6
            for i, top in enumerate(lp["top_logprobs"][1:len(p)], 1))
        assert c["text"].startswith(loaded.tok.decode(p)) and lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    status, r = server.post("completions", json.dumps({**body, "prompt": texts[1], "max_tokens": 0}).encode())
    lp = r["choices"][0]["logprobs"]  # max_tokens 0: the prompt alone, nothing generated
    assert status == 200 and r["usage"]["completion_tokens"] == 0 and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["text"] == loaded.tok.decode(ids[1]) and len(lp["tokens"]) == len(ids[1])
    assert_close(lp["token_logprobs"][1:], full_forward_logprobs(loaded.model, ids[1]))
    status, err = server.post("completions", json.dumps({**body, "max_tokens": 0, "echo": False}).encode())
    assert status == 400 and err["error"]["param"] == "max_tokens", err


def test_lm_eval_finds_the_servers_tokenizer(server, oracle):
    """vLLM's /tokenize, /detokenize and /tokenizer_info: lm-eval's local-completions (tokenizer_backend auto) counts
    context tokens with the served run's own tokenizer, its end-of-document token one id."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support
    _, tok = oracle
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    assert check_remote_tokenizer_support(url)
    remote = RemoteTokenizer(url)
    assert remote.encode(PROMPTS[0]) == tok.encode(PROMPTS[0]).ids and remote.decode([5, 6]) == tok.decode([5, 6])
    assert remote.eos_token_id == tokenizer_files.special_ids(tok)["eod"]


def test_the_openai_client_raises_on_400(server):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        server.client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="messages"):
        server.client.chat.completions.create(model="run", messages=[])
    assert [m.id for m in server.client.models.list()] == ["run"]


def test_sigterm_stops_the_server_cleanly(server):  # (the module's server: the tests above are done with it)
    code, out = server.stop()
    assert code == 0 and "stopped: every request answered, 1 rank(s) done" in out, out[-2000:]


def test_tensor_parallel_serves_the_same_tokens(run, oracle):
    """At TP 2, with preemption and prefix caching on and a pool of 12 blocks of 4 (three requests' worst cases): the
    eight clients at once still get the oracle's answers."""
    s = Server(run, 2, "--preemption", "--enable-prefix-caching", "--block-size", "4", "--num-blocks", "12")
    try:
        assert_serves_the_oracle(s.client, oracle)
    finally:
        code, out = s.stop()
    # torchrun itself exits 1 on a SIGTERM it received (its SignalException), after passing it on to the ranks: the
    # ranks' own exit is what is checked: rank 0 drained, told rank 1 to stop, both left the process group
    assert "stopped: every request answered, 2 rank(s) done" in out and "ChildFailedError" not in out, out[-3000:]


# ---------------------------------------------------------------------------------------------- the loop on warm ranks
def loop_case(rank, n, run, tp, ep, blocks=64, preempt=False, head="", budget=None):
    """server.Loop on n = tp x ep warm ranks, no HTTP: rank 0 submits half the prompts (each after `head`; with one,
    prefix caching on), the rest once the first answer has its first token (so they join a running batch), and
    "stop" once every answer has ended. Rank 0 returns [(text, finish reason)] in PROMPTS' order, the engine's
    preemptions and the prompt tokens it took from the prefix cache."""
    from serving import server
    loaded = checkpoint.load_model(run, tp=tp, ep=ep)
    loop = server.Loop(serve.Engine(loaded.model, blocks, 8, 4, preempt=preempt, prefix_caching=bool(head),
                                    max_num_batched_tokens=budget), loaded.tok, n, rank)
    eod, got = tokenizer_files.special_ids(loaded.tok)["eod"], {}

    def add(i):
        params = serve.SamplingParams(max_tokens=MAX, temperature=0, seed=i, stop=(eod,))
        loop.submit(("add", str(i), loaded.tok.encode(head + PROMPTS[i]).ids, params, []), lambda ev, i=i: on(i, ev))

    def on(i, ev):
        if ev[0] == "token":
            text, reason = got.get(i, ("", None))
            got[i] = (text + ev[1], ev[3])
            if i == 0 and len(got) == 1:
                for j in range(len(PROMPTS) // 2, len(PROMPTS)):
                    add(j)
            if len(got) == len(PROMPTS) and all(r is not None for _, r in got.values()):
                loop.submit(("stop", None))
    if rank == 0:
        for i in range(len(PROMPTS) // 2):
            add(i)
    loop.run()
    return ([got[i] for i in range(len(PROMPTS))], loop.engine.preemptions, loop.engine.reused) if rank == 0 else None


MAMBA = ["--model", "mamba", "--hybrid-layer-pattern", "M*", "--mamba-num-groups", "2", "--mamba-head-dim", "16",
         "--mamba-state-dim", "16", "--mamba-chunk-size", "16"]


HEAD = "# Write Python code, short.\n"  # a shared "system prompt": 27 tokens, 3 full blocks of 8


@pytest.mark.parametrize("tp, ep, flags, preempt, head, budget", [
    (2, 1, [], False, "", None), (1, 2, ["--num-experts", "4", "--moe-router-topk", "2"], False, "", None),
    (2, 1, MAMBA, False, "", None), (2, 1, [], True, "", None), (2, 1, [], False, HEAD, None),
    (2, 1, MAMBA, False, "", 5)], ids=["tp2", "moe-ep2", "mamba-hybrid-tp2", "tp2-preemption", "tp2-prefix-caching",
                                       "mamba-hybrid-tp2-chunked-prefill"])
def test_ranks_in_lock_step_serve_the_oracle(pool, root, tp, ep, flags, preempt, head, budget):
    """Continuous batching on ranks in lock-step (rank 0's commands broadcast each step): at TP 2 (a GPT, and a
    Mamba hybrid: its recurrent-state slots beside the paged KV cache), and an MoE run with its experts split over EP
    2 ranks that both run every request, are each request's tokens alone; and at TP 2 with preemption (a pool of 6
    blocks: too few for 4 running requests, so the newest are preempted and recomputed, alike on both ranks) and
    with prefix caching (every prompt after one shared head: the later ones take its blocks from the cache); and with
    chunked prefill (a budget of 5 tokens a step: the longer prompts cut, a hybrid's later chunks going on from the
    state its earlier ones left)."""
    run = save_run(root, f"run-{tp}-{ep}" + ("-preempt" if preempt else "") + ("-prefix" if head else ""), *flags)
    answer, tok = make_oracle(run)
    eod = tokenizer_files.special_ids(tok)["eod"]
    got, preemptions, reused = pool.run(loop_case, tp * ep, run=run, tp=tp, ep=ep, blocks=6 if preempt else 64,
                                        preempt=preempt, head=head, budget=budget)[0]
    assert got == [answer(tok.encode(head + p).ids, [eod]) for p in PROMPTS]
    assert (preemptions > 0) == preempt and (reused >= 16 * (len(PROMPTS) // 2)) == bool(head), (preemptions, reused)


def score_case(rank, n, run, ids):
    """server.Loop's "score" command (echo's prompt scoring) on n = TP warm ranks: every rank runs the forward."""
    from serving import server
    loaded = checkpoint.load_model(run, tp=n)
    loop, got = server.Loop(serve.Engine(loaded.model, 16, 8, 4), loaded.tok, n, rank), []
    if rank == 0:
        loop.submit(("score", "k", ids, 2), lambda ev: (got.append(ev), loop.submit(("stop", None))))
    loop.run()
    return got[0] if rank == 0 else None


def test_echo_scores_alike_at_tensor_parallel_2(pool, run, oracle):
    """At TP 2 (split matmuls, the vocabulary-parallel output gathered) the prompt's scores are one process's full
    forward (1e-5: float32 sums in another order)."""
    _, tok = oracle
    ids = tok.encode(PROMPTS[0] + " " + PROMPTS[6]).ids
    kind, entries = pool.run(score_case, 2, run=run, ids=ids)[0]
    assert kind == "scored" and [t for t, _, _ in entries] == ids[1:] and all(len(top) == 2 for _, _, top in entries)
    assert_close([v for _, v, _ in entries], full_forward_logprobs(checkpoint.load_model(run).model, ids))
