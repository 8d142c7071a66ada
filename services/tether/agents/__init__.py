"""Agents: the worker that runs a user's harness function against dispatched rollouts.

Modules in data-flow order: main (settings, process) -> worker (take a dispatch job, create the rollout
on the gateway, run the harness, complete it with its reward).
"""
