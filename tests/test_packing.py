"""convert_weight_packed: VNNI-2 layout of 16-bit weights, byte-identical to SGLang's
(docs/FORMATS.md, 16-bit weights; docs/SGLANG.md, same packed layouts), its small-OC
special case and errors."""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe import reference

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("shape", [
    (32, 32), (64, 96), (48, 64), (16, 32), (80, 160),  # 2-D, OC % 32 in {0, 16}
    (1, 32, 64), (3, 64, 32), (2, 48, 96), (4, 16, 64), (5, 112, 160),  # 3-D
], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_matches_reference_packer(dt, shape):
    w = torch.randn(*shape).to(DT[dt])
    w_before = w.clone()
    packed = cpumoe.convert_weight_packed(w)
    assert packed.dtype == w.dtype and packed.shape == w.shape and packed.is_contiguous()
    assert torch.equal(bits(packed), bits(reference.pack_vnni2(w)))
    assert torch.equal(bits(w), bits(w_before)), "input modified"
    if shape[-2] * shape[-1] > 32 * 32 or (len(shape) == 3 and shape[0] > 1):
        assert not torch.equal(bits(packed), bits(w)), "packing was a no-op"


def formula_pack(w: torch.Tensor) -> torch.Tensor:
    """The layout of docs/FORMATS.md (16-bit weights: VNNI-2), element by element:
    block b of expert e holds rows 32b .. 32b+nsz-1 (nsz = 32, or 16 for a last half
    block) at offset e*OC*IC + 32*b*IC, and inside it
    dst[(k/2)*2*nsz + 2*n + (k%2)] = W[32b+n][k]."""
    src = w.reshape(-1, *w.shape[-2:]).view(torch.int16)
    E, OC, IC = src.shape
    flat = [0] * src.numel()
    s = src.tolist()
    for e in range(E):
        for b in range((OC + 31) // 32):
            nsz = min(32, OC - 32 * b)
            base = e * OC * IC + 32 * b * IC
            for n in range(nsz):
                for k in range(IC):
                    flat[base + (k // 2) * 2 * nsz + 2 * n + (k % 2)] = s[e][32 * b + n][k]
    return torch.tensor(flat, dtype=torch.int16).view(w.shape)


@pytest.mark.parametrize("shape", [(2, 48, 64), (80, 32)], ids=["3d-48x64", "2d-80x32"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_hand_formula_on_arange(dt, shape):
    """Every element distinct (its index, as raw 16-bit bits), so any misplaced element
    shows; checked against the formula written out index by index."""
    n = torch.Size(shape).numel()
    w = torch.arange(n, dtype=torch.int16).view(DT[dt]).reshape(shape)
    packed = cpumoe.convert_weight_packed(w)
    expected = formula_pack(w)
    assert torch.equal(bits(packed), expected)
    assert torch.equal(bits(reference.pack_vnni2(w)), expected)
    # spot values worked out by hand for the 3-D case: W[e][r][k] = e*48*64 + r*64 + k
    if shape == (2, 48, 64):
        flat = bits(packed).flatten().tolist()
        assert flat[0:4] == [0, 1, 64, 65]          # (k=0,1) of rows 0 and 1
        assert flat[64:66] == [2, 3]                # k=2,3 of row 0 after the 32 row pairs
        # last half block (rows 32..47, nsz=16) starts at 32*64; its second pair row is 33
        assert flat[32 * 64: 32 * 64 + 4] == [32 * 64, 32 * 64 + 1, 33 * 64, 33 * 64 + 1]
        assert flat[32 * 64 + 32] == 32 * 64 + 2    # k=2 of row 32 after 16 row pairs
        assert flat[48 * 64] == 48 * 64             # expert 1 starts with its W[0][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8],
                         ids=["bf16", "fp16", "int8"])
@pytest.mark.parametrize("oc", [1, 8, 15])
def test_small_oc_2d_returns_fp32_transpose(dtype, oc):
    w = (torch.randn(oc, 64) * 10).to(dtype)
    out = cpumoe.convert_weight_packed(w)
    assert out.dtype == torch.float32 and out.shape == (64, oc) and out.is_contiguous()
    assert torch.equal(out, w.float().t().contiguous())


def test_empty_experts():
    w = torch.empty(0, 32, 64, dtype=torch.bfloat16)
    out = cpumoe.convert_weight_packed(w)
    assert out.shape == w.shape and out.dtype == w.dtype


def test_packing_thread_count_independent():
    w = torch.randn(6, 96, 128).to(torch.bfloat16)
    torch.set_num_threads(1)
    one = cpumoe.convert_weight_packed(w)
    torch.set_num_threads(2)
    assert torch.equal(bits(one), bits(cpumoe.convert_weight_packed(w)))


# ---------------------------------------------------------------------------------------
# Errors: RuntimeError naming the problem, never a crash.


@pytest.mark.parametrize("shape", [(64,), (2, 2, 32, 64)], ids=["1d", "4d"])
def test_rank_error(shape):
    w = torch.randn(*shape).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=rf"expect weight to be 2d or 3d, got {len(shape)}d"):
        cpumoe.convert_weight_packed(w)


@pytest.mark.parametrize("shape", [(24, 64), (2, 40, 64), (17, 32)])
def test_out_features_error(shape):
    w = torch.randn(*shape).to(torch.float16)
    with pytest.raises(RuntimeError, match=rf"invalid weight out features {shape[-2]}"):
        cpumoe.convert_weight_packed(w)


@pytest.mark.parametrize("shape", [(32, 48), (2, 32, 100), (16, 16)])
def test_in_features_error(shape):
    w = torch.randn(*shape).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=rf"invalid weight input features {shape[-1]}"):
        cpumoe.convert_weight_packed(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32],
                         ids=["f32", "f64", "i32"])
def test_dtype_error(dtype):
    w = torch.ones(32, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match=r"weight to be bfloat16, float16, int8, fp8_e4m3 or "
                                           r"uint8"):
        cpumoe.convert_weight_packed(w)


def test_noncontiguous_error():
    w = torch.randn(64, 32).to(torch.bfloat16).t()  # [32, 64] view, not contiguous
    with pytest.raises(RuntimeError, match=r"weight must be contiguous"):
        cpumoe.convert_weight_packed(w)
    w3 = torch.randn(2, 64, 64).to(torch.bfloat16)[:, :, ::2]
    with pytest.raises(RuntimeError, match=r"weight must be contiguous"):
        cpumoe.convert_weight_packed(w3)


def test_uint8_packs_as_mxfp4():
    """uint8 weights, once refused as not implemented, are MXFP4 codes (two a byte): they
    pack into the MXFP4 layout (docs/FORMATS.md). More in tests/test_mxfp4.py."""
    from cpumoe import reference

    w = torch.randint(0, 256, (2, 32, 64), dtype=torch.uint8)
    packed = cpumoe.convert_weight_packed(w)
    assert packed.shape == w.shape and packed.dtype == torch.uint8
    assert torch.equal(packed, reference.pack_mxfp4(w))
    with pytest.raises(RuntimeError, match=r"convert_weight_packed: expect weight to be "):
        cpumoe.convert_weight_packed(torch.zeros(2, 32, 64, dtype=torch.int32))


@pytest.mark.parametrize("shape", [(2, 32, 64), (48, 64), (3, 80, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_vnni2_byte_layout(shape):
    """fp8 (e4m3fn) weights pack into the VNNI-2 layout of 16-bit weights with 1-byte
    elements (docs/FORMATS.md, fp8 weights): same shape and dtype, the uint8 view
    byte-identical to pack_vnni2 of the uint8 view, every byte (NaN codes included) moved
    untouched.
    More in tests/test_fp8.py."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn)
    packed = cpumoe.convert_weight_packed(w)
    assert packed.dtype == torch.float8_e4m3fn and packed.shape == w.shape
    assert torch.equal(packed.view(torch.uint8), reference.pack_vnni2(codes))
    assert not torch.equal(packed.view(torch.uint8), codes)


def int8_formula_pack(w: torch.Tensor) -> torch.Tensor:
    """docs/FORMATS.md, int8 weights (VNNI-4 plus compensation): blocks of 32 rows;
    in a block dst[(k/4)*32*4 + n*4 + (k%4)] = W[n][k], then int32
    comp[n] = 128 * sum_k W[n][k] at byte 32*IC; a block is 32*(IC+4) bytes;
    shape [..., OC, IC+4]."""
    src = w.reshape(-1, *w.shape[-2:])
    E, OC, IC = src.shape
    out = torch.zeros(E, OC * (IC + 4), dtype=torch.int8)
    for e in range(E):
        for b in range(OC // 32):
            blk = src[e, 32 * b: 32 * b + 32]  # [32, IC]
            vnni = blk.reshape(32, IC // 4, 4).permute(1, 0, 2).reshape(-1)
            comp = (blk.to(torch.int32).sum(1) * 128).to(torch.int32).view(torch.int8)
            base = 32 * b * (IC + 4)
            out[e, base: base + 32 * IC] = vnni
            out[e, base + 32 * IC: base + 32 * (IC + 4)] = comp
    return out.view(*w.shape[:-1], IC + 4)


@pytest.mark.parametrize("shape", [(64, 32), (2, 32, 96), (3, 64, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_int8_vnni4_layout(shape):
    """int8 packing (INT8 W8A8 weights), if this build has it: byte-identical to the
    formula of docs/FORMATS.md (int8 weights)."""
    w = torch.randint(-128, 128, shape, dtype=torch.int8)
    try:
        packed = cpumoe.convert_weight_packed(w)
    except RuntimeError as e:
        if "not implemented" in str(e):
            pytest.skip(f"int8 packing not in this build: {e}")
        raise
    assert packed.dtype == torch.int8
    assert packed.shape == (*shape[:-1], shape[-1] + 4)
    assert torch.equal(packed, int8_formula_pack(w))


def test_int8_oc_not_multiple_of_32():
    """int8 blocks must be full (SGLang: TORCH_CHECK(N == BLOCK_N)): OC % 32 == 16 is an
    error, or "not implemented" in builds without int8 packing, never a partial block."""
    w = torch.zeros(2, 48, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"out features|not implemented|multiple of 32"):
        cpumoe.convert_weight_packed(w)
