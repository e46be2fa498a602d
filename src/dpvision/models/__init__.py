"""Models for private image classification, all free of batch normalisation.

* :func:`tanh_cnn` / :class:`TanhCNN` — end-to-end tanh CNNs on pixels (Tramèr & Boneh,
  after Papernot et al.), for 1×28×28 and 3×32×32 images.
* :func:`scatter_cnn` / :class:`ScatterCNN` — tanh CNNs on ScatterNet features with a
  data-independent GroupNorm in front (Tramèr & Boneh).
* :func:`wide_resnet` / :class:`WideResNet` — WRNs with GroupNorm and weight-standardised
  convolutions (:class:`WSConv2d`), as in jax_privacy (De et al.).
* :func:`mlp` / :class:`MLP` — small tanh MLPs (or logistic regression) on flattened images,
  for any image size; the model of many-run privacy audits.
* :class:`ModelSpec` — a ``learner.model`` spec (``wrn-16-4``, ``timm:NAME``, …) parsed once;
  :mod:`dpvision.models.registry` builds a model from it.
* :func:`validate_model` and :func:`replace_batchnorm` — reject or fix layers that mix the
  examples of a batch (BatchNorm), which per-example clipping cannot tolerate.

Every model works with ``torch.func.functional_call`` and ``vmap(grad(...))`` for per-example
gradients: no layer looks across the batch, no operation is in place, and there is no
data-dependent control flow.

>>> import torch
>>> from dpvision.models import tanh_cnn, validate_model
>>> model = tanh_cnn((1, 28, 28), num_classes=10)
>>> validate_model(model)
>>> model(torch.zeros(2, 1, 28, 28)).shape
torch.Size([2, 10])
"""

from dpvision.models.layers import FrozenBatchNorm, WSConv2d
from dpvision.models.mlp import MLP, mlp
from dpvision.models.scatter_cnn import ScatterCNN, scatter_cnn
from dpvision.models.spec import ModelSpec
from dpvision.models.tanh_cnn import TanhCNN, tanh_cnn
from dpvision.models.validation import freeze_batchnorm, replace_batchnorm, validate_model
from dpvision.models.wide_resnet import WideResNet, wide_resnet

__all__ = [
    "MLP",
    "FrozenBatchNorm",
    "ModelSpec",
    "ScatterCNN",
    "TanhCNN",
    "WSConv2d",
    "WideResNet",
    "freeze_batchnorm",
    "mlp",
    "replace_batchnorm",
    "scatter_cnn",
    "tanh_cnn",
    "validate_model",
    "wide_resnet",
]
