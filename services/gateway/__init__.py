"""Gateway: the OpenAI-compatible endpoint agents point at. It identifies the rollout by its API key,
forwards calls to vLLM asking for token ids and logprobs, returns the normal API response, and
records every call as a Trace on Redis. Modules: app (routes) -> proxy (forwarding, streaming) ->
capture (pure wire shapes and trace building); rollouts (registry), admission (pause/drain gate),
control (gRPC), main (process).
"""
