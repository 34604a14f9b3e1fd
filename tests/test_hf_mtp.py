"""DeepSeek-V3's multi-token prediction (MTP) layers in and out of a Hugging Face folder (interop/hf.py, deepseek._hf_mtp):
DeepSeek's checkpoints store depth k + 1 after the decoder's L layers as model.layers.{L + k} — a whole decoder layer
plus enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding (embed_tokens) and output layer
(shared_head.head) — which transformers' DeepseekV3 neither builds nor saves. The folder here is transformers'
save_pretrained plus those tensors written in that layout; its MTP decoder layer is layer L of a DeepseekV3 one layer
deeper (save_pretrained's own layout for it, per-expert tensors included)."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_hf_folders import TP2_SP, first_losses, run_argv, tiny_tokenizer_folder
from test_mla_mtp import hf_deepseek

import checkpoint
import data
import harness
import tools
from interop import hf

L = 2  # decoder layers; layer 0 dense, layer 1 MoE (first_k_dense_replace 1), so the MTP layer is MoE as Megatron's


def mtp_folder(path, depths=1, dtype=torch.float64):
    """(live model, deeper model whose layers L.. are the MTP layers' decoder layers, folder) — the folder stores
    num_nextn_predict_layers = depths and each depth's tensors in DeepSeek's layout."""
    kw = dict(dense=1, dtype=dtype, experts_implementation="eager")  # (grouped-GEMM experts take no float64)
    live, deeper = hf_deepseek(layers=L, **kw), hf_deepseek(layers=L + depths, **kw)
    live.save_pretrained(path)
    deeper.save_pretrained(path / "deeper")
    state = load_file(path / "model.safetensors")
    g, h = torch.Generator().manual_seed(3), live.config.hidden_size
    for k in range(depths):
        p = f"model.layers.{L + k}."
        state.update({n: t for n, t in load_file(path / "deeper" / "model.safetensors").items() if n.startswith(p)})
        state.update({p + "enorm.weight": 1 + torch.rand(h, generator=g, dtype=dtype),
                      p + "hnorm.weight": 1 + torch.rand(h, generator=g, dtype=dtype),
                      p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g, dtype=dtype) * 0.1,
                      p + "shared_head.norm.weight": 1 + torch.rand(h, generator=g, dtype=dtype),
                      p + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                      p + "shared_head.head.weight": state["lm_head.weight"].clone()})
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": depths}))
    return live, deeper, hf.read_folder(path)


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_layers_import_and_export_is_the_identity(depths, tmp_path):
    """Import: our MTP layer k is the folder's model.layers.{L + k} — its norms and eh_proj as stored, its
    transformer_layer what the same tensors convert to as a decoder layer (the deeper model's layer L + k, whose
    logits tests/test_mla_mtp.py checks). Export: every stored tensor again, the two copies included. Exact."""
    _, deeper, folder = mtp_folder(tmp_path / "f", depths)
    stored = hf.file_state(folder)
    mf, c, full = hf.convert(folder.config, stored, torch.float64)
    assert c.mtp_num_layers == depths
    _, _, as_decoder = hf.convert(json.loads((tmp_path / "f" / "deeper" / "config.json").read_text()),
                                  hf.file_state(hf.read_folder(tmp_path / "f" / "deeper")), torch.float64)
    for k in range(depths):
        p, o = f"model.layers.{L + k}.", f"mtp.layers.{k}."
        for ours, theirs in [("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("final_layernorm", "shared_head.norm")]:
            assert torch.equal(full[f"{o}{ours}.weight"], stored[f"{p}{theirs}.weight"]), ours
        layer = {n.removeprefix(f"decoder.layers.{L + k}."): t for n, t in as_decoder.items()
                 if n.startswith(f"decoder.layers.{L + k}.")}
        mine = {n.removeprefix(o + "transformer_layer."): t for n, t in full.items() if n.startswith(o + "transformer_layer.")}
        assert layer.keys() == mine.keys() and any("experts" in n for n in mine)
        assert all(torch.equal(layer[n], mine[n]) for n in layer)
    out, left = hf.export_state(hf.arch_of(folder), full)
    assert left == [] and out.keys() == set(stored)
    for k in out:
        torch.testing.assert_close(out[k], stored[k], rtol=0, atol=0, msg=k)


def test_mtp_copies_that_differ_are_refused_by_name(tmp_path):
    """Negative controls: the MTP layer's own embed_tokens (or output head) differing from the model's is refused
    naming it (our MTP shares the model's, as Megatron's); a stored MTP layer whose MLP kind is not the last decoder
    layer's (what ours is built as) is refused; a folder without MTP tensors imports without MTP."""
    live, _, folder = mtp_folder(tmp_path / "f")
    state = load_file(tmp_path / "f" / "model.safetensors")
    for name in (f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"):
        bad = {**state, name: state[name] * 1.5}
        save_file(bad, tmp_path / "f" / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(hf.ConfigError, match=rf"{re.escape(name)} differs from"):
            hf.convert(folder.config, hf.file_state(folder), torch.float64)
    dense = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{L}.mlp.")}
    dense.update({f"model.layers.{L}.mlp.{p}.weight": state[f"model.layers.0.mlp.{p}.weight"].clone()
                  for p in ("gate_proj", "up_proj", "down_proj")})
    save_file(dense, tmp_path / "f" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf.ConfigError, match=rf"model.layers.{L}.mlp.*dense, the last decoder layer's"):
        hf.convert(folder.config, hf.file_state(hf.read_folder(tmp_path / "f")), torch.float64)
    live.save_pretrained(tmp_path / "plain")  # transformers' own save: no MTP tensors
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert hf.convert(config | {"num_nextn_predict_layers": 1}, hf.file_state(hf.read_folder(tmp_path / "plain")),
                      torch.float64)[1].mtp_num_layers is None


# TP 2 + SP: eh_proj column-parallel, the MTP layer's heads and experts split; PP 2: the last stage holds the MTP
# block and a copy of the embedding (the import loads it there too)
LAYOUTS = {"tp2-sp": TP2_SP, "pp2": ["--pipeline-model-parallel-size", "2"]}


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_a_run_trains_with_the_imported_mtp_loss(tmp_path):
    """Import the folder, train 2 steps at TP 2 + SP and at PP 2: the first step's logged MTP loss (depth 1) is the one the
    folder's tensors give through transformers' own modules — DeepSeek-V3's MTP (its report §2.2, Megatron's
    MultiTokenPredictionLayer): h' = shared_head.norm(layer_L(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))),
    predicting t_{i+2} through lm_head, h_i the model's final (normed) hidden state — in float64 on the float32
    weights (rtol 1e-5: our float32 forward). The main loss is the model's too."""
    torch.manual_seed(0)
    live, deeper, folder = mtp_folder(tmp_path / "src", dtype=torch.float32)
    tiny_tokenizer_folder(tmp_path / "src", live)
    tools.import_hf(tmp_path / "src", tmp_path / "base")
    import train
    args = train.check_args(train.parse(run_argv(tmp_path / "base", tmp_path / "probe")), 1)
    start = checkpoint.plan_start(args)
    corpus = data.build_data(args, train.model_file(args.model).dataset, start.tokenizer_file, start.vocab_size)
    batch = torch.as_tensor(data.global_batch(corpus.train, start=0, size=4)).long()
    ids, labels = batch[:, :-1], batch[:, 1:]
    stored = {k: v.double() for k, v in hf.file_state(folder).items()}
    live, deeper = live.double(), deeper.double()
    eps, p = live.config.rms_norm_eps, f"model.layers.{L}."
    with torch.no_grad():
        hidden = live.model(ids).last_hidden_state  # [b, s, h], after the final norm
        want_main = F.cross_entropy(live.lm_head(hidden).flatten(0, 1), labels.flatten()).item()
        nxt = F.pad(ids[:, 1:], (0, 1))  # t_{i+1}; the last position predicts nothing
        x = torch.cat([rms(live.model.embed_tokens(nxt), stored[p + "enorm.weight"], eps),
                       rms(hidden, stored[p + "hnorm.weight"], eps)], -1) @ stored[p + "eh_proj.weight"].T
        pos = torch.arange(ids.shape[1])[None]
        x = deeper.model.layers[L](x, attention_mask=None, position_ids=pos,
                                   position_embeddings=deeper.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        logits = rms(x, stored[p + "shared_head.norm.weight"], eps) @ stored[p + "shared_head.head.weight"].T
        want_mtp = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).item()
    assert not math.isclose(want_mtp, want_main, rel_tol=1e-3)  # a different loss, not the main one again
    for name, layout in LAYOUTS.items():
        harness.launch(2, run_argv(tmp_path / "base", tmp_path / name, *layout))
        recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        first = next(r for r in recs if "mtp_1_loss" in r)
        assert math.isclose(first_losses(tmp_path / name)[0], want_main, rel_tol=1e-5), name
        assert math.isclose(first["mtp_1_loss"], want_mtp, rel_tol=1e-5), (name, first["mtp_1_loss"], want_mtp)
    tools.main(["export", "--load", str(tmp_path / "tp2-sp"), "--hf-out", str(tmp_path / "out")])
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out.keys() == stored.keys()  # the MTP layer and its two copies, now of the trained weights
    assert torch.equal(out[p + "embed_tokens.weight"], out["model.embed_tokens.weight"])
    assert torch.equal(out[p + "shared_head.head.weight"], out["lm_head.weight"])
    assert not torch.equal(out[p + "eh_proj.weight"].double(), stored[p + "eh_proj.weight"])  # it trained
