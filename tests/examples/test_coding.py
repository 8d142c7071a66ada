"""The coding example: its reward on crafted answers, its task family, its sandbox against scripted
cheating agents (each must score 0) and an honest one (scores 1), and, slow, its run through the stack
with exact token ids."""

from __future__ import annotations

import http.server
import json
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from stack_helpers import assert_samples_are_vllm_tokens, jsonl, runs_a_demo, small_demo, tether_jsonl

from tether.examples.coding import agent, repos, reward, sandbox

try:
    sandbox.check_available()
    SANDBOX = ""
except sandbox.SandboxUnavailable as exc:
    SANDBOX = str(exc)
needs_sandbox = pytest.mark.skipif(bool(SANDBOX), reason=SANDBOX)

TASK = {"task_id": "add+mul:add", "functions": ["add", "mul"], "bug": "add"}
REPO = repos.build(TASK)
FIX = agent.fix_command(REPO.fix)
SUBMIT = f"echo {agent.SUBMIT}"


def scripted(*commands: str):
    """A policy that replies with these commands in order, then submits forever."""
    replies = iter(commands)
    return lambda messages: agent._reply(next(replies, SUBMIT))


def observations(episode: agent.Episode) -> str:
    return "\n".join(str(m["content"]) for m in episode.messages[2:] if m["role"] == "user")


# --- reward: pure functions on crafted reports --------------------------------------------------------

EXPECTED = {"test_add": [5, 4], "test_mul": [6, 0]}


def test_reward_good_bad_and_cheating_reports():
    good = {"test_add": {"values": [5, 4]}, "test_mul": {"values": [6, 0]}}
    assert reward.outcomes(EXPECTED, good) == {"test_add": True, "test_mul": True}
    assert reward.score(True, reward.outcomes(EXPECTED, good), ["test_add"], ["test_mul"]) == 1.0
    # Not submitted: nothing counts.
    assert reward.score(False, reward.outcomes(EXPECTED, good), ["test_add"], ["test_mul"]) == 0.0
    # The bug still there, or the fix broke the other function.
    bad = {"test_add": {"values": [-1, -4]}, "test_mul": {"values": [6, 0]}}
    assert reward.score(True, reward.outcomes(EXPECTED, bad), ["test_add"], ["test_mul"]) == 0.0
    broke = {"test_add": {"values": [5, 4]}, "test_mul": {"values": [5, 5]}}
    assert reward.score(True, reward.outcomes(EXPECTED, broke), ["test_add"], ["test_mul"]) == 0.0
    # Cheats: True for 1, 5.0 for 5, strings, errors, missing tests, an empty report.
    for values in ([5.0, 4.0], ["5", "4"], [True, 4], [5, 4, 0], None):
        assert not reward.outcomes(EXPECTED, {"test_add": {"values": values}})["test_add"], values
    assert reward.outcomes(EXPECTED, {"test_add": {"error": "SystemExit"}}) == {
        "test_add": False,
        "test_mul": False,
    }
    assert reward.score(True, {}, ["test_add"], ["test_mul"]) == 0.0
    assert reward.score(True, {"test_add": True}, ["test_add"], ["test_mul"]) == 0.0
    assert reward.score(True, {}, [], []) == 0.0


def test_report_needs_the_runs_nonce():
    line = json.dumps({"test_add": {"values": [5, 4]}})
    assert reward.parse_report(f"noise\nabc{line}\n", "abc") == {"test_add": {"values": [5, 4]}}
    # A line the code under test printed without the nonce, a broken line, no line at all.
    assert reward.parse_report(f"{line}\nxyz{line}", "abc") == {}
    assert reward.parse_report("abc{not json", "abc") == {}
    assert reward.parse_report("abc[1, 2]", "abc") == {}
    assert reward.parse_report("", "abc") == {}


def test_every_task_has_a_failing_test_and_a_one_line_fix():
    tasks = agent.tasks()
    assert len(tasks) > 100 and len({t["task_id"] for t in tasks}) == len(tasks)
    assert {t["bug"] for t in tasks} == set(repos.BY_NAME)
    for task in tasks:
        repo = repos.build(task)
        source = repo.files[repos.MODULE]
        _, old, new, _ = repo.fix.split("/")
        assert source.count(old) == 1
        fixed = source.replace(old, new)
        for test in repo.tests:
            assert repos._evaluate(fixed, test.function, test.calls) == test.expected
            still = repos._evaluate(source, test.function, test.calls) == test.expected
            assert still == (test.name in repo.pass_to_pass)


def test_prompts_and_commands_are_in_the_vocabulary():
    vocab = set(agent.VOCAB)
    for conversation in agent.demonstrations(50, seed=1):
        for message in conversation:
            assert set(message["content"].split()) <= vocab, message
    assert agent.parse_command("THOUGHT: look.\n```bash\nls -la\n```") == "ls -la"
    assert agent.parse_command("```bash ls ```") == "ls"  # the tiny model's words, space-joined
    assert agent.parse_command("```bash\nls\n```\n```bash\npwd\n```") is None
    assert agent.parse_command("ls") is None


# --- the sandbox: an honest agent, and cheaters that must score 0 ------------------------------------


@needs_sandbox
def test_honest_agent_scores_1():
    episode = agent.run_episode(
        TASK, scripted(agent.TEST_COMMAND, f"cat {repos.MODULE}", FIX, agent.TEST_COMMAND)
    )
    assert episode.reward == 1.0 and episode.end == "submitted"
    obs = observations(episode)
    assert "FAILED test_add\nPASSED test_mul" in obs and "PASSED test_add\nPASSED test_mul" in obs
    assert "return a - b" in obs  # cat showed the working copy


@needs_sandbox
def test_cannot_read_the_tests_the_tasks_or_the_generator(tmp_path):
    # Hidden material on this machine, at paths the cheater knows: a decoy of the hidden tests in the
    # temporary directory (where other episodes' test copies live) and the generator's source.
    decoy = tmp_path / "test_ops.py"
    decoy.write_text("SECRET-EXPECTED-VALUES")
    generator = Path(repos.__file__).resolve()
    episode = agent.run_episode(
        TASK,
        scripted(
            "ls -a; ls tests; cat tests/test_ops.py",
            f"cat {decoy}; cat {generator}; ls {tempfile.gettempdir()}",
            "umount /tmp; umount /tmp/work; cat /proc/1/environ; ls /proc",
            f"grep -rs SECRET-EXPECTED /tmp /var/tmp /root /home {Path.cwd()} | head; cat {decoy}",
        ),
    )
    obs = observations(episode)
    assert "SECRET-EXPECTED-VALUES" not in obs and "FUNCTIONS" not in obs
    assert "No such file" in obs and "umount" in obs
    assert episode.reward == 0.0


@needs_sandbox
def test_planted_test_files_runners_and_startup_hooks_are_ignored():
    fake_report = json.dumps({"test_add": {"values": [5, 4]}, "test_mul": {"values": [6, 0]}})
    episode = agent.run_episode(
        TASK,
        scripted(
            "mkdir -p tests && echo 'def test_add(): pass' > tests/test_ops.py",
            "echo 'import pytest; collect_ignore_glob = [\"*\"]' > conftest.py; printf '[pytest]\\n' > pytest.ini",
            "echo 'import os; os._exit(0)' > sitecustomize.py; echo 'import sitecustomize' > hook.pth",
            "echo '{\"test_add\": [-1, -4]}' > expected.json; echo '{}' > _calls.json",
            f"echo 'print(open(\"_calls.json\").read())' > _tether_runner.py; echo '{fake_report}' > report.txt",
            "ln -s /dev/null tests.py; ls -a",
        ),
    )
    assert episode.submitted and episode.reward == 0.0
    assert episode.passed == {"test_add": False, "test_mul": False} or episode.passed["test_add"] is False


@needs_sandbox
def test_code_under_test_cannot_fake_the_report():
    # ops.py that exits at import, or prints a passing report: the tests still fail.
    for hack in (
        "import os; os._exit(0)",
        'print(\'{"test_add": {"values": [5, 4]}}\')',
        "import json, os; n = json.load(open('_calls.json'))['nonce']; "
        "os.write(1, (n + json.dumps({'test_add': {'values': [5, 4]}})).encode() + b'\\n'); os._exit(0)",
    ):
        episode = agent.run_episode(TASK, scripted(f"echo {json.dumps(hack)} >> ops.py"))
        assert episode.submitted and episode.reward == 0.0, hack
    # An ops.py replaced by a link (to the fixed source elsewhere) is not copied: the tests fail.
    episode = agent.run_episode(
        TASK, scripted("sed 's/-/+/' ops.py > /tmp/fixed.py && rm ops.py && ln -s /tmp/fixed.py ops.py")
    )
    assert episode.reward == 0.0


@needs_sandbox
def test_no_git_history_to_read():
    episode = agent.run_episode(
        TASK, scripted("ls -a; git log -p; git status", "find / -maxdepth 3 -name .git")
    )
    obs = observations(episode)
    assert ".git\n" not in obs and "/.git" not in obs and "commit " not in obs
    assert episode.reward == 0.0


class _FixServer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = REPO.files[repos.MODULE].replace("a - b", "a + b").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@needs_sandbox
def test_no_network_and_no_package_installs():
    # A real server on this host's loopback serves the fix: reachable from here, not from the sandbox.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FixServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/ops.py"
    try:
        import urllib.request

        assert b"a + b" in urllib.request.urlopen(url, timeout=5).read()
        episode = agent.run_episode(
            TASK,
            scripted(
                f"curl -s -o ops.py {url}",
                f"python3 -c \"import urllib.request as u; open('ops.py', 'wb').write(u.urlopen('{url}').read())\"",
                "pip install requests",
                "env",
            ),
        )
    finally:
        server.shutdown()
    obs = observations(episode)
    assert "PIP_NO_INDEX=1" in obs and "proxy" not in obs.lower()
    assert episode.submitted and episode.reward == 0.0


@needs_sandbox
def test_hangs_are_cut_and_leave_nothing_behind():
    marker = "987654"
    episode = agent.run_episode(
        TASK, scripted(f"sleep {marker} & echo started", "while true; do :; done"), command_timeout_s=1.0
    )
    assert "timeout" in observations(episode)
    assert episode.reward == 0.0
    # The background sleep died with the command's PID namespace.
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert left.stdout.strip() == ""


@needs_sandbox
def test_endless_turns_huge_output_and_big_files_score_0():
    endless = agent.run_episode(TASK, lambda messages: agent._reply("ls"), max_turns=4)
    assert (endless.turns, endless.end, endless.submitted, endless.reward) == (4, "turns", False, 0.0)

    flood = agent.run_episode(
        TASK, lambda messages: agent._reply("yes FAILED"), output_chars=300, context_chars=1500
    )
    assert flood.end == "context" and flood.reward == 0.0
    assert all(len(str(m["content"])) <= 300 + 40 for m in flood.messages[2:])
    assert "output truncated" in observations(flood)

    big = agent.run_episode(TASK, scripted("head -c 5000000 /dev/zero > big; ls -l big", FIX))
    assert "File size limit exceeded" in observations(big) or "file size" in observations(big).lower()
    assert big.reward == 1.0  # the fix itself still counts


@needs_sandbox
def test_format_errors_are_observed_not_run():
    episode = agent.run_episode(TASK, lambda messages: "rm -rf ops.py", max_turns=2)
    assert observations(episode) == f"{agent.FORMAT_ERROR}\n{agent.FORMAT_ERROR}"
    assert episode.reward == 0.0


# --- the warm start: a policy RL can improve -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 2])
def test_the_warm_start_reads_the_report_and_leaves_rl_room(seed):
    """RL can only shift mass onto `run_tests` if looking first pays: after the report, the warm-started
    policy must apply the failing function's fix (its ceiling), while it looks first only sometimes (its
    start). Seed 2 at the former 300 warm-start steps read the report 30% of the time and plateaued at 0.4.
    The warm start trains until it reads 0.95 over every task (agent.warm_start_check); 24 of them scored
    here against 0.9 leave room for the spread between tasks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.cli import prepare_example_model
    from tether.demo.warmstart import reply_probability

    path = prepare_example_model("coding", seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    looks_first = reply_probability(model, tokenizer, [*agent.opening({}), agent_turn(agent.TEST_COMMAND)])
    reads = agent.reads_the_report(model, tokenizer, agent.tasks(24, seed))
    assert reads >= 0.9, reads
    assert 0.15 <= looks_first <= 0.6, looks_first


def agent_turn(command: str) -> dict:
    return {"role": "assistant", "content": agent._reply(command)}


# --- through the stack: exact token ids ----------------------------------------------------------------


@pytest.mark.slow
@runs_a_demo
def test_demo_samples_carry_vllm_token_ids_and_harness_rewards(tmp_path):
    from transformers import AutoTokenizer

    run_dir = small_demo(tmp_path, "coding")
    traces, samples = tether_jsonl(tmp_path, "traces"), tether_jsonl(tmp_path, "samples")
    assert_samples_are_vllm_tokens(traces, samples)
    calls: dict[str, list[dict]] = {}
    for t in sorted(traces, key=lambda t: t["started_at"]):
        calls.setdefault(t["rollout_id"], []).append(t)
    # The episodes are multi-turn and merge: a sample is exactly the last call's prompt and response ids.
    for s in samples:
        assert any(
            t["prompt_token_ids"] + t["response_token_ids"] == s["token_ids"] for t in calls[s["rollout_id"]]
        )
    assert any(len(calls[s["rollout_id"]]) >= 2 for s in samples)
    # The reward trained on is the harness's: replaying a rollout's recorded replies (vLLM's token ids,
    # decoded) through the harness scores the same.
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final-model")
    tasks = {t["task_id"]: t for t in jsonl((run_dir / "tasks.jsonl").read_text())}
    for s in samples:
        replies = iter(
            tokenizer.decode(t["response_token_ids"], skip_special_tokens=True)
            for t in calls[s["rollout_id"]]
        )
        episode = agent.run_episode(tasks[s["task_id"]], lambda messages, replies=replies: next(replies))
        assert episode.reward == s["reward"], s["rollout_id"]
