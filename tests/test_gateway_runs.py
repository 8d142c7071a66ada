"""The gateway's run routes (docs/runs.md): create, list, read and stop runs behind the admin token, in
the gateway's error vocabulary; and a run's API key as an authority over its own run's rollouts only
(created in the run's namespace, 404 for any other). In-process gateway, vLLM look-alike."""

from __future__ import annotations

import orjson
from fakes.vllm_openai import MODEL
from gateway_helpers import ADMIN, InProcessGateway, assert_openai_error, bearer, gateway_settings

from tether.common.keys import Keys, key_digest

ADMIN_H = bearer(ADMIN)


def _create(gw, run_id: str, config: dict | None = None, **extra) -> dict:
    resp = gw.http.post("/v1/runs", json={"run_id": run_id, "config": config or {}, **extra}, headers=ADMIN_H)
    assert resp.status_code == 201, resp.text
    return resp.json()


def test_create_list_get_stop(gw, rdb):
    config = {"trainer": {"lr": 0.001}, "scheduler": None, "description": "calc"}
    made = _create(gw, "calc", config)
    key = made.pop("api_key")
    assert key.startswith("trk-")
    assert made["run_id"] == "calc" and made["adapter"] == "calc" and made["config"] == config
    assert made["status"] == "created" and made["namespace"] == f"{gw.settings.namespace}.run.calc"
    assert made["key_sha256"] == key_digest(key)
    other = _create(gw, "instr", adapter="instruction-lora")
    assert other["adapter"] == "instruction-lora"
    other.pop("api_key")

    resp = gw.http.get("/v1/runs", headers=ADMIN_H)
    assert resp.status_code == 200
    listed = [r for r in resp.json()["runs"] if r["run_id"] in ("calc", "instr")]
    assert listed == [made, other]  # oldest first; the key is shown once, at creation, never again
    assert gw.http.get("/v1/runs/calc", headers=ADMIN_H).json() == made
    assert key not in orjson.dumps(rdb.hgetall(gw.keys.runs)).decode()

    resp = gw.http.post("/v1/runs/calc/stop", headers=ADMIN_H)
    assert resp.status_code == 200 and resp.json()["status"] == "stopped"
    assert gw.http.post("/v1/runs/calc/stop", headers=ADMIN_H).json()["status"] == "stopped"
    assert gw.http.get("/v1/runs/calc", headers=ADMIN_H).json()["status"] == "stopped"


def test_refusals_in_the_gateways_error_shape(gw):
    _create(gw, "taken")
    cases = [
        ("post", "/v1/runs", {"run_id": "taken", "config": {}}, ADMIN_H, 409, "run_exists"),
        ("post", "/v1/runs", {"run_id": "Bad Id", "config": {}}, ADMIN_H, 400, "invalid_value"),
        ("post", "/v1/runs", {"run_id": "a" * 41, "config": {}}, ADMIN_H, 400, "invalid_value"),
        (
            "post",
            "/v1/runs",
            {"run_id": "x", "config": {"trainr": {}}},
            ADMIN_H,
            400,
            "unsupported_parameter",
        ),
        ("post", "/v1/runs", {"run_id": "x", "config": {"trainer": 1}}, ADMIN_H, 400, "invalid_value"),
        ("post", "/v1/runs", {"run_id": "x"}, ADMIN_H, 400, "invalid_value"),
        ("post", "/v1/runs", {"run_id": "x", "config": {}, "adapter": ""}, ADMIN_H, 400, "invalid_value"),
        ("post", "/v1/runs", {"run_id": "x", "config": {}}, {}, 401, "invalid_api_key"),
        ("post", "/v1/runs", {"run_id": "x", "config": {}}, bearer("nope"), 403, "forbidden"),
        ("get", "/v1/runs", None, {}, 401, "invalid_api_key"),
        ("get", "/v1/runs/nope", None, ADMIN_H, 404, "run_not_found"),
        ("get", "/v1/runs/No:pe", None, ADMIN_H, 400, "invalid_value"),
        ("get", "/v1/runs/taken", None, {}, 401, "invalid_api_key"),
        ("post", "/v1/runs/nope/stop", None, ADMIN_H, 404, "run_not_found"),
        ("post", "/v1/runs/taken/stop", None, {}, 401, "invalid_api_key"),
    ]
    for method, path, body, headers, status, code in cases:
        resp = gw.http.request(method, path, json=body, headers=headers)
        assert_openai_error(resp, status, code)
    resp = gw.http.post("/v1/runs", content=b"{not json", headers=ADMIN_H)
    assert_openai_error(resp, 400, "invalid_json")
    # None of them made a run (the module's gateway keeps the other tests' runs).
    listed = [r["run_id"] for r in gw.http.get("/v1/runs", headers=ADMIN_H).json()["runs"]]
    assert "x" not in listed and listed.count("taken") == 1


def test_a_run_key_reaches_its_own_runs_rollouts_only(gw, rdb):
    a, b = _create(gw, "run-a"), _create(gw, "run-b", adapter="adapter-b")
    base = gw.new_rollout()  # the base namespace's, made with the admin token

    resp = gw.http.post(
        "/v1/rollouts",
        json={"task_id": "t", "group_id": "g", "metadata": {"adapter": "x"}},
        headers=bearer(a["api_key"]),
    )
    assert resp.status_code == 201, resp.text
    mine = resp.json()
    rid = mine["rollout_id"]
    # In the run's namespace, with the run's adapter; nothing of it in the base namespace.
    run_keys = Keys(a["namespace"], gw.keys.trace_partitions)
    stored = rdb.hgetall(run_keys.rollout(rid))
    assert stored["status"] == "running" and orjson.loads(stored["metadata"])["adapter"] == "run-a"
    assert rdb.get(run_keys.api_key(mine["api_key"])) == rid
    assert not rdb.exists(gw.keys.rollout(rid)) and not rdb.exists(gw.keys.api_key(mine["api_key"]))

    resp = gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(a["api_key"]))
    assert resp.status_code == 200 and resp.json()["metadata"]["adapter"] == "run-a"
    # Another run's key, and the base namespace's admin token, do not find it; run a's key does not
    # find the base namespace's rollout nor run b's.
    assert_openai_error(
        gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(b["api_key"])), 404, "rollout_not_found"
    )
    assert_openai_error(gw.http.get(f"/v1/rollouts/{rid}", headers=ADMIN_H), 404, "rollout_not_found")
    for path, body in (
        (f"/v1/rollouts/{base['rollout_id']}", None),
        (f"/v1/rollouts/{base['rollout_id']}/fail", {}),
    ):
        resp = gw.http.request(
            "POST" if body is not None else "GET", path, json=body, headers=bearer(a["api_key"])
        )
        assert_openai_error(resp, 404, "rollout_not_found")
    for verb, body in (("complete", {"reward": 1.0}), ("fail", {})):
        resp = gw.http.post(f"/v1/rollouts/{rid}/{verb}", json=body, headers=bearer(b["api_key"]))
        assert_openai_error(resp, 404, "rollout_not_found")
    assert gw.http.get(f"/v1/rollouts/{base['rollout_id']}", headers=ADMIN_H).json()["status"] == "running"

    # Run a's key completes its own rollout: the event goes to the run's stream, not the base one.
    resp = gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 0.5}, headers=bearer(a["api_key"]))
    assert resp.status_code == 200 and resp.json()["status"] == "completed"
    events = [orjson.loads(f["data"]) for _, f in rdb.xrange(run_keys.rollout_events)]
    assert [(e["rollout_id"], e["adapter"], e["reward"]) for e in events] == [(rid, "run-a", 0.5)]
    assert rid not in str(rdb.xrange(gw.keys.rollout_events))

    # A stopped run takes no new rollouts.
    gw.http.post("/v1/runs/run-b/stop", headers=ADMIN_H)
    resp = gw.http.post("/v1/rollouts", json={"task_id": "t", "group_id": "g"}, headers=bearer(b["api_key"]))
    assert_openai_error(resp, 409, "run_status")
    # A run key is no admin token: it cannot manage runs.
    assert_openai_error(gw.http.get("/v1/runs", headers=bearer(a["api_key"])), 403, "forbidden")


def test_on_a_gateway_without_an_admin_token_a_run_key_is_still_no_admin(redis_port, vllm):
    """Loopback without a token: anyone may use the run routes, except with a run's key (or a
    rollout's), which is its own run's and nothing more."""
    with InProcessGateway(gateway_settings(redis_port, vllm.url, admin_token=None)) as open_gw:
        resp = open_gw.http.post("/v1/runs", json={"run_id": "open", "config": {}})
        assert resp.status_code == 201, resp.text
        key = resp.json()["api_key"]
        assert open_gw.http.get("/v1/runs").status_code == 200
        for method, path in (("get", "/v1/runs"), ("get", "/v1/runs/open"), ("post", "/v1/runs/open/stop")):
            resp = open_gw.http.request(method, path, headers=bearer(key))
            assert_openai_error(resp, 403, "forbidden")
        assert open_gw.http.get("/v1/runs/open").json()["status"] == "created"


def _post(gw, path: str, body: dict, key: str):
    return gw.http.post(path, json=body, headers=bearer(key))


def test_the_admin_token_reaches_a_runs_rollouts_with_the_run_named(gw, rdb):
    """`?run=<run id>`: the admin token reads, rewards, completes and fails a run's rollouts (without
    it, the base namespace's, where the run's rollout is not: 404). A bad or unknown run is 400 or 404;
    a run's key naming another run, or a rollout's key naming another run than its own, finds nothing;
    every refusal in OpenAI's shape, nothing changed."""
    a, b = _create(gw, "admin-a"), _create(gw, "admin-b")
    made = [
        _post(gw, "/v1/rollouts", {"task_id": "t", "group_id": "g"}, a["api_key"]).json() for _ in range(2)
    ]
    rid, other = made[0]["rollout_id"], made[1]["rollout_id"]
    call = _post(
        gw,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        made[0]["api_key"],
    )
    assert call.status_code == 200, call.text
    call_id = call.headers["x-tether-call-id"]

    assert_openai_error(gw.http.get(f"/v1/rollouts/{rid}", headers=ADMIN_H), 404, "rollout_not_found")
    resp = gw.http.get(f"/v1/rollouts/{rid}?run=admin-a", headers=ADMIN_H)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert (got["rollout_id"], got["status"], got["calls"], got["metadata"]["adapter"]) == (
        rid,
        "running",
        1,
        "admin-a",
    )
    for query, status, code in (
        ("?run=admin-b", 404, "rollout_not_found"),  # not in that run
        ("?run=nope", 404, "run_not_found"),
        ("?run=", 400, "invalid_value"),
        ("?run=Bad%20Id", 400, "invalid_value"),
        ("?run=a:{p0}", 400, "invalid_value"),
    ):
        assert_openai_error(gw.http.get(f"/v1/rollouts/{rid}{query}", headers=ADMIN_H), status, code)
    # The run's own key, and its rollout's key, with their run named: as without; another run: 404.
    assert gw.http.get(f"/v1/rollouts/{rid}?run=admin-a", headers=bearer(a["api_key"])).status_code == 200
    assert (
        gw.http.get(f"/v1/rollouts/{rid}?run=admin-a", headers=bearer(made[0]["api_key"])).status_code == 200
    )
    for key in (a["api_key"], made[0]["api_key"], b["api_key"]):
        resp = gw.http.get(f"/v1/rollouts/{rid}?run=admin-b", headers=bearer(key))
        assert_openai_error(resp, 404)
    assert_openai_error(gw.http.get(f"/v1/rollouts/{rid}?run=admin-a"), 401)  # no key: no admin
    assert_openai_error(
        gw.http.get(f"/v1/rollouts/{rid}?run=admin-a", headers=bearer(b["api_key"])), 404, "rollout_not_found"
    )

    # Reward, complete and fail by the admin, in the run's namespace.
    resp = _post(gw, f"/v1/rollouts/{rid}/calls/{call_id}/reward?run=admin-a", {"reward": 0.5}, ADMIN)
    assert resp.status_code == 200 and resp.json()["replaced"] is False, resp.text
    resp = _post(gw, f"/v1/rollouts/{rid}/complete?run=admin-a", {"reward": 1.0}, ADMIN)
    assert resp.status_code == 200 and resp.json()["status"] == "completed", resp.text
    resp = _post(gw, f"/v1/rollouts/{other}/fail?run=admin-a", {"reason": "admin"}, ADMIN)
    assert resp.status_code == 200 and resp.json()["status"] == "failed", resp.text
    run_keys = Keys(a["namespace"], gw.keys.trace_partitions)
    events = {
        orjson.loads(f["data"])["rollout_id"]: orjson.loads(f["data"])["status"]
        for _, f in rdb.xrange(run_keys.rollout_events)
    }
    assert events == {rid: "completed", other: "failed"}
    assert rdb.hgetall(run_keys.call_rewards(rid)) == {call_id: "0.5"}
    assert rid not in str(rdb.xrange(gw.keys.rollout_events))


def test_a_key_issued_to_a_runs_services_ends_with_the_run(gw):
    """The launcher's key for a run's agent workers (Runs.issue_key) makes the run's rollouts while the
    run lives; once the run is stopped that key is answered as a key that never was, while the key
    `create` answered still reads the run's rollout (and is refused new ones: 409)."""
    from tether.launcher_runs import Registry

    made = _create(gw, "workers")
    registry = Registry(gw.settings.redis_url, gw.settings.namespace)
    try:
        issued = registry.issue_key("workers")
    finally:
        registry.close()
    resp = gw.http.post("/v1/rollouts", json={"task_id": "t", "group_id": "g"}, headers=bearer(issued))
    assert resp.status_code == 201, resp.text
    rid = resp.json()["rollout_id"]
    assert gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(issued)).status_code == 200

    assert gw.http.post("/v1/runs/workers/stop", headers=ADMIN_H).json()["status"] == "stopped"
    for method, path, body in (
        ("POST", "/v1/rollouts", {"task_id": "t", "group_id": "g"}),
        ("GET", f"/v1/rollouts/{rid}", None),
    ):
        resp = gw.http.request(method, path, json=body, headers=bearer(issued))
        never = gw.http.request(method, path, json=body, headers=bearer("trk-" + "x" * 32))
        assert resp.status_code == never.status_code >= 400 and resp.json() == never.json()
    assert gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(made["api_key"])).status_code == 200
    resp = gw.http.post(
        "/v1/rollouts", json={"task_id": "t", "group_id": "g"}, headers=bearer(made["api_key"])
    )
    assert_openai_error(resp, 409, "run_status")
