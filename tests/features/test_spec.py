"""FeatureSpec validation and the ``name:key=value,...`` text form."""

from __future__ import annotations

from pathlib import Path

import pytest
from features_testing import isolate_cache

from dpvision.errors import DPVisionError
from dpvision.features import FeatureSpec, format_feature_spec, parse_feature_spec


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own HOME and feature cache under tmp_path."""
    return isolate_cache(tmp_path, monkeypatch)


def test_parse_names_and_defaults():
    assert parse_feature_spec("scatternet") == FeatureSpec("scatternet")
    assert parse_feature_spec(" pixels ") == FeatureSpec("pixels")
    spec = FeatureSpec("scatternet")
    assert (spec.pool, spec.projection_dim, spec.projection_seed, spec.flatten) == (
        1,
        None,
        0,
        True,
    )
    assert (spec.scales, spec.angles, spec.max_order) == (2, 8, 2)


def test_parse_options():
    assert parse_feature_spec("scatternet:pool=2") == FeatureSpec("scatternet", pool=2)
    assert parse_feature_spec("pixels:projection_dim=256,projection_seed=1") == FeatureSpec(
        "pixels", projection_dim=256, projection_seed=1
    )
    assert parse_feature_spec("scatternet:flatten=false, scales=3") == FeatureSpec(
        "scatternet", flatten=False, scales=3
    )
    assert parse_feature_spec("pixels:projection_dim=none") == FeatureSpec("pixels")


@pytest.mark.parametrize(
    "text",
    [
        "scatternet",
        "pixels:pool=4",
        "scatternet:pool=2,flatten=false,angles=6,max_order=1",
        "pixels:projection_dim=256,projection_seed=1",
    ],
)
def test_format_round_trips(text):
    spec = parse_feature_spec(text)
    assert parse_feature_spec(format_feature_spec(spec)) == spec
    assert format_feature_spec(spec) == text


def test_specs_are_hashable_values():
    specs = {parse_feature_spec("scatternet:pool=2"), FeatureSpec("scatternet", pool=2)}
    assert len(specs) == 1
    with pytest.raises(AttributeError):
        FeatureSpec("pixels").pool = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("resnet", "choose one of: pixels, scatternet"),
        ("", "choose one of: pixels, scatternet"),
        ("scatternet:poll=2", "key one of: pool, projection_dim"),
        ("scatternet:pool", "write key=value"),
        ("scatternet:pool=two", "pool must be an integer"),
        ("scatternet:pool=0", "pool must be >= 1"),
        ("scatternet:pool=2,pool=3", "given twice"),
        ("pixels:projection_dim=0", "projection_dim must be >= 1"),
        ("pixels:projection_seed=-1", "projection_seed must be >= 0"),
        ("scatternet:flatten=maybe", "flatten must be true or false"),
        ("scatternet:max_order=3", "max_order must be in [1, 2]"),
        ("scatternet:projection_dim=8,flatten=false", "needs flatten=True"),
        ("pixels:scales=3", "applies to scatternet features only"),
    ],
)
def test_parse_errors_are_one_line(text, fragment):
    with pytest.raises(DPVisionError) as error:
        parse_feature_spec(text)
    message = str(error.value)
    assert fragment in message
    assert "\n" not in message


def test_direct_construction_is_validated():
    with pytest.raises(DPVisionError, match="choose one of"):
        FeatureSpec("hog")
    with pytest.raises(DPVisionError, match="pool must be an integer"):
        FeatureSpec("pixels", pool=1.5)  # type: ignore[arg-type]
    with pytest.raises(DPVisionError, match="flatten must be true or false"):
        FeatureSpec("pixels", flatten=1)  # type: ignore[arg-type]
