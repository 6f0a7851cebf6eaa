"""The ops called from 4 Python threads at once give the results of serial calls, bit for bit.

torch.ops calls release the GIL while the kernel runs (measured: a 140 ms fused_experts
call in one thread left the interpreter running the other thread with gaps of at most
12 ms), so these calls really overlap. The binding keeps one cached workspace per calling
thread (thread_local in csrc/bindings/runtime.cpp) and the C core one error message per
thread; the cases below have different workspace sizes, so a workspace shared between
threads would be overwritten or reallocated under a running call. (Checked: with the
workspace made one static tensor, and again with it allocated once at 64 MiB and shared,
test_threads_match_serial crashed the interpreter with a segmentation fault: another
thread's routing indices in the shared workspace send writes out of bounds.)
"""

from __future__ import annotations

import threading

import pytest
import torch

import cpumoe
from cpumoe_testing import (
    Int4Weights,
    make_bias,
    make_routing,
    make_scheme_weights,
    make_weights,
    pack,
)

THREADS = 4
ROUNDS = 4
CALLS = 3000


def _fused_case(method, M, E, topk, N, K, dtype, bias=False):
    x = torch.randn(M, K).to(dtype)
    tw, ti = make_routing(M, E, topk, drop_prob=0.1)
    if method == 3:
        w = Int4Weights(E, N, K, 64)
        pw1, pw2, kw = w.p1[0], w.p2[0], w.op_kwargs()
    else:
        w1, w2, kw = make_scheme_weights(method, E, N, K, dtype, block=(64, 64))
        pw1, pw2 = pack(w1), pack(w2)
    if bias:
        b1, b2 = make_bias(E, N, K)
        kw.update(w1_bias=b1, w2_bias=b2, alpha=1.702, limit=7.0)
    return lambda: cpumoe.fused_experts(x, pw1, pw2, tw, ti, **kw)


def _shared_case(M, N, K, dtype):
    x = torch.randn(M, K).to(dtype)
    w1, w2 = (t[0] for t in make_weights(1, N, K, dtype))
    fused = torch.randn(M, K).to(dtype)
    pw1, pw2 = pack(w1), pack(w2)
    return lambda: cpumoe.shared_expert(x, pw1, pw2, fused, 2.5)


def _pack_case():
    w = torch.randn(6, 128, 96).to(torch.bfloat16)
    return lambda: cpumoe.convert_weight_packed(w)


def run_threads(target) -> None:
    """Runs target(t) for t in 0..THREADS-1, each in its own thread; fails on a hang."""
    threads = [threading.Thread(target=target, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "hang"


def cases():
    """Calls of every scheme, dtypes and sizes (workspaces from ~50 KiB to ~3 MiB)."""
    bf16, fp16 = torch.bfloat16, torch.float16
    return [
        _fused_case(0, 3, 8, 2, 64, 128, bf16),
        _fused_case(0, 200, 8, 4, 128, 256, fp16),
        _fused_case(1, 17, 8, 2, 64, 128, bf16),
        _fused_case(1, 150, 6, 3, 128, 192, fp16, bias=True),
        _fused_case(2, 40, 8, 2, 128, 128, bf16),
        _fused_case(2, 120, 4, 2, 64, 256, fp16, bias=True),
        _fused_case(0, 64, 16, 1, 96, 64, bf16, bias=True),
        _fused_case(3, 33, 8, 2, 64, 128, bf16),
        _fused_case(3, 130, 4, 3, 128, 256, fp16, bias=True),
        _shared_case(90, 128, 128, bf16),
        _pack_case(),
    ]


@pytest.mark.parametrize("intra_op_threads", [1, 2])
def test_threads_match_serial(intra_op_threads):
    """Each of 4 threads runs every case ROUNDS times, in its own rotation of the order,
    all starting together; every result equals the serial one bit for bit."""
    torch.set_num_threads(intra_op_threads)
    calls = cases()
    expected = [c() for c in calls]
    start = threading.Barrier(THREADS)
    mismatches, errors = [], []

    def worker(t):
        order = list(range(len(calls)))
        order = order[t:] + order[:t]
        try:
            start.wait()
            for r in range(ROUNDS):
                for i in order:
                    if not torch.equal(calls[i](), expected[i]):
                        mismatches.append((t, r, i))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {e!r}")

    run_threads(worker)
    assert not errors, errors
    assert not mismatches, f"(thread, round, case) differing from the serial result: {mismatches}"


def test_errors_in_threads_are_their_own():
    """4 threads each repeating bad calls of their own get the message of their own call
    (the C core keeps its error text per thread). The window in which a shared text could
    be overwritten is short: with the text made global (no _Thread_local in
    common/error.c), this test failed in 7 of 8 runs."""
    x = torch.randn(64, 64).to(torch.bfloat16)
    w1, w2 = (pack(w) for w in make_weights(8, 32, 64, torch.bfloat16))
    tw, ti = make_routing(64, 8, 2)
    bad = []
    for t in range(THREADS):
        ids = ti.clone()
        ids[7 * t + 3, 1] = 100 + t
        bad.append((ids, f"topk_ids[{7 * t + 3}, 1] = {100 + t} is outside [0, 8)"))
    start = threading.Barrier(THREADS)
    problems = []

    def caller(t):
        ids, want = bad[t]
        start.wait()
        for _ in range(CALLS):
            try:
                cpumoe.fused_experts(x, w1, w2, tw, ids)
                problems.append(f"thread {t}: accepted")
            except RuntimeError as e:
                if want not in str(e):
                    problems.append(f"thread {t}: {e} (wanted {want})")

    run_threads(caller)
    assert not problems, problems[:5]


def test_workers_run_on_torchs_threads():
    """At 2 torch threads the op's workers run on 2 OS threads, at 1 on one. (The binding was
    once built without -fopenmp: at::parallel_for, an OpenMP region compiled into the binding,
    then ran every worker on the calling thread, so '2 threads' measured one.)"""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpumoe._C.runner_threads(2) == 2
        assert cpumoe._C.runner_threads(8) == 2
        torch.set_num_threads(1)
        assert cpumoe._C.runner_threads(8) == 1
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [3, 4, 7])
def test_uneven_worker_counts_match_one_thread(threads):
    """Each worker owns a segment of a stage's tasks and steals from the back of the others'
    (csrc/kernels/common/parallel.c); with more workers than cores and segment counts that do
    not divide the task counts, every task still runs exactly once: the outputs of every
    scheme are those of one thread, bit for bit."""
    torch.manual_seed(threads)
    calls = cases()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [call() for call in calls]
        torch.set_num_threads(threads)
        cpumoe._C.release_workspace()  # no stale results to hide a task that did not run
        got = [call() for call in calls]
    finally:
        torch.set_num_threads(previous)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), i
