"""The whole suite runs in a scratch home: nothing is read from or written to the user's
``~/.cache/dpvision`` (datasets, the feature cache) or anywhere else under ``$HOME``.

Set at import, before any test module is collected, so subprocesses the tests start inherit
it too. ``DPVISION_DATA`` is kept: it is where CI's copy of Fashion-MNIST lives.

Every test also gets torch's thread count back as it found it: a benchmark row run in-process
sets it, and a later test that compares an in-process run with a subprocess (two threads)
would otherwise compare two different orders of float additions. Under pytest-xdist (the
default, ``-n auto``) each worker and the commands it starts use one thread: the workers
are the parallelism, and in-process and subprocess runs still sum in the same order.

``SLOW`` names the long end-to-end and accuracy runs: the default suite deselects them and
``pytest -m slow`` (CI) runs them. None is a release path's neighbouring-dataset test, a
refusal's or an adversary's test; where one of those is long, it stays and a cheaper
variant of it runs by default (docs/development.md, "Test"). Runs of minutes each that CI
leaves out (the documentation's full-size commands, the extended property sweeps) are
marked ``full`` where they are collected and run under ``pytest -m full``.
"""

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# pytest-xdist's workers inherit the controller's environment: they share its scratch home,
# so a feature set one of them extracted is in the others' cache too.
if os.environ.get("DPVISION_TESTS_SCRATCH_HOME"):
    REAL_HOME = Path(os.environ["DPVISION_TESTS_REAL_HOME"])
    SCRATCH_HOME = Path(os.environ["DPVISION_TESTS_SCRATCH_HOME"])
else:
    REAL_HOME = Path.home()
    SCRATCH_HOME = Path(tempfile.mkdtemp(prefix="dpvision-tests-home-"))
    os.environ["DPVISION_TESTS_SCRATCH_HOME"] = str(SCRATCH_HOME)
os.environ["DPVISION_TESTS_REAL_HOME"] = str(REAL_HOME)  # for tests/test_isolation.py
os.environ["HOME"] = str(SCRATCH_HOME)
os.environ["DPVISION_CACHE"] = str(SCRATCH_HOME / ".cache" / "dpvision" / "features")
os.environ.setdefault("MPLCONFIGDIR", str(SCRATCH_HOME / ".config" / "matplotlib"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Node-id prefix: why it is slow (what it checks is plumbing, accuracy or docs, end to end).
SLOW = {
    "tests/test_readme.py::test_readme_command_runs": "the README's commands, end to end",
    "tests/test_examples.py::": "the examples learn digits within their budgets",
    "tests/test_configs_finetune.py::test_config_runs_two_steps_from": "WRN-28-10/40-4 steps",
    "tests/test_configs_finetune.py::test_pretraining_configs_run": "WRN-40-4 pre-training",
    "tests/test_configs_finetune.py::test_the_committed_files": "regenerates every config",
    "tests/test_configs.py::test_config_loads_and_runs_a_few_steps[cifar10_wrn": "WRN steps",
    "tests/test_docs_code.py::test_python_blocks_run[guide/python-api.md]": "docs, training",
    "tests/test_docs_code.py::test_python_blocks_run[tutorials/de-dpsgd.md]": "docs, training",
    "tests/test_docs_code.py::test_python_blocks_run[guide/audit.md]": "docs, an audit",
    "tests/test_docs_code.py::test_shell_blocks_run[guide/privacy-calculator": "docs, PLD grids",
    "tests/test_docs_code.py::test_shell_blocks_run[guide/train.md": "docs, a WRN run",
    "tests/test_docs_code.py::test_shell_blocks_run[tutorials/mehta": "docs, a feature run",
    "tests/audit/test_audit.py::test_honest_mechanisms_stay_below_their_claim[d": "audits",
    "tests/audit/test_audit.py::test_too_little_noise_is_caught[dp-ls": "an audit (dp-sgd's runs)",
    "tests/audit/test_targets.py::test_learner_target_runs_d_prime": "an audit's plumbing",
    "tests/test_progress.py::test_both_audit_phases_show_progress": "an audit's progress lines",
    "tests/test_progress.py::test_cli_audit_progress_reaches": "an audit's progress lines",
    "tests/accounting/test_calibration.py::test_round_trip_rdp_family[classic": "calibrations",
    "tests/accounting/test_calibration.py::test_a_repeated_calibration": "a cache's bookkeeping",
    "tests/training/test_tune.py::test_the_best_candidate_is_found": "the search's utility",
    "tests/training/test_tune.py::test_the_python_entry_point_mirrors": "an API mirror",
    "tests/gpu/test_gpu_check.py::": "the GPU check's report without CUDA",
    "tests/benchmarks/test_dpsgd_speed_smoke.py::": "the benchmarks' plumbing",
    "tests/benchmarks/test_cifar10_rows.py::test_a_projection": "four timed processes",
    "tests/benchmarks/test_small_folders.py::test_dp_sgd_with_only": "accuracy, a CNN run",
    "tests/accounting/test_calibration.py::test_round_trip_pld_grid_corners[10.0": "PLD grids",
    "tests/accounting/test_accountants.py::test_gaussian_le_pld_for_full_batch": "PLD grids",
    "tests/test_device_commands.py::test_a_checkpoint_of_another_device_kind": "devices, CLI",
    "tests/test_saved_models.py::test_cache_list_and_clear": "the cache commands, end to end",
    "tests/test_isolation.py::test_a_command_run_by_a_test_writes": "a command's cache folder",
    "tests/training/test_adaptive_clipping.py::test_cli_adaptive_clipping": "CLI, resume",
    "tests/test_report.py::test_sweep_": "sweeps, end to end",
    "tests/test_opacus_examples.py::": "Opacus's example loops, end to end",
    "tests/test_first_hour.py::test_dpsgd_start_line": "a start line, after a run",
    "tests/models/test_mlp.py::test_dp_sgd_trains_an_mlp_on_digits": "accuracy",
    "tests/test_train_texts.py::test_dpsgd_run_prints": "texts of a run",
    "tests/test_device_commands.py::test_cpu_and_auto_give_identical": "devices, end to end",
    "tests/distributed/test_distributed.py::test_dpsgd_under_torchrun_matches": "torchrun parity",
    "tests/distributed/test_distributed.py::test_dp_ls_under_torchrun_matches": "torchrun parity",
    "tests/distributed/test_distributed.py::test_feature_learners_on_two": "two-process parity",
    "tests/test_saved_models.py::test_a_saved_model_scores_exactly_as_the_run_did": "scores",
    "tests/test_saved_models.py::test_dpsgd_evaluates_on_validation_and": "evaluation plumbing",
    "tests/test_report.py::test_report_tables_plot_and_ledgers": "a report, end to end",
    "tests/training/test_finetuning.py::test_the_issue_contract_commands": "CLI, end to end",
    "tests/training/test_finetuning.py::test_cli_contract": "CLI, end to end",
    "tests/test_docs_code.py::test_python_blocks_run[guide/models.md]": "docs, trainings",
    "tests/test_docs_code.py::test_python_blocks_run[tutorials/mehta": "docs, a feature run",
    "tests/test_docs_code.py::test_python_blocks_run[guide/extending.md]": "docs, trainings",
    "tests/test_configs.py::test_table_13_config_runs_all_three_phases": "three phases",
    "tests/training/test_recipes.py::test_dp_sgd_on_digits_runs_with_a_model": "a recipe's run",
    "tests/audit/test_audit.py::test_phase_one_chooses": "an audit's phase I",
    "tests/audit/test_audit.py::test_cli_audit_prints_json": "an audit, end to end",
}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        marked = item.get_closest_marker("slow") or item.get_closest_marker("full")
        if item.nodeid.startswith(tuple(SLOW)) and not marked:
            item.add_marker(slow)


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phase I encoder for 8x8 gray images like digits' (synthetic data: public)."""
    from dpvision.training.pretrain import pretrain
    from dpvision.training.pretrain_options import PretrainOptions

    path = tmp_path_factory.mktemp("encoder") / "enc.pt"
    options = {"model": "mlp-16", "synthetic": "dead-leaves-mixed", "size": 8, "channels": 1}
    options |= {"num_images": 64, "batch_size": 32, "steps": 3}
    pretrain(PretrainOptions.from_dict(options), path, quiet=True)
    return path
