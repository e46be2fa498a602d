"""The rule of BatchNorm with frozen statistics (fine-tuning a pre-trained CNN): in
evaluation mode, or as :class:`~dpvision.models.FrozenBatchNorm`, each example is normalised
by the running statistics alone, so its gradients are Σ g ⊙ x̂ (scale) and Σ g (offset) per
channel, as for GroupNorm. BatchNorm in training mode normalises with the statistics of the
batch, which mixes examples: it stays refused, with both fixes in the message."""

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn

from dpvision.models.layers import FrozenBatchNorm
from dpvision.models.validation import batch_norm_problem
from dpvision.per_example.layers.base import SmallRowsTerms, UnsupportedError, register_rule

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def batch_statistics(module: nn.Module) -> str | None:
    """Why ``module`` normalises with batch statistics (mixing examples), or None."""
    if isinstance(module, FrozenBatchNorm) or batch_norm_problem(module, "") is None:
        return None
    return (
        f"{type(module).__name__} with batch statistics (it mixes examples; replace it with "
        "GroupNorm, replace_batchnorm(model), or freeze its statistics to fine-tune, "
        "freeze_batchnorm(model))"
    )


@register_rule(*_BATCH_NORMS, FrozenBatchNorm, check=batch_statistics)
class FrozenBatchNormTerms(SmallRowsTerms):
    """BatchNorm with running statistics: rows (B, C) of Σ g ⊙ x̂ and Σ g per channel."""

    def parts(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
        reason = batch_statistics(module)
        if reason is not None:  # switched to training mode after the model was checked
            raise UnsupportedError(reason)
        mean, var = module.running_mean, module.running_var
        assert isinstance(mean, torch.Tensor)
        assert isinstance(var, torch.Tensor)
        with torch.no_grad():
            normalised = F.batch_norm(x, mean, var, training=False, eps=float(module.eps))
        flat_g = g.reshape(g.shape[0], g.shape[1], -1)
        return {
            "weight": torch.einsum("bci,bci->bc", flat_g, normalised.reshape_as(flat_g)),
            "bias": flat_g.sum(-1),
        }
