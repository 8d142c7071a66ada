"""Merger: turns a rollout's recorded LLM calls into token-exact training samples.

Modules in data-flow order: main (settings, process) -> consumer (rollout events in, groups gathered,
samples out to the trainer) -> sidecalls (which sequences are not the agent's turn) -> merge (pure:
calls -> sequences); servicer (gRPC Merger status).
"""
