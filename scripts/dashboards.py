"""Tether's Grafana dashboards and Prometheus alert rules, as code: the one source both compose
(Grafana provisioning, Prometheus rule_files) and the Helm chart (ConfigMaps) read.

Run: python scripts/dashboards.py [--check]
It writes helm/tether/dashboards/<name>.json and helm/tether/alerts/tether-alerts.yaml. --check
regenerates in memory and exits 1 when a committed file differs, is missing, or is not generated here.

Conventions every panel follows (tests/test_dashboards.py checks them on the written files): the
datasource is the `datasource` template variable; every rate/increase window is `$__rate_interval`; a
ratio divides by `clamp_min(..., 1e-9)` so an idle window reads 0, not NaN; the description says what the
panel shows and ends with the metrics it queries (derived from the expressions, so it cannot drift).
Plain dictionaries, no SDK: the JSON is small and this keeps the output byte-stable.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "helm" / "tether" / "dashboards"
ALERTS_FILE = ROOT / "helm" / "tether" / "alerts" / "tether-alerts.yaml"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)
# Series Prometheus makes itself (not in any /metrics page): left out of used_metrics().
PROMETHEUS_SERIES = frozenset({"up"})
# Each component's weight-version series (a selector): the trainer's single policy's (`run=""`), since
# each run's adapter has a version chain of its own.
WEIGHT_VERSIONS = {
    "gateway": "tether_gateway_weight_version",
    "inference": "tether_inference_weight_version",
    "trainer": 'tether_trainer_weight_version{run=""}',
    "scheduler": "tether_scheduler_weight_version",
}


# Series that carry `run` (docs/metrics.md): the trainer's of a policy's steps, the gateway's of recorded
# calls, and every series of a run's own services (its scheduler, merger and agent workers), which the run
# host labels with it. A
# dashboard that queries any of them gets the `run` variable, and each of their selectors `run=~"$run"`:
# "All" (`.*`) also matches a series without the label (the base namespace's, the single policy's).
RUN_SERIES = re.compile(
    r"\b(tether_(?:run|merger|broker|scheduler|agent)_\w+|"
    r"tether_gateway_(?:traces_total|prompt_tokens_total|completion_tokens_total|"
    r"run_calls_in_flight|run_calls_waiting|run_share_refused_total|run_replicas)|"
    r"tether_trainer_(?:steps_total|step_seconds|"
    r"tokens_total|buffered_groups|weight_version|staleness_max|model_flops_total|mfu|peak_memory_bytes|"
    r"policy_entropy|policy_kl|update_kl|clip_fraction|importance_ratio|grad_norm|"
    r"step_guard_retries_total)\b)(\{[^}]*\})?"
)
# The gateway's series of runs side by side (docs/runs.md): one per run, born with the run's first call
# (or, for `run_replicas`, its first discovered set), so a stack with no run exports none of them
# (compose's default profile: tests/test_compose.py leaves exactly these out of its scrape check).
# tests/test_gateway_share.py and tests/test_gateway_replicas.py read each from a real gateway's /metrics.
RUNS_ONLY_METRICS = frozenset(
    {
        "tether_gateway_run_calls_in_flight",
        "tether_gateway_run_calls_waiting",
        "tether_gateway_run_share_refused_total",
        "tether_gateway_run_replicas",
    }
)
RUN_FILTER = 'run=~"$run"'
RUN_VARIABLE_QUERY = "label_values(tether_run_phase, run)"


def for_run(expr: str) -> str:
    """`expr` with every selector of a run-labelled series narrowed to the dashboard's `$run` (but one
    that names its run already: `{run=""}`, the single policy's)."""

    def narrowed(m: re.Match[str]) -> str:
        name, selector = m.group(1), m.group(2)
        inner = selector[1:-1].strip() if selector else ""
        if re.search(r"\brun\s*(=|!=|=~|!~)", inner):  # it picks its own run (the single policy's)
            return m.group(0)
        return f"{name}{{{inner + ', ' if inner else ''}{RUN_FILTER}}}"

    return RUN_SERIES.sub(narrowed, expr)


# --- PromQL building blocks ---------------------------------------------------------------------


def rate(metric: str, by: str = "") -> str:
    """sum [by (labels)] (rate(metric[$__rate_interval]))."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}[{RATE}]))"


def ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator, 0 (not NaN or +Inf) when the denominator is 0 in the window."""
    return f"{numerator} / clamp_min({denominator}, 1e-9)"


def share(part: str, whole: str) -> str:
    """part / whole where part selects a subset of whole's series (same grouping): 0, not an empty
    result, when the window has whole but no part (no errors yet), and 0 when whole is 0."""
    return ratio(f"({part} or {whole} * 0)", whole)


def quantile(q: float, histogram: str, by: str = "") -> str:
    """The q-quantile of a histogram (base name, no _bucket) over the rate window."""
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', labels)})"


def hist_mean(histogram: str, by: str = "") -> str:
    """Mean observation of a histogram over the rate window."""
    return ratio(rate(histogram + "_sum", by), rate(histogram + "_count", by))


# --- metric names of an expression ----------------------------------------------------------------

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan", "atan2"}
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label names, durations and
    numbers are not metrics). Enough PromQL for the expressions written here; `{__name__=...}`
    selectors are not used, so they are not understood."""
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery windows
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


# --- panels and dashboards ------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    about: str  # what the panel shows and how to read it; the metrics are appended
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | state-timeline
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    dashed: tuple[str, ...] = ()  # series (legend names) drawn as a dashed red line: bounds
    text_mode: str = "auto"  # stat panels: "name" shows the series name (the current phase)

    def metrics(self) -> set[str]:
        return set().union(*(metric_names(q.expr) for q in self.queries))

    def description(self) -> str:
        names = ", ".join(sorted(self.metrics()))
        return f"{self.about.rstrip('.')}. Metrics: {names}."


@dataclass(frozen=True)
class Dashboard:
    name: str  # file name (helm/tether/dashboards/<name>.json)
    uid: str
    title: str
    about: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def quantile_queries(histogram: str, by: str = "", label: str = "") -> tuple[Query, ...]:
    prefix = f"{label} " if label else ""
    suffix = "".join(f" {{{{{b.strip()}}}}}" for b in by.split(",") if b.strip())
    return tuple(q(quantile(p, histogram, by), f"{prefix}p{round(p * 100)}{suffix}") for p in QUANTILES) + (
        q(hist_mean(histogram, by), f"{prefix}mean{suffix}"),
    )


def version_queries() -> tuple[Query, ...]:
    return tuple(q(f"max({metric})", name) for name, metric in WEIGHT_VERSIONS.items())


def run_overview() -> Dashboard:
    bound = q("max(tether_run_max_staleness)", "bound")
    return Dashboard(
        "run-overview",
        "tether-run",
        "Tether / Run overview",
        "One training run: reward, step and push time, phase, weight versions, staleness, mismatch",
        (
            Panel(
                "Step",
                "The step the run is on",
                (q("max(tether_scheduler_step)", "step"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Phase",
                "The run's current phase (starting, rolling_out, training, pushing, evaluating, serving, done, stopped, error)",
                (q("max by (phase) (tether_run_phase) == 1", "{{phase}}"),),
                kind="stat",
                width=4,
                height=4,
                text_mode="name",
            ),
            Panel(
                "Reward",
                "Mean reward of the last step's rollouts",
                (q("max(tether_run_reward_mean)", "reward"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Weight version (inference)",
                "The weight version vLLM serves",
                (q("max(tether_inference_weight_version)", "inference"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Staleness max",
                "Largest weight-version lag among the last step's samples, against the bound",
                (q("max(tether_run_staleness_max)", "staleness"), bound),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Groups in flight",
                "Rollout groups dispatched and not yet trained (async modes)",
                (q("max(tether_run_groups_in_flight)", "groups"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Reward over steps",
                "Mean reward of each step's rollouts, set after every step",
                (q("max(tether_run_reward_mean)", "reward mean"),),
            ),
            Panel(
                "Phase over time",
                "Which phase the run was in (1 = current)",
                (q("max by (phase) (tether_run_phase)", "{{phase}}"),),
                kind="state-timeline",
                min=0,
                max=1,
            ),
            Panel(
                "Step, push and pause time",
                "Wall time of the last step, the part it waited for its groups, its weight push, and how long generation was held for it",
                (
                    q("max(tether_run_step_seconds)", "step"),
                    q("max(tether_run_rollout_seconds)", "waiting for groups"),
                    q("max(tether_run_push_seconds)", "push"),
                    q("max(tether_run_paused_seconds)", "paused"),
                ),
                unit="s",
                min=0,
            ),
            Panel(
                "Runs side by side: step rate and staleness",
                "Each run's steps per minute and the staleness of its last step, to see how the"
                " sharing policy shares the trainer and vLLM among runs (docs/runs.md 'Sharing the trainer')",
                (
                    q(
                        "60 * sum by (run) (deriv(tether_scheduler_step[$__rate_interval]))",
                        "steps/min {{run}}",
                    ),
                    q("max by (run) (tether_run_staleness_max)", "staleness {{run}}"),
                ),
                min=0,
            ),
            Panel(
                "Weight version per component",
                "The weight version each component reports: the trainer's newest checkpoint leads until a push lands, then all four agree",
                version_queries(),
                min=0,
            ),
            Panel(
                "Per-sample staleness",
                "Weight-version lag of the samples the last step trained on (max and mean), against the configured bound",
                (
                    q("max(tether_run_staleness_max)", "max"),
                    q("max(tether_run_staleness_mean)", "mean"),
                    bound,
                ),
                min=0,
                dashed=("bound",),
            ),
            Panel(
                "Per-token staleness",
                "Weight-version lag per trained token (a call that spans a weight change has tokens of several versions), against the bound",
                (
                    q("max(tether_run_token_staleness_max)", "max"),
                    q("max(tether_run_token_staleness_mean)", "mean"),
                    bound,
                ),
                min=0,
                dashed=("bound",),
            ),
            Panel(
                "Train/rollout mismatch",
                "How far the trainer's logprobs are from the ones vLLM sampled with: mean |delta logp| and the k3 KL estimate of the last step",
                (
                    q("max(tether_run_logprob_abs_diff)", "mean |delta logp|"),
                    q("max(tether_run_logprob_k3_kl)", "k3 KL"),
                ),
                min=0,
            ),
            Panel(
                "Forks per rollout",
                "Sequences per rollout and forks of the last step (scheduler), and forks per completed rollout over the window (merger)",
                (
                    q("max(tether_run_sequences_per_rollout)", "sequences per rollout (step)"),
                    q("max(tether_run_forks)", "forks (step)"),
                    q(
                        ratio(
                            rate("tether_merger_forks_total"),
                            rate("tether_merger_sequences_per_rollout_count"),
                        ),
                        "forks per rollout (merger)",
                    ),
                ),
                min=0,
            ),
            Panel(
                "Tokens per second",
                "Tokens the run trained per second of step wall time",
                (q("max(tether_run_tokens_per_second)", "tokens/s"),),
                min=0,
            ),
            Panel(
                "Groups in flight and pending",
                "Rollout groups dispatched and not yet trained, and groups the merger still waits on",
                (
                    q("max(tether_run_groups_in_flight)", "in flight"),
                    q("sum(tether_merger_groups_pending)", "merger pending"),
                    q("max(tether_run_stale_groups_dropped)", "dropped as stale (all)"),
                ),
                min=0,
            ),
            Panel(
                "Mixed-version sequences",
                "Share of the last step's sequences sampled by more than one weight version (a push landed mid-call)",
                (q("max(tether_run_mixed_version_fraction)", "mixed"),),
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Evaluation reward",
                "Mean reward of the final evaluation (empty until it ran), next to the last step's training reward",
                (
                    q("max(tether_run_eval_reward)", "eval"),
                    q("max(tether_run_reward_mean)", "train (last step)"),
                ),
            ),
        ),
    )


def gateway() -> Dashboard:
    requests = "tether_gateway_requests_total"
    errors = requests + '{status=~"[45].."}'
    return Dashboard(
        "gateway",
        "tether-gateway",
        "Tether / Gateway",
        "The OpenAI-compatible gateway: traffic, errors, latency, admission and vLLM replicas",
        (
            Panel(
                "Requests/s",
                "HTTP requests per second",
                (q(rate(requests), "requests/s"),),
                unit="reqps",
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Error ratio",
                "Share of requests answered 4xx or 5xx over the window",
                (q(share(rate(errors), rate(requests)), "errors"),),
                unit="percentunit",
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "In flight",
                "Calls admitted and not yet recorded",
                (q("sum(tether_gateway_in_flight)", "in flight"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Admission paused",
                "1 while the gateway holds new calls (around a weight push, or while colocated training runs)",
                (q("max(tether_gateway_admission_paused)", "paused"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Replicas healthy",
                "vLLM replicas taking calls",
                (q("sum(tether_gateway_replica_healthy)", "healthy"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Weight version",
                "Weight version new calls are recorded with",
                (q("max(tether_gateway_weight_version)", "version"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Requests by route and status",
                "HTTP requests per second by route and status code",
                (q(rate(requests, "route, status"), "{{route}} {{status}}"),),
                unit="reqps",
                min=0,
            ),
            Panel(
                "Errors by route",
                "Share of each route's requests answered 4xx or 5xx",
                (
                    q(
                        share(rate(errors, "route"), rate(requests, "route")),
                        "{{route}}",
                    ),
                ),
                unit="percentunit",
                min=0,
            ),
            Panel(
                "Request latency",
                "Latency to the last byte sent, all routes: quantiles and mean over the window",
                quantile_queries("tether_gateway_request_latency_seconds"),
                unit="s",
                min=0,
            ),
            Panel(
                "Request latency p90 by route",
                "90th-percentile latency of each route",
                (q(quantile(0.9, "tether_gateway_request_latency_seconds", "route"), "{{route}}"),),
                unit="s",
                min=0,
            ),
            Panel(
                "Upstream latency by replica",
                "Time each vLLM replica took to answer a call (p50, p99)",
                (
                    q(quantile(0.5, "tether_gateway_upstream_latency_seconds", "replica"), "p50 {{replica}}"),
                    q(
                        quantile(0.99, "tether_gateway_upstream_latency_seconds", "replica"),
                        "p99 {{replica}}",
                    ),
                ),
                unit="s",
                min=0,
            ),
            Panel(
                "In flight per replica",
                "Calls admitted and not yet recorded, in total and per vLLM replica",
                (
                    q("sum(tether_gateway_in_flight)", "total"),
                    q("sum by (replica) (tether_gateway_replica_in_flight)", "{{replica}}"),
                ),
                min=0,
            ),
            Panel(
                "Admission paused and replicas healthy",
                "1 while admission is paused; each replica's health (1 = taking calls)",
                (
                    q("max(tether_gateway_admission_paused)", "admission paused"),
                    q("max by (replica) (tether_gateway_replica_healthy)", "healthy {{replica}}"),
                ),
                min=0,
                max=1,
            ),
            Panel(
                "Tokens per second",
                "Prompt and generated tokens of recorded calls per second",
                (
                    q(rate("tether_gateway_prompt_tokens_total"), "prompt"),
                    q(rate("tether_gateway_completion_tokens_total"), "completion"),
                ),
                min=0,
            ),
            Panel(
                "Traces recorded",
                "Calls recorded per second by status and kind",
                (q(rate("tether_gateway_traces_total", "status, kind"), "{{status}} {{kind}}"),),
                unit="reqps",
                min=0,
            ),
            Panel(
                "Calls by run: in flight and waiting",
                "Each run's model calls in flight and waiting for its turn at vLLM (TETHER_RUN_MAX_CONCURRENT,"
                " docs/runs.md 'Sharing vLLM'), those refused after waiting too long, per second, and with"
                " replica discovery the replicas serving its adapter (the fewest any gateway pod routes to)",
                (
                    q("sum by (run) (tether_gateway_run_calls_in_flight)", "in flight {{run}}"),
                    q("sum by (run) (tether_gateway_run_calls_waiting)", "waiting {{run}}"),
                    q(rate("tether_gateway_run_share_refused_total", "run"), "refused/s {{run}}"),
                    q("min by (run) (tether_gateway_run_replicas)", "replicas serving {{run}}"),
                ),
                min=0,
            ),
        ),
    )


def inference() -> Dashboard:
    return Dashboard(
        "inference",
        "tether-inference",
        "Tether / Inference",
        "vLLM's own metrics, its sleep state and Tether's weight loads",
        (
            Panel(
                "Running",
                "Requests in vLLM's model execution batches",
                (q("sum(vllm:num_requests_running)", "running"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Waiting",
                "Requests queued in vLLM",
                (q("sum(vllm:num_requests_waiting)", "waiting"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "KV cache usage",
                "Fraction of vLLM's KV cache in use (1 = full), the fullest engine",
                (q("max(vllm:kv_cache_usage_perc)", "usage"),),
                unit="percentunit",
                kind="stat",
                width=4,
                height=4,
                min=0,
                max=1,
            ),
            Panel(
                "Awake",
                "1 while every vLLM engine is awake, 0 while one sleeps (colocated training)",
                (q('min(vllm:engine_sleep_state{sleep_state="awake"})', "awake"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Weight version",
                "The weight version vLLM serves",
                (q("max(tether_inference_weight_version)", "version"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Generated tokens/s",
                "Tokens vLLM generates per second",
                (q(rate("vllm:generation_tokens_total"), "tokens/s"),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Requests running and waiting",
                "Requests in execution batches and queued, per vLLM instance",
                (
                    q("sum by (instance) (vllm:num_requests_running)", "running {{instance}}"),
                    q("sum by (instance) (vllm:num_requests_waiting)", "waiting {{instance}}"),
                ),
                min=0,
            ),
            Panel(
                "KV cache usage per instance",
                "Fraction of the KV cache in use per vLLM instance",
                (q("max by (instance) (vllm:kv_cache_usage_perc)", "{{instance}}"),),
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Token throughput",
                "Prefill (prompt) and generated tokens per second",
                (
                    q(rate("vllm:prompt_tokens_total"), "prompt"),
                    q(rate("vllm:generation_tokens_total"), "generation"),
                ),
                min=0,
            ),
            Panel(
                "Time to first token",
                "Time from a request's arrival to its first token: quantiles and mean over the window",
                quantile_queries("vllm:time_to_first_token_seconds"),
                unit="s",
                min=0,
            ),
            Panel(
                "Inter-token latency",
                "Time between consecutive generated tokens: quantiles and mean over the window",
                quantile_queries("vllm:inter_token_latency_seconds"),
                unit="s",
                min=0,
            ),
            Panel(
                "End-to-end request latency",
                "A request's whole time in vLLM: quantiles and mean over the window",
                quantile_queries("vllm:e2e_request_latency_seconds"),
                unit="s",
                min=0,
            ),
            Panel(
                "Sleep state",
                "vLLM's sleep state per engine: awake, weights_offloaded (sleep level 1) or discard_all (level 2)",
                (q("max by (sleep_state) (vllm:engine_sleep_state)", "{{sleep_state}}"),),
                kind="state-timeline",
                min=0,
                max=1,
            ),
            Panel(
                "Weight-update time",
                "Time to load a checkpoint into vLLM (inference adapter: quantiles and mean), and the scheduler's whole push by path",
                quantile_queries("tether_inference_weight_load_seconds", label="load")
                + (q(hist_mean("tether_scheduler_weight_push_seconds", "path"), "push mean {{path}}"),),
                unit="s",
                min=0,
            ),
            Panel(
                "Weight version, served and known",
                "The weight version vLLM serves, next to the one the scheduler believes it serves",
                (
                    q("max(tether_inference_weight_version)", "inference"),
                    q("max(tether_scheduler_weight_version)", "scheduler"),
                ),
                min=0,
            ),
        ),
    )


def broker() -> Dashboard:
    return Dashboard(
        "broker",
        "tether-broker",
        "Tether / Broker",
        "Redis streams: lengths, consumer-group lag and pending entries, dead letters",
        (
            Panel(
                "Dead-letter entries",
                "Records in the dead-letter stream",
                (q("max(tether_broker_dead_letter_entries)", "entries"),),
                kind="stat",
                width=6,
                height=4,
            ),
            Panel(
                "Max group lag",
                "The largest consumer-group lag over every stream",
                (q("max(tether_broker_group_lag)", "lag"),),
                kind="stat",
                width=6,
                height=4,
            ),
            Panel(
                "Pending entries",
                "Entries delivered to consumers and not yet acknowledged, all groups",
                (q("sum(tether_broker_group_pending)", "pending"),),
                kind="stat",
                width=6,
                height=4,
            ),
            Panel(
                "Longest stream",
                "Entries in the longest stream",
                (q("max(tether_broker_stream_length)", "entries"),),
                kind="stat",
                width=6,
                height=4,
            ),
            Panel(
                "Stream length",
                "Entries in each stream",
                (q("max by (stream) (tether_broker_stream_length)", "{{stream}}"),),
                min=0,
            ),
            Panel(
                "Consumer-group lag",
                "Entries of a stream its consumer group has not read yet",
                (q("max by (stream, group) (tether_broker_group_lag)", "{{stream}} / {{group}}"),),
                min=0,
            ),
            Panel(
                "Pending entries by group",
                "Entries read by a group's consumers and not acknowledged (a dead consumer's are claimed after the idle timeout)",
                (q("max by (stream, group) (tether_broker_group_pending)", "{{stream}} / {{group}}"),),
                min=0,
            ),
            Panel(
                "Dead letters",
                "Entries in the dead-letter stream (each entry names the stream and consumer it came from)",
                (q("max(tether_broker_dead_letter_entries)", "entries"),),
                min=0,
            ),
        ),
    )


def trainer() -> Dashboard:
    return Dashboard(
        "trainer",
        "tether-trainer",
        "Tether / Trainer",
        "The trainer: steps, tokens, MFU and memory, buffered groups, weight pushes, staleness",
        (
            Panel(
                "Steps",
                "Training steps done by this trainer process",
                (q("sum(tether_trainer_steps_total)", "steps"),),
                kind="stat",
                width=6,
                height=4,
            ),
            Panel(
                "Buffered groups",
                "Complete groups waiting to be trained on",
                (q("sum(tether_trainer_buffered_groups)", "groups"),),
                kind="stat",
                width=6,
                height=4,
            ),
            Panel(
                "Checkpoint version",
                "Version of the newest checkpoint",
                (q("max(tether_trainer_weight_version)", "version"),),
                kind="stat",
                width=6,
                height=4,
            ),
            Panel(
                "Staleness max",
                "Largest weight-version lag among the last step's samples",
                (q("max(tether_trainer_staleness_max)", "staleness"),),
                kind="stat",
                width=6,
                height=4,
            ),
            Panel(
                "Step time",
                "Wall time of one training step: quantiles and mean over the window",
                quantile_queries("tether_trainer_step_seconds"),
                unit="s",
                min=0,
            ),
            Panel(
                "Steps per minute",
                "Training steps per minute",
                (q(f"60 * {rate('tether_trainer_steps_total')}", "steps/min"),),
                min=0,
            ),
            Panel(
                "Tokens trained per second",
                "Tokens trained on per second (trainer) and trained tokens per second of step time (scheduler)",
                (
                    q(rate("tether_trainer_tokens_total"), "trainer"),
                    q("max(tether_run_tokens_per_second)", "per step time"),
                ),
                min=0,
            ),
            Panel(
                "Buffered and pending groups",
                "Complete groups buffered in the trainer, and groups the merger still waits on",
                (
                    q("sum(tether_trainer_buffered_groups)", "buffered (trainer)"),
                    q("sum(tether_merger_groups_pending)", "pending (merger)"),
                ),
                min=0,
            ),
            Panel(
                "Weight pushes",
                "Pushes per minute by path (scheduler), and path-2 pushes that fell back to a checkpoint load",
                (
                    q(f"60 * {rate('tether_scheduler_weight_push_seconds_count', 'path')}", "{{path}}"),
                    q(f"60 * {rate('tether_scheduler_weight_push_fallbacks_total')}", "fallbacks"),
                ),
                min=0,
            ),
            Panel(
                "Push time",
                "A whole weight push as the scheduler sees it (p90 and mean by path), and the trainer's side of a path-2 push (mean)",
                (
                    q(quantile(0.9, "tether_scheduler_weight_push_seconds", "path"), "p90 {{path}}"),
                    q(hist_mean("tether_scheduler_weight_push_seconds", "path"), "mean {{path}}"),
                    q(hist_mean("tether_trainer_weight_push_seconds"), "trainer path-2 mean"),
                ),
                unit="s",
                min=0,
            ),
            Panel(
                "Staleness against the bound",
                "Largest weight-version lag of the last step's samples, against the bound",
                (
                    q("max(tether_trainer_staleness_max)", "trainer max"),
                    q("max(tether_run_max_staleness)", "bound"),
                ),
                min=0,
                dashed=("bound",),
            ),
            Panel(
                "Checkpoint and served version",
                "The trainer's newest checkpoint against what inference serves",
                (
                    q("max(tether_trainer_weight_version)", "trainer"),
                    q("max(tether_inference_weight_version)", "inference"),
                ),
                min=0,
            ),
            Panel(
                "MFU",
                "Model FLOPs utilisation of the last step (useful FLOPs with attention, over the devices' peak)",
                (q("max(tether_trainer_mfu)", "MFU"),),
                unit="percentunit",
                min=0,
            ),
            Panel(
                "Model TFLOP/s",
                "Useful model FLOPs per second trained (attention included, padding and recomputation not)",
                (q(f"{rate('tether_trainer_model_flops_total')} / 1e12", "TFLOP/s"),),
                min=0,
            ),
            Panel(
                "Peak memory of a step",
                "Most memory the last step held on one device (the largest over ranks)",
                (q("max(tether_trainer_peak_memory_bytes)", "peak"),),
                unit="bytes",
                min=0,
            ),
            Panel(
                "Loss and gradient norm",
                "Policy loss and gradient norm of the last step",
                (
                    q("max(tether_run_loss)", "loss"),
                    q("max(tether_run_grad_norm)", "grad norm"),
                ),
            ),
            Panel(
                "Clip fraction",
                "Share of the last step's tokens whose importance ratio was clipped",
                (q("max(tether_run_clip_fraction)", "clipped"),),
                unit="percentunit",
                min=0,
                max=1,
            ),
        ),
    )


def learning_health() -> Dashboard:
    return Dashboard(
        "learning-health",
        "tether-learning",
        "Tether / Learning health",
        "Whether the policy is still learning: the reward, the policy's entropy, how far each update moves "
        "it, what the objective clipped, the gradient, its responses' length, cuts and repetition, and "
        "the step guard",
        (
            Panel(
                "Reward",
                "Mean reward of the last step's rollouts (a fall to under half its best of the last hour, "
                "held 10 minutes, is the collapse the alert watches), and the final evaluation's",
                (
                    q("max(tether_run_reward_mean)", "train (last step)"),
                    q("max(tether_run_eval_reward)", "eval"),
                ),
                min=0,
            ),
            Panel(
                "Policy entropy",
                "Mean entropy of the policy over the last step's trained tokens (nats); a fall to a small "
                "part of its recent level is an entropy collapse",
                (q("max(tether_trainer_policy_entropy)", "entropy"),),
                min=0,
            ),
            Panel(
                "KL to the sampling policy",
                "k3 estimates of KL(sampling policy || policy): before the step's update (the policy "
                "trained) and after it (the step guard's measure, with the guard on)",
                (
                    q("max(tether_trainer_policy_kl)", "before the update"),
                    q("max(tether_trainer_update_kl)", "after the update"),
                ),
                min=0,
            ),
            Panel(
                "Clipped tokens",
                "Share of the last step's trained tokens the objective clipped, by side",
                (q("max by (side) (tether_trainer_clip_fraction)", "{{side}}"),),
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Importance ratio",
                "Policy over sampling policy on the last step's trained tokens (PPO, CISPO: per token; "
                "GSPO: per sample)",
                (q("max by (stat) (tether_trainer_importance_ratio)", "{{stat}}"),),
                min=0,
            ),
            Panel(
                "Gradient norm",
                "Gradient norm of the last step before clipping",
                (q("max(tether_trainer_grad_norm)", "grad norm"),),
                min=0,
            ),
            Panel(
                "Groups without signal",
                "Share of the last step's groups whose rollouts all got the same reward (no advantage), "
                "and share filtered out: a step of such groups trains on few or none",
                (
                    q("max(tether_run_zero_variance_fraction)", "same reward"),
                    q("max(tether_run_groups_filtered_fraction)", "filtered"),
                ),
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Response length",
                "Tokens generated per response of the last step's completed rollouts, trained or not: mean "
                "and 95th percentile (a length that keeps growing into the output limit is a policy "
                "learning to ramble)",
                (
                    q("max(tether_run_response_length_mean)", "mean"),
                    q("max(tether_run_response_length_p95)", "p95"),
                ),
                min=0,
            ),
            Panel(
                "Cut and repetitive responses",
                "Share of the last step's responses the output limit cut, and share that is degenerate "
                "repetition (a short block looped to the end; docs/metrics.md)",
                (
                    q("max(tether_run_truncated_fraction)", "cut by the limit"),
                    q("max(tether_run_repetition_rate)", "repetition"),
                ),
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Steps that trained nothing",
                "Steps in a row, up to the last, that trained nothing (every group filtered)",
                (q("max(tether_run_untrained_steps_in_a_row)", "in a row"),),
                min=0,
            ),
            Panel(
                "Step guard",
                "Updates the step guard undid and made again at a lower learning rate",
                (q(f"sum(increase(tether_trainer_step_guard_retries_total[{RATE}]))", "retried"),),
                min=0,
            ),
        ),
    )


DASHBOARDS = (run_overview, gateway, inference, broker, trainer, learning_health)


# --- Grafana JSON ---------------------------------------------------------------------------------


def layout(panels: tuple[Panel, ...]) -> list[dict[str, int]]:
    """Left to right on Grafana's 24-column grid, wrapping to a new row when a panel does not fit."""
    out, x, y, row_h = [], 0, 0, 0
    for p in panels:
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append({"h": p.height, "w": p.width, "x": x, "y": y})
        x, row_h = x + p.width, max(row_h, p.height)
    return out


def field_defaults(p: Panel) -> dict[str, Any]:
    d: dict[str, Any] = {"unit": p.unit, "color": {"mode": "palette-classic"}}
    if p.min is not None:
        d["min"] = p.min
    if p.max is not None:
        d["max"] = p.max
    if p.kind == "stat":
        d["color"] = {"mode": "thresholds"}
        d["thresholds"] = {"mode": "absolute", "steps": [{"color": "blue", "value": None}]}
    if p.kind == "state-timeline":
        d["color"] = {"mode": "thresholds"}
        d["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "transparent", "value": None}, {"color": "green", "value": 1}],
        }
        d["mappings"] = [{"type": "value", "options": {"0": {"text": " "}, "1": {"text": "current"}}}]
    if p.kind == "timeseries":
        d["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": True,
        }
    return d


def options(p: Panel) -> dict[str, Any]:
    if p.kind == "stat":
        return {
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": p.text_mode,
        }
    legend = {"displayMode": "list", "placement": "bottom", "showLegend": True}
    if p.kind == "state-timeline":
        return {"legend": legend, "mergeValues": True, "rowHeight": 0.9, "showValue": "never"}
    return {"legend": legend, "tooltip": {"mode": "multi", "sort": "none"}}


def panel_json(p: Panel, pid: int, pos: dict[str, int]) -> dict[str, Any]:
    overrides = [
        {
            "matcher": {"id": "byName", "options": name},
            "properties": [
                {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
                {"id": "color", "value": {"fixedColor": "red", "mode": "fixed"}},
                {"id": "custom.fillOpacity", "value": 0},
            ],
        }
        for name in p.dashed
    ]
    targets = [
        {
            "datasource": DATASOURCE,
            "expr": t.expr,
            "instant": False,
            "legendFormat": t.legend or "__auto",
            "range": True,
            "refId": chr(ord("A") + i),
        }
        for i, t in enumerate(p.queries)
    ]
    return {
        "datasource": DATASOURCE,
        "description": p.description(),
        "fieldConfig": {"defaults": field_defaults(p), "overrides": overrides},
        "gridPos": pos,
        "id": pid,
        "options": options(p),
        "targets": targets,
        "title": p.title,
        "type": p.kind,
    }


def run_variable() -> dict[str, Any]:
    """The `run` template variable: every run whose scheduler reports (the run host's `run` label), and
    "All" (`.*`), the default, which also keeps the series of the base namespace's single policy."""
    return {
        "allValue": ".*",
        "current": {"selected": True, "text": "All", "value": "$__all"},
        "datasource": DATASOURCE,
        "definition": RUN_VARIABLE_QUERY,
        "hide": 0,
        "includeAll": True,
        "label": "Run",
        "multi": False,
        "name": "run",
        "options": [],
        "query": {"query": RUN_VARIABLE_QUERY, "refId": "run"},
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "type": "query",
    }


def by_run(d: Dashboard) -> tuple[Dashboard, bool]:
    """The dashboard with its run-labelled selectors narrowed to `$run`, and whether it has any."""
    panels = tuple(
        replace(p, queries=tuple(Query(for_run(x.expr), x.legend) for x in p.queries)) for p in d.panels
    )
    return replace(d, panels=panels), panels != d.panels


def dashboard_json(d: Dashboard) -> dict[str, Any]:
    d, per_run = by_run(d)
    return {
        "annotations": {"list": []},
        "description": d.about,
        "editable": True,
        "graphTooltip": 1,
        "links": [
            {
                "asDropdown": True,
                "icon": "external link",
                "includeVars": True,
                "keepTime": True,
                "tags": ["tether"],
                "targetBlank": False,
                "title": "Tether",
                "type": "dashboards",
            }
        ],
        "panels": [
            panel_json(p, i + 1, pos)
            for i, (p, pos) in enumerate(zip(d.panels, layout(d.panels), strict=True))
        ],
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["tether"],
        "templating": {
            "list": [
                {
                    "current": {},
                    "hide": 0,
                    "includeAll": False,
                    "label": "Data source",
                    "multi": False,
                    "name": "datasource",
                    "options": [],
                    "query": "prometheus",
                    "refresh": 1,
                    "regex": "",
                    "type": "datasource",
                },
                *([run_variable()] if per_run else []),
            ]
        },
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": d.title,
        "uid": d.uid,
        "version": 1,
    }


# --- alert rules ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str


def _versions(fn: str) -> str:
    """fn over every component's weight version, each tagged with a `component` label (so the
    union keeps them all even when two components share job and instance labels)."""
    parts = [
        f'label_replace({metric}, "component", "{name}", "", "")' for name, metric in WEIGHT_VERSIONS.items()
    ]
    return f"{fn}(\n  " + "\n  or ".join(parts) + "\n)"


ALERTS = (
    Alert(
        "TetherStalenessAboveBound",
        "tether_run_staleness_max > tether_run_max_staleness\n"
        "or tether_run_token_staleness_max > tether_run_max_staleness",
        "1m",
        "critical",
        "A step trained on samples staler than max_staleness",
        "The last step trained on samples (or tokens) {{ $value }} weight versions old, more than the run's"
        " bound: the scheduler's staleness throttle is not holding.",
    ),
    Alert(
        "TetherWeightVersionsDisagree",
        f"{_versions('max')}\n-\n{_versions('min')}\n> 0",
        "5m",
        "warning",
        "Components report different weight versions",
        "The gateway, inference, trainer and scheduler weight versions have differed by {{ $value }} for"
        " longer than a weight push takes: a push is stuck or a component missed it.",
    ),
    Alert(
        "TetherTargetDown",
        "up == 0",
        "2m",
        "critical",
        "{{ $labels.job }} target {{ $labels.instance }} is down",
        "Prometheus could not scrape {{ $labels.job }} at {{ $labels.instance }} for 2 minutes.",
    ),
    Alert(
        "TetherReplicaUnhealthy",
        "tether_gateway_replica_healthy == 0",
        "2m",
        "warning",
        "vLLM replica {{ $labels.replica }} is unhealthy",
        "The gateway has taken replica {{ $labels.replica }} out of rotation for 2 minutes.",
    ),
    Alert(
        # The gauge, not increase(tether_dead_letters_total): a labelled counter is born at its first
        # dead letter, at 1, and increase() over a series' first sample reads 0.
        "TetherDeadLettersGrowing",
        "delta(tether_broker_dead_letter_entries[10m]) > 0",
        "1m",
        "warning",
        "Records are being dead-lettered",
        "{{ $value }} more records in the dead-letter stream than 10 minutes ago: a consumer could not"
        " process them; inspect the stream before they pile up.",
    ),
    Alert(
        # phase training = the scheduler is blocked in the trainer's TrainStep; a step that takes longer
        # than `for` on a big model needs a longer `for`.
        "TetherTrainerStalled",
        'max(tether_run_phase{phase="training"}) == 1\n'
        "and on () sum(tether_trainer_buffered_groups) > 0\n"
        "and on () sum(increase(tether_trainer_steps_total[15m])) == 0",
        "10m",
        "critical",
        "The trainer has not finished a step while groups wait",
        "The scheduler has waited on a training step for 10 minutes with groups buffered in the trainer"
        " and no step finished in the last 15 minutes.",
    ),
    Alert(
        "TetherEntropyCollapse",
        "tether_trainer_policy_entropy < 0.25 * max_over_time(tether_trainer_policy_entropy[1h])",
        "10m",
        "warning",
        "The policy's entropy collapsed",
        "The policy's mean entropy over the trained tokens is {{ $value }} nats, under a quarter of its"
        " level in the last hour, for 10 minutes: the policy is becoming deterministic; exploration (and"
        " with it the reward's variance within groups) may be gone.",
    ),
    Alert(
        "TetherPolicyKLSpike",
        "tether_trainer_policy_kl > 0.05\n"
        "and tether_trainer_policy_kl > 10 * quantile_over_time(0.5, tether_trainer_policy_kl[1h])",
        "0m",
        "warning",
        "A step's policy moved far from the sampling policy",
        "The last step trained a policy {{ $value }} (k3 KL) from the policy that sampled its tokens, over"
        " ten times its median of the last hour: stale or mismatched samples, or an update too large.",
    ),
    Alert(
        # The coding example's drift (docs/trainer.md, "Defaults, measured"): its entropy jumped and
        # 75% of its responses ran to the output limit for 36 steps while the reward stayed at 0.97-1.00.
        "TetherResponsesTruncated",
        "tether_run_truncated_fraction > 0.5",
        "10m",
        "warning",
        "Most responses run to the output limit",
        "{{ $value | humanizePercentage }} of the last step's responses were cut by their output limit,"
        " for 10 minutes: the policy's responses are drifting longer (a rising entropy, a tail after the"
        " answer), which the reward may not show; see the Learning health dashboard, and consider"
        " merger.truncated_responses (exclude or penalty).",
    ),
    Alert(
        "TetherRewardCollapse",
        "tether_run_reward_mean < 0.5 * max_over_time(tether_run_reward_mean[1h])\n"
        "and max_over_time(tether_run_reward_mean[1h]) > 0.2",
        "10m",
        "critical",
        "The reward collapsed",
        "The steps' mean reward is {{ $value }}, under half its best of the last hour, for 10 minutes: the"
        " policy has collapsed (see the Learning health dashboard).",
    ),
    Alert(
        # The merger creates these reasons' series at 0 when it starts (merger/metrics.py): a series born
        # at its first refusal, at 1, would read a rate of 0 there.
        "TetherWrongAdapter",
        "sum by (reason) (\n"
        '  rate(tether_merger_calls_dropped_total{reason=~"wrong_adapter|base_model|unattributed"}[5m])\n'
        ") > 0",
        "0m",
        "critical",
        "Calls not served by their run's adapter",
        "The merger refused calls for attribution ({{ $labels.reason }}, {{ $value | humanize }} a second"
        " over 5 minutes): their rollouts expect an adapter that did not serve every token (another"
        " adapter, the base model, or no record of who served them). They are never trained; check which"
        " adapter the gateway asks for and that vLLM loaded it (docs/runs.md).",
    ),
    Alert(
        # The trainer creates a run's series at 0 with its first step (trainer/steps.py), so the first
        # undone update already counts. One undone update is the guard doing its job (on coding it undid
        # 4-8 a run, docs/trainer.md); three in half an hour say the run's updates keep overshooting.
        "TetherStepGuardActing",
        "sum by (run) (increase(tether_trainer_step_guard_retries_total[30m])) >= 3",
        "0m",
        "warning",
        "The step guard keeps undoing updates",
        "The step guard undid {{ $value | humanize }} updates of run {{ $labels.run }} in 30 minutes: each"
        " moved the policy further from the one that sampled its tokens than trainer.max_step_kl allows"
        " and was made again at a lower learning rate. The run's updates are too large for its data:"
        " lower its learning rate (docs/trainer.md, the step guard).",
    ),
    Alert(
        "TetherNothingTrained",
        "tether_run_untrained_steps_in_a_row >= 5",
        "0m",
        "warning",
        "Steps train nothing",
        "The last {{ $value }} steps in a row trained nothing: every group was filtered (each group's"
        " rollouts got the same reward: the tasks are all solved, or all failed).",
    ),
)


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def alerts_yaml() -> str:
    rules = [
        {
            "alert": a.name,
            "expr": a.expr,
            "for": a.for_,
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary, "description": a.description},
        }
        for a in ALERTS
    ]
    body = yaml.dump(
        {"groups": [{"name": "tether", "rules": rules}]}, Dumper=_Dumper, sort_keys=False, width=100
    )
    return "# Generated by scripts/dashboards.py: edit there, then run it.\n" + body


# --- what is written, and what it uses ------------------------------------------------------------


def dashboards() -> list[Dashboard]:
    return [make() for make in DASHBOARDS]


def render() -> dict[Path, str]:
    """Every generated file and its text."""
    out = {
        DASHBOARD_DIR / f"{d.name}.json": json.dumps(dashboard_json(d), indent=2, sort_keys=True) + "\n"
        for d in dashboards()
    }
    out[ALERTS_FILE] = alerts_yaml()
    return out


def dashboard_metrics(*names: str) -> set[str]:
    """Every metric name the panels of the dashboards `names` (all of them when none is named) select,
    as a scrape shows it (histograms by the _bucket/_sum/_count series queried, counters with _total);
    Prometheus's own `up` is left out."""
    chosen = [d for d in dashboards() if not names or d.name in names]
    if names and len(chosen) != len(set(names)):
        raise KeyError(f"no dashboard among {sorted(set(names) - {d.name for d in chosen})}")
    return set().union(*(p.metrics() for d in chosen for p in d.panels)) - PROMETHEUS_SERIES


def alert_metrics() -> set[str]:
    """Every metric name an alert rule selects, as dashboard_metrics gives them."""
    return set().union(*(metric_names(a.expr) for a in ALERTS)) - PROMETHEUS_SERIES


def used_metrics() -> set[str]:
    """Every metric name a panel or an alert selects (dashboard_metrics and alert_metrics)."""
    return dashboard_metrics() | alert_metrics()


def stale(files: dict[Path, str]) -> list[str]:
    """Committed files that differ from `files`, are missing, or sit beside them ungenerated."""
    bad = [str(p.relative_to(ROOT)) for p, text in files.items() if not p.exists() or p.read_text() != text]
    extra = sorted(set(DASHBOARD_DIR.glob("*.json")) - set(files))
    return bad + [f"{p.relative_to(ROOT)} (not generated)" for p in extra]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed files are stale")
    args = parser.parse_args()
    files = render()
    if args.check:
        bad = stale(files)
        if bad:
            print(f"dashboards/alerts are stale: {bad}; run python scripts/dashboards.py")
            return 1
        print(f"{len(files)} dashboard and alert files up to date")
        return 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
