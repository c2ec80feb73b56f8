"""Reading and editing the arrays of a finished run the way a user or a forger would.

An array's run-relative path ``arrays/S/C/NAME.npy`` is member ``NAME.npy`` of the zip
``arrays/S/C.npz``. Editing a member rewrites its container (the other members kept, in order);
nothing here touches the manifest: a test that plays the consistent forger re-records hashes itself.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from pathlib import Path

import numpy as np

from testbed.evidence import ZIP_DATE_TIME, container_of


def container(run: Path, rel: str) -> Path:
    return Path(run) / container_of(rel)[0]


def read(run: Path, rel: str) -> bytes:
    """The ``.npy`` bytes of one array."""
    name, member = container_of(rel)
    with zipfile.ZipFile(Path(run) / name) as zf:
        return zf.read(member)


def load(run: Path, rel: str) -> np.ndarray:
    return np.load(io.BytesIO(read(run, rel)), allow_pickle=False)


def sha(run: Path, rel: str) -> str:
    return hashlib.sha256(read(run, rel)).hexdigest()


def _rewrite(path: Path, edit) -> None:
    """Rewrite the zip at ``path`` with ``edit(list of (name, bytes))`` applied to its members."""
    with zipfile.ZipFile(path) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    members = edit(members)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE_TIME)
            zf.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)


def write(run: Path, rel: str, data: bytes) -> None:
    """Replace (or add, at the end) the member of ``rel`` with ``data``."""
    _, member = container_of(rel)

    def edit(members):
        if any(n == member for n, _ in members):
            return [(n, data if n == member else d) for n, d in members]
        return members + [(member, data)]

    _rewrite(container(run, rel), edit)


def save(run: Path, rel: str, arr) -> None:
    buf = io.BytesIO()
    np.save(buf, np.asarray(arr), allow_pickle=False)
    write(run, rel, buf.getvalue())


def delete(run: Path, rel: str) -> None:
    """Take the member out; a container left empty is deleted (as a forger tidying up would)."""
    _, member = container_of(rel)
    path = container(run, rel)
    _rewrite(path, lambda ms: [(n, d) for n, d in ms if n != member])
    with zipfile.ZipFile(path) as zf:
        empty = not zf.infolist()
    if empty:
        path.unlink()


def rename(run: Path, src: str, dst: str) -> None:
    """Rename a member within its container (both paths name the same case)."""
    assert container_of(src)[0] == container_of(dst)[0], (src, dst)
    a, b = container_of(src)[1], container_of(dst)[1]
    _rewrite(container(run, src), lambda ms: [(b if n == a else n, d) for n, d in ms])


def flip_bit(run: Path, rel: str, kind: str) -> None:
    """Flip one bit of element 0 of an array: its sign bit ("sign"; bit 0 for integers) or its
    lowest mantissa bit ("lsb")."""
    data = bytearray(read(run, rel))
    f = io.BytesIO(bytes(data))
    version = np.lib.format.read_magic(f)
    _, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                   else np.lib.format.read_array_header_2_0(f))
    start = f.tell()
    if dtype.kind == "f" and kind == "sign":
        data[start + dtype.itemsize - 1] ^= 0x80  # little-endian: the sign bit is the top bit of the last byte
    else:
        data[start] ^= 0x01
    write(run, rel, bytes(data))
