"""Scheduler: the run's brain. Dispatches rollouts, decides when a step trains, pushes weights.

Modules in data-flow order: main (settings, process) -> run (the mode loops, run state in Redis) ->
plan (the decisions, pure: what to dispatch, when a step trains, on which groups) and publish (the
weight push to inference: path 1, path 2, fallback, reconcile); servicer (gRPC Scheduler: GetRun, Stop).
"""
