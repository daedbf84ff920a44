"""Property (CUDA): each SDPA kernel torch's fast path may pick conforms on its own.

Without attention weights, torch runs attention through `F.scaled_dot_product_attention`, which
picks a kernel per call: flash, memory-efficient, cuDNN or the math fallback, by dtype, shape, mask
and GPU. A run of the fast-path property (`test_fast_path.py`) sees only the kernel torch picked
for each example; here each kernel is forced in turn (`torch.nn.attention.sdpa_kernel`), so that a
kernel a user's GPU picks and the CI GPU did not is still checked. A kernel refuses some inputs
(flash takes no attention mask and no float32, the memory-efficient kernel in half precision wants
a head size divisible by 8, cuDNN no key sequence of length 1): such an example checks nothing and
is not counted (it still uses up one of the run's examples), and the property goes on with the
others. Only a kernel that refused every example of the run is skipped, with torch's reasons
(`watch_examples`, which the suite's plugin wraps around each run of this property); one refusal
does not hide the examples the kernel does run.

torch picks among these kernels on CUDA: the property's targets are torch's CUDA ones, skipped with
the reason where there is no CUDA device. tests/suite/test_gpu_parts.py runs it on the CPU's kernels
(`DEVICES`) to see it fail on a broken fast path.
"""

import collections
import contextlib
import warnings

import pytest
from hypothesis import assume, event, given

from conformance.check import backends
from conformance.check.tolerances import in_domain
from conformance.core.config import inert_switches
from conformance.core.output import forward_order
from conformance.suite import runner
from conformance.suite.assertions import assert_tensors_close
from conformance.suite.covering import covering_cases
from conformance.suite.strategies import cases, shared_examples, with_examples

KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
DEVICES = ("cuda",)  # where torch chooses among the kernels
# What torch says when the forced kernel cannot run the inputs (on CUDA; on the CPU). Its reasons
# come before, as warnings ("Mem efficient attention requires last dimension of inputs to be
# divisible by 8...") between generic ones ("... not used because:", "... has been runtime disabled").
NOT_AVAILABLE = ("No available kernel", "No viable backend")
GENERIC = ("not used because", "has been runtime disabled")
CHECKED: collections.Counter = collections.Counter()  # (target label, kernel) -> examples compared
REFUSED: dict[tuple[str, str], set[str]] = collections.defaultdict(set)  # -> torch's reasons


@contextlib.contextmanager
def watch_examples(target, kernel: str):
    """Around one run of the property: skip it, with torch's reasons, if the kernel ran none of its
    examples (a pass would claim a kernel that was never compared)."""
    key = (target.label, kernel)
    CHECKED[key], REFUSED[key] = 0, set()
    yield
    if CHECKED[key] == 0:
        pytest.skip(f"{target.label}: the {kernel} kernel ran none of the examples; torch refused each: "
                    + "; ".join(sorted(REFUSED[key]))[:400])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.devices("cuda")
@shared_examples
@with_examples(covering_cases())
@given(case=cases())
def test_each_sdpa_kernel_matches_the_oracle(target, kernel, case):
    assert backends.kind(target.backend) == "torch" and target.device in DEVICES, f"{target.label}: not a CUDA target"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assume(in_domain(target.dtype, case.scale))
    if case.config.masked_scores == "added" and "masked_scores" not in inert_switches(case.config):
        event("added scores take the explicit path, not the kernel: not counted")
        return  # impl_torch's attention never reaches the kernel there (MultiHeadAttention.fused)
    expected = runner.oracle(case)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([getattr(SDPBackend, kernel)]):
                got = runner.run(target, case, return_attention=False)
        except RuntimeError as exc:
            if not any(text in str(exc) for text in NOT_AVAILABLE):
                raise
            refusal = str(exc).splitlines()[0][:200]
        else:
            refusal = None
    if refusal is not None:
        why = [str(w.message).split(" (Triggered internally")[0] for w in said]
        why = [w for w in dict.fromkeys(why) if w and not any(g in w for g in GENERIC)]
        reason = " / ".join(why[:2])[:300] or refusal
        REFUSED[(target.label, kernel)].add(reason)
        event(f"{kernel} refused an example: {reason}")
        return  # nothing compared: not counted as conforming
    for w in said:  # a call the kernel ran: its warnings go on to pytest, as without the capture
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    CHECKED[(target.label, kernel)] += 1
    names = [n for n in forward_order(case.config) if not n.endswith((".self", ".cross"))]
    assert_tensors_close(got, expected, target, case.config, what=f" (fast path, {kernel} kernel)", names=names)
