"""Tether: harnessed agentic RL. The services/ folder is installed as the `tether` package."""
