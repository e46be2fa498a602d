"""Which parameters a private fine-tuning run trains (``learner.finetune``).

* ``all`` — every parameter;
* ``head`` — the classifier head only (the last ``nn.Linear``): linear probing;
* ``norms+head`` — the scale and offset of every normalisation layer, and the head;
* ``bias+head`` — every bias, and the head (BitFit).

The other parameters get ``requires_grad = False``: no per-example gradient is computed for
them, they are not clipped and not noised, the optimizer does not see them (weight decay
included), and they end the run bit-identical to how they started.

Privacy: the choice depends on the architecture only, never on data; the clipped sum covers
the trained parameters, so its sensitivity is C whatever the mode.
"""

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from dpvision.errors import DPVisionError
from dpvision.models.heads import head_name
from dpvision.models.layers import FrozenBatchNorm

__all__ = ["FINETUNE_MODES", "apply_finetune", "trainable_names"]

FINETUNE_MODES = ("all", "head", "norms+head", "bias+head")

_NORMS = (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, _BatchNorm, _InstanceNorm, FrozenBatchNorm)


def trainable_names(model: nn.Module, mode: str) -> list[str]:
    """The names of the parameters ``mode`` trains, in ``model.named_parameters()`` order.

    >>> from dpvision.models import tanh_cnn
    >>> trainable_names(tanh_cnn((1, 28, 28), 10), "head")
    ['classifier.3.weight', 'classifier.3.bias']
    """
    if mode not in FINETUNE_MODES:
        raise DPVisionError(
            f"unknown learner.finetune {mode!r}; choose one of {', '.join(FINETUNE_MODES)}"
        )
    names = [name for name, _ in model.named_parameters()]
    if mode == "all":
        return names
    head = head_name(model) + "."
    chosen = {name for name in names if name.startswith(head)}
    if mode == "norms+head":
        for path, module in model.named_modules():
            if isinstance(module, _NORMS):
                prefix = f"{path}." if path else ""
                chosen.update(prefix + name for name, _ in module.named_parameters(recurse=False))
    elif mode == "bias+head":
        chosen.update(name for name in names if name.rpartition(".")[2] == "bias")
    return [name for name in names if name in chosen]


def apply_finetune(model: nn.Module, mode: str) -> list[str]:
    """Freezes every parameter that ``mode`` does not train; returns the trained names.

    Raises:
      DPVisionError: an unknown mode, or a mode that leaves nothing to train.
    """
    trained = set(trainable_names(model, mode))
    if not trained:
        raise DPVisionError(f"learner.finetune = {mode} trains no parameter of this model")
    for name, param in model.named_parameters():
        param.requires_grad_(name in trained)
    return [name for name, _ in model.named_parameters() if name in trained]
