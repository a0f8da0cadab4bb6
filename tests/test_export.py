"""``adahop export RUN --hf OUT``: a run's model as a plain transformers Llama (tiny CPU runs)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from adahop.cli import main as adahop_main  # noqa: E402
from adahop.data import load_tokenizer, resolve_source  # noqa: E402
from adahop.integrations.hf_export import REPORT_FILE, ExportError, to_llama  # noqa: E402
from adahop.integrations.transformers import hf_key  # noqa: E402
from adahop.models import build_model  # noqa: E402
from adahop.train import load_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(small_overrides, tmp_path_factory):
    """A run of the default recipe (BF16 forward) and one of mxfp4 (4-bit forward)."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for recipe in ("adahop_lv1_bf16_forward", "mxfp4"):
        argv = [f"--{k}={v}" for k, v in small_overrides(root / recipe, recipe__name=recipe)]
        assert adahop_main(["train", *argv]) == 0
        dirs[recipe] = root / recipe
    return dirs


def test_bf16_forward_export_reloads_with_identical_logits(runs, tmp_path):
    out = tmp_path / "hf"
    assert adahop_main(["export", str(runs["adahop_lv1_bf16_forward"]), "--hf", str(out)]) == 0
    plain = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    model, cfg, _ = load_run(runs["adahop_lv1_bf16_forward"])
    tokens = torch.randint(0, cfg.data.vocab_size, (2, cfg.data.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # float32 on the CPU, the same operations in the same order: equal bit for bit
        assert torch.equal(plain(input_ids=tokens).logits, model.eval()(tokens))
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["forward"] == "bf16" and report["loss_gap"] == 0.0
    assert report["held_out_loss"]["as_trained"] == report["held_out_loss"]["exported"]
    assert not list(tmp_path.glob(".hf.tmp*"))  # the temporary folder became OUT


def test_export_writes_the_runs_tokenizer_and_stops_generation_at_its_end_of_document(runs, tmp_path):
    out = tmp_path / "hf"
    assert adahop_main(["export", str(runs["adahop_lv1_bf16_forward"]), "--hf", str(out)]) == 0
    _, cfg, _ = load_run(runs["adahop_lv1_bf16_forward"])
    ours = load_tokenizer(resolve_source(cfg.data.source), cfg.data.vocab_size)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = 'def f(x):\n    return json.dumps({"a": x})  # <|endoftext|>'
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == ours.eos_id
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == ours.eos_id


def test_quantized_forward_export_reports_both_held_out_losses(runs, tmp_path, capsys):
    out = tmp_path / "hf"
    assert adahop_main(["export", str(runs["mxfp4"]), "--hf", str(out), "--max-batches", "1"]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    loss = report["held_out_loss"]
    assert report["forward"] == "quantized" and report["quantized_forward_layers"] == 14
    assert loss["as_trained"] != loss["exported"]  # the 4-bit forward is gone
    assert report["loss_gap"] == pytest.approx(loss["exported"] - loss["as_trained"])
    printed = capsys.readouterr().out
    assert f"{loss['as_trained']:.4f}" in printed and f"{loss['exported']:.4f}" in printed


@pytest.mark.parametrize("case", ["not_a_run", "out_not_empty"])
def test_export_refuses_in_one_line_and_writes_nothing(runs, tmp_path, capsys, case):
    out = tmp_path / "hf"
    source = str(runs["adahop_lv1_bf16_forward"])
    if case == "not_a_run":
        source = str(tmp_path)
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    assert adahop_main(["export", source, "--hf", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("adahop export: error:") and len(err.splitlines()) == 1
    assert "no checkpoints" in err if case == "not_a_run" else "not an empty folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["hf"] if case == "out_not_empty" else [])
    if case == "out_not_empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_a_model_that_is_not_adahops_llama_has_no_hf_equivalent():
    model = build_model("tiny", vocab_size=64, n_layers=1, dim=32, n_heads=2, n_kv_heads=1, max_seq_len=16)
    model.extra = nn.Linear(32, 32, bias=False)
    with pytest.raises(ExportError, match="model preset 'custom' has no Hugging Face equivalent: .*'extra.weight'"):
        to_llama(model, 0, "custom")
    with pytest.raises(ValueError, match="no Hugging Face Llama equivalent"):
        hf_key("layers.0.attention.wq.bias")


def test_tied_embeddings_export_as_tied_weights(tmp_path):
    model = build_model(
        "tiny", vocab_size=64, n_layers=1, dim=32, n_heads=2, n_kv_heads=1, max_seq_len=16, tie_embeddings=True
    )
    to_llama(model, 0, "tiny").save_pretrained(tmp_path)
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert plain.config.tie_word_embeddings and plain.lm_head.weight is plain.model.embed_tokens.weight
    tokens = torch.arange(16)[None] % 64
    with torch.no_grad():
        assert torch.equal(plain(input_ids=tokens).logits, model.eval()(tokens))
