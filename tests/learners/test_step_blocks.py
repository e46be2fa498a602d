"""DP-SGD-linear's step reads its batch a block at a time, as stored (float32 stays float32),
scores it in that precision and sums the clipped terms in float64: one example still moves
the release by at most C, wherever it sits and however the blocks fall."""

import numpy as np
import pytest
import torch

from dpvision.learners import DPSGDLinear
from dpvision.learners import dp_sgd_linear as module
from dpvision.learners.dp_sgd_linear import (
    StepBlocks,
    _Head,
    clipped_gradient_sum,
    loss_gradient,
    row_sq_norms,
)
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


def test_the_step_agrees_with_the_float64_step_off_zero(small_blocks) -> None:
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
    got = learner._clipped_sum(x, y, batch, head, sq, policy, StepBlocks(x, learner.chunk_size))
    rows = torch.from_numpy(x[batch].astype(np.float64))
    labels = torch.from_numpy(y[batch])
    weight, bias = head.weight.detach(), head.bias.detach()

    def reference(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The clipped sum of the whole batch as one float64 copy, errors from ``scores``."""
        errors = loss_gradient(scores, labels, "softmax").double()
        grad_w, grad_b, norms = clipped_gradient_sum(
            rows, errors, 0.5, fit_intercept=True, sq_norms=sq[torch.from_numpy(batch)]
        )
        return torch.cat([grad_w.reshape(-1), grad_b]), norms

    # Scores in float32 (the step) or float64 (the step before): the errors, and so the
    # sums, differ by float32 rounding only.
    single = rows.float() @ weight.float().T + bias.float()
    for scores in (single, torch.addmm(bias, rows, weight.T)):
        expected, norms = reference(scores)
        assert float((got.grads["theta"] - expected).norm() / expected.norm()) < 1e-6
        assert torch.allclose(got.norms, norms, rtol=1e-4)  # p − 1 near p = 1 cancels
    assert got.count == 211


def test_blocks_are_reused_and_read_a_memory_map(tmp_path, small_blocks) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(100, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    blocks = StepBlocks(mapped, chunk_size=16384)
    assert blocks.size == 7
    index = np.array([3, 50, 99])
    stored, exact = blocks.read(mapped, index)
    assert stored.dtype == torch.float32
    assert exact.dtype == torch.float64
    assert torch.equal(stored, torch.from_numpy(x[index]))
    assert torch.equal(exact, torch.from_numpy(x[index].astype(np.float64)))
    again, _ = blocks.read(x, np.array([0, 1]))
    assert again.data_ptr() == stored.data_ptr()  # the same buffer, no allocation
