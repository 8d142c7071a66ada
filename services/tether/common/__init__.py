"""Code every service shares (docs/architecture.md).

Modules: settings (CommonSettings, RedisSettings), logs (one format), net (free ports), grpc_server (health,
reflection, metrics, graceful stop), records (what travels on Redis), broker (keys and streams),
redis_server (the embedded Redis), vllm_client (vLLM's dev-mode control endpoints).
"""
