"""What the command modules share about argparse: the type of the subparsers each adds its commands to
(argparse's own name for it is private)."""

from __future__ import annotations

import argparse

Subparsers = argparse._SubParsersAction
