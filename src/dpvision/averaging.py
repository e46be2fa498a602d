"""Parameter averaging: the decay schedule of the exponential moving average (EMA).

An average of the iterates of a private training run is post-processing of its releases:
it costs no privacy. Both DP-SGD trainers use this one schedule, the DP-SGD on models
(:class:`dpvision.training.ParameterEMA`) and on a linear head
(:class:`dpvision.learners.DPSGDLinear`).

>>> ema_decay(0.999, 0), ema_decay(0.999, 10**6)
(0.1, 0.999)
"""


def ema_decay(decay: float, step: int) -> float:
    """min(μ, (1 + t)/(10 + t)): the warm-up of jax_privacy and TAN, t the logical step."""
    return min(decay, (1 + step) / (10 + step))
