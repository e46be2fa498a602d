"""IEEE float32 arithmetic for clipping, whatever global precision settings the user chose.

Why. A clipped sum Σᵢ cᵢgᵢ has L2 sensitivity C because cᵢ = min(1, C/‖gᵢ‖) scales gᵢ to
norm at most C. That bounds what the sum actually adds only if the gᵢ that cᵢ multiplies
and the gᵢ whose norm cᵢ came from are computed in the same IEEE float32 arithmetic: then
they agree up to float32 rounding (relative ~1e-7), which the sensitivity tests' tolerance
of 1e-6 covers. Book-keeping takes the norms from one set of products (ghost Gram
matrices, small materialised gradients) and the sum from another (a weighted
weight-gradient product), and the vmap reference could sum with a matrix product. Global
settings break that agreement:

* TensorFloat-32 on NVIDIA GPUs (``torch.backends.cuda.matmul.allow_tf32``,
  ``torch.backends.cudnn.allow_tf32`` — on by default for convolutions —,
  ``torch.set_float32_matmul_precision("high")``, the ``fp32_precision`` knobs of torch ≥
  2.9): cuBLAS and cuDNN round the inputs of a float32 matrix product or convolution to a
  10-bit mantissa (relative error up to 2⁻¹¹ ≈ 5e-4), differently in the two products. On
  an H200 one example clipped to C=1 moved the release by 1.00002 C.
* ``set_float32_matmul_precision("medium")`` (or ``mkldnn`` precision ``bf16``) lets oneDNN
  compute float32 products in bfloat16 on the CPU.
* An autocast block around the call (``optimizer.step()`` inside ``torch.autocast``) would
  run the norms and the sums in float16 or bfloat16.

A privacy guarantee must not depend on such settings, so :func:`exact_arithmetic` turns
them off for the clip arithmetic: the per-example norms, the clip factors and the clipped
sums.

Cost. Only the products inside the block (norms and clipped sums) run in IEEE float32
instead of TF32, which on Ampere and later GPUs is slower for large products; the model's
forward and backward passes keep the user's settings. Entering and leaving the block reads
and writes a few dozen flags (tens of microseconds, no device synchronisation). The flags
are process-wide: another thread running float32 products while a block is open runs them
in IEEE float32 too (and a block entered on one thread and left on another is not
supported).
"""

import contextlib
import warnings
from collections.abc import Iterator

import torch

_Node = tuple[str, str]  # (backend, op) of torch ≥ 2.9's fp32 precision tree

# torch ≥ 2.9: a tree of fp32 precisions, generic → {cuda, mkldnn} → {matmul, conv, rnn}. A
# node set to "none" inherits its parent's value; the getters return the value a node
# resolves to. A leaf may also hold torch's internal default (cuDNN convolutions and RNNs
# start as TF32 that a parent's setting overrides), which no setter can restore.
_NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")
_GENERIC: _Node = ("generic", "all")
_FAMILIES: tuple[_Node, ...] = (("cuda", "all"), ("mkldnn", "all"))
_LEAVES: tuple[_Node, ...] = tuple(
    (backend, op) for backend in ("cuda", "mkldnn") for op in ("matmul", "conv", "rnn")
)
_LEGACY_WARNING = ".*new API settings to control TF32.*"


def _get(node: _Node) -> str:
    return torch._C._get_fp32_precision_getter(*node)


def _set(node: _Node, value: str) -> None:
    torch._C._set_fp32_precision_setter(*node, value)


def _own_values(nodes: tuple[_Node, ...], parents: tuple[_Node, ...]) -> dict[_Node, str | None]:
    """Each node's own value, or None where it inherits (follows its parents): read with
    the parents set to "ieee" and then to "none". The caller restores the parents."""
    seen = []
    for probe in ("ieee", "none"):
        for parent in parents:
            _set(parent, probe)
        seen.append([_get(node) for node in nodes])
    return {
        node: None if first != second else first
        for node, first, second in zip(nodes, *seen, strict=True)
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hides torch 2.9's once-per-process deprecation warning of the legacy matmul flags,
    which :func:`exact_arithmetic` reads and writes to keep them consistent with the new
    knobs (the user did not call them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_LEGACY_WARNING)
        yield


@contextlib.contextmanager
def _ieee_tree() -> Iterator[None]:
    """torch ≥ 2.9: every cuda and mkldnn leaf resolves to "ieee" in the block.

    The two backend nodes are set to "ieee", which the leaves that inherit follow (those
    are never written: one may hold torch's default); leaves with a value of their own
    other than "ieee" are set to "ieee". The legacy matmul precision, which cuBLAS checks
    against the cuda matmul leaf, is set to "highest" if it is not (its setter writes that
    leaf, which then already had a value of its own). All that was written is restored.
    """
    written: dict[_Node, str] = {}  # node → its own value before the block
    legacy: str | None = None
    try:
        generic = _get(_GENERIC)  # the root: the value it resolves to is its own
        families: dict[_Node, str] = {}
        try:
            own = _own_values(_FAMILIES, (_GENERIC,))
            families = {node: value or "none" for node, value in own.items()}
            leaves = _own_values(_LEAVES, (_GENERIC, *_FAMILIES))
        finally:
            _set(_GENERIC, generic)
            for node, value in families.items():
                _set(node, value)
        for node, value in families.items():
            written[node] = value
            _set(node, "ieee")
        for node, own_value in leaves.items():
            if own_value is not None and own_value != "ieee":
                written[node] = own_value
                _set(node, "ieee")
        with _quiet():
            matmul = torch.get_float32_matmul_precision()  # consistent: every leaf is ieee
            if matmul != "highest":
                legacy = matmul
                written.setdefault(("cuda", "matmul"), leaves[("cuda", "matmul")] or "none")
                torch._C._set_cublas_allow_tf32(False)  # "highest"; writes the cuda matmul leaf
                _set(("cuda", "matmul"), "ieee")
        yield
    finally:
        with _quiet():
            if legacy == "medium":  # its setter writes both matmul leaves: restored below
                written.setdefault(("mkldnn", "matmul"), leaves[("mkldnn", "matmul")] or "none")
                torch.set_float32_matmul_precision("medium")
            elif legacy is not None:  # "high"
                torch._C._set_cublas_allow_tf32(True)
        for node, value in written.items():
            _set(node, value)


@contextlib.contextmanager
def _legacy_flags_off() -> Iterator[None]:
    """torch < 2.9: the matmul precision "highest" and cuDNN's TF32 flag off in the block."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch._C._get_cudnn_allow_tf32()
    try:
        torch.set_float32_matmul_precision("highest")
        torch._C._set_cudnn_allow_tf32(False)
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch._C._set_cudnn_allow_tf32(cudnn)


def autocast_enabled(device: torch.device | str) -> bool:
    """Whether autocast is on for ``device``'s type here (a device type autocast does not
    know, such as "meta", never has it on)."""
    try:
        return torch.is_autocast_enabled(torch.device(device).type)
    except RuntimeError:
        return False


def _autocast_types(device: torch.device | str | None) -> list[str]:
    """The device types whose autocast is on and must be turned off."""
    types = ["cpu", "cuda"] if device is None else [torch.device(device).type]
    return [kind for kind in types if autocast_enabled(kind)]


# Unit roundoff u (half the spacing of 1.0) of the reduced float32 arithmetics.
_ROUNDOFF = {"ieee": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-8}


def float32_roundoff(device: torch.device | str) -> float:
    """The unit roundoff of float32 products and convolutions on ``device``'s type under
    the settings in force here: 2⁻²⁴ in IEEE float32, 2⁻¹¹ where TF32 may be used (cuBLAS,
    cuDNN — convolutions are TF32 by default on CUDA —, matmul precision ``"high"``), 2⁻⁸
    where bfloat16 may be (matmul precision ``"medium"``, oneDNN's ``bf16``).

    >>> with exact_arithmetic("cpu"):
    ...     float32_roundoff("cpu") == 2.0**-24
    True
    """
    kind = torch.device(device).type
    values = {torch.get_float32_matmul_precision()}
    if _NEW_API:
        backend = {"cuda": "cuda", "cpu": "mkldnn"}.get(kind)
        nodes = [_GENERIC] + ([(backend, "all")] if backend else [])
        nodes += [(backend, op) for op in ("matmul", "conv", "rnn")] if backend else []
        values |= {_get(node) for node in nodes}
    elif kind == "cuda":
        values |= {"tf32"} if torch._C._get_cudnn_allow_tf32() else set()
    if "medium" in values or "bf16" in values:
        return _ROUNDOFF["bf16"]
    if kind == "cuda" and ("high" in values or "tf32" in values):
        return _ROUNDOFF["tf32"]
    if "tf32" in values:  # oneDNN's TF32 (on CPUs that have it)
        return _ROUNDOFF["tf32"]
    return _ROUNDOFF["ieee"]


@contextlib.contextmanager
def exact_arithmetic(
    device: torch.device | str | None = None, *, keep_autocast: bool = False
) -> Iterator[None]:
    """A block whose float32 products and convolutions are IEEE float32, not TF32 or bf16.

    Turns off, for the block only: TF32 in cuBLAS and cuDNN and bf16 in oneDNN (on torch ≥
    2.9 every ``cuda`` and ``mkldnn`` ``fp32_precision`` resolves to ``"ieee"``; before,
    ``torch.backends.cudnn.allow_tf32`` is False), reduced float32 matmul precision
    (``torch.get_float32_matmul_precision()`` is ``"highest"``, so
    ``torch.backends.cuda.matmul.allow_tf32`` is False), and autocast on ``device``'s type
    (on the CPU and CUDA when ``device`` is None; left as it is with ``keep_autocast``,
    for a model whose low-precision parameters need it). Everything is restored as it was
    on exit, also when the block raises; blocks nest.

    On torch ≥ 2.9 the legacy ``torch.backends.cudnn.allow_tf32`` flag is left alone (the
    kernels read the per-operation precisions; writing the legacy flag would replace
    cuDNN's default, which no setter can restore), so inside the block its getter, which
    checks it against them, may refuse to answer.

    Wrap in it everything that computes per-example norms and everything that computes the
    clipped sum those norms' clip factors scale (see the module docstring for why).

    Privacy:
      Releases nothing. It makes the clip factor cᵢ = min(1, C/‖gᵢ‖) bound the contribution
      the sum actually adds, up to float32 rounding, whatever TF32, matmul-precision and
      autocast settings are in force around the call.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16), exact_arithmetic("cpu"):
    ...     torch.get_float32_matmul_precision(), torch.is_autocast_enabled("cpu")
    ('highest', False)
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_ieee_tree() if _NEW_API else _legacy_flags_off())
        for kind in [] if keep_autocast else _autocast_types(device):
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield
