"""Where a flag's value comes from: arguments.resolve's layers, in DESIGN.md §1's order ("Where a flag's value comes
from"). For each adjacent pair of layers a flag set in both resolves to the higher one, and (the control) a flag set
only in the lower one keeps its value, so each layer is seen to act.
"""
from __future__ import annotations

import pytest

import arguments
import bert
import gpt


def resolved(argv, saved=None, yaml=None, tmp_path=None):
    """parse_args with `yaml` ({flag: value}) as --config FILE's YAML, before argv."""
    if yaml is not None:
        path = tmp_path / "run.yaml"
        path.write_text("".join(f"{k}: {v}\n" for k, v in yaml.items()))
        argv = ["--config", str(path), *argv]
    return arguments.parse_args(argv, saved)


def test_registered_defaults_below_the_model_files(monkeypatch):  # 1 < 2
    assert resolved([]).eval_interval == 100  # (control: the registered default)
    monkeypatch.setitem(gpt.TRAIN_DEFAULTS, "eval_interval", 7)
    assert resolved([]).eval_interval == 7


def test_model_files_defaults_below_its_optimizers():  # 2 < 3
    assert resolved(["--model", "bert"]).lr == bert.TRAIN_DEFAULTS["lr"]  # (control: its Muon run's)
    adam = bert.OPTIMIZER_DEFAULTS["adam"]["lr"]
    assert resolved(["--model", "bert", "--optimizer", "adam"]).lr == adam != bert.TRAIN_DEFAULTS["lr"]
    assert resolved(["--model", "bert", "--task", "sft"]).lr == adam  # (a task's optimizer is adam)
    assert resolved(["--optimizer", "adam"]).lr == 3e-3  # (gpt has none for adam: the registered one)
    assert resolved([]).optimizer == "muon" and resolved([], saved={"lora_rank": 4}).optimizer == "adam"  # (resumed
    # adapters: AdamW, as with --lora-rank)


def test_optimizers_defaults_below_the_tasks(monkeypatch):  # 3 < 4
    assert resolved(["--model", "bert", "--task", "grpo"]).lr == arguments.ONLINE_RL["lr"]
    monkeypatch.setattr(arguments, "TASK_DEFAULTS", {})  # (control: without the task's, the optimizer's)
    assert resolved(["--model", "bert", "--task", "grpo"]).lr == bert.OPTIMIZER_DEFAULTS["adam"]["lr"]


def test_tasks_defaults_below_the_checkpoints():  # 4 < 5
    assert resolved(["--task", "grpo"]).seq_length == arguments.ONLINE_RL["seq_length"]  # (control)
    assert resolved(["--task", "grpo"], saved={"seq_length": 99}).seq_length == 99


def test_checkpoints_flags_below_the_yaml(tmp_path):  # 5 < 6
    assert resolved([], saved={"num_layers": 3}, yaml={"hidden_size": 64}, tmp_path=tmp_path).num_layers == 3
    assert resolved([], saved={"num_layers": 3}, yaml={"num-layers": 5}, tmp_path=tmp_path).num_layers == 5
    assert resolved([], saved={"model": "bert"}).model == "bert"  # --model too
    assert resolved(["--model", "gpt"], saved={"model": "bert"}).model == "gpt"


def test_yaml_below_the_command_line(tmp_path):  # 6 < 7
    assert resolved(["--hidden-size", "64"], yaml={"num-layers": 5}, tmp_path=tmp_path).num_layers == 5  # (control)
    assert resolved(["--num-layers", "6"], yaml={"num-layers": 5}, tmp_path=tmp_path).num_layers == 6


def test_the_checkpoint_found_from_the_command_line(capsys):
    """train.parse's layer 5: a function of the first pass's flags finds it; --no-use-checkpoint-args drops it."""
    find = lambda first: {"num_layers": 3, "hidden_size": 64} if first.load == "RUN" else {}
    args = arguments.parse_args(["--load", "RUN", "--hidden-size", "128"], saved=find)
    assert (args.num_layers, args.hidden_size) == (3, 128)
    assert capsys.readouterr().out == "from the checkpoint: --num-layers 3\n"
    assert arguments.parse_args(["--load", "RUN", "--no-use-checkpoint-args"], saved=find).num_layers == 4
    assert arguments.parse_args(["--load", "ELSEWHERE"], saved=find).num_layers == 4


@pytest.mark.parametrize("argv, expect", [
    ([], (650, 30, 9e-4)),  # the default run's (gpt's TRAIN_DEFAULTS)
    (["--lr", "1e-3"], (650, 0, 0.0)),  # beside a command's own --lr: Megatron's warmup and minimum
    (["--train-samples", "100"], (None, 0, 9e-4)),  # sample-based: no iteration count
])
def test_schedule_defaults_read_what_the_command_gave(argv, expect):
    a = resolved(argv)
    assert (a.train_iters, a.lr_warmup_iters, a.min_lr) == expect


def test_a_saved_run_over_its_models_defaults():
    flags = arguments.run_flags({"model": "bert", "num_layers": 3})
    assert (flags["num_layers"], flags["normalization"]) == (3, bert.TRAIN_DEFAULTS["normalization"])
