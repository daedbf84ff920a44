"""The hypothesis conformance suite: the product users run against their backends.

    pytest -p conformance.suite.pytest_plugin --pyargs conformance.suite    (or: rosetta conformance)

    pytest_plugin   options (--backends, --devices), targets, the header; load it with -p
    conftest        registers the plugin when a run reaches the suite without -p
    profiles        the hypothesis profiles: ci (bounded, derandomized), thorough and scale (full size)
    strategies      drawn configs, weights and token batches (tame, trained-like, long, full size)
    runner          runs one case on one target, results as NumPy arrays
    assertions      comparisons whose failures name backend, device, dtype, tensor and error
    measure         measures the tolerance table (python -m conformance.suite.measure)
    realistic       what the two trained-scale properties share: the bounded sample, the comparison
    estimate        the `scale` profile's time, estimated before it runs
    test_*.py       the properties, one per file

May import: the core, the check tools, hypothesis and pytest; backends only through
`conformance.check.backends`. Never the CLI.
"""
