"""Inference: the real vLLM server plus a gRPC control adapter over its dev-mode endpoints."""
