"""The run's config and tokenizer are authenticated like its checkpoints
(rollart/storage/run_files.py): whoever can write the store but does not hold the owner's key
cannot change what a resume or an evaluation rebuilds the run from. Each refusal is one line
naming the file, before anything starts or is rolled back.

The victim is the in-process loop (`run_local`), 1 iteration with a checkpoint; each test
attacks a copy of its store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.config import StorageConfig
from rollart.runner.local_loop import run_local
from rollart.storage.integrity import digests, sign
from rollart.storage.resume import stored_run_config
from rollart.storage.run_files import (
    RUN_DOMAIN,
    RUN_FILES,
    RunFilesRefused,
    covered_names,
    verify_run_files,
)
from rollart.storage.store import RunStore
from tests.security.owner_run import (
    ATTACKER_KEY,
    RUN,
    become_owner,
    copy_of_store,
    owners_config,
    owners_run,
)


@pytest.fixture(autouse=True)
def owner(monkeypatch, tmp_path):
    become_owner(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    root = tmp_path_factory.mktemp("victim")
    owners_run(root, 1)
    return root


@pytest.fixture
def store(victim, tmp_path) -> RunStore:
    return copy_of_store(victim, tmp_path)


def _recomputed(store: RunStore, key: str | None) -> None:
    """The attacker's best effort on run-files.json: digests recomputed for the files as they
    now are; the owner's (now stale) MAC kept, or signed with the attacker's own key."""
    listed = json.loads(store.read_text(RUN_FILES))
    for name in covered_names(store):
        listed["files"][name] = digests(store.read_bytes(name))
    if key:
        listed = sign(listed, bytes.fromhex(key), RUN_DOMAIN)
    store.write_text(RUN_FILES, json.dumps(listed))


def _tamper(store: RunStore, attack: str) -> None:
    config = store.read_text("config.yaml")
    evil = config.replace("backend: local", "backend: lambda")
    assert evil != config
    if attack == "config changed":
        store.write_text("config.yaml", evil)
    elif attack == "tokenizer changed":
        name = next(n for n in covered_names(store) if n.endswith("tokenizer.json"))
        store.write_bytes(name, store.read_bytes(name).replace(b'"<', b'"<x', 1))
    elif attack == "file added":
        store.write_text("tokenizer/extra_template.jinja", "{{ messages }}")
    elif attack == "file removed":
        store.delete(next(n for n in covered_names(store) if n.startswith("tokenizer/")))
    elif attack in ("digests recomputed", "attacker's key"):
        store.write_text("config.yaml", evil)
        _recomputed(store, ATTACKER_KEY if attack == "attacker's key" else None)
    elif attack == "list removed":
        store.write_text("config.yaml", evil)
        store.delete(RUN_FILES)
    else:
        raise AssertionError(attack)


ATTACKS = {
    "config changed": "config.yaml does not match its SHA-256 in run-files.json",
    "tokenizer changed": "tokenizer/tokenizer.json does not match its SHA-256",
    "file added": "tokenizer/extra_template.jinja was added after the run signed",
    "file removed": "is missing (the run signed it)",
    "digests recomputed": "run-files.json is not authentic",
    "attacker's key": "run-files.json was signed with another checkpoint key",
    "list removed": "run-files.json is missing",
}


def test_the_owners_run_files_are_signed_and_pass(store):
    assert {"config.yaml", "tokenizer/tokenizer.json"} <= set(covered_names(store))
    assert set(json.loads(store.read_text(RUN_FILES))["files"]) == set(covered_names(store))
    verify_run_files(store)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_tampered_run_is_refused_in_one_line_before_the_resume_starts(store, attack):
    _tamper(store, attack)
    before = sorted(p.name for p in Path(store.root).rglob("*"))
    cfg = owners_config(store.root, 2)
    with pytest.raises(RunFilesRefused) as info:
        run_local(cfg, RUN, resume=True)
    msg = str(info.value)
    assert ATTACKS[attack] in msg and "\n" not in msg and RUN in msg, msg
    assert sorted(p.name for p in Path(store.root).rglob("*")) == before  # nothing rolled back
    # The evaluation path reads the same config: refused the same way.
    with pytest.raises(RunFilesRefused, match="refused"):
        stored_run_config(StorageConfig(root=store.root), RUN)


def test_an_unsigned_run_is_accepted_only_when_the_owner_says_so(store, monkeypatch):
    store.delete(RUN_FILES)  # a run written before its files were signed
    with pytest.raises(RunFilesRefused, match="ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS=1"):
        verify_run_files(store)
    monkeypatch.setenv("ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS", "1")
    verify_run_files(store)  # signs them as they stand
    monkeypatch.delenv("ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS")
    verify_run_files(store)


def test_a_resume_with_new_settings_re_signs_the_config(store):
    cfg = owners_config(store.root, 2, "train.lr=0.002")
    assert run_local(cfg, RUN, resume=True)["resumed_from"] == 1
    assert "lr: 0.002" in store.read_text("config.yaml")
    verify_run_files(store)
