"""The model-file contract (config.py): a model file declares what it is, and one function reads it.

  - every model file of the repository resolves, with its own hooks where it has them and the defaults elsewhere;
  - a toy seventh model (tests/toy_model.py: GPT with ScaleNorm) trains, resumes, refuses a changed architecture flag,
    samples and refuses export by its own declaration, and at TP 2 + SP logs the single process's losses — with no
    edit anywhere but its file and this test (nothing outside tests/ names it);
  - --model of something that is not a model file is one clear line.
Tolerance: float32 TP 2 + SP vs one process, 1e-5 relative (reduction order only), as tests/test_train.py.
"""
from __future__ import annotations

import pytest

import arguments
import config as contract
import gpt
import metrics as M
import tools
import train
from harness import ROOT, assert_close, metrics, tiny, torchrun


def test_every_model_file_resolves_with_its_hooks_and_the_defaults():
    import bert
    import mamba
    import t5
    files = {m: contract.model_file(m) for m in contract.model_files()}
    assert set(files) == {"gpt", "bert", "t5", "retro", "mamba", "llava"}
    assert files["gpt"].flops is M.flops and files["bert"].flops is bert.flops and files["t5"].flops is t5.flops
    assert files["mamba"].sample is mamba.sample and files["gpt"].to_hf is gpt.to_hf and files["bert"].to_hf is None
    assert files["gpt"].sample_ids is gpt.sample_ids and files["mamba"].sample_ids is mamba.sample_ids  # causal LMs
    assert files["t5"].sample_ids is files["llava"].sample_ids is files["bert"].sample_ids is None  # (--chat: refused)
    assert files["gpt"].batch_recipe is contract.next_token_recipe and files["bert"].batch_recipe is bert.batch_recipe
    assert files["gpt"].unsupported("context_parallel") is None and "recurrence" in files["mamba"].unsupported(
        "context_parallel")
    assert contract.default_model() == "gpt" and arguments.parse_args([]).model == "gpt"
    for name, mf in files.items():  # tools.py sample: every model file samples, or says why it cannot
        assert mf.sample is not None or mf.unsupported("sample"), name


@pytest.mark.parametrize("name, expect", [
    ("nosuchmodel", "--model nosuchmodel: no model file nosuchmodel.py (this repository has bert, gpt, llava"),
    ("data", "--model data: "),
    ("../gpt", "--model '../gpt': a model is named by its file's module name"),
])
def test_what_is_not_a_model_file_is_refused_in_one_line(name, expect):
    with pytest.raises(arguments.ConfigError) as e:
        contract.model_file(name)
    assert str(e.value).startswith(expect) and "\n" not in str(e.value)
    if name == "data":
        assert "is not a model file (it defines no class Config or Model; see config.py)" in str(e.value)


def toy(corpus, cache, run, *extra, iters=4):
    return tiny(corpus, cache, run, "--model", "toy_model", *extra, iters=iters)


def test_a_seventh_model_needs_nothing_but_its_own_file(corpus, cache, tmp_path, capsys):
    mf = contract.model_file("toy_model")
    assert mf.sample is gpt.sample and mf.flops is M.flops and mf.ARCH_FLAGS == ("scalenorm_learned_gain",)
    outside = [p.name for p in [*ROOT.glob("*.py"), ROOT / "Makefile", *ROOT.glob("*/*.py")]
               if p.parent.name != "tests" and "toy_model" in p.read_text()]
    assert outside == []  # no code outside its own file and this test (the docs may point at it as the example)
    # its flag is in --help with --model toy_model
    with pytest.raises(SystemExit):
        arguments.parse_args(["--model", "toy_model", "--help"])
    assert "--scalenorm-learned-gain" in capsys.readouterr().out
    # it trains (ScaleNorm's gains are in the model), resumes, and refuses a changed architecture flag
    one = tmp_path / "one"
    run = train.train(arguments.parse_args(toy(corpus, cache, one, "--save-interval", "2")))
    gains = [n for n, p in run.model.named_parameters() if n.endswith("layernorm.g")]
    assert len(gains) == 2 * 2 + 1  # two per layer, the final norm
    (ref, _) = metrics(one)
    assert ref[4]["loss"] < ref[1]["loss"]
    with pytest.raises(SystemExit, match="^2$"):
        train.main(toy(corpus, cache, one, "--load", str(one), "--no-scalenorm-learned-gain", iters=6))
    assert "scalenorm_learned_gain=True in the checkpoint, False now" in capsys.readouterr().err
    # TP 2 + SP on warm torchrun ranks: the single process's losses
    tp2 = tmp_path / "tp2"
    torchrun(2, toy(corpus, cache, tp2, "--tensor-model-parallel-size", "2", "--sequence-parallel"))
    got, _ = metrics(tp2)
    for i in ref:
        assert_close(got[i]["loss"], ref[i]["loss"], 1e-5, f"toy_model TP 2 + SP loss at iteration {i}")
    # tools.py: it samples through gpt's hook; it refuses export with its own reason
    assert tools.main(["sample", "--load", str(one), "--prompt", "def ", "--max-new-tokens", "4"]).startswith("def ")
    capsys.readouterr()
    with pytest.raises(SystemExit, match="^2$"):
        tools.main(["export", "--load", str(one), "--hf-out", str(tmp_path / "hf")])
    assert capsys.readouterr().err.strip() == ("tools.py: error: export: --model toy_model has no Hugging Face export "
                                               "here (Hugging Face has no model class with ScaleNorm)")
