"""Runs side by side on one trainer (trainer/runs.py; docs/runs.md "Trained side by side"), on the tiny
Llama through the service's own build path: two runs trained in turn give each run exactly what it
gets alone in a fresh trainer, with its own hyper-parameters too; a run's optimizer holds and moves
only its adapter; the base weights and the single policy's adapter never move; a restarted trainer
resumes each run where it was, as if uninterrupted, and one run's checkpoints are never touched by
another's steps; each version's adapter lies in its own directory; a closed run leaves memory and
comes back where it was; waiting runs are served in the sharing policy's order; one run's failure
stops that run only; unknown runs and settings a run may not have are refused through the real gRPC
servicer."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file
from test_trainer import _model, _samples
from test_trainer_resume import tiny_model_dir, trainer_settings

from tether.common.records import SampleRecord
from tether.trainer.distributed import Dist
from tether.trainer.main import build, run_set, trainer_settings_record
from tether.trainer.runs import adapter_problem, open_problem, peft_name, run_seed, version_dir
from tether.trainer.steps import RunRefused, RunsUnavailable, Trainer, TrainerBroken, TrainerCore, UnknownRun
from tether.trainer.weights import as_peft

pytest.importorskip("peft")
torch.set_num_threads(1)

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("runs") / "model")


def _trainer(model_dir: Path, folder: Path, **overrides) -> Trainer:
    """A rank-0 trainer (single policy and runs) built and resumed by the service's own path, sharing
    its turns as main.amain has it."""
    s = trainer_settings(model_dir, folder, peak_tflops=1.0, **{**LORA, **overrides})
    d = Dist()
    runner, tokenizer, resume = build(s, d)
    core = TrainerCore(
        runner,
        tokenizer,
        folder,
        resumed=resume.state if resume else None,
        settings=trainer_settings_record(s, d),
    )
    return Trainer(
        core,
        runs=run_set(s, d, runner, tokenizer),
        step_delay_s=s.test_step_delay_s,
        sharing=s.run_sharing,
        hold_s=s.run_sharing_hold_s,
        weight=s.run_weight,
    )


def _groups(run: str, n: int) -> list[tuple[str, list[SampleRecord], int]]:
    """`n` groups of 2 rollouts x 2 sequences for `run`, each run its own data."""
    model = _model()
    offset = 1000 * (1 + sum(map(ord, run)))
    return [(f"{run}-g{g}", _samples(model, n=4, seed=offset + g), 2) for g in range(n)]


def _feed(trainer: Trainer, run: str, n: int) -> None:
    for group in _groups(run, n):
        trainer.core_of(run).submit(*group)


def _train(trainer: Trainer, run: str, step: int) -> float:
    """One step of `run` on its oldest buffered group; its loss."""
    core = trainer.core_of(run)
    plan = core.plan(step, 1, 1)
    record = core.execute(plan)
    core.finish(plan, record)
    return record.metrics["loss"]


def _adapter(trainer: Trainer, run: str) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    model = trainer.core.runner.model
    return {k: v.clone() for k, v in get_peft_model_state_dict(model, adapter_name=peft_name(run)).items()}


def _alone(
    model_dir: Path, folder: Path, run: str, adapter: str, steps: int, **settings
) -> tuple[list[float], dict]:
    """`run` trained `steps` steps alone in a fresh trainer with `settings` (its own)."""
    trainer = _trainer(model_dir, folder, **settings)
    trainer.runs.open(run, adapter)
    _feed(trainer, run, steps)
    losses = [_train(trainer, run, n) for n in range(1, steps + 1)]
    return losses, _adapter(trainer, run)


def _base_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The base model's own tensors inside the PeftModel, under the HF names."""
    base = as_peft(trainer.core.runner.model).get_base_model()
    return {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if "lora_" not in k}


def test_two_runs_in_turn_train_exactly_as_each_alone(model_dir, tmp_path):
    """A, B, A, B, A, B on one trainer: each run's losses and adapter are bitwise those of the run alone
    in a fresh trainer; the published versions hold them; the base weights and the single policy's
    adapter are as loaded."""
    alone = {
        run: _alone(model_dir, tmp_path / f"alone-{run}", run, adapter, 3)
        for run, adapter in (("a", "calc"), ("b", "instr"))
    }
    both = _trainer(model_dir, tmp_path / "both")
    default_before = {k: v.clone() for k, v in both.core.runner.adapter_state().items()}
    for run, adapter in (("a", "calc"), ("b", "instr")):
        both.runs.open(run, adapter)
        _feed(both, run, 3)
    losses: dict[str, list[float]] = {"a": [], "b": []}
    for n in (1, 2, 3):
        for run in ("a", "b"):
            losses[run].append(_train(both, run, n))
    for run, adapter in (("a", "calc"), ("b", "instr")):
        assert losses[run] == alone[run][0], run
        mine = _adapter(both, run)
        assert mine.keys() == alone[run][1].keys()
        for k in mine:
            assert torch.equal(mine[k], alone[run][1][k]), (run, k)
        published = load_file(
            version_dir(tmp_path / "both" / "adapters", adapter, 3) / "adapter_model.safetensors"
        )
        assert published.keys() == mine.keys()
        assert all(torch.equal(published[k], mine[k]) for k in mine)
    assert losses["a"] != losses["b"]  # each its own data and adapter
    loaded = load_file(model_dir / "model.safetensors")
    base = _base_weights(both)
    assert base.keys() == loaded.keys()
    for k in base:
        assert torch.equal(base[k], loaded[k]), k
    default_after = both.core.runner.adapter_state()
    assert all(torch.equal(default_after[k], v) for k, v in default_before.items())
    assert both.core.version == 0 and both.core.status()["buffered_groups"] == 0


def test_a_runs_optimizer_holds_and_moves_only_its_adapter(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path / "t")
    for run in ("a", "b"):
        trainer.runs.open(run, "")
        _feed(trainer, run, 2)
    params = dict(as_peft(trainer.core.runner.model).named_parameters())

    def held(run: str) -> set[str]:
        ids = {id(p) for g in trainer.core_of(run).runner.optimizer.param_groups for p in g["params"]}
        return {name for name, p in params.items() if id(p) in ids}

    for run in ("a", "b"):
        names = held(run)
        assert names and all(f".{peft_name(run)}." in n for n in names), run
        assert names == {n for n in params if f".{peft_name(run)}." in n}
    _train(trainer, "a", 1)
    a_state = {k: v["exp_avg"].clone() for k, v in trainer.core_of("a").runner.optimizer.state.items()}
    a_adapter = _adapter(trainer, "a")
    _train(trainer, "b", 1)
    after = trainer.core_of("a").runner.optimizer.state
    assert after.keys() == a_state.keys() and all(
        torch.equal(after[k]["exp_avg"], v) for k, v in a_state.items()
    )
    assert all(torch.equal(v, a_adapter[k]) for k, v in _adapter(trainer, "a").items())
    assert not trainer.core_of("b").runner.optimizer.state.keys() & a_state.keys()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_each_run_resumes_where_it_was_and_matches_an_uninterrupted_trainer(model_dir, tmp_path):
    order = [("a", 1), ("b", 1), ("a", 2), ("a", 3), ("b", 2)]  # a restart after the first three
    straight = _trainer(model_dir, tmp_path / "straight")
    for run in ("a", "b"):
        straight.runs.open(run, f"{run}-lora")
        _feed(straight, run, 3)
    straight_losses = [_train(straight, run, n) for run, n in order]

    first = _trainer(model_dir, tmp_path / "x")
    for run in ("a", "b"):
        first.runs.open(run, f"{run}-lora")
        _feed(first, run, 3)
    losses = [_train(first, run, n) for run, n in order[:2]]
    b_checkpoint = _files(tmp_path / "x" / "runs" / "b")
    losses.append(_train(first, "a", 2))
    assert _files(tmp_path / "x" / "runs" / "b") == b_checkpoint  # a's step touches nothing of b's
    del first

    second = _trainer(model_dir, tmp_path / "x")
    assert {r: second.core_of(r).version for r in ("a", "b")} == {"a": 2, "b": 1}
    assert list(second.core_of("a").groups) == ["a-g2"] and list(second.core_of("b").groups) == [
        "b-g1",
        "b-g2",
    ]
    assert second.runs.open("a", "a-lora") is second.core_of("a")  # idempotent
    losses += [_train(second, run, n) for run, n in order[3:]]
    assert losses == straight_losses
    for run in ("a", "b"):
        ours, theirs = _adapter(second, run), _adapter(straight, run)
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], atol=1e-7, rtol=0, msg=k)
    assert sorted(p.name for p in (tmp_path / "x" / "adapters" / "a-lora").iterdir()) == ["0", "1", "2", "3"]
    status = second.core_of("a").status()
    assert status["adapter_dir"] == str(tmp_path / "x" / "adapters" / "a-lora" / "3")
    assert status["run_id"] == "a" and status["adapter"] == "a-lora" and status["steps_done"] == 3


def test_a_published_version_is_never_rewritten(model_dir, tmp_path):
    """A second trainer (fresh checkpoints) publishing into the same ADAPTERS_DIR: its version 1 finds
    the first one's folder and stops the run rather than replace what vLLM may serve."""
    adapters = tmp_path / "adapters"
    published = adapters / "calc" / "1"
    for folder in ("first", "second"):
        trainer = _trainer(model_dir, tmp_path / folder, adapters_dir=str(adapters))
        trainer.runs.open("a", "calc")
        _feed(trainer, "a", 1)
        if folder == "first":
            _train(trainer, "a", 1)
            before = _files(published)
        else:
            with pytest.raises(TrainerBroken, match="never rewritten"):
                _train(trainer, "a", 1)
    # Version 0, the adapter as opened, the second trainer found there and left (the same seed made it).
    assert _files(published) == before and sorted(p.name for p in (adapters / "calc").iterdir()) == ["0", "1"]


def test_run_decisions():
    assert open_problem("a", "calc", {}) is None
    assert open_problem("a", "calc", {"a": "calc"}) is None  # opened again as it is
    assert "invalid run id" in open_problem("A!", "calc", {})
    assert "open with adapter 'calc'" in open_problem("a", "other", {"a": "calc"})
    assert "belongs to run b" in open_problem("a", "calc", {"b": "calc"})
    assert adapter_problem("org/model") is None
    for bad in ("", "/abs", "a/../b", "a//b", ".", " x", "a\\b"):
        assert adapter_problem(bad), bad
    assert run_seed(0, "a") == run_seed(0, "a") != run_seed(0, "b") != run_seed(1, "b")
    assert version_dir(Path("/ad"), "calc", 4) == Path("/ad/calc/4")
    assert peft_name("lo") == "run-lo"  # never a part of peft's "lora_" prefix


async def _refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def _registrar(servicer):
    from tether.v1 import trainer_pb2, trainer_pb2_grpc

    def register(server):
        trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
        return [trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name]

    return register


async def test_runs_through_the_real_grpc_servicer(model_dir, tmp_path):
    from test_trainer_resume import group_requests

    from tether.common.grpc_server import start_server
    from tether.trainer.servicer import TrainerServicer
    from tether.v1 import trainer_pb2, trainer_pb2_grpc, types_pb2

    trainers = {
        "lora": _trainer(model_dir, tmp_path / "lora"),
        "full": _trainer(model_dir, tmp_path / "full", lora_rank=0),
    }
    servers, stubs = [], {}
    for name, trainer in trainers.items():
        server, _, port = await start_server(0, _registrar(TrainerServicer(trainer)))
        servers.append(server)
        stubs[name] = trainer_pb2_grpc.TrainerStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))

    async def code(call) -> grpc.StatusCode:
        return (await _refusal(call)).code()

    stub = stubs["lora"]
    group = group_requests(1)[0]
    try:
        opened = await stub.OpenRun(trainer_pb2.OpenRunRequest(run_id="calc"))
        assert (opened.run_id, opened.adapter, opened.weight_version) == ("calc", "calc", 0)
        initial = tmp_path / "lora" / "adapters" / "calc" / "0"  # the adapter as opened, for vLLM
        assert opened.adapter_dir == str(initial)
        assert sorted(p.name for p in initial.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        assert await code(stub.OpenRun(trainer_pb2.OpenRunRequest(run_id="calc", adapter="x"))) == invalid
        assert await code(stub.OpenRun(trainer_pb2.OpenRunRequest(run_id="b", adapter="calc"))) == invalid
        assert await code(stub.OpenRun(trainer_pb2.OpenRunRequest(run_id="Bad!"))) == invalid
        assert await code(stub.OpenRun(trainer_pb2.OpenRunRequest(run_id="x", adapter="../x"))) == invalid
        # A run's own settings: what may differ per run is taken; a setting that shapes the shared model
        # or the process, unknown or badly valued, or a KL term without the reference model, refused
        # and named; nothing of the refused run is left behind.
        for settings, named in (
            ({"lora_rank": "8"}, "lora_rank"),
            ({"model_dir": "/elsewhere", "lr": "0.5"}, "model_dir"),
            ({"lr": "fast"}, "lr"),
            ({"lrr": "1"}, "lrr"),
            ({"mask_low": "3"}, "(section)"),
            ({"kl_coef": "0.1"}, "kl_coef"),
        ):
            err = await _refusal(stub.OpenRun(trainer_pb2.OpenRunRequest(run_id="other", settings=settings)))
            assert err.code() == invalid and f"trainer.{named}" in err.details(), (settings, err.details())
        assert not (tmp_path / "lora" / "runs" / "other").exists()
        same = trainer_pb2.OpenRunRequest(run_id="same", settings={"lora_rank": "4", "lr": "0.5"})
        assert dict((await stub.OpenRun(same)).settings) == {"lr": "0.5"}  # lora_rank: the trainer's own
        assert dict((await stub.OpenRun(same)).settings) == {"lr": "0.5"}  # idempotent
        other_lr = trainer_pb2.OpenRunRequest(run_id="same", settings={"lr": "0.25"})
        assert "close it first" in (await _refusal(stub.OpenRun(other_lr))).details()
        # Closed (idempotent), it is gone until opened again, then with the settings asked now.
        assert (await stub.CloseRun(trainer_pb2.CloseRunRequest(run_id="same"))).closed
        assert not (await stub.CloseRun(trainer_pb2.CloseRunRequest(run_id="same"))).closed
        assert not (await stub.CloseRun(trainer_pb2.CloseRunRequest(run_id="never"))).closed
        missing = grpc.StatusCode.NOT_FOUND
        assert await code(stub.GetRunStatus(trainer_pb2.RunStatusRequest(run_id="same"))) == missing
        assert dict((await stub.OpenRun(other_lr)).settings) == {"lr": "0.25"}
        group.run_id = "nope"
        assert await code(stub.SubmitGroup(group)) == missing
        assert (
            await code(stub.TrainStep(trainer_pb2.TrainStepRequest(step=1, min_groups=1, run_id="nope")))
            == missing
        )
        assert await code(stub.GetRunStatus(trainer_pb2.RunStatusRequest(run_id="nope"))) == missing
        assert (
            await code(stub.PushWeights(trainer_pb2.PushWeightsRequest(version=1, run_id="nope"))) == missing
        )
        group.run_id = "calc"
        assert (await stub.SubmitGroup(group)).buffered_groups == 1
        trained = await stub.TrainStep(trainer_pb2.TrainStepRequest(step=1, min_groups=1, run_id="calc"))
        where = tmp_path / "lora" / "adapters" / "calc" / "1"
        assert trained.weight_version == 1 and trained.adapter_dir == str(where)
        assert sorted(p.name for p in where.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        pushed = await stub.PushWeights(trainer_pb2.PushWeightsRequest(version=1, run_id="calc"))
        assert pushed.adapter_dir == str(where)
        stale = stub.PushWeights(trainer_pb2.PushWeightsRequest(version=2, run_id="calc"))
        assert await code(stale) == grpc.StatusCode.FAILED_PRECONDITION
        status = await stub.GetRunStatus(trainer_pb2.RunStatusRequest(run_id="calc"))
        assert (status.weight_version, status.adapter_dir) == (1, str(where))
        assert time.time() - 60 < status.last_step_time <= time.time() and status.steps_per_minute > 0
        # A run whose loss is normalised by the intended batch: a step of 1 group meant as 4 weighs 1/4
        # (the scheduler says what it meant in each TrainStep); the other run's steps are its own.
        short = trainer_pb2.OpenRunRequest(run_id="short", settings={"loss_denominator": "intended"})
        assert dict((await stub.OpenRun(short)).settings) == {"loss_denominator": "intended"}
        group.run_id = "short"
        assert (await stub.SubmitGroup(group)).buffered_groups == 1
        meant = trainer_pb2.TrainStepRequest(step=1, min_groups=1, run_id="short", intended_groups=4)
        assert (await stub.TrainStep(meant)).metrics["loss_scale"] == 0.25
        assert trained.metrics["loss_scale"] == 1.0  # run calc: its own batch
        single = await stub.GetStatus(types_pb2.Empty())  # the single policy: untouched
        assert (single.weight_version, single.run_id, single.buffered_groups) == (0, "", 0)
        refused = stubs["full"].OpenRun(trainer_pb2.OpenRunRequest(run_id="calc"))
        assert await code(refused) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        for server in servers:
            await server.stop(0)
    with pytest.raises(UnknownRun):
        trainers["full"].core_of("calc")
    with pytest.raises(RunRefused):
        trainers["lora"].runs.open("calc", "other")
    with pytest.raises(RunsUnavailable):
        trainers["full"].runs.open("calc", "")


def test_runs_with_their_own_settings_train_as_each_alone_on_a_trainer_with_them(model_dir, tmp_path):
    """On a trainer whose own lr is 0.01 and objective PPO: run a at lr 0.02, run b at lr 0.005 with
    CISPO and no lower clip, trained in turn: each gives bitwise the losses and adapter it gives alone in
    a trainer with those settings as its own; the single policy keeps the trainer's."""
    own = {"a": {"lr": 0.02}, "b": {"lr": 0.005, "policy_loss": "cispo", "clip_low": 1.0}}
    alone = {run: _alone(model_dir, tmp_path / f"alone-{run}", run, run, 2, **own[run]) for run in own}
    both = _trainer(model_dir, tmp_path / "both")
    for run, settings in own.items():
        both.runs.open(run, "", {k: str(v) for k, v in settings.items()})
        _feed(both, run, 2)
    losses: dict[str, list[float]] = {"a": [], "b": []}
    for n in (1, 2):
        for run in own:
            losses[run].append(_train(both, run, n))
    for run in own:
        assert losses[run] == alone[run][0], run
        mine = _adapter(both, run)
        assert mine.keys() == alone[run][1].keys()
        assert all(torch.equal(mine[k], alone[run][1][k]) for k in mine), run
    assert [g["lr"] for g in both.core_of("a").runner.optimizer.param_groups] == [0.02]
    assert [g["lr"] for g in both.core.runner.optimizer.param_groups] == [0.01]
    assert both.core_of("b").runner.cfg.policy_loss == "cispo" and both.core.runner.cfg.policy_loss == "ppo"
    assert both.core_of("b").status()["settings"] == {
        "clip_low": "1.0",
        "lr": "0.005",
        "policy_loss": "cispo",
    }
    # The run's checkpoint records its own settings; a restarted trainer reopens it with them.
    again = _trainer(model_dir, tmp_path / "both")
    assert [g["lr"] for g in again.core_of("b").runner.optimizer.param_groups] == [0.005]
    assert again.core_of("b").runner.cfg.policy_loss == "cispo"


def test_a_closed_run_leaves_memory_and_comes_back_where_it_was(model_dir, tmp_path):
    """Closed after one step: its optimizer is collected, the model holds the parameters it held
    before the run opened, its series leave the exposition, a restarted trainer does not reopen it;
    opened again it resumes from its checkpoint and ends as a run never closed."""
    run = "closing"
    straight = _trainer(model_dir, tmp_path / "straight")
    straight.runs.open(run, "")
    _feed(straight, run, 2)
    straight_losses = [_train(straight, run, n) for n in (1, 2)]

    trainer = _trainer(model_dir, tmp_path / "t")
    model = trainer.core.runner.model
    before = {n: p.numel() for n, p in model.named_parameters()}
    trainer.runs.open(run, "")
    _feed(trainer, run, 2)
    steps = REGISTRY.get_sample_value("tether_trainer_steps_total", {"run": run})
    losses = [_train(trainer, run, 1)]
    assert REGISTRY.get_sample_value("tether_trainer_steps_total", {"run": run}) == steps + 1
    optimizer = weakref.ref(trainer.core_of(run).runner.optimizer)
    assert asyncio.run(trainer.close_run(run)) is True
    gc.collect()
    assert optimizer() is None
    assert {n: p.numel() for n, p in model.named_parameters()} == before
    assert peft_name(run) not in as_peft(model).peft_config
    assert REGISTRY.get_sample_value("tether_trainer_steps_total", {"run": run}) is None
    assert REGISTRY.get_sample_value("tether_trainer_weight_version", {"run": run}) is None
    with pytest.raises(UnknownRun):
        trainer.core_of(run)
    assert asyncio.run(trainer.close_run(run)) is False  # idempotent
    with pytest.raises(UnknownRun):
        _trainer(model_dir, tmp_path / "t").core_of(run)  # a restart leaves it closed
    core = trainer.runs.open(run, "")
    assert core.version == 1 and list(core.groups) == [f"{run}-g1"]
    losses.append(_train(trainer, run, 2))
    assert losses == straight_losses
    ours, theirs = _adapter(trainer, run), _adapter(straight, run)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-7, rtol=0, msg=k)


async def _until(check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_waiting_runs_are_served_in_the_sharing_policys_order(model_dir, tmp_path):
    """Steps through Trainer.train (each in its worker thread), as the servicer calls it.
    Round-robin: while a's first step trains, a's second, then b's and c's arrive: b and c go first (in
    arrival order a second step of a would). Weighted 3:1, each run asking again only when its step
    returned (as its scheduler does): a three steps to b's one, once b's first step evened the start."""
    rr = _trainer(model_dir, tmp_path / "rr", test_step_delay_s=0.3)
    for run in ("a", "b", "c"):
        rr.runs.open(run, "")
        _feed(rr, run, 2)
    tasks = [asyncio.create_task(rr.train(1, 1, 1, [], [], "a"))]
    await _until(lambda: rr.turns.busy)
    for run, step in (("a", 2), ("b", 1), ("c", 1)):
        tasks.append(asyncio.create_task(rr.train(step, 1, 1, [], [], run)))
        waiting = len(tasks) - 1
        await _until(lambda: len(rr.turns.waiting) == waiting)  # noqa: B023 (awaited at once)
    await asyncio.gather(*tasks)
    assert rr.turns.order == ["a", "b", "c", "a"]
    assert [rr.core_of(r).version for r in ("a", "b", "c")] == [2, 1, 1]

    weighted = _trainer(model_dir, tmp_path / "w", run_sharing="weighted", run_sharing_hold_s=30.0)
    steps = {"a": 6, "b": 2}
    for run, weight in (("a", "3"), ("b", "1")):
        weighted.runs.open(run, "", {"run_weight": weight})
        _feed(weighted, run, steps[run])

    async def scheduler(run: str) -> None:
        for n in range(1, steps[run] + 1):
            await weighted.train(n, 1, 1, [], [], run)

    started = time.monotonic()
    await asyncio.gather(scheduler("a"), scheduler("b"))
    assert "".join(weighted.turns.order) == "abaabaaa"
    assert time.monotonic() - started < 30  # never held for a run that was not coming back


async def test_one_runs_failure_stops_that_run_only(model_dir, tmp_path):
    """Run bad's step cannot publish its version (the folder is taken): its core stops and its calls
    answer UNAVAILABLE, while run good and the single policy train on and the trainer's health (the
    servicer's on_broken) is left alone."""
    from tether.common.grpc_server import start_server
    from tether.trainer.servicer import TrainerServicer
    from tether.v1 import trainer_pb2, trainer_pb2_grpc

    trainer = _trainer(model_dir, tmp_path / "t")
    for run in ("bad", "good"):
        trainer.runs.open(run, "")
        _feed(trainer, run, 2)
    trainer.core.submit(*_groups("single", 1)[0])
    (tmp_path / "t" / "adapters" / "bad" / "1").mkdir(parents=True)
    broken: list[bool] = []

    async def on_broken() -> None:
        broken.append(True)

    server, _, port = await start_server(0, _registrar(TrainerServicer(trainer, on_broken=on_broken)))
    stub = trainer_pb2_grpc.TrainerStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    try:
        for step in (1, 2):  # stopped: its next step too
            err = await _refusal(
                stub.TrainStep(trainer_pb2.TrainStepRequest(step=step, min_groups=1, run_id="bad"))
            )
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        good = await stub.TrainStep(trainer_pb2.TrainStepRequest(step=1, min_groups=1, run_id="good"))
        single = await stub.TrainStep(trainer_pb2.TrainStepRequest(step=1, min_groups=1))
        assert (good.weight_version, single.weight_version) == (1, 1)
        assert broken == [] and trainer.core.broken is None and trainer.core_of("good").broken is None
    finally:
        await server.stop(0)
