"""Parameter averaging: the decay schedule of the exponential moving average (EMA).

An average of the iterates of a private training run is post-processing of its releases:
it costs no privacy. Every DP-SGD trainer keeps its average with :class:`ParameterEMA` and
this one schedule: the DP-SGD on models, the Opacus-style optimizer and the linear head
(:class:`dpvision.learners.DPSGDLinear`).

>>> ema_decay(0.999, 0), ema_decay(0.999, 10**6)
(0.1, 0.999)
"""

import torch


def ema_decay(decay: float, step: int) -> float:
    """min(μ, (1 + t)/(10 + t)): the warm-up of jax_privacy and TAN, t the logical step."""
    return min(decay, (1 + step) / (10 + step))


class ParameterEMA:
    """Exponential moving average of a module's parameters, updated once per logical step."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.step = 0
        self.model = model
        self.shadow = {k: v.detach().clone() for k, v in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module | None = None) -> None:
        """Moves the average towards the parameters of ``model`` (default: the module it
        was made for)."""
        mu = ema_decay(self.decay, self.step)
        for name, param in (model or self.model).named_parameters():
            if param.requires_grad:  # a frozen parameter's average is itself, bit for bit
                self.shadow[name].mul_(mu).add_(param.detach(), alpha=1 - mu)
        self.step += 1

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> torch.nn.Module:
        """Writes the averaged parameters into ``model`` (a copy of the averaged module)."""
        for name, param in model.named_parameters():
            param.copy_(self.shadow[name])
        return model

    def state_dict(self) -> dict[str, object]:
        """The decay, the step count and the averaged parameters, for checkpoints."""
        return {"decay": self.decay, "step": self.step, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restores :meth:`state_dict`."""
        shadow = state["shadow"]
        assert isinstance(shadow, dict)
        for name, value in shadow.items():
            self.shadow[name].copy_(value)
        self.step = int(state["step"])  # type: ignore[call-overload]
