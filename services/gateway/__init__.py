"""Gateway: the endpoint agents point at (OpenAI chat completions and completions, Anthropic Messages,
OpenAI Responses). It identifies the rollout by its API key, forwards calls to vLLM asking for token
ids and logprobs (translating Messages and Responses to chat completions), returns the normal API
response, and records every call as a Trace on Redis. Modules: app (routes) -> proxy (forwarding,
streaming) -> apis (one object per API) -> capture, messages, responses (pure wire shapes, translation
and trace building); rollouts (registry), admission (pause/drain gate), control (gRPC), main (process).
"""
