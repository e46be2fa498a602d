"""``--device`` on every command that computes: the same results on ``cpu`` and on ``auto``
(the CPU here), one-line errors for a device that is misspelt or absent, the CUDA side of
the memory checks and of checkpoints, and the on-device input path (run on the CPU).

The GPU itself is exercised by ``tests/gpu`` (marked ``gpu``, skipped without CUDA).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from dpvision.cli import main
from dpvision.data.inputs import LazyInputs, lazy_pixel_inputs
from dpvision.devices import Placement, available_memory
from dpvision.errors import DPVisionError
from dpvision.training.memory import check_memory, memory_error
from dpvision.training.options import DPSGDOptions

COMPUTING = ("train", "audit", "pretrain", "predict", "evaluate")
TIMING = {"wall_seconds", "train_seconds"}


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phase I encoder for digits' 8x8 gray images (synthetic data: public)."""
    path = tmp_path_factory.mktemp("encoder") / "enc.pt"
    code = main(
        [
            "pretrain",
            "-q",
            "--model",
            "mlp-16",
            "--size",
            "8",
            "--channels",
            "1",
            "--steps",
            "3",
            "--batch-size",
            "32",
            "--num-images",
            "64",
            "--device",
            "cpu",
            "--out",
            str(path),
        ]
    )
    assert code == 0
    return path


@pytest.mark.parametrize("command", COMPUTING)
def test_every_computing_command_takes_device(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert "--device DEVICE" in capsys.readouterr().out


@pytest.mark.parametrize("command", COMPUTING)
@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu"])
def test_a_misspelt_device_is_one_line_and_exit_2(command, device, capsys, tmp_path):
    model = tmp_path / "m"
    model.touch()
    extra = {"predict": [str(model), "x"], "evaluate": [str(model)], "pretrain": ["--out", "x"]}
    with pytest.raises(SystemExit) as done:
        main([command, *extra.get(command, []), "--device", device])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "choose auto, cpu, cuda or cuda:N" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--device", "cuda"],
        ["train", "--method", "dp-sgd", "--device", "cuda:0"],
        ["audit", "--device", "cuda", "--json", "OUT/audit.json"],
        ["pretrain", "--device", "cuda", "--out", "OUT/enc.pt", "--steps", "1"],
        ["train", "--set", "device='cuda'"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_cuda_without_cuda_is_one_line_and_exit_2_before_any_work(argv, capsys, tmp_path):
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "sees no CUDA device; use cpu or auto" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_fp16_is_refused_with_the_reason(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--method", "dp-sgd", "--precision", "fp16"])
    assert done.value.code == 2
    assert "dynamic loss scale" in capsys.readouterr().err


def _result(tmp_path: Path, name: str, argv: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["train", "-q", "--json", str(out), *argv]) == 0
    result = json.loads(out.read_text())
    for key in TIMING:
        result.pop(key, None)
    result["config"].pop("device")
    return result


RUNS = {
    "dp-ls": ["--method", "dp-ls"],
    "dp-newton": ["--method", "dp-newton", "--set", "learner.iterations=2"],
    "dp-fc": ["--method", "dp-fc", "--set", "learner.epochs=2"],
    "dp-sgd-linear": ["--method", "dp-sgd-linear", "--set", "learner.epochs=2"],
    "dp-sgd": [
        "--method",
        "dp-sgd",
        "--set",
        "learner.model='mlp-8'",
        "--set",
        "learner.steps=3",
        "--set",
        "learner.augmult=2",
        "--set",
        "learner.ema_decay=0.9",
    ],
    "dp-sgd bf16": [
        "--method",
        "dp-sgd",
        "--precision",
        "bf16",
        "--set",
        "learner.model='wrn-10-1'",
        "--set",
        "learner.steps=2",
        "--set",
        "learner.batch_size=64",
    ],
    "dp-randp": [
        "--method",
        "dp-randp",
        "--set",
        "learner.model='mlp-16'",
        "--set",
        "learner.steps=4",
        "--set",
        "learner.batch_size=64",
    ],
}


# Without a GPU "auto" is the CPU: one method runs by default, all three with -m slow
# (tests/gpu compares CUDA runs with the CPU's on a GPU machine).
@pytest.mark.parametrize(
    "name", [n if n == "dp-sgd" else pytest.param(n, marks=pytest.mark.full) for n in RUNS]
)
def test_cpu_and_auto_give_identical_results(name, tmp_path, encoder):
    argv = list(RUNS[name])
    if name == "dp-randp":
        argv += ["--set", f"learner.encoder='{encoder}'"]
    argv += ["--secret-seed", "3"]  # both runs replay the same secret randomness
    cpu = _result(tmp_path, "cpu", [*argv, "--device", "cpu"])
    auto = _result(tmp_path, "auto", [*argv, "--device", "auto"])
    expected = "cpu" if not torch.cuda.is_available() else auto["device"]
    assert auto.get("device") == expected
    if not torch.cuda.is_available():
        assert cpu == auto
    assert cpu["privacy_ledger"] == auto["privacy_ledger"]


@pytest.mark.parametrize("objective", ["contrastive", "supervised"])
def test_pretrain_on_cpu_and_auto_writes_identical_weights(objective, tmp_path):
    argv = ["pretrain", "-q", "--objective", objective, "--model", "mlp-16", "--steps", "3"]
    if objective == "contrastive":
        argv += ["--size", "8", "--channels", "1", "--batch-size", "32", "--num-images", "64"]
    else:
        argv += ["--dataset", "digits", "--batch-size", "32"]
    files = {}
    for device in ("cpu", "auto"):
        files[device] = tmp_path / f"{device}.pt"
        assert main([*argv, "--device", device, "--out", str(files[device])]) == 0
    if torch.cuda.is_available():
        pytest.skip("auto is CUDA here: compared in tests/gpu")
    first = torch.load(files["cpu"], weights_only=True)
    second = torch.load(files["auto"], weights_only=True)
    states = [first["state_dict"], second["state_dict"]]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_predict_and_evaluate_on_cpu_and_auto_agree(tmp_path, capsys):
    model = tmp_path / "model.safetensors"
    assert main(["train", "-q", "--method", "dp-ls", "--save", str(model)]) == 0
    outputs = {}
    for device in ("cpu", "auto"):
        json_out = tmp_path / f"{device}.json"
        args = ["evaluate", str(model), "--json", str(json_out), "--device", device]
        assert main(args) == 0
        outputs[device] = json.loads(json_out.read_text())["accuracy"]
    assert outputs["cpu"] == outputs["auto"]
    tensors = safetensors.torch.load_file(model)
    assert all(t.device.type == "cpu" for t in tensors.values())  # saved from the CPU


def test_a_checkpoint_of_another_device_kind_is_refused_in_one_line(tmp_path, capsys):
    checkpoint = tmp_path / "run.ckpt"
    argv = [*RUNS["dp-sgd"], "--device", "cpu", "--checkpoint", str(checkpoint)]
    assert main(["train", "-q", *argv]) == 0
    payload = torch.load(checkpoint, weights_only=True)
    assert payload["noise_device"] == "cpu"
    payload["noise_device"] = "cuda"
    torch.save(payload, checkpoint)
    before = checkpoint.read_bytes()
    assert main(["train", "-q", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "noise generator on cuda; resume it with --device cuda" in err
    assert checkpoint.read_bytes() == before


def test_the_memory_check_reads_the_device_it_runs_on(monkeypatch):
    options = DPSGDOptions.from_dict({"physical_batch_size": 4096, "augmult": 16})
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))
    assert available_memory(cuda) == 2**30
    with pytest.raises(DPVisionError, match=r"need 1\.2 GiB of cuda:0") as error:
        check_memory(options, torch.Size((3, 40, 40)), cuda)
    assert "learner.physical_batch_size=1024" in str(error.value)
    check_memory(options, torch.Size((3, 8, 8)), cuda)  # fits: no error


def test_cuda_out_of_memory_becomes_advice():
    options = DPSGDOptions.from_dict({"physical_batch_size": 256})
    advice = memory_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"), options)
    assert isinstance(advice, DPVisionError)
    assert "learner.physical_batch_size=64" in str(advice)
    other = RuntimeError("shape mismatch")
    assert memory_error(other, options) is other


@pytest.mark.parametrize("normalization", ["none", "dataset"])
def test_inputs_made_from_device_resident_uint8_equal_the_host_path(normalization):
    """The accelerator path (uint8 images moved once, converted per batch on the device)
    gives bit-identical inputs; here the 'device' is the CPU."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(20, 8, 8, 3), dtype=np.uint8)
    host = lazy_pixel_inputs(images, "cifar10", normalization)
    resident = LazyInputs(torch.from_numpy(images), host.transforms)
    index = torch.tensor([3, 0, 19, 7])
    assert torch.equal(host[index], resident[index])
    assert torch.equal(host[2:9], resident[2:9])
    assert resident[index].is_contiguous()
    assert resident[index].dtype == torch.float32
    assert host.to(torch.device("cpu")).images is images  # nothing moves on the CPU


def test_placement_names_the_device():
    assert Placement().describe() == "cpu"
    assert Placement(torch.device("cpu"), "bf16").compute_dtype is torch.bfloat16


@pytest.mark.full  # 30 s of inductor's C++ compilation on the CPU
def test_compile_trains_the_same_model_up_to_float_rounding(tmp_path):
    """``learner.compile`` (off by default): the compiled network clips, noises
    and saves like the eager one; only the rounding of the fused kernels differs."""
    argv = [
        "--method",
        "dp-sgd",
        "--device",
        "cpu",
        "--set",
        "learner.model='mlp-8'",
        "--set",
        "learner.steps=2",
        "--set",
        "learner.batch_size=64",
        "--set",
        "learner.ema_decay=0.9",
        "--set",
        "learner.physical_batch_size=32",
    ]
    saved = {}
    results = {}
    for compiled in (False, True):
        saved[compiled] = tmp_path / f"{compiled}.safetensors"
        flags = ["--set", f"learner.compile={str(compiled).lower()}"]
        results[compiled] = _result(
            tmp_path, str(compiled), [*argv, *flags, "--save", str(saved[compiled])]
        )
    assert results[False]["privacy_ledger"] == results[True]["privacy_ledger"]
    eager = safetensors.torch.load_file(saved[False])
    compiled = safetensors.torch.load_file(saved[True])
    assert eager.keys() == compiled.keys()
    gap = max((eager[k].double() - compiled[k].double()).abs().max().item() for k in eager)
    assert gap < 1e-4
    assert abs(results[False]["test_accuracy"] - results[True]["test_accuracy"]) <= 0.01
