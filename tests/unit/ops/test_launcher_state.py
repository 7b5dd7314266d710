"""Run-state files that `omnirail up` writes and `up --detach`/`down`/`ps` read."""

import json
import os
import threading

import pytest

from omnirail.ops import launcher


@pytest.fixture(autouse=True)
def private_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(launcher.tempfile, "tempdir", None)  # gettempdir() reads TMPDIR anew
    monkeypatch.setattr(launcher, "STATE_BASES", ())


def test_a_mesh_started_under_another_runtime_dir_is_found(tmp_path, monkeypatch) -> None:
    """`omnirail status`/`down` from a shell whose XDG_RUNTIME_DIR differs from the one
    that started the mesh (su, ssh): the usual places are read too."""
    started, other = tmp_path / "run-user", tmp_path / "other"
    started.mkdir()
    other.mkdir()
    monkeypatch.setattr(launcher, "STATE_BASES", (str(started),))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(started))
    launcher.write_state("m", {"pid": os.getpid(), "address": "unix:/x"})
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
    assert launcher.read_states() == {"m": {"pid": os.getpid(), "address": "unix:/x"}}
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert list(launcher.read_states()) == ["m"]


def test_a_state_dir_others_may_write_is_not_read(tmp_path, monkeypatch) -> None:
    # A state file names a pid that `down` signals: a directory another user could have
    # made or written is not trusted.
    launcher.write_state("m", {"pid": os.getpid(), "address": "unix:/x"})
    launcher.state_dir().chmod(0o777)
    try:
        assert launcher.read_states() == {}
    finally:
        launcher.state_dir().chmod(0o700)


def test_written_state_is_listed_and_leaves_no_temp_file() -> None:
    launcher.write_state("m", {"pid": os.getpid(), "address": "unix:/x"})
    assert launcher.read_states() == {"m": {"pid": os.getpid(), "address": "unix:/x"}}
    assert [p.name for p in launcher.state_dir().iterdir()] == ["m.json"]


def test_state_of_a_dead_process_is_removed() -> None:
    path = launcher.write_state("gone", {"pid": 2**22 + 12345, "address": "unix:/x"})
    assert launcher.read_states() == {}
    assert not path.exists()


def test_unreadable_state_is_skipped_not_deleted() -> None:
    # A reader racing a writer once saw a half-written file and deleted it, so `up --detach`
    # waited forever for a mesh that was running.
    path = launcher.state_dir() / "half.json"
    path.write_text('{"pid": ')
    assert launcher.read_states() == {}
    assert path.exists()


def test_reader_racing_writer_always_sees_the_state() -> None:
    stop = threading.Event()
    payload = {"pid": os.getpid(), "address": "unix:/" + "x" * 4096}

    def writer() -> None:
        while not stop.is_set():
            launcher.write_state("busy", payload)

    launcher.write_state("busy", payload)
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):
            assert launcher.read_states().get("busy") == payload
    finally:
        stop.set()
        thread.join()
    assert json.loads((launcher.state_dir() / "busy.json").read_text()) == payload
