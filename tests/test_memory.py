"""Resident memory stays flat over 2000 calls of each op and scheme.

Every scheme is covered. The binding allocates only the output, the cached per-thread workspace (grown, never
shrunk) and, with is_vnni=False, the per-call packed copies; all of it must go back to the
allocator. After a warm-up, RSS (from /proc/self/statm) is sampled every 250 calls; it
may not rise more than SLACK above the first sample. Measured: without a leak the rise was
0 KiB in every case (3 runs); a 4 KiB tensor or malloc block kept per call (a temporary
mutation of the binding) made every case fail, rising 6.5-25 MiB.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

import cpumoe
from cpumoe_testing import (
    Int4Weights,
    make_mxfp4_weights,
    make_routing,
    make_scheme_weights,
    make_weights,
    pack,
)

CALLS, WARMUP, EVERY = 2000, 200, 250
SLACK = 1 << 20  # bytes
M, E, TOPK, N, K = 8, 4, 2, 32, 64

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"),
                                reason="needs /proc/self/statm (Linux)")


def trim_heap() -> None:
    """Returns the free pages of glibc's heap to the OS (where glibc is the libc): a leak
    could otherwise reuse pages an earlier test freed but kept resident, and RSS would not
    show it until they run out."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_parts() -> str:
    """The resident set's anonymous and file-backed parts (Linux's /proc/self/status), for
    the failure message: a leak grows RssAnon, code pages touched for the first time grow
    RssFile."""
    try:
        with open("/proc/self/status") as f:
            parts = (line.partition(":") for line in f if line.startswith(("RssAnon", "RssFile")))
            return " ".join(f"{key} {value.strip()}" for key, _, value in parts)
    except OSError:
        return ""


def _fused(method, is_vnni=True, bad_ids=False):
    x = torch.randn(M, K).to(torch.bfloat16)
    tw, ti = make_routing(M, E, TOPK)
    if bad_ids:
        ti[3, 1] = E
    if method == 3:
        w = Int4Weights(E, N, K, 32)
        w1, w2, kw = w.p1[0], w.p2[0], w.op_kwargs()
    elif method == 4:
        w1, s1, w2, s2 = make_mxfp4_weights(E, N, K)
        kw = dict(moe_comp_method=4, w1_scale=cpumoe.convert_scale_packed(s1),
                  w2_scale=cpumoe.convert_scale_packed(s2))
        if is_vnni:
            w1, w2 = pack(w1), pack(w2)
    else:
        w1, w2, kw = make_scheme_weights(method, E, N, K)
        if is_vnni:
            w1, w2 = pack(w1), pack(w2)

    def call():
        try:
            return cpumoe.fused_experts(x, w1, w2, tw, ti, is_vnni=is_vnni, **kw)
        except RuntimeError:
            if not bad_ids:
                raise
    return call


def _shared():
    x = torch.randn(M, K).to(torch.bfloat16)
    w1, w2 = (pack(t[0]) for t in make_weights(1, N, K, torch.bfloat16))
    fused = torch.randn(M, K).to(torch.bfloat16)
    return lambda: cpumoe.shared_expert(x, w1, w2, fused, 2.0)


CASES = {
    "bf16": lambda: _fused(0),
    "int8": lambda: _fused(1),
    "fp8": lambda: _fused(2),
    "int4": lambda: _fused(3),
    "mxfp4": lambda: _fused(4),
    "mxfp4-unpacked": lambda: _fused(4, is_vnni=False),  # packs the codes on every call
    "int8-unpacked": lambda: _fused(1, is_vnni=False),  # packs w1/w2 on every call
    "bf16-rejected": lambda: _fused(0, bad_ids=True),  # the error path
    "shared": _shared,
}


@pytest.mark.parametrize("case", CASES)
def test_rss_flat(case):
    torch.set_num_threads(1)  # other threads' stacks and arenas are not the op's memory
    call = CASES[case]()
    for _ in range(WARMUP):
        call()
    trim_heap()
    samples, first_parts = [rss()], rss_parts()
    for i in range(1, CALLS + 1):
        call()
        if i % EVERY == 0:
            samples.append(rss())
    rise = max(samples) - samples[0]
    assert rise <= SLACK, (f"RSS rose by {rise / 1024:.0f} KiB over {CALLS} calls "
                           f"(samples in KiB: {[s // 1024 for s in samples]}; "
                           f"first: {first_parts}; last: {rss_parts()})")
