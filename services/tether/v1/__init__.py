"""Generated from protos/tether/v1 by scripts/gen_protos.py. Do not edit."""
