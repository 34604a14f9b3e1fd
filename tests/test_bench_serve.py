"""bench/bench_serve.py at a tiny size: a row per concurrency, the engine's greedy tokens equal to generate_one's,
and memory figures that are the paged cache's exactly — the peak is every request's worst case (all arrive together
with the same max_tokens, so each holds ceil((prompt + max_tokens − 1) / block) blocks at the final step), a block
is 2 (K, V) × layers × key/value heads × block size × head dim × 4 bytes (fp32), and the dense figure n × the
longest request's positions × a position's bytes. Percentiles are nearest-rank. Negative control: a peak read after
each step (not at each allocation) misses the final step's blocks, freed within that step. --system-prompt: the head
is taken from the cache by every request after the first, exactly; --soak ends with the engine empty; --engines
gives a row per engine, and --attention-kernels' mechanisms agree with the gather path. --hf: transformers' greedy
generate on our model converted as tools.py export does (3 prompts of different lengths, one left-padded batch and
one at a time) gives the engine's tokens; negative control: padding on the right changes them.
Tolerance: none; blocks, bytes and tokens are integers, compared exactly.
"""
from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

from serving import engine as serve

TINY = ["--block-size", "4", "--new-tokens", "4", "--prompt-len", "3", "9", "--device", "cpu", "--model-args",
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --vocab-size 128"]


def bench():
    """bench/bench_serve.py, imported (its main is behind __name__ == "__main__")."""
    spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parent.parent / "bench" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_serve_prints_a_row_per_concurrency(capsys):
    bench().main(["--concurrency", "1", "3", "--rounds", "2", *TINY])
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    assert all(r.split("|")[-2].strip() == "yes" for r in rows), rows  # same tokens as generate_one


def test_engines_each_a_row_and_the_attention_kernels_agree(capsys):
    """--engines: a row per engine (gather, paged with a budget below most prompts), the same tokens as generate_one;
    --attention-kernels: every mechanism within 1e-5 of the gather path (fp32 sums in another order)."""
    bench().main(["--concurrency", "3", "--engines", "gather", "paged:3", *TINY])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [r[2].strip() for r in rows] == ["gather", "paged:3"] and all(r[-2].strip() == "yes" for r in rows), rows
    bench().main(["--attention-kernels", "--concurrency", "4", "--repeats", "1", *TINY])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if re.match(r"\| [a-z]", line)]
    assert len(rows) == 5 and all(float(r[-2]) <= 1e-5 for r in rows[1:]), rows  # (a header, 4 mechanisms)


def test_a_row_is_its_round_of_median_wall_time():
    rounds = [("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 5.0)]
    assert bench().by_median(rounds, 1) == ("c", 2.0)  # (the lower middle of four)
    assert bench().by_median(rounds[:3], 1) == ("c", 2.0) and bench().by_median(rounds[:1], 1) == ("a", 3.0)


def assert_memory_is_the_caches(peak_of=None):
    B = bench()
    a = B.parse_args(["--concurrency", "3", *TINY])
    model = B.build(a, a.prompt_len[1] + a.new_tokens)
    prompts = B.requests(3, tuple(a.prompt_len), model.config.vocab_size, seed=7)
    tokens, latencies, wall, peak, engine, ttft = B.run_engine(model, prompts, a.new_tokens, a.block_size)
    peak = peak_of(engine, prompts) if peak_of else peak
    worst = sum(math.ceil((len(p) + a.new_tokens - 1) / a.block_size) for p in prompts)
    assert peak == worst, f"peak {peak} blocks, every request's worst case held at once is {worst}"
    c, (block, states) = model.config, B.kv_bytes(engine)
    assert block == 2 * c.num_layers * c.num_query_groups * a.block_size * c.kv_channels * 4 and states == 0
    max_len = max(len(p) for p in prompts) + a.new_tokens
    assert B.memory(engine, prompts, peak, a.new_tokens) == (peak * block, 3 * max_len * block // a.block_size)
    assert tokens == [serve.generate_one(model, p, serve.SamplingParams(max_tokens=4, temperature=0)) for p in prompts]
    assert len(latencies) == 3 and max(latencies) <= wall and all(0 < t <= x for t, x in zip(ttft, latencies))


def test_memory_figures_are_the_paged_caches():
    assert_memory_is_the_caches()
    assert bench().summary([10, 9, 8, 7, 6, 5, 4, 3, 2, 1]) == (5.5, 5, 9)  # p50 the 5th of 10, p90 the 9th


def test_a_peak_read_after_each_step_is_caught():
    """Negative control: the blocks held after each step() (rerun of the same load) miss the final step's."""
    def after_steps(engine, prompts):
        fresh = serve.Engine(engine.model, engine.cache.num_blocks, engine.cache.block_size, engine.max_batch)
        for p in prompts:
            fresh.add_request(p, serve.SamplingParams(max_tokens=4, temperature=0))
        held = []
        while fresh.has_unfinished():
            fresh.step()
            held.append(fresh.cache.num_blocks - len(fresh.cache.free))
        return max(held)
    with pytest.raises(AssertionError, match=r"peak \d+ blocks, every request's worst case held at once is \d+"):
        assert_memory_is_the_caches(after_steps)


def test_a_shared_head_is_computed_once_and_the_soak_ends_empty(capsys):
    """--system-prompt: every request after the first takes the head's full blocks from the cache (exactly), the
    tokens are those without prefix caching; --soak: the engine holds nothing once the requests are done."""
    B = bench()
    a = B.parse_args(["--concurrency", "5", "--system-prompt", "10", *TINY])
    model = B.build(a, a.prompt_len[1] + a.new_tokens + a.system_prompt)
    (off, reused_off, _, out_off), (on, reused, _, out_on) = B.shared_head(model, a)
    assert out_on == out_off and reused_off == 0 and reused == 4 * (10 // 4 * 4) and off - on == reused
    B.main(["--soak", "20", "--concurrency", "3", *TINY])
    assert "(engine: 0 requests held, " in capsys.readouterr().out


def assert_hf_tokens_are_the_engines(left=True):
    """--hf: our tiny GPT converted in memory as tools.py export does, 3 prompts of different lengths as one padded
    batch through transformers' greedy generate (and one at a time): the engine's tokens, exactly."""
    B = bench()
    a = B.parse_args(["--hf", "--block-size", "4", "--new-tokens", "4", "--device", "cpu", "--model-args",
                      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 128"])
    model = B.build(a, 16)
    prompts = [[5, 17, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [64, 32, 16, 8, 4, 2]]
    want = B.run_engine(model, prompts, 4, a.block_size)[0]
    hf = B.hf_model(a, model)
    assert B.run_hf_sequential(hf, prompts, 4)[0] == want
    got = B.run_hf(hf, prompts, 4, left=left)[0]
    assert got == want, f"HF's padded batch gave {got}, the engine {want}"


def test_hf_greedy_tokens_are_the_engines(capsys):
    assert_hf_tokens_are_the_engines()
    bench().main(["--concurrency", "2", "--hf", *TINY])  # the table's 5 HF columns, every request the same tokens
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 1 and len(rows[0]) == 19 and rows[0][-2].strip() == "2/2, 2/2", rows


def test_right_padding_is_caught():
    """Negative control: padding on the right, the short prompts' new tokens follow pad tokens and change."""
    with pytest.raises(AssertionError, match=r"HF's padded batch gave .*, the engine "):
        assert_hf_tokens_are_the_engines(left=False)
