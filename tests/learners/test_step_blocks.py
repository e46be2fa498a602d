"""DP-SGD-linear's step reads its batch a block at a time into reused buffers, as stored
(float32 stays float32 in memory), and does its arithmetic in float64: one example still
moves the release by at most C, wherever it sits and however the blocks fall, and the other
examples' terms do not move at all."""

import numpy as np
import pytest
import torch

from dpvision.learners import DPSGDLinear
from dpvision.learners import step_blocks as module
from dpvision.learners.dp_sgd_linear import _Head, clipped_gradient_sum, loss_gradient
from dpvision.learners.step_blocks import StepBlocks, row_sq_norms
from dpvision.mechanisms import observing_releases
from dpvision.mechanisms.clip_policy import make_clip_policy


def _first_release(features: np.ndarray, labels: np.ndarray, clip: float) -> torch.Tensor:
    """The exact value of a full-batch DP-SGD-linear fit's first release (before noise)."""
    seen: list[torch.Tensor] = []

    def observer(release):
        seen.append(release.value.clone())
        return release.value

    learner = DPSGDLinear(noise_multiplier=1.0, clip_norm=clip, epochs=1, random_state=0)
    with observing_releases(observer):
        learner.set_params(num_classes=3).fit(features, labels)
    return seen[0]


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 7 rows of 6 float64 numbers: a batch of 300 spans 43 of them."""
    monkeypatch.setattr(module, "BLOCK_BYTES", 7 * 6 * 8)


@pytest.mark.parametrize("position", [0, 150, 300])
def test_one_enormous_float32_example_moves_the_release_by_at_most_c(
    position: int, blobs, small_blocks
) -> None:
    x, y, _, _ = blobs
    x = x.astype(np.float32)
    x2 = np.insert(x, position, np.full(x.shape[1], 1e6, dtype=np.float32), axis=0)
    y2 = np.insert(y, position, 2)
    clip = 0.7
    change = float(
        torch.linalg.vector_norm(_first_release(x, y, clip) - _first_release(x2, y2, clip))
    )
    assert 0.4 * clip <= change <= clip * (1 + 1e-12)


def test_the_step_is_the_float64_step_of_the_whole_batch(small_blocks) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(500, 40)).astype(np.float32)
    y = rng.integers(0, 4, 500)
    batch = np.sort(rng.choice(500, 211, replace=False))
    head = _Head(4, 40, 0.0)
    with torch.no_grad():
        head.theta.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(0))
    sq = row_sq_norms(x)
    policy = make_clip_policy("flat", 0.5, expected_batch_size=211.0)
    learner = DPSGDLinear(noise_multiplier=1.0, clip_norm=0.5, num_classes=4)
    got = learner._clipped_sum(x, y, batch, head, sq, policy, StepBlocks(x, learner.chunk_size, 4))
    # The step before: the whole batch as one float64 copy, one GEMM each.
    rows = torch.from_numpy(x[batch].astype(np.float64))
    weight, bias = head.weight.detach(), head.bias.detach()
    errors = loss_gradient(torch.addmm(bias, rows, weight.T), torch.from_numpy(y[batch]), "softmax")
    grad_w, grad_b, norms = clipped_gradient_sum(
        rows, errors, 0.5, fit_intercept=True, sq_norms=sq[torch.from_numpy(batch)]
    )
    expected = torch.cat([grad_w.reshape(-1), grad_b])
    assert torch.allclose(got.grads["theta"], expected, rtol=1e-12, atol=1e-14)
    assert torch.allclose(got.norms, norms, rtol=1e-12)
    assert got.count == 211


def test_a_row_moved_by_one_place_keeps_its_term() -> None:
    """The privacy review's construction: large float32 rows whose margins sit where
    softmax's p − 1 jumps by a rounding step, a non-zero head, d = 3 969 (ScatterNet on
    28×28, not a multiple of 16), and the target inserted first, moving every other row
    by one place in its block. With float32 scores the shared rows' terms turned and the
    sum moved by 6.2 C; with float64 scores only the target's own term moves."""
    d, m, n, clip = 3969, 10, 600, 1.0
    rng = np.random.default_rng(0)
    w = rng.normal(size=d) * 1e-6  # the head: class 0's weights, the others 0
    x = rng.normal(size=(n, d)) * 1e6
    edges = np.array([15.0261, 15.5369, 16.6355])  # where float32 softmax's p₀ − 1 jumps
    margin = rng.choice(edges, n) + rng.uniform(-3e-5, 3e-5, n)
    x = (x + ((margin - x @ w) / (w @ w))[:, None] * w).astype(np.float32)
    y = np.zeros(n, dtype=np.int64)
    head = _Head(m, d, 0.0)
    with torch.no_grad():
        head.weight[0] = torch.from_numpy(w)

    def clipped(features: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        learner = DPSGDLinear(noise_multiplier=1.0, clip_norm=clip, num_classes=m)
        policy = make_clip_policy("flat", clip, expected_batch_size=float(n))
        blocks = StepBlocks(features, learner.chunk_size, m)
        batch = np.arange(len(features))
        out = learner._clipped_sum(
            features, labels, batch, head, row_sq_norms(features), policy, blocks
        )
        return out.grads["theta"], out.norms

    a, norms_a = clipped(x, y)
    b, norms_b = clipped(np.insert(x, 0, 0.0, axis=0), np.insert(y, 0, 0))
    assert torch.equal(norms_a, norms_b[1:])  # every shared row's gradient, bit for bit
    assert float((b - a).norm()) <= clip * (1 + 1e-9)


def test_blocks_are_reused_and_read_a_memory_map(tmp_path, small_blocks) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(100, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    blocks = StepBlocks(mapped, chunk_size=16384, num_classes=3)
    assert blocks.size == 7
    assert blocks.rows.dtype == np.float32  # stored rows stay float32 in memory
    index = np.array([3, 50, 99])
    exact = blocks.read(mapped, index)
    assert exact.dtype == torch.float64
    assert exact.shape == (7, 6)  # always the whole block
    assert exact.stride(0) == 8  # rows 64 bytes apart: every row at the same alignment
    assert torch.equal(exact[:3], torch.from_numpy(x[index].astype(np.float64)))
    again = blocks.read(x, np.array([0, 1]))
    assert again.data_ptr() == exact.data_ptr()  # the same buffer, no allocation
    assert torch.equal(again[:2], torch.from_numpy(x[:2].astype(np.float64)))


def test_a_tensor_of_features_is_read_as_its_rows(blobs) -> None:
    x, y, _, _ = blobs
    array = DPSGDLinear(noise_multiplier=0.0, epochs=2, random_state=0, num_classes=3).fit(x, y)
    tensor = DPSGDLinear(noise_multiplier=0.0, epochs=2, random_state=0, num_classes=3)
    tensor.fit(torch.from_numpy(x), y)
    assert np.array_equal(np.asarray(array.coef_), np.asarray(tensor.coef_))


def _shared_rows_change(
    x: np.ndarray, y: np.ndarray, head: "_Head", m: int, loss: str, chunk_size: int
) -> tuple[float, int]:
    """(‖S(D′) − S(D) − the target's own term‖ / C, shared rows whose norm changed) for
    D′ = D with a zero row inserted first, which moves every row of D by one place."""

    def clipped(features: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        learner = DPSGDLinear(
            noise_multiplier=1.0, clip_norm=1.0, num_classes=m, loss=loss, chunk_size=chunk_size
        )
        policy = make_clip_policy("flat", 1.0, expected_batch_size=float(len(features)))
        blocks = StepBlocks(features, chunk_size, m)
        out = learner._clipped_sum(
            features, labels, np.arange(len(features)), head, row_sq_norms(features), policy, blocks
        )
        return out.grads["theta"], out.norms

    a, norms_a = clipped(x, y)
    b, norms_b = clipped(np.insert(x, 0, 0.0, axis=0), np.insert(y, 0, 0))
    target, _ = clipped(np.zeros((1, x.shape[1]), x.dtype), np.zeros(1, np.int64))
    return float((b - a - target).norm()), int((norms_a != norms_b[1:]).sum())


@pytest.mark.parametrize("m", [12, 100])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_at_a_blocks_end_keep_their_terms(m: int, dtype: type) -> None:
    """The second review's construction: blocks of 7 rows (not a multiple of 4) at m ≥ 12,
    where MKL scores the last rows of a product with another kernel, and one crafted row
    per block just before those rows, whose score cancels (1e30 − 1e30 + 40): the kernels
    disagree on it, and it moved the sum by 48 C."""
    d, size, blocks = 6, 7, 40
    head = _Head(m, d, 0.0)
    with torch.no_grad():
        head.weight[0] = 1.0
    worst = 0.0
    for a, b, c in ((0, 3, 4), (0, 1, 5), (1, 4, 2)):
        crafted = np.zeros(d, dtype)
        crafted[[a, b, c]] = (1e30, 40.0, -1e30)
        x = np.zeros((blocks * size, d), dtype)
        x[size - size % 4 - 1 :: size] = crafted
        change, moved = _shared_rows_change(x, np.zeros(len(x), np.int64), head, m, "softmax", 7)
        assert moved == 0
        worst = max(worst, change)
    assert worst <= 1e-9


def test_a_sigmoid_near_one_keeps_its_term_at_a_blocks_tail() -> None:
    """The second review's sigmoid construction: σ(zᵧ) − 1 at zᵧ = 30.18 lost most of its
    digits, and the last elements of a block take another exp (scalar, not vector): a
    one-ulp difference in σ moved eᵧ by 0.3 %. −σ(−zᵧ) keeps it to an ulp."""
    d, m, chunk = 6, 2, 134
    head = _Head(m, d, 0.0)
    with torch.no_grad():
        head.weight[0, 0] = 30.181443677866437
        head.weight[1, 0] = -30.18
    crafted = np.zeros(d, np.float32)
    crafted[:2] = (1.0, 1e20)
    x = np.zeros((40 * chunk, d), np.float32)
    x[127::chunk] = crafted
    change, _ = _shared_rows_change(x, np.zeros(len(x), np.int64), head, m, "sigmoid", chunk)
    assert change <= 1e-9  # was 5.7e-2 (1.4e-3 C a moved row)


def test_the_label_entry_of_the_loss_gradient_keeps_its_precision() -> None:
    scores = torch.tensor([[40.0, 0.0, 0.0], [-3.0, 1.0, 2.0]], dtype=torch.float64)
    labels = torch.tensor([0, 2])
    errors = loss_gradient(scores.clone(), labels, "softmax")
    exact = torch.softmax(scores, dim=1)
    assert torch.allclose(errors[0, 0], -(exact[0, 1] + exact[0, 2]), rtol=1e-14)
    assert errors[0, 0] != 0.0  # p₀ − 1 in float64 rounds to 0 at a margin of 40
    assert torch.allclose(errors.sum(dim=1), torch.zeros(2, dtype=torch.float64), atol=1e-15)
    sig = loss_gradient(scores.clone(), labels, "sigmoid")
    assert torch.allclose(sig[0, 0], -torch.sigmoid(torch.tensor(-40.0, dtype=torch.float64)))
    assert torch.allclose(sig[0, 1:], torch.sigmoid(scores[0, 1:]))


def test_scoring_falls_back_to_one_row_at_a_time_where_a_block_is_not_uniform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = np.random.default_rng(4).normal(size=(30, 6))
    monkeypatch.setattr(StepBlocks, "uniform", lambda self, m: False)
    blocks = StepBlocks(x, 7, 3)
    assert not blocks.by_block
    block = blocks.read(x, np.arange(5))
    weight, bias = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    assert torch.allclose(blocks.scores(weight, bias)[:5], block[:5] @ weight.T + bias, rtol=1e-12)


@pytest.mark.parametrize("label_entry", [True, False])
def test_one_row_gets_the_same_gradient_in_every_slot_of_a_partial_block(label_entry) -> None:
    """The third review's construction: ATen takes a tensor's last elements through another
    exp, so a sigmoid of only the block's rows gave the rows ending the batch other bits
    (an ulp), and adaptive clipping's count of norms ≤ C flipped for 15 shared rows."""
    d, m, chunk, z = 2, 2, 64, -1.7813060892405783  # σ(z): the two exps round differently
    head = _Head(m, d, 0.0)
    with torch.no_grad():
        head.weight[0, 0], head.weight[1, 0] = (-z, -40.0) if label_entry else (40.0, z)
    learner = DPSGDLinear(noise_multiplier=1.0, num_classes=m, loss="sigmoid", chunk_size=chunk)
    policy = make_clip_policy("flat", 1.0, expected_batch_size=100.0)
    for n in (chunk + 1, chunk + 7, chunk + 15):
        x = np.tile([1.0, 0.0], (n, 1))
        out = learner._clipped_sum(
            x,
            np.zeros(n, np.int64),
            np.arange(n),
            head,
            row_sq_norms(x),
            policy,
            StepBlocks(x, chunk, m),
        )
        assert len(set(out.norms.tolist())) == 1, n
