"""Checkpoint files written past the page cache (`checkpoint_format.DirectFile`, O_DIRECT where the system has it):
the same bytes as a buffered write, whatever the sizes (chunk boundaries, a padded tail cut back), and the same
files where the file system refuses O_DIRECT at open or at the first write."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fivefold.checkpoint_format as fmt
from fivefold.config import file_sha256


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("small", torch.randn(3, 5, generator=g)),  # header + 60 bytes: a tail shorter than a block
            ("chunky", torch.randn(fmt.DirectFile.CHUNK // 4 + 1001, generator=g)),  # crosses a chunk boundary
            ("ints", torch.arange(7, dtype=torch.int64)), ("empty", torch.zeros(0)),
            ("half", torch.randn(4097, generator=g).to(torch.bfloat16))]


def _buffered_bytes(tmp_path: Path, tensors, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The file as written through the page cache (no O_DIRECT at all)."""
    with monkeypatch.context() as m:
        m.delattr(os, "O_DIRECT", raising=False)
        fmt.write_safetensors(tmp_path / "buffered.safetensors", tensors)
    return (tmp_path / "buffered.safetensors").read_bytes()


def test_direct_write_gives_the_bytes_of_a_buffered_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _tensors()
    sha = fmt.write_safetensors(tmp_path / "x.safetensors", tensors)
    data = (tmp_path / "x.safetensors").read_bytes()
    assert data == _buffered_bytes(tmp_path, tensors, monkeypatch)
    assert sha == hashlib.sha256(data).hexdigest() == file_sha256(tmp_path / "x.safetensors")
    back = load_file(str(tmp_path / "x.safetensors"))  # safetensors' own reader
    assert all(torch.equal(back[name], t) for name, t in tensors)
    header = int.from_bytes(data[:8], "little")
    assert len(data) == 8 + header + sum(t.numel() * t.element_size() for _, t in tensors)  # the tail cut back


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_a_refused_o_direct_falls_back_at_open_and_at_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs refuses O_DIRECT at open (EINVAL); some file systems take the open and refuse the write. Either way the
    file is written through the page cache, with the same bytes."""
    tensors = _tensors()
    expected = _buffered_bytes(tmp_path, tensors, monkeypatch)
    real_open, real_write = os.open, os.write

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *a)

    with monkeypatch.context() as m:
        m.setattr(os, "open", refusing_open)
        fmt.write_safetensors(tmp_path / "open.safetensors", tensors)
    assert (tmp_path / "open.safetensors").read_bytes() == expected

    refused = []

    def refusing_write(fd, data):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    with monkeypatch.context() as m:
        m.setattr(os, "write", refusing_write)
        fmt.write_safetensors(tmp_path / "write.safetensors", tensors)
    assert refused and (tmp_path / "write.safetensors").read_bytes() == expected


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
@pytest.mark.parametrize("value", ["0", "off", "1", ""])
def test_the_environment_switch_turns_o_direct_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   value: str) -> None:
    """`FIVEFOLD_CHECKPOINT_DIRECT_IO=0` (or off) opens no file with O_DIRECT; 1 or unset keeps it."""
    opened = []
    real_open = os.open

    def recording_open(path, flags, *a):
        opened.append(bool(flags & os.O_DIRECT))
        return real_open(path, flags, *a)

    monkeypatch.setenv(fmt.DIRECT_IO_ENV, value)
    monkeypatch.setattr(os, "open", recording_open)
    fmt.write_safetensors(tmp_path / "x.safetensors", _tensors())
    assert opened[0] is (value in ("1", ""))  # (a file system that refuses it is then opened again without)
    assert any(opened) is (value in ("1", ""))
    assert {k: v.shape for k, v in load_file(str(tmp_path / "x.safetensors")).items()} == \
        {k: v.shape for k, v in _tensors()}


def test_a_write_error_other_than_einval_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk is not a reason to try again another way: the error reaches the caller (the checkpoint's one
    line), naming no fallback."""

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as e:
        fmt.write_safetensors(tmp_path / "x.safetensors", _tensors())
    assert e.value.errno == errno.ENOSPC
