"""Scheduler: the run's brain. Dispatches rollouts, decides when a step trains, pushes weights."""
