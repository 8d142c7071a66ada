"""Trainer: the HF causal LM, the policy-gradient step, checkpoints that inference loads."""
