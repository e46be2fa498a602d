"""The suite never touches the user's home: the root conftest points HOME and the feature
cache at a scratch folder before anything is collected."""

import os
import subprocess
import sys
from pathlib import Path

from dpvision.data.sources import cache_dir
from dpvision.features import default_cache_dir

REAL_HOME = Path(os.environ["DPVISION_TESTS_REAL_HOME"])
SCRATCH_HOME = Path(os.environ["HOME"])


def test_home_and_caches_are_scratch_folders() -> None:
    assert Path.home() == SCRATCH_HOME != REAL_HOME
    assert SCRATCH_HOME.name.startswith("dpvision-tests-home-")
    assert SCRATCH_HOME in default_cache_dir().parents
    assert SCRATCH_HOME in cache_dir("fashion-mnist").parents


def test_a_command_run_by_a_test_writes_its_cache_under_the_scratch_home(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dpvision", "train", "--features", "pixels:pool=2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=os.environ,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert list(Path(os.environ["DPVISION_CACHE"]).glob("digits-pixels*"))
