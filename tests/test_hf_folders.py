"""Hugging Face folders in and out (interop/hf.py), for every family of the gpt, bert, t5, mamba and llava model files: a
folder as `save_pretrained` writes it (sharded safetensors included) converts to what the live `transformers` model
converts to (whose logits the converters' own tests compare), export is the identity on every stored tensor, a run
starts from an imported folder at TP 2 + SP, PP 2 and DP 2 with the Hugging Face model's loss on its first batch,
trains, and exports a folder `transformers` loads with our model's logits; LoRA adapters go out as PEFT folders."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
import transformers
from test_bert import hf_bert
from test_hf import FAMILIES as LLAMA_FAMILIES
from test_hf import hf_family, hf_gpt2, hf_llama
from test_llava import hf_llava
from test_mamba import hf_mamba2
from test_mla_mtp import hf_deepseek
from test_t5 import hf_t5

import checkpoint
import data
import harness
import tools
from interop import hf

FAMILIES = {"gpt2": hf_gpt2, "llama": lambda: hf_llama(groups=2), "bert": hf_bert, "t5": hf_t5,
            "mamba2": lambda: hf_mamba2(2, 4), "llava": hf_llava, "deepseek_v3": hf_deepseek,
            **{name.replace("-", "_"): lambda name=name: hf_family(name) for name in LLAMA_FAMILIES if "-" not in name
               or name.endswith("-moe")}}


def saved(model, path, shard=False):
    """The folder `save_pretrained` writes (in float64: the comparisons below are exact up to summation order)."""
    model.double().save_pretrained(path, **({"max_shard_size": "50KB"} if shard else {}))
    return hf.read_folder(path)


def hf_logits(model, ids):
    with torch.no_grad():
        if model.config.model_type == "t5":
            return model(input_ids=ids, decoder_input_ids=ids).logits
        if model.config.model_type == "bert":
            return model(input_ids=ids).prediction_logits
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_folder_is_the_model_and_export_is_the_identity(family, tmp_path):
    """The stored layout (which differs from the live one for LLaVA, Mixtral and the MoE families) converts to
    the same Config and state as the live model does (the converters' own logit tests: tests/test_hf.py,
    test_bert.py, ...), and tracing sends every element back to where it came from: exact, no tolerance."""
    live = FAMILIES[family]().double().eval()
    folder = saved(live, tmp_path / "f", shard=family in ("llama", "mixtral"))
    assert family != "llama" or (tmp_path / "f" / hf.INDEX).is_file()  # the sharded case really is sharded
    mf, c, full = hf.convert(folder.config, hf.file_state(folder), torch.float64)
    c_live, full_live = mf.HF_CONVERTERS[live.config.model_type](live, mf.Config, torch.float64)
    assert c == c_live
    assert full.keys() == full_live.keys()
    for k in full:
        torch.testing.assert_close(full[k], full_live[k], rtol=0, atol=0, msg=k)
    rebuilt = hf.architecture(hf.arch_of(folder), mf)  # the Config a run rebuilds from the recorded setting
    assert dataclasses.replace(rebuilt, params_dtype=torch.float64) == c
    stored, left = hf.export_state(hf.arch_of(folder), full)
    want = {k: v for k, v in hf.file_state(folder).items()}
    assert set(stored) | set(left) == set(want)
    for k in stored:
        torch.testing.assert_close(stored[k], want[k], rtol=0, atol=0, msg=k)
    for k in left:  # what the model never reads: a tied copy, CLIP's unused head and layers
        assert re.search(r"lm_head|post_layernorm|vision_tower.*layers\.\d+|cls\.|pooler", k), k


def test_export_names_a_tensor_it_cannot_trace(tmp_path):
    """Negative controls: a state of another shape, and a converter that computes a value (here a scale), are
    refused by name; a wrong element order would fail the identity above."""
    folder = saved(hf_llama(groups=2), tmp_path / "f")
    arch = hf.arch_of(folder)
    mf, c, full = hf.convert(folder.config, hf.file_state(folder), torch.float64)
    bad = {**full, "decoder.final_layernorm.weight": full["decoder.final_layernorm.weight"][:-1]}
    with pytest.raises(hf.ExportError, match="decoder.final_layernorm.weight"):
        hf.export_state(arch, bad)
    stored, _ = hf.export_state(arch, {**full, "decoder.layers.0.mlp.linear_fc2.weight":
                                       full["decoder.layers.0.mlp.linear_fc2.weight"].flip(0)})
    with pytest.raises(AssertionError):
        torch.testing.assert_close(stored["model.layers.0.mlp.down_proj.weight"],
                                   hf.file_state(folder)["model.layers.0.mlp.down_proj.weight"], rtol=0, atol=0)
    scaled = dict(mf.HF_CONVERTERS)
    try:
        conv = mf.HF_CONVERTERS["llama"]

        def halving(h, C, d):  # a converter that scales a tensor: a computed value, not a moved one
            c, f = conv(h, C, d)
            return c, {**f, "decoder.final_layernorm.weight": f["decoder.final_layernorm.weight"] * 0.5}
        mf.HF_CONVERTERS["llama"] = halving
        with pytest.raises(hf.ExportError, match="computed"):
            hf.export_state(arch, full)
    finally:
        mf.HF_CONVERTERS.clear()
        mf.HF_CONVERTERS.update(scaled)


def test_a_folder_that_is_not_one_fails_in_one_line(tmp_path):
    with pytest.raises(hf.ConfigError, match="not a local folder"):
        hf.read_folder(tmp_path / "nowhere")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(hf.ConfigError, match="no model.safetensors"):
        hf.read_folder(tmp_path / "f")
    (tmp_path / "f" / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(hf.ConfigError, match="model.safetensors: not a readable safetensors"):
        hf.read_folder(tmp_path / "f")
    with pytest.raises(hf.ConfigError, match="model_type 'gptj' is not supported"):
        hf.converter_for("gptj")
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2, dtype=torch.float8_e4m3fn), "w_scale_inv": torch.ones(1)},
              tmp_path / "f" / "model.safetensors")  # a float8 release (DeepSeek-V3's): its scales are not read
    with pytest.raises(hf.ConfigError, match="a quantized checkpoint \\(w is F8_E4M3\\).*dequantize"):
        hf.read_folder(tmp_path / "f")
    (tmp_path / "f" / "config.json").write_text('{"model_type": "llama", "quantization_config": {"quant_method": "fp8"}}')
    with pytest.raises(hf.ConfigError, match="a quantized checkpoint \\(\\{'quant_method': 'fp8'\\}\\)"):
        hf.read_folder(tmp_path / "f")


# ---------------------------------------------------------------------------------------------- a run on an imported folder
def tiny_tokenizer_folder(path, model):
    """A byte-level BPE trained on the default corpus's kind of text, saved with transformers as the folder's
    tokenizer (eos </s>, no pad token: the import makes eos play pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"] * 20,
                            trainers.BpeTrainer(vocab_size=model.config.vocab_size, special_tokens=["<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def run_argv(base, save, *extra):
    """A 2-step run from the imported folder `base`, on harness.SNIPPET's 40 small files (made beside `save`, with
    their token cache): the stdlib would cost each family's tokenizer a pass over ~12 MB, and prove nothing more."""
    corpus = Path(save).parent / "corpus"
    if not corpus.is_dir():
        corpus.mkdir(parents=True)
        for i in range(40):
            (corpus / f"m{i:02d}.py").write_text(harness.SNIPPET.format(i=i))
    return ["--data-path", str(corpus), "--data-cache-dir", str(corpus.parent / "data_cache"),
            "--pretrained-checkpoint", str(base), "--save", str(save), "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1",
            "--eval-interval", "2", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0", *extra]


def first_losses(run_dir):
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EVERY_LAYOUT = {"tp2-sp": TP2_SP, "pp2": ["--pipeline-model-parallel-size", "2"], "dp2": []}
# every other decoder family at one or two parallel layouts (each layout several times): the suite's budget; all three
# under HYPOTHESIS_PROFILE=deep (`HYPOTHESIS_PROFILE=deep .venv/bin/python -m pytest -q tests/test_hf_folders.py`)
DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"
ONE_LAYOUT = {"mistral": "dp2", "qwen2": ("tp2-sp", "pp2"), "qwen3": "pp2", "mixtral": ("tp2-sp", "pp2"),
              "qwen2_moe": "dp2", "qwen3_moe": "pp2", "deepseek_v3": ("tp2-sp", "pp2"), "mamba2": "tp2-sp"}


def make_live(family):
    if family == "llama":
        return hf_llama(groups=2).float().eval()
    if family == "gpt2":
        return hf_gpt2().float().eval()
    return FAMILIES[family]().float().eval()


@pytest.mark.parametrize("family", ["llama", "gpt2", *ONE_LAYOUT])
def test_a_run_starts_from_a_folder_at_every_layout_and_exports_back(family, tmp_path):
    """Import, then train 2 steps at TP 2 + SP, PP 2 and DP 2: the first step's loss is the Hugging Face model's mean
    next-token loss on the run's first global batch (float32 training: rtol 1e-5, a few float32 roundings of a
    summation over 128 tokens), the same at every layout; the export of the trained run loads in transformers with our
    model's logits (float32: atol 1e-5)."""
    torch.manual_seed(0)
    live = make_live(family)
    src = tmp_path / "src"
    live.save_pretrained(src)
    tiny_tokenizer_folder(src, live)
    tools.import_hf(src, tmp_path / "base")
    import train
    args = train.check_args(train.parse(run_argv(tmp_path / "base", tmp_path / "probe")), 1)
    start = checkpoint.plan_start(args)
    corpus = data.build_data(args, train.model_file(args.model).dataset, start.tokenizer_file, start.vocab_size)
    batch = torch.as_tensor(data.global_batch(corpus.train, start=0, size=4)).long()
    with torch.no_grad():
        logits = live(batch[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    chosen = ONE_LAYOUT.get(family, ())
    layouts = EVERY_LAYOUT if family in ("llama", "gpt2") or DEEP else {
        name: EVERY_LAYOUT[name] for name in ((chosen,) if isinstance(chosen, str) else chosen)}
    for name, layout in layouts.items():
        harness.launch(2, run_argv(tmp_path / "base", tmp_path / name, *layout))
        got = first_losses(tmp_path / name)[0]
        assert math.isclose(got, want, rel_tol=1e-5), f"{name}: first loss {got} vs Hugging Face's {want}"
    from tools import main as tools_main
    trained = tmp_path / next(iter(layouts))
    tools_main(["export", "--load", str(trained), "--hf-out", str(tmp_path / "out")])
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ours = checkpoint.load_model(trained).model.eval()
    with torch.no_grad():
        a, b = back(batch[:, :-1]).logits, ours(batch[:, :-1])[..., :live.config.vocab_size]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert (a - logits).abs().max() > 1e-4  # it trained: the export is not the starting folder
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.eos_token == "</s>" and tok("def f").input_ids == corpus.tokenizer.encode("def f").ids


def test_a_flag_against_the_folders_architecture_is_refused(tmp_path):
    live = hf_llama(groups=2).float()
    live.save_pretrained(tmp_path / "src")
    tiny_tokenizer_folder(tmp_path / "src", live)
    tools.import_hf(tmp_path / "src", tmp_path / "base")
    import train
    with pytest.raises(hf.ConfigError, match="--num-layers 3: the model's architecture comes from"):
        train.setup(train.parse(run_argv(tmp_path / "base", tmp_path / "x", "--num-layers", "3")))
    with pytest.raises(hf.ConfigError, match="is a Hugging Face folder: import it once"):  # the folder itself
        train.setup(train.parse(run_argv(tmp_path / "src", tmp_path / "y")))


# ---------------------------------------------------------------------------------------------- LoRA adapters as PEFT folders
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_adapters_export_as_a_peft_folder(family, tmp_path):
    """A LoRA run at TP 2 on an imported folder: its adapters as a PEFT folder on the base's export give, in peft,
    our merged model's logits (float32: atol 1e-5); GPT-2's Conv1D takes them as columns (fan_in_fan_out). Negative
    control: B's rows for k_proj / c_attn taken in our fused order fail that comparison."""
    import peft
    live = (hf_llama(groups=2) if family == "llama" else hf_gpt2()).float().eval()
    live.save_pretrained(tmp_path / "src")
    tiny_tokenizer_folder(tmp_path / "src", live)
    tools.import_hf(tmp_path / "src", tmp_path / "base")
    harness.launch(2, run_argv(tmp_path / "base", tmp_path / "lora", "--lora-rank", "4", "--lora-alpha", "8",
                               "--lr", "5e-2", "--tensor-model-parallel-size", "2", "--sequence-parallel"))
    tools.main(["export", "--load", str(tmp_path / "base"), "--hf-out", str(tmp_path / "base-hf")])
    tools.main(["export", "--load", str(tmp_path / "lora"), "--peft-out", str(tmp_path / "adapter")])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] == (family == "gpt2")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf").float().eval()
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = checkpoint.load_model(tmp_path / "lora").model.eval()
    ids = torch.randint(0, live.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = merged(ids)[..., :live.config.vocab_size]
        torch.testing.assert_close(adapted(input_ids=ids).logits, want, rtol=0, atol=1e-5)
        with adapted.disable_adapter():  # (peft wraps `base` in place)
            assert (adapted(input_ids=ids).logits - want).abs().max() > 1e-3  # the adapters trained: they matter
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    key = next(k for k in state if ("k_proj" in k or "c_attn" in k) and k.endswith("lora_B.weight"))
    state[key] = state[key].flip(0)
    save_file(state, tmp_path / "adapter" / "adapter_model.safetensors")
    wrong = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf")
                                           .float().eval(), tmp_path / "adapter").eval()
    with torch.no_grad(), pytest.raises(AssertionError):
        torch.testing.assert_close(wrong(input_ids=ids).logits, want, rtol=0, atol=1e-5)


def test_the_export_trace_and_the_import_trace_agree(tmp_path):
    """A model trained here exports through its model file's exporter (convert.gpt_to_hf); its trace (export_trace)
    puts every element where the import's trace of the exported folder finds it — one correspondence, two ways."""
    import gpt
    folder = saved(hf_llama(groups=2), tmp_path / "f")
    mf, c, full = hf.convert(folder.config, hf.file_state(folder), torch.float64)
    a, b = hf.import_trace(hf.arch_of(folder)), hf.export_trace(gpt.to_hf, c, full)
    assert list(a.tensors) != [] and set(a.tensors) == set(b.tensors)
    # the same HF element: map each trace's flat ids to (name, position)
    def where(t):
        names, sizes = list(t.tensors), [math.prod(s) for s in t.tensors.values()]
        starts = torch.tensor([0] + sizes).cumsum(0)
        return {k: [(names[int(torch.searchsorted(starts, i - 1, right=True)) - 1],
                     int(i - 1 - starts[int(torch.searchsorted(starts, i - 1, right=True)) - 1])) if i else None
                    for i in v.flatten()[:: max(1, v.numel() // 7)].tolist()] for k, v in t.ids.items()}
    assert where(a) == where(b)


# ---------------------------------------------------------------------------------------------- encoders: BERT, T5
def wordpiece_folder(path, model, sentinels: int = 0):
    """A lower-case WordPiece tokenizer (BERT's: [CLS] $A [SEP]) saved with transformers as the folder's; with
    `sentinels`, T5's <extra_id_i> tokens and eos </s>, pad <pad> instead (span corruption reads them)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    t5 = sentinels > 0
    specials = ["<pad>", "</s>", "<unk>"] + [f"<extra_id_{i}>" for i in range(sentinels)] if t5 else [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token=specials[2] if t5 else "[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"] * 20,
                            trainers.WordPieceTrainer(vocab_size=model.config.vocab_size, special_tokens=specials,
                                                      show_progress=False))
    names = dict(eos_token="</s>", pad_token="<pad>", unk_token="<unk>") if t5 else dict(
        unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(path)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_an_encoder_folder_trains_at_tp2_and_exports_back(family, tmp_path):
    """A BERT (pretraining heads, its folder's [CLS]/[SEP]/[MASK] as the roles, [SEP] as the end of a document) and
    a T5 (its <extra_id_i> sentinels) folder: import, 2 steps at TP 2 + SP, export; transformers loads the export with
    our trained model's logits (float32: atol 1e-5), which moved from the folder's."""
    live = FAMILIES[family]().float().eval()
    live.save_pretrained(tmp_path / "src")
    wordpiece_folder(tmp_path / "src", live, sentinels=100 if family == "t5" else 0)
    tools.import_hf(tmp_path / "src", tmp_path / "base")
    layouts = {"run": TP2_SP}  # under HYPOTHESIS_PROFILE=deep also DP 2, and PP 2 for BERT (T5 has no PP here)
    layouts |= {"dp2": [], **({"pp2": EVERY_LAYOUT["pp2"]} if family == "bert" else {})} if DEEP else {}
    for name, layout in layouts.items():
        argv = run_argv(tmp_path / "base", tmp_path / name, *layout, "--lr", "1e-2")
        if family == "t5":  # (T5's spelling of the sequence length, and its decoder's)
            argv[argv.index("--seq-length")] = "--encoder-seq-length"
            argv += ["--decoder-seq-length", "16"]
        harness.launch(2, argv)
    losses = [first_losses(tmp_path / name)[0] for name in layouts]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), dict(zip(layouts, losses))  # every layout's first step
    tools.main(["export", "--load", str(tmp_path / "run"), "--hf-out", str(tmp_path / "out")])
    back = type(live).from_pretrained(tmp_path / "out").float().eval()
    ours = checkpoint.load_model(tmp_path / "run").model.eval()
    ids = torch.randint(5, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        if family == "bert":
            got, want, start = ours(ids, torch.ones_like(ids))[0], back(input_ids=ids).prediction_logits, \
                live(input_ids=ids).prediction_logits
        else:
            got, want, start = ours(ids, ids), back(input_ids=ids, decoder_input_ids=ids).logits, \
                live(input_ids=ids, decoder_input_ids=ids).logits
    torch.testing.assert_close(want, got[..., :want.shape[-1]], rtol=0, atol=1e-5)
    assert (want - start).abs().max() > 1e-4  # it trained
