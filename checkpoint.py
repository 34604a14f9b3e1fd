"""checkpoint.py — saving, finding and loading runs: sharded torch.distributed.checkpoint in Megatron's layout.

Mirrors Megatron-LM's megatron/training/checkpointing.py (save_checkpoint, load_checkpoint, the iter_0000100/ and
latest_checkpointed_iteration.txt layout) with torch DCP as its dist_checkpointing. A file of its own because three
readers need it and only one is the loop: train.py saves and resumes, and `load_model` rebuilds a saved run in one
process for tools.py (sample, merge, export, score) and Retro's BERT chunk embedder (retrieval.py).

    SAVE/iter_0000100/  .metadata  __0_0.distcp ...  (DCP: each TP slice written once, by its owner)
                        rng_rank0.pt ...              (per-rank RNG states: tensors, read with weights_only)
                        meta.json                     (iteration, the run's settings, scaler)
                        manifest.json                 (size and SHA-256 of every other file: checked before loading)
    SAVE/latest_checkpointed_iteration.txt            written (atomically) only after iter_.../ is complete
Loading verifies the manifest before anything reads a checkpoint file, so a damaged checkpoint ends in one line
naming the file. `check_run_dirs` refuses a --load that does not exist and a --save that would overwrite another run.
TP-sharded tensors are saved as DTensors with their global shape, so DCP reads them back at any TP size.
A strided shard (SwiGLU fc1: [gate_r; up_r] on rank r) is viewed as [2, f/tp, h] of a global [2, f, h].
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

import arguments
import data
import parallel as P
from arguments import Args, ConfigError, model_config, run_flags
from config import ModelFile, model_file
from interop import hf, tokenizer_files
from posttraining import lora, quantization


def dcp():
    """torch.distributed.checkpoint, imported on first use: it pulls in DTensor (~1 s of every process's start)."""
    import torch.distributed.checkpoint
    return torch.distributed.checkpoint


class Checkpoint(NamedTuple):
    """A verified checkpoint directory (SAVE/iter_0000100/) and its meta.json."""
    path: Path
    meta: dict


ADDED = "added_to_base"  # p.added_to_base = True: a parameter a run adds on top of the model it starts from


def added_to_base(p) -> bool:
    """A parameter a run adds on top of its base model (LoRA adapters, posttraining/lora.py; a reward model's value head,
    posttraining/recipes.py): a base checkpoint need not hold it, and a run on a frozen base (LoRA) saves only these."""
    return getattr(p, ADDED, False)


def checkpoint_state(chunks, optimizer, mesh, fp8: bool = True, only=None):
    """{'model': {global name: tensor}, 'optimizer': {global name: {exp_avg, exp_avg_sq, step}}} as views of
    the live tensors, so dcp.load writes straight into them. Pipeline stages save disjoint names (a last stage's
    copy of the tied embedding saves the same values under the same name: DCP keeps one). With `fp8`, also
    'fp8': {global weight name.role.amax_history / .scale} of every FP8 linear: the delayed recipe's state, the
    same on every TP and DP rank (amaxes are reduced), so it loads at any layout. `only(p)`: keep just those
    parameters (a LoRA run saves its adapters, lora.is_adapter; its base is loaded without them)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def as_dtensor(t, p, dim):
        if mesh is None or not getattr(p, "tensor_model_parallel", False) or isinstance(t, DTensor):
            return t  # (a DTensor already: torch FSDP2's DP shard, parallel.TorchFSDP2, at TP 1)
        return DTensor.from_local(t, mesh, [Replicate(), Shard(dim)], run_check=False)

    def view(t, p):
        dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
        if isinstance(stride, (list, tuple)):  # per-segment shards (Mamba's in_proj [z_r, x_r, B_r, C_r, dt_r]):
            n = sum(stride) // t.shape[dim]  # one entry per segment, each a plain Shard (Megatron does the same)
            return {f"segment{i}": as_dtensor(seg, p, dim) for i, seg in enumerate(t.split([k // n for k in stride], dim))}
        if stride > 1:  # (a replicated one too: MoE's fc1 at expert-TP 1 — its rows, dim 0, as when sharded)
            dim = max(dim, 0)
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
            if only is not None and not only(p):
                continue
            g = gname(name)
            state["model"][g] = view(p.data, p)
            if optimizer is not None and p in full:  # (a frozen parameter has no optimizer state)
                ea, eas, step = full[p]
                state["optimizer"][g] = {"exp_avg": view(ea, p), "exp_avg_sq": view(eas, p), "step": step}
        persistent = model.state_dict(keep_vars=True)  # buffers saved with the weights: MoE's expert bias (replicated)
        state["model"].update({gname(name): b for name, b in model.named_buffers() if name in persistent})
    return state


def _barrier():
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _quiet_dcp():  # DCP warns that it runs "in no_dist mode" when there is no process group: that is intended
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


FORMAT = 2  # meta.json's "checkpoint_format": 2 = with manifest.json and tensor-only RNG files (absent: format 1)
MANIFEST = "manifest.json"
POINTER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"iter_(\d{7})")


def _rank():  # also before any process group exists: torchrun sets RANK
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _digest(files: dict) -> str:  # the manifest's own checksum: a damaged manifest.json is told apart from its files
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(d: Path):
    """manifest.json: {"files": {name: {"size", "sha256"}} for every other file of the checkpoint directory, "sha256":
    of that dict}. Rank 0 writes it once every rank's files are complete (after the save's barrier)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(d.iterdir()) if p.name != MANIFEST}
    (d / MANIFEST).write_text(json.dumps({"format": 1, "files": files, "sha256": _digest(files)}, indent=1) + "\n")


def verify_checkpoint(d: Path) -> bool:
    """Check checkpoint directory `d` against its manifest.json before anything reads it: False when it has none (a
    checkpoint saved before manifests existed); otherwise True, or ConfigError naming the first file that is missing,
    unexpected, of another size or of other content. Pure file reads, so every rank reaches the same verdict."""
    m = d / MANIFEST
    if not m.exists():
        return False
    try:
        body = json.loads(m.read_text())
        files = body["files"]
        ok = body["sha256"] == _digest(files) and all(set(f) == {"size", "sha256"} for f in files.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ConfigError(f"{m} is damaged (its checksum does not match its contents): cannot verify {d}")
    present = {p.name for p in d.iterdir()} - {MANIFEST}
    for name in sorted(set(files) - present):
        raise ConfigError(f"{d / name} is missing (listed in {MANIFEST})")
    for name in sorted(present - set(files)):
        raise ConfigError(f"{d / name} is an unexpected file (not in {MANIFEST}): not part of the checkpoint saved")
    for name, f in sorted(files.items()):
        size = (d / name).stat().st_size if (d / name).is_file() else None
        if size != f["size"]:
            raise ConfigError(f"{d / name}: size differs from when it was saved ({size} bytes, {f['size']} in "
                              f"{MANIFEST}): truncated or overwritten")
    for name, f in sorted(files.items()):
        if _sha256(d / name) != f["sha256"]:
            raise ConfigError(f"{d / name}: content differs from when it was saved (SHA-256 mismatch with {MANIFEST})")
    return True


def rng_state(chunks) -> dict:
    """This rank's RNG streams: {"torch": state, "tracker": [{(stream, device): state} per chunk], "cuda": state or
    None}, every state a uint8 tensor; plain containers and tensors only, so weights_only=True reads it back."""
    return {"torch": torch.get_rng_state(), "tracker": [dict(c.rng.states) for c in chunks],
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def read_rng(path: Path) -> dict:
    """An RNG file (rng_state's dict), read with torch.load(weights_only=True): torch's restricted unpickler builds
    tensors and plain containers only and refuses anything else, so no code in the file runs. Anything but the
    expected layout of uint8 tensors: ConfigError naming the file."""
    try:
        rng = torch.load(path, weights_only=True)
    except Exception as e:  # the restricted unpickler refused it (or it is no torch file at all)
        raise ConfigError(f"{path} is not a tensor-only RNG file ({type(e).__name__}); refusing to unpickle it") from None
    state = lambda t: isinstance(t, torch.Tensor) and t.dtype == torch.uint8
    ok = (isinstance(rng, dict) and set(rng) == {"torch", "tracker", "cuda"} and state(rng["torch"])
          and (rng["cuda"] is None or state(rng["cuda"])) and isinstance(rng["tracker"], list)
          and all(isinstance(s, dict) and all(isinstance(k, tuple) and len(k) == 2 and all(isinstance(x, str) for x in k)
                                              and state(t) for k, t in s.items()) for s in rng["tracker"]))
    if not ok:
        raise ConfigError(f"{path} does not hold RNG states (uint8 tensors in the layout checkpoint.rng_state saves)")
    return rng


def save_checkpoint(save_dir, it, chunks, optimizer, scaler, mesh, settings: dict, lora_base: dict | None = None,
                    progress: dict | None = None, keep: int | None = None):
    """Iteration `it` of this rank's chunks, and the optimizer's state (None: weights only, as tools.py merge writes),
    into save_dir/iter_{it:07d}/, atomically (a .tmp directory renamed, then the pointer file). `settings`: the run's
    flags and what it found (meta.json's "args"); `lora_base` ({"path", "sha256"}): the frozen base a LoRA run trains
    on, whose checkpoints then hold only what the run added (added_to_base); `progress`: meta.json entries of where
    the run is beyond its iteration (train.py's: consumed_train_samples, opt_param_scheduler's num_steps); `keep`: once
    committed, all but the newest `keep` checkpoints of save_dir are deleted (--keep-last-checkpoints)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = Path(save_dir) / f"iter_{it:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
    _barrier()

    def write_shards():
        tmp.mkdir(parents=True, exist_ok=True)
        with _quiet_dcp():
            dcp().save(checkpoint_state(chunks, optimizer, mesh, only=added_to_base if lora_base else None),
                     checkpoint_id=str(tmp))
        torch.save(rng_state(chunks), tmp / f"rng_rank{rank}.pt")

    def commit():  # every rank's files are complete: meta.json, then the manifest of them all
        meta = {"iteration": it, "checkpoint_format": FORMAT, "loss_scale": scaler.scale, "clean_steps": scaler.clean,
                "stuck_steps": scaler.stuck, **(progress or {}), "args": settings}
        if lora_base:
            meta["lora_base"] = lora_base  # {"path": base checkpoint directory, "sha256": its manifest's digest}
        if optimizer is None:
            meta["weights_only"] = True  # no optimizer state (tools.py merge): a run starts from it with --finetune
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = Path(save_dir) / POINTER
        pointer.with_suffix(".tmp").write_text(f"{it}\n")
        os.replace(pointer.with_suffix(".tmp"), pointer)  # the commit point
        saved = sorted(int(m.group(1)) for p in Path(save_dir).iterdir() if (m := ITER_DIR.fullmatch(p.name)))
        for old in saved[:-keep] if keep else []:
            shutil.rmtree(Path(save_dir) / f"iter_{old:07d}")

    _saved_on_every_rank(write_shards, save_dir, it, tmp)
    _saved_on_every_rank(commit if rank == 0 else lambda: None, save_dir, it, tmp)


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a file system error): train.py says it in one line."""


def _saved_on_every_rank(step, save_dir, it: int, tmp: Path):
    """Run this rank's part of a save; then every rank learns whether any rank's part failed (an all-gather), so one
    rank's full disk stops them all here instead of leaving the others in the next collective. On failure the
    partial directory goes and SaveError names the cause and the checkpoint the run still has."""
    error = None
    try:
        step()
    except BaseException as e:  # a full disk: OSError, torch's RuntimeError, DCP's CheckpointException (a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        e = next(iter(getattr(e, "failures", {}).values()), (e,))[0]  # DCP's: {rank: (exception, its traceback)}
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    if dist.is_initialized():
        error = P.agree_on_error(error)
    if error is None:
        return
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    latest = _pointer(Path(save_dir), "--save")
    free = shutil.disk_usage(save_dir).free / 2**20
    kept = (f"the previous checkpoint {Path(save_dir) / f'iter_{latest:07d}'} is intact ({POINTER} names it)"
            if latest is not None else "no earlier checkpoint")
    raise SaveError(f"saving iteration {it} to {save_dir} failed ({error}; {free:.1f} MiB free there): {kept}")


def _pointer(run_dir: Path, flag: str):
    """The iteration latest_checkpointed_iteration.txt names, None without one; ConfigError when it is garbled."""
    pointer = run_dir / POINTER
    if not pointer.exists():
        return None
    text = pointer.read_text(errors="replace").strip()
    if not re.fullmatch(r"\d{1,7}", text):
        raise ConfigError(f"{flag} {run_dir}: {pointer} is damaged: expected an iteration number, found {text[:40]!r}")
    return int(text)


def find_checkpoint(load_dir, step=None, flag="--load") -> Checkpoint | None:
    """The Checkpoint to load, or None when load_dir has no checkpoint yet. The directory is
    verified against its manifest first (verify_checkpoint) and its RNG files parsed (tensors only), so a damaged
    checkpoint is refused here, before any process group exists, with one line naming the file. A checkpoint saved
    before manifests existed loads with a warning (runs saved earlier must not be lost)."""
    load_dir = Path(load_dir)
    it = step if step is not None else _pointer(load_dir, flag)
    if it is None:
        return None
    d = load_dir / f"iter_{it:07d}"
    if not d.is_dir():
        raise ConfigError(f"{flag} {load_dir}: checkpoint {d} is missing")
    verified = verify_checkpoint(d)
    if not (d / "meta.json").exists():
        raise ConfigError(f"{flag} {load_dir}: checkpoint {d} is incomplete (no meta.json)")
    try:
        meta = json.loads((d / "meta.json").read_text())
        ok = meta["iteration"] == it and isinstance(meta["args"], dict)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ConfigError(f"{d / 'meta.json'} is damaged: not the JSON a checkpoint of iteration {it} holds")
    if not verified:
        if meta.get("checkpoint_format", 1) >= 2:
            raise ConfigError(f"{d / MANIFEST} is missing: cannot verify {d}")
        if _rank() == 0:
            print(f"WARNING: {d} has no {MANIFEST} (saved before checkpoints had one): loading it unverified",
                  file=sys.stderr, flush=True)
    for p in sorted(d.glob("rng_rank*.pt")):  # every rank checks every file, so all reach the same verdict
        read_rng(p)
    return Checkpoint(d, meta)


def check_run_dirs(args):
    """--load and --save before anything is built: (checkpoint to load or None, resume), resume meaning --load is
    the --save directory. A --load that does not exist is an error (unless it is --save: a run's first start);
    a --save holding a checkpoint is refused unless this run resumes it (--load the same directory) or
    --overwrite-save; then partial iter_*.tmp/ of interrupted saves in --save are removed (rank 0)."""
    load, save = (Path(p) if p else None for p in (args.load, args.save))
    same = load is not None and save is not None and load.resolve() == save.resolve()
    if load is not None and not load.is_dir() and not same:
        raise ConfigError(f"--load {load} " + ("is not a directory" if load.exists() else "does not exist")
                          + " (to start a new run, leave out --load)")
    ckpt = find_checkpoint(load, args.ckpt_step) if load is not None and load.is_dir() else None
    if ckpt is None and load is not None and args.ckpt_step is not None:
        raise ConfigError(f"--ckpt-step {args.ckpt_step}: --load {load} has no checkpoint yet")
    if save is not None and save.exists() and not save.is_dir():
        raise ConfigError(f"--save {save} is a file, not a directory")
    if save is not None:  # a directory this process cannot write to fails now, not at the first save
        try:
            save.mkdir(parents=True, exist_ok=True)
            probe = save / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"--save {save}: cannot write there ({e.strerror or e})") from None
    if save is not None and save.is_dir() and not same and not args.overwrite_save:
        saved = [int(m.group(1)) for p in save.iterdir() if (m := ITER_DIR.fullmatch(p.name)) and p.is_dir()]
        if saved:
            start = f"{ckpt.path} (iteration {ckpt.meta['iteration']})" if ckpt else "scratch"
            raise ConfigError(f"--save {save} holds a run (checkpoint at iteration {max(saved)}) and this run starts "
                              f"from {start}: saving would overwrite it; pass --load {save} to resume it, or "
                              "--overwrite-save to replace it")
    if save is not None and save.is_dir() and _rank() == 0:
        for p in sorted(save.glob("iter_*.tmp")):
            shutil.rmtree(p, ignore_errors=True)
            print(f"removed {p}: a partial checkpoint left by an interrupted save", flush=True)
    return ckpt, same and ckpt is not None


# The flags that shape the weights, which a resumed run and a run's base must share (a model file adds its own:
# config.ModelFile.ARCH_FLAGS). Recomputation, dropout, the layout and the like are not architecture.
ARCH_FLAGS = arguments.ARCH_FLAGS  # the flags that shape the weights (arguments.py)

# ---------------------------------------------------------------------------------------------- where a run starts
# A LoRA run's checkpoints hold what it added (added_to_base: its adapters) and, in meta.json, "lora_base": the path
# of the base checkpoint directory and the SHA-256 digest of its manifest, so --load finds the weights the adapters
# belong to and refuses other ones. --finetune / --pretrained-checkpoint load a checkpoint's weights only (Megatron's).
LORA_FLAGS = ["lora_rank", "lora_alpha", "lora_target_modules", "quantize_base"]  # a LoRA run resumes only with the same adapters


def _manifest_digest(d: Path):
    return json.loads((d / MANIFEST).read_text())["sha256"] if (d / MANIFEST).exists() else None


def pointer_to(ckpt: Checkpoint) -> dict:
    """{"path", "sha256"}: how a run records the checkpoint it started from (its manifest's digest pins the files)."""
    return {"path": str(ckpt.path.resolve()), "sha256": _manifest_digest(ckpt.path)}


def recorded_base(pointer: dict, run_dir, flag="--load", who="the adapters") -> Checkpoint:
    """The checkpoint a run recorded with pointer_to (a LoRA run's base, a DPO run's reference), verified: its files
    against its manifest, its manifest against the digest recorded when the run started. `run_dir`: the run that
    recorded it (for the message)."""
    d = Path(pointer["path"])
    if not (d / "meta.json").is_file():
        raise ConfigError(f"{flag} {run_dir}: its base checkpoint {d} is missing (needed by {who})")
    verify_checkpoint(d)
    if _manifest_digest(d) != pointer["sha256"]:
        raise ConfigError(f"{flag} {run_dir}: its base checkpoint {d} is not the one {who} "
                          f"{'were trained on' if who == 'the adapters' else 'started from'} (its manifest's SHA-256 "
                          "differs)")
    return Checkpoint(d, json.loads((d / "meta.json").read_text()))


class Start(NamedTuple):
    """Where a run starts (plan_start), from --load, --pretrained-checkpoint and --finetune."""
    resume: Checkpoint | None  # the checkpoint it resumes: weights, optimizer, iteration, RNG
    base: Checkpoint | None  # the weights it starts from (a LoRA run: the frozen base its adapters sit on)
    continues: bool  # --load is --save and holds a checkpoint: the run's metrics.jsonl continues
    tokenizer_file: str | None  # --tokenizer-file, else the tokenizer.json of the run it starts from
    vocab_size: int | None  # --vocab-size, else that run's
    lora_base: dict | None  # a LoRA run: pointer_to(its base), recorded in every checkpoint it saves


def plan_start(args) -> Start:
    """Where a run starts, checked before anything is built (check_run_dirs, then Megatron's rules plus LoRA's):
      --finetune                   base = --load's checkpoint, else --pretrained-checkpoint's; nothing is resumed
                                   (iteration 0, a fresh optimizer and RNG)
      --pretrained-checkpoint P    base = P's checkpoint while --load has none; once it has one, the run resumes it
      resuming a LoRA run          base = the checkpoint its meta.json names (lora_base), verified
    A run resumes only with its own --task (a run starting from another run's weights may change task). The run
    takes the tokenizer (tokenizer.json beside the checkpoints) and vocabulary size of the checkpoint it starts
    from, unless --tokenizer-file / --vocab-size say otherwise."""
    ckpt, continues = check_run_dirs(args)
    base = None
    if args.finetune and ckpt is not None:
        ckpt, base = None, ckpt
    elif ckpt is None and args.pretrained_checkpoint:
        if hf.is_folder(args.pretrained_checkpoint):
            raise ConfigError(f"--pretrained-checkpoint {args.pretrained_checkpoint} is a Hugging Face folder: import it "
                              f"once, then start from the import: python tools.py import-hf --hf "
                              f"{args.pretrained_checkpoint} --save RUN; --pretrained-checkpoint RUN")
        base = find_checkpoint(args.pretrained_checkpoint, flag="--pretrained-checkpoint")
        if base is None:
            raise ConfigError(f"--pretrained-checkpoint {args.pretrained_checkpoint}: no checkpoint there")
    if args.finetune and base is None:
        raise ConfigError(f"--finetune: --load {args.load} has no checkpoint to take the weights from")
    task = ckpt.meta["args"].get("task", "pretrain") if ckpt is not None else None  # (older runs: pretraining)
    if task is not None and task != args.task:
        raise ConfigError(f"--load {args.load} is a --task {task} run: resuming it with --task {args.task} is refused; "
                          "start from its weights instead (--finetune, or --pretrained-checkpoint with a new --load)")
    if base is not None and "lora_base" in base.meta:
        raise ConfigError(f"{base.path} holds LoRA adapters, not a whole model: merge them into it first "
                          f"(tools.py merge --load {base.path.parent} --save DIR)")
    if base is not None and args.save and base.path.parent.resolve() == Path(args.save).resolve():
        raise ConfigError(f"--save {args.save} is the run whose weights this run starts from: its checkpoints would "
                          "overwrite that run's; --save elsewhere")
    if ckpt is not None and ckpt.meta.get("weights_only") and not args.no_load_optim:
        raise ConfigError(f"--load {ckpt.path} holds model weights only (no optimizer state: tools.py merge wrote it): "
                          "start from it with --finetune, or resume its iteration with --no-load-optim")
    if ckpt is not None and "lora_base" in ckpt.meta:
        base = recorded_base(ckpt.meta["lora_base"], ckpt.path.parent)
    elif ckpt is not None and args.lora_rank is not None:
        raise ConfigError(f"--lora-rank with --load {args.load}, a run without adapters: add --finetune to adapt its "
                          "model (or --pretrained-checkpoint with a fresh --load)")
    if args.lora_rank is not None and base is None:
        raise ConfigError(f"--lora-rank: --load {args.load} has no checkpoint, so there is no model to adapt: "
                          "pass --pretrained-checkpoint DIR")
    tok_file, vocab = args.tokenizer_file, args.vocab_size
    if (ckpt or base) is not None:  # the tokenizer and vocabulary the model was trained with
        run = (ckpt or base).path.parent
        if tok_file is None and (run / "tokenizer.json").exists():
            tok_file = str(run / "tokenizer.json")
        elif (run / "tokenizer.json").exists() and not tokenizer_files.same_tokenizer(tok_file, run / "tokenizer.json"):
            raise ConfigError(f"--tokenizer-file {tok_file} is not the tokenizer {run / 'tokenizer.json'} the model was "
                              "trained with (its ids would mean other tokens): leave --tokenizer-file out")
        vocab = vocab or (ckpt or base).meta["args"]["vocab_size"]
    return Start(ckpt, base, continues, tok_file, vocab, pointer_to(base) if args.lora_rank is not None else None)


def saved_flags(args) -> dict:
    """The flags that shape the model (ARCH_FLAGS and its model file's; LORA_FLAGS of a LoRA run it resumes) of the
    checkpoint a run would resume (--load's, or --ckpt-step's) or else start from (--pretrained-checkpoint's): train.py
    parses the command line again with them as defaults, so a run on a checkpoint needs none of its size flags
    (Megatron's --use-checkpoint-args, on by default here). Read, not verified (plan_start verifies it later); {} when
    there is no checkpoint or its meta.json does not read."""
    for d, step in ((args.load, args.ckpt_step), (args.pretrained_checkpoint, None)):
        try:
            it = step if step is not None else _pointer(Path(d), "--load") if d else None
            meta = json.loads((Path(d) / f"iter_{it:07d}" / "meta.json").read_text()) if it is not None else None
            saved = meta["args"]
            flags = ARCH_FLAGS + list(model_file(saved["model"]).ARCH_FLAGS) + (LORA_FLAGS if "lora_base" in meta
                                                                               and d == args.load else [])
        except (OSError, ValueError, KeyError, TypeError, ConfigError):
            continue  # no checkpoint there (or a damaged one: plan_start says so)
        return {k: saved[k] for k in flags if k in saved}
    return {}


def check_same_model(args, start: Start, mf: ModelFile, vocab_size: int):
    """The flags that shape the model must be the checkpoints': ARCH_FLAGS and the model file's for the base and for
    a resumed run, and LORA_FLAGS too for a resumed LoRA run. ConfigError naming every difference."""
    now = {**vars(args), "vocab_size": vocab_size}
    for c, what in ((start.base, f"base checkpoint {start.base and start.base.path}"), (start.resume, f"--load {args.load}")):
        if c is None:
            continue
        saved = dict(c.meta["args"])
        flags = ARCH_FLAGS + list(mf.ARCH_FLAGS)
        flags += LORA_FLAGS if c is start.resume and (saved.get("lora_rank") or args.lora_rank) else []
        if any(k not in saved for k in flags):  # saved before the flag existed: it had the flag's default then
            defaults = run_flags(saved, args.model)
            saved.update({k: defaults.get(k) for k in flags if k not in saved})
        diff = {k: (saved.get(k), now.get(k)) for k in flags if saved.get(k) != now.get(k)}
        if diff:
            raise ConfigError(f"{what}: the checkpoint's model differs: "
                              + ", ".join(f"{k}={a} in the checkpoint, {b} now" for k, (a, b) in diff.items()))
        was = saved.get("optimizer", "adam")  # (saved before --optimizer existed: AdamW)
        if c is start.resume and not args.no_load_optim and was != args.optimizer:
            raise ConfigError(f"{what}: its optimizer state is --optimizer {was}'s, not {args.optimizer}'s; "
                              f"--optimizer {was} continues it, --no-load-optim starts a fresh optimizer from its "
                              "weights")


# ---------------------------------------------------------------------------------------------- loading
def saved_names(ckpt: Checkpoint) -> set[str]:
    """The model tensors' names a checkpoint holds (DCP's metadata: no tensor is read)."""
    meta = dcp().FileSystemReader(str(ckpt.path)).read_metadata()
    # (a per-segment parameter, Mamba's in_proj / conv1d, is saved as NAME.segment0, NAME.segment1, ...)
    return {re.sub(r"\.segment\d+$", "", k.split(".", 1)[1]) for k in meta.state_dict_metadata if k.startswith("model.")}


def load_weights(ckpt: Checkpoint, chunks, mesh):
    """Only the model weights of checkpoint `ckpt` into `chunks` (no optimizer, iteration, RNG or FP8 state): the
    start of a --finetune run, a LoRA run's frozen base, a DPO run's reference model. Any layout. A parameter the run
    added on top (added_to_base: adapters, a value head) keeps its initialization unless the checkpoint holds it."""
    held = saved_names(ckpt)
    state = checkpoint_state(chunks, None, mesh, fp8=False)["model"]
    missing = {k for k in state if k not in held}
    added = {k for c in chunks for name, p in c.named_parameters() if added_to_base(p)
             for k in [c.global_name(name) if hasattr(c, "global_name") else name]}
    if missing - added:
        raise ConfigError(f"{ckpt.path} lacks {sorted(missing - added)[:3]}: not a checkpoint of this model")
    with _quiet_dcp():
        dcp().load({"model": {k: v for k, v in state.items() if k in held}}, checkpoint_id=str(ckpt.path))


def load_checkpoint(ckpt: Checkpoint, chunks, optimizer, scaler, mesh, layout, fp8_args=None, load_optim=True,
                    load_rng=True):
    """Resume from `ckpt`: weights (a LoRA run's: what it added), optimizer state, loss scale, RNG streams (same layout
    only, as in Megatron). `fp8_args` (this run's --fp8* flags, or None): the FP8 scaling state is loaded when the
    checkpoint was saved with the same ones; otherwise scaling starts afresh. load_optim=False (Megatron's
    --no-load-optim): the optimizer's moments and the loss scale stay fresh; load_rng=False (--no-load-rng): the RNG
    streams stay the seed's. The iteration is the checkpoint's either way. Returns (iteration, RNG restored)."""
    optimizer = optimizer if load_optim else None
    path, meta = ckpt
    keys = ["fp8", "fp8_format", "fp8_recipe", "fp8_amax_history_len"]
    fp8 = fp8_args is not None and all(meta["args"].get(k) == fp8_args[k] for k in keys)
    if fp8_args is not None and not fp8 and (dist.get_rank() if dist.is_initialized() else 0) == 0:
        saved = {k: meta["args"].get(k) for k in keys}
        print(f"note: {path} was saved with other FP8 settings ({saved}): FP8 scaling starts afresh")
    state = checkpoint_state(chunks, optimizer, mesh, fp8, only=added_to_base if "lora_base" in meta else None)
    with _quiet_dcp():
        dcp().load(state, checkpoint_id=str(path))
    if optimizer is not None:  # the distributed optimizer keeps this rank's slices of the loaded moments
        optimizer.load_full_state()
    rank = dist.get_rank() if dist.is_initialized() else 0
    same_layout = load_rng and all(meta["args"].get(k) == v for k, v in layout.items())
    if same_layout:  # RNG streams are per rank: they carry over only to the same layout (as in Megatron)
        rng = read_rng(path / f"rng_rank{rank}.pt")  # verified and parsed (by find_checkpoint) before
        torch.set_rng_state(rng["torch"])
        for c, states in zip(chunks, rng["tracker"]):
            c.rng.states = states
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    if optimizer is not None:
        scaler.scale, scaler.clean = meta["loss_scale"], meta["clean_steps"]
        scaler.stuck = meta.get("stuck_steps", 0)  # fp16 overflows in a row at the minimum scale (older: none saved)
    return meta["iteration"], same_layout


def load_start(args, start: Start, chunks, optimizer, scaler, mesh, fp8, rank: int, note: str | None = None
               ) -> tuple[int, int, int]:
    """Load what a run starts from (plan_start): the base's weights (--finetune, --pretrained-checkpoint, a LoRA run's
    frozen base), then the checkpoint it resumes (`note`: said after it, scheduler.TimeFit's on its schedule).
    Returns where the run starts, as Megatron counts it and meta.json records it: (iterations done, samples consumed,
    the learning-rate schedule's steps: the samples of the applied steps; --no-load-optim starts the schedule again,
    as Megatron's scheduler state is the optimizer's)."""
    if start.base is not None:  # model weights only: iteration 0, fresh optimizer and RNG (or a LoRA run's base)
        load_weights(start.base, chunks, mesh)
        if rank == 0:
            print(f"model weights from {start.base.path}" + (" (frozen: LoRA adapters train)" if args.lora_rank else ""))
        if args.quantize_base:  # QLoRA: each rank quantizes the base shard it now holds (DESIGN.md §1)
            full = sum(quantization.linear_weight_bytes(c) for c in chunks)
            held = sum(quantization.quantize_linears(c, args.quantize_base) for c in chunks)
            if rank == 0:
                print(f"base linears in {args.quantize_base}: {held:,} bytes on rank 0 (full precision: {full:,})")
    if start.resume is None:
        if args.load and start.base is None and rank == 0:
            print(f"a new run in {args.load}" if args.load == args.save else
                  f"WARNING: no checkpoint in --load {args.load}; starting from scratch")
        if args.task != "pretrain" and start.base is None and rank == 0:
            print(f"note: --task {args.task} starts from random weights (the seed's initialization); pass "
                  "--pretrained-checkpoint DIR to start from a trained model", flush=True)
        return 0, 0, 0
    layout = {k: getattr(args, k) for k in ["world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size"]}
    fp8_args = {k: getattr(args, k) for k in ["fp8", "fp8_format", "fp8_recipe", "fp8_amax_history_len"]}
    first, rng_restored = load_checkpoint(start.resume, chunks, optimizer, scaler, mesh, layout,
                                          fp8_args if fp8 is not None else None, load_optim=not args.no_load_optim,
                                          load_rng=not args.no_load_rng)
    if rank == 0:
        print(f"resumed from {start.resume.path} at iteration {first}"
              + (" (--no-load-optim: a fresh optimizer, loss scale and learning-rate schedule)" if args.no_load_optim
                 else "") + ("" if rng_restored else " (--no-load-rng: RNG streams from the seed)" if args.no_load_rng
                             else " (different layout: RNG streams not restored)"))
        if note:
            print(note, flush=True)
    meta = start.resume.meta  # a checkpoint saved before these were recorded: a constant batch, no skipped step
    consumed = meta.get("consumed_train_samples", first * meta["args"]["global_batch_size"])
    return first, consumed, 0 if args.no_load_optim else meta.get("opt_param_scheduler", {}).get("num_steps", consumed)


def add_adapters(chunks, args):
    """A LoRA run's model (--lora-rank; without it nothing changes): adapters on the --lora-target-modules linears of
    each of `chunks`, everything else frozen (posttraining/lora.py), as the run trains, saves and loads them."""
    for c in chunks if args.lora_rank is not None else []:
        lora.apply_lora(c, args.lora_target_modules, args.lora_rank, args.lora_alpha, args.lora_dropout)


class Loaded(NamedTuple):
    """A saved run rebuilt for inference (load_model)."""
    model: object  # the whole model (TP = PP = 1), or this rank's TP (and EP) shard of it; eval-ready
    args: Args  # the run's settings (its flags and vocabulary), with the layout it was loaded at
    tok: object  # its tokenizer
    ckpt: Checkpoint
    model_file: ModelFile


def load_model(load_dir, step=None, flag="--load", merge=True, extend=None, tp: int = 1, ep: int = 1,
               reward_model: bool | None = None, build: bool = True) -> Loaded:
    """A saved run for inference: in one process (TP = PP = 1; tools.py and Retro's BERT chunk embedder read runs so),
    or on a world of tp x ep ranks (serving/server.py: the checkpoint, saved at any layout, read as this rank's TP shard, the
    experts split over ep ranks that all hold the same tokens; no sequence parallelism, one pipeline stage). A LoRA
    run: its base model with the adapters, merged into the weights (lora.merge) unless merge=False. `extend(model)`:
    what the run added on top of the model before it was saved (recipes.add_value_head for a reward model), so that
    it loads too. reward_model: True — the run must be a reward model (--task rm; its value head is added), False —
    it must not be (it generates), None — either; refused with one line before anything is built. build=False: the
    run and the layout checked (its Config at tp), nothing built or read (model None: the server's --check-only)."""
    ckpt = find_checkpoint(load_dir, step, flag)
    if ckpt is None:
        raise ConfigError(f"{flag} {load_dir}: no checkpoint there (no latest_checkpointed_iteration.txt)")
    saved = ckpt.meta["args"]
    task = saved.get("task", "pretrain")
    if reward_model is False and task == "rm":
        raise ConfigError(f"{flag} {load_dir} is a reward model (--task rm): it scores text (tools.py score), it does "
                          "not generate or export as a causal LM")
    if reward_model and task != "rm":
        raise ConfigError(f"{flag} {load_dir} is a --task {task} run, not a reward model (--task rm)")
    mf = model_file(saved["model"])
    # flags a run saved before they existed take their defaults (of the flags of its time, the same values)
    layout = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "data_parallel_size": ep,
              "expert_model_parallel_size": ep, "context_parallel_size": 1, "sequence_parallel": False}
    if saved.get("expert_tensor_parallel_size") not in (None, 1):
        layout["expert_tensor_parallel_size"] = tp  # experts split like the dense MLP at this TP (or whole at 1)
    args = Args(**{**run_flags(saved), **layout})
    tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(Path(load_dir) / "tokenizer.json"))
    config = model_config(mf, args, tok=tok)  # (a layout the model cannot take refused: TP vs heads)
    if not build:
        return Loaded(None, args, tok, ckpt, mf)
    grid = mesh = None
    if tp * ep > 1:
        from torch.distributed.device_mesh import DeviceMesh
        grid = P.Grid(tp=tp, dp=ep, ep=ep, etp=args.expert_tensor_parallel_size)
        mesh = DeviceMesh("cpu", torch.arange(tp * ep).view(ep, tp), mesh_dim_names=("dp_cp", "tp"))
    model = mf.Model(config, grid)
    if extend is not None:
        extend(model)
    adapters = "lora_base" in ckpt.meta
    if adapters:
        load_weights(recorded_base(ckpt.meta["lora_base"], ckpt.path.parent, flag), [model], mesh)
        if saved.get("quantize_base"):  # a QLoRA run's adapters belong on the base as it trained: dequantized
            quantization.fake_quantize(model, saved["quantize_base"])
        add_adapters([model], args)
    with _quiet_dcp():
        dcp().load({"model": checkpoint_state([model], None, mesh, only=added_to_base if adapters else None)["model"]},
                   checkpoint_id=str(ckpt.path))
    if adapters and merge:
        lora.merge(model)
        args = Args(**{**vars(args), "lora_rank": None})
    return Loaded(model, args, tok, ckpt, mf)


def save_merged(load_dir, save_dir):
    """tools.py merge: a LoRA run's base with its adapters merged (W + (alpha/r)·B·A) saved to `save_dir` as a plain
    checkpoint of model weights (its iteration; its settings without LoRA's; its tokenizer). Start from it with
    --finetune, or sample or export it."""
    run = load_model(load_dir, merge=False)
    if "lora_base" not in run.ckpt.meta:
        raise ConfigError(f"--load {load_dir}: not a LoRA run (no adapters to merge)")
    out = Path(save_dir)
    refuse_run_in(out, "merge")
    lora.merge(run.model)
    settings = {**run.ckpt.meta["args"], "save": str(out), "load": None, "lora_rank": None}
    return save_weights(run.model, run.tok, out, settings, run.ckpt.meta["iteration"])


def save_weights(model, tok, save_dir, settings: dict, iteration: int = 0) -> Path:
    """A checkpoint of `model`'s weights only (no optimizer: meta.json's weights_only) at `iteration`, with `settings`
    as its args and `tok` as tokenizer.json beside it: what tools.py merge and import-megatron write. A run starts
    from it with --pretrained-checkpoint or --finetune."""
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files.save_tokenizer(tok, out / "tokenizer.json")
    save_checkpoint(out, iteration, [model], None, Scale(), None, settings)
    return out


def model_from_flags(args):
    """(a freshly initialized model of train.py's flags `args` in one process, its tokenizer, the run's settings):
    the tokenizer and vocabulary as train.py finds them (--tokenizer-file, else the run's default BPE; --vocab-size),
    the settings as its checkpoints record them. tools.py import-megatron fills the model with a checkpoint's weights."""
    mf = model_file(args.model)
    corpus = data.build_data(args, None, args.tokenizer_file, args.vocab_size, samples=False)
    model = mf.Model(model_config(mf, args, corpus.vocab_size, corpus.tokenizer))
    return model, corpus.tokenizer, {**vars(args), "vocab_size": corpus.vocab_size, "load": None}


def refuse_run_in(save_dir, what: str):
    """ConfigError when `save_dir` holds a run already (merge and import write into an empty or new directory)."""
    out = Path(save_dir)
    if out.is_dir() and any(ITER_DIR.fullmatch(p.name) for p in out.iterdir()):
        raise ConfigError(f"--save {out} holds a run already: {what} into an empty directory")


class Scale(NamedTuple):
    """The loss scaler's state of a checkpoint without training state (fp32: scale 1)."""
    scale: float = 1.0
    clean: int = 0
    stuck: int = 0
