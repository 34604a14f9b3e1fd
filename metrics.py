"""metrics.py — what a training run reports: the progress bar, metrics.jsonl, TensorBoard and loss.png.

Mirrors the logging half of Megatron-LM's `megatron/training/training.py` (training_log, the TensorBoard writer).
A file of its own so train.py stays a loop a reader takes in at once: the loop hands each record here.

Run:    make train MODEL=gpt     (writes runs/gpt/metrics.jsonl, runs/gpt/tensorboard/, runs/gpt/loss.png)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist


def module_losses(model) -> dict:
    """{name: mean} of the losses modules log themselves (a submodule's `logged_losses()` -> {name: tensor([sum,
    count])} since its last call: deepseek.MTPBlock's per-depth MTP losses), summed over every rank, so the mean is
    over the global batch whichever stage and DP rank holds what (TP copies scale sum and count alike). A
    collective: every rank calls it, with or without such modules."""
    sums = {}
    for m in model.modules():
        for k, v in (m.logged_losses() if callable(getattr(m, "logged_losses", None)) else {}).items():
            sums[k] = sums.get(k, 0) + v
    every = [sums]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sums)
    total = {}
    for d in every:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return {k: float(v[0] / v[1]) for k, v in total.items() if v[1] > 0}


class Logger:
    def __init__(self, run_dir, rank, start, total, resume):
        self.on = rank == 0
        if not self.on:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        old = self.path.read_text().splitlines() if resume and self.path.exists() else []
        keep = [line for line in old if json.loads(line)["iteration"] <= start]  # drop lines past the checkpoint
        self.path.write_text("".join(line + "\n" for line in keep))
        self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=start + 1)
        self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, mininterval=1.0)

    def log(self, rec):
        if not self.on:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        for k, v in rec.items():
            if k != "iteration" and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, rec["iteration"])
        if "val_loss" in rec:
            self.bar.write(f"iteration {rec['iteration']}: validation loss {rec['val_loss']:.4f}")
        else:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", gnorm=f"{rec['grad_norm']:.3f}",
                                 tok_s=f"{rec['tokens_per_s']:.0f}")

    def close(self):
        if not self.on:
            return
        self.bar.close()
        self.tb.close()
        recs = [json.loads(line) for line in self.path.read_text().splitlines()]
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        tr = [r for r in recs if "loss" in r]
        va = [r for r in recs if "val_loss" in r]
        ax.plot([r["iteration"] for r in tr], [r["loss"] for r in tr], label="train")
        ax.plot([r["iteration"] for r in va], [r["val_loss"] for r in va], "o-", label="validation")
        ax.set(xlabel="iteration", ylabel="loss (nats/token)", title=str(self.dir))
        ax.legend()
        fig.savefig(self.dir / "loss.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
