"""Golden output digests: the exact bits of a few hundred op calls, recorded once and
checked on every tier the CPU runs, with 1 and 2 threads.

The other tests compare tiers with each other and with the reference; these pin the
bits themselves, so a refactor that changes every tier the same way (an operation order
moved in the shared pipeline, a rounding step dropped) still fails. Inputs are made
from integers (torch.randint with a fixed generator) scaled by powers of two, so they
are the same bits on any machine and torch build; weights are packed by our packers.

Record again only when an output is meant to change, and say why in the commit:
    python tests/test_golden_digests.py --record
A new case (a new scheme's) gets its digest without touching the others:
    python tests/test_golden_digests.py --record-new
"""

import hashlib
import itertools
import json
import os
import sys
import zlib

import pytest
import torch

import cpumoe
from cpumoe_testing import bits_class

# The digests hold the bits of this numerics class (and of fp32-chain-daz, which parts from it
# only on denormals: the digests' data have none); a tier of another class agrees with them
# only within its tolerance, which the other tests check.
GOLDEN_CLASS = "fp32-chain"
DIGESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden_digests.json")


def _generator(*key):
    # crc32 of the repr, not hash(): str hashes change with every process
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _ints(gen, shape, lo, hi):
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64)


def _dyadic(gen, shape, lo, hi, shift, dtype):
    """Integers in [lo, hi) times 2^-shift: exact in bf16/fp16 for |ints| < 256."""
    return (_ints(gen, shape, lo, hi).to(torch.float32) * 2.0**-shift).to(dtype)


def _routing(gen, M, E, topk, ids_dtype, skip):
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)])
    if skip and M > 1:
        ids[1, 0] = -1
    weights = _ints(gen, (M, topk), 1, 256).to(torch.float32) / 256
    return weights, ids.to(ids_dtype)


def _int4_checkpoint(gen, E, OC, IC, group, fmt):
    G = IC // group
    if fmt == 0:  # AWQ: qweight [IC, OC/8]
        qweight = _ints(gen, (E, IC, OC // 8), -(2**31), 2**31).to(torch.int32)
    else:  # GPTQ: qweight [IC/8, OC]
        qweight = _ints(gen, (E, IC // 8, OC), -(2**31), 2**31).to(torch.int32)
    qzeros = _ints(gen, (E, G, OC // 8), -(2**31), 2**31).to(torch.int32)
    scales = _dyadic(gen, (E, G, OC), 1, 64, 12, torch.float16)
    return cpumoe.convert_weight_packed_scale_zp(qweight, qzeros, scales, fmt)


def _fused_case(scheme, act, activation, bias, M, shape, extra):
    E, topk, K, N = shape
    gen = _generator(scheme, act, activation, bias, M, shape, extra)
    x = _dyadic(gen, (M, K), -127, 128, 6, act)
    topk_weights, topk_ids = _routing(gen, M, E, topk, torch.int32 if M % 2 else torch.int64,
                                      skip=True)
    kw = {}
    if scheme == 0:
        w1 = _dyadic(gen, (E, 2 * N, K), -127, 128, 10, act)
        w2 = _dyadic(gen, (E, K, N), -127, 128, 10, act)
        w1, w2 = cpumoe.convert_weight_packed(w1), cpumoe.convert_weight_packed(w2)
    elif scheme == 1:
        w1 = cpumoe.convert_weight_packed(_ints(gen, (E, 2 * N, K), -128, 128).to(torch.int8))
        w2 = cpumoe.convert_weight_packed(_ints(gen, (E, K, N), -128, 128).to(torch.int8))
        kw = dict(w1_scale=_dyadic(gen, (E, 2 * N, 1), 1, 64, 14, torch.float32),
                  w2_scale=_dyadic(gen, (E, K, 1), 1, 64, 12, torch.float32))
    elif scheme == 2:
        bn, bk = extra
        w1, w2 = (_ints(gen, s, 0, 256).to(torch.uint8) for s in ((E, 2 * N, K), (E, K, N)))
        w1[(w1 & 0x7F) == 0x7F] = 0  # no NaN codes
        w2[(w2 & 0x7F) == 0x7F] = 0
        w1 = cpumoe.convert_weight_packed(w1.view(torch.float8_e4m3fn))
        w2 = cpumoe.convert_weight_packed(w2.view(torch.float8_e4m3fn))
        kw = dict(w1_scale=_dyadic(gen, (E, -(-2 * N // bn), -(-K // bk)), 1, 64, 12,
                                   torch.float32),
                  w2_scale=_dyadic(gen, (E, -(-K // bn), -(-N // bk)), 1, 64, 10, torch.float32),
                  block_size=[bn, bk])
    elif scheme == 4:  # MXFP4: every code, scales up to 2^-6 (weights up to 6 / 64)
        c1, c2 = (_ints(gen, s, 0, 256).to(torch.uint8) for s in ((E, 2 * N, K // 2),
                                                                    (E, K, N // 2)))
        s1, s2 = (_ints(gen, s, 117, 122).to(torch.uint8) for s in ((E, 2 * N, K // 32),
                                                                      (E, K, N // 32)))
        w1, w2 = cpumoe.convert_weight_packed(c1), cpumoe.convert_weight_packed(c2)
        kw = dict(w1_scale=cpumoe.convert_scale_packed(s1),
                  w2_scale=cpumoe.convert_scale_packed(s2))
    else:
        g1, g2, fmt = extra
        p1 = _int4_checkpoint(gen, E, 2 * N, K, g1, fmt)
        p2 = _int4_checkpoint(gen, E, K, N, g2, fmt)
        w1, w2 = p1[0], p2[0]
        kw = dict(w1_scale=p1[2], w2_scale=p2[2], w1_zero=p1[1], w2_zero=p2[1])
    if bias:
        kw["w1_bias"] = _dyadic(gen, (E, 2 * N), -64, 64, 6, torch.float32)
        kw["w2_bias"] = _dyadic(gen, (E, K), -64, 64, 6, torch.float32)
    if activation == "swiglu":
        kw.update(alpha=1.702, limit=7.0)
    return lambda: cpumoe.fused_experts(x, w1, w2, topk_weights, topk_ids, moe_comp_method=scheme,
                                        **kw)


def _shared_case(scheme, act, M, K, N, residual):
    gen = _generator("shared", scheme, act, M, K, N, residual)
    x = _dyadic(gen, (M, K), -127, 128, 6, act)
    kw = {}
    if scheme == 0:
        w1 = cpumoe.convert_weight_packed(_dyadic(gen, (2 * N, K), -127, 128, 10, act))
        w2 = cpumoe.convert_weight_packed(_dyadic(gen, (K, N), -127, 128, 10, act))
    elif scheme == 1:
        w1 = cpumoe.convert_weight_packed(_ints(gen, (2 * N, K), -128, 128).to(torch.int8))
        w2 = cpumoe.convert_weight_packed(_ints(gen, (K, N), -128, 128).to(torch.int8))
        kw = dict(use_int8_w8a8=True, w1_scale=_dyadic(gen, (2 * N, 1), 1, 64, 14, torch.float32),
                  w2_scale=_dyadic(gen, (K, 1), 1, 64, 12, torch.float32))
    else:
        w1, w2 = (_ints(gen, s, 0, 256).to(torch.uint8) for s in ((2 * N, K), (K, N)))
        w1[(w1 & 0x7F) == 0x7F] = 0
        w2[(w2 & 0x7F) == 0x7F] = 0
        w1 = cpumoe.convert_weight_packed(w1.view(torch.float8_e4m3fn))
        w2 = cpumoe.convert_weight_packed(w2.view(torch.float8_e4m3fn))
        kw = dict(use_fp8_w8a16=True, block_size=[128, 128],
                  w1_scale=_dyadic(gen, (-(-2 * N // 128), -(-K // 128)), 1, 64, 12,
                                   torch.float32),
                  w2_scale=_dyadic(gen, (-(-K // 128), -(-N // 128)), 1, 64, 10, torch.float32))
    args = ()
    if residual:
        args = (_dyadic(gen, (M, K), -127, 128, 6, act), 2.5)
    return lambda: cpumoe.shared_expert(x, w1, w2, *args, **kw)


def _cases():
    """name -> a function returning the op's output. Names are stable: they key the file."""
    cases = {}
    shapes = [(8, 2, 64, 32), (6, 3, 96, 160)]
    extras = {0: [None], 1: [None], 2: [(128, 128), (32, 64)], 3: [(32, 64, 0), (128, 32, 1)],
              4: [None]}
    acts = [torch.bfloat16, torch.float16]
    for scheme, act, activation, bias, M, shape in itertools.product(
            range(5), acts, ("silu", "swiglu"), (False, True), (1, 3, 16, 37), shapes):
        if activation == "swiglu" and not bias and M in (3, 16):
            continue  # swiglu is covered with and without bias at the other M
        for extra in extras[scheme]:
            if scheme == 3 and shape[3] % extra[1]:
                continue  # the group size must divide the reduction
            if scheme == 3 and shape[2] % extra[0]:
                continue
            name = (f"fused s{scheme} {str(act)[6:]} {activation} bias{int(bias)} M{M} "
                    f"E{shape[0]}k{shape[1]}K{shape[2]}N{shape[3]} {extra}")
            cases[name] = _fused_case(scheme, act, activation, bias, M, shape, extra)
    for scheme, act, M, residual in itertools.product(range(3), acts, (1, 5, 40), (False, True)):
        name = f"shared s{scheme} {str(act)[6:]} M{M} residual{int(residual)}"
        cases[name] = _shared_case(scheme, act, M, 128, 64, residual)
    # more than one 1024-token chunk
    cases["fused s1 bfloat16 silu bias0 M1100 E4k2K64N32"] = _fused_case(
        1, torch.bfloat16, "silu", False, 1100, (4, 2, 64, 32), None)
    cases["fused s0 float16 silu bias1 M1030 E4k2K64N32"] = _fused_case(
        0, torch.float16, "silu", True, 1030, (4, 2, 64, 32), None)
    return cases


def _digest(t):
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()[:20]


def _load():
    with open(DIGESTS) as f:
        return json.load(f)


def _check_tier(tier):
    from cpumoe_testing import use_isa

    want = _load()
    cases = _cases()
    assert sorted(want) == sorted(cases), "the case list changed: record the digests again"
    bad = []
    with use_isa(tier):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, run in cases.items():
                got = _digest(run())
                if got != want[name]:
                    bad.append(f"{name} ({threads} threads): {got} != {want[name]}")
    assert not bad, f"{len(bad)} of {2 * len(cases)} outputs changed on {tier}:\n" + "\n".join(
        bad[:20])


def test_golden_digests(isa):
    if bits_class(cpumoe.numerics_class(isa)) != GOLDEN_CLASS:
        pytest.skip(f"tier {isa} is in numerics class {cpumoe.numerics_class(isa)}; the "
                    f"digests hold the bits of {GOLDEN_CLASS}")
    _check_tier(isa)


def _record(only_new=False):
    torch.set_num_threads(1)
    cpumoe.set_isa(cpumoe.built_isas()[0])  # the portable tier
    assert cpumoe.numerics_class(cpumoe.isa()) == GOLDEN_CLASS
    kept = _load() if only_new else {}
    digests = {name: kept[name] if name in kept else _digest(run())
               for name, run in _cases().items()}
    os.makedirs(os.path.dirname(DIGESTS), exist_ok=True)
    with open(DIGESTS, "w") as f:
        json.dump(digests, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"recorded {len(digests) - len(kept)} digests on the {cpumoe.isa()} tier to {DIGESTS}")


if __name__ == "__main__" and ("--record" in sys.argv or "--record-new" in sys.argv):
    _record(only_new="--record-new" in sys.argv)
