"""Per-example gradients with torch.func: vmap(grad(loss)) equals micro-batches of one.

DP-SGD clips per-example gradients, which are computed with ``functional_call`` and
``vmap(grad(...))``. This only works, and only gives the right answer, if no layer mixes the
examples of a batch, no operation is in place and there is no data-dependent control flow.
"""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from torch import nn
from torch.func import functional_call, grad, vmap

from dpvision.models import scatter_cnn, tanh_cnn, wide_resnet

BATCH = 4


def vmap_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss(params, example, label):
        logits = functional_call(model, (params, buffers), (example.unsqueeze(0),))
        return F.cross_entropy(logits, label.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    rows: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            rows[name].append(p.grad.detach().clone())
    return {name: torch.stack(grads) for name, grads in rows.items()}


@pytest.mark.parametrize(
    ("build", "input_shape"),
    [
        (lambda: tanh_cnn((1, 28, 28)), (1, 28, 28)),
        (lambda: tanh_cnn((3, 32, 32)), (3, 32, 32)),
        (lambda: scatter_cnn((81, 7, 7)), (81, 7, 7)),
        (lambda: wide_resnet(depth=10, width=1), (3, 32, 32)),
    ],
    ids=["tanh-mnist", "tanh-cifar", "scatter-fmnist", "wrn-10-1"],
)
def test_vmap_per_example_gradients_equal_micro_batches_of_one(build, input_shape):
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(BATCH, *input_shape, dtype=torch.float64)
    y = torch.randint(0, 10, (BATCH,))

    vmapped = vmap_gradients(model, x, y)
    looped = loop_gradients(model, x, y)

    assert vmapped.keys() == looped.keys()
    for name, expected in looped.items():
        assert vmapped[name].shape == (BATCH, *dict(model.named_parameters())[name].shape)
        torch.testing.assert_close(vmapped[name], expected, rtol=1e-7, atol=1e-10, msg=name)
    # The examples really have different gradients (the test is not vacuous).
    first = torch.cat([g[0].flatten() for g in vmapped.values()])
    second = torch.cat([g[1].flatten() for g in vmapped.values()])
    assert not torch.allclose(first, second)
    # And a batched forward pass equals per-example passes: no layer looks across the batch.
    together = model(x)
    alone = torch.cat([model(x[i : i + 1]) for i in range(BATCH)])
    torch.testing.assert_close(together, alone)
