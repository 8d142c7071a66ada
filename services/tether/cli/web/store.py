"""What `tether ui` shows, read where the `tether` commands read it: the run directory's metrics.jsonl
(else the metrics stream), and the run's Redis through tether.cli.inspection's readers (the streams
`tether samples` and `tether metrics` print, the trace partitions `tether traces` prints) and the
Keys the merger writes its verdicts to. Nothing is copied or cached: every page reads afresh.

Which groups a step trained is not recorded with the step: `groups_of_step` takes the group results
that finished after the previous step's record and up to this one's (exact in the sync modes, where a
step waits for its groups; in the async modes a group finishing while a step trains is shown with that
step although the next one trains it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.cli import inspection


def groups_of_step(metrics: Sequence[dict], results: Sequence[dict], step: int) -> list[dict]:
    """The non-evaluation group results of `step` (pure): those its record names (`group_ids`, in its
    order; a group's last result where it has several); for a record without them (a run before they
    were recorded), those finished after the previous step record's time and no later than this one's.
    [] for a step not in `metrics`."""
    steps = sorted((m for m in metrics if "step" in m), key=lambda m: m["step"])
    for i, record in enumerate(steps):
        if record["step"] != step:
            continue
        if "group_ids" in record:
            latest = {g["group_id"]: g for g in results if not g.get("eval")}
            return [latest[gid] for gid in record["group_ids"] if gid in latest]
        since = steps[i - 1]["time"] if i else float("-inf")
        until = record["time"]
        return [g for g in results if not g.get("eval") and since < float(g.get("finished_at", 0)) <= until]
    return []


def first_advantage(sample: dict) -> float | None:
    """The advantage of a sample's first trained token (one per sequence under the group estimators)."""
    for mask, advantage in zip(sample["loss_mask"], sample["advantages"], strict=False):
        if mask:
            return float(advantage)
    return None


@dataclass
class UiStore:
    """The run `tether ui` shows. `redis_url` None: the stack's Redis is not available (a run directory
    alone), and only metrics.jsonl is shown. `decode(id)` is a token's text (None: ids only)."""

    run_dir: Path | None
    redis_url: str | None
    namespace: str
    decode: Callable[[int], str] | None = None

    @property
    def has_redis(self) -> bool:
        return self.redis_url is not None

    async def metrics(self) -> list[dict]:
        """The step records: metrics.jsonl when the run directory has one, else the metrics stream."""
        from tether.cli.demo import read_metrics

        if self.run_dir is not None and (self.run_dir / "metrics.jsonl").exists():
            return read_metrics(self.run_dir / "metrics.jsonl")
        return await self._stream("metrics")

    async def _stream(self, name: str, keep: Callable[[dict], bool] = lambda rec: True) -> list[dict]:
        if self.redis_url is None:
            return []
        return await inspection.stream_records(name, self.redis_url, self.namespace, keep)

    async def group_results(self) -> list[dict]:
        return await self._stream("group_results")

    async def rollout_events(self, keep: Callable[[dict], bool]) -> list[dict]:
        return await self._stream("rollout_events", keep)

    async def samples(self, rollout: str | None = None, group: str | None = None) -> list[dict]:
        """The samples `tether samples --rollout/--group` prints (the same reader and filter)."""
        return await self._stream("samples", inspection.sample_filter(rollout, group))

    async def traces(self, rollout_id: str) -> list[dict]:
        """The rollout's recorded calls, as `tether traces --rollout` prints them."""
        if self.redis_url is None:
            return []
        return await inspection.trace_records(self.redis_url, self.namespace, None, rollout_id)

    async def mismatches(self, call_ids: Sequence[str]) -> list[dict]:
        """The merger's prefix-mismatch examples of these calls (`tether samples --mismatches`'s
        records): the calls whose prompt continued no sequence of their rollout, so forked one."""
        if self.redis_url is None or not call_ids:
            return []
        wanted = set(call_ids)
        records = await inspection.mismatch_records(self.redis_url, self.namespace)
        return [rec for rec in records if rec.get("call_id") in wanted]

    async def outcomes(self, rollout_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The merger's TrainingOutcome of each rollout that has one (Keys.rollout_training)."""
        if self.redis_url is None or not rollout_ids:
            return {}
        from tether.common import broker
        from tether.common.records import TrainingOutcome

        r = broker.connect(self.redis_url)
        try:
            keys = await inspection.trace_keys(r, self.namespace, None)
            raw = await r.mget([keys.rollout_training(rid) for rid in rollout_ids])
        finally:
            await r.aclose()
        return {
            rid: TrainingOutcome.from_json(value).to_dict()
            for rid, value in zip(rollout_ids, raw, strict=True)
            if value
        }

    def token_text(self, token_id: int) -> str | None:
        return self.decode(token_id) if self.decode is not None else None


def tokenizer_decode(model_dir: str | None) -> Callable[[int], str] | None:
    """One token's text with the model's tokenizer (transformers, imported here), memoised; None when
    there is no model directory or it has no tokenizer."""
    if not model_dir or not Path(model_dir).exists():
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, ImportError):
        return None
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = str(tokenizer.decode([token_id], skip_special_tokens=False))
        return cache[token_id]

    return decode
