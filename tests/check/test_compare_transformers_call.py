"""`conformance.compare` calls a live transformers model as transformers would, with no `run=`.

A transformers seq2seq model masks source padding only when given an `attention_mask`; called as
`model(src_ids, tgt_ids)` it attends to the padding and computes another function on a padded
batch. Each hf-* layout says, in its `[hf.call]` table, how the family's forward takes a batch;
`compare` calls the model so by default. Checked against transformers itself on right-padded
batches, for every family with an `[hf]` layout (BART as README shows it, in float64), and a model
that is not a transformers model, called with no mask, is told so before any switch is named.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the models are PyTorch models")
transformers = pytest.importorskip("transformers", reason="the models are built by transformers")

import conformance  # noqa: E402
from conformance.convert import load_layout  # noqa: E402
from systems import randomize_  # noqa: E402

VOCAB = 48
BART = dict(vocab_size=VOCAB, d_model=16, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, encoder_layers=2, decoder_layers=2, max_position_embeddings=32)
T5 = dict(vocab_size=VOCAB, d_model=16, d_kv=8, num_heads=2, d_ff=32, num_layers=2, relative_attention_num_buckets=8,
          relative_attention_max_distance=16, decoder_start_token_id=0)
# layout -> (config class, model class, config fields, pad id)
FAMILIES = {
    "hf-bart": ("BartConfig", "BartForConditionalGeneration", dict(BART, pad_token_id=1), 1),
    "hf-mbart": ("MBartConfig", "MBartForConditionalGeneration", dict(BART, pad_token_id=1), 1),
    "hf-m2m100": ("M2M100Config", "M2M100ForConditionalGeneration", dict(BART, pad_token_id=1), 1),
    "hf-pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", dict(BART, pad_token_id=0), 0),
    "hf-marian": ("MarianConfig", "MarianMTModel", dict(BART, pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1),
                  VOCAB - 1),
    "hf-t5": ("T5Config", "T5ForConditionalGeneration", dict(T5, pad_token_id=0), 0),
    "hf-mt5": ("MT5Config", "MT5ForConditionalGeneration", dict(T5, pad_token_id=0), 0),
}


def build(layout: str):
    config_class, model_class, fields, _ = FAMILIES[layout]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    frozen = ("embed_positions",) if layout in ("hf-marian", "hf-pegasus", "hf-m2m100") else ()
    buffers = ("final_logits_bias",) if hasattr(model, "final_logits_bias") else ()
    return randomize_(model, 3, buffers=buffers, skip=frozen)


def padded_batch(pad: int):
    """Sources of 7, 4 and 2 real tokens and decoder inputs of 6, 3 and 1, right-padded; no real
    token is the pad id or a special id below 3."""
    rng = np.random.default_rng(5)
    real = np.array([i for i in range(3, VOCAB) if i != pad])
    src = np.full((3, 7), pad, dtype=np.int64)
    tgt = np.full((3, 6), pad, dtype=np.int64)
    for row, (n_src, n_tgt) in enumerate([(7, 6), (4, 3), (2, 1)]):
        src[row, :n_src] = rng.choice(real, n_src)
        tgt[row, :n_tgt] = rng.choice(real, n_tgt)
    return src, tgt


def test_bart_as_the_readme_shows_it_agrees_in_float64():
    model = build("hf-bart").double()
    src, tgt = padded_batch(1)
    report = conformance.compare(model, "hf-bart", src, tgt, backends=())
    assert report.first_divergence is None, report.to_text()
    assert report.ok
    logits = report.cells[("logits", report.yours.label)].comparison
    assert logits.passed and logits.max_abs <= 1e-12, logits.describe()
    text = report.to_text()
    assert "called as model(input_ids=src_ids, attention_mask=(src_ids != 1), decoder_input_ids=tgt_ids)" in text


@pytest.mark.parametrize("layout", list(FAMILIES))
def test_every_family_is_called_with_its_padding_mask(layout):
    """float32 models held to the float32 tolerance: without the mask the padded rows differ by
    whole units, far outside it."""
    model = build(layout)
    src, tgt = padded_batch(FAMILIES[layout][3])
    report = conformance.compare(model, layout, src, tgt, backends=())
    assert report.first_divergence is None, report.to_text()
    compared = [t for (t, label), cell in report.cells.items() if label == report.yours.label and cell.comparison]
    assert "logits" in compared and "encoder.output" in compared, compared
    assert load_layout(layout).hf.call["attention_mask"] == "src_mask"


class NotTransformers(torch.nn.Module):
    """BART's modules under BART's keys, called with no mask: a model compare cannot know."""

    def __init__(self, bart):
        super().__init__()
        self.model, self.lm_head = bart.model, bart.lm_head
        self.register_buffer("final_logits_bias", bart.final_logits_bias.clone())

    def forward(self, src_ids, tgt_ids):
        hidden = self.model(input_ids=src_ids, decoder_input_ids=tgt_ids).last_hidden_state
        return self.lm_head(hidden) + self.final_logits_bias


def test_a_model_called_with_no_mask_is_told_so_before_any_switch():
    bart = build("hf-bart").double()
    mine = NotTransformers(bart)
    src, tgt = padded_batch(1)
    sizes = dict(n_heads=2, pad_id=1, activation="gelu", scale_embedding=False)
    report = conformance.compare(mine, "hf-bart", src, tgt, backends=(), **sizes)
    assert report.first_divergence is not None
    text = report.to_text()
    assert "called as model(src_ids, tgt_ids) (no run= given): no padding mask" in text
    said = text.index("the run gave your model no padding mask, and the batch has padding")
    assert said < text.index("switches that act there"), text
    assert report.to_json()["run_gave_no_padding_mask"] is True

    def with_mask(model, src, tgt):
        hidden = model.model(input_ids=src, attention_mask=(src != 1).long(), decoder_input_ids=tgt).last_hidden_state
        return model.lm_head(hidden) + model.final_logits_bias

    report = conformance.compare(mine, "hf-bart", src, tgt, run=with_mask, backends=(), **sizes)
    assert report.first_divergence is None, report.to_text()
    assert "no padding mask" not in report.to_text()
