"""Code every service shares (docs/architecture.md).

Modules in data-flow order: settings (CommonSettings, RedisSettings) -> usage (`--help`: the settings
table) -> logs (one format) -> net (free ports) -> grpc_server (health, reflection, metrics, graceful
stop, client channels) -> retry (the retryable gRPC codes, bounded retry) -> records (what travels on
Redis, strict decoders) -> broker (keys, streams, dead letters) -> redis_server (the embedded Redis);
vllm_client (vLLM's dev-mode control endpoints).
"""
