"""Example harnesses, shipped in the package so `tether demo --example NAME` runs from an installed wheel.

Each `<name>/agent.py` has the same shape (README.md here): tasks, the tiny model's vocabulary and
demonstrations, and the harness function `rollout`.
"""
