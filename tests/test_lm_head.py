"""The chunked LM head (tether/trainer/lm_head.py) against the plain path that materialises the logits:
log p(target), entropy and their gradients wrt the hidden states and the head's weight, in fp32 (to
1e-5 relative) and in fp64 (to 1e-10), for any chunking, with and without an entropy term."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.trainer.lm_head import (
    chunk_positions,
    plain_logprobs_and_entropy,
    target_logprobs_and_entropy,
)


def _case(n, v, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype) * 2
    weight = torch.randn(v, h, generator=g, dtype=dtype) / h**0.5
    targets = torch.randint(0, v, (n,), generator=g)
    a = torch.randn(n, generator=g, dtype=dtype)
    b = torch.randn(n, generator=g, dtype=dtype)
    return hidden, weight, targets, a, b


def _grads(fn, hidden, weight, targets, a, b, entropy_term):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    lp, ent = fn(hidden, weight, targets)
    loss = (a * lp).sum() + ((b * ent).sum() if entropy_term else 0.0)
    loss.backward()
    return lp.detach(), ent.detach(), loss.detach(), hidden.grad, weight.grad


def _plain(hidden, weight, targets):
    return plain_logprobs_and_entropy(hidden @ weight.t(), targets)


def _close(x, y, rtol):
    scale = y.abs().max().clamp(min=1e-30)
    return float((x - y).abs().max() / scale) <= rtol


@pytest.mark.parametrize("entropy_term", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_the_plain_path_in_fp32(chunk, entropy_term):
    case = _case(50, 3000, 32, torch.float32)
    got = _grads(lambda h, w, t: target_logprobs_and_entropy(h, w, t, chunk), *case, entropy_term)
    want = _grads(_plain, *case, entropy_term)
    for name, x, y in zip(("logprobs", "entropy", "loss", "d hidden", "d weight"), got, want, strict=True):
        assert _close(x, y, 1e-5), name


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    v=st.integers(2, 300),
    h=st.integers(1, 24),
    chunk=st.integers(1, 50),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_the_plain_path_in_fp64(n, v, h, chunk, seed):
    case = _case(n, v, h, torch.float64, seed)
    got = _grads(lambda hh, w, t: target_logprobs_and_entropy(hh, w, t, chunk), *case, True)
    want = _grads(_plain, *case, True)
    for x, y in zip(got, want, strict=True):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12)


def test_the_entropy_of_a_uniform_policy_is_log_v_and_a_certain_one_is_zero():
    v = 128
    hidden = torch.zeros(3, 4)
    lp, ent = target_logprobs_and_entropy(hidden, torch.randn(v, 4), torch.tensor([0, 5, 9]), chunk=2)
    assert torch.allclose(ent, torch.full((3,), float(torch.log(torch.tensor(v)))))
    assert torch.allclose(lp, torch.full((3,), -float(torch.log(torch.tensor(v)))))
    weight = torch.zeros(v, 1)
    weight[7] = 1.0
    lp, ent = target_logprobs_and_entropy(torch.full((2, 1), 200.0), weight, torch.tensor([7, 7]))
    assert float(ent.abs().max()) < 1e-6 and float(lp.abs().max()) < 1e-6


def test_a_chunk_holds_the_budget_of_logits():
    assert chunk_positions(151_936) == 256 * 1024 * 1024 // (4 * 151_936)
    assert chunk_positions(10**12) == 1


def test_only_the_gradients_asked_for_are_computed():
    hidden, weight, targets, a, _ = _case(5, 20, 4, torch.float32)
    weight.requires_grad_(True)
    lp, _ = target_logprobs_and_entropy(hidden, weight, targets, chunk=2)
    (a * lp).sum().backward()
    assert hidden.grad is None and weight.grad is not None
    with pytest.raises(ValueError, match="hidden"):
        target_logprobs_and_entropy(hidden[None], weight, targets)
