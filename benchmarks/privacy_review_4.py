"""Privacy review 4's reproductions (issue 48), runnable on any dpvision version since issue 40.

1. **Refusal membership**: weights pre-trained on a whole dataset A (not declared public), a
   private run on B with ``learner.init``. The adversary, who reads A's row digests in the
   weight file, says "member" when B plus the target is refused. TPR over ``--trials``
   targets of A, FPR over as many images of neither.
2. **Engine noise reuse**: two ``PrivacyEngine`` runs with one ``secret_seed`` and another
   setting (σ = 1 and 2; ε = 1 and 4), one step at q = 1 each. The adversary solves the two
   releases for the clipped sum S, assuming shared noise: |Ŝ − S| / C (0 when the noise is
   shared; about 2√(2d) σ₁σ₂/(σ₂ − σ₁) when independent).
3. **Sweep exposure**: an ``imagefolder:ROOT/<class>/`` tree split into train and test by
   seeds 0…4 as ``dpvision sweep --seeds`` runs them: the images that are test images (their
   accuracy released exactly) in one run and training images in another.
4. **Data-update replay**: dp-ls with one ``secret_seed`` on D and on D plus one example.
   ||M(D′) − M(D)|| over the same with two independent secrets: ≪ 1 when the second run
   replays the first run's noise, ≈ 1 when it draws its own.
5. **Cache log line**: a corrupt feature-cache entry, then a run: whether the warning names
   the entry by its hash of the private images.
6. **Attribute state**: a running mean kept in a plain tensor attribute and used at the next
   step under ``PrivacyEngine``: refused, or the step-2 release's movement / C with one
   example of huge norm added.

    python benchmarks/privacy_review_4.py
    PYTHONPATH=/old/checkout/src python benchmarks/privacy_review_4.py --label "old main"

Writes a Markdown table to stdout (docs/results/privacy_review_4.md has both runs).
"""

import argparse
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpvision
from dpvision import DPVisionError, PrivacyEngine
from dpvision.config import TrainConfig
from dpvision.per_example import clipped_gradient_sum

SECRET = 918273645546372819


def _npz(path: Path, images: np.ndarray, labels: np.ndarray) -> str:
    np.savez(path, x_train=images, y_train=labels, x_test=images[:20], y_test=labels[:20])
    return f"npz:{path}"


def _bands(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 3
    images = rng.integers(0, 60, (n, 12, 12, 1)).astype(np.uint8)
    for label in range(3):
        images[labels == label, 4 * label : 4 * label + 4] += 150
    return images, labels


def refusal_membership(trials: int, folder: Path) -> tuple[float, float]:
    """(TPR, FPR) of "refused means member"."""
    from dpvision.training.pretrain_options import SupervisedOptions
    from dpvision.training.supervised import pretrain_supervised

    a_images, a_labels = _bands(300, 0)
    a = _npz(folder / "a.npz", a_images, a_labels)
    options = {"dataset": a, "num_classes": 3, "model": "mlp-16", "steps": 5, "batch_size": 32}
    pretrain_supervised(SupervisedOptions.from_dict(options), folder / "whole.pt", quiet=True)
    b_images, b_labels = _bands(100, 1)
    strangers, stranger_labels = _bands(trials, 2)

    def refused(image: np.ndarray, label: int) -> bool:
        data = _npz(
            folder / "b.npz", np.concatenate([b_images, image[None]]), np.append(b_labels, label)
        )
        learner = {
            "model": "mlp-16",
            "init": str(folder / "whole.pt"),
            "steps": 1,
            "batch_size": 32,
        }
        try:
            dpvision.train(dataset=data, num_classes=3, method="dp-sgd", learner=learner)
        except DPVisionError:
            return True
        return False

    members = sum(refused(a_images[i], a_labels[i]) for i in range(trials))
    outsiders = sum(refused(strangers[i], stranger_labels[i]) for i in range(trials))
    return members / trials, outsiders / trials


def _engine_step(data: TensorDataset, **options: float) -> tuple[torch.Tensor, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    engine = PrivacyEngine()
    arguments = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
        "data_loader": DataLoader(data, batch_size=len(data)),
        "max_grad_norm": 0.1,
        "secret_seed": SECRET,
    }
    if "target_epsilon" in options:
        made = engine.make_private_with_epsilon(
            **arguments, target_delta=1e-5, epochs=1, target_epsilon=options["target_epsilon"]
        )
        sigma = float(made[1].release.noise_multiplier)
    else:
        sigma = options["sigma"]
        made = engine.make_private(**arguments, noise_multiplier=sigma)
    private, optimizer, loader = made
    x, y = next(iter(loader))
    nn.functional.cross_entropy(private(x), y).backward()
    optimizer.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()]) * len(data), sigma


def engine_noise_reuse(setting: str) -> float:
    """|Ŝ − S| / C from two one-step runs with one secret seed, σ (or ε) differing."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(40, 6, generator=gen, dtype=torch.float64), torch.arange(40) % 3
    )
    key = "sigma" if setting == "sigma" else "target_epsilon"
    (one, s1), (two, s2) = (
        _engine_step(data, **{key: 1.0}),
        _engine_step(data, **{key: 2.0 if key == "sigma" else 4.0}),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = data.tensors
    exact = clipped_gradient_sum(
        model, nn.CrossEntropyLoss(reduction="none"), x, y, max_grad_norm=0.1
    )
    s = torch.cat([g.flatten() for g in exact.grads.values()])
    estimate = (s2 * one - s1 * two) / (s2 - s1)
    return float((estimate - s).norm()) / 0.1


def sweep_exposure(folder: Path, seeds: int = 5, images: int = 60) -> tuple[int, int]:
    """(images on the test side in one run and the training side in another, images)."""
    root = folder / "tree"
    rng = np.random.default_rng(0)
    for index in range(images):
        (root / f"c{index % 2}").mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"c{index % 2}" / f"{index}.png")
    test_sides = []
    for seed in range(seeds):
        fields = {"dataset": f"imagefolder:{root}", "seed": seed}
        if "image_size" in TrainConfig.__dataclass_fields__:
            fields["image_size"] = 8
        dataset = TrainConfig(**fields).load_dataset()
        test_sides.append({bytes(image) for image in dataset.test_images})
    ever, always = set().union(*test_sides), set.intersection(*test_sides)
    return len(ever - always), images


def data_update_replay(folder: Path) -> float:
    """||M(D′) − M(D)|| with one secret seed over the same with two secrets."""
    digits = load_digits()
    images, labels = (digits.images * 15).astype(np.uint8)[:300, ..., None], digits.target[:300]
    grown = np.concatenate([images, images[:1]]), np.append(labels, 3)

    def model(data: tuple[np.ndarray, np.ndarray], secret: int) -> np.ndarray:
        run = dpvision.train(
            dataset=_npz(folder / "u.npz", *data),
            method="dp-ls",
            features="pixels",
            epsilon=1.0,
            num_classes=10,
            secret_seed=secret,
        )
        return np.concatenate([np.ravel(run.model.coef), np.ravel(run.model.intercept)])

    base = model((images, labels), SECRET)
    same = np.linalg.norm(model(grown, SECRET) - base)
    fresh = np.linalg.norm(model(grown, SECRET + 1) - base)
    return float(same / fresh)


def cache_log_names_a_hash(folder: Path) -> bool:
    """Whether the warning about a corrupt cache entry names the entry's hash."""
    os.environ["DPVISION_CACHE"] = str(folder / "cache")
    digits = load_digits()
    images, labels = (digits.images * 15).astype(np.uint8)[:100, ..., None], digits.target[:100]
    fields = {
        "dataset": _npz(folder / "c.npz", images, labels),
        "method": "dp-ls",
        "features": "scatternet",
        "num_classes": 10,
    }
    dpvision.train(**fields)
    entries = [p for p in (folder / "cache").rglob("*") if p.is_file()]
    for path in entries:
        if path.suffix in (".npy", ".npz"):
            path.write_bytes(b"corrupt")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("dpvision").addHandler(handler)
    try:
        dpvision.train(**fields)
    finally:
        logging.getLogger("dpvision").removeHandler(handler)
    hashes = {
        part for p in entries for part in p.name.replace(".", "-").split("-") if len(part) >= 16
    }
    return any(h in line for line in records for h in hashes)


class _Forgetful(nn.Module):
    """Keeps the previous batch's mean in a plain attribute (no register_buffer) and
    subtracts it: written only in passes with gradients, one pass late, so the layout probe
    and the mixing re-run (without gradients) see the state the recorded pass saw."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.running, self.pending = torch.zeros(4, dtype=torch.float64), None
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            if self.pending is not None:
                self.running = self.pending
            self.pending = x.detach().mean(0)
        return self.head(torch.tanh(self.body(x - self.running)))


def attribute_state() -> str:
    """Refused, or the largest release movement / C over two epochs at q = 1 with one
    example of huge norm added (noise off)."""
    from dpvision.testing import check_sensitivity, privacy_engine_release

    def loop(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader) -> None:
        for _ in range(2):
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()

    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(12, 4, generator=gen, dtype=torch.float64), torch.arange(12) % 3)
    report = check_sensitivity(privacy_engine_release(_Forgetful(), loop), data, neighbours=3)
    if report.refusal is not None:
        return "refused"
    return f"moved {report.max_ratio:.3f} C"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print(f"## {args.label}\n")
        print("| reproduction | measured |\n|---|---|")
        tpr, fpr = refusal_membership(args.trials, folder)
        what = f"refusal membership, whole-set weights ({args.trials} members, {args.trials} not)"
        print(f"| {what} | TPR {tpr:.2f}, FPR {fpr:.2f} |")
        for setting in ("sigma", "epsilon"):
            pair = "σ = 1 and 2" if setting == "sigma" else "ε = 1 and 4"
            what = f"engine, one secret seed, {pair}: reconstruction error of S / C"
            print(f"| {what} | {engine_noise_reuse(setting):.3g} |")
        exposed, total = sweep_exposure(folder)
        what = "single-tree split over seeds 0–4: test in one run, training in another"
        print(f"| {what} | {exposed} of {total} images |")
        what = "dp-ls, one secret seed, D and D + x: model change / with two secrets"
        print(f"| {what} | {data_update_replay(folder):.3g} |")
        what = "corrupt cache entry: the warning names the hash of the private images"
        print(f"| {what} | {'yes' if cache_log_names_a_hash(folder) else 'no'} |")
        what = "plain tensor attribute across steps (PrivacyEngine)"
        print(f"| {what} | {attribute_state()} |")


if __name__ == "__main__":
    main()
