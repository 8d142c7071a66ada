"""Example harnesses, shipped in the package so `tether demo` runs from an installed wheel.

Modules: calculator.agent (the demo's tasks, demonstrations and harness function `rollout`).
"""
