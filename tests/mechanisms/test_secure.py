"""The secure noise mode: CSPRNG normals at the right scale, marked in the ledger, wired
through the learners, the DP-SGD trainer and PrivacyEngine; what cannot be replayed is
refused."""

import json
import os

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import PrivacyEngine
from dpvision.accounting import PrivacyLedger
from dpvision.cli import main
from dpvision.errors import DPVisionError
from dpvision.learners import DPLeastSquares
from dpvision.mechanisms import PoissonSampler, SecureRandom, gaussian_noise, release_gaussian
from dpvision.mechanisms.secure import noise_source
from dpvision.training import DPSGDStep

SIGMA, CLIP = 1.3, 0.5


def test_secure_gaussian_noise_is_at_the_stated_scale():
    draws = gaussian_noise(
        (20_000,), l2_sensitivity=CLIP, noise_multiplier=SIGMA, generator=SecureRandom()
    ).numpy()
    scale = SIGMA * CLIP
    assert stats.kstest(draws, stats.norm(scale=scale).cdf).pvalue > 1e-3
    assert stats.kstest(draws, stats.norm(scale=0.67 * scale).cdf).pvalue < 1e-6
    assert stats.kstest(draws, stats.norm(scale=1.5 * scale).cdf).pvalue < 1e-6


def test_secure_draws_are_fresh_and_fill_any_shape_and_dtype():
    rng = SecureRandom()
    first = gaussian_noise((3, 4), l2_sensitivity=1.0, noise_multiplier=1.0, generator=rng)
    second = gaussian_noise((3, 4), l2_sensitivity=1.0, noise_multiplier=1.0, generator=rng)
    assert first.shape == (3, 4)
    assert first.dtype == torch.float32
    assert not torch.equal(first, second)
    uniforms = rng.uniform(100_000)
    assert uniforms.min() > 0
    assert uniforms.max() < 1
    assert stats.kstest(uniforms, "uniform").pvalue > 1e-3
    assert rng.state_dict() == {}


def test_the_ledger_marks_secure_releases_and_only_them():
    ledger = PrivacyLedger()
    value = torch.zeros(3, dtype=torch.float64)
    release_gaussian(value, l2_sensitivity=1.0, noise_multiplier=2.0, ledger=ledger,
                     released="a", generator=SecureRandom())  # fmt: skip
    release_gaussian(value, l2_sensitivity=1.0, noise_multiplier=2.0, ledger=ledger,
                     released="a", generator=torch.Generator())  # fmt: skip
    first, second = ledger.to_dict()["entries"]
    assert first["noise_source"] == "secure"
    assert "noise_source" not in second  # the default is left out of the JSON
    assert PrivacyLedger.from_json(ledger.to_json()) == ledger
    assert len(ledger) == 2  # a secure and a seeded release are not merged
    assert noise_source(None) == "pseudo-random"


def test_secure_poisson_sampling_has_its_rate_and_no_replayable_state():
    sampler = PoissonSampler(num_examples=2000, sample_rate=0.1, steps=50, secure=True)
    sizes = [len(batch) for batch in sampler]
    assert abs(np.mean(sizes) - 200) < 10
    assert sampler.state_dict() == {"step": 50, "secure": True}
    seeded = PoissonSampler(num_examples=10, sample_rate=0.5, steps=3, seed=0)
    with pytest.raises(DPVisionError, match="another noise mode"):
        seeded.load_state_dict(sampler.state_dict())


def test_a_secure_dpsgd_step_has_the_right_noise():
    # Zero gradients: the update is the noise alone, σC/(qN) per coordinate.
    def update() -> torch.Tensor:
        model = nn.Linear(3, 2, bias=False).double()
        nn.init.zeros_(model.weight)
        step = DPSGDStep.build(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            loss_fn=lambda out, y: 0.0 * out.sum(dim=-1),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            sample_rate=0.01,
            num_examples=1000,
            ledger=ledger,
            generator=SecureRandom(),
        )
        step([(torch.ones(4, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.long))])
        return model.weight.detach().reshape(-1)

    ledger = PrivacyLedger()
    draws = torch.cat([update() for _ in range(1500)]).numpy()
    scale = SIGMA * CLIP / 10
    assert stats.kstest(draws, stats.norm(scale=scale).cdf).pvalue > 1e-3
    assert stats.kstest(draws, stats.norm(scale=0.67 * scale).cdf).pvalue < 1e-6
    assert ledger.to_dict()["entries"][0]["noise_source"] == "secure"


def test_privacy_engine_secure_mode():
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    model = nn.Linear(5, 3)
    engine = PrivacyEngine(secure_mode=True)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    entries = engine.ledger.to_dict()["entries"]
    assert entries[0]["noise_source"] == "secure"
    assert entries[0]["count"] == 4
    assert engine.accountant.get_epsilon(1e-5) > 0
    other = nn.Linear(5, 3)
    with pytest.raises(DPVisionError, match="noise_generator"):
        PrivacyEngine(secure_mode=True).make_private(
            module=other,
            optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_generator=torch.Generator(),
        )


def test_a_secure_learner_fit_is_not_reproducible_and_is_marked():
    x = np.random.default_rng(0).normal(size=(200, 5))
    y = np.arange(200) % 3
    fits = [
        DPLeastSquares(target_epsilon=1.0, num_classes=3, secure_mode=True, random_state=0).fit(
            x, y
        )
        for _ in range(2)
    ]
    assert not np.array_equal(fits[0].coef_, fits[1].coef_)  # random_state does not seed it
    sources = {e["noise_source"] for e in fits[0].privacy_ledger_.to_dict()["entries"]}
    assert sources == {"secure"}
    with pytest.raises(DPVisionError, match="secure_mode must be true or false"):
        DPLeastSquares(target_epsilon=1.0, num_classes=3, secure_mode="yes").fit(x, y)


@pytest.mark.parametrize("method", ["dp-sgd", "dp-ls"])
def test_cli_secure_mode_is_in_the_result_json(method, tmp_path):
    out = tmp_path / "result.json"
    code = main(
        ["train", "--quiet", "--method", method, "--set", "learner.secure_mode=true",
         "--set", "preprocessing.kind='none'", "--json", str(out)]
        + (["--set", "learner.epochs=1"] if method == "dp-sgd" else [])
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert {e["noise_source"] for e in result["privacy_ledger"]} == {"secure"}
    assert result["config"]["learner"]["secure_mode"] is True


def test_cli_secure_mode_refuses_a_checkpoint_before_any_work(tmp_path, capsys):
    checkpoint = tmp_path / "run.ckpt"
    code = main(
        ["train", "--quiet", "--method", "dp-sgd", "--set", "learner.secure_mode=true",
         "--checkpoint", str(checkpoint)]
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "no state to checkpoint" in err
    assert len(err.splitlines()) == 1
    assert not os.path.exists(checkpoint)
