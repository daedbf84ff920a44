"""The device search (conformance/core/generation/device.py, run by every backend's `generate`) against
the reference search (conformance/core/generation/search.py), on synthetic logits: the same ids and scores
in float64 for every setting, ties included.

The logits are a fixed table read at a hash of each row's prefix (and its source row), so both
searches see the same logits for the same prefix whatever order they ask in. Integer-valued
tables make exact ties everywhere (the rule: the lower index first); continuous ones do not.
The models' own searches are compared with the reference in the suite (conformance/suite,
test_generate) and in tests/generation/test_generate.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from thorough import thorough_only

from conformance.core.generation import device as device_search
from conformance.core.generation.search import search, uniforms
from conformance.core.generation.device import NumpyOps, Rules
from conformance.core.errors import InputError

VOCAB, ROWS, BOS, EOS, PAD = 7, 3, 1, 2, 0
SETTINGS = [dict(num_beams=beams, length_penalty=alpha, early_stopping=early, length_penalty_form=form,
                 forced_eos=forced, banned_ids=banned)
            for beams, alpha, early, form, forced, banned in itertools.product(
                (1, 2, 3), (1.0, 0.0, -0.5, 2.0), (False, True, "never"), ("hf", "gnmt"), (False, True),
                ((), (4,)))
            if beams > 1 or early is False]


def table(kind: str, seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "ties":
        return rng.integers(-2, 2, size=(101, vocab)).astype(np.float64)  # exact ties everywhere
    return rng.normal(size=(101, vocab)) * 3.0


def logits_of(tokens: np.ndarray, beams: int, values: np.ndarray) -> np.ndarray:
    """(N, V): the table at a hash of each row's prefix and source row (N = B x beams)."""
    n, t = tokens.shape
    weights = np.array([31, 17, 13, 11, 7, 5, 3, 2] * 4)[:t]
    source = np.arange(n) // beams
    return values[(tokens @ weights + 29 * source + 3 * t) % len(values)]


# Flax's beam rule: no early_stopping (refused), every beam count (one beam is a beam search too).
FLAX_SETTINGS = [dict(num_beams=beams, length_penalty=alpha, length_penalty_form=form, forced_eos=forced,
                      banned_ids=banned, beam_rule="flax")
                 for beams, alpha, form, forced, banned in itertools.product(
                     (1, 2, 3), (1.0, 0.0, -0.5, 0.6), ("gnmt", "hf"), (False, True), ((), (4,)))]
# Sampling: each warper off and on (top_k above the vocabulary keeps every id), 1-2 samples per row.
SAMPLE_SETTINGS = [dict(num_beams=1, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        num_return_sequences=returned, forced_eos=forced, banned_ids=banned)
                   for (temperature, top_k, top_p), seed, returned, forced, banned in itertools.product(
                       ((1.0, 0, 1.0), (0.5, 3, 1.0), (2.0, 0, 0.5), (1.0, 2, 0.9), (0.7, 9, 0.6), (1.5, 1, 0.3)),
                       (0, 7), (1, 2), (False, True), ((), (4,)))]


def rows_per_source(settings) -> int:
    return settings["num_return_sequences"] if settings.get("do_sample") else settings["num_beams"]


def reference(settings, values, max_len):
    per = rows_per_source(settings)
    return search(lambda tokens, parents: logits_of(tokens, per, values), ROWS, max_len, BOS, EOS, PAD, **settings)


def device(ops, settings, values, max_len, to_numpy=np.asarray, from_numpy=np.asarray, banned_mask=None, read=None,
           scores=True):
    per = rows_per_source(settings)
    rules = Rules(max_len=max_len, num_beams=settings["num_beams"], early_stopping=settings.get("early_stopping", False),
                  form=settings.get("length_penalty_form", "hf"), forced_eos=settings["forced_eos"],
                  rule=settings.get("beam_rule", "hf"), do_sample=settings.get("do_sample", False))
    mask = np.zeros(values.shape[1], dtype=bool)  # the table's vocabulary
    mask[list(settings["banned_ids"])] = True
    dtype = from_numpy(np.zeros((), np.float64)).dtype
    returned = settings.get("num_return_sequences", 1)
    sampling = None
    if rules.do_sample:
        sampling = {"uniforms": from_numpy(uniforms(settings["seed"], max_len, ROWS * returned)),
                    **{name: settings[name] for name in ("temperature", "top_k", "top_p")}}

    def step(state, i):
        tokens = to_numpy(device_search.prefix(ops, rules, state, i))
        return from_numpy(logits_of(tokens, per, values))

    read = read or (lambda *arrays: [to_numpy(a).item() for a in arrays])
    ids, found = device_search.run(ops, rules, step, ROWS, BOS, EOS, PAD, from_numpy(mask),
                                   settings.get("length_penalty", 1.0), dtype, read, returned, sampling, scores)
    return to_numpy(ids), None if found is None else to_numpy(found)


def same(got, expected, settings):
    (ids, scores), (ref_ids, ref_scores) = got, expected
    assert ids.shape == ref_ids.shape and (ids == ref_ids).all(), (settings, ids, ref_ids)
    # the same formulas; torch's exp, log and pow may round the last bit differently from NumPy's
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-14, atol=0, err_msg=str(settings))


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_numpy_device_search_equals_the_reference(kind):
    values = table(kind)
    for settings in SETTINGS:
        same(device(NumpyOps(), settings, values, 6), reference(settings, values, 6), settings)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_torch_device_search_equals_the_reference(kind):
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    values = table(kind)
    for settings in SETTINGS:
        got = device(Ops("cpu"), settings, values, 6, to_numpy=lambda a: a.cpu().numpy(),
                     from_numpy=lambda a: torch.as_tensor(a))
        same(got, reference(settings, values, 6), settings)


def test_torch_top_k_keeps_the_lower_index_among_ties():
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0], [-1e9, -1e9, 5.0, -1e9, -np.inf, -1e9]], dtype=torch.float64)
    values, index = Ops("cpu").top_k(x, 3)
    assert index.tolist() == [[1, 2, 4], [2, 0, 1]]
    assert values.tolist() == [[3.0, 3.0, 3.0], [5.0, -1e9, -1e9]]
    x = torch.tensor([[3.0] * 7 + [5.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    values, index = Ops("cpu").top_k(x, 2)
    assert index.tolist() == [[7, 0], [7, 6]]


@pytest.mark.parametrize("beams", [1, 3])
def test_nan_logits_of_an_open_row_are_refused_as_the_reference_does(beams):
    values = table("continuous").copy()
    values[values[:, 0] > 1.0] = np.nan
    settings = next(s for s in SETTINGS if s["num_beams"] == beams)
    with pytest.raises(InputError) as expected:
        reference(settings, values, 6)
    with pytest.raises(InputError) as got:
        device(NumpyOps(), settings, values, 6)
    assert str(got.value) == str(expected.value)
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    with pytest.raises(InputError) as got:
        device(Ops("cpu"), settings, values, 6, to_numpy=lambda a: a.cpu().numpy(), from_numpy=torch.as_tensor)
    assert str(got.value) == str(expected.value)


# Eager JAX dispatches op by op: the three eager-JAX device-search tests (test_device_search.py,
# test_generate_processors.py) took 73 CPU-seconds with both tables, 57 with the tie-heavy one,
# where the lower-index rule decides. Under `ci` that one only: the continuous table runs the same
# settings through the same ops, and the NumPy and torch adapters run both tables in CI.
JAX_KINDS = ["ties", pytest.param("continuous", marks=thorough_only(
    "eager JAX on the continuous table repeats the ties run's settings and ops"))]
# The eager-JAX device-search tests (these two, and tests/generation/test_generate_processors.py's) dispatch
# the same ops at the same shapes: on one xdist worker they share its compiled op programs
# (measured, collection left out: 44 CPU-s in three processes, 29 in one).
EAGER_JAX_SEARCH = pytest.mark.xdist_group("eager-jax-search")


@EAGER_JAX_SEARCH
@pytest.mark.parametrize("kind", JAX_KINDS)
def test_jax_device_search_equals_the_reference(kind):
    """The JAX adapter (lax.top_k, the functional column writes) run eagerly; the compiled
    while_loop around the same functions is compared through generate (tests/generation/test_generate.py,
    the suite)."""
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax
    from impl_jax.decode import Ops

    values = table(kind)
    with impl_jax.enable_x64():
        for settings in SETTINGS[::3]:  # eager JAX dispatches op by op: a third of the settings
            got = device(Ops(None), settings, values, 6, to_numpy=np.asarray, from_numpy=jnp.asarray)
            same(got, reference(settings, values, 6), settings)


@pytest.mark.parametrize("host_reads", [True, False], ids=["cpu-path", "branch-free"])
def test_torch_exact_top_k_is_the_stable_sorts_on_tie_heavy_rows(host_reads):
    """`Ops.top_k` against NumPy's stable argsort of -x (the reference's order), on rows of ties,
    -inf and NaN (a +inf logit's beam), short and long; `host_reads` False runs on the CPU the
    branch-free path a GPU takes."""
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    rng = np.random.default_rng(3)
    for m, k in ((50, 3), (400, 8), (9, 4), (300, 6)):
        x = rng.integers(-3, 3, size=(7, m)).astype(np.float64)
        x[0, :] = 1.0  # one value everywhere
        x[1, rng.random(m) < 0.5] = -np.inf
        x[2, rng.random(m) < 0.3] = np.nan
        x[3, :] = np.nan
        x[4, :] = -np.inf
        x[4, rng.choice(m, m // 3, replace=False)] = np.nan  # -inf and NaN only: the -inf first
        x[5, : k // 2] = 5.0  # fewer numbers than k, then NaN
        x[5, k // 2:] = np.nan
        ops = Ops("cpu")
        ops.host_reads = host_reads
        expected_index = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        values, index = ops.top_k(torch.as_tensor(x), k)
        assert (index.numpy() == expected_index).all(), (m, k, index, expected_index)
        np.testing.assert_array_equal(values.numpy(), np.take_along_axis(x, expected_index, axis=-1))


def test_torch_top_k_over_long_rows_orders_equal_scores_by_index_on_both_paths():
    """Rows longer than `sorted_top_k`: on the CPU a batch in which no score equal to the k-th best
    is left out takes torch's k best and orders them itself (equal scores inside the k best, lower
    index first); a batch where one row has such a tie takes the tie key. Both are the stable sort's."""
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    rng = np.random.default_rng(4)
    m, k = 700, 8
    inside = rng.permutation(np.linspace(-5.0, -1.0, m))  # distinct
    inside[rng.choice(m, 5, replace=False)] = 2.0  # five equal best, all inside the k best
    inside[rng.choice(np.flatnonzero(inside < 2.0), 2, replace=False)] = 1.5
    across = inside.copy()
    across[rng.choice(np.flatnonzero(inside < 1.5), 4, replace=False)] = 1.0  # equal to the 8th best, 9th and 10th too
    for rows in (np.stack([inside, inside[::-1]]), np.stack([inside, across])):
        expected = np.argsort(-rows, axis=-1, kind="stable")[:, :k]
        values, index = Ops("cpu").top_k(torch.as_tensor(rows), k)
        assert index.tolist() == expected.tolist()
        assert values.numpy().tolist() == np.take_along_axis(rows, expected, axis=-1).tolist()


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_torch_device_search_over_a_wide_vocabulary_equals_the_reference(kind):
    """Beam rows of 2-3 x 150 scores, past `sorted_top_k`: torch's CPU top-k over beams x V takes
    its host-read path (torch's k best, reordered) or the tie key, both held to the reference's
    order (the VOCAB 7 tables above never leave the short rows' single sort)."""
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    values = table(kind, seed=1, vocab=150)
    for n, settings in enumerate([s for s in SETTINGS if s["num_beams"] > 1][::5]):
        ops = Ops("cpu")
        ops.host_reads = n % 2 == 0  # every other search on the branch-free path a GPU takes
        got = device(ops, settings, values, 6, to_numpy=lambda a: a.cpu().numpy(), from_numpy=torch.as_tensor)
        same(got, reference(settings, values, 6), settings)


@pytest.mark.parametrize("vocab", [100, 200], ids=["short-rows", "long-rows"])
@pytest.mark.parametrize("backend", ["numpy", "torch", "torch-branch-free", "jax"])
def test_a_plus_inf_logit_searches_on_as_the_reference_does(backend, vocab, monkeypatch):
    """A +inf logit makes its beam's whole log-softmax NaN. That is not a NaN logit (nothing is
    refused): the reference ranks the NaN candidates last and searches on among the others. Beam
    rows of 2 x 100 scores (torch: one sort) and 2 x 200 (past `sorted_top_k`: torch's host-read
    path, or with "branch-free" the path a GPU takes); rows of finite scores run beside it."""
    import contextlib
    import importlib

    from conformance.core.config import ModelConfig
    from conformance.core.generation.settings import resolve

    framework = backend.split("-")[0]
    if framework != "numpy":
        pytest.importorskip(framework)
    module = importlib.import_module(f"impl_{framework}")
    if backend == "torch-branch-free":
        built = module.decode.Ops.__init__

        def branch_free(self, device):
            built(self, device)
            self.host_reads = False

        monkeypatch.setattr(module.decode.Ops, "__init__", branch_free)
    batch, beams, max_len = 2, 2, 5
    values = np.random.default_rng(3).normal(size=(max_len, batch * beams, vocab))
    values[1, 1, 7] = np.inf  # source 0's second beam at the second step
    config = ModelConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, max_len=max_len, pad_id=PAD)
    settings = resolve(config, max_len, BOS, EOS, return_scores=True, num_beams=beams)
    x64 = module.enable_x64() if framework == "jax" else contextlib.nullcontext()
    with x64, np.errstate(invalid="ignore"):  # the reference's own log-softmax of the +inf row
        expected_ids, expected_scores = search(lambda tokens, parents: values[tokens.shape[1] - 1], batch, max_len,
                                               BOS, EOS, PAD, num_beams=beams)
        ids, scores = module.decode.search_steps(lambda data, ids, i: data["values"][i], {"values": values}, batch,
                                                 vocab, PAD, settings, "float64")
    assert np.isfinite(expected_scores).all()
    assert np.asarray(ids).tolist() == expected_ids.tolist()
    np.testing.assert_allclose(np.asarray(scores), expected_scores, rtol=1e-14, atol=0)


def test_torch_argmax_and_ban_are_the_functional_ones():
    """`Ops.argmax` is the first of equal maxima; `Ops.ban` writes -inf into the step's own array
    only when told it is one (owned), for a (V,) mask (its columns) and an (N, V) mask alike."""
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    ops = Ops(torch.device("cpu"))
    x = torch.tensor([[0.0, 3.0, 1.0, 3.0], [-np.inf, -1.0, -1.0, -2.0]])
    assert ops.argmax(x).tolist() == [1, 1]
    for banned in (torch.tensor([True, False, False, True]), torch.tensor([[False, True, False, False]] * 2)):
        expected = torch.where(banned, -torch.inf, x)
        kept = x.clone()
        assert torch.equal(ops.ban(kept, banned, owned=False), expected) and torch.equal(kept, x)
        assert torch.equal(ops.ban(kept, banned, owned=True), expected) and torch.equal(kept, expected)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_num_return_sequences_are_the_references(kind):
    """Beam search's `returned` best hypotheses per row, best first (num_return_sequences)."""
    values = table(kind)
    for settings in [s for s in SETTINGS if s["num_beams"] == 3][::4]:
        for returned in (2, 3):
            expected = search(lambda tokens, parents: logits_of(tokens, 3, values), ROWS, 6, BOS, EOS, PAD,
                              num_return_sequences=returned, **settings)
            rules = Rules(max_len=6, num_beams=3, early_stopping=settings["early_stopping"],
                          form=settings["length_penalty_form"], forced_eos=settings["forced_eos"])
            mask = np.zeros(values.shape[1], dtype=bool)  # the table's vocabulary
            mask[list(settings["banned_ids"])] = True
            ops = NumpyOps()
            got = device_search.run(
                ops, rules, lambda state, i: logits_of(device_search.prefix(ops, rules, state, i), 3, values), ROWS,
                BOS, EOS, PAD, mask, settings["length_penalty"], np.float64, lambda *a: [x.item() for x in a],
                returned)
            same(got, expected, (settings, returned))


# -- Flax's beam rule and sampling ---------------------------------------------------------------


def test_the_flax_and_sampling_settings_reach_what_they_test():
    """The flax settings choose other ids than Hugging Face's rule on some rows (where the rules
    differ: an end ranked below the best beams, the length limit), rows end early and are padded,
    and the sampling settings draw other ids than greedy search."""
    values = table("continuous")
    differ = padded = 0
    for settings in FLAX_SETTINGS:
        if settings["num_beams"] == 1:
            continue
        ids, _ = reference(settings, values, 6)
        hf = dict(settings, beam_rule="hf")
        hf_ids, _ = reference(hf, values, 6)
        differ += ids.shape != hf_ids.shape or (ids != hf_ids).any()
        padded += ((ids[:, :-1] == EOS) & (ids[:, 1:] == PAD)).any()
    assert differ >= 4 and padded >= 4, (differ, padded)
    greedy, _ = reference(SETTINGS[0], values, 6)
    sampled = [reference(s, values, 6)[0] for s in SAMPLE_SETTINGS if s["num_return_sequences"] == 1][:8]
    assert any(s.shape != greedy.shape or (s != greedy).any() for s in sampled)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_numpy_device_search_equals_the_reference_flax_rule_and_sampling(kind):
    values = table(kind)
    for settings in FLAX_SETTINGS + SAMPLE_SETTINGS:
        same(device(NumpyOps(), settings, values, 6), reference(settings, values, 6), settings)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_torch_device_search_equals_the_reference_flax_rule_and_sampling(kind):
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    values = table(kind)
    for settings in FLAX_SETTINGS + SAMPLE_SETTINGS:
        got = device(Ops("cpu"), settings, values, 6, to_numpy=lambda a: a.cpu().numpy(),
                     from_numpy=lambda a: torch.as_tensor(a))
        same(got, reference(settings, values, 6), settings)


@EAGER_JAX_SEARCH
@pytest.mark.parametrize("kind", JAX_KINDS)
def test_jax_device_search_equals_the_reference_flax_rule_and_sampling(kind):
    """Eager JAX, with the warpers' settings as arrays (as the compiled search takes them): both
    filters computed, each kept where on."""
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax
    from impl_jax.decode import Ops

    values = table(kind)
    with impl_jax.enable_x64():
        for settings in FLAX_SETTINGS[::4] + SAMPLE_SETTINGS[::4]:
            data = {name: jnp.asarray(settings[name]) for name in ("temperature", "top_k", "top_p") if name in settings}
            got = device(Ops(None), {**settings, **data}, values, 6, to_numpy=np.asarray, from_numpy=jnp.asarray)
            same(got, reference(settings, values, 6), settings)


def test_without_scores_greedy_search_and_sampling_choose_the_same_ids():
    """scores=False (generate without return_scores) skips the log-softmax: the same ids, no scores."""
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    values = table("ties")
    for settings in [s for s in SETTINGS if s["num_beams"] == 1] + SAMPLE_SETTINGS[::3]:
        expected, _ = reference(settings, values, 6)
        ids, scores = device(NumpyOps(), settings, values, 6, scores=False)
        assert (ids == expected).all() and scores is None, settings
        ids, scores = device(Ops("cpu"), settings, values, 6, to_numpy=lambda a: a.cpu().numpy(),
                             from_numpy=lambda a: torch.as_tensor(a), scores=False)
        assert (ids == expected).all() and scores is None, settings


# -- Every backend's `search_steps` (the driver its `generate` runs, over any decoder's step) ------


def uniform_script():
    """A scripted decoder whose every step is the same over the real ids (the pad id peaked but
    banned): every finished hypothesis ties exactly with the others, so the ranking of the
    finished list and the stopping bounds decide on equal scores."""
    from conformance.suite.strategies.scripted import BATCH, MAX_LEN, VOCAB

    table = np.full((BATCH, MAX_LEN, VOCAB, VOCAB), -4.0)
    table[..., 0] = 0.0
    return table


def search_steps_of(backend: str):
    if backend == "numpy":
        from impl_numpy import decode
        return decode.search_steps, "cpu", np.asarray
    pytest.importorskip(backend)
    if backend == "torch":
        from impl_torch import decode
        return decode.search_steps, "cpu", lambda a: a.cpu().numpy()
    from impl_jax import decode
    return decode.search_steps, "cpu", np.asarray


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_search_steps_rank_equal_finished_scores_as_the_reference(backend):
    """Found by the suite's search-rule property (conformance/suite/test_search_rules.py): the
    compiled JAX search divided by the length penalty as XLA rewrites x / p for a scalar p,
    x * (1 / p), an ulp off the reference's quotient; where finished hypotheses tie exactly, it
    returned them in another order (and could stop at another step)."""
    import contextlib

    from conformance.core.config import ModelConfig
    from conformance.core.generation.settings import resolve
    from conformance.suite.strategies.scripted import BATCH, BOS, EOS, MAX_LEN, PAD, VOCAB, Script, scripted_step

    search_steps, device, to_numpy = search_steps_of(backend)
    table = uniform_script()
    config = ModelConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, max_len=MAX_LEN, pad_id=PAD)
    x64 = contextlib.nullcontext
    if backend == "jax":
        import impl_jax
        x64 = impl_jax.enable_x64
    for early in (False, True, "never"):
        for alpha in (1.0, 2.0, -0.5):
            options = dict(num_beams=3, early_stopping=early, length_penalty=alpha, num_return_sequences=3,
                           banned_ids=(PAD,))
            expected = search(lambda tokens, parents: Script(table, alpha).logits(tokens), BATCH, MAX_LEN, BOS, EOS,
                              PAD, **options)
            settings = resolve(config, MAX_LEN, BOS, EOS, return_scores=True, **options)
            data = {"table": table, "source": np.repeat(np.arange(BATCH), 3)}
            with x64():
                ids, scores = search_steps(scripted_step, data, BATCH, VOCAB, PAD, settings, "float64", device)
                got = to_numpy(ids), to_numpy(scores)
            same(got, expected, options)


def test_the_scripted_decoders_reach_what_they_test():
    """The suite's scripts (conformance/suite/strategies/scripted.py), in 25 drawn examples as under
    `ci`, give the reference's search exact ties and near-ties to decide, rows whose finished list
    fills up, searches that stop before max_len under each stopping rule, and endings at the first
    step and at the last, which a random model's steps rarely do."""
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hypothesis_settings

    from conformance.suite.strategies.scripted import BATCH, BOS, EOS, MAX_LEN, PAD, scripts

    seen = {"tie": 0, "near-tie": 0, "first step end": 0, "last step end": 0,
            **{f"early stop {early!r}": 0 for early in (False, True, "never")}}

    @hypothesis_settings(max_examples=25, derandomize=True, database=None, deadline=None,
                         suppress_health_check=list(HealthCheck))
    @given(script=scripts())
    def draw(script):
        for early in (False, True, "never"):
            trace = []
            ids, _ = search(lambda tokens, parents: script.logits(tokens), BATCH, MAX_LEN, BOS, EOS, PAD,
                            num_beams=3, early_stopping=early, length_penalty=script.length_penalty,
                            num_return_sequences=3, banned_ids=(PAD,), trace=trace)
            gaps = np.concatenate([record["gap"] for record in trace])
            seen["tie"] += (gaps == 0).any()
            seen["near-tie"] += ((gaps > 0) & (gaps < 1e-5)).any()
            seen[f"early stop {early!r}"] += len(trace) < MAX_LEN
            seen["first step end"] += (ids[:, 0] == EOS).any()
            seen["last step end"] += ids.shape[1] == MAX_LEN and (ids[:, -1] == EOS).any()

    draw()
    print(seen)
    assert all(count >= 2 for count in seen.values()), seen
