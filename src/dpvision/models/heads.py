"""The classifier head of a model: the last linear layer, and what feeds it.

Transfer learning (DP-RandP's Phases I–III, linear probing on a backbone) splits a model into
a *body* that maps images to an embedding and a *head*, the final ``nn.Linear`` that maps the
embedding to logits. Every model in :mod:`dpvision.models` ends with such a layer, so the
split is found rather than declared: the head is the last ``nn.Linear`` in module order.

>>> import torch
>>> from dpvision.models import tanh_cnn
>>> model = tanh_cnn((1, 28, 28), num_classes=10)
>>> head_name(model), embedding_dim(model)
('classifier.3', 32)
>>> body = replace_head(model, torch.nn.Identity())
>>> body(torch.zeros(2, 1, 28, 28)).shape
torch.Size([2, 32])
"""

from torch import nn

from dpvision.errors import DPVisionError


def head_name(model: nn.Module) -> str:
    """The dotted name of ``model``'s head: its last ``nn.Linear`` submodule.

    Raises:
        DPVisionError: The model has no linear layer.
    """
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not names:
        raise DPVisionError(f"{type(model).__name__} has no linear head to split off")
    return str(names[-1])


def embedding_dim(model: nn.Module) -> int:
    """The width of the embedding that feeds the head (the head's ``in_features``)."""
    head = model.get_submodule(head_name(model))
    assert isinstance(head, nn.Linear)
    return head.in_features


def replace_head(model: nn.Module, new: nn.Module) -> nn.Module:
    """Puts ``new`` in the place of ``model``'s head, in place, and returns ``model``.

    With ``nn.Identity()`` the model then maps images to embeddings.
    """
    name = head_name(model)
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
    return model


def body_of(model: nn.Module) -> nn.Module:
    """``model`` with its head replaced by the identity, in place: images → embeddings."""
    return replace_head(model, nn.Identity())
