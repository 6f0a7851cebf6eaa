"""cm_parallel_tasks and cm_parallel_stages (csrc/kernels/common/parallel.c) under
ThreadSanitizer: the stress program tests/stress/parallel_tasks.c runs stages of 0..4999
uneven tasks on 1..9 pthread workers, and chains of up to 8 stages on workers with their
own threads, run one after another, or two to a thread; it checks that every task ran
exactly once and after the stage before it, and ThreadSanitizer checks the lock-free claims
and the waits between stages for data races. Skipped where no ThreadSanitizer build or run
is possible."""

from __future__ import annotations

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(REPO, "tests", "stress", "parallel_tasks.c")
PARALLEL = os.path.join(REPO, "csrc", "kernels", "common", "parallel.c")


def test_parallel_tasks_under_thread_sanitizer(tmp_path):
    exe = str(tmp_path / "parallel_tasks")
    build = subprocess.run(
        [os.environ.get("CC", "cc"), "-std=c11", "-O1", "-g", "-fsanitize=thread",
         "-I" + os.path.join(REPO, "csrc", "include"), "-I" + os.path.join(REPO, "csrc", "kernels"),
         SOURCE, PARALLEL, "-o", exe, "-lpthread"],
        capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip("no ThreadSanitizer build here: " + build.stderr.strip()[-300:])
    run = subprocess.run([exe, "600"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TSAN_OPTIONS": "halt_on_error=1"})
    report = run.stdout + run.stderr
    if run.returncode != 0 and "FATAL: ThreadSanitizer" in report and "WARNING" not in report:
        pytest.skip("ThreadSanitizer cannot run here: " + report.strip()[-300:])
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), report[-2000:]
