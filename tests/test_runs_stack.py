"""A run's scheduler on the real stack (issue 28; docs/runs.md, "What works now"): the run made through
the gateway's registry, a real trainer holding it as a LoRA adapter of the calculator model, the
inference control adapter over a real vLLM-CPU with LoRA on and Tether's plugin, and the run's
scheduler (its `Run`, as scheduler.main builds it for a run's namespace) opening the run (version 0,
the adapter as opened) and pushing two versions.

Each version must be what vLLM serves the run's calls with, as the plugin's adapter spans in the
gateway's trace say (adapter and version), and the version the run's gate records the calls under;
the run's own admission is paused around each load while the base namespace's calls go on unpaused;
a restarted scheduler (its start again) finds vLLM serving the newest version and loads nothing."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import vllm_cpu
from gateway_helpers import ADMIN, InProcessGateway, bearer, gateway_settings, wait_traces
from test_trainer_runs import _groups, _registrar, _trainer

from tether.common import broker
from tether.common.grpc_server import start_server
from tether.common.vllm_client import VLLMControl
from tether.inference.servicer import InferenceServicer
from tether.merger.main import trainer_submitter
from tether.scheduler.config import RunConfig, Stubs
from tether.scheduler.gateways import RunGate
from tether.scheduler.main import run_adapter
from tether.scheduler.run import Run
from tether.trainer.servicer import TrainerServicer
from tether.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2_grpc, types_pb2

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

RUN, ADAPTER = "calc", "calc-lora"
CHECK_S = 0.05  # the gateway's TETHER_ADMISSION_CHECK_S, and the scheduler's


@pytest.fixture(scope="module")
def model_dir():
    from tether.cli import prepare_calculator_model

    return prepare_calculator_model(0)


@pytest.fixture(scope="module")
def lora_vllm(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-runs") / "vllm.log"
    # One run's adapter, and its next version beside it while calls finish on the old one.
    with vllm_cpu.lora_server(model_dir, log, max_loras=2, max_cpu_loras=4) as url:
        yield url


def _inference_registrar(servicer):
    def register(server):
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        return [inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name]

    return register


def _trace(gw: InProcessGateway, rdb, run_key: str | None = None, keys: broker.Keys | None = None) -> dict:
    """One greedy completions call in a new rollout (the run's, made with `run_key`; else the base
    namespace's) and its trace."""
    if run_key is None:
        rollout, keys = gw.new_rollout(), gw.keys
    else:
        body = {"task_id": "t", "group_id": f"g-{time.monotonic_ns()}"}
        made = gw.http.post("/v1/rollouts", json=body, headers=bearer(run_key))
        assert made.status_code == 201, made.text
        rollout = made.json()
    body = {"model": vllm_cpu.MODEL, "prompt": "12+7=", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    resp = gw.http.post("/v1/completions", json=body, headers=bearer(rollout["api_key"]), timeout=120)
    assert resp.status_code == 200, resp.text
    assert keys is not None
    [trace] = wait_traces(rdb, keys, rollout["rollout_id"])
    assert trace["status"] == "ok", trace["error"]
    return trace


def _served_by(trace: dict) -> list[tuple[str, str]]:
    return [(s["adapter"], s["version"]) for s in trace["adapter_spans"]]


class Watch:
    """Samples, every few milliseconds while a push runs, the run's admission key and the base
    namespace's gate (the gateway's own, through its GatewayControl)."""

    def __init__(self, gw: InProcessGateway, rdb, run_keys: broker.Keys) -> None:
        self.gw, self.rdb, self.run_keys = gw, rdb, run_keys
        self.run_paused: set[bool] = set()
        self.base_paused: set[bool] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.run_paused.add(self.rdb.get(self.run_keys.admission) == "paused")
            self.base_paused.add(self.gw.control.GetAdmission(types_pb2.Empty()).paused)
            time.sleep(0.005)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


async def test_a_runs_scheduler_serves_each_adapter_version_and_pauses_only_its_run(
    lora_vllm, model_dir, redis_port, rdb, tmp_path
):
    settings = gateway_settings(
        redis_port, lora_vllm, upstream_model=vllm_cpu.MODEL, admission_check_s=CHECK_S, admission_wait_s=30
    )
    with InProcessGateway(settings) as gw:
        made = gw.http.post(
            "/v1/runs", json={"run_id": RUN, "adapter": ADAPTER, "config": {}}, headers=bearer(ADMIN)
        )
        assert made.status_code == 201, made.text
        run_key, namespace = made.json()["api_key"], made.json()["namespace"]
        run_keys = broker.Keys(namespace, gw.keys.trace_partitions)

        trainer = _trainer(model_dir, tmp_path / "trainer", lora_rank=8, lora_alpha=16.0)
        vllm = VLLMControl(lora_vllm)
        servers = [
            (await start_server(0, _registrar(TrainerServicer(trainer))))[::2],
            (await start_server(0, _inference_registrar(InferenceServicer(vllm, str(model_dir)))))[::2],
        ]
        (trainer_server, trainer_port), (inference_server, inference_port) = servers
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in (trainer_port, inference_port)]
        trainer_stub = trainer_pb2_grpc.TrainerStub(channels[0])
        inference_stub = inference_pb2_grpc.InferenceStub(channels[1])
        r = broker.connect(f"redis://127.0.0.1:{redis_port}")
        try:
            # As scheduler.main does for a run's namespace: the run and its adapter from the registry.
            run_id, adapter, settings = await run_adapter(r, namespace)
            assert (run_id, adapter, settings) == (RUN, ADAPTER, {})
            cfg = RunConfig(
                run_id="sched-calc",
                steps=2,
                tasks_per_step=1,
                group_size=2,
                seed=0,
                run_dir=tmp_path / "run",
                mode="disaggregated-async",
                trainer_run_id=run_id,
                adapter=adapter,
            )
            stubs = Stubs(
                gateway=RunGate(r, run_keys, hold_s=2 * CHECK_S),
                inference=inference_stub,
                trainer=trainer_stub,
            )
            cfg.run_dir.mkdir()
            run = Run(r, run_keys, cfg, stubs, [])
            assert await run.start_run() == 0  # opens the run on the trainer and loads its version 0
            assert trainer.core_of(RUN).version == 0
            first = await asyncio.to_thread(_trace, gw, rdb, run_key, run_keys)
            assert _served_by(first) == [(ADAPTER, "0")] and first["weight_version"] == 0
            submit = trainer_submitter(trainer_stub, run_id)  # the run's merger's hand-over
            groups = _groups(RUN, 2)
            for step, version in ((0, 1), (1, 2)):
                await submit(*groups[step])
                with Watch(gw, rdb, run_keys) as watch:
                    # A base-namespace call while the run pushes: never held.
                    base = asyncio.create_task(asyncio.to_thread(_trace, gw, rdb))
                    await run.push(step, [groups[step][0]], colocated=False)
                    base_trace = await base
                assert watch.run_paused == {True, False}, "the run's gate was not paused around the load"
                assert watch.base_paused == {False}
                assert _served_by(base_trace) == [("", "")]
                assert run.state.weight_version == version and run.push_path == "adapter"
                served = await vllm.served_adapters()
                assert served[ADAPTER] == str(tmp_path / "trainer" / "adapters" / ADAPTER / str(version))
                trace = await asyncio.to_thread(_trace, gw, rdb, run_key, run_keys)
                assert _served_by(trace) == [(ADAPTER, str(version))]
                assert trace["weight_version"] == version  # the run's gate took the saved version
            assert rdb.get(gw.keys.admission) is None

            # A restarted scheduler: the trainer answers the run where it is, vLLM serves that version
            # already (the plugin would refuse loading its path again), and calls go on on it.
            again = Run(r, run_keys, cfg, stubs, [])
            await again.start_run()
            assert again.state.weight_version == 2
            trace = await asyncio.to_thread(_trace, gw, rdb, run_key, run_keys)
            assert _served_by(trace) == [(ADAPTER, "2")]
        finally:
            await r.aclose()
            for ch in channels:
                await ch.close()
            for server, _ in servers:
                await server.stop(0)
            await vllm.close()
