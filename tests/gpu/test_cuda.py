"""On a CUDA device: every part of a run computes there, close to the CPU, privately.

Each test that takes ``cuda`` (``conftest.py``) runs twice: ``[gpu]`` on the real GPU
(marked ``gpu``, skipped where torch sees no CUDA device: ``pytest -m gpu tests/gpu`` runs
them where a GPU is), and ``[fake-cuda]`` in the default suite, on a fake CUDA device that
computes on the CPU, so the logic of a CUDA run (device resolution and names, checkpoints,
refusals, ledgers, the memory check) is tested on every machine. The tests of the kernels
themselves (rounding, TF32, bf16, ``torch.compile``, NCCL) are marked ``gpu`` alone.

CUDA and CPU results agree up to rounding, not bit for bit (other kernels, another noise
stream); a run resumed on the same GPU is bit-identical.
"""

import json
import os
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the usual PyTorch alias)
from cuda_devices import ON_GPU

from dpvision.cli import build_parser, main
from dpvision.cli.arguments import run_flags
from dpvision.config import resolve
from dpvision.devices import Placement, available_memory, placement
from dpvision.distributed import torchrun_command
from dpvision.models.registry import build_model
from dpvision.per_example import clip_and_sum
from dpvision.runs.train import fit
from dpvision.testing import check_sensitivity, dpsgd_release
from dpvision.training import DPSGDStep

CUDA = torch.device("cuda", 0)  # a name only: the real or the fake device's
gpu = pytest.mark.gpu  # the kernels themselves: the real GPU only (skipped without one)


def _result(tmp_path: Path, name: str, argv: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["train", "-q", "--json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_auto_picks_the_gpu_and_names_it(tmp_path, cuda):
    chosen = placement("auto")
    assert chosen.device == cuda.compute
    assert chosen.describe().startswith("cuda:0 (")
    assert torch.cuda.get_device_name(0) in chosen.describe()
    assert available_memory(CUDA) > 0
    result = _result(tmp_path, "auto", ["--method", "dp-ls"])
    assert result["device"].startswith("cuda:0 (")


def test_dp_sgd_on_cuda_matches_the_cpu_up_to_rounding_and_noise(tmp_path, cuda):
    """With the noise off the runs differ only by rounding; the ledgers are identical."""
    off = [*cuda.dpsgd, "--noise-multiplier", "0"]
    cpu = _result(tmp_path, "cpu", [*off, "--device", "cpu"])
    gpu = _result(tmp_path, "gpu", [*off, "--device", "cuda"])
    assert cpu["device"] == "cpu"
    assert gpu["device"].startswith("cuda:0")
    assert gpu["privacy_ledger"] == cpu["privacy_ledger"]
    assert abs(gpu["test_accuracy"] - cpu["test_accuracy"]) < 0.05
    private = _result(tmp_path, "private", [*cuda.dpsgd, "--device", "cuda", "--epsilon", "3"])
    assert private["epsilon"] <= 3.0
    assert not private["diverged"]


def test_physical_batch_size_does_not_change_a_cuda_run(cuda):
    """The same run in micro-batches of 16 and in one: the same ledger, and the same accuracy
    up to rounding. Both get the same secret randomness (batches and noise): a secret seed
    alone would not do, as it is mixed with the whole config, this memory knob included."""
    results, secret = [], None
    for size in (16, 128):
        argv = [*cuda.dpsgd, "--device", "cuda", "--set", f"learner.physical_batch_size={size}"]
        args = build_parser().parse_args(["train", *argv])
        config = resolve(args.config, run_flags(args), args.set)
        secret = secret or config.secret_randomness()
        results.append(fit(config, quiet=True, secret=secret)[0])
    assert results[0]["privacy_ledger"] == results[1]["privacy_ledger"]
    assert abs(results[0]["test_accuracy"] - results[1]["test_accuracy"]) <= 0.01


def test_a_cuda_run_resumes_bit_identically(tmp_path, cuda, monkeypatch):
    """A run interrupted in its fifth step (Ctrl-C, as the CPU tests of resuming do) and
    resumed from its checkpoint of step 4 ends with the parameters, EMA, ledger, history and
    accuracy of the run that was never interrupted."""
    argv = [*cuda.dpsgd, "--device", "cuda", "--set", "learner.checkpoint_every=2"]
    whole_checkpoint, checkpoint = tmp_path / "whole.ckpt", tmp_path / "run.ckpt"
    whole = _result(tmp_path, "whole", [*argv, "--checkpoint", str(whole_checkpoint)])
    original, calls = DPSGDStep.__call__, []

    def interrupted(self: DPSGDStep, batches):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return original(self, batches)

    monkeypatch.setattr(DPSGDStep, "__call__", interrupted)
    assert main(["train", "-q", *argv, "--checkpoint", str(checkpoint)]) == 130
    monkeypatch.setattr(DPSGDStep, "__call__", original)
    payload = torch.load(checkpoint, weights_only=True)
    assert payload["sampler"]["step"] == 4
    assert payload["noise_device"] == cuda.compute.type  # the generator of the run's device
    resumed = _result(tmp_path, "resumed", [*argv, "--checkpoint", str(checkpoint)])
    assert resumed["history"] == whole["history"]
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    assert resumed["privacy_ledger"] == whole["privacy_ledger"]
    first = torch.load(whole_checkpoint, weights_only=True)
    second = torch.load(checkpoint, weights_only=True)
    for part in ("model", "optimizer"):
        assert first[part].keys() == second[part].keys()
    for name, value in first["model"].items():
        assert torch.equal(value, second["model"][name]), name
    for name, value in first["ema"]["shadow"].items():
        assert torch.equal(value, second["ema"]["shadow"][name]), name
    assert first["ledger"] == second["ledger"]


@gpu
def test_compile_on_cuda_matches_eager_up_to_rounding(tmp_path):
    """``learner.compile``: the same ledger, and the same accuracy up to the rounding of
    the fused kernels, with the noise off so that only rounding separates the runs."""
    off = [*ON_GPU.dpsgd, "--device", "cuda", "--noise-multiplier", "0"]
    eager = _result(tmp_path, "eager", off)
    compiled = _result(tmp_path, "compiled", [*off, "--set", "learner.compile=true"])
    assert compiled["privacy_ledger"] == eager["privacy_ledger"]
    assert abs(compiled["test_accuracy"] - eager["test_accuracy"]) < 0.05


def test_a_cuda_checkpoint_is_refused_on_the_cpu(tmp_path, capsys, cuda):
    """In one line that names the fix, and the checkpoint left as it was."""
    checkpoint = tmp_path / "run.ckpt"
    argv = [*cuda.dpsgd, "--checkpoint", str(checkpoint)]
    _result(tmp_path, "cuda", [*argv, "--device", "cuda"])
    before = checkpoint.read_bytes()
    capsys.readouterr()
    assert main(["train", "-q", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "(differs in: device); resume it with --device cuda," in err
    assert checkpoint.read_bytes() == before


@gpu
@pytest.mark.parametrize("method", ["dp-ls", "dp-newton", "dp-fc", "dp-sgd-linear"])
def test_feature_learners_on_cuda_agree_with_the_cpu_with_the_noise_off(tmp_path, method):
    argv = ["--method", method, "--noise-multiplier", "0", "--set", "learner.chunk_size=300"]
    if method != "dp-ls":
        argv += ["--set", "learner.epochs=2" if method != "dp-newton" else "learner.iterations=2"]
    cpu = _result(tmp_path, "cpu", [*argv, "--device", "cpu"])
    gpu = _result(tmp_path, "gpu", [*argv, "--device", "cuda"])
    assert gpu["privacy_ledger"] == cpu["privacy_ledger"]
    assert abs(gpu["test_accuracy"] - cpu["test_accuracy"]) <= 0.01


@gpu
@pytest.mark.parametrize("shape", [(28, 28, 1), (32, 32, 3)])
def test_scatternet_features_on_cuda_match_the_cpu(shape, tf32):
    """dpvision's transform on CUDA is the CPU's, with TF32 allowed around it or not (its
    low-pass products run in IEEE float32 whatever the user's flags)."""
    from dpvision.features import extract_features, parse_feature_spec

    images = np.random.default_rng(0).integers(0, 256, (16, *shape), dtype=np.uint8)
    spec = parse_feature_spec("scatternet")
    on_cpu = extract_features(images, spec, progress=False, device="cpu")
    on_gpu = extract_features(images, spec, progress=False, device="cuda")
    np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-4, atol=1e-5)


@pytest.fixture(params=[True, False], ids=["tf32", "no-tf32"])
def tf32(request: pytest.FixtureRequest) -> Iterator[bool]:
    """TF32 allowed (a common setting: cuDNN's default) or not, in cuBLAS and cuDNN, through
    torch's legacy flags, which users set; the flags as they were afterwards."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    with warnings.catch_warnings():  # torch >= 2.9 asks for its new API, once per process
        warnings.filterwarnings("ignore", message=".*new API settings to control TF32.*")
        saved = (torch.get_float32_matmul_precision(), matmul.allow_tf32, cudnn.allow_tf32)
        torch.set_float32_matmul_precision("high" if request.param else "highest")
        matmul.allow_tf32 = cudnn.allow_tf32 = request.param
        try:
            yield request.param
        finally:
            torch.set_float32_matmul_precision(saved[0])
            matmul.allow_tf32, cudnn.allow_tf32 = saved[1:]


@gpu
@pytest.mark.parametrize("clipping", ["bookkeeping", "vmap"])
@pytest.mark.parametrize("precision", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_clipping_on_cuda_is_within_c_on_neighbouring_datasets(precision, clipping, tf32):
    """Every release moves by at most C·(1 + 1e-6) (``tolerance``: the relative slack of
    :attr:`~dpvision.testing.SensitivityReport.ok`), whether TF32 is allowed or not: the
    clip arithmetic does not round like TF32 (10 mantissa bits) however torch is set."""
    torch.manual_seed(0)
    model = build_model("wrn-10-1", (3, 16, 16), 10).to(CUDA)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, 3, 16, 16, generator=generator).to(CUDA)
    y = torch.randint(0, 10, (10,), generator=generator).to(CUDA)
    run = dpsgd_release(
        model,
        max_grad_norm=1.0,
        precision=precision,
        physical_batch_size=4,
        grad_sample_mode=clipping,
    )
    report = check_sensitivity(run, (x, y), neighbours=3, scale=1e4, tolerance=1e-6)
    assert report.refusal is None, report.refusal
    assert report.ok, report.summary()
    assert report.max_ratio > 0.99
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    assert flags == (tf32, tf32)  # the release left torch's flags as the user set them


@gpu
def test_bf16_on_cuda_keeps_norms_and_sums_in_float32_close_to_fp32():
    torch.manual_seed(0)
    model = build_model("wrn-10-1", (3, 16, 16), 10).to(CUDA)
    x = torch.randn(32, 3, 16, 16, device=CUDA) * 3
    y = torch.randint(0, 10, (32,), device=CUDA)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target, reduction="none")

    exact = clip_and_sum(model, loss, x, y, max_grad_norm=1.0)
    low = clip_and_sum(model, loss, x, y, max_grad_norm=1.0, precision=torch.bfloat16)
    assert low.norms.dtype == torch.float32
    assert ((low.norms - exact.norms).abs() / exact.norms).max() < 0.05
    summed = float(torch.clamp(exact.norms, max=1.0).sum())
    gap = torch.linalg.vector_norm(
        torch.cat([(low.grads[k] - g).reshape(-1) for k, g in exact.grads.items()])
    )
    assert float(gap) < 0.06 * summed


def test_noise_is_drawn_on_the_device_from_the_checkpointed_generator(cuda):
    chosen = Placement(cuda.compute)
    first = torch.randn(5, device=cuda.compute, generator=chosen.generator(3))
    generator = chosen.generator(3)
    assert generator.device == cuda.compute
    state = generator.get_state()
    again = torch.randn(5, device=cuda.compute, generator=generator)
    generator.set_state(state)
    assert torch.equal(first, again)
    assert torch.equal(torch.randn(5, device=cuda.compute, generator=generator), again)


def test_the_memory_check_reads_cuda_memory(cuda):
    from dpvision.errors import DPVisionError
    from dpvision.training.memory import check_memory
    from dpvision.training.options import DPSGDOptions

    free = available_memory(CUDA)
    assert 0 < free <= torch.cuda.get_device_properties(CUDA).total_memory
    views = 16 * 3 * 32 * 32 * 4  # bytes of one example's 16 views
    options = DPSGDOptions.from_dict({"augmult": 16, "physical_batch_size": free // views + 64})
    with pytest.raises(DPVisionError, match="of cuda:0"):
        check_memory(options, torch.Size((3, 32, 32)), CUDA)
    check_memory(DPSGDOptions.from_dict({"augmult": 16}), torch.Size((3, 32, 32)), CUDA)


def test_pretrain_on_cuda_writes_a_cpu_loadable_encoder(tmp_path, cuda):
    out = tmp_path / "enc.pt"
    argv = ["pretrain", "-q", "--model", "mlp-16", "--size", "8", "--channels", "1"]
    argv += ["--steps", "3", "--batch-size", "32", "--num-images", "64", "--device", "cuda"]
    assert main([*argv, "--out", str(out)]) == 0
    payload = torch.load(out, map_location="cpu", weights_only=True)
    assert all(t.device.type == "cpu" for t in payload["state_dict"].values())


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_two_gpus_under_torchrun_with_nccl_match_one(tmp_path):
    argv = [*ON_GPU.dpsgd, "--device", "cuda", "--noise-multiplier", "1"]
    single = _result(tmp_path, "single", argv)
    out = tmp_path / "two.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = torchrun_command(2, "-m", "dpvision", "train", "-q", "--json", str(out), *argv)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    two = json.loads(out.read_text())
    assert two["world_size"] == 2
    assert two["privacy_ledger"] == single["privacy_ledger"]
    assert abs(two["test_accuracy"] - single["test_accuracy"]) <= 0.02
