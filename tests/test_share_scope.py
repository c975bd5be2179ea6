"""Issue 21: which restores share their image's pages (``FORKYARD_SHARE_RESTORED_PAGES``).

Units over the setting and the driver's feature probe, with the real runsc build the
node uses (``--share-restored-pages`` is probed by running it). What sandboxes then map
is checked end to end in ``tests/test_forkmem.py``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from forkyard.config import SHARE_ALL, SHARE_FORKS, SHARE_OFF, DEFAULT_RUNSC, GVisorSettings
from forkyard.runtime.gvisor.runsc import SHARE_PAGES_FLAG, probe_features, runsc_supports


@pytest.mark.parametrize("raw, scope", [("", SHARE_FORKS), ("forks", SHARE_FORKS), ("FORKS", SHARE_FORKS),
                                        ("all", SHARE_ALL), ("1", SHARE_ALL), ("off", SHARE_OFF), ("0", SHARE_OFF)])
def test_the_setting_reads_each_spelling(monkeypatch, raw, scope):
    monkeypatch.setenv("FORKYARD_SHARE_RESTORED_PAGES", raw)
    assert GVisorSettings().share_restored_pages == scope


def test_the_default_is_forks(monkeypatch):
    monkeypatch.delenv("FORKYARD_SHARE_RESTORED_PAGES", raising=False)
    assert GVisorSettings().share_restored_pages == SHARE_FORKS


def test_a_bad_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("FORKYARD_SHARE_RESTORED_PAGES", "yes")
    with pytest.raises(ValueError, match=r"FORKYARD_SHARE_RESTORED_PAGES must be one of .*forks.*'yes'"):
        GVisorSettings()


def _runsc() -> str:
    path = shutil.which(os.environ.get("FORKYARD_RUNSC", DEFAULT_RUNSC))
    if not path or not runsc_supports(path, SHARE_PAGES_FLAG):
        pytest.skip("the node's runsc lacks forkyard's patch 0020")
    return path


@pytest.mark.parametrize("scope", [SHARE_FORKS, SHARE_ALL, SHARE_OFF])
def test_what_each_scope_shares(monkeypatch, scope):
    monkeypatch.setenv("FORKYARD_SHARE_RESTORED_PAGES", scope)
    f = probe_features(_runsc(), GVisorSettings(), "none")
    assert f.shares(fork=True) is (scope != SHARE_OFF)  # a fork's children and source
    assert f.shares(fork=False) is (scope == SHARE_ALL)  # resumes, templates, snapshots
    assert f.shares_saved_pages is (scope != SHARE_OFF)


def test_compressed_images_share_nothing_saved(monkeypatch):
    monkeypatch.setenv("FORKYARD_SHARE_RESTORED_PAGES", "forks")
    f = probe_features(_runsc(), GVisorSettings(), "flate-best-speed")
    assert not f.shares_saved_pages  # a compressed image has no pages file to map
