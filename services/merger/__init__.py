"""Merger: turns a rollout's recorded LLM calls into token-exact training sequences."""
