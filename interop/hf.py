"""interop/hf.py — Hugging Face model folders in and out: a local folder (config.json, *.safetensors, tokenizer files) becomes
a checkpoint of ours that any run starts from, and a run goes back out as a folder `transformers` loads and serves.

    tools.py import-hf --hf DIR --save RUN     DIR: a local Hugging Face folder (nothing is downloaded)
    train.py --pretrained-checkpoint RUN ...   any task (pretraining, --task sft/dpo/kto/rm), layout, LoRA
    tools.py export --load RUN2 --hf-out OUT   config.json, safetensors in the folder's layout, its tokenizer files

This is Megatron-Bridge's flow (AutoBridge.import_ckpt, then training from the Megatron checkpoint, then export) and
ms-swift's (`swift export --to_mcore`, `megatron sft --load`, `--to_hf`). Reading: read_folder and file_state (the
folder's tensors, read lazily), memory_state (the layout `transformers` holds in memory: the converters read it);
import: tools.py import_hf, one full state dict written as sharded DCP; the run's architecture: `hf_architecture`
(arguments.model_config); export: by tracing the converter on element numbers, so that import then export is the
identity on every tensor. How and why: DESIGN.md §1, "Hugging Face folders in and out".

Dimension glossary: gpt.py's. Tests: tests/test_hf_folders.py, test_hf_mtp.py (DeepSeek-V3's MTP layers, copies),
test_hf_first_loss.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from config import ConfigError, model_file, model_files
from interop import tokenizer_files

INDEX = "model.safetensors.index.json"
SERVING_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class Folder(NamedTuple):
    """A Hugging Face model folder, listed (read_folder): no tensor is read."""
    path: Path
    config: dict  # config.json
    tensors: dict  # {name as stored: (file name, safetensors dtype, shape)}


def is_folder(path) -> bool:
    """A Hugging Face model folder: config.json beside model.safetensors or its shards' index."""
    p = Path(path)
    return (p / "config.json").is_file() and ((p / "model.safetensors").is_file() or (p / INDEX).is_file())


def read_folder(path) -> Folder:
    """List a local Hugging Face folder. One-line ConfigError naming the file for anything missing or unreadable
    (a .bin-only folder included: only safetensors are read, pickles never)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"--hf {path}: not a local folder (nothing is downloaded: fetch it first, e.g. with "
                          "huggingface_hub.snapshot_download)")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p / 'config.json'}: unreadable ({e})") from None
    if (p / INDEX).is_file():
        try:
            files = sorted(set(json.loads((p / INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{p / INDEX}: unreadable ({e})") from None
    elif (p / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"{p}: no model.safetensors or {INDEX} (a folder of .bin pickles: re-save it with "
                          "save_pretrained(safe_serialization=True))")
    tensors = {}
    for name in files:
        try:
            header = _header(p / name)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{p / name}: not a readable safetensors file ({e})") from None
        tensors.update({k: (name, v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"})
    quantized = config.get("quantization_config") or next(
        (f"{k} is {v[1]}" for k, v in tensors.items() if v[1].startswith(("F8", "I4", "U4"))), None)
    if quantized:  # (DeepSeek-V3's own release: float8 weights with *.weight_scale_inv block scales)
        raise ConfigError(f"{p}: a quantized checkpoint ({quantized}): not read (its scales would be dropped); "
                          "dequantize it to bfloat16 or float32 first")
    return Folder(p, config, tensors)


def _header(path) -> dict:
    """A safetensors file's JSON header (8 bytes of length, then the JSON): names, dtypes, shapes, offsets. A file
    shorter than its header says (a truncated copy or download) is refused here, before any tensor is read."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n < 100_000_000:
            raise ValueError(f"header length {n}")
        header = json.loads(f.read(n))
    end = 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if os.path.getsize(path) < end:
        raise ValueError(f"truncated: {os.path.getsize(path):,} bytes, its header describes {end:,}")
    return header


# ---------------------------------------------------------------------------------------------- the folder as a state dict
class Lazy(Mapping):
    """{name: tensor} whose tensors are made on access, one at a time (make(name)); `kind`: file_state's."""

    def __init__(self, names, make, kind="real"):
        self.names, self.make, self.kind = list(names), make, kind

    def __getitem__(self, name):
        if name not in self.names:
            raise KeyError(name)
        return self.make(name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def file_state(folder: Folder, kind: str = "real") -> Lazy:
    """The folder's tensors by their stored names: "real" read from the file on access (safetensors maps the file;
    only that tensor's bytes are read), "meta" empty tensors of their shape and dtype, "ids" int64 tensors numbering
    every element of every tensor 1, 2, 3, ... in name order (0 is left for what no element of the folder fills:
    vocabulary padding)."""
    if kind == "real":
        from safetensors import safe_open  # (requirements.txt)
        return Lazy(folder.tensors, lambda k: safe_open(str(folder.path / folder.tensors[k][0]), "pt").get_tensor(k))
    if kind == "meta":
        return Lazy(folder.tensors, lambda k: torch.empty(folder.tensors[k][2], dtype=DTYPES[folder.tensors[k][1]],
                                                          device="meta"), kind)
    offsets, n = {}, 1
    for k in folder.tensors:
        offsets[k], n = n, n + math.prod(folder.tensors[k][2])
    return Lazy(folder.tensors, lambda k: torch.arange(offsets[k], offsets[k] + math.prod(folder.tensors[k][2]))
                .view(folder.tensors[k][2]), kind)


def live_name(layout: dict, stored_name: str) -> str:
    """A stored tensor's name in the live model (the layout's renames)."""
    for pattern, to in layout.get("renames", ()):
        stored_name = re.sub(pattern, to, stored_name)
    return stored_name


def copies_of(layout: dict, names) -> dict:
    """{stored name: the stored name it is a copy of}, by the layout's "copies" [(regex, [source names])]: a tensor
    the folder stores twice (DeepSeek-V3's MTP layers hold the model's embedding and output weights again), which
    our model holds once. The source is the first of the names present (an output layer tied to the embedding is
    not stored)."""
    names, out = set(names), {}
    for pattern, sources in layout.get("copies", ()):
        src = next((s for s in sources if s in names), None)
        out.update({k: src for k in names if src is not None and re.fullmatch(pattern, k)})
    return out


def without_copies(layout: dict, stored: Mapping) -> Lazy:
    """The stored state less its copies (copies_of), which must equal their sources when the tensors are read
    (a folder whose copies differ is refused naming both: our model has one tensor for the two)."""
    copies = copies_of(layout, stored)
    if getattr(stored, "kind", "real") == "real":
        for k, src in copies.items():
            if not torch.equal(stored[k], stored[src]):
                raise ConfigError(f"{k} differs from {src}: the model holds one tensor for both (shared), so it "
                                  "cannot represent the two")
    return Lazy([k for k in stored if k not in copies], stored.__getitem__, getattr(stored, "kind", "real"))


def memory_state(layout: dict, stored: Mapping) -> Lazy:
    """The stored state dict in `transformers`' in-memory layout, by the rules a model file declares for its
    model_type (config.ModelFile.HF_LAYOUTS, transformers' conversion_mapping): "renames" [(regex, replacement)]
    (LLaVA's prefixes, Mixtral's block_sparse_moe), and with "experts" (gate, up, down names) each MoE layer's
    experts stacked as transformers 5 holds them:
    experts.{j}.{gate,up}.weight [f, h] -> experts.gate_up_proj [E, 2f, h] ([gate_j; up_j] per expert), and
    experts.{j}.{down}.weight [h, f] -> experts.down_proj [E, h, f]. Lazy: a stacked tensor reads its experts on
    access."""
    names = {live_name(layout, k): k for k in stored}
    if "experts" not in layout:
        return Lazy(names, lambda k: stored[names[k]])
    gate, up, down = layout["experts"]
    expert = re.compile(rf"(.*\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight$")
    stacks = {}  # stacked name -> {part: {j: stored name}}
    plain = {}
    for k, src in names.items():
        m = expert.match(k)
        if m is None:
            plain[k] = src
            continue
        stacked = m[1] + (".down_proj" if m[3] == down else ".gate_up_proj")
        stacks.setdefault(stacked, {}).setdefault(m[3], {})[int(m[2])] = src

    def make(k):
        if k in plain:
            return stored[plain[k]]
        parts = stacks[k]
        per = lambda part: torch.stack([stored[parts[part][j]] for j in sorted(parts[part])])  # [E, rows, cols]
        return per(down) if k.endswith(".down_proj") else torch.cat([per(gate), per(up)], dim=1)
    return Lazy([*plain, *stacks], make)


ALIASES = {"image_token_id": "image_token_index", "num_experts": "num_local_experts"}  # transformers attribute_map:
# attribute -> the key config.json stores it under


def config_view(d: dict):
    """config.json as the attributes a converter reads (a transformers config object's way): nested *_config
    dicts as views too, transformers' JSON spelling of non-finite floats ({"__float__": "Infinity"}) as floats, and
    the older names of renamed attributes (ALIASES); a missing attribute raises AttributeError, so
    getattr(hc, name, default) works."""
    def value(k, v):
        if isinstance(v, dict) and set(v) == {"__float__"}:
            return float(v["__float__"])
        if isinstance(v, (list, tuple)):
            return type(v)(value(k, x) for x in v)
        return config_view(v) if k.endswith("_config") and isinstance(v, dict) else v
    out = {k: value(k, v) for k, v in d.items()}
    out.update({new: out[old] for new, old in ALIASES.items() if old in out and new not in out})
    return types.SimpleNamespace(**out)


def converter_for(model_type):
    """(model file, converter) of the repository's model file whose HF_CONVERTERS names this model_type."""
    for name in model_files():
        mf = model_file(name)
        if model_type in mf.HF_CONVERTERS:
            return mf, mf.HF_CONVERTERS[model_type]
    known = sorted(t for name in model_files() for t in model_file(name).HF_CONVERTERS)
    raise ConfigError(f"model_type {model_type!r} is not supported (these are: {', '.join(known)})")


def convert(config: dict, stored: Mapping, dtype=None):
    """(model file, our Config, our full state dict) of a Hugging Face config.json and state dict in the stored
    layout (file_state), through the model file's converter. A setting the converter cannot represent: ConfigError
    naming it."""
    model_type = config.get("model_type")
    mf, conv = converter_for(model_type)
    layout = mf.HF_LAYOUTS.get(model_type, {})
    state = memory_state(layout, without_copies(layout, stored))
    first = next(iter(state.values()), None) if dtype is None else None
    dtype = dtype or (first.dtype if first is not None and first.is_floating_point() else torch.float32)
    source = types.SimpleNamespace(config=config_view(config), state_dict=lambda: state,
                                   parameters=lambda: iter([torch.empty(0, dtype=dtype)]))
    try:
        c, full = conv(source, mf.Config, dtype)
    except (ValueError, AttributeError, KeyError) as e:
        raise ConfigError(f"Hugging Face {model_type} folder: {e}") from None
    return mf, c, full


# ---------------------------------------------------------------------------------------------- the run's architecture
def arch_of(folder: Folder) -> dict:
    """The setting `hf_architecture` a run records: config.json, the stored tensors' dtypes and shapes, and the small
    files serving needs (SERVING_FILES, as text: the tokenizer's special tokens, chat template, generation config), so
    every run started from it exports a complete folder (tokenizer.json is the run's own, saved beside it)."""
    return {"config": folder.config, "tensors": {k: [dt, list(shape)] for k, (_, dt, shape) in folder.tensors.items()},
            "files": {n: (folder.path / n).read_text() for n in SERVING_FILES if (folder.path / n).is_file()}}


def _folder_of(arch: dict) -> Folder:
    return Folder(Path("."), arch["config"], {k: ("", dt, tuple(shape)) for k, (dt, shape) in arch["tensors"].items()})


def architecture(arch: dict, mf=None):
    """Our Config of a recorded `hf_architecture` (the converter on meta tensors: nothing is read). `mf`: the run's
    model file, which must be the one that converts this model_type."""
    found, c, _ = convert(arch["config"], file_state(_folder_of(arch), "meta"), torch.float32)
    if mf is not None and found.name != mf.name:
        raise ConfigError(f"--model {mf.name}: the Hugging Face model_type {arch['config'].get('model_type')!r} is "
                          f"--model {found.name}'s")
    return c


# ---------------------------------------------------------------------------------------------- import
def tokenizer(path):
    """The folder's tokenizer (tokenizer_files.folder_tokenizer: tokenizer.json, its special tokens and chat template), taken as
    it is (Roles.fixed: its vocabulary is the model's embedding, nothing is added): a role it has no token for is
    played by eos — pad, as transformers users set it for batching; cls, sep, mask, which a decoder never reads."""
    tok = tokenizer_files.folder_tokenizer(path)
    missing = {r: tok.roles.eod for r in tokenizer_files.ROLES if tok.token_to_id(getattr(tok.roles, r)) is None}
    tok.roles = dataclasses.replace(tok.roles, **missing, fixed=True)
    return tok


def spelled(c, flags) -> dict:
    """Every flag that spells a field of `c`, with the value that says it."""
    out = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name in flags and f.name not in RUN_FIELDS}
    out.update(swiglu=c.gated_linear_unit and c.activation == "silu", disable_bias_linear=not c.add_bias_linear,
               untie_embeddings_and_output_weights=not c.share_embeddings_and_output_weights,
               norm_epsilon=c.layernorm_epsilon, apply_layernorm_1p=c.layernorm_zero_centered_gamma)
    return {k: v for k, v in out.items() if k in flags}


# Config fields a run sets itself whatever model it starts from (training, not architecture)
RUN_FIELDS = {"hidden_dropout", "attention_dropout", "init_method_std", "sequence_parallel", "params_dtype",
              "label_smoothing", "seed", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type",
              "moe_pad_expert_input_to_capacity", "moe_router_load_balancing_type", "moe_token_drop_policy",
              "moe_router_bias_update_rate", "recompute_granularity", "recompute_method", "recompute_num_layers",
              "cp_comm_type", "mtp_loss_scaling_factor", "encoder_seq_length", "decoder_seq_length"}


# ---------------------------------------------------------------------------------------------- export
class ExportError(ConfigError):
    """An export that would not be exact, or a setting Hugging Face's classes cannot represent (convert.gpt_to_hf): the
    message names the tensor or the setting, in one line."""


def export_state(arch: dict, full: dict, dtype=None) -> tuple[dict, list]:
    """Our full state dict -> ({stored name: tensor} in the folder's own layout, [names left out]), by tracing
    (DESIGN.md §1, "Hugging Face folders in and out"): each element of ours goes back to the element of the folder it
    came from. `dtype`: of the tensors written (None: each tensor's dtype in the folder)."""
    folder = _folder_of(arch)
    traced = import_trace(arch).ids
    total = 1 + sum(math.prod(s) for _, _, s in folder.tensors.values())
    flat = torch.zeros(total, dtype=torch.float64)
    filled = torch.zeros(total, dtype=torch.bool)
    for name, ids in traced.items():
        if ids.dtype != torch.int64 or (ids.numel() and (ids.min() < 0 or ids.max() >= total)):
            raise ExportError(f"export: {name} is computed from the folder's tensors, not moved: tracing cannot "
                              "invert it")
        if name not in full or full[name].shape != ids.shape:
            raise ExportError(f"export: the model's {name} does not match the architecture's "
                              f"{tuple(ids.shape)} (a model of another shape)")
        moved = ids > 0
        if filled[ids[moved]].any() or ids[moved].unique().numel() != int(moved.sum()):
            raise ExportError(f"export: {name} repeats elements of the folder's tensors: tracing cannot invert it")
        flat[ids[moved]] = full[name].detach()[moved].double()
        filled[ids[moved]] = True
    out, left, offset = {}, [], 1
    for k, (_, dt, shape) in folder.tensors.items():
        n = math.prod(shape)
        got = filled[offset: offset + n]
        if not got.any():
            left.append(k)
        elif not got.all():
            raise ExportError(f"export: only {int(got.sum())} of {n} elements of {k} come from the model")
        else:
            out[k] = flat[offset: offset + n].view(shape).to(dtype or DTYPES[dt]).contiguous()
        offset += n
    mf, _ = converter_for(arch["config"].get("model_type"))
    copies = copies_of(mf.HF_LAYOUTS.get(arch["config"].get("model_type"), {}), folder.tensors)
    out = {k: out[k] if k in out else out[copies[k]].to(dtype or DTYPES[folder.tensors[k][1]]).clone()
           for k in folder.tensors if k in out or copies.get(k) in out}  # a copy: its source's values, again
    return out, [k for k in left if k not in out]


def export_folder(arch: dict, full: dict, tok, out_dir, dtype=None):
    """tools.py export of a run on an imported model: the folder again — config.json (its dtype the written one),
    model.safetensors (the folder's layout, export_state), the run's tokenizer.json and the folder's serving files
    (arch_of). Returns (out_dir, names left out)."""
    from safetensors.torch import save_file

    state, left = export_state(arch, full, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config = {**arch["config"], "dtype": written}
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    for name, text in arch.get("files", {}).items():
        (out / name).write_text(text)
    return out, left


# ---------------------------------------------------------------------------------------------- LoRA adapters -> PEFT
class Trace(NamedTuple):
    """Where each element of our state dict lives in a Hugging Face layout: `tensors` {HF name: shape} in id order
    (ids of tensor k: starts[k] .. starts[k] + numel - 1), `ids` {our name: int64 tensor of HF element ids, 0 = none}."""
    tensors: dict
    ids: dict


def import_trace(arch: dict) -> Trace:
    """The trace of a recorded architecture (an imported model): the converter run on the folder's element numbers."""
    folder = _folder_of(arch)
    _, _, traced = convert(arch["config"], file_state(folder, "ids"), torch.float32)
    return Trace({k: s for k, (_, _, s) in folder.tensors.items()}, traced)


def export_trace(to_hf, c, full: dict) -> Trace:
    """The trace of a model file's exporter (to_hf(config, our state) -> (config.json, HF state)), which moves
    elements only: run it on our elements' numbers and invert."""
    ours, n = {}, 1
    for k, v in full.items():
        ours[k], n = torch.arange(n, n + v.numel()).view(v.shape), n + v.numel()
    _, theirs = to_hf(c, ours)
    where = torch.zeros(n, dtype=torch.int64)  # our element id -> its HF element id
    m = 1
    for v in theirs.values():
        where[v.flatten()] = torch.arange(m, m + v.numel())
        m += v.numel()
    return Trace({k: tuple(v.shape) for k, v in theirs.items()}, {k: where[v] for k, v in ours.items()})


def peft_state(trace: Trace, adapters: dict, rename=lambda k: k) -> tuple[dict, dict]:
    """LoRA adapters {our weight name: (A [r, i], B [o, r])} on fused linears -> PEFT's ({key: tensor}, config
    fields) on the Hugging Face modules those weights came from (trace). Exact, not approximated: W + c·B·A moves
    row by row, so a Hugging Face module fed by rows of ours gets the same A and those rows of B (q/k/v_proj from
    linear_qkv, gate/up_proj from linear_fc1); GPT-2's Conv1D, stored [in, out], gets them as columns
    (fan_in_fan_out). A weight whose rows do not each land whole on one row (or column) of one tensor, in order,
    is refused by name. `rename`: a stored name -> the live model's (the layout's renames)."""
    names, shapes = list(trace.tensors), list(trace.tensors.values())
    starts = torch.tensor([0] + [math.prod(s) for s in shapes]).cumsum(0)[:-1] + 1
    out, fan_in_fan_out, targets = {}, set(), set()
    for ours, (A, B) in adapters.items():
        ids = trace.ids[ours].contiguous()
        which = torch.searchsorted(starts, ids, right=True) - 1  # [o, i] the HF tensor of each element
        local = ids - starts[which]
        if (ids == 0).any() or (which != which[:, :1]).any():
            raise ExportError(f"export: the adapter on {ours}: a row of it spreads over several Hugging Face tensors")
        cols = torch.tensor([shapes[t][-1] for t in which[:, 0].tolist()])[:, None]
        p, q = local // cols, local % cols  # [o, i] row and column in the HF tensor
        i = torch.arange(ids.shape[1])
        if (p == p[:, :1]).all() and (q == i).all():
            rows, transposed = p[:, 0], False  # nn.Linear [out, in]: our row j is its row p_j
        elif (q == q[:, :1]).all() and (p == i).all():
            rows, transposed = q[:, 0], True  # Conv1D [in, out]: our row j is its column q_j
        else:
            raise ExportError(f"export: the adapter on {ours}: its rows are not rows of one Hugging Face tensor")
        for t in which[:, 0].unique().tolist():
            module = rename(names[t]).removesuffix(".weight")
            mine = which[:, 0] == t
            b = torch.zeros(shapes[t][1 if transposed else 0], B.shape[1], dtype=B.dtype)
            b[rows[mine]] = B.detach()[mine]
            out[f"base_model.model.{module}.lora_A.weight"] = A.detach().clone()
            out[f"base_model.model.{module}.lora_B.weight"] = b
            targets.add(module.rsplit(".", 1)[-1])
            fan_in_fan_out.add(transposed)
    if len(fan_in_fan_out) > 1:
        raise ExportError("export: the adapters sit on both nn.Linear and Conv1D modules: PEFT has one fan_in_fan_out")
    return out, {"target_modules": sorted(targets), "fan_in_fan_out": fan_in_fan_out == {True}}


def save_peft(out_dir, state: dict, fields: dict, rank: int, alpha: float, dropout: float, base: str = ""):
    """A PEFT adapter folder: adapter_config.json and adapter_model.safetensors, which
    peft.PeftModel.from_pretrained(base_model, out_dir) loads (scale lora_alpha / r, as ours)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
              "bias": "none", "use_rslora": False, "inference_mode": True, "base_model_name_or_path": base,
              "modules_to_save": None, **fields}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return out
