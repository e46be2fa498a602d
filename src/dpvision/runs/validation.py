"""What a run releases about its held-out validation rows: noisy counts by default.

The validation rows (:func:`dpvision.data.splits.training_rows`) are private examples too:
an exact validation accuracy is an exact statistic of them, which ε would not cover. So a
run releases, for each validation accuracy it reports (the result's
``validation_accuracy``, each ``eval_every`` entry of its history and progress line, with
an EMA the averaged parameters' too), the count of correct held-out examples plus
N(0, σ_v²), divided by the public ``n_validation``:

* ``validation = "private"`` (the default): the counts are Gaussian releases of
  sensitivity 1 (one example added or removed changes a count by at most 1 for a given
  model), written in the ledger when the run is planned, before σ of the training is
  calibrated, so that the whole run — training and validation — meets the target ε. By
  default σ_v makes all of the run's validation counts together cost
  :data:`VALIDATION_SHARE` of the target ε alone; ``validation_noise`` sets σ_v.
* ``validation = "public"``: the user declares the held-out rows public; their exact
  accuracies are released and the result says ``validation = "public"``.
* inside ``dpvision tune``: nothing about the held-out rows is released by the run; the
  exact count goes to the selection, which releases the best run's noisy score
  (:mod:`dpvision.runs.tune`).

Privacy: see above; the noise comes from the run's secret randomness.
"""

import math
from dataclasses import dataclass, field

import torch

from dpvision.accounting import PrivacyLedger, calibrate_noise_multiplier
from dpvision.config import TrainConfig
from dpvision.errors import DPVisionError
from dpvision.mechanisms.noise import gaussian_noise, observe_release
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.mechanisms.secure import noise_source

__all__ = ["VALIDATION_SHARE", "ValidationRelease"]

VALIDATION_SHARE = 0.1
"""The default σ_v: all of a run's validation counts together are (0.1 ε, δ)-DP alone."""
RELEASED = "noisy count of correct validation examples"


@dataclass
class ValidationRelease:
    """How one run releases its validation accuracies (see the module docstring).

    Attributes:
      mode: ``private``, ``public`` or ``selection`` (tune's runs).
      noise: σ_v (0 with the noise off; unused when public or in selection).
      planned: how many counts the run planned (and recorded) to release.
      secret: the run's secret randomness; release k draws its noise from the stream
        ``validation k``, so a run resumed from a checkpoint (which restores ``made``) never
        draws a noise twice.
      made: how many it released so far.
      exact: ``selection`` mode: the exact counts, for the selection only.
    """

    mode: str
    noise: float = 0.0
    planned: int = 0
    secret: SecretRandomness | None = None
    made: int = 0
    exact: list[int] = field(default_factory=list)

    @classmethod
    def for_selection(cls) -> "ValidationRelease":
        """``tune``'s runs: nothing released, the exact counts kept for the selection."""
        return cls("selection")

    @classmethod
    def plan(
        cls,
        config: TrainConfig,
        count: int,
        ledger: PrivacyLedger,
        secret: SecretRandomness,
        mode: "ValidationRelease | None" = None,
    ) -> "ValidationRelease":
        """The run's validation releases, ``count`` of them, recorded in ``ledger`` now (the
        training's σ is then calibrated with them); ``mode``: tune's selection mode.

        Privacy: records ``count`` Gaussian releases of sensitivity 1 and noise σ_v.
        """
        if mode is not None:
            return mode
        if config.validation_is_public or not count:
            return cls("public" if config.validation_is_public else "private")
        if config.noise_off:
            ledger.record_non_private(released=f"{RELEASED} (noise off)", count=count)
            return cls("private", 0.0, count, secret)
        sigma = config.validation_noise or _default_noise(config, count)
        ledger.record(
            noise_multiplier=sigma,
            sample_rate=1.0,
            l2_sensitivity=1.0,
            count=count,
            released=RELEASED,
            noise_source=noise_source(secret.noise("validation 0")),
        )
        return cls("private", sigma, count, secret)

    def accuracy(self, accuracy: float, n: int) -> float:
        """The released accuracy for an exact ``accuracy`` on ``n`` held-out rows.

        Privacy: ``private``: (correct + N(0, σ_v²)) / n clamped to [0, 1], one planned release of
        sensitivity 1; ``public``: exact (declared public); ``selection``: the count is kept
        for the selection and NaN is returned (nothing released).
        """
        correct = round(accuracy * n)
        if self.mode == "public":
            return accuracy
        if self.mode == "selection":
            self.exact.append(correct)
            return math.nan
        if self.made >= self.planned:
            raise DPVisionError(
                f"the run released more validation counts than the {self.planned} it was "
                "calibrated for: this is a bug in dpvision, please report it"
            )
        index, self.made = self.made, self.made + 1
        value = observe_release(
            torch.tensor([float(correct)], dtype=torch.float64),
            l2_sensitivity=1.0,
            released=RELEASED,
        )
        if self.noise:
            assert self.secret is not None
            value = value + gaussian_noise(
                (1,),
                l2_sensitivity=1.0,
                noise_multiplier=self.noise,
                dtype=torch.float64,
                generator=self.secret.noise(f"validation {index}"),
            )
        # Post-processing: an accuracy outside [0, 1] says nothing more than its clamp.
        return min(max(float(value[0]) / n, 0.0), 1.0)

    def summary(self) -> dict[str, object]:
        """The result's fields about the validation release (public: mode and σ_v)."""
        if self.mode == "selection":
            return {}
        return {"validation": self.mode, "validation_noise": self.noise or None}


def _default_noise(config: TrainConfig, count: int) -> float:
    """σ_v: ``count`` releases at σ_v together (VALIDATION_SHARE · ε, δ)-DP; with a fixed
    σ instead of a target, σ·√count (all of them together cost one release at σ)."""
    if config.epsilon is None:
        assert config.noise_multiplier is not None
        return config.noise_multiplier * math.sqrt(count)
    return calibrate_noise_multiplier(
        target_epsilon=VALIDATION_SHARE * config.epsilon,
        target_delta=config.delta,
        sample_rate=1.0,
        steps=count,
        accountant=config.accountant,
    )
