"""Context parallelism: the bytes one rank moves for one layer's attention, per variant (ring p2p, all-gather, a2a),
measured with parallel.count_collectives() against the theory (tests/test_context_parallel.py's cp_theory), and the
mean seconds of its forward + backward, at the default model's attention shape: 8 heads (8 query groups), head dim
32, seq 128, micro-batch 16, float32. 2 and 4 gloo ranks on CPU (the times depend on the machine's load).

    .venv/bin/python bench/bench_cp.py --cp 2 4 --repeats 3

Bytes follow the audit's rule (parallel.py section 2): an all-gather counts its whole output, a reduce-scatter its
whole input, all-to-all / send / recv what this rank sends or receives. What leaves the rank over the wire is
(cp−1)/cp of an all-gather's or all-to-all's logged bytes (its own piece stays home); a ring send is all wire.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from test_context_parallel import cp_bytes_case, cp_theory, work  # noqa: E402

import parallel as P  # noqa: E402
from harness import Pools  # noqa: E402

SHAPE = dict(b=16, heads=8, groups=8, s=128, d=32)


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--cp", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    return ap.parse_args(argv)


def main():
    args = parse_args()
    print(f"command: .venv/bin/python bench/bench_cp.py --cp {' '.join(map(str, args.cp))} --repeats {args.repeats}")
    print("shape: " + ", ".join(f"{k} {v}" for k, v in SHAPE.items()) + " (float32; bytes of one rank, one layer)")
    kv_full = 2 * SHAPE["b"] * SHAPE["groups"] * SHAPE["s"] * SHAPE["d"] * 4
    print(f"the whole K/V of the layer: {kv_full:,} bytes")
    pools, ok = Pools(), True
    try:
        print("\n| cp | variant    | phase    | kind           | bytes measured | bytes theory | ratio | of whole K/V | "
              "fwd+bwd s |")
        print(f"|{'-' * 4}|{'-' * 12}|{'-' * 10}|{'-' * 16}|{'-' * 16}|{'-' * 14}|{'-' * 7}|{'-' * 14}|{'-' * 11}|")
        for cp in args.cp:
            for comm in P.CP_COMM_TYPES:
                res = pools.run(cp_bytes_case, cp, comm=comm, dtype=torch.float32, repeats=args.repeats, **SHAPE)
                want = cp_theory(comm, cp, e=4, **SHAPE)
                seconds = max(r["seconds"] for r in res)
                ok &= all(r["bytes"] == want for r in res)
                got = res[0]["bytes"]
                for phase in ("forward", "backward"):
                    for kind in sorted(set(got[phase]) | set(want[phase])):
                        b, be = got[phase].get(kind, 0), want[phase].get(kind, 0)
                        print(f"| {cp:>2} | {comm:<10} | {phase:<8} | {kind:<14} | {b:>14,} | {be:>12,} | "
                              f"{b / be if be else float('inf'):5.2f} | {b / kv_full:12.3f} | "
                              f"{f'{seconds:9.3f}' if phase == 'forward' else '':>9} |")
    finally:
        pools.close()
    print("\nevery rank, every row: measured / theory = 1.00" if ok else "\nMISMATCH: see the rows whose ratio is not 1.00")
    s = SHAPE["s"]
    for cp in args.cp:  # the causal ring's work: score entries per rank (x b·heads), visible parts only
        balanced = work(lambda r: P.cp_positions(s, cp, r), s, cp)
        contiguous = work(lambda r: torch.arange(s).view(cp, -1)[r], s, cp)
        print(f"cp {cp}, causal ring, score entries per rank (x b·heads): load-balanced chunks {balanced}; "
              f"contiguous chunks {contiguous}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
