"""The HTML of `tether ui`'s pages from the records the store read (pure). Every value from a record is
escaped (`_e`): a token's text, a task id or an error message may hold markup."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Sequence
from html import escape
from typing import Any
from urllib.parse import quote

from tether.cli.plots import learning_series
from tether.cli.web.store import first_advantage
from tether.cli.web.svg import line_chart
from tether.cli.web.tokens import token_kinds, version_at


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _num(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or value is None:
        return _e("" if value is None else value)
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else f"{value:.{digits}g}"
    return _e(value)


def _json(value: Any) -> str:
    return _e(json.dumps(value, sort_keys=True)) if value else ""


def page(title: str, body: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)} · tether ui</title>"
        '<link rel="stylesheet" href="/static/ui.css"><script src="/static/ui.js" defer></script>'
        '</head><body><nav><a href="/">runs</a></nav>'
        f"<h1>{_e(title)}</h1>{body}</body></html>"
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """A table whose cells are HTML already (escaped by the caller)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{_e(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _link(href: str, text: Any) -> str:
    return f'<a href="{_e(href)}">{_e(text)}</a>'


STEP_COLUMNS = (
    "reward_mean",
    "weight_version",
    "rollouts",
    "groups_trained",
    "groups_filtered",
    "samples",
    "tokens",
    "forks",
    "logprob_abs_diff",
    "step_seconds",
)


def runs_page(source: str, metrics: Sequence[dict], note: str = "") -> str:
    """The run: its reward curve, its learning-health curves (tether.cli.plots.learning_series, the
    panels of learning.png) and its steps, each linking to its step page."""
    steps = [m for m in metrics if "step" in m]
    xs = [int(m["step"]) for m in steps]
    reward = [m.get("reward_mean") for m in steps]
    rewards = [float(r) if isinstance(r, int | float) else math.nan for r in reward]
    charts = [line_chart("reward (step mean)", [("reward", xs, rewards)], 640, 240)]
    charts += [line_chart(title, series) for title, series in learning_series(list(metrics))]
    evals = [m["eval_reward"] for m in metrics if "eval_reward" in m]
    rows = [
        [_link(f"/step/{int(m['step'])}", m["step"]), *(_num(m.get(c)) for c in STEP_COLUMNS)] for m in steps
    ]
    body = (
        f'<p class="source">{_e(source)}</p>'
        + (f'<p class="note">{_e(note)}</p>' if note else "")
        + (f"<p>final evaluation reward: {_num(evals[-1])}</p>" if evals else "")
        + f'<div class="charts">{"".join(charts)}</div>'
        + f"<h2>steps ({len(steps)})</h2>"
        + table(["step", *STEP_COLUMNS], rows, "steps")
    )
    return page("run", body)


def _rollout_rows(
    events: Sequence[dict], outcomes: dict[str, dict], samples: Sequence[dict]
) -> list[list[str]]:
    rows = []
    for ev in events:
        rid = ev["rollout_id"]
        out = outcomes.get(rid, {})
        advantages = sorted(
            {a for s in samples if s["rollout_id"] == rid if (a := first_advantage(s)) is not None}
        )
        rows.append(
            [
                _link(f"/rollout/{quote(rid, safe='')}", rid),
                _e(ev.get("status", "")),
                _num(ev.get("reward")),
                _e(ev.get("attempt", 0)),
                _e(out.get("status", "pending")),
                _e(out.get("reason") or ""),
                _e(out.get("samples", "")),
                ", ".join(_num(a) for a in advantages),
            ]
        )
    return rows


def step_page(
    step: dict,
    groups: Sequence[dict],
    events: Sequence[dict],
    outcomes: dict[str, dict],
    samples: Sequence[dict],
    note: str = "",
) -> str:
    """A step: its record, and each of its groups (the merger's GroupResult: outcome, rewards, merge
    accounting) with its rollouts (RolloutEvent), what became of each (TrainingOutcome) and the
    advantage its samples got."""
    record = table(["field", "value"], [[_e(k), _num(v)] for k, v in step.items()], "record")
    parts = [f'<p class="note">{_e(note)}</p>' if note else "", "<details><summary>record</summary>", record]
    parts.append(f"</details><h2>groups ({len(groups)})</h2>")
    for g in groups:
        gid = g["group_id"]
        facts = [
            ("outcome", g.get("outcome")),
            ("estimator", g.get("estimator")),
            ("completed", f"{g.get('completed')}/{g.get('rollouts')}"),
            ("rewards", ", ".join(_num(r) for r in g.get("rewards", []))),
            ("samples", g.get("samples")),
            ("tokens", g.get("tokens")),
            ("forks", g.get("forks")),
            ("realigns", g.get("realigns")),
            ("mismatched calls", g.get("mismatched_calls")),
            ("dropped calls", json.dumps(g.get("dropped_calls") or {})),
            ("timed out", g.get("timed_out")),
            ("min weight version", g.get("min_weight_version")),
        ]
        mine = [ev for ev in events if ev.get("group_id") == gid]
        parts.append(
            f'<section class="group outcome-{_e(g.get("outcome"))}"><h3>group {_e(gid)}</h3>'
            + "".join(f'<span class="fact">{_e(k)}: <b>{_e(v)}</b></span>' for k, v in facts)
            + table(
                ["rollout", "status", "reward", "attempt", "training", "why not", "samples", "advantage"],
                _rollout_rows(mine, outcomes, samples),
                "rollouts",
            )
            + "</section>"
        )
    return page(f"step {step['step']}", "".join(parts))


def calls_table(traces: Sequence[dict], forked: Collection[Any] = ()) -> str:
    """A rollout's calls: API family, status (a refused call's HTTP status and error), timings, tokens,
    weight versions, what the gateway adjusted or a grammar guided, and whether it forked a new sequence
    (its id in `forked`)."""
    rows = []
    for t in traces:
        rows.append(
            [
                _e(t.get("call_id", "")),
                _e(t.get("api", "")),
                _e(t.get("status", ""))
                + (f" ({_e(t['http_status'])})" if t.get("http_status", 200) != 200 else ""),
                _e(t.get("finish_reason") or ""),
                _num(t.get("latency_s")),
                _num(t.get("upstream_latency_s")),
                _e(len(t.get("prompt_token_ids") or [])),
                _e(len(t.get("response_token_ids") or [])),
                _e(t.get("weight_version", ""))
                + _e(
                    f" → {t['weight_version_end']}"
                    if t.get("weight_version_end") not in (None, t.get("weight_version"))
                    else ""
                ),
                _json(t.get("adjustments")),
                _e(", ".join(t.get("guided_by") or [])),
                _e(t.get("error") or ""),
                "forked" if t.get("call_id") in forked else "",
            ]
        )
    return table(
        [
            "call",
            "api",
            "status",
            "finish",
            "latency s",
            "upstream s",
            "prompt",
            "response",
            "weights",
            "adjustments",
            "guided by",
            "error / refusal",
            "sequence",
        ],
        rows,
        "calls",
    )


def tokens_html(sample: dict, calls: Sequence[dict], decode: Callable[[int], str] | None) -> str:
    """A sample's tokens, one <span> each: its kind as class (tokens.KINDS; "vchange" too where a trained
    token was sampled by other weights than the trained token before it), `data-token-id`,
    `data-loss-mask`, `data-weight-version`, `data-logprob` and `data-advantage`, and a title with them
    (the hover). Its text is the token's (escaped), or its id without a tokenizer."""
    ids, mask = sample["token_ids"], sample["loss_mask"]
    kinds = token_kinds(ids, mask, calls)
    logprobs, advantages = sample["rollout_logprobs"], sample["advantages"]
    spans = sample.get("weight_spans") or []
    out = []
    last: int | None = None  # the version of the previous trained token
    for i, (tid, m) in enumerate(zip(ids, mask, strict=True)):
        lp = logprobs[i] if i < len(logprobs) else None
        adv = advantages[i] if i < len(advantages) else None
        version = version_at(spans, i, sample["weight_version"]) if m else None
        cls = kinds[i] + (" vchange" if m and last is not None and version != last else "")
        last = version if m else last
        text = decode(tid) if decode is not None else f"[{tid}]"
        title = f"#{i} id {tid} · {kinds[i]}" + (
            f" · logprob {lp:.4f} · advantage {adv:.4g} · weights v{version}"
            if m and lp is not None and adv is not None
            else ""
        )
        out.append(
            f'<span class="tok {cls}" data-token-id="{int(tid)}" data-loss-mask="{int(m)}" '
            f'data-weight-version="{_e("" if version is None else version)}" data-logprob="{_e("" if lp is None else lp)}" '
            f'data-advantage="{_e("" if adv is None else adv)}" title="{_e(title)}">{_e(text)}</span>'
        )
    return f'<pre class="tokens">{"".join(out)}</pre>'


def sample_section(sample: dict, calls: Sequence[dict], decode: Callable[[int], str] | None) -> str:
    spans = sample.get("weight_spans") or []
    span_text = ", ".join(f"v{v}: [{a}, {b})" for v, a, b in spans) or f"all v{sample['weight_version']}"
    facts = [
        ("reward", _num(sample.get("reward"))),
        ("advantage", _num(first_advantage(sample))),
        ("tokens", _e(len(sample["token_ids"]))),
        ("trained", _e(sum(sample["loss_mask"]))),
        ("grammar-masked", _e(sample.get("constrained_tokens", 0))),
        ("weight spans", _e(span_text)),
        ("calls", _e(", ".join(sample.get("call_ids") or []))),
    ]
    return (
        f'<section class="sample"><h3>sequence {_e(sample["sequence_index"])} '
        f"of {_e(sample.get('rollout_sequences', 1))}</h3>"
        + "".join(f'<span class="fact">{k}: <b>{v}</b></span>' for k, v in facts)
        + tokens_html(sample, calls, decode)
        + "</section>"
    )


LEGEND = (
    '<p class="legend"><span class="tok trained">trained</span> <span class="tok context">context</span> '
    '<span class="tok masked">masked tool output</span> <span class="tok grammar">grammar-masked</span> '
    "(hover a token for its id, logprob, advantage and weight version)</p>"
)


def mismatches_html(mismatches: Sequence[dict], decode: Callable[[int], str] | None) -> str:
    """The retokenization diffs of the calls that forked a sequence, as `tether samples --mismatches`
    writes them (tether.merger.merge.format_mismatch), escaped; token ids where there is no tokenizer."""
    if not mismatches:
        return ""
    from tether.merger.merge import format_mismatch

    def text(ids: list[int]) -> str:
        return "".join(decode(i) for i in ids) if decode is not None else " ".join(f"[{i}]" for i in ids)

    diffs = "".join(f'<pre class="diff">{_e(format_mismatch(m, text))}</pre>' for m in mismatches)
    return f"<h2>forks: calls that continued no sequence ({len(mismatches)})</h2>{diffs}"


def rollout_page(
    rollout_id: str,
    traces: Sequence[dict],
    samples: Sequence[dict],
    outcome: dict | None,
    decode: Callable[[int], str] | None,
    mismatches: Sequence[dict] = (),
) -> str:
    """A rollout: its calls, what became of it, the calls that forked a sequence (their token diffs),
    and the samples built from the calls token by token."""
    by_id = {t.get("call_id"): t for t in traces}
    fate = (
        f"{outcome['status']}" + (f" ({outcome['reason']})" if outcome.get("reason") else "")
        if outcome
        else "pending (no training outcome yet)"
    )
    parts = [
        f"<p>training: <b>{_e(fate)}</b>"
        + (f" · group {_e(outcome['group_id'])} ({_e(outcome.get('group_outcome', ''))})" if outcome else "")
        + "</p>",
        f"<h2>calls ({len(traces)})</h2>",
        calls_table(traces, {m.get("call_id") for m in mismatches}),
        mismatches_html(mismatches, decode),
        f"<h2>samples ({len(samples)})</h2>",
        LEGEND if samples else "<p>no sample was trained from this rollout</p>",
    ]
    if decode is None and samples:
        parts.append('<p class="note">no tokenizer: tokens are shown as [id]</p>')
    for s in sorted(samples, key=lambda s: s["sequence_index"]):
        calls = [by_id[c] for c in s.get("call_ids") or [] if c in by_id]
        parts.append(sample_section(s, calls, decode))
    return page(f"rollout {rollout_id}", "".join(parts))


def not_found(what: str) -> str:
    return page("not found", f"<p>{_e(what)}</p>")
