"""Writes the fine-tuning configs of De et al. (seed 003): Tables 5, 6, 10 and 11, and the
public pre-training runs they start from.

    python configs/seed003/make_finetune_configs.py   # rewrites configs/seed003/finetune/

Each published cell (pre-training → fine-tuning dataset × layers trained × ε) becomes
``finetune/<dataset>_<model>_<pretraining>_<layers>_eps<ε>.toml`` with the hyper-parameters
of App. C.5 (Tables 16-22), the published accuracy in ``[reference]`` and, in ``needs``,
the checkpoint and the data it needs. σ and T are the paper's; the ε the run reports is
computed by dpvision's accountant and written in the header (a test checks it is at most
the published ε). The committed TOMLs are this script's output; a test checks that they
still are.
"""

import argparse
from pathlib import Path

HERE = Path(__file__).parent / "finetune"
CITATION = (
    '# De, Berrada, Hayes, Smith & Balle (2022), "Unlocking High-Accuracy Differentially\n'
    '# Private Image Classification through Scale" (shared/seeds/003).\n'
)

# Tables 16-19 (ImageNet-32 → CIFAR, WRN-28-10): the same σ and T for every dataset and
# layer choice; the learning rate is 1 for all layers and 4 for the classifier alone.
IMAGENET32_SIGMA = {1: 21.1, 2: 15.8, 4: 12.0, 8: 9.4}
IMAGENET32_STEPS = {1: 250, 2: 500, 4: 1000, 8: 2000}
IMAGENET32_RATE = {"all": 1.0, "head": 4.0}
# Table 5: median of 5 runs.
TABLE5 = {
    ("cifar10", "head"): {1: 93.1, 2: 93.6, 4: 94.0, 8: 94.2},
    ("cifar10", "all"): {1: 94.8, 2: 95.4, 4: 96.1, 8: 96.6},
    ("cifar100", "head"): {1: 70.3, 2: 73.9, 4: 76.1, 8: 77.6},
    ("cifar100", "all"): {1: 67.4, 2: 74.7, 4: 79.2, 8: 81.8},
}
# Table 10 (WRN-40-4, ImageNet-32 → CIFAR-10, all layers); "the same experimental setup as
# Section 4.1": no table of its own, so Table 16's values.
TABLE10 = {1: 93.6, 2: 94.3, 4: 95.1, 8: 95.6}
# Table 20 (CIFAR-100 → CIFAR-10, WRN-40-4, all layers): ε → (B, lr, σ, T); Table 11.
TABLE20 = {
    0.5: (1024, 0.125, 5.0, 781),
    1: (4096, 1.0, 5.0, 164),
    1.5: (4096, 0.3, 6.0, 531),
    2: (4096, 0.3, 6.0, 906),
    4: (4096, 0.3, 5.0, 2171),
    6: (4096, 0.1, 6.0, 6421),
    8: (4096, 0.1, 5.0, 7226),
}
TABLE11 = {0.5: 76.7, 1: 80.4, 1.5: 83.8, 2: 84.9, 4: 87.0, 6: 88.4, 8: 89.0}
# Table 22 (JFT-4B → ImageNet, NFNet-F3, last layer): ε → (lr, σ, T); Table 6 (top-1).
TABLE22 = {
    0.1: (30.0, 82.6, 100),
    0.5: (10.0, 57.2, 1000),
    1: (30.0, 29.9, 1000),
    2: (30.0, 15.8, 1000),
    4: (100.0, 8.4, 1000),
    8: (100.0, 4.6, 1000),
}
TABLE6 = {0.1: 77.6, 0.5: 83.8, 1: 84.4, 2: 85.6, 4: 86.0, 8: 86.7}

CHECKPOINTS = {
    "wrn28_10_imagenet32": "checkpoints/wrn28_10_imagenet32.pt",
    "wrn40_4_imagenet32": "checkpoints/wrn40_4_imagenet32.pt",
    "wrn40_4_cifar100": "checkpoints/wrn40_4_cifar100.pt",
    "nfnet_f3_jft4b": "checkpoints/nfnet_f3_jft4b.safetensors",
}
CIFAR_DEVIATIONS = """\
# Deviations from the published run:
# - Batches are Poisson-sampled at q = B/N (expected size B), as the accountant assumes;
#   jax_privacy shuffled and took fixed batches of exactly B.
# - dpvision's WRN uses weight-standardised convolutions and GroupNorm(16) (jax_privacy's
#   too); its pre-training is `dpvision pretrain --objective supervised` (see `needs`).
# - Pixels are standardised with the CIFAR statistics of the fine-tuning dataset, as in
#   the from-scratch configs; the paper's ImageNet-32 pipeline scaled pixels to [-1, 1]
#   during pre-training and does not say which it used when fine-tuning.
# - physical_batch_size is a memory knob only.
"""


def _number(value: float) -> str:
    return f"{value:g}"


def _name(value: float) -> str:
    return _number(value).replace(".", "p")


def _epsilon(sigma: float, rate: float, steps: int, delta: float) -> tuple[float, float]:
    from dpvision.accounting import PrivacyLedger

    ledger = PrivacyLedger()
    ledger.record(noise_multiplier=sigma, sample_rate=rate, count=steps, released="sum")
    return ledger.epsilon(delta, "rdp"), ledger.epsilon(delta, "pld")


def _finetune(
    *,
    title: str,
    dataset: str,
    n_train: int,
    model: str,
    checkpoint: str,
    pretraining: str,
    layers: str,
    epsilon: float,
    accuracy: float,
    batch: int,
    rate: float,
    sigma: float,
    steps: int,
    augmult: int,
    source: str,
    needs: str,
    delta: float = 1e-5,
    extra: str = "",
    deviations: str = CIFAR_DEVIATIONS,
) -> str:
    rdp, pld = _epsilon(sigma, batch / n_train, steps, delta)
    # The paper's accountant (RDP) where it meets the published ε; else the tighter PLD,
    # so that the run never reports more than the published ε.
    accountant = "rdp" if rdp <= epsilon else "pld"
    assert min(rdp, pld) <= epsilon, (title, epsilon, rdp, pld)
    trained = "the classifier layer only" if layers == "head" else "all layers"
    pixels = dataset in ("cifar10", "cifar100")
    lines = [
        CITATION.rstrip("\n"),
        f"# {title}, column ε = {_number(epsilon)}: {model} pre-trained on {pretraining},",
        f"# fine-tuned with DP-SGD on {dataset}, {trained}.",
        f"# Published: {accuracy} % test accuracy at ({_number(epsilon)}, {delta:g})-DP.",
        f"# Published hyper-parameters (App. C.5): B = {batch}, augmult K = {augmult}, C = 1,",
        f"# learning rate {_number(rate)}, σ = {_number(sigma)}, {steps} updates; SGD without",
        "# momentum, constant learning rate, no weight decay; EMA with warm-up (App. C.3).",
        f"# ε of this run (σ and T fixed, ε computed): {rdp:.3f} with rdp, the paper's",
        f"# accountant, {pld:.3f} with pld; add/remove-one, q = {batch}/{n_train}. The run",
        f"# uses {accountant}"
        + (
            " (rdp's bound exceeds the published ε: Poisson sampling at q = B/N)."
            if accountant == "pld"
            else "."
        ),
        deviations.rstrip("\n"),
        "",
        f'dataset = "{dataset}"',
        *([] if pixels else ["num_classes = 1000               # public: ImageNet-1k's labels"]),
        'method = "dp-sgd"',
        'features = "pixels"',
        f"noise_multiplier = {_number(sigma)}",
        f"delta = {delta:g}",
        f'accountant = "{accountant}"',
        "seed = 0",
        "",
        "[preprocessing]",
        'kind = "none"',
        "",
        "[learner]",
        f'model = "{model}"',
        f'init = "{checkpoint}"        # see `needs` below',
        f'finetune = "{layers}"',
        f"batch_size = {batch}",
        "physical_batch_size = 64",
        f"steps = {steps}",
        f"learning_rate = {_number(rate)}",
        "momentum = 0.0",
        'optimizer = "sgd"',
        "max_grad_norm = 1.0",
        f"augmult = {augmult}",
        *extra.splitlines(),
        "",
        "[reference]                      # the published number; not used by the run",
        f'source = "{source}"',
        f"accuracy = {accuracy / 100:.3f}",
        f"epsilon = {_number(epsilon)}",
        f"band = [{(accuracy - 2) / 100:.3f}, {(accuracy + 2) / 100:.3f}]"
        "    # ± 2 points: a rerun outside it is flagged by dpvision report",
        f'needs = "{needs}"',
    ]
    return "\n".join(lines) + "\n"


CIFAR_EXTRA = """\
padding_mode = "symmetric"       # mirror padding, as jax_privacy
ema_decay = 0.9999
groups = 16
normalization = "dataset\""""


def _imagenet32_needs(dataset: str, key: str) -> str:
    return (
        f"{dataset.upper().replace('CIFAR', 'CIFAR-')} (the python-version pickles); the "
        f"checkpoint {CHECKPOINTS[key]} from `dpvision pretrain --config "
        f"configs/seed003/finetune/{key.replace('_imagenet32', '')}_imagenet32_pretrain.toml "
        f"--out {CHECKPOINTS[key]}` on ImageNet-32 (Chrabaszcz et al. 2017, downloaded by hand "
        "into data/imagenet32.npz: x_train/y_train/x_test/y_test); an accelerator"
    )


def configs() -> dict[str, str]:
    """Every file's name and text."""
    files: dict[str, str] = {}
    for (dataset, layers), row in TABLE5.items():
        for epsilon, accuracy in row.items():
            name = f"{dataset}_wrn28_10_imagenet32_{layers}_eps{_name(epsilon)}.toml"
            files[name] = _finetune(
                title="Table 5 (Tables 16-19 for the hyper-parameters)",
                dataset=dataset,
                n_train=50_000,
                model="wrn-28-10",
                checkpoint=CHECKPOINTS["wrn28_10_imagenet32"],
                pretraining="ImageNet-32",
                layers=layers,
                epsilon=epsilon,
                accuracy=accuracy,
                batch=16384,
                rate=IMAGENET32_RATE[layers],
                sigma=IMAGENET32_SIGMA[epsilon],
                steps=IMAGENET32_STEPS[epsilon],
                augmult=16,
                source=f"De et al. 2022, Table 5 ({dataset}, WRN-28-10 from ImageNet-32, "
                f"{'classifier layer' if layers == 'head' else 'all layers'})",
                needs=_imagenet32_needs(dataset, "wrn28_10_imagenet32"),
                extra=CIFAR_EXTRA,
            )
    for epsilon, accuracy in TABLE10.items():
        files[f"cifar10_wrn40_4_imagenet32_all_eps{_name(epsilon)}.toml"] = _finetune(
            title="Table 10 (Table 16's hyper-parameters: 'the same experimental setup')",
            dataset="cifar10",
            n_train=50_000,
            model="wrn-40-4",
            checkpoint=CHECKPOINTS["wrn40_4_imagenet32"],
            pretraining="ImageNet-32",
            layers="all",
            epsilon=epsilon,
            accuracy=accuracy,
            batch=16384,
            rate=IMAGENET32_RATE["all"],
            sigma=IMAGENET32_SIGMA[epsilon],
            steps=IMAGENET32_STEPS[epsilon],
            augmult=16,
            source="De et al. 2022, Table 10 (CIFAR-10, WRN-40-4 from ImageNet-32, all layers)",
            needs=_imagenet32_needs("cifar10", "wrn40_4_imagenet32"),
            extra=CIFAR_EXTRA,
        )
    for epsilon, accuracy in TABLE11.items():
        batch, rate, sigma, steps = TABLE20[epsilon]
        files[f"cifar10_wrn40_4_cifar100_all_eps{_name(epsilon)}.toml"] = _finetune(
            title="Table 11 (Table 20 for the hyper-parameters)",
            dataset="cifar10",
            n_train=50_000,
            model="wrn-40-4",
            checkpoint=CHECKPOINTS["wrn40_4_cifar100"],
            pretraining="CIFAR-100",
            layers="all",
            epsilon=epsilon,
            accuracy=accuracy,
            batch=batch,
            rate=rate,
            sigma=sigma,
            steps=steps,
            augmult=16,
            source="De et al. 2022, Table 11 (CIFAR-10, WRN-40-4 from CIFAR-100, all layers)",
            needs=(
                "CIFAR-10 and CIFAR-100 (the python-version pickles); the checkpoint "
                f"{CHECKPOINTS['wrn40_4_cifar100']} from `dpvision pretrain --config "
                "configs/seed003/finetune/wrn40_4_cifar100_pretrain.toml --out "
                f"{CHECKPOINTS['wrn40_4_cifar100']}`; an accelerator"
            ),
            extra=CIFAR_EXTRA,
        )
    for epsilon, accuracy in TABLE6.items():
        rate, sigma, steps = TABLE22[epsilon]
        files[f"imagenet_nfnet_f3_jft4b_head_eps{_name(epsilon)}.toml"] = _finetune(
            title="Table 6 (Table 22 for the hyper-parameters)",
            dataset="npy:data/imagenet-320",
            n_train=1_271_167,
            model="timm:dm_nfnet_f3",
            checkpoint=CHECKPOINTS["nfnet_f3_jft4b"],
            pretraining="JFT-4B",
            layers="head",
            epsilon=epsilon,
            accuracy=accuracy,
            batch=262144,
            rate=rate,
            sigma=sigma,
            steps=steps,
            augmult=0,
            delta=8e-7,
            source="De et al. 2022, Table 6 (ImageNet top-1, NFNet-F3 from JFT-4B, last layer)",
            needs=(
                "the models extra (pip install 'dpvision[models]'); an NFNet-F3 pre-trained "
                "on JFT-4B with JFT's near-duplicates of ImageNet removed, saved as "
                f"{CHECKPOINTS['nfnet_f3_jft4b']} (not public: timm's dm_nfnet_f3 ImageNet "
                "weights are no substitute, they were trained on the private dataset itself); "
                "ImageNet at 320x320 as npy:data/imagenet-320 (x_train.npy of the 1 271 167 "
                "training images less a 10 000-image validation split, y_train.npy, x_test.npy "
                "and y_test.npy of the official validation set); accelerators"
            ),
            extra=(
                "ema_decay = 0.99999               # App. C.3, ImageNet\n"
                'normalization = "none"            # see the deviations'
            ),
            deviations=(
                "# Deviations from the published run:\n"
                "# - Batches are Poisson-sampled at q = B/N (expected size B).\n"
                "# - timm's dm_nfnet_f3 is DeepMind's NFNet-F3 architecture; the JFT-4B\n"
                "#   weights are the paper's own and not public (see `needs`).\n"
                "# - Pixels enter in [0, 1]; the paper's pipeline standardised them and\n"
                "#   resized to 1.2× before a random crop. No augmentation (as published).\n"
                "# - n = 1 271 167 (the training set less the paper's 10 000 validation\n"
                "#   images) sets q; with another n the run reports its own ε.\n"
            ),
        )
    files.update(_pretraining())
    return files


def _pretraining() -> dict[str, str]:
    """The public pre-training runs (App. C.4): ImageNet-32 and CIFAR-100."""
    common = (
        'objective = "supervised"\n'
        "momentum = 0.9\n"
        "crop_padding = 4                 # random crops and flips, augmentation multiplicity 1\n"
        "flip = true\n"
        'padding_mode = "symmetric"\n'
        "seed = 0\n"
        "checkpoint_every = 2000\n"
    )
    imagenet = (
        "{citation}"
        "# App. C.4, pre-training on ImageNet-32 (for Tables 5 and 10): {model}, SGD with\n"
        "# momentum 0.9, constant learning rate 0.3, weight decay 5e-5, random crops and\n"
        "# flips, 240 000 iterations of batch 1024. Public data: no privacy cost.\n"
        "#   dpvision pretrain --out {checkpoint} --checkpoint {checkpoint}.ckpt \\\n"
        "#       --config configs/seed003/finetune/{stem}_imagenet32_pretrain.toml\n"
        "# Needs ImageNet-32 (Chrabaszcz et al. 2017) as data/imagenet32.npz (x_train, y_train,\n"
        "# x_test, y_test; 32x32x3 uint8) and an accelerator: days of training on a CPU.\n"
        "# Deviations: pixels in [0, 1] rather than [-1, 1] (normalization = none); dpvision's\n"
        "# WRN (GroupNorm, weight standardisation).\n\n"
        "[pretrain]\n"
        'dataset = "npz:data/imagenet32.npz"\n'
        "num_classes = 1000\n"
        'model = "{model}"\n'
        "groups = 16\n"
        "steps = 240000\n"
        "batch_size = 1024\n"
        "learning_rate = 0.3\n"
        'schedule = "constant"\n'
        "weight_decay = 5e-5\n"
    )
    files = {}
    for stem, model in (("wrn28_10", "wrn-28-10"), ("wrn40_4", "wrn-40-4")):
        files[f"{stem}_imagenet32_pretrain.toml"] = (
            imagenet.format(
                citation=CITATION,
                model=model,
                stem=stem,
                checkpoint=CHECKPOINTS[f"{stem}_imagenet32"],
            )
            + common
        )
    files["wrn40_4_cifar100_pretrain.toml"] = (
        CITATION
        + "# App. B.4 and C.4, pre-training on CIFAR-100 (for Table 11): WRN-40-4, SGD with\n"
        "# momentum 0.9, learning rate 0.1 divided by 10 at 50K and 75K iterations, weight\n"
        "# decay 5e-4, random crops and flips, 100 000 iterations of batch 128. Public data\n"
        "# (for CIFAR-10): no privacy cost.\n"
        f"#   dpvision pretrain --out {CHECKPOINTS['wrn40_4_cifar100']} \\\n"
        "#       --config configs/seed003/finetune/wrn40_4_cifar100_pretrain.toml\n"
        "# Needs CIFAR-100 (the python-version pickles) and an accelerator.\n\n"
        "[pretrain]\n"
        'dataset = "cifar100"\n'
        'model = "wrn-40-4"\n'
        "groups = 16\n"
        "steps = 100000\n"
        "batch_size = 128\n"
        "learning_rate = 0.1\n"
        'schedule = "step"\n'
        "milestones = [0.5, 0.75]\n"
        "weight_decay = 5e-4\n"
        'normalization = "dataset"\n' + common
    )
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is out of date")
    args = parser.parse_args()
    stale = []
    HERE.mkdir(exist_ok=True)
    for name, text in configs().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        raise SystemExit(f"out of date: {', '.join(stale)}")


if __name__ == "__main__":
    main()
