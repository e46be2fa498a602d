"""DpEvents: the descriptions of the mechanisms dpvision runs.

A mechanism's *description* (a ``dp_accounting.DpEvent``) is kept separate from the
*accountant* that turns it into (ε, δ). dpvision runs only Gaussian mechanisms, on sums of
contributions whose L2 sensitivity is bounded by clipping, under add/remove-one adjacency:

* **Full-batch Gaussian** (``sample_rate == 1``): a sum S(D) with ‖S(D) − S(D')‖₂ ≤ Δ released
  as S(D) + N(0, (σΔ)² I). Its description is ``GaussianDpEvent(σ)``. Used by the feature
  learners (DP-LS, DP-Newton, DP-FC, full-batch gradient steps) and private statistics.
* **Poisson-sampled Gaussian** (``0 < sample_rate < 1``): every example joins the batch
  independently with probability q, then the clipped sum of the batch gets Gaussian noise.
  Its description is ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` — DP-SGD.

Runs that combine mechanisms (private normalisation, then DP-SGD; two training phases
with different sampling rates) are ``ComposedDpEvent``s of these.
"""

from collections.abc import Sequence

import dp_accounting

from dpvision.accounting._checks import check_noise_multiplier, check_sample_rate, check_steps


def gaussian_event(*, noise_multiplier: float, count: int = 1) -> dp_accounting.DpEvent:
    """Describes ``count`` full-batch Gaussian releases, each with noise std σ·Δ.

    Args:
      noise_multiplier: σ, the ratio of the noise standard deviation to the L2 sensitivity.
      count: How many such releases are composed.

    Returns:
      ``GaussianDpEvent(σ)``, wrapped in ``SelfComposedDpEvent`` when ``count > 1``.
    """
    sigma = check_noise_multiplier(noise_multiplier)
    count = check_steps(count, "count")
    event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(sigma)
    return event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)


def poisson_gaussian_event(
    *, noise_multiplier: float, sample_rate: float, steps: int
) -> dp_accounting.DpEvent:
    """Describes ``steps`` DP-SGD steps: Poisson sampling at rate q, then a Gaussian sum.

    ``sample_rate == 1`` means every example is in every batch (full batch); the event is
    then the plain Gaussian one, with no amplification by sampling claimed.

    Args:
      noise_multiplier: σ; the noise std is σ·C where C bounds each example's contribution.
      sample_rate: q in (0, 1], each example's probability of joining a batch.
      steps: The number of noisy steps T.

    Returns:
      The DpEvent of the T-fold composition.
    """
    sample_rate = check_sample_rate(sample_rate)
    if sample_rate == 1.0:
        return gaussian_event(noise_multiplier=noise_multiplier, count=steps)
    sigma = check_noise_multiplier(noise_multiplier)
    steps = check_steps(steps)
    step = dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma))
    return step if steps == 1 else dp_accounting.SelfComposedDpEvent(step, steps)


def compose_events(events: Sequence[dp_accounting.DpEvent]) -> dp_accounting.DpEvent:
    """Describes the sequential composition of ``events`` (in the order they ran)."""
    events = list(events)
    if not events:
        return dp_accounting.NoOpDpEvent()
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)
