"""Instruction following with verifiable constraints: RL teaches a policy to check its draft first."""
