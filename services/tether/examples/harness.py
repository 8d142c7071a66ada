"""What every example harness shares: its OpenAI client on a shared connection pool, the sample of tasks a
run draws, and the shuffled mix of demonstration kinds its warm start draws from. The examples import it; nothing else does."""

from __future__ import annotations

import functools
import random

import httpx
import openai


@functools.lru_cache(maxsize=16)
def _pool(base_url: str) -> httpx.Client:
    """One connection pool per endpoint, shared by every rollout's client (thread-safe). A client of
    its own per rollout cost ~20 ms of CPU (an SSL context) and a new connection."""
    return httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=512, max_keepalive_connections=128))


def client(base_url: str, api_key: str) -> openai.OpenAI:
    """The rollout's own client (its key), on the endpoint's shared pool."""
    # openai from 3.x types http_client as an httpx2.Client and takes an httpx.Client still (checked at run
    # time); older releases type it as httpx's: the ignore holds for both.
    return openai.OpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=1,
        timeout=60.0,
        http_client=_pool(base_url),  # type: ignore[arg-type, unused-ignore]
    )


def mix(n: int, fraction: float, rng: random.Random, name: str = "fraction") -> list[bool]:
    """n flags in a shuffled order, round(n * fraction) of them True: which demonstrations show the
    behaviour RL should find (the tool, the search) and which show the shortcut."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{name} must be in [0, 1]")
    n_true = round(n * fraction)
    kinds = [True] * n_true + [False] * (n - n_true)
    rng.shuffle(kinds)
    return kinds


def pick(every: list[dict], n: int | None, seed: int) -> list[dict]:
    """`every` task when n is None, else n of them sampled without replacement (the same n for a seed)."""
    if n is None:
        return every
    if not 0 <= n <= len(every):
        raise ValueError(f"n must be in [0, {len(every)}]")
    return random.Random(seed).sample(every, n)
