"""ModelSet: loading and validating a bundle's contents, and the decision procedure."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.domain import ACTIONS, Action, Context, PageType, Source
from weights import mlp
from weights.bundle import Bundle, BundleError, npy_bytes, read_bundle
from weights.embedded import DEFAULT_MODEL_VERSION
from weights.golden import golden_error
from weights.model_set import LoadOptions, ModelSet, NoModel, load_file

A, V, C, S, X = ACTIONS
STATIC = np.array([1.0, 1.0, 0.8, 0.5, 0.0])
SEARCH = Context(PageType.SEARCH, cart_item_count=0, hour=14, n_recent_behaviors=1)
SEARCH_FULL_CART = Context(PageType.SEARCH, cart_item_count=3, hour=14, n_recent_behaviors=1)
LOGITS = np.array([0.8, 1.6, 0.2, -0.6, 2.5], dtype=np.float32)
PERMISSIVE = np.full(5, 0.9, dtype=np.float32)


VETO_AT = 0.2
"""The guard threshold the decision tests run under (the default bundle ships no veto: its guard does not earn one)."""


@pytest.fixture(scope="module")
def model(default_bundle: Bundle) -> ModelSet:
    return ModelSet.load(default_bundle, LoadOptions(device="cpu", warmup_batch=4, guard_threshold=VETO_AT))


def load_reason(data: bytes, options: LoadOptions | None = None) -> str:
    with pytest.raises(BundleError) as info:
        ModelSet.load(read_bundle(data), options or LoadOptions(device="cpu", warmup_batch=2))
    return info.value.reason


def masked_softmax(logits: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The guardrails by hand: p ∝ w · exp(logit)."""
    unnorm = np.array([w * math.exp(x) for x, w in zip(logits.tolist(), weights.tolist(), strict=True)])
    return unnorm / unnorm.sum()


# --- loading -----------------------------------------------------------------------------------


def test_default_bundle_loads_and_passes_its_golden_self_test(model: ModelSet, default_bundle: Bundle) -> None:
    model = ModelSet.load(default_bundle, LoadOptions(device="cpu", warmup_batch=4))
    assert model.ready is True
    assert model.version == DEFAULT_MODEL_VERSION
    assert model.encoder.spec.state_dim == 920
    decoder = model.decision.decoder
    assert (decoder.samples, decoder.min_votes, decoder.epsilon, decoder.temperature) == (10, 4, 0.1, 1.2)  # the trainer's ε
    assert model.decision.guard.threshold == default_bundle.manifest["guard"]["threshold"]  # chosen by the trainer on held-out data
    assert model.decision.guardrails.static.tolist() == STATIC.tolist()
    states = default_bundle.array("golden_states.npy")
    logits, allow = model.infer(states)
    expected = default_bundle.array("golden_outputs.npy")
    assert logits.shape == allow.shape == (len(states), 5)
    np.testing.assert_allclose(np.concatenate([logits, allow], axis=1), expected, atol=1e-4, rtol=0)
    assert ((allow > 0) & (allow < 1)).all()


def test_load_options_override_the_bundle(default_bundle: Bundle) -> None:
    m = ModelSet.load(default_bundle, LoadOptions(device="cpu", warmup_batch=1, samples=6, min_votes=2,
                                                  exploration_epsilon=0.0, guard_threshold=0.0))
    decoder = m.decision.decoder
    assert (decoder.samples, decoder.min_votes, decoder.epsilon, m.decision.guard.threshold) == (6, 2, 0.0, 0.0)


def test_nan_in_the_behavior_table(rebuild: Any, default_bundle: Bundle) -> None:
    table = default_bundle.array("behavior_table.npy").copy()
    table[17, 3] = np.nan
    assert load_reason(rebuild(**{"behavior_table.npy": npy_bytes(table)})) == "nonfinite"
    table[17, 3] = np.inf
    assert load_reason(rebuild(**{"behavior_table.npy": npy_bytes(table)})) == "nonfinite"


@pytest.mark.parametrize(
    "table",
    [
        np.zeros((2048, 64), dtype=np.float32),
        np.zeros((1024, 128), dtype=np.float32),
        np.zeros((2048, 128), dtype=np.float64),
        np.zeros(2048 * 128, dtype=np.float32),
    ],
)
def test_behavior_table_of_the_wrong_shape_or_dtype(rebuild: Any, table: np.ndarray) -> None:
    assert load_reason(rebuild(**{"behavior_table.npy": npy_bytes(table)})) == "shape"


def test_golden_outputs_that_are_off(rebuild: Any, default_bundle: Bundle) -> None:
    golden = default_bundle.array("golden_outputs.npy").copy()
    golden[3, 7] += 2e-4  # twice the bundle's tolerance, on one guard output
    assert load_reason(rebuild(**{"golden_outputs.npy": npy_bytes(golden)})) == "golden"
    golden[3, 7] = np.nan
    assert load_reason(rebuild(**{"golden_outputs.npy": npy_bytes(golden)})) == "golden"


def test_golden_outputs_within_the_tolerance_still_load(rebuild: Any, default_bundle: Bundle) -> None:
    golden = default_bundle.array("golden_outputs.npy").copy()
    golden[0, 0] += 5e-5
    assert ModelSet.load(read_bundle(rebuild(**{"golden_outputs.npy": npy_bytes(golden)})),
                         LoadOptions(device="cpu", warmup_batch=1)).version == DEFAULT_MODEL_VERSION


def test_a_named_file_is_named_whether_it_cannot_be_read_or_cannot_be_loaded(rebuild: Any, default_bytes: bytes,
                                                                            default_bundle: Bundle, tmp_path: Path) -> None:
    """What `evaluate`, `simulate --bundle` and `train --init` report in one line (exit 2), not a traceback."""
    good, golden = tmp_path / "good.bundle", default_bundle.array("golden_outputs.npy").copy()
    good.write_bytes(default_bytes)
    assert load_file(good, LoadOptions(device="cpu", warmup_batch=1))[1].version == DEFAULT_MODEL_VERSION
    with pytest.raises(BundleError, match=f"^cannot read bundle {tmp_path / 'nosuch.bundle'}: No such file"):
        load_file(tmp_path / "nosuch.bundle")
    golden[3, 7] += 2e-4
    off = tmp_path / "off.bundle"
    off.write_bytes(rebuild(**{"golden_outputs.npy": npy_bytes(golden)}))  # a sound container, contents a server refuses
    with pytest.raises(BundleError, match=f"^invalid bundle {off} \\(golden\\): golden self-test failed") as info:
        load_file(off)
    assert info.value.reason == "golden"


def test_a_confident_policy_is_judged_relative_to_its_logits(rebuild: Any, default_bundle: Bundle) -> None:
    """Golden logits in the hundreds (a policy the trainer made confident) are compared relative to their size: float32
    rounding that two CPUs or torch and onnxruntime legitimately differ by passes, a real difference still fails."""
    model = ModelSet.load(default_bundle, LoadOptions(device="cpu", warmup_batch=1))
    states = default_bundle.array("golden_states.npy") * np.float32(3000.0)  # far outside any state: logits in the hundreds
    logits, allow = model.policy.run(states), model.guard_model.run(states)
    golden = np.concatenate([logits, allow], axis=1).astype(np.float32)
    i, j = np.unravel_index(np.argmax(np.abs(logits)), logits.shape)
    assert abs(golden[i, j]) > 50.0, golden[i, j]  # large enough that 5e-6 of it is more than the absolute 1e-4
    near, off = golden.copy(), golden.copy()
    near[i, j] *= 1.0 + 5e-6  # rounding-sized: within 1e-4 relative, beyond 1e-4 absolute
    off[i, j] *= 1.0 + 5e-4  # five times the tolerance, relative
    parts = {"golden_states.npy": npy_bytes(states)}
    assert ModelSet.load(read_bundle(rebuild(**parts, **{"golden_outputs.npy": npy_bytes(near)})),
                         LoadOptions(device="cpu", warmup_batch=1)).version == DEFAULT_MODEL_VERSION
    assert load_reason(rebuild(**parts, **{"golden_outputs.npy": npy_bytes(off)})) == "golden"


def test_golden_error_is_absolute_below_one_and_relative_above() -> None:
    expected = np.array([0.5, -0.2, 300.0, -250.0])
    assert golden_error(expected + np.array([1e-4, 0, 0, 0]), expected) == pytest.approx(1e-4)  # |expected| < 1: absolute
    assert golden_error(expected + np.array([0, 0, 0.03, 0]), expected) == pytest.approx(1e-4)  # 0.03 of 300
    assert golden_error(expected + np.array([0, 0, 0, -0.05]), expected) == pytest.approx(2e-4)  # 0.05 of 250
    assert math.isnan(golden_error(np.array([np.nan, 0, 0, 0]), expected))  # NaN never passes a bound
    assert golden_error(np.zeros((0, 10)), np.zeros((0, 10))) == 0.0


@pytest.mark.parametrize(
    "parts",
    [
        {"golden_outputs.npy": np.zeros((8, 5), dtype=np.float32)},
        {"golden_states.npy": np.zeros((8, 900), dtype=np.float32)},
        {"golden_states.npy": np.zeros((8, 920), dtype=np.float64)},
        {"golden_states.npy": np.zeros((0, 920), dtype=np.float32), "golden_outputs.npy": np.zeros((0, 10), dtype=np.float32)},
    ],
    ids=["outputs-too-narrow", "states-too-narrow", "states-float64", "both-empty"],
)
def test_golden_data_of_the_wrong_shape(rebuild: Any, parts: dict[str, np.ndarray]) -> None:
    """Refused as shape, naming the part at fault; with no golden rows at all (an empty comparison has error 0) the
    self-test would pass for any graph, so empty states are refused too."""
    with pytest.raises(BundleError) as info:
        ModelSet.load(read_bundle(rebuild(**{name: npy_bytes(a) for name, a in parts.items()})), LoadOptions(warmup_batch=2))
    at_fault = "golden_states.npy" if "golden_states.npy" in parts else "golden_outputs.npy"  # the states first where both are
    assert info.value.reason == "shape" and str(info.value).startswith(at_fault)


def _with(manifest: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(manifest)
    *head, last = path.split(".")
    node = out
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is ...:
        del node[last]
    else:
        node[last] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("fallback_rules.1.actions", ["apply_coupon", "teleport"], r"fallback_rules\[1\] \(full_cart_coupon\)\.actions: unknown action"),
        ("fallback_rules.3.actions", ["view_detail"], r"default rule \(default\) must list every permitted action"),
        ("fallback_rules.0.when", {"page_type": ["basket"]}, r"fallback_rules\[0\] \(cart_page_coupon\)\.when\.page_type"),
        ("guardrails.rules.0.multiplier", -0.3, r"guardrails\.rules\[0\]\.multiplier \(full_cart_damp_add\)"),
        ("guardrails.static.exit", "none", r"guardrails\.static\.exit"),
        ("actions", ["view_detail", "add_to_cart", "apply_coupon", "share_social", "exit"], r"actions: expected"),
        ("feature_spec.item_dim", 0, r"feature_spec\.item_dim"),
        ("feature_spec.behavior_window", 100_000, r"feature_spec\.behavior_window: expected at most 64"),  # 2.7 GB served
        ("guard.threshold", 1.5, r"guard threshold: expected 0\.\.1"),
        ("guard.threshold", "0.2", r"guard\.threshold must be a finite number"),
        ("decoder.min_votes", 11, r"min_votes: expected 1\.\.10"),
        ("decoder.exploration_epsilon", 2.0, r"exploration_epsilon"),
        ("decoder.samples", ..., r"decoder\.samples must be an integer in 1\.\.16"),
        ("decoder.samples", 10.5, r"decoder\.samples must be an integer in 1\.\.16"),
        ("decoder.samples", 1000, r"decoder\.samples must be an integer in 1\.\.16"),
        ("golden.tolerance", float("nan"), r"golden\.tolerance must be a finite number"),
        ("fallback_rules", ..., r"missing 'fallback_rules'"),
    ],
)
def test_bad_manifest_contents_are_schema_errors(rebuild: Any, manifest: dict[str, Any], path: str, value: Any,
                                                 message: str) -> None:
    with pytest.raises(BundleError, match=message) as info:
        ModelSet.load(read_bundle(rebuild(manifest=_with(manifest, path, value))), LoadOptions(device="cpu"))
    assert info.value.reason == "schema"


def test_guardrail_rules_that_are_not_a_list_are_a_schema_error(rebuild: Any, manifest: dict[str, Any]) -> None:
    """``"rules": null`` in a bundle must be refused as a BundleError; any other exception stops the server."""
    assert load_reason(rebuild(manifest=_with(manifest, "guardrails.rules", None))) == "schema"


def test_npz_behavior_table_is_refused_as_a_bundle_error(rebuild: Any, default_bundle: Bundle) -> None:
    buf = io.BytesIO()
    np.savez(buf, table=default_bundle.array("behavior_table.npy"))
    assert load_reason(rebuild(**{"behavior_table.npy": buf.getvalue()})) == "format"


def test_object_array_table_is_refused_as_format(rebuild: Any) -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    assert load_reason(rebuild(**{"behavior_table.npy": buf.getvalue()})) == "format"


def test_graph_whose_input_does_not_match_the_feature_spec(rebuild: Any) -> None:
    params = mlp.init_params(np.random.default_rng(1), [900, 16, 16, 5])
    assert load_reason(rebuild(**{"policy.onnx": mlp.policy_onnx(params)})) == "shape"
    guard = mlp.init_params(np.random.default_rng(2), [900 + 5, 8, 8, 1])
    assert load_reason(rebuild(**{"guard.onnx": mlp.guard_onnx(guard, 900)})) == "shape"


def test_graph_with_the_wrong_number_of_actions(rebuild: Any) -> None:
    params = mlp.init_params(np.random.default_rng(3), [920, 16, 16, 4])
    assert load_reason(rebuild(**{"policy.onnx": mlp.policy_onnx(params)})) == "shape"


def test_onnx_part_that_is_garbage(rebuild: Any) -> None:
    assert load_reason(rebuild(**{"policy.onnx": b"\x08\x07garbage that is not a model"})) == "onnx"
    assert load_reason(rebuild(**{"guard.onnx": b""})) == "onnx"


def test_nan_in_the_policy_weights(rebuild: Any) -> None:
    params = mlp.init_params(np.random.default_rng(4), [920, 128, 128, 5])
    params["w2"][5, 9] = np.nan
    assert load_reason(rebuild(**{"policy.onnx": mlp.policy_onnx(params)})) == "nonfinite"


def test_other_valid_weights_fail_the_golden_test(rebuild: Any) -> None:
    params = mlp.init_params(np.random.default_rng(5), [920, 128, 128, 5])
    assert load_reason(rebuild(**{"policy.onnx": mlp.policy_onnx(params)})) == "golden"


# --- decide ------------------------------------------------------------------------------------


def test_served_probs_are_the_exact_procedure(model: ModelSet) -> None:
    d = model.decision.decide(SEARCH, LOGITS, PERMISSIVE, "exact-1")
    p = masked_softmax(LOGITS, STATIC)
    np.testing.assert_allclose(d.policy_probs, p, rtol=1e-12, atol=0)
    # nothing vetoed: q = p; the fallback for a search page is the default rule's first action
    np.testing.assert_allclose(d.served_probs, model.decision.decoder.served_distribution(p, V.index), rtol=1e-12, atol=1e-15)
    assert d.served_probs.sum() == pytest.approx(1.0, abs=1e-12)
    assert d.served_probs[X.index] == 0.0
    assert d.propensity == d.served_probs[d.action.index]
    assert d.blocked.tolist() == [False, False, False, False, True]
    assert d.samples == 10 and d.model_version == DEFAULT_MODEL_VERSION
    np.testing.assert_allclose(d.allow_probs, PERMISSIVE.astype(np.float64))


def test_vetoed_actions_are_blocked_and_never_served(model: ModelSet) -> None:
    allow = np.array([0.9, 0.1, 0.9, 0.9, 0.9], dtype=np.float32)  # view_detail below the 0.2 threshold
    p = masked_softmax(LOGITS, STATIC)
    q = np.where([True, False, True, True, False], p, 0.0)
    q /= q.sum()
    served = set()
    for i in range(300):
        d = model.decision.decide(SEARCH, LOGITS, allow, f"veto-{i}")
        assert d.blocked.tolist() == [False, True, False, False, True]
        assert d.action not in (V, X)
        assert d.served_probs[V.index] == 0.0 and d.served_probs[X.index] == 0.0
        assert d.propensity == d.served_probs[d.action.index] > 0
        if d.source is Source.FALLBACK_LOW_CONSENSUS:
            assert (d.action, d.rule) == (A, "default")  # view is vetoed, so the default rule's next action
        served.add(d.action)
    np.testing.assert_allclose(d.served_probs, model.decision.decoder.served_distribution(q, A.index), rtol=1e-12, atol=1e-15)
    assert served >= {A, C}


def test_all_vetoed_falls_back_to_the_least_risky_permitted_action(model: ModelSet) -> None:
    allow = np.array([0.1, 0.15, 0.05, 0.19, 0.99], dtype=np.float32)  # exit is "safest" but banned
    d = model.decision.decide(SEARCH, LOGITS, allow, "all-vetoed")
    assert d.source is Source.FALLBACK_GUARD
    assert (d.action, d.rule) == (S, "default:least_risky")
    assert d.propensity == 1.0
    assert d.served_probs.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert d.blocked.all()
    assert d.votes == 0


def test_allowed_actions_whose_probability_underflows_fall_back_to_the_rules(model: ModelSet) -> None:
    logits = np.array([0.0, 0.0, 0.0, -2000.0, 0.0], dtype=np.float32)
    allow = np.array([0.1, 0.1, 0.1, 0.9, 0.9], dtype=np.float32)  # only share_social is allowed
    d = model.decision.decide(SEARCH, logits, allow, "underflow")
    assert (d.action, d.source, d.propensity) == (S, Source.FALLBACK_GUARD, 1.0)


def test_full_cart_damps_add_to_cart_by_exactly_the_rule_factor(model: ModelSet) -> None:
    empty = model.decision.decide(SEARCH, LOGITS, PERMISSIVE, "cart").policy_probs
    full = model.decision.decide(SEARCH_FULL_CART, LOGITS, PERMISSIVE, "cart").policy_probs
    assert (full[A.index] / full[V.index]) / (empty[A.index] / empty[V.index]) == pytest.approx(0.3, rel=1e-12)
    for other in (C, S):
        assert full[other.index] / full[V.index] == pytest.approx(empty[other.index] / empty[V.index], rel=1e-12)
    assert full[A.index] < empty[A.index]
    np.testing.assert_allclose(full, masked_softmax(LOGITS, np.array([0.3, 1.0, 0.8, 0.5, 0.0])), rtol=1e-12)


def test_decide_replays_for_a_decision_id(model: ModelSet) -> None:
    def key(i: int) -> tuple[Any, ...]:
        d = model.decision.decide(SEARCH, LOGITS, PERMISSIVE, f"replay-{i}")
        return d.action, d.source, d.votes, d.counts, d.propensity, d.rule

    first = [key(i) for i in range(40)]
    assert first == [key(i) for i in range(40)]
    assert len({k[3] for k in first}) > 5  # different ids draw differently


def test_decisions_follow_served_probs_and_sources_are_consistent(model: ModelSet) -> None:
    logits = np.zeros(5, dtype=np.float32)  # q ∝ static weights: low consensus is common
    n = 10_000
    freq = np.zeros(5)
    sources: dict[Source, int] = {}
    served = None
    for i in range(n):
        d = model.decision.decide(SEARCH, logits, PERMISSIVE, f"mix-{i}")
        served = d.served_probs
        freq[d.action.index] += 1
        sources[d.source] = sources.get(d.source, 0) + 1
        if d.source is Source.POLICY:
            assert d.votes == d.counts[d.action.index] == max(d.counts) >= 4 and sum(d.counts) == 10
        elif d.source is Source.FALLBACK_LOW_CONSENSUS:
            assert max(d.counts) < 4 and sum(d.counts) == 10 and (d.action, d.rule, d.votes) == (V, "default", 0)
        else:
            assert d.source is Source.EXPLORATION and d.votes == 0 and sum(d.counts) == 0
    assert served is not None
    assert set(sources) == {Source.POLICY, Source.FALLBACK_LOW_CONSENSUS, Source.EXPLORATION}
    p = served
    assert (np.abs(freq / n - p) <= 5 * np.sqrt(p * (1 - p) / n)).all(), (freq / n, p)
    eps = model.decision.decoder.epsilon
    assert abs(sources[Source.EXPLORATION] / n - eps) <= 5 * math.sqrt(eps * (1 - eps) / n)


def test_epsilon_override_turns_exploration_off(default_bundle: Bundle) -> None:
    m = ModelSet.load(default_bundle, LoadOptions(device="cpu", warmup_batch=1, exploration_epsilon=0.0))
    logits = np.zeros(5, dtype=np.float32)
    sources = {m.decision.decide(SEARCH, logits, PERMISSIVE, f"eps-{i}").source for i in range(1000)}
    assert Source.EXPLORATION not in sources
    d = m.decision.decide(SEARCH, logits, PERMISSIVE, "eps")
    p = masked_softmax(logits, STATIC)
    np.testing.assert_allclose(d.served_probs, m.decision.decoder.served_distribution(p, V.index), rtol=1e-12, atol=1e-15)
    assert m.decision.decoder.epsilon == 0.0


def test_guard_threshold_override(default_bundle: Bundle) -> None:
    strict = ModelSet.load(default_bundle, LoadOptions(device="cpu", warmup_batch=1, guard_threshold=0.95))
    d = strict.decision.decide(SEARCH, LOGITS, PERMISSIVE, "strict")
    assert d.source is Source.FALLBACK_GUARD and d.propensity == 1.0 and d.rule == "default:least_risky"
    lax = ModelSet.load(default_bundle, LoadOptions(device="cpu", warmup_batch=1, guard_threshold=0.0))
    d = lax.decision.decide(SEARCH, LOGITS, np.full(5, 0.01, dtype=np.float32), "lax")
    assert d.blocked.tolist() == [False, False, False, False, True]
    assert d.source is not Source.FALLBACK_GUARD


# --- fallbacks without model outputs -----------------------------------------------------------


def test_model_fallback_answers_from_the_rules(model: ModelSet) -> None:
    d = model.fallback(Context(PageType.CART, 0, 12, 0), Source.FALLBACK_DEGRADED)
    assert (d.action, d.source, d.rule, d.propensity) == (C, Source.FALLBACK_DEGRADED, "cart_page_coupon", 1.0)
    assert d.served_probs.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert d.blocked.tolist() == [False, False, False, False, True]


def test_no_model_answers_from_the_rules(default_bundle: Bundle) -> None:
    none = NoModel(default_bundle.manifest)
    assert none.ready is False and none.version == ""
    d = none.fallback(Context(PageType.DETAIL, 0, 12, 0), Source.FALLBACK_NO_MODEL)
    assert (d.action, d.source, d.rule, d.propensity) == (A, Source.FALLBACK_NO_MODEL, "detail_page_add", 1.0)
    assert d.model_version == ""
    d = none.fallback(Context(PageType.DETAIL, 3, 12, 0), Source.FALLBACK_NO_MODEL)
    assert (d.action, d.rule) == (C, "full_cart_coupon")
    assert isinstance(d.action, Action)
    assert none.item_dim == 768  # requests are still validated against the default feature spec


def test_guardrails_that_ban_everything_for_a_request_are_named_in_the_fallback(default_bundle: Bundle) -> None:
    """A bundle may permit one action and damp it to 0 for some requests; the rule engine then serves its default
    rule's first action and says so (``default:all_banned``), not a permitted action it does not have."""
    manifest = copy.deepcopy(default_bundle.manifest)
    manifest["guardrails"] = {"static": {"add_to_cart": 1.0, "view_detail": 0.0, "apply_coupon": 0.0, "share_social": 0.0,
                                         "exit": 0.0},
                              "rules": [{"name": "full_cart_no_add", "when": {"cart_item_count_min": 3},
                                         "action": "add_to_cart", "multiplier": 0.0}]}
    none = NoModel(manifest)
    d = none.fallback(Context(PageType.SEARCH, 3, 12, 0), Source.FALLBACK_NO_MODEL)
    assert (d.action, d.rule, d.guardrail_hits) == (V, "default:all_banned", ("full_cart_no_add",))
    assert d.blocked.tolist() == [True] * 5
    d = none.fallback(Context(PageType.SEARCH, 0, 12, 0), Source.FALLBACK_NO_MODEL)
    assert (d.action, d.rule) == (A, "default")  # otherwise the default rule's one permitted action


def test_a_decision_is_the_same_alone_or_in_a_batch() -> None:
    """Replay: the same decision id and inputs give the same decision whatever batch it ran in."""
    from core.domain import Context, DecisionRequest, PageType
    from weights.embedded import default_bundle as embedded

    model = ModelSet.load(embedded())
    rng = np.random.default_rng(3)
    requests = [DecisionRequest("u", "s", "i", (rng.standard_normal(768) / 28).astype(np.float32), ("a", "b")[: i % 3],
                                PageType(i % 5), 0.0, i % 6) for i in range(24)]
    contexts = [Context(r.page_type, r.cart_item_count, (5 * i) % 24, len(r.recent_behavior_ids)) for i, r in enumerate(requests)]
    ids = [f"decision-{i}" for i in range(24)]
    batched = model.run(requests, contexts, ids)
    for i, b in enumerate(batched):
        (alone,) = model.run([requests[i]], [contexts[i]], [ids[i]])
        assert (alone.action, alone.source, alone.votes, alone.rule, alone.counts) == (b.action, b.source, b.votes, b.rule, b.counts)
        assert np.allclose(alone.served_probs, b.served_probs, rtol=0, atol=1e-12)
        assert alone.propensity == pytest.approx(b.propensity, abs=1e-12)


def _state_first(graph_bytes: bytes, make_nodes: Any) -> bytes:
    """``graph_bytes`` with the nodes ``make_nodes(input name)`` returns between its input and its first node."""
    import onnx

    model = onnx.load_model_from_string(graph_bytes)
    state = model.graph.input[0].name
    nodes, initializers, out = make_nodes(state)
    for node in model.graph.node:
        node.input[:] = [out if name == state else name for name in node.input]
    model.graph.initializer.extend(initializers)
    for i, node in enumerate(nodes):
        model.graph.node.insert(i, node)
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def _golden_for(default_bundle: Bundle, policy: bytes, states: np.ndarray) -> dict[str, bytes]:
    """The parts of a bundle whose golden states are ``states`` and whose golden outputs are its own graphs' on them."""
    import onnxruntime as ort

    def run(graph: bytes) -> np.ndarray:
        session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
        return session.run(None, {session.get_inputs()[0].name: states})[0]  # type: ignore[no-any-return]

    outputs = np.concatenate([run(policy), run(default_bundle.parts["guard.onnx"])], axis=1).astype(np.float32)
    assert np.isfinite(outputs).all()
    return {"policy.onnx": policy, "golden_states.npy": npy_bytes(states), "golden_outputs.npy": npy_bytes(outputs)}


def test_a_graph_that_passes_its_own_golden_states_but_not_real_requests_is_refused(rebuild: Any,
                                                                                    default_bundle: Bundle) -> None:
    """An attack review (2026-12-06) had both swapped in: every call then degraded, each batch rerun one by one."""
    from onnx import helper, numpy_helper

    golden = default_bundle.array("golden_states.npy")
    # a Sqrt of the state: finite on non-negative golden states, NaN on any embedding with a negative value
    sqrt = _state_first(default_bundle.parts["policy.onnx"],
                        lambda s: ([helper.make_node("Sqrt", [s], ["rooted"])], [], "rooted"))
    data = rebuild(**_golden_for(default_bundle, sqrt, np.abs(golden).astype(np.float32)))
    with pytest.raises(BundleError, match="random requests") as info:
        ModelSet.load(read_bundle(data), LoadOptions(device="cpu", warmup_batch=2))
    assert info.value.reason == "nonfinite"
    # a fixed Reshape to the golden set's rows: runs on that batch alone
    rows = len(golden)
    fixed = _state_first(default_bundle.parts["policy.onnx"], lambda s: (
        [helper.make_node("Reshape", [s, "fixed_shape"], ["reshaped"])],
        [numpy_helper.from_array(np.array([rows, golden.shape[1]], dtype=np.int64), "fixed_shape")], "reshaped"))
    data = rebuild(**_golden_for(default_bundle, fixed, golden))
    assert load_reason(data, LoadOptions(device="cpu", warmup_batch=rows)) == "shape"
