"""Hypothesis strategies for the conformance suite, one module per thing drawn:

    model_configs  `ModelConfig`s over every switch (`switch_values`, read from the config
                   module), presets at a small size
    ids            padded token batches, one padding pattern per row
    weights        trained-like weights (`Trained`) and the kinds a config can be checked on
    forward_cases  a config, its weights and a batch (`Case`), the forward properties' example;
                   `shared_examples` and `with_examples`
    realistic      trained-like, long and full-size cases, and the anchors every profile runs first
    generation     decoding examples (`GenerationCase`)
    scripted       scripted decoders (`Script`): step logits drawn directly, for the search's rules
    training       gradient examples (`TrainingCase`)

Sizes are small (d_model 8-64, 1-4 heads, 1-3 layers per side, vocab 5-64) so that thousands of
examples run in minutes. Sequence lengths are drawn from a short list and max_len from two
values, so that a jit-compiling backend (JAX) sees a bounded set of shapes: each new
(config, shape) costs a compile, which the suite reports separately from run time.

Every name below is importable from `conformance.suite.strategies` itself, as before the split.

May import what conformance.suite may: the core, the check tools, the backends lazily, hypothesis.
"""

from conformance.suite.strategies.forward_cases import WEIGHT_SCALES, Case, cases, shared_examples, with_examples
from conformance.suite.strategies.model_configs import (BASE, FILLS, MAX_LENS, NUMERIC_CHOICES, any_configs, configs,
                                                  preset_configs, small_configs, switch_values)
from conformance.suite.strategies.generation import GenerationCase, generation_cases
from conformance.suite.strategies.scripted import Script, scripted_step, scripts
from conformance.suite.strategies.ids import LENGTHS, PADDING_PATTERNS, token_ids
from conformance.suite.strategies.realistic import (LONG_MAX_LENS, SCALE_D_MODELS, SCALE_HEAD_DIM, SCALE_LAYERS,
                                                    SCALE_LENGTHS, SCALE_VOCAB, any_realistic_cases, long_anchor_case,
                                                    long_cases, long_seeded_cases, realistic_cases, scale_cases,
                                                    trained_anchor_cases)
from conformance.suite.strategies.training import LABEL_SMOOTHINGS, TrainingCase, relabelled, training_cases
from conformance.suite.strategies.weights import (KINDS, LN_GAINS, OFFSETS, OUTLIER_SIZES, QK_GAINS, Trained,
                                                  kinds_for, realistic_in_domain, trained)
