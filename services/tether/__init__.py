"""Tether: harnessed agentic RL. One package, a room per service (docs/architecture.md):

common, algorithms, v1   shared by every service: settings, logging, gRPC bootstrap, records, broker keys;
                         the RL math; the generated gRPC contract
gateway -> merger -> trainer    the data path: calls recorded as traces, merged into samples, trained
scheduler, inference     the run's decisions; vLLM and its control adapter
agents                   the worker that runs a user's harness for dispatched rollouts
cli, launcher, demo, examples   `tether` commands, local processes, the CPU demo's model and harness
"""
