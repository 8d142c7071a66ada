"""Merger: turns a rollout's recorded LLM calls into token-exact training samples.

Modules in data-flow order: main (settings, process, the trainer client) -> consumer (the shell:
rollout events in, groups gathered, samples out to the trainer) -> store (its Redis reads and writes)
and metrics (its Prometheus metrics and status counters) -> score (the pure core: traces -> merged
rollout, a group's merged rollouts -> samples, result, outcomes) -> merge (pure: calls -> sequences)
-> sidecalls (which sequences are not the agent's turn); servicer (gRPC Merger status).
"""
