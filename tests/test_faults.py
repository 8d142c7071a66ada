"""The fault matrix (`make test-all`): every process of one running `tether demo` killed with -9 in
turn, the run finishing on its own with nothing lost and the reward still rising. What is dealt and what
must hold after it: tests/fault_helpers.py. `make test` kills the gateway in tests/test_e2e.py's demo."""

from __future__ import annotations

import pytest
from fault_helpers import FAULTS, check_fault_run, demo_with_faults

pytestmark = pytest.mark.slow

STEPS = 20


def test_every_fault_in_one_run(tmp_path):
    check_fault_run(demo_with_faults(tmp_path, FAULTS, steps=STEPS), learns=True)
