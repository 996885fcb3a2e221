"""offload.hf's version policy (offload/hf/versions.py): older than the lowest supported or a
release known to break refuses, naming the fix; newer than the tested range warns once and
runs; the test dependencies install exactly the supported range."""
import os
import re
import warnings

import pytest

from offload.hf import versions
from _paths import ROOT

pytestmark = pytest.mark.hf_versions


@pytest.fixture
def have(monkeypatch):
    """have(name=version, ...): what versions.installed reports."""
    monkeypatch.delenv("OFFLOAD_HF_UNTESTED", raising=False)
    monkeypatch.setattr(versions, "_warned", set())
    found = {}
    monkeypatch.setattr(versions, "installed", lambda name: found.get(name))
    return lambda **kw: found.update(kw)


def test_older_than_the_lowest_supported_refuses(have):
    have(transformers="5.23.2")
    with pytest.raises(versions.VersionError, match=r"supports transformers>=5\.24\.0 \(tested with transformers "
                                                    r"5\.24\.0 to 5\.25\.x\), found 5\.23\.2: pip install -U "
                                                    r"'transformers>=5\.24\.0,<5\.26'"):
        versions.check("transformers")
    have(transformers="5.24.0rc1")                      # a pre-release of the lowest is older than it
    with pytest.raises(versions.VersionError, match="found 5.24.0rc1"):
        versions.check("transformers")


def test_newer_than_the_tested_range_warns_once_and_runs(have):
    have(transformers="5.26.1", peft="0.21.2")
    with pytest.warns(versions.UntestedVersionWarning, match=r"tested with transformers 5\.24\.0 to 5\.25\.x; "
                                                            r"found transformers 5\.26\.1, newer: running anyway"):
        versions.check("transformers", "peft")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check("transformers")                  # once per process
        have(transformers="5.25.3")
        versions.check("transformers", "peft")          # inside the tested range: silent


def test_known_broken_release_and_missing_package_refuse(have, monkeypatch):
    monkeypatch.setitem(versions.BROKEN, "accelerate", {"1.15.1": "its prepare() drops the optimizer"})
    have(accelerate="1.15.1")
    with pytest.raises(versions.VersionError, match=r"accelerate 1\.15\.1 is known to break offload\.hf \(its "
                                                    r"prepare\(\) drops the optimizer\): pip install "
                                                    r"'accelerate>=1\.15\.0,<1\.17'"):
        versions.check("accelerate")
    with pytest.raises(versions.VersionError, match=r"offload.hf needs trl: pip install 'trl>=1\.16\.0,<1\.17'"):
        versions.check("trl")


def test_untested_variable_skips_the_check(have, monkeypatch):
    have(transformers="4.40.0")
    monkeypatch.setenv("OFFLOAD_HF_UNTESTED", "1")
    versions.check("transformers")


def test_test_dependencies_install_the_supported_range():
    """pyproject's test extras allow exactly versions.TESTED's range for each package, so that
    `make test` on a fresh machine installs the newest release offload.hf is tested with (an
    unpinned accelerate once came in one release past the tested range)."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    extras = re.search(r"^test = \[(.*)\]", text, re.M).group(1)
    bounds = dict(re.findall(r'"([a-z]+)(>=[0-9.]+,<[0-9.]+)"', extras))
    assert bounds == {n: versions.requirement(n)[len(n):] for n in versions.TESTED}, (bounds, versions.TESTED)
    assert versions.lowest_requirements().split() == [f"{n}=={lo}" for n, (lo, _) in versions.TESTED.items()]


def test_lowest_run_checks_what_it_runs_against(have):
    """not_lowest() (checked by `make test` before its lowest-versions subset) names each
    package not at its lowest supported release."""
    have(**{n: lo for n, (lo, _) in versions.TESTED.items()})
    assert versions.not_lowest() == []
    have(peft="0.21.2")
    assert versions.not_lowest() == ["peft 0.21.2 (lowest supported: 0.21.0)"]

