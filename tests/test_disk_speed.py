"""A node's disk read speed (omlx_node/disk_speed.py): measured past the page cache, once per
device, leaving nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omlx_node import disk_speed


def test_measures_and_leaves_no_probe(tmp_path: Path) -> None:
    speed = disk_speed.measure_disk(tmp_path / "store", size=16 << 20)
    assert speed > 0
    assert list((tmp_path / "store").iterdir()) == []


def test_measured_once_per_device(tmp_path: Path) -> None:
    cache, store = tmp_path / "disk-speed.json", tmp_path / "store"
    store.mkdir()
    first = disk_speed.node_disk_speed(cache, store)
    assert first > 0
    saved = json.loads(cache.read_text())
    assert saved == {str(os.stat(store).st_dev): first}
    cache.write_text(json.dumps({str(os.stat(store).st_dev): 4.25}))  # what a last join kept
    assert disk_speed.node_disk_speed(cache, store) == 4.25
    assert disk_speed.node_disk_speed(cache, store, remeasure=True) != 4.25


def test_an_unwritable_folder_is_a_warning_not_a_failure(tmp_path: Path, caplog) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert disk_speed.node_disk_speed(tmp_path / "c.json", blocked / "store") == 0.0
    assert "could not measure the disk" in caplog.text


def test_a_store_not_made_yet_is_measured_where_it_will_be(tmp_path: Path) -> None:
    # A first join: neither its home nor the store in it exists yet.
    store = tmp_path / "home" / "models"
    assert disk_speed.node_disk_speed(tmp_path / "disk-speed.json", store) > 0
    assert store.is_dir() and list(store.iterdir()) == []
