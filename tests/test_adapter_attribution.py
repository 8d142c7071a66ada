"""The merger's attribution check (issue 28, docs/runs.md "Attribution"): a rollout that expects an
adapter (RolloutEvent.adapter) trains only calls whose adapter spans say that adapter served every
response token of every choice; the others are refused (wrong_adapter, base_model, unattributed),
counted by reason and never trained. With no adapter expected nothing is checked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.common.records import AdapterSpan, RolloutEvent, Trace
from tether.merger.score import (
    MergerConfig,
    attribution_refusal,
    group_result,
    group_samples,
    merge_rollout,
    plan_group,
    trace_to_call,
)


def S(adapter: str, start: int, end: int, version: str = "1") -> AdapterSpan:
    return AdapterSpan(adapter, version if adapter else "", start, end)


def T(call_id: str, prompt, response, spans=(), rollout_id="r", **kw) -> Trace:
    return Trace(
        call_id,
        rollout_id,
        "chat.completions",
        {},
        "ok",
        list(prompt),
        list(response),
        [-0.5] * len(response),
        adapter_spans=list(spans),
        **kw,
    )


def E(rollout_id="r", reward=1.0, adapter="a") -> RolloutEvent:
    return RolloutEvent(rollout_id, "t", "g", 2, "completed", reward, adapter=adapter)


def test_a_call_served_by_the_expected_adapter_is_kept_whatever_its_versions():
    call, why = trace_to_call(T("c", [1], [2, 3, 4], [S("a", 0, 2, "3"), S("a", 2, 3, "4")]), "a")
    assert why is None and call is not None and call.response_token_ids == [2, 3, 4]


def test_each_way_of_not_being_served_by_the_adapter_has_its_reason():
    cases = {
        "wrong_adapter": [S("a", 0, 1), S("b", 1, 3)],
        "base_model": [S("a", 0, 1), S("", 1, 3)],
        "unattributed": [],
    }
    for reason, spans in cases.items():
        assert trace_to_call(T("c", [1], [2, 3, 4], spans), "a") == (None, reason)
    # Spans that leave a token out, or reach past the response, say nothing of it.
    assert trace_to_call(T("c", [1], [2, 3, 4], [S("a", 0, 2)]), "a") == (None, "unattributed")
    assert trace_to_call(T("c", [1], [2, 3, 4], [S("a", 0, 4)]), "a") == (None, "unattributed")
    # Another adapter outweighs the base model, which outweighs a gap.
    assert trace_to_call(T("c", [1], [2, 3, 4], [S("", 0, 1), S("b", 2, 3)]), "a") == (None, "wrong_adapter")


def test_errors_and_missing_ids_keep_their_own_reasons():
    assert trace_to_call(T("c", [1], [], [S("b", 0, 1)]), "a") == (None, "missing_token_ids")
    bad = T("c", [1], [2], [S("b", 0, 1)])
    bad.status = "error"
    assert trace_to_call(bad, "a") == (None, "error")


def test_no_adapter_expected_checks_nothing():
    for spans in ([], [S("b", 0, 1)], [S("", 0, 1)]):
        call, why = trace_to_call(T("c", [1], [2], spans))
        assert why is None and call is not None
        assert trace_to_call(T("c", [1], [2], spans), "") == (call, None)


def test_a_further_choice_served_by_another_adapter_condemns_its_call():
    ok = {"index": 1, "token_ids": [7, 8], "logprobs": [-0.1, -0.2]}
    good = [{**ok, "adapter_spans": [S("a", 0, 2).to_dict()]}]
    assert trace_to_call(T("c", [1], [2], [S("a", 0, 1)], extra_choices=good), "a")[1] is None
    for spans, reason in (
        ([S("b", 0, 2).to_dict()], "wrong_adapter"),
        ([S("", 0, 2).to_dict()], "base_model"),
        ([S("a", 0, 1).to_dict()], "unattributed"),
        ([], "unattributed"),
        ([{"adapter": "a"}], "unattributed"),  # does not decode
        ("a", "unattributed"),
    ):
        choices = [{**ok, "adapter_spans": spans}]
        trace = T("c", [1], [2], [S("a", 0, 1)], extra_choices=choices)
        assert trace_to_call(trace, "a") == (None, reason), spans
    no_spans = [dict(ok)]  # a choice written before adapters
    assert trace_to_call(T("c", [1], [2], [S("a", 0, 1)], extra_choices=no_spans), "a")[1] == "unattributed"


def _rollout(rid: str, reward: float, planted: Trace | None = None, adapter: str = "a"):
    """A two-call conversation served by "a", with ``planted`` between the calls (its own prompt)."""
    traces = [T(f"{rid}-c0", [1, 2], [3, 4], [S("a", 0, 2)], rollout_id=rid)]
    if planted is not None:
        traces.append(planted)
    traces.append(T(f"{rid}-c2", [1, 2, 3, 4, 5], [6], [S("a", 0, 1, "2")], rollout_id=rid))
    return merge_rollout(E(rid, reward, adapter), traces, MergerConfig())


def test_a_planted_call_is_refused_counted_and_never_trained_while_the_others_train():
    for spans, reason in (
        ([S("b", 0, 3)], "wrong_adapter"),
        ([S("", 0, 3)], "base_model"),
        ([], "unattributed"),
    ):
        planted = T("x-c1", [90, 91], [97, 98, 99], spans, rollout_id="x")
        x, y = _rollout("x", 1.0, planted), _rollout("y", 0.0)
        assert x.dropped_calls == {reason: 1} and y.dropped_calls == {}
        plan = plan_group("g", [x, y], "grpo")
        samples = group_samples(plan)
        assert plan.outcome == "trained" and {s.rollout_id for s in samples} == {"x", "y"}
        trained = [s for s in samples if s.rollout_id == "x"]
        assert [s.call_ids for s in trained] == [["x-c0", "x-c2"]]
        assert trained[0].token_ids == [1, 2, 3, 4, 5, 6] and trained[0].loss_mask == [0, 0, 1, 1, 0, 1]
        assert not any(t in s.token_ids for s in samples for t in (90, 97, 98, 99))
        assert group_result(plan, plan.outcome, samples, False, 0.0).dropped_calls == {reason: 1}


def test_without_an_adapter_expected_the_planted_call_trains_as_before():
    planted = T("x-c1", [90, 91], [97, 98, 99], [S("b", 0, 3)], rollout_id="x")
    checked_off = _rollout("x", 1.0, planted, adapter="")
    assert checked_off.dropped_calls == {}
    assert any(97 in s.token_ids for s in checked_off.sequences)
    # Byte for byte what a record without the field merges to.
    event = RolloutEvent.from_dict({k: v for k, v in E("x", 1.0, "").to_dict().items() if k != "adapter"})
    traces = [T("x-c0", [1, 2], [3, 4], [S("a", 0, 2)], rollout_id="x"), planted]
    assert (
        merge_rollout(event, traces, MergerConfig()).to_dict()
        == merge_rollout(E("x", 1.0, ""), traces, MergerConfig()).to_dict()
    )


# ---------------------------------------------------------------- property


def _oracle(spans: list[AdapterSpan], n: int, adapter: str) -> bool:
    """Kept iff every span is a real span of the response naming ``adapter`` and every token is in one."""
    if any(s.adapter != adapter or not 0 <= s.start < s.end <= n for s in spans):
        return False
    return all(any(s.start <= i < s.end for s in spans) for i in range(n))


@st.composite
def layouts(draw):
    """A response of n tokens and adapter spans over it: tilings cut at random points (the gateway's
    shape), with gaps, overlaps, spans out of range and other adapters or the base model mixed in."""
    n = draw(st.integers(1, 12))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
    bounds = [0, *cuts, n]
    names = st.sampled_from(["a", "a", "a", "b", ""])
    spans = [S(draw(names), a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    if draw(st.booleans()):
        spans = draw(st.permutations(spans))
    if spans and draw(st.integers(0, 3)) == 0:
        del spans[draw(st.integers(0, len(spans) - 1))]
    if draw(st.integers(0, 3)) == 0:
        a = draw(st.integers(-1, n + 1))
        spans.append(S(draw(names), a, draw(st.integers(a - 1, n + 2))))
    return n, spans


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_property_a_call_is_kept_iff_the_adapter_served_every_token(layout):
    n, spans = layout
    call, why = trace_to_call(T("c", [1], list(range(n)), spans), "a")
    assert (call is not None) == _oracle(spans, n, "a") == (attribution_refusal(spans, n, "a") is None)
    if why is not None:
        assert why == (
            "wrong_adapter"
            if any(s.adapter == "b" for s in spans)
            else "base_model"
            if any(s.adapter == "" for s in spans)
            else "unattributed"
        )
    # With no adapter expected every such call is kept.
    assert trace_to_call(T("c", [1], list(range(n)), spans))[1] is None
