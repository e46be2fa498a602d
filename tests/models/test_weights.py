"""learner.init: weights from state dicts, safetensors, encoders and checkpoints."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dpvision.errors import DPVisionError
from dpvision.models import tanh_cnn
from dpvision.models.weights import load_weights, read_weights


def _pair(classes: int = 10) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    source = tanh_cnn((1, 28, 28), num_classes=classes)
    torch.manual_seed(1)
    return source, tanh_cnn((1, 28, 28), num_classes=10)


@pytest.mark.parametrize("form", ["pt", "safetensors", "nested", "ddp"])
def test_every_form_loads_and_gives_the_same_logits(tmp_path, form):
    source, target = _pair()
    state = source.state_dict()
    if form == "safetensors":
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        path = tmp_path / "w.pt"
        if form == "nested":
            torch.save({"epoch": 3, "state_dict": state}, path)
        elif form == "ddp":
            torch.save({f"module.{k}": v for k, v in state.items()}, path)
        else:
            torch.save(state, path)
    report = load_weights(target, path)
    assert not report.head_replaced
    assert report.loaded == len(state)
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(source(x), target(x))


def test_another_number_of_classes_replaces_the_head_with_zeros_and_says_so(tmp_path):
    source, target = _pair(classes=100)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    report = load_weights(target, tmp_path / "w.pt")
    assert report.head_replaced
    assert report.head_init == "zero"
    assert "classifier head 'classifier.3' starts at zero" in report.message()
    assert not target.classifier[3].weight.any()
    assert not target.classifier[3].bias.any()
    assert torch.equal(target.features[0].weight, source.features[0].weight)
    _, again = _pair(classes=100)
    fresh_head = again.classifier[3].weight.detach().clone()
    assert load_weights(again, tmp_path / "w.pt", "random").head_init == "random"
    assert torch.equal(again.classifier[3].weight, fresh_head)  # the model's own init


@pytest.mark.parametrize("head", ["keep", "auto", "zero", "random"])
def test_a_head_that_fits_is_kept_only_when_asked(tmp_path, head):
    """A file trained on other classes may have a head of the right shape (Fashion-MNIST's
    10 classes for digits): ``zero`` and ``random`` start it fresh all the same."""
    source, target = _pair()
    torch.save(source.state_dict(), tmp_path / "w.pt")
    own = target.classifier[3].weight.detach().clone()
    report = load_weights(target, tmp_path / "w.pt", head)
    kept = head in ("keep", "auto")
    assert report.head_replaced is not kept
    assert report.head_init == {"keep": "file", "auto": "file"}.get(head, head)
    expected = {"zero": torch.zeros_like(own), "random": own}.get(head, source.classifier[3].weight)
    assert torch.equal(target.classifier[3].weight, expected)
    assert torch.equal(target.features[0].weight, source.features[0].weight)


def test_an_rgb_stem_is_summed_to_one_channel(tmp_path):
    torch.manual_seed(0)

    def net(channels: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(channels, 4, 3), nn.Flatten(), nn.Linear(4 * 36, 10))

    rgb, gray = net(3), net(1)
    torch.save(rgb.state_dict(), tmp_path / "w.pt")
    report = load_weights(gray, tmp_path / "w.pt")
    assert report.adapted == ("0.weight",)
    x = torch.rand(2, 1, 8, 8)
    assert torch.allclose(gray(x), rgb(x.expand(-1, 3, -1, -1)), atol=1e-5)


def test_weights_of_another_architecture_are_a_one_line_error(tmp_path):
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 10))
    torch.save(other.state_dict(), tmp_path / "w.pt")
    with pytest.raises(DPVisionError, match="does not fit the model") as error:
        load_weights(tanh_cnn((1, 28, 28), 10), tmp_path / "w.pt")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "absent.pt", "not found"),
        (b"not a torch file", "w.pt", "cannot read"),
        (b"junk", "w.safetensors", "cannot read"),
        (b"x", "w.npy", "neither .safetensors nor a torch file"),
    ],
)
def test_unreadable_files_are_one_line_errors(tmp_path, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DPVisionError, match=message) as error:
        read_weights(path)
    assert "\n" not in str(error.value)


def test_a_file_without_tensors_is_refused(tmp_path):
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "w.pt")
    with pytest.raises(DPVisionError, match="holds no state dict"):
        read_weights(tmp_path / "w.pt")


def test_pickled_code_is_not_run(tmp_path):
    torch.save({"weights": nn.Linear(2, 2)}, tmp_path / "w.pt")  # a pickled module object
    with pytest.raises(DPVisionError, match="pickled code is not run"):
        read_weights(tmp_path / "w.pt")


def test_weights_trained_on_the_protected_dataset_are_refused_under_any_spelling(
    tmp_path, monkeypatch
):
    from dpvision.data.datasets import same_dataset
    from dpvision.models.weights import check_trained_on

    def check(record: dict, dataset: str) -> None:
        check_trained_on(record, dataset, what="w.pt", same=same_dataset)

    with pytest.raises(DPVisionError, match="the dataset this run protects"):
        check({"dataset": "Fashion_MNIST"}, "fashion-mnist")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DPVisionError, match="the dataset this run protects"):
        check({"dataset": "npz:data/x.npz"}, f"npz:{tmp_path}/data/x.npz")
    check({"dataset": "cifar100"}, "cifar10")
    check({"trained_on": "synthetic:dead-leaves-mixed"}, "cifar10")
    check_trained_on(
        {"dataset": "mnist"}, "mnist", what="w", same=same_dataset, allow=True, override="x"
    )


def test_a_public_slice_that_records_no_rows_is_refused():
    """A file from before issue 35 names a slice of a permutation of range(N), whose rows
    moved with N, and records none of them: even a run at its fraction cannot check it."""
    from dpvision.data.datasets import same_dataset
    from dpvision.models.weights import check_trained_on

    record = {"dataset": "mnist", "public_fraction": 0.1}
    override = "learner.init_allow_same_dataset = true"
    with pytest.raises(DPVisionError, match=r"public_fraction = 0\.1\) chosen by an older") as e:
        check_trained_on(record, "mnist", what="w.pt", same=same_dataset, override=override)
    assert "\n" not in str(e.value)
    assert override in str(e.value)
    check_trained_on(record, "mnist", what="w.pt", same=same_dataset, allow=True)
    check_trained_on(record, "cifar10", what="w.pt", same=same_dataset)
