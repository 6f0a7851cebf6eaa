"""Model shapes of the benchmark (:data:`SHAPES`, ``--shape``), the activation dtypes and
the decode-style routings drawn for a shape (:func:`make_routings`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch


@dataclass(frozen=True)
class Shape:
    """One MoE layer: E experts, topk per token, hidden size K, expert intermediate size N
    (w1 is [E, 2N, K], w2 is [E, K, N])."""

    name: str
    E: int
    topk: int
    K: int
    N: int

    def expert_bytes(self, bytes_per_weight: int) -> int:
        """Bytes of one expert's weights (w1 and w2)."""
        return 3 * self.N * self.K * bytes_per_weight


SHAPES: Dict[str, Shape] = {
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", E=128, topk=8, K=2048, N=768),
    "mixtral-8x7b": Shape("mixtral-8x7b", E=8, topk=2, K=4096, N=14336),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", E=64, topk=6, K=2048, N=1408),
    "olmoe-1b-7b": Shape("olmoe-1b-7b", E=64, topk=8, K=2048, N=1024),
    # gpt-oss-20b's sizes with cpumoe's SiLU*mul (the model itself uses a clamped SwiGLU with
    # biases); K = N = 2880 is not a multiple of 128: fp8 has partial 128x128 scale blocks
    # and int4 uses groups of 64
    "gpt-oss-20b": Shape("gpt-oss-20b", E=32, topk=4, K=2880, N=2880),
}
DEFAULT_SHAPE = "qwen3-30b-a3b"
DEFAULT_M = (1, 4, 16, 64, 256, 512)
ALL_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # --m all

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
        return dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def parse_shapes(spec: str) -> List[Shape]:
    """A name of :data:`SHAPES` (``qwen3-30b-a3b``, ``mixtral-8x7b``, ``deepseek-v2-lite``,
    ``olmoe-1b-7b``, ``gpt-oss-20b``) | ``all`` | ``custom:E,topk,K,N``; several may be
    given separated by ``+`` (e.g. ``mixtral-8x7b+custom:8,2,256,128``)."""
    shapes: List[Shape] = []
    for part in spec.split("+"):
        part = part.strip().lower()
        if part == "all":
            shapes.extend(SHAPES.values())
        elif part in SHAPES:
            shapes.append(SHAPES[part])
        elif part.startswith("custom:"):
            try:
                E, topk, K, N = (int(v) for v in part[len("custom:"):].split(","))
            except ValueError:
                raise ValueError(f"bad custom shape '{part}': expected custom:E,topk,K,N "
                                 "(four integers)") from None
            shapes.append(_check_shape(Shape(f"custom-{E}x{topk}-{K}x{N}", E, topk, K, N)))
        else:
            raise ValueError(f"unknown shape '{part}': expected one of "
                             f"{', '.join(SHAPES)}, all, or custom:E,topk,K,N")
    return shapes


def _check_shape(s: Shape) -> Shape:
    if min(s.E, s.topk, s.K, s.N) <= 0:
        raise ValueError(f"{s.name}: E, topk, K and N must be positive")
    if s.topk > s.E:
        raise ValueError(f"{s.name}: topk={s.topk} exceeds E={s.E}")
    if s.K % 32 or s.N % 32:
        # convert_weight_packed needs OC % 16 == 0 and IC % 32 == 0 for w1 [2N, K] and w2 [K, N].
        raise ValueError(f"{s.name}: K and N must be multiples of 32 for the packed layout")
    return s


def _as_shape(shape) -> Shape:
    if isinstance(shape, Shape):
        return _check_shape(shape)
    if isinstance(shape, str):
        shapes = parse_shapes(shape)
        if len(shapes) != 1:
            raise ValueError(f"run_case needs exactly one shape, got '{shape}'")
        return shapes[0]
    E, topk, K, N = shape  # a 4-tuple
    return _check_shape(Shape(f"custom-{E}x{topk}-{K}x{N}", E, topk, K, N))



@dataclass
class Routing:
    topk_weights: torch.Tensor  # [M, topk] float32, softmax-normalised
    topk_ids: torch.Tensor  # [M, topk] int32, distinct experts per token


def make_routings(count: int, M: int, E: int, topk: int, generator: torch.Generator) -> List[Routing]:
    """``count`` independent decode-style routings: per token, ``topk`` distinct random
    experts (topk of uniform random scores) with softmax-normalised fp32 weights."""
    out = []
    for _ in range(count):
        ids = torch.rand(M, E, generator=generator).topk(topk, dim=1).indices.to(torch.int32)
        w = torch.randn(M, topk, generator=generator).softmax(dim=1)
        out.append(Routing(w.contiguous(), ids.contiguous()))
    return out
