"""Scheduler: the run's brain. Dispatches rollouts, decides when a step trains, pushes weights.

Modules in data-flow order: main (settings, process) -> run (assembles a run from the parts below,
starts and ends it) -> the mode loops: sync_loop (colocated-sync), async_loop (colocated-async,
disaggregated-async), serve (`tether up`), evaluate (the final evaluation) -> steps (a training step's
lifecycle), rollouts (dispatch and group results), health (hold dispatch while inference is not
serving), push (train and push under the mode's rules) over publish (the weight push to inference:
path 1, path 2, fallback, reconcile), report (step records, metrics.jsonl, the metrics stream), store
(the run state in Redis). plan holds every decision, pure: what to dispatch, when a step trains and on
which groups, what a restart resumes from, hold or go on inference health, how a step pushes.
config (RunConfig, Stubs), servicer (gRPC Scheduler: GetRun, Stop), fleet and gateways (every
inference and gateway replica), kube (Kubernetes).
"""
