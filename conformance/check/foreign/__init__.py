"""The user's own model beside the float64 oracle: `conformance.compare` / `rosetta compare`.

    side_by_side  a live torch or Flax model (or a folder, ONNX graphs, a CTranslate2 directory,
                  dispatched to their rooms) as a column of the `rosetta check` report
    grads         its backward half: the user's loss and gradients beside the oracle's
    report        the side-by-side report and the pieces every way of comparing shares
    taps          reading a foreign model's tensors where its layout's [taps] say
    user_code     the user's code failing: its own frames of the traceback

May import what conformance.check may.
"""
