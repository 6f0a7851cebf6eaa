"""Linux grants AMX tile data only on request (arch_prctl ARCH_REQ_XCOMP_PERM); cpumoe asks
once per process. Where the kernel refuses, the best other tier must run and
cpumoe.isa_reason() must say why (docs/KERNELS.md, dispatch/cpuinfo.c).

The refusal is made real: a child process starts under a seccomp filter that fails exactly
that arch_prctl request with EPERM (a tiny C launcher, compiled here), then imports cpumoe.
Runs on CPUs with the amx tier and a C compiler."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import cpumoe
from cpumoe_testing import subprocess_env

LAUNCHER = textwrap.dedent(r"""
    /* Runs argv[1..] with arch_prctl(ARCH_REQ_XCOMP_PERM, ...) failing with EPERM. */
    #include <errno.h>
    #include <linux/filter.h>
    #include <linux/seccomp.h>
    #include <stddef.h>
    #include <stdio.h>
    #include <sys/prctl.h>
    #include <sys/syscall.h>
    #include <unistd.h>

    int main(int argc, char **argv) {
      struct sock_filter filter[] = {
          BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
          BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_arch_prctl, 0, 3),
          BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
          BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 0, 1),
          BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
          BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      };
      struct sock_fprog prog = {sizeof filter / sizeof filter[0], filter};
      if (argc < 2 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
          prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        perror("seccomp");
        return 126;
      }
      execvp(argv[1], argv + 1);
      perror("execvp");
      return 127;
    }
""")

CHILD = textwrap.dedent("""
    import json, torch, cpumoe
    from cpumoe import reference
    E, N, K, M = 2, 32, 64, 40
    torch.manual_seed(0)
    x = torch.randn(M, K).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * N, K) / 8).to(torch.bfloat16)
    w2 = (torch.randn(E, K, N) / 6).to(torch.bfloat16)
    tw = torch.ones(M, 1)
    ti = (torch.arange(M) % E).view(M, 1).int()
    out = cpumoe.fused_experts(x, cpumoe.convert_weight_packed(w1),
                               cpumoe.convert_weight_packed(w2), tw, ti, is_vnni=True)
    ref = reference.fused_experts(x, w1, w2, tw, ti)
    print(json.dumps({"isa": cpumoe.isa(), "best": cpumoe.best_isa(),
                      "reason": cpumoe.isa_reason(),
                      "max_err": (out.float() - ref.float()).abs().max().item()}))
""")


def _has_amx_tier() -> bool:
    return "amx" in cpumoe.built_isas() and cpumoe.best_isa() == "amx"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's AMX permission")
def test_refused_tile_permission_falls_back_with_a_reason(tmp_path):
    if not _has_amx_tier():
        pytest.skip(f"this CPU's best tier is {cpumoe.best_isa()}, not amx: nothing to refuse")
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler to build the seccomp launcher")
    src = tmp_path / "refuse_amx.c"
    src.write_text(LAUNCHER)
    exe = tmp_path / "refuse_amx"
    subprocess.run([cc, "-O1", str(src), "-o", str(exe)], check=True)
    env = subprocess_env()
    env.pop("CPUMOE_ISA", None)
    result = subprocess.run([str(exe), sys.executable, "-c", CHILD], env=env,
                            capture_output=True, text=True, timeout=300)
    if result.returncode == 126:
        pytest.skip(f"seccomp is not available here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["best"] == "avx512bf16" and got["isa"] == "avx512bf16", got
    assert "amx not used" in got["reason"] and "refused" in got["reason"], got["reason"]
    assert "Operation not permitted" in got["reason"], got["reason"]
    assert got["max_err"] < 0.05, got  # the fallback tier computes the op


def test_granted_tile_permission_is_not_reported():
    """Without a refusal the reason says nothing about AMX on an AMX machine."""
    if not _has_amx_tier():
        pytest.skip(f"this CPU's best tier is {cpumoe.best_isa()}, not amx")
    assert "amx not used" not in cpumoe.isa_reason()
