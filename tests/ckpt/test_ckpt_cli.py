"""``omni ckpt ls | inspect | verify``, as a person and a script see them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt.states import engine, shard_state
from slurm_omni.checkpoint import format as fmt
from slurm_omni.cli.main import main


@pytest.fixture
def root(tmp_path: Path) -> Path:
    with engine(tmp_path, keep_last=0) as eng:
        for step in (10, 20, 30):
            eng.save(step, shard_state(step))
    fmt.tmp_dir(tmp_path, 40).mkdir()
    return tmp_path


def omni(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ls_lists_every_step_with_its_status(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = omni("ckpt", "ls", str(root), capsys=capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "STATUS", "SIZE"]
    assert [line.split()[:2] for line in lines[1:]] == [["10", "complete"], ["20", "complete"],
                                                      ["30", "complete"], ["40", "writing"]]
    code, out, _ = omni("ckpt", "ls", "--json", str(root), capsys=capsys)
    data = json.loads(out)
    assert data["latest_complete"] == 30 and [c["status"] for c in data["checkpoints"]][-1] == "writing"


def test_inspect_shows_the_manifest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = omni("ckpt", "inspect", str(root), capsys=capsys)
    assert code == 0 and "step 30" in out and "load order: vision_encoder, projector, text_decoder" in out
    assert "text_decoder/optim" in out
    code, out, _ = omni("ckpt", "inspect", "--json", str(root / "step-20"), capsys=capsys)
    data = json.loads(out)
    assert data["step"] == 20 and data["layout"][0]["stage"] == "main"
    assert data["shards"]["rank-00000"]["state"]["data"] == {"pairs": 60, "text": 100}
    assert set(data["units"]) == {"vision_encoder/model", "projector/model", "text_decoder/model",
                                  "text_decoder/optim"}


def test_verify_passes_a_sound_checkpoint_and_fails_a_flipped_byte(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = omni("ckpt", "verify", "--no-progress", str(root), capsys=capsys)
    assert code == 0 and out.startswith(f"{root / 'step-30'}: ok")
    manifest = fmt.read_manifest(root / "step-20")
    piece = manifest.units["projector/model"].tensors["proj.weight"].pieces[0]
    with open(root / "step-20" / "rank-00000.h5", "r+b") as f:
        f.seek(piece.offset)
        first = f.read(1)
        f.seek(piece.offset)
        f.write(bytes([first[0] ^ 1]))
    code, out, err = omni("ckpt", "verify", "--json", str(root / "step-20"), capsys=capsys)
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert report["problems"] == ["projector/model/proj.weight (rank-00000.h5): checksum mismatch"]
    assert err.strip() == f"omni: checkpoint: {root / 'step-20'} failed verification: 1 problem(s)"


def test_an_incomplete_checkpoint_fails_verify(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "step-30" / fmt.MARKER).unlink()
    code, out, _ = omni("ckpt", "verify", str(root / "step-30"), capsys=capsys)
    assert code == 1 and "no COMPLETE marker" in out


def test_ckpt_ls_does_not_import_torch(root: Path) -> None:
    probe = ("import sys; from slurm_omni.cli.main import main; main(['ckpt', 'ls', sys.argv[1]]); "
             "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", probe, str(root)], check=True, capture_output=True)


def _forge(step: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the manifest with ``edit`` and a marker that matches it (what a writer of the folder could do)."""
    data = json.loads((step / fmt.MANIFEST).read_bytes())
    edit(data)
    raw = json.dumps(data).encode()
    (step / fmt.MANIFEST).write_bytes(raw)
    fmt.write_marker(step, data["step"], raw)


def _first_piece(data: dict[str, Any]) -> dict[str, Any]:
    piece: dict[str, Any] = data["units"]["projector/model"]["tensors"]["proj.weight"]["pieces"][0]
    return piece


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/etc/passwd", "rank-00000.h5/../x", "rank-00001.h5",
                                  "sub/rank-00000.h5"])
def test_a_manifest_naming_another_file_fails_verify_and_restore(
        root: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    step = root / "step-30"
    _forge(step, lambda d: d["shards"]["rank-00000"].update(file=name))
    code, out, _ = omni("ckpt", "verify", "--no-progress", str(step), capsys=capsys)
    assert code == 1 and len(out.splitlines()) == 1, out
    assert f"names file {name!r}" in out and "only rank-00000.h5 in the step directory is allowed" in out
    with engine(root) as eng, eng.restore() as r:
        assert r.step == 20


@pytest.mark.parametrize("offset, nbytes", [(-8, 64), (0, -1), (1 << 40, 64), (0, 1 << 40)])
def test_a_piece_outside_its_file_fails_verify_with_one_line(
        root: Path, capsys: pytest.CaptureFixture[str], offset: int, nbytes: int) -> None:
    step = root / "step-30"
    _forge(step, lambda d: _first_piece(d).update(offset=offset, nbytes=nbytes))
    code, out, _ = omni("ckpt", "verify", "--no-progress", str(step), capsys=capsys)
    assert code == 1
    assert f"piece at offset {offset} of {nbytes} bytes in shard 'rank-00000' lies outside its file" in out
    with engine(root) as eng, eng.restore() as r:
        assert r.step == 20


def test_a_symlinked_shard_file_is_not_followed(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = root / "step-30"
    real = root / "elsewhere.h5"
    (step / "rank-00000.h5").rename(real)
    (step / "rank-00000.h5").symlink_to(real)
    code, out, _ = omni("ckpt", "verify", "--no-progress", str(step), capsys=capsys)
    assert code == 1 and "rank-00000.h5: couldn't open" in out
    with engine(root) as eng, eng.restore() as r:
        assert r.step == 20
