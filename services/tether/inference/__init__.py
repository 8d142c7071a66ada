"""Inference: the real vLLM server plus a gRPC control adapter over its dev-mode endpoints.

Modules in data-flow order: main (settings, process) -> launch (vLLM as a child process) -> servicer
(gRPC Inference: weight version, load weights, pause/resume, sleep/wake) -> weights (path 1 of the
weight push: reload a checkpoint, never serve half-loaded weights). vLLM's own plugin lives in
services/vllm_plugin and is installed into vLLM's environment.
"""
