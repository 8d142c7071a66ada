"""`tether ui` (tether.cli.web) over a small run written with the project's own records and keys into
the embedded Redis, plus a run directory's metrics.jsonl: every page answers, a rollout page's tokens
carry what `tether samples` prints for the same rollout, values are escaped, unknown ids are 404, and
the admin token is enforced when set. No stack, no browser."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tether.cli.inspection import cmd_samples
from tether.cli.web.app import build_app
from tether.cli.web.store import UiStore, groups_of_step
from tether.cli.web.svg import line_chart
from tether.cli.web.tokens import token_kinds
from tether.common import broker
from tether.common.records import GroupResult, RolloutEvent, SampleRecord, Trace, TrainingOutcome

NS = "tether-uitest"
HOSTILE = "<script>alert(1)</script>"


def group_result(gid: str, rewards: list[float], outcome: str, finished_at: float) -> GroupResult:
    return GroupResult(
        group_id=gid, rollouts=len(rewards), completed=len(rewards), rewards=rewards, eval=False,
        sequences=len(rewards), forks=0, single_sequence_rollouts=len(rewards), realigns=0, truncated=0,
        generated_tokens=8, mismatched_calls=0, side_sequences_excluded=0, dropped_calls={}, mismatches=[],
        timed_out=False, finished_at=finished_at, estimator="grpo", outcome=outcome,
        samples=2 if outcome == "trained" else 0, tokens=20, min_weight_version=0,
    )  # fmt: skip


# r1's sample: prompt [1, 2, 3], call c1's response [10, 11] (11 grammar-constrained), tool output
# [4, 5], call c2's response [12, 13].
SAMPLE_IDS = [1, 2, 3, 10, 11, 4, 5, 12, 13]
SAMPLE_MASK = [0, 0, 0, 1, 0, 0, 0, 1, 1]


async def write_run(url: str) -> None:
    keys = broker.Keys(NS)
    r = broker.connect(url)
    try:
        traces = [
            Trace(call_id="c1", rollout_id="r1", api="chat.completions", request={}, status="ok",
                  prompt_token_ids=[1, 2, 3], response_token_ids=[10, 11], response_logprobs=[-0.5, -0.1],
                  constrained_spans=[[1, 2]], guided_by=["tool_choice"], adjustments={"ignored": [HOSTILE]},
                  latency_s=0.2, finished_at=40.0),
            Trace(call_id="c2", rollout_id="r1", api="messages", request={}, status="ok",
                  prompt_token_ids=[1, 2, 3, 10, 11, 4, 5], response_token_ids=[12, 13],
                  response_logprobs=[-0.25, -0.75], weight_version=1, finished_at=45.0),
            Trace(call_id="c3", rollout_id="r2", api="responses", request={}, status="error",
                  http_status=400, error=f"refused: {HOSTILE}", finished_at=41.0),
        ]  # fmt: skip
        for t in traces:
            await broker.publish(r, keys.traces(t.rollout_id), t.to_dict())
        sample = SampleRecord(
            rollout_id="r1", group_id="g1", task_id="t1", sequence_index=0, token_ids=SAMPLE_IDS,
            loss_mask=SAMPLE_MASK, rollout_logprobs=[0, 0, 0, -0.5, 0, 0, 0, -0.25, -0.75],
            advantages=[0, 0, 0, 0.7, 0, 0, 0, 0.7, 0.7], reward=1.0, weight_version=0,
            weight_spans=[[0, 3, 5], [1, 5, 9]], constrained_tokens=1, call_ids=["c1", "c2"],
        )  # fmt: skip
        other = SampleRecord(
            rollout_id="r2", group_id="g1", task_id="t1", sequence_index=0, token_ids=[1, 20],
            loss_mask=[0, 1], rollout_logprobs=[0, -1.0], advantages=[0, -0.7], reward=0.0, weight_version=0,
        )  # fmt: skip
        for s in (sample, other):
            await broker.publish(r, keys.samples, s.to_dict())
        # c2's prompt re-tokenised c1's response (11 -> 14): the merger's example of the fork.
        fork = {"call_id": "c2", "expected_prefix": [1, 2, 3, 10, 11], "prompt": [1, 2, 3, 10, 14, 4, 5],
                "diverge_at": 4, "response_start": 3, "group_id": "g1", "task_id": "t1", "time": 45.0}  # fmt: skip
        await broker.publish(r, keys.mismatches, fork)
        for gid, rids, rewards, outcome, at in (
            ("g1", ["r1", "r2"], [1.0, 0.0], "trained", 50.0),
            ("g2", ["r3", "r4"], [1.0, 1.0], "filtered", 150.0),
        ):
            await broker.publish(r, keys.group_results, group_result(gid, rewards, outcome, at).to_dict())
            for rid, reward in zip(rids, rewards, strict=True):
                event = RolloutEvent(rollout_id=rid, task_id="t1", group_id=gid, group_size=2,
                                     status="completed", reward=reward)  # fmt: skip
                await broker.publish(r, keys.rollout_events, event.to_dict())
                trained = outcome == "trained"
                fate = TrainingOutcome(
                    rollout_id=rid, group_id=gid, status="trained" if trained else "will_not_train",
                    reason=None if trained else "zero_variance", samples=1 if trained else 0,
                    group_outcome=outcome,
                )  # fmt: skip
                await r.set(keys.rollout_training(rid), json.dumps(fate.to_dict()))
    finally:
        await r.aclose()


def step_record(step: int, reward: float, at: float) -> dict:
    return {"step": step, "weight_version": step, "reward_mean": reward, "rollouts": 2.0, "groups_trained": 1.0,
            "groups_filtered": 0.0, "samples": 2.0, "tokens": 11.0, "time": at, "entropy": 0.5 / step,
            "grad_norm": math.nan}  # fmt: skip


@pytest.fixture
def run(tmp_path, redis_url):
    asyncio.run(write_run(redis_url))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(m) + "\n" for m in (step_record(1, 0.5, 100.0), step_record(2, 1.0, 200.0)))
    )
    texts = {11: HOSTILE}
    store = UiStore(run_dir, redis_url, NS, decode=lambda tid: texts.get(tid, f"t{tid}"))
    return store


class Tokens(HTMLParser):
    """The token spans of a page: (attributes, text) each."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[tuple[dict, str]] = []
        self._open = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "span" and "data-token-id" in a:
            self.tokens.append((a, ""))
            self._open = True

    def handle_data(self, data: str) -> None:
        if self._open:
            attrs, text = self.tokens[-1]
            self.tokens[-1] = (attrs, text + data)

    def handle_endtag(self, tag: str) -> None:
        self._open = False


def tokens_of(html: str) -> list[tuple[dict, str]]:
    parser = Tokens()
    parser.feed(html)
    return parser.tokens


def stopped_run(data: Path) -> int:
    """`write_run`'s records in an embedded Redis whose append-only file is `data`, stopped again (a run
    whose stack is down); the port it listened on."""
    from tether.common.net import free_port
    from tether.common.redis_server import start_embedded_redis

    port = free_port()
    proc = start_embedded_redis(data, port)
    try:
        asyncio.run(write_run(f"redis://127.0.0.1:{port}/0"))
    finally:
        proc.terminate()
        proc.wait(10)
    return port


def processes_in(folder: Path) -> list[int]:
    """The processes whose working directory is `folder` (Linux's /proc)."""
    import os

    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == folder:
                found.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            pass
    return found


def test_every_page_answers(run) -> None:
    client = TestClient(build_app(run, "test run"))
    runs = client.get("/")
    assert runs.status_code == 200
    assert 'href="/step/1"' in runs.text and 'href="/step/2"' in runs.text
    assert runs.text.count("<svg") >= 2  # the reward and the entropy curves
    step = client.get("/step/1")
    assert step.status_code == 200
    assert "group g1" in step.text and "group g2" not in step.text  # g2 finished after step 1's record
    assert 'href="/rollout/r1"' in step.text and "0.7" in step.text and "trained" in step.text
    filtered = client.get("/step/2")
    assert "group g2" in filtered.text and "zero_variance" in filtered.text
    for path in ("/rollout/r1", "/rollout/r2", "/static/ui.css", "/static/ui.js"):
        assert client.get(path).status_code == 200, path
    for path in ("/", "/step/1", "/rollout/r1", "/static/ui.css", "/static/ui.js"):  # nothing from elsewhere
        text = client.get(path).text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|url\(|@import""", text), path
    calls = client.get("/rollout/r2").text
    assert "error (400)" in calls and "responses" in calls
    assert "forked" not in calls and "forks:" not in calls


def test_a_rollout_page_shows_the_calls_that_forked_with_their_token_diff(run) -> None:
    page = TestClient(build_app(run, "test run")).get("/rollout/r1").text
    assert page.count(">forked<") == 1
    diff = page[page.index('class="diff"') :]
    assert "call c2: prompt diverges at token 4 inside the previous response" in diff
    assert (
        "- expected: &lt;script&gt;" in diff and "[11]" in diff and "+ got:" in diff and "[14, 4, 5]" in diff
    )


def test_a_rollout_pages_tokens_are_what_tether_samples_prints(run, capsys) -> None:
    args = argparse.Namespace(
        redis_url=run.redis_url, namespace=NS, rollout="r1", group=None, mismatches=False, model=None
    )
    cmd_samples(args)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 1
    page = TestClient(build_app(run, "test run")).get("/rollout/r1").text
    tokens = tokens_of(page[page.index('class="tokens"') :])
    assert [int(a["data-token-id"]) for a, _ in tokens] == printed[0]["token_ids"]
    assert [int(a["data-loss-mask"]) for a, _ in tokens] == printed[0]["loss_mask"]
    kinds = [a["class"].split()[1] for a, _ in tokens]  # "tok KIND [vchange]"
    assert kinds == ["context"] * 3 + ["trained", "grammar", "masked", "masked", "trained", "trained"]
    assert [a["data-weight-version"] for a, _ in tokens if a["data-loss-mask"] == "1"] == ["0", "1", "1"]
    assert [i for i, (a, _) in enumerate(tokens) if "vchange" in a["class"].split()] == [7]  # v0 -> v1
    assert "logprob -0.2500" in tokens[7][0]["title"]


def test_hostile_text_is_escaped(run) -> None:
    client = TestClient(build_app(run, "test run"))
    for path in ("/rollout/r1", "/rollout/r2"):
        assert HOSTILE not in client.get(path).text, path
    page = client.get("/rollout/r1").text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert tokens_of(page[page.index('class="tokens"') :])[4][1] == HOSTILE  # its text, unescaped back
    odd = client.get("/rollout/%3Cscript%3E")
    assert odd.status_code == 404 and "<script>" not in odd.text


def test_unknown_ids_are_404(run) -> None:
    client = TestClient(build_app(run, "test run"))
    assert client.get("/step/9").status_code == 404
    assert client.get("/rollout/nope").status_code == 404
    assert client.get("/static/secret.py").status_code == 404


def test_the_admin_token_is_enforced_when_set(run) -> None:
    client = TestClient(build_app(run, "test run", admin_token="s3cret"))
    assert client.get("/").status_code == 401
    assert client.get("/rollout/r1", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/?token=wrong").status_code == 401
    assert client.get("/?token=s3cret").status_code == 200
    assert client.get("/rollout/r1").status_code == 200  # the cookie the token set
    assert TestClient(build_app(run, "test run")).get("/").status_code == 200  # no token: open


def test_a_run_directory_alone_shows_its_metrics(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps(step_record(1, 0.25, 10.0)) + "\n")
    client = TestClient(build_app(UiStore(tmp_path, None, NS), "run directory"))
    page = client.get("/")
    assert page.status_code == 200 and "Redis is not available" in page.text
    assert client.get("/step/1").status_code == 200
    assert client.get("/rollout/r1").status_code == 404


def test_groups_of_a_step_are_those_finished_since_the_previous_step() -> None:
    metrics = [step_record(1, 0, 100.0), step_record(2, 0, 200.0), {"eval_reward": 1.0}]
    results = [
        {"group_id": "a", "finished_at": 100.0},
        {"group_id": "b", "finished_at": 100.5},
        {"group_id": "e", "finished_at": 150.0, "eval": True},
        {"group_id": "c", "finished_at": 250.0},
    ]
    assert [g["group_id"] for g in groups_of_step(metrics, results, 1)] == ["a"]
    assert [g["group_id"] for g in groups_of_step(metrics, results, 2)] == ["b"]
    assert groups_of_step(metrics, results, 3) == []


def test_groups_of_a_step_are_those_its_record_names_when_it_names_them() -> None:
    # An async step: "b" finished while step 1 trained, and step 2 trains it; "a" was resolved twice.
    metrics = [
        {**step_record(1, 0, 100.0), "group_ids": ["a"]},
        {**step_record(2, 0, 200.0), "group_ids": ["c", "b"]},
    ]
    results = [
        {"group_id": "a", "finished_at": 90.0, "samples": 1},
        {"group_id": "b", "finished_at": 95.0},
        {"group_id": "a", "finished_at": 99.0, "samples": 2},
        {"group_id": "e", "finished_at": 150.0, "eval": True},
        {"group_id": "c", "finished_at": 150.0},
    ]
    assert groups_of_step(metrics, results, 1) == [{"group_id": "a", "finished_at": 99.0, "samples": 2}]
    assert [g["group_id"] for g in groups_of_step(metrics, results, 2)] == ["c", "b"]


def test_token_kinds_without_calls_split_context_from_masked() -> None:
    assert token_kinds([1, 2, 3, 4, 5], [0, 1, 0, 1, 0], []) == [
        "context",
        "trained",
        "masked",
        "trained",
        "masked",
    ]


def test_a_chart_draws_gaps_and_escapes_its_title() -> None:
    svg = line_chart(HOSTILE, [("a", [1, 2, 3, 4], [0.0, 1.0, math.nan, 2.0])])
    assert HOSTILE not in svg and svg.count("<polyline") == 1 and svg.count("<circle") == 1
    assert "no data" in line_chart("empty", [("a", [1], [math.nan])])


def test_tether_ui_serves_a_stopped_runs_directory_from_its_redis_data(tmp_path) -> None:
    """`tether ui --run-dir` on a run whose stack is down: its metrics.jsonl, and its Redis append-only
    file opened with an embedded Redis of the command's own (as `tether samples` does)."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    from tether.common.net import free_port

    run_dir = tmp_path / "up-1"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps(step_record(1, 0.5, 100.0)) + "\n")
    stopped_run(run_dir / "redis")
    ui_port = free_port()
    env = {**os.environ, "TETHER_ADMIN_TOKEN": ""}
    cmd = [sys.executable, "-m", "tether.cli", "ui", "--run-dir", str(run_dir), "--namespace", NS]
    ui = subprocess.Popen([*cmd, "--port", str(ui_port)], env=env, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{ui_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert ui.poll() is None and time.monotonic() < deadline, "tether ui did not start"
                time.sleep(0.2)
        assert "Redis is not available" not in httpx.get(url).text
        page = httpx.get(f"{url}/rollout/r1")
        assert page.status_code == 200
        assert [int(a["data-token-id"]) for a, _ in tokens_of(page.text)] == SAMPLE_IDS
        assert "[11]" in page.text  # no tokenizer given: ids
    finally:
        ui.terminate()
        ui.wait(10)
    # SIGTERM stopped the Redis it had opened the run's data with, too (redis-server's working
    # directory is its data directory).
    assert ui.returncode == 0 and processes_in(run_dir / "redis") == []


def test_token_texts_come_from_the_models_tokenizer(tmp_path) -> None:
    from tether.cli.web.store import tokenizer_decode
    from tether.demo import tiny

    tokenizer = tiny.build_tokenizer(["add", "seven"])
    tokenizer.save_pretrained(tmp_path)
    decode = tokenizer_decode(str(tmp_path))
    assert decode is not None
    ids = tokenizer.encode("seven", add_special_tokens=False)
    assert [decode(i) for i in ids] == [tokenizer.decode([i]) for i in ids] and "seven" in "".join(
        map(decode, ids)
    )
    assert tokenizer_decode(str(tmp_path / "none")) is None and tokenizer_decode(None) is None


def test_tether_samples_reopens_a_stopped_stacks_redis(tmp_path) -> None:
    """The reader `tether ui` shares with `tether samples` (inspection.stack_redis): with the stack's
    Redis down, the run's append-only file is opened by an embedded Redis and read."""
    import subprocess
    import sys

    port = stopped_run(tmp_path / "redis")
    (tmp_path / ".tether").mkdir()
    state = {
        "redis_url": f"redis://127.0.0.1:{port}/0",
        "redis_data": str(tmp_path / "redis"),
        "namespace": NS,
    }
    (tmp_path / ".tether" / "stack.json").write_text(json.dumps(state))
    out = subprocess.run(
        [sys.executable, "-m", "tether.cli", "samples", "--rollout", "r1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == [SAMPLE_IDS]


def test_tether_ui_refuses_to_listen_beyond_loopback_without_a_token(monkeypatch, capsys) -> None:
    from tether.cli import build_parser
    from tether.cli.ui import open_refusal

    monkeypatch.delenv("TETHER_ALLOW_OPEN_ADMIN", raising=False)
    monkeypatch.delenv("TETHER_ADMIN_TOKEN", raising=False)
    args = build_parser().parse_args(["ui", "--host", "0.0.0.0", "--run-dir", "nowhere"])
    assert args.fn(args) == 2 and "TETHER_ADMIN_TOKEN" in capsys.readouterr().err
    assert open_refusal("127.0.0.1", None) is None and open_refusal("0.0.0.0", "s3cret") is None
    monkeypatch.setenv("TETHER_ALLOW_OPEN_ADMIN", "true")
    assert open_refusal("0.0.0.0", None) is None


def test_healthz_alone_answers_without_the_token(run) -> None:
    """The probes of compose's and the chart's ui call /healthz, which shows nothing of the run; every
    other route still needs the token."""
    client = TestClient(build_app(run, "test run", admin_token="s3cret"))
    health = client.get("/healthz")
    assert health.status_code == 200 and health.text == "ok" and "set-cookie" not in health.headers
    for path in ("/", "/healthz/", "/static/ui.css", "/rollout/r1", "/step/1"):
        assert client.get(path).status_code == 401, path


def test_tether_ui_reads_the_redis_its_environment_names_without_a_stack(run, tmp_path, monkeypatch) -> None:
    """Compose's and the chart's ui: no stack.json, the Redis, namespace and tokenizer from
    TETHER_REDIS_URL, TETHER_NAMESPACE and TETHER_MODEL_DIR (the password stays off the command line).
    An unreachable Redis is refused without printing its password."""
    from contextlib import ExitStack

    from tether.cli import build_parser
    from tether.cli.ui import _sources
    from tether.common.net import free_port

    monkeypatch.chdir(tmp_path)  # no .tether/stack.json here
    monkeypatch.setenv("TETHER_REDIS_URL", run.redis_url)
    monkeypatch.setenv("TETHER_NAMESPACE", NS)
    monkeypatch.setenv("TETHER_MODEL_DIR", str(tmp_path / "model"))
    with ExitStack() as stack:
        got = _sources(build_parser().parse_args(["ui"]), stack)
    assert got[:4] == (None, run.redis_url, NS, str(tmp_path / "model"))
    monkeypatch.setenv("TETHER_REDIS_URL", f"redis://:hunter2@127.0.0.1:{free_port()}/0")
    with ExitStack() as stack, pytest.raises(SystemExit) as refused:
        _sources(build_parser().parse_args(["ui"]), stack)
    assert "not reachable" in str(refused.value) and "hunter2" not in str(refused.value)
