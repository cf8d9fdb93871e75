"""`--kv-offload` (services/kv_offload.py): its grammar, GiB into blocks of the pipeline as
`pagoda serve` hands it on, and the disk tier's folders of dead processes swept at start."""

from __future__ import annotations

import os

import pytest

from services.kv_offload import GIB, parse_kv_offload
from worker_svc.execution.kv_tier_files import process_folder_name, sweep_dead_folders


def test_sizes_in_gib_or_blocks():
    assert parse_kv_offload("") is None and parse_kv_offload(None) is None
    gib = parse_kv_offload("host:4,disk:/var/kv:64")
    assert (gib.host, gib.disk, gib.disk_path, gib.in_blocks) == (4.0, 64.0, "/var/kv", False)
    blocks = gib.in_blocks_of(GIB // 256)
    assert (blocks.host_blocks, blocks.disk_blocks) == (1024, 16384)
    assert blocks.spec() == "host:1024b,disk:/var/kv:16384b"
    assert parse_kv_offload(blocks.spec()) == blocks
    assert parse_kv_offload("host:0.5").in_blocks_of(GIB // 4).host_blocks == 2
    with pytest.raises(ValueError, match="turned into blocks"):
        _ = gib.host_blocks  # a service given GiB cannot size the tier alike


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("disk:/x:3", "host tier"),
        ("host:x", "not a number"),
        ("host:1,disk:3", "disk:PATH:SIZE"),
        ("host:1b,disk:/a:2", "every size in GiB or every size in blocks"),
        ("host:1.5b", "whole"),
        ("host:1,host:2", "want host"),
        ("host:-1", "positive"),
    ],
)
def test_a_bad_spec_names_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_offload(spec)


def test_a_tier_that_holds_no_block_is_refused():
    with pytest.raises(ValueError, match="host:0.001 GiB holds no block"):
        parse_kv_offload("host:0.001").in_blocks_of(GIB // 100)
    with pytest.raises(ValueError, match="disk:0.001 GiB holds no block"):
        parse_kv_offload("host:1,disk:/x:0.001").in_blocks_of(GIB // 100)


def test_dead_processes_folders_are_swept_and_live_ones_kept(tmp_path):
    mine = tmp_path / process_folder_name(0, 2)
    mine.mkdir()
    (mine / "ab.kv").write_bytes(b"x")
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    dead = tmp_path / f"stage1-of-2-pid{dead_pid}"
    dead.mkdir()
    (dead / "cd.kv").write_bytes(b"x")
    (dead / "ef.kv.tmp").write_bytes(b"x")
    other = tmp_path / "not-a-tier-folder"
    other.mkdir()
    assert sweep_dead_folders(tmp_path) == [dead.name]
    assert mine.is_dir() and (mine / "ab.kv").exists() and other.is_dir() and not dead.exists()
    assert str(os.getpid()) in mine.name
