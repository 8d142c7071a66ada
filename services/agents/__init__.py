"""Agents: the worker that runs a user's harness function against dispatched rollouts."""
