"""Trainer: the HF causal LM, the policy-gradient step, checkpoints that inference loads.

Modules in data-flow order: main (settings, process, torchrun ranks) -> servicer (gRPC Trainer: protos
<-> steps, status codes) -> steps (groups buffered, steps planned and recorded, one at a time) -> train
(one step's math) -> distributed (process group, wrapping, collectives) -> weights (checkpoints, LoRA)
-> weight_transfer, nccl_push (path 2 of the weight push).
"""
