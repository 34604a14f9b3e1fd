"""Activation-memory audit: bytes one transformer layer saves for backward, measured, next to the formula.

Run:  .venv/bin/python bench/bench_activations.py      (spawns tp = 1, 2, 4 gloo ranks on this CPU; ~1 min; --list)

Measured on rank 0 of a tp-rank gloo world: one training-mode forward of one GPT layer (transformer.py's Decoder
with one TransformerLayer: LayerNorm, GeLU MLP 4h, biases, dropout 0.1 on attention and hidden states, multi-head
attention) under torch.autograd.graph.saved_tensors_hooks; every tensor autograd keeps is counted once per
storage (q, k, v are views of one QKV output), parameters excluded. --list prints each storage.

The formula (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4), for
s sequence, b batch, h hidden, a heads, t tensor-parallel size, in fp16 (2 bytes; dropout masks 1 byte):
    no parallelism      s·b·h·(34 + 5·a·s/h)
    TP                  s·b·h·(10 + 24/t + 5·a·s/(h·t))
    TP + SP             s·b·h·(34 + 5·a·s/h) / t
    TP + SP, selective  34·s·b·h / t                 (the a·s² attention core recomputed)
    full recompute      2·s·b·h (/t with SP)         (the layer input only)
Ours differs: `ours()` below, planning/memory.py, matches the measurement byte for byte; see DESIGN.md §6.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt  # noqa: E402
import parallel as P  # noqa: E402
from planning import memory  # noqa: E402
from planning.layout import Layout  # noqa: E402
from transformer import Decoder  # noqa: E402

S, B, H, A = 128, 2, 256, 8  # sequence, batch, hidden, heads
RECOMPUTE = {"off": {}, "selective": dict(recompute_granularity="selective"),
             "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}


def layouts(t):
    return [(sp, rc) for sp in ([False, True] if t > 1 else [False]) for rc in RECOMPUTE]


def measure(grid, t, sp, rc, listing):
    c = gpt.Config(num_layers=1, hidden_size=H, num_attention_heads=A, vocab_size=128, max_position_embeddings=S,
                   hidden_dropout=0.1, attention_dropout=0.1, sequence_parallel=sp and t > 1, **RECOMPUTE[rc])
    rng = P.RNGTracker(c.seed, grid)
    layer = Decoder(c, grid, rng, 1, post_process=False)
    P.init_params(layer, c.seed, grid)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(S // t if c.sequence_parallel else S, B, H, requires_grad=True)  # the layer's input
    seen = {}

    def pack(v):
        st = v.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), (st.nbytes(), tuple(v.shape), v.dtype))
        return v

    layer.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda v: v):
        y = layer(x)
    y.sum().backward()  # (the graph is sound: backward runs)
    if listing:
        print(f"-- tp={t} sp={sp} recompute={rc}")
        for nbytes, shape, dtype in sorted(seen.values(), reverse=True):
            print(f"   {nbytes:>9,} B  {shape} {dtype}")
    return sum(n for n, _, _ in seen.values())


def layer_bytes(t, sp, rc, accounting):
    """One layer's bytes by planning/memory.py: "cpu" ours, "gpu" the paper's 16-bit items (DESIGN.md §6)."""
    c = gpt.Config(num_layers=1, hidden_size=H, num_attention_heads=A, vocab_size=128, max_position_embeddings=S,
                   hidden_dropout=0.1, attention_dropout=0.1, **RECOMPUTE[rc])
    layout = Layout(seq=S, micro_batch=B, tp=t, sequence_parallel=sp, recompute=None if rc == "off" else rc,
                          dtype="fp32" if accounting == "cpu" else "bf16")
    return memory.chunk_activations(c, layout, False, False, range(1), accounting)[0]  # (kept after forward)


def ours(t, sp, rc):
    """Our layer's bytes: fp32 everywhere, torch's CPU dropout masks included (fp32, not bool)."""
    return layer_bytes(t, sp, rc, "cpu")


def paper(t, sp, rc):
    return layer_bytes(t, sp, rc, "gpu")


def worker(rank, world, port, out, tps, listing):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    for t in tps:  # one world for every t: tp = t, dp = world / t (the DP replicas measure the same)
        grid = P.Grid(tp=t, dp=world // t)
        res = [(t, sp, rc, measure(grid, t, sp, rc, listing and rank == 0)) for sp, rc in layouts(t)]
        if rank == 0:
            out.put(res)
    dist.destroy_process_group()


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}")
    ap.add_argument("--list", action="store_true", help="print every saved storage")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    return ap.parse_args(argv)


def main():
    args = parse_args()
    ctx = mp.get_context("spawn")
    sbh, world = S * B * H, max(args.tp)
    print(f"s={S} b={B} h={H} a={A} (a·s/h = {A * S // H}); bytes one layer saves for backward, and / (s·b·h)\n")
    print("| t | SP | recompute | measured bytes | measured / sbh | ours (formula) / sbh | paper, fp16 / sbh |")
    print("|---|---|---|---|---|---|---|")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, 29731, q, args.tp, args.list)) for r in range(world)]
    for p in procs:
        p.start()
    for _ in args.tp:
        for t, sp, rc, got in q.get():
            want = ours(t, sp, rc)
            assert got == want, f"t={t} sp={sp} recompute={rc}: measured {got:,} B, the formula says {want:,} B"
            print(f"| {t} | {'on' if sp else 'off'} | {rc} | {got:,} | {got / sbh:.2f} | {want / sbh:.2f} | "
                  f"{paper(t, sp, rc) / sbh:.2f} |", flush=True)
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
