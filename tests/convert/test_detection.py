"""Auto-detection never guesses (issue 53): keys that fit several systems computing different
models are refused with the candidates, what tells them apart and the --layout line; keys that
fit one system but hold a structure it does not have are refused by name.

Bare state dicts of PLBart and Blenderbot (and BlenderbotSmall) carry exactly BART's and Pegasus'
keys: before, PLBart converted silently as hf-bart and Blenderbot as hf-pegasus, with other
logits (the embedding scale, the activation). Named with --layout, each converts to the model its
folder converts to (tests/convert/test_hf_families.py holds those against transformers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the families are PyTorch models")
pytest.importorskip("transformers", reason="the families are built by transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers beside the rooms

from conformance.cli import main  # noqa: E402
from conformance.convert import (  # noqa: E402
    AmbiguousLayoutError, NoMatchingLayoutError, TensorError, export_state_dict, from_hf, import_state_dict,
)
from conformance.convert.readers import as_arrays  # noqa: E402
from test_hf_families import build  # noqa: E402

# family -> (the layouts its bare keys fit, a switch that differs between them)
AMBIGUOUS = {
    "plbart": (["hf-bart", "hf-plbart"], "scale_embedding"),
    "blenderbot": (["hf-blenderbot", "hf-pegasus"], "activation"),
    "blenderbot_small": (["hf-bart", "hf-blenderbot-small", "hf-plbart"], "decoder_embedding_norm"),
}


@pytest.mark.parametrize("name", sorted(AMBIGUOUS))
def test_a_bare_state_dict_that_fits_several_families_is_refused_with_the_candidates(name, tmp_path, capsys):
    model = build(name)
    state = as_arrays(model.state_dict())
    fits, switch = AMBIGUOUS[name]
    with pytest.raises(AmbiguousLayoutError) as refused:
        import_state_dict(state, None, n_heads=2)
    message = str(refused.value)
    assert set(fits) <= set(refused.value.names), message
    assert switch in message and "trial forward pass cannot catch" in message, message
    for layout in fits:
        assert f"--layout {layout}" in message, message
    # From the command line: exit 2, nothing written, the same message.
    path = tmp_path / "bare.pt"
    torch.save(model.state_dict(), path)
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(path), str(out), "--set", "n_heads=2"]) == 2
    layout = "hf-" + name.replace("_", "-")
    assert not out.exists() and f"--layout {layout}" in capsys.readouterr().err
    # Named, it converts to what transformers' own config gives (from_hf reads model.config).
    config, params = import_state_dict(state, layout, n_heads=2)
    live_config, live = from_hf(model)
    assert config.replace(notes={}) == live_config.replace(notes={})
    assert all(np.array_equal(params[k], live[k]) for k in live)


def test_marian_keys_holding_a_learned_table_are_refused_by_name():
    """BART's keys without layernorm_embedding are Marian's, but Marian rebuilds its sinusoid when
    it loads a model: a learned table is a structure Marian does not have. Converted before."""
    model = build("bart")
    state = {k: v for k, v in as_arrays(model.state_dict()).items() if "layernorm_embedding" not in k}
    with pytest.raises(TensorError, match="is not the sinusoid-split sinusoid that the hf-marian system rebuilds") as info:
        import_state_dict(state, None, n_heads=2)
    assert info.value.key.endswith("embed_positions.weight")


def test_a_near_miss_one_structural_switch_would_fit_is_named():
    """llmhub's keys without the q/k/v biases: the keys of llmhub with qkv_bias=false, a structure
    llmhub does not have; the refusal names it and the line that says a copy was changed so."""
    from conformance import init_params, preset

    config = preset("llmhub", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                    src_vocab_size=11, tgt_vocab_size=11, max_len=8)
    state = export_state_dict(config, init_params(config, seed=1), "llmhub")
    short = {k: v for k, v in state.items() if not any(f".w_{p}.bias" in k for p in "qkv")}
    with pytest.raises(NoMatchingLayoutError) as refused:
        import_state_dict(short, None, n_heads=2)
    message = str(refused.value)
    assert "these are the keys of llmhub with qkv_bias=false" in message, message
    assert "--layout llmhub --set qkv_bias=false" in message, message
    back, _ = import_state_dict(short, "llmhub", n_heads=2, qkv_bias=False)
    assert not back.qkv_bias
