"""What only the CPU demo, the tests and the benches use; no service imports it.

Modules: tiny (a deterministic tiny chat model and tokenizer), warmstart (supervised warm start on
demonstrations), testset (a deterministic multi-turn tool-use test set for the merger).
"""
