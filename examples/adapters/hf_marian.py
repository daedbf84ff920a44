"""transformers' MarianMTModel behind rosetta's adapter protocol (docs/own-backend.md), two ways:

    rosetta conformance --backends examples/adapters/hf_marian.py:eager   its eager attention
    rosetta conformance --backends examples/adapters/hf_marian.py:sdpa    its SDPA attention (the default)

The model is transformers' own, built from the drawn config (`MarianConfig`) and loaded with the
drawn weights through the `hf-marian` layout, as `from_pretrained` would load them: without the
position tables, which Marian does not save and builds itself. Its forward, its intermediate
tensors (read where Marian computes them, the layout's `[taps]`), its `generate` (transformers'
own search: greedy and beam search with its rule) and its gradients (its own autograd, our loss)
are compared with the float64 oracle.

What Marian computes is described by `ModelConfig` switches (`SWITCHES`): the preset `hf-marian`,
with the constructor's arguments (activation, embedding scale, pad id) left to the draw, and the
masks as each attention applies them. Eager attention adds `finfo(dtype).min` to a masked score
(`masked_scores="added"`, `mask_fill` float32's edge): a query with no key to attend to averages
the values, and its gradient reaches q and k through the added scores. SDPA attention gives such
a query zeros (`empty_rows="zeros"`). Two differences remain, acknowledged (`KNOWN`) with why.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import MarianConfig, MarianMTModel

from conformance.check.targets.adapter import canonical_gradients, switches_of
from conformance.check.foreign.taps import capture
from conformance.convert import export_state_dict, load_layout
from conformance.core.output import forward_order
from conformance.core.presets import FLOAT32_MIN

LAYOUT = load_layout("hf-marian")
# MarianConfig.activation_function for each of rosetta's activations (transformers' ACT2FN names).
ACTIVATIONS = {"silu": "swish", "gelu": "gelu", "relu": "relu", "gelu-tanh": "gelu_new", "tanh": "tanh"}


class Marian:
    """A MarianMTModel and the config it was built from, called as the protocol calls a model."""

    def __init__(self, model: MarianMTModel, config, attention_switches: dict):
        self.model, self.config, self.attention_switches = model, config, attention_switches

    def run(self, model, src, tgt):
        """Marian's forward on batch-first ids: the encoder mask from the pad id (as `generate`
        infers it), no decoder mask (Marian's decoder is causal only)."""
        return model(input_ids=src, attention_mask=(src != self.config.pad_id).long(), decoder_input_ids=tgt).logits

    def forward(self, src_ids, tgt_ids):
        with torch.no_grad():
            return self.run(self.model, torch.from_numpy(src_ids), torch.from_numpy(tgt_ids)).numpy()

    def intermediates(self, src_ids, tgt_ids):
        names = forward_order(self.config)
        with torch.no_grad():
            captured = capture(self.model, LAYOUT, names, self.run, src_ids, tgt_ids, self.config.to_dict())
        return {**captured.values, "logits": captured.logits}

    def generate(self, src_ids, max_len, bos_id, eos_id, *, num_beams=1, length_penalty=1.0, early_stopping=False,
                 no_repeat_ngram_size=0, forced_bos_id=None, forced_eos=False, bad_words_ids=(), min_length=0,
                 min_new_tokens=None, banned_ids=(), length_penalty_form="hf", **processors):
        """transformers' own search: greedy, or beam search with its rule (`searches` below), with the
        suite's logits processors passed on by their transformers names (`PROCESSORS`); any other
        option is refused, never dropped."""
        unknown = sorted(set(processors) - set(PROCESSORS))
        if unknown or (length_penalty_form != "hf" and num_beams > 1):
            raise TypeError(f"MarianMTModel.generate has no {unknown or ['length_penalty_form=' + length_penalty_form]}")
        src = torch.from_numpy(src_ids)
        bad = [list(word) for word in bad_words_ids] + [[i] for i in banned_ids]
        passed = {name: (list(value) if isinstance(value, tuple) and name.endswith("tokens") else value)
                  for name, value in processors.items() if value is not None}
        with torch.no_grad():
            out = self.model.generate(
                input_ids=src, attention_mask=(src != self.config.pad_id).long(), decoder_start_token_id=bos_id,
                eos_token_id=eos_id, pad_token_id=self.config.pad_id, max_length=max_len + 1, num_beams=num_beams,
                length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False,
                no_repeat_ngram_size=no_repeat_ngram_size or None, forced_bos_token_id=forced_bos_id,
                forced_eos_token_id=eos_id if forced_eos else None, bad_words_ids=bad or None,
                min_length=min_length, min_new_tokens=min_new_tokens, num_return_sequences=1, **passed)
        return out[:, 1:].numpy()  # the start token left out, as rosetta's generate returns the ids

    def loss_and_grads(self, src_ids, tgt_ids, labels, *, label_smoothing=0.0):
        """Our loss (docs/training.md: the mean cross-entropy over the labels that are not the pad
        id) on Marian's logits, differentiated by torch's autograd, the gradients back under
        rosetta's canonical names (`canonical_gradients`: through the layout's key map)."""
        self.model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            logits = self.run(self.model, torch.from_numpy(src_ids), torch.from_numpy(tgt_ids))
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), torch.from_numpy(labels).flatten(), ignore_index=self.config.pad_id,
                label_smoothing=label_smoothing)
            loss.backward()
        grads = {key: p.grad.double().numpy() for key, p in self.model.named_parameters() if p.grad is not None}
        return float(loss.detach()), canonical_gradients(self.config, grads, LAYOUT, **self.attention_switches)


def marian(config, params, dtype, attention: str) -> Marian:
    hf = MarianConfig(vocab_size=config.src_vocab_size, decoder_vocab_size=config.tgt_vocab_size,
                      d_model=config.d_model, encoder_layers=config.n_encoder_layers,
                      decoder_layers=config.n_decoder_layers, encoder_attention_heads=config.n_heads,
                      decoder_attention_heads=config.n_heads, encoder_ffn_dim=config.d_ff,
                      decoder_ffn_dim=config.d_ff, max_position_embeddings=config.max_len,
                      activation_function=ACTIVATIONS[config.activation], scale_embedding=config.scale_embedding,
                      pad_token_id=config.pad_id, decoder_start_token_id=config.pad_id, eos_token_id=config.pad_id,
                      forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                      share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    hf._attn_implementation = attention
    model = MarianMTModel(hf).to(getattr(torch, dtype)).eval()
    # How its attention meets the masks is the attention implementation's (SWITCHES), not the
    # layout's, which describes the weights: said to the export. Marian's position tables are its
    # own (rebuilt on load, never saved): the exported ones stay out.
    attention_switches = {name: getattr(config, name) for name in ("mask_fill", "masked_scores", "empty_rows")}
    state = {key: torch.from_numpy(value).to(getattr(torch, dtype))
             for key, value in export_state_dict(config, params, LAYOUT, **attention_switches).items()
             if "embed_positions" not in key}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("embed_positions" in key for key in missing), (missing, unexpected)
    return Marian(model, config, attention_switches)


def eager(config, params, dtype):
    return marian(config, params, dtype, "eager")


def sdpa(config, params, dtype):
    return marian(config, params, dtype, "sdpa")


# What MarianMTModel can be: the preset, with what MarianConfig takes from its user left to the
# draw (activation, embedding scale, pad id). The relative-position fields act only with T5's
# relative positions, never in Marian's config: free, they are drawn and change nothing.
PRESET = switches_of("hf-marian", free=("activation", "scale_embedding", "pad_id", "relative_buckets",
                                        "relative_max_distance"))
SWITCHES = {"eager": {**PRESET, "activation": tuple(ACTIVATIONS), "mask_fill": FLOAT32_MIN, "masked_scores": "added",
                      "empty_rows": "softmax"},
            "sdpa": {**PRESET, "activation": tuple(ACTIVATIONS), "mask_fill": FLOAT32_MIN, "empty_rows": "zeros"}}
# transformers' generate: greedy search and beam search with its rule (no Flax rule, no GNMT
# penalty, and its sampling draws from its own generator, not from rosetta's seeds).
SEARCHES = ("greedy", "beam")
# The logits processors rosetta's generate takes that transformers' takes by the same name and meaning.
PROCESSORS = ("repetition_penalty", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size",
              "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "renormalize_logits")
# Marian's final_logits_bias is a buffer: transformers never trains it (rosetta's freeze switches
# hold the pad embedding row; this one is the adapter's to declare).
FROZEN = ("final_logits_bias",)
# In float64 its position table is float32's: the embeddings differ first, then, rarely, the ids
# of a search at a near tie; in the gradient property every gradient moves with them, and the
# first found beyond float64's tolerance is any of them (the loss, a LayerNorm's bias, ...).
TABLE = ("MarianSinusoidalPositionalEmbedding.create_weight rounds its table to float32 (torch.FloatTensor) before "
         "the model is cast to float64: every position term is off by up to 3e-8")
KNOWN = [
    dict(tensor=["*.embeddings", "ids"], when={"dtype": "float64"}, condition="the float32 position table",
         reason=TABLE),
    dict(tensor="*", when={"dtype": "float64", "property": "gradients"}, condition="the float32 position table",
         reason=TABLE + "; every gradient moves with it"),
]
for factory, attention in ((eager, "eager"), (sdpa, "sdpa")):
    factory.switches = SWITCHES[attention]
    factory.dtypes = ("float32", "float64")
    factory.searches = SEARCHES
    factory.frozen = FROZEN
    factory.known_differences = KNOWN
