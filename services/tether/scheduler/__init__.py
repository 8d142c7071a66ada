"""Scheduler: the run's brain. Dispatches rollouts, decides when a step trains, pushes weights.

Modules in data-flow order: main (settings, process) -> run (the mode loops, run state in Redis);
servicer (gRPC Scheduler: GetRun, Stop).
"""
