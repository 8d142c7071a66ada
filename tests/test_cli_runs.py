"""`tether run create|list|status|stop` (docs/runs.md) against a gateway in-process (vLLM look-alike),
found by --gateway-url or through the stack's `.tether/stack.json`, with the admin token from
TETHER_ADMIN_TOKEN: JSON lines out, the gateway's refusals as exit 1 with its words."""

from __future__ import annotations

import json

import pytest
from gateway_helpers import ADMIN

from tether.cli import main


def _tether(capsys, *argv: str) -> tuple[int, list[dict], str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, [json.loads(line) for line in out.splitlines()], err


@pytest.fixture
def admin(monkeypatch):
    monkeypatch.setenv("TETHER_ADMIN_TOKEN", ADMIN)
    monkeypatch.delenv("TETHER_GATEWAY_URL", raising=False)


def test_create_list_status_stop(gw, capsys, tmp_path, admin):
    config = tmp_path / "calc_lora.yaml"
    config.write_text("example: calculator\ntrainer:\n  lr: 0.001\n")
    url = ("--gateway-url", gw.url)

    code, [made], _ = _tether(capsys, "run", "create", "--config", str(config), *url)
    assert code == 0
    assert made["run_id"] == "calc-lora" and made["adapter"] == "calc-lora"  # from the file's name
    assert made["config"] == {"example": "calculator", "trainer": {"lr": 0.001}}
    assert made["status"] == "created" and made["api_key"].startswith("trk-")

    code, [other], _ = _tether(
        capsys, "run", "create", "--config", str(config), "--id", "calc-2", "--adapter", "lora-2", *url
    )
    assert code == 0 and (other["run_id"], other["adapter"]) == ("calc-2", "lora-2")

    code, listed, _ = _tether(capsys, "run", "list", *url)
    assert code == 0 and [r["run_id"] for r in listed][-2:] == ["calc-lora", "calc-2"]
    assert all("api_key" not in r for r in listed)

    code, [status], _ = _tether(capsys, "run", "status", "calc-lora", *url)
    assert code == 0 and status == {k: v for k, v in made.items() if k != "api_key"}

    code, [stopped], _ = _tether(capsys, "run", "stop", "calc-lora", *url)
    assert code == 0 and stopped["status"] == "stopped"

    # The gateway's refusals: exit 1, its message on stderr, nothing on stdout.
    for argv, said in [
        (("run", "create", "--config", str(config)), "409: run calc-lora exists already"),
        (("run", "status", "nope"), "404: no run nope"),
        (("run", "stop", "Bad:Id"), "400: invalid run id"),
    ]:
        code, out, err = _tether(capsys, *argv, *url)
        assert (code, out) == (1, []) and said in err, err


def test_a_bad_run_config_is_refused_before_anything_is_sent(gw, capsys, tmp_path, admin):
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  lrr: 1\n")
    code, out, err = _tether(capsys, "run", "create", "--config", str(config), "--gateway-url", gw.url)
    assert (code, out) == (1, []) and "trainer.lrr: unknown setting" in err
    code, listed, _ = _tether(capsys, "run", "list", "--gateway-url", gw.url)
    assert code == 0 and "bad" not in [r["run_id"] for r in listed]
    config = tmp_path / "Not A Slug!.yaml"
    config.write_text("")
    code, out, err = _tether(
        capsys, "run", "create", "--config", str(config), "--id=-x", "--gateway-url", gw.url
    )
    assert code == 1 and "invalid run id" in err


def test_the_stacks_gateway_and_the_admin_token(gw, capsys, tmp_path, monkeypatch, admin):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".tether").mkdir()
    (tmp_path / ".tether" / "stack.json").write_text(json.dumps({"addresses": {"gateway_url": gw.url}}))
    code, listed, _ = _tether(capsys, "run", "list")
    assert code == 0 and isinstance(listed, list)
    monkeypatch.delenv("TETHER_ADMIN_TOKEN")  # this gateway has one: without it, 401
    code, out, err = _tether(capsys, "run", "list")
    assert (code, out) == (1, []) and "401: This route needs the admin token" in err
