"""The public surface every backend package offers, by name: one list, read by the three
`impl_*/__init__.py` as their `__all__` and by the tools that drive any backend.

    Model(config, params=None, dtype=None, *, device=None, param_dtype=None)
                                                               the model; `.config`, `.dtype`, `.param_dtype`, `.device`
    load(path, dtype=None, *, device=None, param_dtype=None) / save(model, path)
                                                               the checkpoint, in and out (save writes the stored dtype)
    SUPPORTED_DTYPES                                           what `dtype` may be
    full_precision() / precision_settings()                    matmuls at full precision (TF32 off), and a report
    to_numpy(array)                                            any result as a host NumPy array, bit for bit
    padding_mask, causal_mask, target_mask, make_masks         the masks, True = may attend
    softmax, scaled_dot_product_attention                      attention as a pure function

`dtype` is the dtype a model computes in (activations, logits, scores); `param_dtype` the dtype
its parameters are stored in (default: `dtype`), each cast to `dtype` where it is used through the
one `cast(w, dtype)` helper of each model.py. Gradients (`loss_and_grads`) come in `param_dtype`.

What only one backend has stays importable from it, listed in its `BACKEND_EXTRAS`.
"""

BACKEND_API = (
    "Model",
    "SUPPORTED_DTYPES",
    "causal_mask",
    "full_precision",
    "load",
    "make_masks",
    "padding_mask",
    "precision_settings",
    "save",
    "scaled_dot_product_attention",
    "softmax",
    "target_mask",
    "to_numpy",
)
