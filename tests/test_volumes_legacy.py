"""Volumes made by a node before rows moved to files (``volume.json`` beside the image):
the rows of the node database's old ``volumes`` table are carried over once at start,
so an upgraded node keeps its volumes (no sandbox needed: the rows and names only)."""

from __future__ import annotations

import json
import sqlite3
import stat

from forkyard.orchestrator.volumes.store import IMAGE_NAME, NAMES, ROW_NAME, Volumes

OLD_SCHEMA = """CREATE TABLE volumes (id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, token TEXT NOT NULL,
                                      size_mb INTEGER NOT NULL, created_at REAL NOT NULL)"""


def _old_node(tmp_path, rows):
    db = tmp_path / "state.db"
    with sqlite3.connect(db) as c:
        c.execute(OLD_SCHEMA)
        c.executemany("INSERT INTO volumes VALUES (?, ?, ?, ?, ?)", rows)
    root = tmp_path / "volumes"
    for vid, *_ in rows:
        (root / vid).mkdir(parents=True)
        (root / vid / IMAGE_NAME).write_bytes(b"")  # the image the old node made
    return db, root


def test_old_rows_are_imported_once_and_privately(tmp_path):
    db, root = _old_node(tmp_path, [("vol1abc", "data", "tok1", 1024, 100.0), ("vol2abc", "other", "tok2", 64, 200.0)])
    vols = Volumes(root, root, max_count=64, size_mb=1024, legacy_db=db)
    got = [(r.id, r.name, r.token, r.size_mb) for r in vols.all()]
    assert got == [("vol1abc", "data", "tok1", 1024), ("vol2abc", "other", "tok2", 64)]
    assert (root / NAMES / "data").read_text() == "vol1abc"
    for vid in ("vol1abc", "vol2abc"):
        assert stat.S_IMODE((root / vid / ROW_NAME).stat().st_mode) == 0o600  # it holds the token
    # A second start imports nothing again: a row changed since is kept as it is.
    row = json.loads((root / "vol1abc" / ROW_NAME).read_text())
    (root / "vol1abc" / ROW_NAME).write_text(json.dumps({**row, "token": "tok1-new"}))
    again = Volumes(root, root, max_count=64, size_mb=1024, legacy_db=db)
    assert next(r for r in again.all() if r.id == "vol1abc").token == "tok1-new"


def test_rows_without_an_image_or_with_bad_names_are_not_imported(tmp_path):
    db, root = _old_node(tmp_path, [("vol1abc", "data", "tok1", 1024, 100.0)])
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO volumes VALUES ('gone123', 'lost', 't', 1, 1.0)")  # its image is gone
        c.execute("INSERT INTO volumes VALUES ('../x', 'esc', 't', 1, 1.0)")
    vols = Volumes(root, root, max_count=64, size_mb=1024, legacy_db=db)
    assert [r.id for r in vols.all()] == ["vol1abc"]
    assert not (tmp_path / "x").exists() and not (root / "gone123").exists()


def test_a_database_without_the_old_table_is_fine(tmp_path):
    db = tmp_path / "state.db"
    sqlite3.connect(db).close()
    root = tmp_path / "volumes"
    assert Volumes(root, root, max_count=64, size_mb=1024, legacy_db=db).all() == []
