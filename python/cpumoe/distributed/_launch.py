"""Starting the processes of a run on this machine, over 127.0.0.1: what the demo does when
torchrun did not start it, and what the tests do. Each process gets torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so it joins with
``torch.distributed.init_process_group(backend, init_method="env://")``."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int, threads: int,
                     base: Optional[dict] = None) -> dict:
    """torchrun's variables for one process of a run on 127.0.0.1, its OpenMP thread count,
    and gloo bound to the loopback interface (unless the caller chose one)."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


@dataclass
class RankResult:
    rank: int
    returncode: int
    stopped: bool  # still running when a peer failed or the deadline passed, so stopped
    stdout: str
    stderr: str


def run_local(cmd: Sequence[str], world_size: int, *, threads: int = 1, timeout: float,
              capture: bool = True, env: Optional[dict] = None) -> List[RankResult]:
    """Runs ``cmd`` as ``world_size`` processes (ranks 0..world_size-1) on a free port of
    127.0.0.1 and waits for them. The run ends by itself: when a process fails the others
    are stopped (a collective would wait for it forever), and at ``timeout`` seconds all
    are. With ``capture`` their output is returned; without, rank 0 writes to this
    process's stdout, the others' stdout is dropped, and every stderr is inherited."""
    port = free_port()
    procs, files = [], []
    with tempfile.TemporaryDirectory(prefix="cpumoe-ranks-") as tmp:
        for rank in range(world_size):
            if capture:
                out = open(os.path.join(tmp, f"{rank}.out"), "w+")
                err = open(os.path.join(tmp, f"{rank}.err"), "w+")
                files.append((out, err))
            else:
                out, err = (None if rank == 0 else subprocess.DEVNULL), None
            procs.append(subprocess.Popen(
                list(cmd), env=rank_environment(rank, world_size, port, threads, env),
                stdout=out, stderr=err))
        deadline = time.monotonic() + timeout
        stopped = set()
        try:
            while any(p.poll() is None for p in procs):
                failed = any(p.returncode not in (None, 0) for p in procs)
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for rank, p in enumerate(procs):  # still running: a peer failed, or the deadline
                if p.poll() is None:
                    stopped.add(rank)
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        results = []
        for rank, p in enumerate(procs):
            text = ["", ""]
            if capture:
                for i, f in enumerate(files[rank]):
                    f.seek(0)
                    text[i] = f.read()
                    f.close()
            results.append(RankResult(rank, p.returncode, rank in stopped, *text))
    return results
