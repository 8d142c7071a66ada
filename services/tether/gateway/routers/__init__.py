"""The gateway's HTTP routes, one thin module per API family (vLLM's `entrypoints` layout): each reads
the request, hands it to the module that does the work, and answers in its family's shape.

  calls      the call routes of every family, plain ASGI in front of the FastAPI app (the hot path)
  chat       OpenAI chat completions and completions (call routes), GET /v1/models
  messages   Anthropic Messages (call route), count_tokens
  responses  OpenAI Responses (call route), stored responses (404: none are stored)
  gemini     Google's Gemini API (call routes, matched by `{model}:{method}`), countTokens, models
  rollouts   the rollout lifecycle and per-call rewards
  runs       the run registry (admin): create, list, read, stop runs
  sessions   record-only sessions' rewards
  ops        health, metrics, the OpenAPI document, HEAD probes
  errors     the FastAPI routes' exception handlers
  state      the gateway's parts the routes reach (`app.state.gateway`)

app.create_app assembles them; nothing here imports app.
"""
