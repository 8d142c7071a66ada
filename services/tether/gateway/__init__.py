"""Gateway: the endpoint agents point at (OpenAI chat completions and completions, Anthropic Messages,
OpenAI Responses, Gemini). It identifies the rollout by its API key, forwards calls to vLLM asking for
token ids and logprobs, returns the normal API response, and records every call as a Trace on Redis.

Modules in data-flow order: main (settings, process) -> app (assembles the HTTP app) -> routers/ (one
router per API family; routers/calls.py the plain-ASGI call routes) and edge (what they share: keys,
error shapes, bodies, request metrics) -> rollouts, sessions (who is calling) -> admission (pause/drain
gate) -> limits (token budget) -> proxy (one call: admit, forward, record) with call (the call in
progress), forwarding (the exchange with vLLM: replicas, retries, output limits), stream (relaying a
stream), traces (recording) -> apis (one object per API) -> capture, messages, responses, gemini,
guided (pure wire shapes, translation, trace building) -> routing (which replica) -> upstream
(HTTP/1.1 to vLLM) -> recorder (traces to Redis); servicer (gRPC GatewayControl), metrics.
"""
