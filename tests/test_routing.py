"""The routing ops before the experts (topk_softmax_cpu, topk_sigmoid_cpu, grouped_topk_cpu,
biased_grouped_topk_cpu, biased_topk_cpu, hash_topk_cpu):

* bit for bit against reference.route with the kernels' score functions
  (exact_reference.kernel_gating), for many E / topk / group shapes, M from 0 to 2000,
  fp32/bf16/fp16 logits, renormalize on and off, fused shared experts, scaling factors,
  padding rows, on every tier (the `isa` fixture) and for 1, 2 and 3 threads;
* against the same reference with torch's exp/sigmoid (the readable specification)
  within fp32 rounding, and against SGLang's torch algorithms restated here;
* ties (lower expert / group index first), NaN logits, opcheck, torch.compile, and
  routing feeding fused_experts (shared experts included).
Bad inputs are in tests/test_errors.py (section "routing")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpumoe
from cpumoe import reference
from cpumoe_testing import SUPPORTED_ISAS, make_weights, needs_two_tiers, pack, use_isa
from exact_reference import kernel_gating

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# (E, topk, num_expert_group, topk_group): SGLang's test shapes (E, G, topk, topk_group in
# its order: (8,2,2,1), (16,4,3,2), (32,4,3,2), (64,1,6,1), (256,8,4,8), (160,8,6,2)), the
# models' (Qwen3 128/8, DeepSeek-V3 256/8 in 8 groups keeping 4, Kimi-K2 384/8, 512), and
# shapes SGLang's kernels do not serve: E = 1, odd E, groups of one expert, topk = E.
SHAPES = [
    (8, 2, 2, 1), (16, 3, 4, 2), (32, 3, 4, 2), (64, 6, 1, 1), (256, 4, 8, 8),
    (160, 6, 8, 2), (128, 8, 1, 1), (256, 8, 8, 4), (384, 8, 1, 1), (512, 8, 16, 4),
    (1, 1, 1, 1), (7, 3, 7, 3), (15, 5, 5, 5), (60, 20, 6, 3), (1000, 9, 10, 1),
]
SHAPE_IDS = [f"E{e}-k{k}-g{g}-{t}" for e, k, g, t in SHAPES]


def logits(M, E, dtype=torch.float32, scale=2.0):
    return (torch.randn(M, E) * scale).to(dtype)


def hidden(M):
    return torch.empty(M, 16, dtype=torch.bfloat16)  # only its row count is read


def exact(fn, *args, **kw):
    """reference.<fn> with the kernels' score functions: the ops' bits."""
    with kernel_gating():
        return getattr(reference, fn)(*args, **kw)


def assert_same(got, want, msg=""):
    (gw, gi), (ww, wi) = got, want
    assert gw.dtype == torch.float32 and gi.dtype == torch.int32, (gw.dtype, gi.dtype)
    assert gw.shape == ww.shape and gi.shape == wi.shape, (gw.shape, ww.shape)
    assert torch.equal(gi, wi), f"ids differ {msg}\n{gi}\n{wi}"
    nan_same = torch.isnan(gw) == torch.isnan(ww)
    assert nan_same.all() and torch.equal(gw.nan_to_num(7.0), ww.nan_to_num(7.0)), (
        f"weights differ {msg}: {int((gw != ww).sum())} of {gw.numel()}")


# ---------------------------------------------------------------------------------------
# bit for bit against the reference, every tier


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("M", [0, 1, 5, 300])
def test_topk_softmax_exact(isa, M, dt, renormalize):
    for E, topk in [(128, 8), (60, 4), (7, 7), (1, 1), (384, 8)]:
        x, g = hidden(M), logits(M, E, DTYPES[dt])
        got = cpumoe.topk_softmax(x, g, topk, renormalize)
        assert_same(got, exact("topk_softmax", x, g, topk, renormalize), f"E={E} topk={topk}")


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("M", [0, 1, 5, 300])
def test_topk_sigmoid_exact(isa, M, dt, renormalize):
    for E, topk in [(64, 1), (128, 8), (33, 5), (1, 1)]:
        x, g = hidden(M), logits(M, E, DTYPES[dt], scale=4.0)
        got = cpumoe.topk_sigmoid(x, g, topk, renormalize)
        assert_same(got, exact("topk_sigmoid", x, g, topk, renormalize), f"E={E} topk={topk}")


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_grouped_topk_exact(isa, shape):
    E, topk, G, tg = shape
    for M, dt, renormalize in [(1, "bf16", True), (40, "fp32", False), (300, "fp16", True)]:
        x, g = hidden(M), logits(M, E, DTYPES[dt])
        got = cpumoe.grouped_topk(x, g, topk, renormalize, G, tg)
        assert_same(got, exact("grouped_topk", x, g, topk, renormalize, G, tg), f"M={M}")


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_biased_grouped_topk_exact(isa, shape):
    E, topk, G, tg = shape
    for M, dt, bias_dt, renormalize, factor in [
        (1, "bf16", torch.float32, True, 2.5), (40, "fp32", torch.bfloat16, False, None),
        (300, "fp16", torch.float32, True, None), (17, "bf16", torch.float16, False, 16.0),
    ]:
        x, g = hidden(M), logits(M, E, DTYPES[dt])
        bias = (torch.randn(E) * 0.2).to(bias_dt)
        got = cpumoe.biased_grouped_topk(x, g, bias, topk, renormalize, G, tg,
                                         routed_scaling_factor=factor)
        want = exact("biased_grouped_topk", x, g, bias, topk, renormalize, G, tg, 0, factor)
        assert_same(got, want, f"M={M} {dt} bias {bias_dt} factor {factor}")


@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("apply", [False, True], ids=["no_scale", "scale_out"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
def test_biased_topk_exact(isa, scoring_func, apply, renormalize):
    for M, E, topk, dt in [(1, 256, 8, "bf16"), (300, 384, 8, "fp32"), (9, 64, 6, "fp16"),
                           (2, 5, 5, "fp32")]:
        x, g = hidden(M), logits(M, E, DTYPES[dt], scale=6.0)  # sqrtsoftplus's tails too
        bias = torch.randn(E) * 0.1
        got = cpumoe.biased_topk(x, g, bias, topk, renormalize, scoring_func=scoring_func,
                                 routed_scaling_factor=2.5,
                                 apply_routed_scaling_factor_on_output=apply)
        want = exact("biased_topk", x, g, bias, topk, renormalize, scoring_func, 0, 2.5, apply)
        assert_same(got, want, f"M={M} E={E}")


def table(M, R, E, seed=0):
    """A hash table's rows for M tokens: R ids in [0, E) each (repeats possible)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, E, (M, R), dtype=torch.int32, generator=gen)


@pytest.mark.parametrize("shared", [0, 1, 3], ids=["no_shared", "shared1", "shared3"])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_hash_topk_exact(isa, dt, scoring_func, shared):
    """hash_topk_cpu: slot j of token m is tid2eid[m, j] with its score as weight, the
    non-softmax weights renormalized, the fused shared slot last; bit for bit, for DeepSeek-V4's
    shape (256 experts, 6 from the table), E the table's width, R > E with repeats, R = 1,
    E = 1 and odd E."""
    factor = 1.5
    for M, E, R in [(0, 256, 6), (1, 256, 6), (5, 64, 64), (300, 256, 6), (17, 7, 9),
                    (3, 1, 2), (40, 33, 1)]:
        g, t = logits(M, E, DTYPES[dt], scale=6.0), table(M, R, E, seed=M + E)
        topk = R + (shared > 0)
        got = cpumoe.hash_topk(g, t, topk, scoring_func=scoring_func,
                               num_fused_shared_experts=shared, routed_scaling_factor=factor)
        want = exact("hash_topk", g, t, topk, scoring_func, shared, E, factor)
        assert_same(got, want, f"M={M} E={E} R={R}")
        w, ids = got
        assert torch.equal(ids[:, :R], t)
        if shared:
            assert torch.equal(ids[:, -1], (torch.arange(M) % shared + E).int())
        if M and scoring_func != "softmax":  # renormalized: the routed weights sum to 1
            torch.testing.assert_close(w[:, :R].double().sum(-1), torch.ones(M).double(),
                                       rtol=1e-6, atol=0)


def test_hash_topk_weights_and_shared_slot(isa):
    """The weights are the table experts' scores (softmax over all E, not over the R), the
    shared slot's weight the routed weights' sum over the factor: 1 / factor after a
    renormalization."""
    M, E, R, factor = 23, 64, 6, 2.5
    g, t = logits(M, E), table(M, R, E)
    w, ids = cpumoe.hash_topk(g, t, R + 1, scoring_func="softmax", num_fused_shared_experts=1,
                              routed_scaling_factor=factor)
    p = torch.softmax(g.double(), -1).gather(1, t.long())
    torch.testing.assert_close(w[:, :R].double(), p, rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(w[:, R].double(), p.sum(-1) / factor, rtol=2e-6, atol=1e-9)
    w, ids = cpumoe.hash_topk(g, t, R + 1, scoring_func="sigmoid", num_fused_shared_experts=1,
                              routed_scaling_factor=factor)
    s = torch.sigmoid(g.double()).gather(1, t.long())
    torch.testing.assert_close(w[:, :R].double(), s / s.sum(-1, keepdim=True), rtol=2e-6,
                               atol=1e-9)
    torch.testing.assert_close(w[:, R], torch.full((M,), 1 / factor), rtol=1e-6, atol=0)


def test_hash_topk_tiny_and_nan_sums(isa):
    """Logits of -inf give the smallest scores (exp's argument is clamped), never 0: the sum
    stays > 0 and the row is renormalized as any other. A NaN logit makes its own slots NaN
    and their sum, which is then not > 0: the other slots keep their scores as they are."""
    for scoring_func in ("sigmoid", "sqrtsoftplus"):
        g = torch.full((2, 8), float("-inf"))
        t = torch.tensor([[0, 3, 3], [7, 1, 2]], dtype=torch.int32)
        w, ids = cpumoe.hash_topk(g, t, 4, scoring_func=scoring_func, num_fused_shared_experts=1,
                                  routed_scaling_factor=2.0)
        assert ids[:, :3].equal(t) and (ids[:, 3] == 8).all()
        torch.testing.assert_close(w, torch.tensor([[1 / 3] * 3 + [0.5]] * 2))
        assert_same((w, ids), exact("hash_topk", g, t, 4, scoring_func, 1, 8, 2.0))
        g = torch.zeros(1, 8)
        g[0, 3] = float("nan")
        w, ids = cpumoe.hash_topk(g, t[:1], 3, scoring_func=scoring_func)
        assert torch.isnan(w[0, 1:]).all()
        with kernel_gating():  # the score of logit 0, as it is
            assert w[0, 0] == reference.routing_scores(torch.zeros(1, 1), scoring_func)[0, 0]
        assert_same((w, ids), exact("hash_topk", g, t[:1], 3, scoring_func, 0, 8, 1.0))


def test_hash_topk_layouts_and_factor(isa):
    """Any strides of gating_output and tid2eid; without a fused shared expert the factor
    is not read (0 and NaN accepted, the result unchanged); an empty batch gives [0, topk]."""
    M, E, R = 9, 64, 4
    g = logits(E, M).t()
    t = table(2 * R, M, E).t()[:, ::2]
    assert not g.is_contiguous() and not t.is_contiguous()
    want = cpumoe.hash_topk(g.contiguous(), t.contiguous(), R, scoring_func="sigmoid")
    assert_same(cpumoe.hash_topk(g, t, R, scoring_func="sigmoid"), want)
    for factor in (0.0, float("nan"), float("inf")):
        got = cpumoe.hash_topk(g, t, R, scoring_func="sigmoid", routed_scaling_factor=factor)
        assert_same(got, want, f"factor {factor}")
    w, ids = cpumoe.hash_topk(torch.randn(0, E), torch.zeros(0, R, dtype=torch.int32), R + 1,
                              num_fused_shared_experts=1, routed_scaling_factor=2.0)
    assert w.shape == ids.shape == (0, R + 1)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32


@pytest.mark.parametrize("op", ["grouped", "biased_grouped", "biased"])
@pytest.mark.parametrize("shared", [1, 2, 3])
def test_fused_shared_experts_exact(isa, op, shared):
    """The last slot is shared expert E + m % shared, weight routed sum / factor (1 after
    renormalizing); the other slots are the topk - 1 best routed experts."""
    M, E, topk, G, tg, factor = 37, 256, 9, 8, 4, 2.5
    x, g, bias = hidden(M), logits(M, E, torch.bfloat16), torch.randn(E) * 0.1
    for renormalize in (False, True):
        if op == "grouped":
            got = cpumoe.grouped_topk(x, g, topk, renormalize, G, tg, num_fused_shared_experts=shared,
                                      routed_scaling_factor=factor)
            want = exact("grouped_topk", x, g, topk, renormalize, G, tg, shared, factor)
        elif op == "biased_grouped":
            got = cpumoe.biased_grouped_topk(x, g, bias, topk, renormalize, G, tg,
                                             num_fused_shared_experts=shared,
                                             routed_scaling_factor=factor)
            want = exact("biased_grouped_topk", x, g, bias, topk, renormalize, G, tg, shared,
                         factor)
        else:
            got = cpumoe.biased_topk(x, g, bias, topk, renormalize,
                                     num_fused_shared_experts=shared, routed_scaling_factor=factor,
                                     apply_routed_scaling_factor_on_output=True)
            want = exact("biased_topk", x, g, bias, topk, renormalize, "sigmoid", shared, factor,
                         True)
        assert_same(got, want, f"renormalize={renormalize}")
        w, ids = got
        assert torch.equal(ids[:, -1], (torch.arange(M) % shared + E).int())
        assert (ids[:, :-1] < E).all() and (ids[:, :-1] >= 0).all()
        routed = w[:, :-1].double().sum(-1)
        if renormalize:  # routed weights sum to the factor, the shared slot's is 1
            torch.testing.assert_close(routed, torch.full((M,), factor, dtype=torch.float64),
                                       rtol=1e-6, atol=0)
            torch.testing.assert_close(w[:, -1], torch.ones(M))
        else:  # every weight times the factor: the shared slot's is the routed sum over it
            torch.testing.assert_close(w[:, -1].double(), routed / factor, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_num_token_non_padded(isa, dt):
    """Rows from num_token_non_padded on are padding: ids -1 (fused_experts skips them),
    weights 0; the other rows as without it."""
    M, E, topk = 20, 64, 6
    x, g, bias = hidden(M), logits(M, E, DTYPES[dt]), torch.randn(E) * 0.1
    for n, ndt in [(13, torch.int32), (0, torch.int64), (20, torch.int32), (99, torch.int64),
                   (-3, torch.int32)]:
        nt = torch.tensor([n], dtype=ndt)
        for fn, args in [("grouped_topk", (x, g, topk, True, 4, 2)),
                         ("biased_grouped_topk", (x, g, bias, topk, True, 4, 2))]:
            w, ids = getattr(cpumoe, fn)(*args, num_token_non_padded=nt)
            pw, pids = getattr(cpumoe, fn)(*args)
            k = min(max(n, 0), M)
            assert torch.equal(ids[:k], pids[:k]) and torch.equal(w[:k], pw[:k])
            assert (ids[k:] == -1).all() and (w[k:] == 0).all()
            assert_same((w, ids), exact(fn, *args, 0, None, nt))
    # a 0-d tensor holds one value too
    w, ids = cpumoe.grouped_topk(x, g, topk, True, 4, 2, num_token_non_padded=torch.tensor(3))
    assert (ids[3:] == -1).all() and (ids[:3] >= 0).all()


# ---------------------------------------------------------------------------------------
# threads and tiers


def _calls(M):
    E = 256
    x, g, bias = hidden(M), logits(M, E, torch.bfloat16), torch.randn(E) * 0.1
    return [
        lambda: cpumoe.topk_softmax(x, g, 8, True),
        lambda: cpumoe.topk_sigmoid(x, g, 3, False),
        lambda: cpumoe.grouped_topk(x, g, 8, True, 8, 4, num_fused_shared_experts=1,
                                    routed_scaling_factor=2.5),
        lambda: cpumoe.biased_grouped_topk(x, g, bias, 8, True, 8, 4, routed_scaling_factor=2.5),
        lambda: cpumoe.biased_topk(x, g, bias, 8, True, scoring_func="sqrtsoftplus"),
        lambda: cpumoe.hash_topk(g, table(M, 6, E), 7, scoring_func="sqrtsoftplus",
                                 num_fused_shared_experts=1, routed_scaling_factor=1.5),
        lambda: cpumoe.hash_topk(g, table(M, 6, E), 6, scoring_func="softmax"),
        lambda: cpumoe.hash_topk(g.float(), table(M, 6, E), 6, scoring_func="sigmoid"),
    ]


@pytest.mark.parametrize("M", [1, 17, 33, 1000])
def test_thread_counts_bit_identical(isa, M):
    calls, results = _calls(M), {}
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results[threads] = [call() for call in calls]
    for threads in (2, 3):
        for a, b in zip(results[1], results[threads]):
            assert_same(b, a, f"{threads} threads vs 1")


@needs_two_tiers
def test_tiers_bit_identical():
    """Every tier gives the same bits (the scores are elementwise kernels written once)."""
    torch.manual_seed(0)
    calls = _calls(64)
    per_tier = {}
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            per_tier[tier] = [call() for call in calls]
    first = SUPPORTED_ISAS[0]
    for tier in SUPPORTED_ISAS[1:]:
        for a, b in zip(per_tier[first], per_tier[tier]):
            assert_same(b, a, f"{tier} vs {first}")


# ---------------------------------------------------------------------------------------
# against the specification with torch's exp and sigmoid


def test_spec_unbiased(isa):
    """Unbiased ops rank by logit, so the ids do not depend on the exp: equal to the spec's;
    the weights agree within fp32 rounding of torch's exp/sigmoid (a few ulp)."""
    M, E = 200, 160
    x = hidden(M)
    for g in (logits(M, E), logits(M, E, torch.bfloat16), logits(M, E, torch.float16)):
        for got, want in [
            (cpumoe.topk_softmax(x, g, 8, True), reference.topk_softmax(x, g, 8, True)),
            (cpumoe.topk_softmax(x, g, 8, False), reference.topk_softmax(x, g, 8, False)),
            (cpumoe.topk_sigmoid(x, g, 4, False), reference.topk_sigmoid(x, g, 4, False)),
            (cpumoe.grouped_topk(x, g, 6, True, 8, 2), reference.grouped_topk(x, g, 6, True, 8, 2)),
        ]:
            assert torch.equal(got[1], want[1])
            torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_spec_hash(isa, scoring_func):
    """hash_topk against the reference with torch's exp/sigmoid/softplus: the same ids, the
    weights within fp32 rounding."""
    M, E, R = 200, 256, 6
    t = table(M, R, E)
    for g in (logits(M, E, scale=3.0), logits(M, E, torch.bfloat16, scale=3.0)):
        got = cpumoe.hash_topk(g, t, R + 1, scoring_func=scoring_func,
                               num_fused_shared_experts=2, routed_scaling_factor=1.5)
        want = reference.hash_topk(g, t, R + 1, scoring_func, 2, E, 1.5)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=4e-6, atol=1e-9)


@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus"])
def test_spec_biased(isa, scoring_func):
    """Biased ops rank by score + bias, which moves with the exp by an ulp: a row may pick
    differently from the spec only between experts whose spec ranks are within 1e-6; the
    weights of the experts picked agree within fp32 rounding."""
    M, E = 400, 256
    x, g, bias = hidden(M), logits(M, E, scale=3.0), torch.randn(E) * 0.1
    score = (torch.sigmoid(g) if scoring_func == "sigmoid"
             else torch.sqrt(F.softplus(g.double())).float())
    rank = score + bias
    if scoring_func == "sigmoid":
        got = cpumoe.biased_grouped_topk(x, g, bias, 8, True, 8, 4)
        want = reference.biased_grouped_topk(x, g, bias, 8, True, 8, 4)
    else:
        got = cpumoe.biased_topk(x, g, bias, 8, True, scoring_func=scoring_func)
        want = reference.biased_topk(x, g, bias, 8, True, scoring_func, 0, None, False)
    differ = (got[1] != want[1]).any(-1)
    assert differ.sum() <= M // 50, int(differ.sum())
    for m in differ.nonzero().flatten().tolist():
        a, b = rank[m, got[1][m].long()], rank[m, want[1][m].long()]
        assert (a - b).abs().max() < 1e-6, (m, got[1][m], want[1][m])
    same = ~differ
    torch.testing.assert_close(got[0][same], want[0][same], rtol=2e-6, atol=1e-9)
    # the weights are the unbiased scores of the experts picked, renormalized
    w = score.gather(1, got[1].long())
    torch.testing.assert_close(got[0], w / w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)


# SGLang's torch algorithms (its topk.py), restated: scores, group scores (the group's max,
# or for the biased variant the sum of its top 2 of score + bias), groups masked, torch.topk
# over the rest; weights from the unbiased scores; renormalized by their sum; optionally
# times the routed scaling factor. Returned sorted by id (SGLang's order is unspecified).

def sglang_grouped(g, topk, renormalize, G, tg, bias=None, factor=None):
    scores = torch.softmax(g.float(), -1) if bias is None else torch.sigmoid(g.float())
    M, E = scores.shape
    choice = scores if bias is None else scores + bias.float()[None]
    per_group = choice.view(M, G, E // G)
    gscore = per_group.max(-1).values if bias is None else per_group.topk(2, -1).values.sum(-1)
    keep = torch.zeros(M, G).scatter_(1, gscore.topk(tg, -1).indices, 1.0)
    mask = keep[:, :, None].expand(M, G, E // G).reshape(M, E).bool()
    ids = choice.masked_fill(~mask, float("-inf")).topk(topk, -1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if factor is not None:
        w = w * factor
    order = ids.argsort(-1)
    return w.gather(1, order), ids.gather(1, order).int()


def by_id(routing):
    w, ids = routing
    order = ids.argsort(-1)
    return w.gather(1, order.long()), ids.gather(1, order.long())


@pytest.mark.parametrize("shape", [(256, 8, 8, 4), (160, 6, 8, 2), (64, 6, 1, 1),
                                   (16, 3, 4, 2)], ids=["dsv3", "E160", "E64", "E16"])
def test_matches_sglang_algorithms(shape):
    E, topk, G, tg = shape
    M = 123
    # fp32 logits: no equal values, whose order torch.topk leaves open
    x, g, bias = hidden(M), logits(M, E), torch.randn(E) * 0.1
    for renormalize in (False, True):
        w, ids = by_id(cpumoe.grouped_topk(x, g, topk, renormalize, G, tg))
        sw, sids = sglang_grouped(g, topk, renormalize, G, tg)
        assert torch.equal(ids, sids)
        torch.testing.assert_close(w, sw, rtol=1e-5, atol=1e-7)
        if E // G >= 2:
            w, ids = by_id(cpumoe.biased_grouped_topk(x, g, bias, topk, renormalize, G, tg,
                                                      routed_scaling_factor=2.5))
            sw, sids = sglang_grouped(g, topk, renormalize, G, tg, bias, 2.5)
            assert torch.equal(ids, sids)
            torch.testing.assert_close(w, sw, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------
# ties and non-finite logits


def brute_force_ids(rank, k):
    """For each row: experts sorted by (rank desc, index asc), NaN as -inf; the first k."""
    out = []
    for row in rank.tolist():
        key = [(-(v if v == v else float("-inf")), e) for e, v in enumerate(row)]
        out.append([e for _, e in sorted(key)[:k]])
    return torch.tensor(out, dtype=torch.int32)


def test_ties_go_to_the_lower_index(isa):
    M, E = 64, 32
    x = hidden(M)
    g = torch.randint(0, 3, (M, E)).float()  # many equal logits
    assert torch.equal(cpumoe.topk_softmax(x, g, 7, False)[1], brute_force_ids(g, 7))
    assert torch.equal(cpumoe.topk_sigmoid(x, g, 5, True)[1], brute_force_ids(g, 5))
    # equal scores + equal biases tie too
    bias = torch.zeros(E)
    got = cpumoe.biased_topk(x, g, bias, 6, True)[1]
    assert torch.equal(got, brute_force_ids(torch.sigmoid(g), 6))
    # all equal: experts 0..k-1, in order
    w, ids = cpumoe.topk_softmax(x, torch.zeros(M, E), 4, False)
    assert torch.equal(ids, torch.arange(4, dtype=torch.int32).expand(M, 4))
    assert torch.equal(w, torch.full((M, 4), 1 / 32))


def test_group_ties_go_to_the_lower_group(isa):
    """Groups of equal scores: the lower group indices are kept."""
    M, E, G = 3, 16, 4
    x = hidden(M)
    g = torch.zeros(M, E)
    g[:, [1, 5, 9, 13]] = 1.0  # every group's best is equal
    w, ids = cpumoe.grouped_topk(x, g, 4, False, G, 2)
    assert torch.equal(ids[0], torch.tensor([1, 5, 0, 2], dtype=torch.int32))
    bias = torch.zeros(E)
    _, ids = cpumoe.biased_grouped_topk(x, g, bias, 3, False, G, 1)
    assert torch.equal(ids[0], torch.tensor([1, 0, 2], dtype=torch.int32))


def test_top2_sum_ranks_groups(isa):
    """biased_grouped_topk scores a group by the sum of its two best (SGLang), not its max:
    group 1 (0.5 + 0.5) beats group 0 (0.9 + 0)."""
    x = hidden(1)
    bias = torch.zeros(8)
    s = torch.tensor([[0.9, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]])
    g = torch.logit(s.clamp(1e-6, 1 - 1e-6))  # sigmoid(g) = s
    _, ids = cpumoe.biased_grouped_topk(x, g, bias, 2, False, 2, 1)
    assert sorted(ids[0].tolist()) == [4, 5]
    _, ids = cpumoe.grouped_topk(x, torch.log(s.clamp_min(1e-6)), 2, False, 2, 1)
    assert ids[0, 0].item() == 0  # by max, group 0


def test_bias_picks_weights_do_not_use_it(isa):
    """The correction bias changes which experts are chosen, not their weights."""
    M, E = 50, 64
    x, g = hidden(M), logits(M, E)
    bias = torch.zeros(E)
    bias[7] = 10.0  # expert 7 always chosen
    w, ids = cpumoe.biased_topk(x, g, bias, 4, False)
    assert (ids[:, 0] == 7).all()
    torch.testing.assert_close(w[:, 0], torch.sigmoid(g[:, 7]), rtol=2e-7, atol=0)


def test_nan_logits(isa):
    """A NaN logit ranks as -inf: never chosen while others remain; a softmax row holding
    one has NaN weights (its sum is NaN), a sigmoid row only the NaN expert's."""
    M, E = 4, 8
    x = hidden(M)
    g = logits(M, E)
    g[:, 2] = float("nan")
    w, ids = cpumoe.topk_sigmoid(x, g, 7, False)
    assert (ids != 2).all() and torch.isfinite(w).all()
    w, ids = cpumoe.topk_sigmoid(x, g, 8, False)
    assert (ids[:, -1] == 2).all() and torch.isnan(w[:, -1]).all()
    assert torch.isfinite(w[:, :-1]).all()
    w, ids = cpumoe.topk_softmax(x, g, 3, True)
    assert (ids != 2).all() and torch.isnan(w).all()
    assert_same((w, ids), exact("topk_softmax", x, g, 3, True))
    # -inf logits: last, weight (near) zero; +inf makes the softmax NaN, as torch's
    g = torch.zeros(1, 4)
    g[0, 1] = float("-inf")
    w, ids = cpumoe.topk_softmax(hidden(1), g, 4, False)
    assert ids[0].tolist() == [0, 2, 3, 1] and w[0, 3] < 1e-30
    g[0, 1] = float("inf")
    w, ids = cpumoe.topk_softmax(hidden(1), g, 2, False)
    assert ids[0].tolist() == [1, 0] and torch.isnan(w).all()


# ---------------------------------------------------------------------------------------
# shapes and layouts


def test_noncontiguous_logits_and_bias(isa):
    M, E = 9, 64
    x = hidden(M)
    g = logits(E, M).t()  # [M, E] transposed view
    bias = torch.randn(2 * E)[::2]
    assert not g.is_contiguous() and not bias.is_contiguous()
    assert_same(cpumoe.biased_grouped_topk(x, g, bias, 4, True, 4, 2),
                cpumoe.biased_grouped_topk(x, g.contiguous(), bias.contiguous(), 4, True, 4, 2))


def test_empty_batch(isa):
    for fn, args in [("topk_softmax", (3, True)), ("grouped_topk", (3, True, 4, 2))]:
        w, ids = getattr(cpumoe, fn)(hidden(0), torch.randn(0, 16), *args)
        assert w.shape == (0, 3) and ids.shape == (0, 3)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32


def test_returns_sglang_types():
    """(topk_weights float32, topk_ids int32), contiguous [M, topk], whatever the logits'
    dtype."""
    x = hidden(3)
    for dt in DTYPES.values():
        w, ids = torch.ops.cpumoe.topk_softmax_cpu(x, logits(3, 8, dt), 2, False)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32
        assert w.is_contiguous() and ids.is_contiguous() and w.shape == ids.shape == (3, 2)


# ---------------------------------------------------------------------------------------
# as PyTorch operators, and in front of fused_experts


def _op_args():
    M, E = 3, 16
    x, g, bias = hidden(M), logits(M, E, torch.bfloat16), torch.randn(E)
    n = torch.tensor([2], dtype=torch.int32)
    return [
        (torch.ops.cpumoe.topk_softmax_cpu.default, (x, g, 4, True)),
        (torch.ops.cpumoe.topk_sigmoid_cpu.default, (x, g.float(), 1, False)),
        (torch.ops.cpumoe.grouped_topk_cpu.default, (x, g, 4, True, 4, 2, 0, None, None)),
        (torch.ops.cpumoe.grouped_topk_cpu.default, (x, g, 5, True, 4, 2, 1, 2.5, n)),
        (torch.ops.cpumoe.biased_grouped_topk_cpu.default,
         (x, g, bias, 4, True, 4, 2, 0, 2.5, None)),
        (torch.ops.cpumoe.biased_topk_cpu.default,
         (x, g, bias, 4, True, "sqrtsoftplus", 1, 2.5, True)),
        (torch.ops.cpumoe.hash_topk_cpu.default,
         (g, table(M, 4, E), 4, "sqrtsoftplus", 0, E, 1.0)),
        (torch.ops.cpumoe.hash_topk_cpu.default,
         (g.float(), table(M, 4, E), 5, "softmax", 2, E, 2.5)),
    ]


@pytest.mark.parametrize("case", range(8))
def test_opcheck(case):
    op, args = _op_args()[case]
    torch.library.opcheck(op, args)


def test_compile_fullgraph_routing_then_experts():
    """biased_grouped_topk feeding fused_experts, compiled with fullgraph=True, equals eager."""
    M, E, N, K = 5, 16, 32, 64
    x = torch.randn(M, K).to(torch.bfloat16)
    w1, w2 = make_weights(E, N, K, torch.bfloat16)
    pw1, pw2 = pack(w1), pack(w2)
    g, bias = logits(M, E, torch.bfloat16), torch.randn(E) * 0.1

    def layer(x, g, bias):
        tw, ti = cpumoe.biased_grouped_topk(x, g, bias, 4, True, 4, 2, routed_scaling_factor=2.5)
        return cpumoe.fused_experts(x, pw1, pw2, tw, ti).float(), tw, ti

    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x, g, bias)
    want = layer(x, g, bias)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fused_shared_expert_through_fused_experts(isa):
    """DeepSeek's fused shared expert: routing over E routed experts with the shared slot
    E, and fused_experts over E + 1 experts, equals the routed experts (weights times the
    factor) plus the shared expert (weight 1) computed apart."""
    M, E, N, K, factor = 6, 16, 32, 64, 2.5
    x = torch.randn(M, K).to(torch.bfloat16)
    w1, w2 = make_weights(E + 1, N, K, torch.bfloat16)
    g, bias = logits(M, E, torch.bfloat16), torch.randn(E) * 0.1
    tw, ti = cpumoe.biased_grouped_topk(x, g, bias, 5, True, 4, 2, num_fused_shared_experts=1,
                                        routed_scaling_factor=factor)
    assert (ti[:, -1] == E).all()
    out = cpumoe.fused_experts(x, pack(w1), pack(w2), tw, ti)
    ref = reference.fused_experts(x, w1, w2, tw, ti)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    rw, ri = cpumoe.biased_grouped_topk(x, g, bias, 4, True, 4, 2)
    routed = reference.fused_experts(x, w1, w2, rw * factor, ri).float()
    shared = reference.fused_experts(x, w1[E:], w2[E:], torch.ones(M, 1),
                                     torch.zeros(M, 1, dtype=torch.int32)).float()
    torch.testing.assert_close(out.float(), routed + shared, atol=4e-2, rtol=4e-2)
