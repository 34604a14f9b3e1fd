"""checkpoint.py — saving, finding and loading runs: sharded torch.distributed.checkpoint in Megatron's layout.

Mirrors Megatron-LM's megatron/training/checkpointing.py (save_checkpoint, load_checkpoint, the iter_0000100/ and
latest_checkpointed_iteration.txt layout) with torch DCP as its dist_checkpointing. A file of its own because two
readers need it and neither is the loop: train.py saves and resumes, and `load_model` rebuilds a saved run in one
process for `train.py sample` and Retro's BERT chunk embedder (retrieval.py), which must not import train.py.

    SAVE/iter_0000100/  .metadata  __0_0.distcp ...  (DCP: each TP slice written once, by its owner)
                        rng_rank0.pt ...              (per-rank RNG states)     meta.json (iteration, flags, scaler)
    SAVE/latest_checkpointed_iteration.txt            written (atomically) only after iter_.../ is complete
TP-sharded tensors are saved as DTensors with their global shape, so DCP reads them back at any TP size.
A strided shard (SwiGLU fc1: [gate_r; up_r] on rank r) is viewed as [2, f/tp, h] of a global [2, f, h].
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import data
import parallel as P
from arguments import ConfigError, import_model, model_config


def checkpoint_state(chunks, optimizer, mesh, fp8: bool = True):
    """{'model': {global name: tensor}, 'optimizer': {global name: {exp_avg, exp_avg_sq, step}}} as views of
    the live tensors, so dcp.load writes straight into them. Pipeline stages save disjoint names (a last stage's
    copy of the tied embedding saves the same values under the same name: DCP keeps one). With `fp8`, also
    'fp8': {global weight name.role.amax_history / .scale} of every FP8 linear: the delayed recipe's state, the
    same on every TP and DP rank (amaxes are reduced), so it loads at any layout."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def as_dtensor(t, p, dim):
        if mesh is None or not getattr(p, "tensor_model_parallel", False):
            return t
        return DTensor.from_local(t, mesh, [Replicate(), Shard(dim)], run_check=False)

    def view(t, p):
        dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
        if isinstance(stride, (list, tuple)):  # per-segment shards (Mamba's in_proj [z_r, x_r, B_r, C_r, dt_r]):
            n = sum(stride) // t.shape[dim]  # one entry per segment, each a plain Shard (Megatron does the same)
            return {f"segment{i}": as_dtensor(seg, p, dim) for i, seg in enumerate(t.split([k // n for k in stride], dim))}
        if stride > 1:
            t, dim = t.unflatten(dim, (stride, -1)), dim + 1  # [.., stride, rows/stride, ..]
        return as_dtensor(t, p, dim)

    state = {"model": {}, "optimizer": {}}
    full = optimizer.full_state() if optimizer is not None else None  # whole per parameter (DP slices gathered)
    for model in chunks:
        gname = model.global_name if hasattr(model, "global_name") else (lambda name: name)
        for name, m in model.named_modules() if fp8 else ():
            if isinstance(getattr(m, "linear_impl", None), P.FP8LinearMeta):
                for role, t in zip(("input", "weight", "grad_output"), m.linear_impl.tensors()):
                    prefix = f"{gname(name + '.weight')}.{role}"
                    state.setdefault("fp8", {}).update({prefix + ".amax_history": t.amax_history,
                                                        prefix + ".scale": t.scale})
        for name, p in model.named_parameters():
            g = gname(name)
            state["model"][g] = view(p.data, p)
            if optimizer is not None:
                ea, eas, step = full[p]
                state["optimizer"][g] = {"exp_avg": view(ea, p), "exp_avg_sq": view(eas, p), "step": step}
    return state


def _barrier():
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _quiet_dcp():  # DCP warns that it runs "in no_dist mode" when there is no process group: that is intended
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def save_checkpoint(args, it, chunks, optimizer, scaler, mesh):
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = Path(args.save) / f"iter_{it:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
    _barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    with _quiet_dcp():
        dcp.save(checkpoint_state(chunks, optimizer, mesh), checkpoint_id=str(tmp))
    rng = {"torch": torch.get_rng_state(), "tracker": [c.rng.states for c in chunks],
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, tmp / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        meta = {"iteration": it, "loss_scale": scaler.scale, "clean_steps": scaler.clean,
                "args": {k: v for k, v in vars(args).items() if k != "model_module"}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = Path(args.save) / "latest_checkpointed_iteration.txt"
        pointer.with_suffix(".tmp").write_text(f"{it}\n")
        os.replace(pointer.with_suffix(".tmp"), pointer)  # the commit point
    _barrier()


def find_checkpoint(load_dir, step=None):
    """(directory, meta) of the checkpoint to load, or None when load_dir has no checkpoint yet."""
    pointer = Path(load_dir) / "latest_checkpointed_iteration.txt"
    if step is None and not pointer.exists():
        return None
    it = step if step is not None else int(pointer.read_text().strip())
    d = Path(load_dir) / f"iter_{it:07d}"
    if not (d / "meta.json").exists():
        raise ConfigError(f"--load {load_dir}: checkpoint {d} is missing or incomplete")
    return d, json.loads((d / "meta.json").read_text())


ARCH_FLAGS = ["model", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "position_embedding_type", "normalization", "swiglu", "disable_bias_linear", "vocab_size",
              "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "max_position_embeddings"]


def load_checkpoint(ckpt, chunks, optimizer, scaler, mesh, layout, fp8_args=None):
    """`fp8_args` (this run's --fp8* flags, or None): the FP8 scaling state is loaded when the checkpoint was saved
    with the same ones; otherwise scaling starts afresh."""
    path, meta = ckpt
    keys = ["fp8", "fp8_format", "fp8_recipe", "fp8_amax_history_len"]
    fp8 = fp8_args is not None and all(meta["args"].get(k) == fp8_args[k] for k in keys)
    if fp8_args is not None and not fp8 and (dist.get_rank() if dist.is_initialized() else 0) == 0:
        saved = {k: meta["args"].get(k) for k in keys}
        print(f"note: {path} was saved with other FP8 settings ({saved}): FP8 scaling starts afresh")
    state = checkpoint_state(chunks, optimizer, mesh, fp8)
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None:  # the distributed optimizer keeps this rank's slices of the loaded moments
        optimizer.load_full_state()
    rank = dist.get_rank() if dist.is_initialized() else 0
    same_layout = all(meta["args"].get(k) == v for k, v in layout.items())
    if same_layout:  # RNG streams are per rank: they carry over only to the same layout (as in Megatron)
        rng = torch.load(path / f"rng_rank{rank}.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        for c, states in zip(chunks, rng["tracker"]):
            c.rng.states = states
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    if optimizer is not None:
        scaler.scale, scaler.clean = meta["loss_scale"], meta["clean_steps"]
    return meta["iteration"], same_layout


def load_model(load_dir, step=None, flag="--load"):
    """A saved run for inference in one process (TP = PP = 1): (model, its flags, its tokenizer, (checkpoint
    directory, meta)). `train.py sample` and Retro's BERT chunk embedder (retrieval.ChunkEmbedder.load) read runs so."""
    ckpt = find_checkpoint(load_dir, step)
    if ckpt is None:
        raise ConfigError(f"{flag} {load_dir}: no checkpoint there (no latest_checkpointed_iteration.txt)")
    args = argparse.Namespace(**ckpt[1]["args"])
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    tok = data.get_tokenizer(None, None, tokenizer_file=str(Path(load_dir) / "tokenizer.json"))
    module = args.model_module = import_model(args.model)
    model = module.Model(model_config(module, args))
    with _quiet_dcp():
        dcp.load({"model": checkpoint_state([model], None, None)["model"]}, checkpoint_id=str(ckpt[0]))
    return model, args, tok, ckpt
