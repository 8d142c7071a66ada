"""Coding agent: a bash-tool harness fixing a seeded bug in an isolated copy of a small repository."""
