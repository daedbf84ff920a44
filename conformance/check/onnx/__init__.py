"""ONNX Runtime beside the float64 oracle (docs/deployment.md).

    export   impl_torch's model as encoder/decoder ONNX graphs (torch's exporter), `rosetta convert --to onnx`
    runtime  the `onnxruntime` target: those graphs run by ONNX Runtime, beside the oracle
    compare  the user's own ONNX graphs beside the oracle, tensor by tensor
    single   one graph of a whole transformers model (a user's torch.onnx.export): its inputs by
             the layout's [hf.call], its taps by the module scopes the exporter recorded

May import what conformance.check may; onnx and onnxruntime lazily.
"""
