"""The evidence store: every array saved as ``.npy`` bytes with its nbytes, dtype, shape and SHA-256.

Layout of one run::

    manifest.json  protocol(s) + sha256, source hashes (LF-normalized), environment,
                   arrays {relpath: {sha256, nbytes, dtype, shape}}, files {relpath: sha256},
                   gates, excluded
    protocols/NAME.json   each frozen protocol, byte for byte
    results.json   {"cases": {...}, "rows": [...]}
    timings.json   raw per-call timings
    report.md      tables
    report.html    figures (testbed/report_html/), their plotted data embedded for the audit
    arrays/STUDY/CASE.npz   one zip per case, a ``.npy`` member per array (deflated)

An array's run-relative path is ``arrays/STUDY/CASE/NAME.npy``: member ``NAME.npy`` of the
container ``arrays/STUDY/CASE.npz`` (`container_of`). ``np.load("arrays/STUDY/CASE.npz")[NAME]``
reads it (with numpy's default ``allow_pickle=False``). One file per case instead of one per
array: most arrays are a few hundred bytes (scales, zero-points), and every file costs a
file-system block. The SHA-256 of an array is the hash of its ``.npy`` bytes (header included;
the member as stored, uncompressed), so the audit can check the bytes before parsing them; the
container's own bytes depend on the zlib that deflated them and are not hashed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["ArrayStore", "RecordingStore", "replay", "npy_bytes", "container_of", "load_array", "sha256_file", "sha256_bytes",
           "write_json", "source_hashes", "environment", "REPO_ROOT", "SOURCE_GLOBS"]

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_GLOBS = ("testbed/**/*.py", "protocols/*.json", "pyproject.toml")
SCHEMA_VERSION = 1
# Fixed member timestamp (the zip format's earliest): a container's bytes depend on its arrays only.
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record_lines(obj, depth: int = 0) -> str:
    """JSON text of ``obj`` with one record per line: the top level is laid out one entry per
    line, as is any collection of records below it (a list or dict whose items are all objects or
    lists: the rows, the cases, the manifest's arrays, the timings); everything inside a record
    stays on its line, without spaces after its separators. As diffable as an indented file, and
    smaller."""
    items = (obj.values() if isinstance(obj, dict) else obj) if isinstance(obj, (dict, list)) else ()
    expand = bool(items) and (depth == 0 or (depth <= 2 and all(isinstance(x, (dict, list)) for x in items)))
    if not expand:
        return json.dumps(obj, allow_nan=True, separators=(",", ":"))
    pad = " " * (depth + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {_record_lines(v, depth + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    items = [pad + _record_lines(v, depth + 1) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"


def write_json(path: Path, obj) -> None:
    Path(path).write_text(_record_lines(obj) + "\n", encoding="utf-8")


class ArrayStore:
    """Writes arrays into per-case containers under ``root/arrays`` and remembers their hashes for the manifest."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.entries: dict[str, dict] = {}
        self._by_content: dict[tuple[str, str], str] = {}
        self._containers: set[str] = set()

    def save(self, relpath: str, array) -> str:
        """Save ``array`` (numpy or torch) under ``arrays/``; returns the run-relative path.

        ``relpath`` is ``STUDY/CASE/...``: the first two levels name the container
        (``arrays/STUDY/CASE.npz``) and any deeper levels are joined with dots into the member's
        name (``STUDY/CASE/R=16/key.codes`` is member ``R=16.key.codes.npy``, run-relative path
        ``arrays/STUDY/CASE/R=16.key.codes.npy``).

        Within one study the store is content-addressed: an array whose bytes equal one already
        saved in that study (a payload header, query positions) is not written again and the
        earlier path is returned. Studies never share containers, so a study run alone or in a
        worker (``--jobs``) stores exactly what it stores in a full run."""
        array, parts, rel, data = npy_bytes(relpath, array)
        if rel in self.entries:
            raise ValueError(f"{rel}: stored twice in one run")
        digest = sha256_bytes(data)
        seen = self._by_content.get((parts[0], digest))
        if seen is not None:
            return seen
        container, member = container_of(rel)
        path = self.root / container
        if container not in self._containers:
            path.parent.mkdir(parents=True, exist_ok=True)
        # Appended and closed at once: every container on disk is a whole zip after every save.
        with zipfile.ZipFile(path, "a" if container in self._containers else "x") as zf:
            info = zipfile.ZipInfo(member, date_time=ZIP_DATE_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
        self._containers.add(container)
        self._by_content[(parts[0], digest)] = rel
        self.entries[rel] = {
            "sha256": digest,
            "nbytes": int(array.nbytes),
            "dtype": array.dtype.str,
            "shape": list(array.shape),
        }
        return rel

    def save_packed(self, prefix: str, packed) -> dict[str, str]:
        """Save every array of a `Packed`; returns {array name: run-relative path}."""
        return {name: self.save(f"{prefix}/{name}", arr) for name, arr in packed.arrays.items()}


def container_of(rel: str) -> tuple[str, str]:
    """``(container, member)`` of a run-relative array path: ``arrays/S/C/NAME.npy`` is member
    ``NAME.npy`` of ``arrays/S/C.npz``."""
    head, _, member = rel.rpartition("/")
    return head + ".npz", member


def load_array(root: Path, rel: str) -> np.ndarray:
    """The array stored at run-relative path ``rel`` of the run in ``root`` (no pickle)."""
    container, member = container_of(rel)
    with zipfile.ZipFile(Path(root) / container) as zf:
        return np.load(io.BytesIO(zf.read(member)), allow_pickle=False)


def array_rel(relpath: str) -> tuple[list[str], str]:
    """``(path parts, run-relative path)`` under which `ArrayStore.save` stores ``relpath``."""
    parts = relpath.split("/")
    if len(parts) < 3:
        raise ValueError(f"{relpath}: array paths are STUDY/CASE/NAME (a container per case)")
    if len(parts) > 3:
        parts = parts[:2] + [".".join(parts[2:])]
    rel = "arrays/" + "/".join(parts) + ".npy"
    if ".." in Path(rel).parts or Path(rel).is_absolute():
        raise ValueError(f"{rel}: array paths must stay inside the run")
    return parts, rel


def npy_bytes(relpath: str, array) -> tuple[np.ndarray, list[str], str, bytes]:
    """``(array, path parts, run-relative path, .npy bytes)`` of one array as `ArrayStore.save` stores it."""
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    array = np.ascontiguousarray(array)
    if array.dtype == object:
        raise ValueError(f"{relpath}: object arrays cannot be stored")
    parts, rel = array_rel(relpath)
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return array, parts, rel, buf.getvalue()


class RecordingStore:
    """An `ArrayStore` stand-in for a unit run elsewhere (a Ray worker): it writes nothing and keeps
    every save, in order, as ``(relpath, .npy bytes)``; the driver replays them into the run's
    store (`replay`), so the stored files, their order and the content sharing are a serial run's.
    ``save`` returns the path the array would have if no earlier array had the same bytes; the
    driver rewrites those paths to where replaying put them."""

    def __init__(self):
        self.saves: list[tuple[str, bytes]] = []

    def save(self, relpath: str, array) -> str:
        _, _, rel, data = npy_bytes(relpath, array)
        self.saves.append((relpath, data))
        return rel

    save_packed = ArrayStore.save_packed


def replay(store: ArrayStore, saves: list[tuple[str, bytes]]) -> dict[str, str]:
    """Save each recorded ``(relpath, .npy bytes)`` into ``store``, in order; returns {recorded path:
    stored path}. The bytes are parsed with ``allow_pickle=False`` and the driver stores its own
    serialization of the array, the bytes a serial run writes."""
    return {array_rel(relpath)[1]: store.save(relpath, np.load(io.BytesIO(data), allow_pickle=False))
            for relpath, data in saves}


def _lf_normalized_sha256(path: Path) -> str:
    return sha256_bytes(path.read_bytes().replace(b"\r\n", b"\n"))


def source_hashes(root: Path = REPO_ROOT) -> dict[str, str]:
    """SHA-256 of the LF-normalized text of every source file that feeds a run."""
    out = {}
    for pattern in SOURCE_GLOBS:
        for p in sorted(root.glob(pattern)):
            if p.is_file() and "__pycache__" not in p.parts:
                out[p.relative_to(root).as_posix()] = _lf_normalized_sha256(p)
    return dict(sorted(out.items()))


def environment() -> dict:
    env = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        # The SIMD level torch dispatches to: float kernels (softmax, exp, even randn) round
        # differently at different levels, so bytes are comparable only between equal levels.
        "torch_cpu_capability": _cpu_capability(),
        "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                      "OPENBLAS_CORETYPE", "MKL_CBWR", "ATEN_CPU_CAPABILITY",
                                                      "PYTHONHASHSEED") if os.environ.get(k) is not None},
    }
    return env


def _cpu_capability() -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
