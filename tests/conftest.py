"""pytest fixtures of the cpumoe test suite (test plumbing: cpumoe_testing.py; bit-exact
models of the kernels: exact_reference.py).

* ``isa``: runs a test once per ISA tier compiled into the build (``cpumoe.built_isas()``);
  tiers the CPU cannot run (above ``cpumoe.best_isa()``) are skipped with a reason that
  names the tier, the CPU's best tier and its features (cpumoe_testing.unsupported_reason);
  the previous tier is restored afterwards. Parametrize it indirectly to pick tiers per
  case.
* an autouse fixture seeds torch per test and restores the thread count and tier.
"""

import os
import sys
import zlib

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # cpumoe_testing, exact_reference
# `pytest tests` works without PYTHONPATH=python; an explicit PYTHONPATH still wins.
sys.path.append(os.path.join(os.path.dirname(_HERE), "python"))

import cpumoe  # noqa: E402
from cpumoe_testing import isa_params, skip_unless_supported, use_isa  # noqa: E402


@pytest.fixture(params=isa_params())
def isa(request):
    """The active tier for the test; parametrize indirectly to choose tiers per case."""
    tier = request.param
    skip_unless_supported(tier)
    with use_isa(tier):
        yield tier


@pytest.fixture(autouse=True)
def _seed_and_restore(request):
    """Seeds torch per test (from the test id, so cases differ but runs repeat) and
    restores the thread count and the ISA tier whatever the test did."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    threads = torch.get_num_threads()
    tier = cpumoe.isa()
    yield
    torch.set_num_threads(threads)
    if cpumoe.isa() != tier:
        cpumoe.set_isa(tier)


