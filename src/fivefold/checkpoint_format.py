"""The sharded checkpoint format, on disk: tensors stored as rectangular pieces, their safetensors files and the
manifest of checksums. What a checkpoint directory holds and how it is written atomically is `train/checkpoint.py`;
this module is the part that the trainer and the readers of a finished run (`fivefold export`, `fivefold generate`)
share, so it sits in the base layer.

A named global tensor (a plain-model parameter, or one of its AdamW moments) is stored as one or more pieces;
each piece is a rectangle of the global tensor, recorded in an index with the global shape and the piece's
offsets along every dim. A tp slice, an ep rank's experts, a pipeline stage's layers and a ZeRO-3 shard are
rectangles; a ZeRO-1/2 flat slice of a bucket covers a row-major range of each parameter, which
`flat_rects` cuts into at most 2 x ndim rectangles. Any rectangle of any tensor can then be read back from the
pieces that intersect it (`PieceReader.read`), reading only those bytes (`safe_open(...).get_slice`), whatever
layout wrote them.

Files are plain safetensors (`write_safetensors` streams them tensor by tensor, hashing as it writes, so a writer
never holds a second copy of its state, past the page cache where the system allows it: `DirectFile`);
`manifest.json` records the size and sha256 of every other file of a
checkpoint directory (`verify_manifest` checks them). Every file a reader opens is named by a path relative to the
checkpoint directory that stays inside it (`member`: no absolute path, no `..`, no link out) and is listed in the
manifest: an index that points elsewhere is damage. `verify_checkpoint` is the one check of a checkpoint directory,
run by a resuming rank and by `fivefold export` and `generate` alike: what one refuses, the others refuse. So is
`nonfinite`, the check that a checkpoint holds no NaN or infinity (a resume's on the state it loaded, a save's on the
state it would write, export's and generate's on every tensor of the index).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from fivefold.config import file_sha256, shown
from fivefold.pathnames import name_inside

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


class PieceError(Exception):
    """A piece file or index that is missing, damaged or does not cover what is asked of it."""


Rect = tuple[tuple[int, ...], tuple[int, ...], int, int]  # offsets, shape, flat start, flat end


def flat_rects(shape: tuple[int, ...], start: int, end: int) -> list[Rect]:
    """The row-major range [start, end) of a tensor of `shape` as rectangles (offsets, shape, flat start, flat
    end), each contiguous in memory, in order."""
    if start >= end:
        return []
    shape = tuple(shape)
    if len(shape) <= 1:
        return [((start,), (end - start,), start, end)] if shape else [((), (), 0, 1)]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:
        return [((first, *o), (1, *s), lo + first * row, hi + first * row)
                for o, s, lo, hi in flat_rects(shape[1:], start - first * row, end - first * row)]
    out: list[Rect] = []
    if start % row:
        out += flat_rects(shape, start, (first + 1) * row)
        first += 1
    full_end = end // row
    if full_end > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (full_end - first, *shape[1:]), first * row, full_end * row))
    if end % row:
        out += flat_rects(shape, full_end * row, end)
    return out


FINITE_CHUNK = 1 << 18  # elements checked at a time: the check's temporaries stay at a quarter MiB


@torch.no_grad()
def nonfinite(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The positions in `tensors` (on one device) of those that hold a NaN or an infinity; integer tensors are
    finite. Checked a chunk at a time: a mask of a whole tensor (a byte per element, tens of MiB for a large layer)
    would stay in the process's heap and make a save the largest resident memory of the run."""
    floats = [i for i, v in enumerate(tensors) if v.is_floating_point()]
    if not floats:
        return []
    # a finite sum proves every element of a tensor finite (a NaN or an infinity makes any sum NaN or infinite): one
    # read of each tensor without temporaries, and one host read; only a tensor whose sum is not finite (an overflow
    # of large finite values, or a real NaN) is checked element by element
    sums = torch.isfinite(torch.stack([tensors[i].sum().float() for i in floats]))
    if bool(sums.all()):
        return []
    suspects = [i for i, finite in zip(floats, sums.tolist(), strict=True) if not finite]
    flags = []
    for i in suspects:
        ok = torch.ones((), dtype=torch.bool, device=tensors[i].device)
        for chunk in tensors[i].reshape(-1).split(FINITE_CHUNK):
            ok &= torch.isfinite(chunk).all()
        flags.append(ok)
    return [i for i, ok in zip(suspects, torch.stack(flags).tolist(), strict=True) if not ok]


class WriteCancelled(Exception):
    """A write given up between two tensors because its writer asked (`write_safetensors`' `cancelled`)."""


def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None, cancelled=None, read=None) -> str:
    """Write `tensors` as a safetensors file, one tensor at a time (each copied to the CPU alone), fsync it and
    return its sha256. The file gets the mode the umask gives (safetensors' own `save_file` makes it 0600).
    `cancelled()`, asked before each tensor, gives the write up (WriteCancelled) when true; `read()` is called once
    every tensor's bytes are written, before the flush and fsync (the tensors are not read after it)."""
    return stream_safetensors(path, [LazyTensor(name, t.dtype, tuple(t.shape), lambda t=t: t) for name, t in tensors],
                              metadata, cancelled, read)


@dataclass(frozen=True)
class LazyTensor:
    """A tensor to write, described by its name, dtype and shape, and produced only when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def stream_safetensors(path: Path, tensors: list[LazyTensor], metadata: dict[str, str] | None = None,
                       cancelled: Callable[[], bool] | None = None, read: Callable[[], None] | None = None) -> str:
    """Write a safetensors file whose header comes from the descriptions, then each tensor's bytes as it is produced
    (one at a time, dropped once written: the writer holds one tensor), fsync it and return its sha256. A produced
    tensor of another dtype or shape than its description is a ValueError; `cancelled()`, asked before each tensor,
    gives the write up (WriteCancelled) when true; `read()` is called once every tensor's bytes are written (handed
    to the file, which keeps its own copy), before the flush and the fsync."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    with DirectFile(path) as f:
        head = struct.pack("<Q", len(raw)) + raw
        digest.update(head)
        f.write(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        for t in tensors:
            if cancelled is not None and cancelled():
                raise WriteCancelled(str(path))
            value = t.produce()
            if value.dtype != t.dtype or tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"tensor {t.name} was described as {t.dtype} {list(t.shape)} but is {value.dtype} "
                                 f"{list(value.shape)}")
            data = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            digest.update(data.numpy())
            f.write(data)
            del value, data
        f.finish()
        if read is not None:
            read()
        f.sync()
    return digest.hexdigest()


REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)  # how a file system says that it does not do O_DIRECT
# set to 0 (or false, no, off) to write checkpoints through the page cache: a file system that takes O_DIRECT but
# serves it slowly
DIRECT_IO_ENV = "FIVEFOLD_CHECKPOINT_DIRECT_IO"


def direct_io_wanted() -> bool:
    """Whether checkpoint files are written with O_DIRECT: where the system has it, unless `DIRECT_IO_ENV` says no."""
    off = os.environ.get(DIRECT_IO_ENV, "").strip().lower() in ("0", "false", "no", "off")
    return hasattr(os, "O_DIRECT") and not off


class DirectFile:
    """A file written past the page cache where the system allows it (Linux's O_DIRECT): bytes are copied into a
    page-aligned buffer and written from it in whole blocks, straight to the device, so that the kernel neither
    copies them again nor writes them back later (a 2-core machine spent about 1.3 core-seconds per GB of buffered
    writes in the kernel, taken from training, against about 0.3 this way; docs/benchmarks.md). The last block is
    written padded, and the file then cut to its length. Where the file system refuses O_DIRECT (tmpfs, some
    network file systems), or where `FIVEFOLD_CHECKPOINT_DIRECT_IO=0` says so, the same calls write through the
    page cache. `finish()` writes what the buffer holds (the bytes are then in the file), `sync()` makes the file
    durable (fsync)."""

    BLOCK = 4096  # the alignment O_DIRECT asks of buffers, offsets and lengths on common devices
    CHUNK = 8 * 2**20

    def __init__(self, path: Path) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = direct_io_wanted()
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o666)
        except OSError as e:
            if not self.direct or e.errno not in REFUSED:
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o666)
        self.buf = mmap.mmap(-1, self.CHUNK)  # page-aligned, as O_DIRECT needs
        self.staged = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.fill = self.size = 0

    def write(self, data: torch.Tensor) -> None:
        """Append the bytes of a 1-d uint8 CPU tensor (copied into the buffer: the caller may change the tensor once
        this returns)."""
        at, n = 0, data.numel()
        while at < n:
            take = min(n - at, self.CHUNK - self.fill)
            self.staged[self.fill:self.fill + take].copy_(data[at:at + take])
            self.fill += take
            self.size += take
            at += take
            if self.fill == self.CHUNK:
                self._write_buffer(self.CHUNK)

    def _write_buffer(self, length: int) -> None:
        """Write the buffer's first `length` bytes (a whole number of blocks under O_DIRECT) and empty it."""
        with memoryview(self.buf)[:length] as view:
            done = 0
            while done < length:
                try:
                    done += os.write(self.fd, view[done:])
                except OSError as e:
                    if not (self.direct and e.errno in REFUSED and done == 0):
                        raise
                    self._buffered()  # the file system took the open but not the write
        self.fill = 0

    def _buffered(self) -> None:
        import fcntl

        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def finish(self) -> None:
        """Write the buffered tail: padded to a whole block under O_DIRECT, then the file cut to its length."""
        tail = self.fill
        if tail:
            padded = -(-tail // self.BLOCK) * self.BLOCK if self.direct else tail
            self.staged[tail:padded].zero_()
            self._write_buffer(padded)
            if padded != tail:
                os.ftruncate(self.fd, self.size)

    def sync(self) -> None:
        os.fsync(self.fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
        del self.staged
        try:
            self.buf.close()
        except BufferError:  # a view of it is still held (by an error's traceback): freed with that view
            pass


class TensorReader(Protocol):
    """Reads rectangles of named global tensors, only their bytes: a checkpoint's pieces (`PieceReader`), a Hugging
    Face directory's tensors (`models.hf.HfSliceReader`). What `Engine.load_state_pieces` loads from."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor: ...


class PieceReader:
    """Reads rectangles of named global tensors from the pieces of an index:
    `{name: {"shape": [...], "pieces": [{"file", "key", "offsets", "shape"}, ...]}}` (files relative to `root`).
    `opened(path)` is called once before a file is first read (a checksum check)."""

    def __init__(self, root: Path, index: dict[str, dict[str, Any]], opened=None) -> None:
        self.root, self.index, self.opened = root, index, opened
        self._files: dict[str, Any] = {}
        self._checked: set[str] = set()

    def names(self) -> list[str]:
        return list(self.index)

    def close(self) -> None:
        """Let go of the files opened so far (their mapped pages leave this process's resident memory); a later
        read opens them again (`opened` is not called again)."""
        self._files.clear()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of global tensor `name`, as its first piece's header records it."""
        piece = self.index[name]["pieces"][0]
        try:
            code = self._file(piece["file"]).get_slice(piece["key"]).get_dtype()
        except PieceError:
            raise
        except Exception as e:
            raise PieceError(f"checkpoint file {self.root / piece['file']} is corrupted or unreadable: {e}") from None
        found = [dtype for dtype, written in _DTYPES.items() if written == code]
        if not found:
            raise PieceError(f"checkpoint file {self.root / piece['file']} holds {shown(name)} as {shown(code)}, "
                             f"not one of the dtypes fivefold writes ({', '.join(_DTYPES.values())})")
        return found[0]

    def _file(self, name: str) -> Any:
        if name not in self._files:
            from safetensors import safe_open

            path = member(self.root, name)
            if self.opened is not None and name not in self._checked:
                self.opened(name)
            self._checked.add(name)
            try:
                self._files[name] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type for damaged files
                raise PieceError(f"checkpoint file {self.root / name} is corrupted or unreadable: {e}") from None
        return self._files[name]

    def read(self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rectangle at `offsets` of `shape` (default: all) of global tensor `name`, from every piece that
        intersects it; a PieceError when the pieces do not cover it."""
        if name not in self.index:
            raise PieceError(f"the checkpoint has no tensor {shown(name)}")
        full = self.shape(name)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(full)
        shape = tuple(shape) if shape is not None else full
        out: torch.Tensor | None = None
        covered = 0
        for piece in self.index[name]["pieces"]:
            po, ps = piece["offsets"], piece["shape"]
            lo = [max(o, p) for o, p in zip(offsets, po, strict=True)]
            hi = [min(o + s, p + q) for o, s, p, q in zip(offsets, shape, po, ps, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            try:
                part = self._file(piece["file"]).get_slice(piece["key"])[
                    tuple(slice(a - p, b - p) for a, b, p in zip(lo, hi, po, strict=True))]
            except PieceError:
                raise
            except Exception as e:
                raise PieceError(f"checkpoint file {self.root / piece['file']} is corrupted or unreadable: "
                                 f"{e}") from None
            if out is None:
                out = torch.empty(shape, dtype=part.dtype)
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))] = part
            covered += part.numel()
        if covered != math.prod(shape) or out is None:
            raise PieceError(f"the checkpoint's pieces of {shown(name)} cover {covered} of the {math.prod(shape)} "
                             f"elements asked for at {offsets} {shape}")
        return out if dtype is None else out.to(dtype)


MANIFEST = "manifest.json"  # of a checkpoint directory: the size and sha256 of every other file


def member(root: Path, name: object) -> Path:
    """The file `name` of checkpoint directory `root`: a PieceError unless `name` is a relative path without `..`
    that resolves (links followed) inside `root` (`pathnames.name_inside`)."""
    path, why = name_inside(root, name)
    if path is None:
        raise PieceError(f"checkpoint {shown(str(root))} names the file {shown(name)}, which {why}")
    return path


def read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The files a checkpoint directory's manifest lists (relative name -> bytes and sha256)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        listed = manifest["files"]
        if not isinstance(listed, dict) or not all(isinstance(v, dict) for v in listed.values()):
            raise TypeError("'files' is not a table of tables")
    except FileNotFoundError:
        raise PieceError(f"checkpoint file {path / MANIFEST} is missing") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise PieceError(f"checkpoint file {path / MANIFEST} is corrupted: {shown(e)}") from None
    return listed


def hash_file(path: Path) -> str:
    """The sha256 of a checkpoint file, for its check against the manifest (every check hashes through here)."""
    return file_sha256(path)


def verify_manifest(path: Path, names: list[str] | None = None, checksums: bool = True,
                    listed: dict[str, dict[str, Any]] | None = None) -> None:
    """Check the files `names` (default: every file the manifest lists) of a checkpoint directory against its
    manifest (`listed`: the manifest's files, already read): each must be a path inside the directory (`member`),
    listed, present, and of the recorded size and (with `checksums`) sha256. Raises a PieceError naming the first
    file that is not."""
    listed = read_manifest(path) if listed is None else listed
    for name in listed if names is None else names:
        f = member(path, name)
        if name not in listed:
            raise PieceError(f"checkpoint file {f} is not in the manifest, so it cannot be verified")
        if not f.is_file():
            raise PieceError(f"checkpoint file {f} is missing")
        size, want = f.stat().st_size, listed[name].get("sha256")
        if size != listed[name].get("bytes"):
            raise PieceError(f"checkpoint file {f} is corrupted: {size} bytes, the manifest says "
                             f"{shown(listed[name].get('bytes'))} (an incomplete copy?)")
        if not checksums:
            continue
        got = hash_file(f)
        if got != want:
            raise PieceError(f"checkpoint file {f} is corrupted: its sha256 is {got[:16]}..., the manifest "
                             f"says {str(want)[:16]}...")


def verify_config(checkpoint: Path) -> None:
    """Check a checkpoint directory's config.toml against its manifest (size and sha256), where it has one, before
    anything parses it: a damaged file is reported as corrupted, naming it, rather than as an invalid config.
    Raises PieceError."""
    if (checkpoint / MANIFEST).is_file():
        verify_manifest(checkpoint, ["config.toml"])


def merge_index(part: dict[str, Any], index: dict[str, dict[str, Any]]) -> None:
    """Add the pieces of one `rankN.json` to `index` (name -> global shape and pieces); a malformed part raises
    KeyError, TypeError or ValueError."""
    for p in part["pieces"]:
        entry = index.setdefault(str(p["name"]), {"shape": [int(d) for d in p["shape"]], "pieces": []})
        entry["pieces"].append({"file": part["file"], "key": str(p["key"]), "offsets": [int(o) for o in p["offsets"]],
                                "shape": [int(d) for d in p["piece_shape"]]})


GLOBAL_INDEX = "index.json"  # of a checkpoint directory: every rank's pieces, merged at save (`global_index`)


def global_index(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint's one index, from every rank's part (`rankN.json`, each read once, by the writer that finishes
    the checkpoint): {"tensors": name -> global shape and pieces, "steps": AdamW's step of each parameter}. A reader
    opens it alone, not one part per rank."""
    tensors: dict[str, dict[str, Any]] = {}
    steps: dict[str, float] = {}
    for part in parts:
        merge_index(part, tensors)
        for k, v in part["steps"].items():
            steps[k] = max(steps.get(k, 0.0), float(v))
    return {"tensors": tensors, "steps": steps}


def read_global_index(data: Any) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """(tensors, steps) of a parsed `index.json`, each entry checked for its form; KeyError, TypeError or ValueError
    for a malformed one."""
    tensors: dict[str, dict[str, Any]] = {}
    for name, entry in data["tensors"].items():
        tensors[str(name)] = {"shape": [int(d) for d in entry["shape"]], "pieces": [
            {"file": p["file"], "key": str(p["key"]), "offsets": [int(o) for o in p["offsets"]],
             "shape": [int(d) for d in p["shape"]]} for p in entry["pieces"]]}
    return tensors, {str(k): float(v) for k, v in data["steps"].items()}


FORMAT_VERSION = 3  # 2: manifest.json with the sha256 of every file; 3: sharded pieces
COMPLETE = "COMPLETE"  # of a checkpoint directory: written last, before the rename into place
TRAINER_STATE = "trainer_state.json"


@dataclass
class TrainerState:
    step: int  # optimizer steps completed
    tokens_seen: int
    skipped_steps: int = 0  # steps whose update was skipped for a non-finite loss or gradient norm
    format_version: int = FORMAT_VERSION
    # the learning-rate schedule's phases, (end step, kind) (`train.optim.LrSchedule`); None: one phase to the
    # checkpoint's train.max_steps (checkpoints written before runs could be extended)
    lr_phases: list[tuple[int, str]] | None = None


@dataclass
class VerifiedCheckpoint:
    """A checkpoint directory that passed `verify_checkpoint`, with what it read to check it."""

    path: Path
    state: TrainerState
    world_size: int  # the ranks that wrote it
    data: dict[str, Any]  # the global batch, sequence length, samples consumed (and data fingerprint) it records
    index: dict[str, dict[str, Any]]  # every piece of every tensor
    steps: dict[str, float]  # AdamW's step of each parameter
    listed: dict[str, dict[str, Any]]  # the manifest's files
    piece_files: list[str]
    own_rng: str | None  # this rank's RNG file, verified (when the checkpoint has as many ranks as the reader)


def saved_rank(name: str) -> int:
    """The rank a checkpoint file belongs to (`rank3.json`, `rng-rank3.safetensors`: 3); 0 for a shared file."""
    found = re.fullmatch(r"(?:rng-)?rank(\d+)\.(?:json|safetensors)", name)
    return int(found.group(1)) if found else 0


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PieceError(f"checkpoint file {path} is missing") from None
    except (OSError, ValueError, RecursionError) as e:
        raise PieceError(f"checkpoint file {path} is corrupted: {shown(e)}") from None


LR_PHASE_KINDS = ("schedule", "hold", "decay")  # `train.optim.LrSchedule`'s phases


def check_state_values(state: TrainerState, world_size: int, data: dict[str, int]) -> None:
    """A ValueError naming the first value of a trainer state that no run writes: a negative count, a world, batch or
    sequence length below 1, learning-rate phases that do not end at increasing steps or of an unknown kind (a
    resume would fail inside, or go on from a meaningless position)."""
    counts = {"step": state.step, "tokens_seen": state.tokens_seen, "skipped_steps": state.skipped_steps,
              "samples_consumed": data.get("samples_consumed", 0)}
    for key, value in counts.items():
        if value < 0:
            raise ValueError(f"{key} = {value} is negative")
    for key, value in (("world_size", world_size), ("global_batch_size", data.get("global_batch_size", 1)),
                       ("seq_len", data.get("seq_len", 1))):
        if value < 1:
            raise ValueError(f"{key} = {value} is below 1")
    if state.lr_phases is not None:
        ends = [end for end, _ in state.lr_phases]
        if not ends or ends[0] < 1 or any(b <= a for a, b in zip(ends, ends[1:], strict=False)):
            raise ValueError(f"lr_phases = {shown(state.lr_phases)} must end at increasing steps >= 1")
        for _, kind in state.lr_phases:
            if kind not in LR_PHASE_KINDS:
                raise ValueError(f"lr_phases kind {shown(kind)} is not one of {', '.join(LR_PHASE_KINDS)}")


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1, pieces: bool = False) -> VerifiedCheckpoint:
    """The one check of a checkpoint directory, for rank `rank` of a reader of `world_size` ranks (a resume on
    each rank; `fivefold export` and `generate` as rank 0 of 1): its `COMPLETE` marker, then, each checked against
    the manifest (size and sha256) before it is parsed, the trainer state, the config, the piece index (`index.json`;
    a checkpoint written without one: every saved rank's `rankN.json`) and this rank's RNG file; every piece file
    inside the directory and of its listed size (with `pieces`, its sha256 too; else the reader checks it as it
    opens it); every other file the manifest lists, shared out over the reader's ranks (rank r: the files of saved
    ranks r, r + world_size, ...; one rank alone checks them all). A PieceError names the first file (or the marker)
    that fails."""
    if not (path / COMPLETE).is_file():
        raise PieceError(f"{path} is not a complete checkpoint (no {COMPLETE} marker: its save was interrupted)")
    if (path / TRAINER_STATE).is_file():
        try:
            version = json.loads((path / TRAINER_STATE).read_text()).get("format_version")
        except (OSError, ValueError, AttributeError, RecursionError):
            version = None
        if version is not None and version != FORMAT_VERSION:
            raise PieceError(f"{path} has checkpoint format {version}; this fivefold reads format "
                             f"{FORMAT_VERSION} (sharded pieces with a manifest of checksums)")
    listed = read_manifest(path)
    verify_manifest(path, [TRAINER_STATE], listed=listed)
    meta = _json(path / TRAINER_STATE)
    try:
        state = TrainerState(step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]),
                             skipped_steps=int(meta.get("skipped_steps", 0)),
                             format_version=int(meta["format_version"]),
                             lr_phases=[(int(end), str(kind)) for end, kind in meta["lr_phases"]]
                             if "lr_phases" in meta else None)
        saved_world = int(meta["world_size"])
        data = {k: int(meta[k]) for k in ("global_batch_size", "seq_len", "samples_consumed") if k in meta}
        check_state_values(state, saved_world, data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PieceError(f"checkpoint file {path / TRAINER_STATE} is corrupted: {shown(e)}") from None
    if isinstance(meta.get("data_fingerprint"), str):
        data["data_fingerprint"] = meta["data_fingerprint"]
    indexes = [GLOBAL_INDEX] if GLOBAL_INDEX in listed else [f"rank{r}.json" for r in range(saved_world)]
    own_rng = f"rng-rank{rank}.safetensors" if saved_world == world_size else None
    verify_manifest(path, ["config.toml", *indexes] + ([own_rng] if own_rng else []), listed=listed)
    index: dict[str, dict[str, Any]] = {}
    steps: dict[str, float] = {}
    for name in indexes:
        part = _json(path / name)
        try:
            if name == GLOBAL_INDEX:
                index, steps = read_global_index(part)
                continue
            merge_index(part, index)
            for k, v in part["steps"].items():
                steps[k] = max(steps.get(k, 0.0), float(v))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PieceError(f"checkpoint file {path / name} is corrupted: {shown(e)}") from None
    piece_files = sorted({str(piece["file"]) for entry in index.values() for piece in entry["pieces"]})
    for name in piece_files:  # every piece file a path inside the checkpoint
        member(path, name)
    verify_manifest(path, piece_files, checksums=pieces, listed=listed)
    # every other file the manifest lists (each saved rank's piece index and RNG state, however this reader reads
    # them): a damaged one is refused, not trusted because another file stands in for it
    checked = {TRAINER_STATE, "config.toml", *indexes, *([own_rng] if own_rng else [])}
    verify_manifest(path, [name for name in sorted(set(listed) - set(piece_files) - checked)
                           if saved_rank(name) % world_size == rank], listed=listed)
    return VerifiedCheckpoint(path=path, state=state, world_size=saved_world, data=data, index=index, steps=steps,
                              listed=listed, piece_files=piece_files, own_rng=own_rng)
