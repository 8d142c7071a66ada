"""Merger: turns a rollout's recorded LLM calls into token-exact training samples.

Modules in data-flow order: main (settings, process, the trainer client) -> consumer (rollout events
in, groups gathered, samples out to the trainer) -> merge (pure: calls -> sequences) -> sidecalls (which
sequences are not the agent's turn); servicer (gRPC Merger status).
"""
