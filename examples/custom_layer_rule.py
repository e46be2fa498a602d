"""Your own layer under DP-SGD: register a per-example-gradient rule for it.

``Scale`` (y = x ⊙ w) runs its own autograd function, as a fused kernel would: ``torch.func``
cannot see inside it, so PrivacyEngine refuses it until a rule gives each example's gradient
from the layer's input x and output gradient g, ∂ℓᵢ/∂w = gᵢ ⊙ xᵢ; then it trains on digits at
(ε, δ) = (3, 1e-5), test accuracy 0.84-0.88 (a rule's test: tests/per_example/).
"""

import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpvision import PrivacyEngine
from dpvision.per_example import LayerTerms, register_rule

EPSILON, DELTA, EPOCHS = 3.0, 1e-5, 10


class ScaleFunction(torch.autograd.Function):  # no setup_context: opaque to torch.func
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors  # the weight's gradient sums the batch: one per step
        return grad * weight, (grad * x).sum(0)


class Scale(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaleFunction.apply(x, self.weight)


@register_rule(Scale)  # calls: (input, output gradient) of each call, B·K rows (K views)
class ScaleTerms(LayerTerms):
    def __init__(self, module, calls, views, strategy="auto"):
        rows = sum(g * x.detach() for x, g in calls)  # (B·K, d): each row's gradient of w
        self.rows = rows.reshape(-1, views, rows.shape[-1]).sum(1)  # an example's K views
        self.sq_norms = self.rows.pow(2).sum(1)  # what each example is clipped by

    def clipped_sum(self, scale, drop):  # Σᵢ cᵢ·gᵢ, rows in `drop` (non-finite) zeroed
        rows = self.rows if drop is None else self.rows.masked_fill(drop[:, None], 0)
        return {"weight": scale.to(rows.dtype) @ rows}


def main() -> None:
    images, labels = load_digits(return_X_y=True)
    x, y = torch.tensor(images, dtype=torch.float32) / 16.0, torch.tensor(labels)
    model = nn.Sequential(Scale(64), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    engine = PrivacyEngine(accountant="pld")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x[:1437], y[:1437]), batch_size=128),
        target_epsilon=EPSILON,
        target_delta=DELTA,
        epochs=EPOCHS,
        max_grad_norm=1.0,
    )
    for _ in range(EPOCHS):
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    with torch.no_grad():  # the plain module: nothing recorded
        accuracy = (model(x[1437:]).argmax(1) == y[1437:]).float().mean().item()
    print(f"test accuracy {accuracy:.4f}")
    print(f"ε = {engine.get_epsilon(delta=DELTA):.4f} at δ = {DELTA:g}")


if __name__ == "__main__":
    main()
