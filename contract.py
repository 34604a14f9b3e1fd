"""contract.py — the model-file contract: what a model file declares, and `model_file(name)`, the one function that
reads it (every hook with its default).

`--model NAME` imports NAME.py — a model file of this repository, or your own anywhere on the Python path — and the
infrastructure (arguments.py, checkpoint.py, train.py, tools.py, posttraining/recipes.py) asks it everything through the
ModelFile this returns: its flags, its samples, its loss recipe, its FLOPs, whether it samples or exports, what it
does not support and why. None of them names a model (tests/test_repo.py checks it), so a new model touches its own
file and its tests, nothing else. A file of its own because every piece of the infrastructure asks these questions
and none of them owns the answers.
Mirrors Megatron-LM's model providers: what pretrain_gpt.py hands megatron/training/training.py's pretrain()
(model_provider, forward_step_func, extra_args_provider, train_valid_test_datasets_provider).

A model file must define
  Config   a dataclass of Megatron's TransformerConfig fields: extend config.Config (gpt.Config is it), whose
           UNSUPPORTED (feature -> why not) and FULL_RECOMPUTE class attributes declare what the model cannot do
  Model    Model(config, grid=None, pre_process=True, post_process=True, layer_offset=0, num_layers=None): extend
           gpt.Model (DESIGN.md §1, "One model skeleton")
and may define any hook named in ModelFile; a hook it leaves out takes the default shown there.

Run:    .venv/bin/python -c "import contract; print(contract.model_file('bert'))"
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable
from pathlib import Path

import data
import metrics
from config import ConfigError

ROOT = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------- the defaults
def no_arguments(parser) -> None:
    """A model file without flags of its own."""


def token_windows(source, doc_ids, args, tok, seed):
    """Samples: windows of --seq-length + 1 tokens of the shuffled document stream (data.GPTDataset)."""
    return data.GPTDataset(source, doc_ids, args.seq_length, seed)


def next_token_loss(model, mb, pack=None):
    """The next-token recipe's loss: micro-batch [b, s+1] -> the SUM of its b·s next-token losses (a scalar). With
    `pack` (data.Packing: --reset-position-ids, --reset-attention-mask, --eod-mask-loss) documents packed in a row."""
    if pack is None:
        return model(mb[:, :-1], mb[:, 1:]).float().sum()
    mask, loss_mask, position_ids = pack(mb[:, :-1])
    out = model(mb[:, :-1], mb[:, 1:], position_ids=position_ids, mask=mask)  # [b, s] (an inner stage: [s, b, h])
    return (out * loss_mask).sum() if model.post_process else out  # the float32 mask: a sum in >= float32


def next_token_recipe(batch, args, corpus):
    """(loss_func(model, mb) -> the SUM of the micro-batch's losses, the global count that divides it, DESIGN.md §2)
    for one global batch [gbs, s+1] of a causal language model: every next token, or with packed documents those
    data.Packing counts. `corpus` (data.Corpus) gives the end-of-document id."""
    pack = data.Packing.from_args(args, corpus.eod)
    if pack is None:
        return next_token_loss, batch[:, 1:].numel()
    return functools.partial(next_token_loss, pack=pack), pack.num_loss_tokens(batch)


# ---------------------------------------------------------------------------------------------- the contract
@dataclasses.dataclass(frozen=True)
class ModelFile:
    """A model file, as the infrastructure sees it: its Config and Model, and each hook (its own or the default)."""
    name: str  # the --model name: the module's
    Config: type
    Model: type
    # flags: add_arguments(parser) adds the model's own flags (Megatron's extra_args_provider); ARCH_FLAGS names those
    # of them that shape the weights (a checkpoint must match them, checkpoint.check_same_model); TRAIN_DEFAULTS are
    # its defaults for train.py's flags (its default run); OPTIMIZER_DEFAULTS {optimizer: defaults} those that replace
    # them where another --optimizer than the one TRAIN_DEFAULTS names runs (its learning rates: else train.py's)
    add_arguments: Callable = no_arguments
    ARCH_FLAGS: tuple = ()
    TRAIN_DEFAULTS: dict = dataclasses.field(default_factory=dict)
    OPTIMIZER_DEFAULTS: dict = dataclasses.field(default_factory=dict)
    # config_fields(args, tok) -> Config fields the model file derives from its flags and the tokenizer (tok None:
    # not known yet), beside those arguments.model_config copies by name
    config_fields: Callable = lambda args, tok: {}
    # derived_flags(args) -> {flag: value} the model file derives from its other flags (Megatron's validate_args for
    # its own flags): arguments.check_args writes them into the checked flags, so a checkpoint records what ran
    derived_flags: Callable = lambda args: {}
    # MEGATRON_SPECS: Megatron's --spec values (module, function) whose layers the model file builds: --spec with one
    # of them is accepted with a note, any other --spec is refused (arguments.FALLBACKS / REFUSED)
    MEGATRON_SPECS: tuple = ()
    # data: dataset(source, doc_ids, args, tok, seed) -> its samples (ds[i]: a numpy row; data.global_batch stacks)
    dataset: Callable = token_windows
    # the loss: batch_recipe(batch, args, corpus) -> (loss_func(model, mb) -> SUM of its losses, the global count)
    batch_recipe: Callable = next_token_recipe
    # evaluation: eval_counts(model, mb) -> {name: (hits, total)}, extra validation metrics (None: the loss only)
    eval_counts: Callable | None = None
    # metrics: flops(config, batch, seq) -> the model FLOPs of one iteration (Megatron's transformer count)
    flops: Callable = metrics.flops
    # tools.py: sample(model, tok, prompt, max_new_tokens, temperature, top_k) -> text; a causal LM's
    # sample_ids(model, tok, ids, max_new_tokens, temperature, top_k, stop=None) -> the token ids it samples after
    # the prompt's token ids, through the end-of-document token or one of the `stop` ids (tools.py sample --chat: an
    # SFT model's answer to a chat prompt, data.chat_stop_ids);
    # to_hf(config, state) -> (Hugging Face config.json dict, {name: tensor}). None: it does not
    # (UNSUPPORTED["sample"/"export"] says why)
    sample: Callable | None = None
    sample_ids: Callable | None = None
    to_hf: Callable | None = None
    # HF_CONVERTERS: {Hugging Face model_type: converter(hf, Config, dtype) -> (Config, full state dict)} — the
    # folders tools.py import-hf reads as this model (interop/hf.py)
    HF_CONVERTERS: dict = dataclasses.field(default_factory=dict)
    # HF_LAYOUTS: {model_type: {"renames": [(regex, replacement)], "experts": (gate, up, down), "copies": [(regex,
    # [source names])]}} — how the folder stores what a live `transformers` model holds otherwise (hf.memory_state),
    # and the tensors it stores twice (hf.copies_of); absent: the same names
    HF_LAYOUTS: dict = dataclasses.field(default_factory=dict)

    def unsupported(self, feature: str) -> str | None:
        """Why the model does not support `feature` (a key of config.Config.UNSUPPORTED), or None if it does."""
        return self.Config.UNSUPPORTED.get(feature)

    def refuse(self, feature: str, what: str):
        """ConfigError `--model NAME with WHAT: why` when the model does not support `feature`."""
        if (why := self.unsupported(feature)) is not None:
            raise ConfigError(f"--model {self.name} with {what}: {why}")


HOOKS = [f.name for f in dataclasses.fields(ModelFile) if f.name not in ("name", "Config", "Model")]


def model_files() -> list[str]:
    """This repository's model files: the top-level files that define `class Model` (read as text, nothing imported)."""
    return sorted(p.stem for p in ROOT.glob("*.py") if re.search(r"^class Model\b", p.read_text(), re.M))


def default_model() -> str:
    """--model's default: the model file that declares `DEFAULT_MODEL = True` (train.py's default run trains it)."""
    found = [p.stem for p in ROOT.glob("*.py") if re.search(r"^DEFAULT_MODEL = True\b", p.read_text(), re.M)]
    if len(found) != 1:
        raise ConfigError(f"exactly one model file must declare DEFAULT_MODEL = True, found {found}")
    return found[0]


@functools.cache
def model_file(name: str) -> ModelFile:
    """--model NAME: import NAME and read its contract; ConfigError naming the problem if it is not a model file."""
    if not re.fullmatch(r"[A-Za-z_]\w*", name or ""):
        raise ConfigError(f"--model {name!r}: a model is named by its file's module name (one of {model_files()})")
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise ConfigError(f"--model {name}: no model file {name}.py (this repository has {', '.join(model_files())})"
                          ) from None
    kinds = {k: getattr(module, k, None) for k in ("Config", "Model")}
    if not all(isinstance(v, type) for v in kinds.values()):
        missing = [k for k, v in kinds.items() if not isinstance(v, type)]
        raise ConfigError(f"--model {name}: {module.__file__} is not a model file (it defines no class "
                          f"{' or '.join(missing)}; see contract.py)")
    return ModelFile(name=name, **kinds, **{k: getattr(module, k) for k in HOOKS if hasattr(module, k)})
