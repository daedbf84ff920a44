"""Adapter targets in the suite (`conformance.check.targets.adapter`, docs/own-backend.md): which properties
run on a user's adapter, each one that does not skipped by name with what it needs, and the report
of what the adapters did not offer. Read by the suite's pytest plugin.

The exported-graph targets (`onnxruntime`) are skipped here too, by name, for the few properties
that call what an exported graph has no input or output for (`GRAPH_TARGETS_LACK`)."""

from __future__ import annotations

import pytest

from conformance.check import backends
from conformance.check.backends import Target

# The properties an adapter (`conformance.check.targets.adapter`, docs/own-backend.md) runs, and the
# optional methods of the protocol each needs beyond `forward` and `intermediates`.
ADAPTER_PROPERTIES = {
    "test_every_tensor_matches_the_oracle": (),
    "test_repeated_calls_are_bitwise_identical": (),
    "test_generate_chooses_the_oracles_ids": ("generate",),
    "test_gradients_match_the_oracle": ("loss_and_grads",),
}
# Why each other property does not run on an adapter: what it calls that the protocol has not.
BEYOND_THE_ADAPTER = {
    "test_encode_then_decode_equals_the_forward": "it calls encode and decode apart",
    "test_bad_calls_fail_the_same_way_everywhere": "it holds a backend to rosetta's InputError for bad input",
    "test_bad_params_fail_the_same_way_everywhere": "it holds a backend to rosetta's InputError for bad parameters",
    "test_unsupported_dtypes_are_refused": "it holds a backend to rosetta's InputError for a dtype",
    "test_explicit_masks_give_the_same_result_as_derived_masks": "it passes explicit masks",
    "test_masks_equal_the_oracle_exactly": "it calls the backend's make_masks",
    "test_fast_path_matches_the_oracle": "it calls the model without attention weights (the fast path)",
    "test_fully_masked_rows_follow_the_fill": "it runs the drawn config itself, not one held to the adapter's switches",
    "test_every_tensor_matches_the_oracle_at_trained_scale": "it runs the drawn config itself, not one held to the "
                                                             "adapter's switches",
    "test_long_sequences_match_the_oracle_in_half_precision": "it runs the drawn config itself, not one held to the "
                                                              "adapter's switches",
    "test_backends_agree_pairwise": "each adapter is compared with the oracle (test_every_tensor_matches_the_oracle)",
}

# Targets that run exported graphs (conformance.check.onnx.runtime): the properties that call what
# a graph has no input or output for, and why. Forward, the fast path, encode-decode, generate,
# determinism, the pairs and the error properties run.
GRAPH_TARGETS_LACK = {
    "onnxruntime": {
        "test_explicit_masks_give_the_same_result_as_derived_masks":
            "the exported decoder graph derives its target mask from the ids inside the graph: no mask input "
            "to pass an explicit (B, 1, T, T) mask to",
        "test_masks_equal_the_oracle_exactly": "the masks are computed inside the exported graphs: there is no "
                                               "make_masks to call",
    },
}


def adapter_skip_reason(property_name: str, target: Target) -> str | None:
    """Why `property_name` does not run on an adapter target (None: it runs): a property outside
    the protocol, or an optional method the adapter's model does not have. Named in the report.
    On an exported-graph target, a property the graphs cannot serve (`GRAPH_TARGETS_LACK`)."""
    lack = GRAPH_TARGETS_LACK.get(target.backend, {}).get(property_name)
    if lack:
        return f"{target.label}: exported graphs: {property_name} does not run: {lack}"
    if not backends.is_adapter(target.backend):
        return None
    if property_name not in ADAPTER_PROPERTIES:
        why = BEYOND_THE_ADAPTER.get(property_name, "it needs more of a backend than the adapter protocol has")
        return f"{target.label}: adapter: {property_name} is not in the adapter protocol: {why}"
    offers = backends.adapter_of(target.backend).offers()
    lacking = [method for method in ADAPTER_PROPERTIES[property_name] if method not in offers]
    if lacking:
        return (f"{target.label}: adapter: {property_name} needs {' and '.join(lacking)}, which the adapter's model "
                "does not have (optional in the protocol)")
    return None


def with_adapter_skips(params: list, property_name: str) -> list:
    """`params` with an adapter target that cannot run `property_name` skipped, by name."""
    out = []
    for param in params:
        targets = param.values[0] if isinstance(param.values[0], tuple) else (param.values[0],)
        reason = next((r for t in targets if (r := adapter_skip_reason(property_name, t))), None)
        if reason and not param.marks:
            param = pytest.param(*param.values, id=param.id, marks=[pytest.mark.skip(reason=reason)])
        out.append(param)
    return out


def backend_of(label: str) -> str:
    """The backend of a target label `backend/device/dtype`: an adapter's path may hold a "/"."""
    return label.rsplit("/", 2)[0]


def adapter_report(skipped_because: dict[str, set[str]], not_exposed: dict[str, set[str]]) -> list[str]:
    """Per adapter target: the properties skipped by name and why, and the tensors its model never
    returned (compared nowhere), from the run's reports (`not_exposed`: target label -> names)."""
    lines = []
    for name in backends.requested_backends():
        if not backends.is_adapter(name):
            continue
        adapter = backends.adapter_of(name)
        lines.append(f"  {adapter.describe()}")
        for label, reasons in sorted(skipped_because.items()):
            if "/" in label and any(backend_of(one) == name for one in label.split("~")):  # a target or a pair
                lines += [f"    skipped: {reason}" for reason in sorted(reasons)]
        for label, missing in sorted(not_exposed.items()):
            if missing and backend_of(label) == name:
                lines.append(f"    {label}: not exposed by intermediates, so not compared: {', '.join(sorted(missing))}")
    return lines
