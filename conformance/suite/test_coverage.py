"""Check: every property saw every switch value on every target it ran (issue 24).

Run after every property (the plugin collects this file last). `covering.RECORDER` noted, for
each property and target, the switches and padding kinds of every case that reached the backend;
a property that passed on a target must have seen every value `covering.all_switch_values()` lists
(less the few a property never sees by design, `covering.NEVER`). The failure names the property,
the target and each value missed. A property that failed, or was skipped on a target, is not
checked there: its own result already says why.
"""

import pytest

from conformance.suite.covering import RECORDER, coverage_problems


def test_every_property_saw_every_switch_value():
    if not RECORDER.passed & {item for item, _ in RECORDER.seen}:
        pytest.skip("no conformance property ran and passed in this session: nothing to check")
    problems = coverage_problems(RECORDER.seen, RECORDER.passed)
    assert not problems, "properties ran without every switch value:\n  " + "\n  ".join(problems)
