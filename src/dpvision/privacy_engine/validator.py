"""``ModuleValidator``: Opacus' model check and fixer, over dpvision's rules.

``validate`` lists what per-example clipping cannot handle (one error per layer, each
saying what to do); ``fix`` returns a copy where BatchNorm no longer mixes examples, by
GroupNorm (Opacus' fix) or, for fine-tuning, by freezing its statistics, and where
attention dropout, which cannot be replayed per example, is off.
"""

import copy
import logging

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpvision.errors import DPVisionError
from dpvision.models import FrozenBatchNorm, replace_batchnorm
from dpvision.models.validation import model_problems
from dpvision.per_example.bookkeeping import unsupported_layers

_log = logging.getLogger(__name__)

BATCH_NORM_FIXES = ("group", "freeze")


class ModuleValidator:
    """Opacus' ``opacus.validators.ModuleValidator``, for dpvision's :class:`PrivacyEngine`.

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    >>> ModuleValidator.is_valid(model)
    False
    >>> ModuleValidator.is_valid(ModuleValidator.fix(model))
    True
    """

    @staticmethod
    def validate(module: nn.Module, *, strict: bool = False) -> list[DPVisionError]:
        """Every reason ``make_private`` would refuse ``module``, as errors (one line each).

        Args:
          module: the model.
          strict: raise the first error instead of returning the list.
        """
        problems = model_problems(module)
        problems += [p for p in unsupported_layers(module) if "BatchNorm" not in p]
        errors = [DPVisionError(problem) for problem in problems]
        if strict and errors:
            raise errors[0]
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """Whether :meth:`validate` finds nothing."""
        return not cls.validate(module)

    @staticmethod
    def fix(module: nn.Module, *, batch_norm: str = "group", groups: int = 16) -> nn.Module:
        """A copy of ``module`` that per-example clipping accepts, as far as a copy can be.

        Args:
          module: the model (left unchanged).
          batch_norm: ``group`` replaces every BatchNorm by GroupNorm (fresh parameters, as
            Opacus' fix); ``freeze`` keeps each BatchNorm's pre-trained statistics, scale and
            offset as a :class:`~dpvision.models.FrozenBatchNorm` (for fine-tuning; one
            without running statistics becomes GroupNorm).
          groups: preferred GroupNorm groups (see :func:`~dpvision.models.replace_batchnorm`).

        Attention dropout (``nn.MultiheadAttention.dropout``) is set to 0 and said so in
        the log. What a copy cannot fix (``batch_first=False``, parameters used outside
        their layers) stays for :meth:`validate` to report.
        """
        if batch_norm not in BATCH_NORM_FIXES:
            raise DPVisionError(
                f"batch_norm must be one of {', '.join(BATCH_NORM_FIXES)}, got {batch_norm!r}"
            )
        fixed = copy.deepcopy(module)
        if batch_norm == "freeze":
            if isinstance(fixed, _BatchNorm) and fixed.running_mean is not None:
                return FrozenBatchNorm.from_batch_norm(fixed)
            for parent in list(fixed.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, _BatchNorm) and child.running_mean is not None:
                        setattr(parent, name, FrozenBatchNorm.from_batch_norm(child))
        fixed = replace_batchnorm(fixed, groups=groups)
        for path, layer in fixed.named_modules():
            if isinstance(layer, nn.MultiheadAttention) and layer.dropout > 0:
                _log.warning("attention dropout %s at %s set to 0", layer.dropout, path or "root")
                layer.dropout = 0.0
        return fixed

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **options: object) -> nn.Module:
        """:meth:`fix`, then :meth:`validate` with ``strict=True``."""
        fixed = cls.fix(module, **options)  # type: ignore[arg-type]
        cls.validate(fixed, strict=True)
        return fixed
