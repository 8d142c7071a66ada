"""Runs side by side on one trainer (issue 28; docs/runs.md, "Trained side by side").

One base model, frozen, and per run: its own LoRA adapter (a named peft adapter, `run-<run id>`, on the
one PeftModel), its own optimizer over that adapter's parameters only, and its own TrainerCore (buffer,
step records, version, checkpoints under `<checkpoint dir>/runs/<run id>/`). A run's step activates
its adapter (peft's set_adapter: only that adapter runs and trains), so it moves nothing of another
run, of the single policy or of the base weights. Each version of a run's adapter is published to
`<adapters dir>/<adapter>/<version>` (peft's save_pretrained), never rewritten: vLLM's record of a
request's lora_path then names the version (docs/runs.md, "Version scheme"). Version 0, the adapter
as opened, is published when a run opens, so that inference can serve the run's first rollouts.

A run's adapter is initialised from a seed of its own (the trainer's seed and the run id), so a run
starts from the same adapter whichever runs were opened before it. A run has its own hyper-parameters
(`RunPolicy`: its learning rate, its objective and their options, its sharing weight), the trainer's
settings with the run's own over them, checked by main.run_policy. `runs/<run id>/run.json` records
the run (id, adapter, its own settings, whether it was closed); a restarted trainer reopens every run
found there that was not closed, each from its newest checkpoint. Closing a run drops its adapter
and optimizer from memory; its folders stay, and opening it again resumes it.

Who may call: main.py (wiring) and tether.trainer.steps.Trainer (open, get).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from tether.common.runs import RUN_ID_RULE, valid_run_id
from tether.trainer import weights
from tether.trainer.steps import (
    RunRefused,
    RunsUnavailable,
    StepOutput,
    StepRunner,
    TrainerCore,
    UnknownRun,
    close_series,
    open_series,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.trainer.train import StepConfig

log = logging.getLogger(__name__)

RUNS_DIR = "runs"  # under the checkpoint directory: one folder per run
RUN_FILE = "run.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors")  # what vLLM loads as an adapter


# --- decisions (pure) ----------------------------------------------------------------------------------


def peft_name(run_id: str) -> str:
    """The run's adapter name inside the model: never "default" (the single policy's), never a part of
    peft's "lora_" prefix (peft then mistakes keys on load), and no "." (a module name)."""
    return f"run-{run_id}"


def run_seed(seed: int, run_id: str) -> int:
    """The seed of a run's adapter initialisation: the same for a run whatever else the trainer holds."""
    digest = hashlib.sha256(f"{seed}:{run_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 2**63


def adapter_problem(adapter: str) -> str | None:
    """What makes `adapter` unusable as a directory under the adapters directory, or None. A name with
    "/" (an organisation's model name) nests; its last part is never the version."""
    parts = adapter.split("/")
    if not adapter or adapter.startswith("/") or "\\" in adapter or "\0" in adapter:
        return f"adapter {adapter!r} is no relative path: a model name without '\\' or a leading '/'"
    if any(p in ("", ".", "..") for p in parts) or adapter != adapter.strip():
        return f"adapter {adapter!r} has an empty, '.' or '..' part or surrounding spaces"
    return None


def open_problem(run_id: str, adapter: str, adapters: dict[str, str]) -> str | None:
    """Why run `run_id` cannot be opened with `adapter`, given the open runs' adapters (`adapters`: run
    id -> adapter), or None (a run already open with that adapter is fine: OpenRun is idempotent)."""
    if not valid_run_id(run_id):
        return f"invalid run id {run_id!r}: {RUN_ID_RULE}"
    problem = adapter_problem(adapter)
    if problem:
        return problem
    if run_id in adapters and adapters[run_id] != adapter:
        return f"run {run_id} is open with adapter {adapters[run_id]!r}, not {adapter!r}"
    other = next((r for r, a in adapters.items() if a == adapter and r != run_id), None)
    if other is not None:
        return f"adapter {adapter!r} belongs to run {other}: each run publishes its own adapter's versions"
    return None


def settings_problem(run_id: str, open_with: dict[str, Any], asked: dict[str, Any]) -> str | None:
    """Why an open run cannot be opened again with the settings `asked` (as parsed), or None: a run's
    settings are fixed while it is open (close it, and open it with the new ones)."""
    if asked == open_with:
        return None
    changed = sorted(k for k in open_with.keys() | asked.keys() if open_with.get(k) != asked.get(k))
    return (
        f"run {run_id} is open with other trainer settings ({', '.join(changed)}: "
        f"{ {k: open_with.get(k) for k in changed} } open, { {k: asked.get(k) for k in changed} } asked); "
        "close it first (CloseRun) to change them"
    )


def version_dir(adapters_root: Path, adapter: str, version: int) -> Path:
    """Where version `version` of `adapter` lies: its last path component is the version."""
    return adapters_root / adapter / str(version)


@dataclass(frozen=True)
class RunPolicy:
    """A run's own hyper-parameters on the shared model (main.run_policy builds it from OpenRun's
    settings): `values`, the run's own settings as parsed (run.json keeps them; {}: all the trainer's);
    `cfg`, its step's choices; `make_optimizer(resume)`, its Adam over the active adapter's parameters
    (its moments from `resume`); `weight`, its share under the weighted sharing policy."""

    values: dict[str, Any]
    cfg: StepConfig
    make_optimizer: Callable[[weights.Resume | None], torch.optim.Optimizer]
    weight: float = 1.0


# --- a run's step --------------------------------------------------------------------------------------


class RunStepRunner(StepRunner):
    """A run's step: its adapter activated and trained by its optimizer on the shared model; its
    checkpoints hold the adapter (peft's files), its versions are published under the adapters dir."""

    def __init__(
        self,
        base: StepRunner,
        optimizer: torch.optim.Optimizer,
        cfg: StepConfig,
        run_id: str,
        adapter: str,
        adapters_root: Path,
        folder: Path,
        settings: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(base.model, base.engine, optimizer, cfg, base.d, folder, ref_model=base.ref_model)
        self.settings = settings or {}  # the run's own trainer settings (GetRunStatus shows them)
        self.run_id = run_id
        self.adapter = adapter
        self.adapter_name = peft_name(run_id)
        self.adapters_root = adapters_root

    def trained_state(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        return None, self.adapter_state()

    def save_weights(self, folder: Path, out: StepOutput, tokenizer: PreTrainedTokenizerBase) -> None:
        self.save_adapter(folder)

    def save_adapter(self, folder: Path) -> None:
        """peft's save_pretrained of this run's adapter alone, its files at the top of `folder` (peft
        puts a named adapter's files in a sub-folder of that name)."""
        weights.as_peft(self.model).save_pretrained(
            str(folder), selected_adapters=[self.adapter_name], safe_serialization=True
        )
        for name in ADAPTER_FILES:
            os.replace(folder / self.adapter_name / name, folder / name)
        shutil.rmtree(folder / self.adapter_name)

    def publish(self, checkpoint: Path, version: int) -> None:
        """Copy the adapter of the checkpoint of `version` to its version directory: a new folder by one
        rename; an existing one is refused (a version is never rewritten)."""
        final = Path(self.adapter_dir(version))
        if final.exists():
            raise FileExistsError(
                f"{final} exists: an adapter's version is never rewritten (resume the run from its "
                "checkpoints, or use a fresh TETHER_ADAPTERS_DIR)"
            )
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name in ADAPTER_FILES:
            shutil.copyfile(checkpoint / name, tmp / name)
        weights.fsync_tree(tmp)
        os.replace(tmp, final)
        weights.fsync_dir(final.parent)

    def publish_initial(self) -> None:
        """Version 0: the adapter as opened (peft's initial B = 0: the base model's outputs), published
        as every version is, unless a trainer before this one published it (the run's own seed made
        the same adapter)."""
        if Path(self.adapter_dir(0)).exists():
            return
        staging = self.checkpoint_root / f".tmp-initial-adapter-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            self.save_adapter(staging)
            self.publish(staging, 0)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def adapter_dir(self, version: int) -> str:
        return str(version_dir(self.adapters_root, self.adapter, version))

    def describe(self, version: int) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "adapter": self.adapter,
            "adapter_dir": self.adapter_dir(version),
            "settings": {k: str(v) for k, v in sorted(self.settings.items())},
        }


# --- the runs of one trainer ---------------------------------------------------------------------------


class RunSet:
    """The runs a trainer holds beside its single policy: open (or reopen) one, find one.

    `base`: the single policy's runner, whose model (a PeftModel) the runs share; `policy(settings)`: a
    run's RunPolicy from its own settings (RunRefused naming a setting it may not have); `refusal`: why
    this trainer cannot hold runs (None: it can)."""

    def __init__(
        self,
        base: StepRunner,
        tokenizer: PreTrainedTokenizerBase,
        adapters_root: Path,
        policy: Callable[[dict[str, Any]], RunPolicy],
        *,
        seed: int,
        keep: int,
        settings: dict[str, Any],
        refusal: str | None = None,
    ) -> None:
        self.base = base
        self.tokenizer = tokenizer
        self.adapters_root = adapters_root
        self.policy = policy
        self.seed = seed
        self.keep = keep
        self.settings = settings
        self.refusal = refusal
        self.root = base.checkpoint_root / RUNS_DIR
        self.cores: dict[str, TrainerCore] = {}
        self.adapters: dict[str, str] = {}  # run id -> adapter
        self.policies: dict[str, RunPolicy] = {}

    def reopen(self) -> None:
        """Every run this trainer had (runs/*/run.json) and did not close, each from its newest
        checkpoint, with the settings it was opened with."""
        for path in sorted(self.root.glob(f"*/{RUN_FILE}")):
            record = orjson.loads(path.read_bytes())
            if record.get("closed"):
                continue
            if self.refusal:
                raise SystemExit(f"{path.parent} holds run {record['run_id']}, but {self.refusal}")
            try:
                policy = self.policy(record.get("settings", {}))
            except RunRefused as exc:
                raise SystemExit(f"{path}: run {record['run_id']}'s settings: {exc}") from exc
            self._load(record["run_id"], record["adapter"], policy)

    def weight(self, run_id: str) -> float:
        """Run `run_id`'s share under the weighted sharing policy (1 for a run not open)."""
        policy = self.policies.get(run_id)
        return policy.weight if policy is not None else 1.0

    def get(self, run_id: str) -> TrainerCore:
        core = self.cores.get(run_id)
        if core is None:
            raise UnknownRun(f"run {run_id!r} is not open on this trainer (OpenRun first)")
        return core

    def open(self, run_id: str, adapter: str, settings: dict[str, Any] | None = None) -> TrainerCore:
        """Open run `run_id` with `adapter` ("" = the run id) and its own trainer `settings`; the open
        run itself when it is open with those."""
        if self.refusal:
            raise RunsUnavailable(self.refusal)
        adapter = adapter or run_id
        problem = open_problem(run_id, adapter, self.adapters)
        if problem:
            raise RunRefused(problem)
        policy = self.policy(settings or {})
        if run_id in self.cores:
            problem = settings_problem(run_id, self.policies[run_id].values, policy.values)
            if problem:
                raise RunRefused(problem)
            return self.cores[run_id]
        self._record(run_id, {"run_id": run_id, "adapter": adapter, "settings": policy.values})
        return self._load(run_id, adapter, policy)

    def close(self, run_id: str) -> bool:
        """Drop open run `run_id` from memory (its adapter, optimizer and core) and mark it closed in
        its run.json, so that a restarted trainer leaves it closed; its checkpoints, spooled groups and
        published versions stay. False when it was not open."""
        core = self.cores.pop(run_id, None)
        if core is None:
            return False
        adapter = self.adapters.pop(run_id)
        self.policies.pop(run_id)
        model = weights.as_peft(self.base.model)
        core.runner.optimizer.zero_grad(set_to_none=True)
        model.delete_adapter(peft_name(run_id))
        self.base.activate()  # what is left active is the single policy's, as without runs
        close_series(run_id)
        record = orjson.loads((self.root / run_id / RUN_FILE).read_bytes())
        self._record(run_id, {**record, "closed": True})
        if self.base.d.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("run %s closed: adapter %s left memory at version %d", run_id, adapter, core.version)
        return True

    def _record(self, run_id: str, record: dict[str, Any]) -> None:
        """Write `runs/<run id>/run.json` (by one rename)."""
        folder = self.root / run_id
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tmp-{RUN_FILE}"
        tmp.write_bytes(orjson.dumps(record))
        os.replace(tmp, folder / RUN_FILE)

    def _load(self, run_id: str, adapter: str, policy: RunPolicy) -> TrainerCore:
        """Add the run's adapter (its own seed), resume it and its optimizer from its newest checkpoint,
        and republish that version's adapter directory if a crash came between the two."""
        model = weights.as_peft(self.base.model)
        name = peft_name(run_id)
        with _seeded(run_seed(self.seed, run_id), self.base.d.device):
            model.add_adapter(name, copy.deepcopy(model.peft_config["default"]))
        model.set_adapter(name)  # its parameters alone trainable: what its optimizer takes
        folder = self.root / run_id
        weights.remove_partial(folder)
        resume = weights.latest_resumable(folder, ADAPTER_CONFIG)
        if resume is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, resume.state["adapter"], adapter_name=name)
        optimizer = policy.make_optimizer(resume)
        runner = RunStepRunner(
            self.base, optimizer, policy.cfg, run_id, adapter, self.adapters_root, folder, policy.values
        )
        open_series(run_id)
        core = TrainerCore(
            runner,
            self.tokenizer,
            folder,
            keep=self.keep,
            resumed=resume.state if resume else None,
            settings={**self.settings, **policy.values},
        )
        if resume is None:
            runner.publish_initial()
        elif not Path(runner.adapter_dir(resume.version)).exists():
            runner.publish(resume.path, resume.version)
        self.cores[run_id], self.adapters[run_id], self.policies[run_id] = core, adapter, policy
        log.info(
            "run %s: adapter %s at version %d (%d steps done), own settings %s",
            run_id,
            adapter,
            core.version,
            core.steps_done,
            policy.values or "none",
        )
        return core


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """torch's RNG seeded with `seed` inside, and as it was outside (the process's RNG goes on as if
    nothing had drawn from it)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield
