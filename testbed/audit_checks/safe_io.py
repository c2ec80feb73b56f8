"""The audit's file I/O inside a run folder, shared by :mod:`testbed.audit`, :mod:`testbed.compare` and
:mod:`testbed.replay`: standard library and numpy only, never a path outside the run, never a symlink
followed, never an unpickle.

``safe_relpath`` resolves a manifest path inside the run (refusing absolute paths, ``..``, control
characters and symlinks); ``load_json`` parses strictly (UTF-8, no duplicate keys); ``sha256_file``
hashes a file in blocks; ``container_of`` names the zip and member of an array; ``Containers`` opens
each case's ``.npz`` once with the stdlib's zipfile, checks its layout (``check_zip_layout``: no byte
outside its members) and reads one member bounded by the manifest's nbytes; ``load_npy`` checks an
``.npy`` header before loading with ``allow_pickle=False``. Every problem is an ``AuditError``.
"""

from __future__ import annotations

import collections
import hashlib
import io
import math
import os
import re
import stat
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .common import strict_json

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")

__all__ = ["AuditError", "BadInput", "CONTROL_CHARS", "Containers", "MEMBER_NAME", "NPY_HEADER_MAX", "check_zip_layout",
           "container_of", "load_json", "load_npy", "present_files", "safe_relpath", "sha256_file"]


class AuditError(Exception):
    """A problem that stops the audit of one file or row."""


class BadInput(Exception):
    """A folder a command cannot read as a run (``testbed.compare``, ``testbed.replay``: exit 2)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_json(path: Path):
    """Parse JSON strictly: UTF-8, no duplicate keys (two readers could see two different values).

    Raises ``AuditError`` for anything that is not such a document (including absurd nesting)."""
    try:
        return strict_json(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise AuditError(f"not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def safe_relpath(root: Path, rel: str) -> Path:
    """Resolve ``rel`` inside ``root`` without following any symlink; refuse anything else.

    Only ``os.lstat`` is called on the components below ``root``, and only after the text of
    ``rel`` has been checked, so nothing outside the run is ever touched."""
    if not isinstance(rel, str) or not rel:
        raise AuditError(f"path {rel!r} is not a non-empty string")
    if rel.startswith(("/", "\\", "~")) or (len(rel) > 1 and rel[1] == ":"):
        raise AuditError(f"path {rel!r} is absolute; refused")
    if CONTROL_CHARS.search(rel):
        raise AuditError(f"path {rel!r} contains control characters; refused")
    parts = rel.split("/")
    if any(p in ("..", ".", "") for p in parts) or "\\" in rel:
        raise AuditError(f"path {rel!r} leaves the run folder (or is not normalized); refused")
    cur = root
    for part in parts:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except (FileNotFoundError, NotADirectoryError):
            raise AuditError(f"{rel}: missing") from None
        except (OSError, ValueError) as e:
            raise AuditError(f"{rel}: cannot be examined ({e})") from None
        if stat.S_ISLNK(st.st_mode):
            raise AuditError(f"{rel}: is a symlink; refused")
    if not stat.S_ISREG(st.st_mode):
        raise AuditError(f"{rel}: not a regular file")
    return cur


def present_files(root: Path) -> tuple[set[str], list[str]]:
    files, links = set(), []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in list(dirnames) + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                links.append(rel)
            elif name in filenames:
                files.add(rel)
    return files, links


def container_of(rel: str) -> tuple[str, str]:
    """``(container, member)``: array ``arrays/S/C/NAME.npy`` is member ``NAME.npy`` of ``arrays/S/C.npz``."""
    head, _, member = rel.rpartition("/")
    return head + ".npz", member


MEMBER_NAME = re.compile(r"[^/\\\x00-\x1f]+\.npy")
NPY_HEADER_MAX = 1 << 17  # a .npy header is at most 65,535 bytes + its preamble (format 1.0) or ~4 GB (2.0): bounded here


class Containers:
    """The per-case array containers of one run, each opened once, read with the stdlib's zipfile.

    ``members(container)`` lists its member names (a container that is not a zip, names a member
    twice or holds an encrypted member is an `AuditError`); ``load(rel, entry)`` reads one member,
    bounded by the manifest's nbytes before anything is decompressed, checks its SHA-256 and loads
    it with `load_npy`."""

    def __init__(self, root: Path):
        self.root = root
        self._open: dict[str, zipfile.ZipFile | AuditError] = {}

    def _zip(self, container: str) -> zipfile.ZipFile:
        got = self._open.get(container)
        if got is None:
            try:
                path = safe_relpath(self.root, container)
                try:
                    zf = zipfile.ZipFile(path)
                except Exception as e:  # noqa: BLE001 - any malformed zip is a FAIL line (NotImplementedError too)
                    raise AuditError(f"{container}: not a readable zip ({type(e).__name__}: {str(e)[:200]})") from None
                names = [i.filename for i in zf.infolist()]
                dup = sorted(n for n, c in collections.Counter(names).items() if c > 1)
                if dup:
                    raise AuditError(f"{container}: member {dup[0]!r} stored twice (which one is the array?)")
                bad = [i.filename for i in zf.infolist() if i.flag_bits & 0x1 or i.compress_type not in
                       (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)]
                if bad:
                    raise AuditError(f"{container}: member {bad[0]!r} is encrypted or not stored/deflated; refused")
                check_zip_layout(path, zf, container)
                got = zf
            except AuditError as e:
                got = e
            self._open[container] = got
        if isinstance(got, AuditError):
            raise got
        return got

    def members(self, container: str) -> list[str]:
        return [i.filename for i in self._zip(container).infolist()]

    def read(self, rel: str, entry: dict) -> bytes:
        container, member = container_of(rel)
        zf = self._zip(container)
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise AuditError(f"{rel}: missing (no member {member} in {container})") from None
        nbytes = entry.get("nbytes") if isinstance(entry, dict) else None
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise AuditError(f"{rel}: manifest records nbytes {nbytes!r}; not read")
        limit = nbytes + NPY_HEADER_MAX
        if info.file_size > limit:
            raise AuditError(f"{rel}: member declares {info.file_size} bytes, more than an .npy of {nbytes} data "
                             "bytes can hold; not decompressed")
        try:
            with zf.open(info) as f:
                data = f.read(limit + 1)
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError) as e:
            raise AuditError(f"{rel}: member cannot be read from {container} ({str(e)[:200]})") from None
        if len(data) > limit:
            raise AuditError(f"{rel}: member holds more than an .npy of {nbytes} data bytes can; not loaded")
        return data

    def load(self, rel: str, entry: dict, *, check_sha: bool = True) -> np.ndarray:
        """The array, its bytes checked against the manifest's sha256 (``check_sha=False``: only its
        header, size and nbytes, for `compare`, which reports what differs, not whether a run is intact)."""
        data = self.read(rel, entry)
        if not isinstance(entry, dict):
            raise AuditError("manifest entry is not an object")
        if check_sha and hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise AuditError("sha256 differs from the manifest")
        return load_npy(data, rel, entry)

    def close(self) -> None:
        for zf in self._open.values():
            if isinstance(zf, zipfile.ZipFile):
                zf.close()
        self._open.clear()


def check_zip_layout(path: Path, zf: zipfile.ZipFile, container: str) -> None:
    """The zip holds its members and nothing else: local entries back to back from byte 0, the
    central directory right after them, no comment, no data descriptors and no zip64 (what
    `ArrayStore` writes). Its bytes are not hashed (they depend on the zlib that deflated them), so
    this is what keeps bytes no member accounts for out of a run."""
    infos = sorted(zf.infolist(), key=lambda i: i.header_offset)
    if zf.comment:
        raise AuditError(f"{container}: the zip carries a comment ({len(zf.comment)} bytes); refused")
    at, central = 0, 0
    with open(path, "rb") as f:
        for info in infos:
            if info.flag_bits & 0x08 or max(info.file_size, info.compress_size, info.header_offset) >= 0xFFFFFFFF:
                raise AuditError(f"{container}: member {info.filename!r} uses a data descriptor or zip64; refused")
            f.seek(info.header_offset)
            head = f.read(30)
            if info.header_offset != at or len(head) < 30 or head[:4] != b"PK\x03\x04":
                raise AuditError(f"{container}: bytes before member {info.filename!r} that no member accounts for")
            n, m = struct.unpack("<HH", head[26:30])
            at += 30 + n + m + info.compress_size
            central += 46 + len(info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")) + \
                len(info.extra) + len(info.comment)
        size = os.fstat(f.fileno()).st_size
    if size != at + central + 22:
        raise AuditError(f"{container}: {size - at - central - 22} bytes that no member accounts for")


def load_npy(data: bytes, rel: str, entry: dict) -> np.ndarray:
    """Check the .npy header before reading; refuse object dtypes and pickles.

    The header is parsed by numpy's header reader (a literal parser, no code), the member's size
    must be exactly header + data, and only then is it loaded with ``allow_pickle=False``."""
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise AuditError(f"{rel}: unsupported .npy version {version}")
    except (ValueError, TypeError, SyntaxError, OverflowError) as e:
        raise AuditError(f"{rel}: not a valid .npy file ({str(e)[:200]})") from None
    data_start = f.tell()
    size = len(data)
    if dtype.hasobject:
        raise AuditError(f"{rel}: object dtype {dtype} refused (would need pickle); not loaded")
    if math.prod(shape) * dtype.itemsize != size - data_start:
        raise AuditError(f"{rel}: member holds {size - data_start} data bytes, its header {dtype.str} {list(shape)} "
                         f"needs {math.prod(shape) * dtype.itemsize} (truncated or padded); not loaded")
    if dtype.str != entry.get("dtype") or list(shape) != entry.get("shape"):
        raise AuditError(f"{rel}: header says {dtype.str} {list(shape)}, manifest says {entry.get('dtype')} {entry.get('shape')}")
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as e:
        raise AuditError(f"{rel}: cannot load without pickle ({e})") from None
    if int(arr.nbytes) != entry.get("nbytes"):
        raise AuditError(f"{rel}: nbytes {arr.nbytes} != manifest {entry.get('nbytes')}")
    arr.setflags(write=False)
    return arr
