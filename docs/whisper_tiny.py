"""A tiny random Whisper, as `WhisperForConditionalGeneration.save_pretrained` writes it, with a tokenizer:
the stand-in for a downloaded openai/whisper-* folder in docs/whisper.md's walkthrough, which cannot
download one.

    python docs/whisper_tiny.py whisper-tiny/            # config.json, generation_config.json,
                                                          # model.safetensors, tokenizer.json, ...
    python docs/whisper_tiny.py other/ --seed 1           # another model of the same shape
    python docs/whisper_tiny.py tuned/ --fine-tune-decoder   # the seed's model, its decoder moved on
                                                          # (a fine-tune with the encoder frozen)

transformers builds the model (d_model 16, 2 + 2 layers, 8 mel bins, a 16-frame window, 16 decoder
positions); every weight, norm and bias is then jittered off its initialisation (the encoder's
sinusoid left as it is; weights by 1.5 / sqrt(fan-in), biases and norms by 0.2), and the end of
text's row of the tied token table is doubled so that greedy outputs end at different lengths
(seed 0, on a whole window of three rows of standard-normal features: one row ends after 3 tokens,
two run to the limit, each its own ids). The 64 ids are laid out as a multilingual Whisper's, with its
special tokens spelled as its tokenizer spells them (ct2-transformers-converter and CTranslate2 find
them by their spelling): 45 text tokens, <|endoftext|>, <|startoftranscript|>, <|en|>, <|de|>,
<|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nospeech|>, <|notimestamps|>, then 9
timestamps (which ct2-transformers-converter spells itself, as for a released model's tokenizer
that lacks them). The tokenizer is a word-level one: its text tokens are "w00".."w44".
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
           "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
TEXT = 45  # text ids 0..44; the special tokens from 45
VOCAB = 64  # 45 text, 10 special, 9 timestamps (<|0.00|> .. <|0.16|>: max_source_positions + 1 of them)
SIZES = dict(vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
             max_source_positions=8, max_target_positions=16, pad_token_id=45, bos_token_id=45, eos_token_id=45,
             decoder_start_token_id=46)
# The generation settings a released Whisper's generation_config.json has, for these ids.
GENERATION = dict(decoder_start_token_id=46, bos_token_id=45, eos_token_id=45, pad_token_id=45, max_length=16,
                  is_multilingual=True, lang_to_id={"<|en|>": 47, "<|de|>": 48},
                  task_to_id={"transcribe": 50, "translate": 49}, no_timestamps_token_id=54, prev_sot_token_id=52,
                  suppress_tokens=[1, 2, 7, 8, 9, 46, 49, 50, 51, 52, 53], begin_suppress_tokens=[3, 45],
                  max_initial_timestamp_index=4, forced_decoder_ids=[[1, None], [2, 50]])


def build(seed: int = 0, fine_tune_decoder: bool = False):
    """The jittered transformers model (float32, eval); `fine_tune_decoder`: then every decoder
    weight moved on by 0.05 / sqrt(fan-in) N(0, 1) (a generator of seed + 1), the encoder as it was."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**SIZES)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.encoder.embed_positions.weight":
                continue  # Whisper's encoder sinusoid is never trained
            noise = torch.randn(p.shape, generator=generator)
            p.add_(0.2 * noise if p.ndim == 1 else 1.5 * noise / math.sqrt(max(1, p[0].numel())))
        model.model.decoder.embed_tokens.weight[GENERATION["eos_token_id"]] *= 2.0
        if fine_tune_decoder:
            generator = torch.Generator().manual_seed(seed + 1)
            for name, p in model.model.decoder.named_parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator) / math.sqrt(max(1, p[0].numel())))
    return model


def tokenizer():
    """A word-level tokenizer with Whisper's special tokens at their ids (transformers' fast tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i:02d}": i for i in range(TEXT)} | {token: TEXT + i for i, token in enumerate(SPECIAL)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])


def write(folder: str | Path, seed: int = 0, fine_tune_decoder: bool = False) -> Path:
    """The model (`build`), its generation config and its tokenizer, saved into the new folder `folder`."""
    import transformers

    folder = Path(folder)
    if folder.exists():
        raise SystemExit(f"{folder} exists: name a new folder")
    model = build(seed, fine_tune_decoder)
    model.generation_config = transformers.GenerationConfig(**GENERATION)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the new folder to write")
    parser.add_argument("--seed", type=int, default=0, help="the model's seed (default 0)")
    parser.add_argument("--fine-tune-decoder", action="store_true",
                        help="move the decoder's weights on, the encoder's as they were (a fine-tune with the encoder "
                             "frozen)")
    args = parser.parse_args(argv)
    print(f"wrote {write(args.folder, args.seed, args.fine_tune_decoder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
