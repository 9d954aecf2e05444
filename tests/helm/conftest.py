"""Fixtures of the Helm chart tests: the chart, loaded once, and every values set rendered once per
session (test_chart.py and test_chart_security.py share them)."""

from __future__ import annotations

import functools

import pytest

import helm_python as helm
import kubernetes_validate
from specdec_chart import CHART, NAMESPACE, RELEASE, VALUE_SETS, Release


@pytest.fixture(scope="session", autouse=True)
def cached_kubernetes_schemas():
    """kubernetes-validate re-reads a 1-2 MB definitions file for every object; read each file once."""
    with pytest.MonkeyPatch.context() as patch:
        utils = getattr(kubernetes_validate, "utils", None)
        if hasattr(utils, "schema_contents"):  # an optimisation only: skipped if the internals change
            patch.setattr(utils, "schema_contents", functools.cache(utils.schema_contents))
        yield


@pytest.fixture(scope="session")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def releases(chart) -> dict[str, Release]:
    return {name: Release(chart.merge_values(values), chart.render(values, name=RELEASE, namespace=NAMESPACE))
            for name, values in VALUE_SETS.items()}
