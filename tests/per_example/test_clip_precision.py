"""The clip's norms and sums run in IEEE float32 whatever the TF32 and autocast settings.

On an H200 with TF32 allowed, one example clipped to C = 1 moved the DP-SGD release by
1.00002 C (``tests/gpu/test_cuda.py::test_clipping_on_cuda_is_within_c_on_neighbouring_datasets``
with ``precision=None``): cuBLAS and cuDNN round the inputs of float32 products to TF32, and
the products the norms came from and the products of the clipped sum round differently.
:class:`EmulatedTF32` makes the CPU behave like such a GPU, so the failure and its fix
(:func:`~dpvision.per_example.precision.exact_arithmetic`) are tested without one.
"""

import contextlib
import functools
import random
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dpvision.mechanisms.clip_policy import FlatClip
from dpvision.models.registry import build_model
from dpvision.per_example import bookkeeping, clip_terms, reference
from dpvision.per_example.precision import exact_arithmetic
from dpvision.testing import SensitivityReport, check_sensitivity, dpsgd_release

aten = torch.ops.aten
NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")
TOLERANCE = 1e-6


def tf32(x: Any) -> Any:
    """``x`` rounded to TF32 (10-bit mantissa, round to nearest, ties to even) if it is a
    float32 tensor, as tensor cores read their inputs; anything else unchanged."""
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32):
        return x
    bits = x.view(torch.int32)
    rounded = (bits + (0x0FFF + ((bits >> 13) & 1))) & ~0x1FFF
    return torch.where(torch.isnan(x), x, rounded.view(torch.float32))


def cublas_tf32() -> bool:
    """What cuBLAS reads (``allowTF32CuBLAS``): raises, as it does, on a mix of the APIs."""
    return torch._C._get_cublas_allow_tf32()


def cudnn_conv_tf32() -> bool:
    """What cuDNN convolutions read: the ``cuda``/``conv`` precision (torch ≥ 2.9), else the
    legacy ``torch.backends.cudnn.allow_tf32``."""
    if NEW_API:
        return torch._C._get_fp32_precision_getter("cuda", "conv") == "tf32"
    return torch.backends.cudnn.allow_tf32


# Which arguments a TF32 kernel rounds: cuBLAS GEMMs (matrix-vector products and dot products
# do not use tensor cores) and cuDNN convolutions, forward and backward.
GEMMS = {
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.baddbmm.default: (1, 2),
    aten.addbmm.default: (1, 2),
    aten._addmm_activation.default: (1, 2),
}
CONVOLUTIONS = {
    aten.convolution.default: (0, 1),
    aten.convolution_backward.default: (0, 1, 2),  # grad_output, input, weight
}


class EmulatedTF32(TorchDispatchMode):
    """The CPU as a GPU with TensorFloat-32: float32 inputs of matrix products and
    convolutions are rounded to TF32 (products and sums stay float32, as on tensor cores)
    whenever the global flags allow TF32 for that kind of kernel, read as the kernels read
    them. Dispatch-level, so it also sees the products of backward passes, of ``vmap`` and
    of decompositions (``matmul``, ``einsum``, ``tensordot``, ``F.linear``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rounded = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        which = ()
        if func in GEMMS and cublas_tf32():
            which = GEMMS[func]
        elif func in CONVOLUTIONS and cudnn_conv_tf32():
            which = CONVOLUTIONS[func]
        if which:
            args = tuple(tf32(a) if i in which else a for i, a in enumerate(args))
            self.rounded += 1
        return func(*args, **(kwargs or {}))


def allow_tf32(on: bool) -> None:
    """Sets TF32 the way users do (PyTorch's own default is on for cuDNN, off for cuBLAS)."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


NODES = [("generic", "all")] + [
    (backend, op) for backend in ("cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn")
]


@pytest.fixture(autouse=True)
def _keep_global_flags() -> Iterator[None]:
    """Puts the flags a test changes back to the values they resolved to (torch's own
    defaults can only be approached: a written node no longer inherits)."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    get = torch._C._get_fp32_precision_getter if NEW_API else None
    tree = {node: get(*node) for node in NODES} if get is not None else {}
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn
    for node, value in tree.items():
        torch._C._set_fp32_precision_setter(*node, value)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """These models are tiny: with two threads on a busy two-core machine, OpenMP's waiting
    made them 30 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def without_exact_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """No exact arithmetic around the norms and the sums: for book-keeping, the code as it
    was before :mod:`~dpvision.per_example.precision`."""
    for module in (bookkeeping, clip_terms, reference):
        monkeypatch.setattr(
            module, "exact_arithmetic", lambda device=None: contextlib.nullcontext()
        )


def wrn() -> nn.Module:
    """The GPU test's model."""
    torch.manual_seed(0)
    return build_model("wrn-10-1", (3, 16, 16), 10)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


def data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, 3, size, size, generator=generator)
    return x, torch.randint(0, 10, (10,), generator=generator)


def dpsgd_check(
    model: nn.Module,
    clipping: str,
    dtype: torch.dtype | None = None,
    *,
    size: int = 8,
    neighbours: int = 3,
    autocast: bool = False,
) -> SensitivityReport:
    """One DP-SGD step (C = 1, noise off, physical batches of 4) on 10 examples and on
    neighbours with one example of norm 1e4 added, on the emulated TF32 GPU."""
    run = dpsgd_release(
        model, max_grad_norm=1.0, precision=dtype, physical_batch_size=4, grad_sample_mode=clipping
    )
    if autocast:  # the caller's own autocast around the step
        step = run

        def run(data: Any) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                step(data)

    with EmulatedTF32():
        report = check_sensitivity(
            run, data(size), neighbours=neighbours, scale=1e4, tolerance=TOLERANCE
        )
    assert report.refusal is None, report.refusal
    return report


def observed_flags() -> dict[str, Any]:
    """Every flag a user can read, and how the precision tree answers below the generic
    node (so that a node's own "none" is told from a value it only inherited)."""
    seen: dict[str, Any] = {}
    for name, read in {
        "matmul_precision": torch.get_float32_matmul_precision,
        "cublas_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": lambda: torch.backends.cudnn.allow_tf32,
        "cpu_autocast": lambda: torch.is_autocast_enabled("cpu"),
    }.items():
        try:
            seen[name] = read()
        except RuntimeError:  # a mix of the legacy and new APIs
            seen[name] = "refused"
    if NEW_API:
        get, put = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter
        generic = get("generic", "all")  # the root: its value is its own
        for probe in (generic, "ieee", "tf32", "none"):
            put("generic", "all", probe)
            seen.update({f"{b}.{op}<-{probe}": get(b, op) for b, op in NODES})
        put("generic", "all", generic)
    return seen


# --- the emulation --------------------------------------------------------------------


def test_tf32_rounds_to_nearest_even_on_a_10_bit_mantissa():
    ulp = 2.0**-10
    x = torch.tensor([1 + ulp / 2, 1 + 1.5 * ulp, 1 + 0.75 * ulp, -(1 + 0.25 * ulp), 3.0])
    expected = torch.tensor([1.0, 1 + 2 * ulp, 1 + ulp, -1.0, 3.0])
    assert torch.equal(tf32(x), expected)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    torch.testing.assert_close(tf32(special), special, rtol=0, atol=0, equal_nan=True)
    y = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    assert float(((tf32(y) - y) / y).abs().max()) <= 2.0**-11
    assert torch.equal(tf32(y.double()), y.double())  # float32 only


@pytest.mark.parametrize("on", [True, False])
def test_the_emulation_rounds_products_and_convolutions_exactly_when_tf32_is_allowed(on):
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=generator), torch.randn(32, 8, generator=generator)
    x, w = (
        torch.randn(2, 3, 6, 6, generator=generator),
        torch.randn(4, 3, 3, 3, generator=generator),
    )
    allow_tf32(on)
    with EmulatedTF32() as mode:
        product, convolved = a @ b, F.conv2d(x, w)
        with exact_arithmetic("cpu"):  # TF32 off, whatever the flags say
            exact_product, exact_convolved = a @ b, F.conv2d(x, w)
    assert torch.equal(exact_product, a @ b)
    assert torch.equal(exact_convolved, F.conv2d(x, w))
    assert torch.equal(product, a @ b) is not on
    assert torch.equal(convolved, F.conv2d(x, w)) is not on
    assert mode.rounded == (2 if on else 0)
    if on:  # the rounding is TF32's: exact products of the rounded inputs
        torch.testing.assert_close(product, tf32(a) @ tf32(b), rtol=0, atol=1e-6)


# --- the failure, reproduced ------------------------------------------------------------


@pytest.mark.usefixtures("without_exact_arithmetic")
def test_before_the_fix_tf32_lets_bookkeeping_move_the_release_by_more_than_c():
    """The GPU test's case (wrn-10-1 on 3×16×16, float32, book-keeping) on the emulated GPU:
    1.00023 C here (the code before the fix gave the same; the vmap reference's
    ``tensordot`` sum gave 1.00035 C)."""
    allow_tf32(True)
    report = dpsgd_check(wrn(), "bookkeeping", size=16)
    assert report.max_ratio > 1 + TOLERANCE, (
        f"no violation reproduced: max ratio {report.max_ratio:.8f}"
    )
    allow_tf32(False)  # the same code with TF32 off was within C, as on the GPU
    assert dpsgd_check(small_model(), "bookkeeping").ok


def test_before_the_fix_the_vmap_sum_as_a_matrix_product_exceeded_c():
    """The reference summed with ``tensordot``, a matrix product that TF32 rounds, while
    the norm is not a product: the contribution of a gradient clipped to C exceeded C."""
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(20, 1, 500, generator=generator) * 1e4  # 20 examples' gradients
    norms = torch.linalg.vector_norm(g, dim=-1)
    scales = torch.clamp(1.0 / norms, max=1.0)
    allow_tf32(True)
    with EmulatedTF32():
        old = [torch.tensordot(s, row, dims=1) for s, row in zip(scales, g, strict=True)]
        new = [(row * s.view(-1, 1)).sum(0) for s, row in zip(scales, g, strict=True)]
    old_ratio = max(float(torch.linalg.vector_norm(c)) for c in old)
    new_ratio = max(float(torch.linalg.vector_norm(c)) for c in new)
    assert old_ratio > 1 + TOLERANCE, f"tensordot under TF32: max ratio {old_ratio:.8f}"
    assert new_ratio <= 1 + TOLERANCE, f"products and a sum: max ratio {new_ratio:.8f}"


@pytest.mark.usefixtures("without_exact_arithmetic")
def test_without_exact_arithmetic_a_callers_autocast_lets_bookkeeping_exceed_c():
    """Book-keeping's norms (ghost products) in bfloat16 under the caller's autocast. (Before
    the fix book-keeping refused such a step, or crashed on mixed dtypes, and the vmap
    reference ran its ``tensordot`` sum in bfloat16: 1.00064 C on this model.)"""
    report = dpsgd_check(small_model(), "bookkeeping", autocast=True)
    assert report.max_ratio > 1 + TOLERANCE, f"max ratio {report.max_ratio:.8f}"


# --- the fix ---------------------------------------------------------------------------


@pytest.mark.parametrize("tf32_on", [True, False], ids=["tf32", "ieee"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clipping", ["bookkeeping", "vmap"])
def test_clipping_moves_the_release_by_at_most_c_whatever_the_tf32_flags(clipping, dtype, tf32_on):
    allow_tf32(tf32_on)
    before = observed_flags()
    report = dpsgd_check(small_model(), clipping, dtype)
    assert report.ok, report.summary()
    assert report.max_ratio > 0.99  # the added example was clipped to C, not dropped
    assert observed_flags() == before


def test_the_gpu_tests_case_is_within_c_on_the_emulated_gpu():
    allow_tf32(True)
    report = dpsgd_check(wrn(), "bookkeeping", size=16)
    assert report.ok, report.summary()


@pytest.mark.usefixtures("without_exact_arithmetic")
def test_the_vmap_sum_needs_no_flags_at_all():
    """Its sum is products and a sum over rows, and its norms are no products: within C
    under TF32 even without :func:`exact_arithmetic`."""
    allow_tf32(True)
    report = dpsgd_check(small_model(), "vmap")
    assert report.ok, report.summary()


@pytest.mark.parametrize("clipping", ["bookkeeping", "vmap"])
def test_a_callers_autocast_around_the_step_keeps_the_release_within_c(clipping):
    report = dpsgd_check(small_model(), clipping, autocast=True)
    assert report.ok, report.summary()
    assert report.max_ratio > 0.99


# --- exact_arithmetic itself -------------------------------------------------------------


def _legacy_everything_on() -> None:
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = True


def _new_api_tree() -> None:
    put = torch._C._set_fp32_precision_setter
    put("generic", "all", "tf32")
    put("mkldnn", "all", "bf16")
    put("cuda", "rnn", "ieee")  # conv inherits "tf32" from generic, cudnn getter refuses
    put("mkldnn", "conv", "none")


def _mixed_apis() -> None:
    torch.set_float32_matmul_precision("high")
    torch._C._set_fp32_precision_setter("cuda", "matmul", "ieee")  # the getters refuse


STATES = {
    "default": lambda: None,
    "legacy": _legacy_everything_on,
    "ieee": lambda: allow_tf32(False),
    **({"new-api": _new_api_tree, "mixed": _mixed_apis} if NEW_API else {}),
}


def ieee_inside() -> None:
    """What every block guarantees: no TF32, no bf16, no autocast."""
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.matmul.allow_tf32
    assert not torch.is_autocast_enabled("cpu")
    if NEW_API:
        for backend in ("cuda", "mkldnn"):
            for op in ("matmul", "conv", "rnn"):
                assert torch._C._get_fp32_precision_getter(backend, op) == "ieee"
    else:
        assert not torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("state", list(STATES))
def test_exact_arithmetic_turns_reduced_precision_off_and_restores_every_flag(state):
    STATES[state]()
    before = observed_flags()
    with torch.autocast("cpu", dtype=torch.bfloat16), exact_arithmetic("cpu"):
        ieee_inside()
        a = torch.randn(4, 4)
        assert (a @ a).dtype == torch.float32
    assert observed_flags() == before


def test_exact_arithmetic_restores_the_flags_when_the_block_raises_and_nests():
    allow_tf32(True)
    before = observed_flags()

    def nested() -> None:
        with exact_arithmetic():
            with exact_arithmetic(torch.device("cpu")):
                pass
            ieee_inside()  # the inner block left the outer's settings
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        nested()
    assert observed_flags() == before


@pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no fp32 precision tree")
def test_exact_arithmetic_keeps_torchs_own_cudnn_default():
    """cuDNN starts with TF32 that a parent's setting overrides, a state no setter can
    restore: a block must not write it (seen in a fresh process)."""
    code = (
        "import torch\n"
        "from dpvision.per_example.precision import exact_arithmetic\n"
        "get, put = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter\n"
        "with exact_arithmetic():\n"
        "    assert get('cuda', 'conv') == 'ieee'\n"
        "assert get('cuda', 'conv') == get('cuda', 'rnn') == 'tf32'\n"
        "assert torch.backends.cudnn.allow_tf32\n"
        "put('generic', 'all', 'ieee')\n"
        "assert get('cuda', 'conv') == get('cuda', 'rnn') == 'ieee'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "meta"])
def test_exact_arithmetic_takes_any_device(device):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with exact_arithmetic(device):
            assert torch.is_autocast_enabled("cpu") is (device == "meta")
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no fp32 precision tree")
def test_exact_arithmetic_restores_random_mixes_of_the_legacy_and_new_apis():
    rng = random.Random(0)
    setters = [
        lambda: torch.set_float32_matmul_precision(rng.choice(["highest", "high", "medium"])),
        lambda: torch._C._set_cudnn_allow_tf32(rng.random() < 0.5),
        lambda: torch._C._set_cublas_allow_tf32(rng.random() < 0.5),
    ]
    for _ in range(100):
        for _ in range(rng.randint(0, 5)):
            if rng.random() < 0.4:
                rng.choice(setters)()
            else:
                node = rng.choice(NODES)
                values = ["ieee", "tf32", "none"] + ([] if node[0] == "cuda" else ["bf16"])
                torch._C._set_fp32_precision_setter(*node, rng.choice(values))
        before = observed_flags()
        with exact_arithmetic():
            ieee_inside()
        assert observed_flags() == before


@pytest.mark.parametrize(
    "layer",
    [nn.Linear(6, 5), nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 5, padding=2, groups=4)],
    ids=["linear", "conv", "depthwise"],
)
def test_bf16_per_example_gradients_are_kept_in_bf16_and_clipped_by_their_own_norms(layer):
    """Under autocast a materialised layer forms its per-example gradients in bfloat16 (as
    the kernels of the pass would), keeps that one tensor, and reads both the norms and the
    clipped sum from it in float32: each example adds exactly scaleᵢ times the gradient
    whose norm set scaleᵢ."""
    from dpvision.per_example.layers import layer_terms

    torch.manual_seed(3)
    shape = (6,) if isinstance(layer, nn.Linear) else (layer.in_channels, 6, 6)
    x = torch.randn(4, *shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    g = torch.randn_like(out)
    terms = layer_terms(layer, [(x, g)], 1, "materialise")
    kept = terms.per_example
    assert kept is not None
    assert kept.dtype == torch.bfloat16
    assert not terms.calls  # the recorded pair is not kept beside it
    assert terms.sq_norms.dtype == torch.float32
    bias = g.float().flatten(2).sum(-1) if g.dim() > 2 else g.float()
    own = kept.float().flatten(1).pow(2).sum(1) + bias.pow(2).sum(1)
    torch.testing.assert_close(terms.sq_norms, own, rtol=1e-6, atol=0)
    scale = torch.tensor([1.0, 0.5, 0.25, 0.0])
    summed = terms.clipped_sum(scale, None)
    expected = torch.tensordot(scale, kept.float(), dims=1)
    if not getattr(terms, "natural", True):  # the dense rule's im2col column order
        expected = terms.dense.unmatrix(expected)
    torch.testing.assert_close(summed["weight"], expected.reshape(layer.weight.shape))
    exact = layer_terms(layer, [(x.bfloat16().float(), g.float())], 1, "materialise")
    gap = (terms.sq_norms - exact.sq_norms).abs() / exact.sq_norms
    assert float(gap.max()) < 1e-2  # bfloat16 products rounded once per example


@pytest.mark.parametrize("forward", ["bf16", "tf32", "float32"])
def test_a_ws_conv_input_crafted_against_the_forward_rounding_is_clipped_to_c(forward):
    """WSConv2d's ghost norms once read aₜ·w̃ₒ back from the layer's forward output, which
    the pass computed from rounded values (bfloat16 under autocast, TF32 on a GPU): an
    image whose patches are orthogonal to the rounded standardised weight (a null-space
    solve; the weights are public) but not to the exact one made the norm see rounding
    noise while the sum added the whole gain gradient: 12.5 C in bf16, 10.5 C under TF32,
    1.0001 C in float32. The norms now read only the recorded input."""
    from dpvision.models.layers import WSConv2d

    torch.manual_seed(0)
    channels, out, side = 128, 32, 8

    class Probe(nn.Module):  # only the gain trains (scale-only fine-tuning)
        def __init__(self) -> None:
            super().__init__()
            self.ws = WSConv2d(channels, out, 3, padding=1)
            self.fc = nn.Linear(out, 5)
            for p in (self.ws.weight, self.ws.bias, *self.fc.parameters()):
                p.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.ws(x).mean((2, 3)))

    model = Probe()
    # The rounding the target is crafted against (for a float32 forward: TF32's, which that
    # forward does not do).
    rounding = {"bf16": lambda w: w.bfloat16().float(), "tf32": tf32, "float32": tf32}
    with torch.no_grad():
        exact = model.ws.standardized_weight().double()
        seen = rounding[forward](exact.float()).double()
        conv = lambda x: F.conv2d(x, seen, padding=1)  # noqa: E731
        back = lambda z: F.conv_transpose2d(z, seen, padding=1)  # noqa: E731
        size = out * side * side
        basis = torch.eye(size, dtype=torch.float64).reshape(size, out, side, side)
        gram = conv(back(basis)).reshape(size, size)
        lift = torch.randn(1, out, 1, 1, dtype=torch.float64).expand(1, out, side, side)
        v = F.conv_transpose2d(lift, exact - seen, padding=1)
        target = v - back(torch.linalg.solve(gram, conv(v).reshape(-1)).reshape(1, out, side, side))
    x = torch.randn(4, channels, side, side)
    y = torch.randint(0, 5, (4,))
    alone = torch.zeros(4, dtype=torch.bool)
    alone[0] = True  # the target's own contribution
    precision = torch.bfloat16 if forward == "bf16" else None
    context = EmulatedTF32 if forward == "tf32" else contextlib.nullcontext
    loss = functools.partial(F.cross_entropy, reduction="none")

    def step() -> Any:
        with context():
            return bookkeeping.clip_and_sum(
                model, loss, x, y, max_grad_norm=1.0, mask=alone, precision=precision,
                method="bookkeeping",
            )  # fmt: skip

    step()  # a benign first call verifies the signature
    for scale in (1e4, 1e6):
        x[0] = (scale * target / target.abs().max()).float()[0]
        got = step()
        moved = float(torch.linalg.vector_norm(got.grads["ws.gain"].double()))
        assert moved <= 1.0 + 1e-5, f"scale {scale:g}: the target moved the sum by {moved} C"


@pytest.mark.parametrize("strategy", ["ghost", "pixel"])
def test_a_ws_conv_patch_along_the_projected_directions_is_clipped_to_c(strategy):
    """A WSConv2d weight's gradient is the output-gradient-weighted patches projected off 1
    and w̃ₒ. Its ghost norm was ‖Gₒ‖² − d·mean² − ⟨Gₒ, w̃ₒ⟩², which cancels in float32: the
    patch α·1 + ρ·v (v ⟂ 1 and every w̃ₒ, the weights being public) made it 0 while the
    mapped sum added about 400 C. The ghost paths now clip by the bound (γₒ/sₒ)‖Gₒ‖."""
    from dpvision.models.layers import WSConv2d

    torch.manual_seed(1)

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ws = WSConv2d(3, 8, 3)
            self.fc = nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.ws(x).mean((2, 3)))

    model = Probe()
    weights = model.ws.weight.detach().reshape(8, 27)
    span = torch.cat([torch.ones(1, 27), weights - weights.mean(1, keepdim=True)]).double()
    q, _ = torch.linalg.qr(span.T)
    v = torch.randn(27, dtype=torch.float64)
    v = (v - q @ (q.T @ v)) / torch.linalg.vector_norm(v - q @ (q.T @ v))
    y = torch.zeros(4, dtype=torch.long)
    alone = torch.tensor([True, False, False, False])
    loss = functools.partial(F.cross_entropy, reduction="none")

    def moved(x: torch.Tensor) -> float:
        got = bookkeeping._bookkeeping_sum(
            model, loss, x, y, policy=FlatClip(1.0), views=False, mask=alone, strategy=strategy
        )
        return float(torch.sqrt(sum(g.double().pow(2).sum() for g in got.grads.values())))

    moved(torch.randn(4, 3, 3, 3))  # a benign first call verifies the signature
    worst = 0.0
    for alpha in (1e5, 3e6, 1e7, 4e8):
        x = torch.randn(4, 3, 3, 3)
        x[0] = alpha + 1000 * v.float().view(3, 3, 3)
        worst = max(worst, moved(x))
    assert worst <= 1.0 + 1e-5, f"the crafted patch moved the sum by {worst} C"
