"""Packed weights (with INT4's zero points and scales and MXFP4's packed scales) and the op
workspace are on transparent huge pages where Linux offers them.

The packers (and ``_C.new_weight_buffer``, which the bench's bandwidth probe streams and its
weight copies live in) ask the kernel with ``madvise(MADV_HUGEPAGE)`` for the 2 MiB-aligned
interior of the new tensor, before the packer writes it. Whether the kernel then *gives* huge pages depends on its
settings and on fragmentation, so the test checks what is deterministic: the mapping that
holds the packed bytes carries the advice (``hg`` in its ``VmFlags`` in /proc/self/smaps),
and the packed bytes are the same as without it (test_packing covers their values).
"""

from __future__ import annotations

import os

import pytest
import torch

import cpumoe
from cpumoe import _C

THP = "/sys/kernel/mm/transparent_hugepage/enabled"
pytestmark = pytest.mark.skipif(
    not (os.path.exists("/proc/self/smaps") and os.path.exists(THP)),
    reason="needs Linux with transparent huge pages (/proc/self/smaps, " + THP + ")")

HUGE = 2 << 20


def vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that contains ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def interior_of(address: int, nbytes: int) -> int:
    """The first 2 MiB-aligned huge page inside the ``nbytes`` bytes at ``address``."""
    first = (address + HUGE - 1) & ~(HUGE - 1)
    assert first + HUGE <= address + nbytes
    return first


def interior(t: torch.Tensor) -> int:
    """An address in the first 2 MiB-aligned huge page inside ``t``'s bytes."""
    return interior_of(t.data_ptr(), t.numel() * t.element_size())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8,
                                   torch.float8_e4m3fn, torch.uint8])
def test_packed_weights_advised(dtype):
    E, OC, IC = 4, 256, 4096  # 4-8 MiB: a few huge pages inside
    if dtype == torch.int8:
        w = torch.randint(-127, 128, (E, OC, IC), dtype=torch.int8)
    elif dtype == torch.uint8:  # MXFP4 codes, two a byte: [E, OC, IC / 2], 4 MiB
        w = torch.randint(0, 256, (E, 2 * OC, IC // 2), dtype=torch.uint8)
    else:
        w = torch.randn(E, OC, IC).to(dtype)
    packed = cpumoe.convert_weight_packed(w)
    assert "hg" in vm_flags(interior(packed))


def test_int4_packed_weights_advised():
    E, OC, IC, G = 4, 512, 4096, 32  # 4.5 MiB packed
    qweight = torch.randint(-2**31, 2**31 - 1, (E, IC, OC // 8), dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (E, G, OC // 8), dtype=torch.int32)
    scales = torch.rand(E, G, OC, dtype=torch.bfloat16)
    packed, _, _ = cpumoe.convert_weight_packed_scale_zp(qweight, qzeros, scales, 0)
    assert "hg" in vm_flags(interior(packed))


def test_int4_zeros_and_scales_advised():
    """The zero points and scales stream beside the packed weights on every call: advised
    the same way (a decode kernel with them on 4 KiB pages streamed 10-15 % slower)."""
    E, OC, IC, G = 8, 2048, 4096, 256  # zeros 4 MiB, scales 16 MiB
    qweight = torch.randint(-2**31, 2**31 - 1, (E, IC, OC // 8), dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (E, G, OC // 8), dtype=torch.int32)
    scales = torch.rand(E, G, OC, dtype=torch.bfloat16)
    _, zeros, out_scales = cpumoe.convert_weight_packed_scale_zp(qweight, qzeros, scales, 0)
    assert zeros.numel() * zeros.element_size() == 4 << 20
    assert "hg" in vm_flags(interior(zeros))
    assert "hg" in vm_flags(interior(out_scales))


def test_mxfp4_scales_advised():
    E, OC, G = 8, 4096, 128  # e8m0 scales of [E, OC, 4096] codes: 4 MiB
    scale = torch.randint(100, 140, (E, OC, G), dtype=torch.uint8)
    packed = cpumoe.convert_scale_packed(scale)
    assert "hg" in vm_flags(interior(packed))


def test_weight_buffer():
    buf = _C.new_weight_buffer(3 * HUGE)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE and buf.is_contiguous()
    assert "hg" in vm_flags(interior(buf))
    assert _C.new_weight_buffer(0).numel() == 0
    with pytest.raises(RuntimeError, match="nbytes must be >= 0"):
        _C.new_weight_buffer(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float32, torch.uint8])
def test_bench_weight_copies_advised(dtype):
    """The bench's weight layers (and the dense bench's copies) are weight_copy()s: the same
    values, dtype and shape, in memory advised as packed weights and the read probe's buffer
    are (a clone() would be on torch's 4 KiB pages)."""
    from cpumoe.bench.machine import weight_copy

    t = (torch.randn(3, 1024, 2048) * 50).to(dtype)  # 6-24 MiB: huge pages inside
    c = weight_copy(t)
    assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
    assert c.data_ptr() != t.data_ptr()
    assert "hg" in vm_flags(interior(c))
    scalar = torch.tensor(2.5)  # a per-tensor scale
    assert torch.equal(weight_copy(scalar), scalar) and weight_copy(scalar).shape == ()
    strided = t.transpose(1, 2)
    assert torch.equal(weight_copy(strided), strided)


def test_op_workspace_advised():
    """The op's cached workspace is asked for huge pages too: its A panels are written and
    tile-loaded back on every call, 16 rows a load, each row on its own 4 KiB page when the
    rows are 4 KiB apart."""
    from cpumoe_testing import make_hidden, make_routing, make_weights, run_fused

    _C.release_workspace()
    assert _C.workspace_address() == 0
    M, E, topk, N, K = 256, 8, 2, 1024, 2048  # a workspace of ~12 MiB
    x = make_hidden(M, K, torch.bfloat16)
    w1, w2 = make_weights(E, N, K, torch.bfloat16)
    tw, ti = make_routing(M, E, topk)
    out = run_fused(x, w1, w2, tw, ti, is_vnni=False)
    address, nbytes = _C.workspace_address(), _C.workspace_bytes()
    assert address != 0 and nbytes >= 3 * HUGE
    assert "hg" in vm_flags(interior_of(address, nbytes))
    _C.release_workspace()
    assert torch.equal(run_fused(x, w1, w2, tw, ti, is_vnni=False), out)
