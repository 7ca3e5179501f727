"""On-disk cache of built graph pairs, shared by processes, safe against torn files.

A second process that traces the same graphs skips exporting and checking them: the key is a
content hash of the traced (tidied) FX graphs plus everything else the ONNX graphs depend on
(policy, library versions). Each file carries a SHA-256 of its payload; a file that fails the
check is deleted and rebuilt, never used. Writes go to a temporary file in the same folder and
are renamed into place, so a reader sees the old file, the new one, or none.

Beside the graphs, the folder holds the disk index's records (`*.index`, checksummed JSON): per
signature, what serving it needs without a first eager call, and per (signature, mask), the key
of its graphs, so a new process finds them without tracing (keys: `index_key.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import onnx
import onnxruntime
import torch

from lazygrad.capture import Draw, Feed, Graphs, OutputSlot, OutputView

ENV_VAR = "LAZYGRAD_CACHE_DIR"
MAGIC = b"LAZYGRAD-GRAPHS-6\n"
INDEX_MAGIC = b"LAZYGRAD-INDEX-1\n"
_DEFAULT = Path(__file__).resolve().parent.parent / "cache"


def default_directory() -> Path | None:
    """`$LAZYGRAD_CACHE_DIR` if set (empty: no disk cache), else the project's `cache/` folder."""
    configured = os.environ.get(ENV_VAR)
    if configured is not None:
        return Path(configured) if configured else None
    return _DEFAULT


def versions() -> tuple[str, ...]:
    """Everything outside the traced graph that changes the ONNX graphs or how they run."""
    return (MAGIC.decode(), torch.__version__, metadata.version("onnxscript"),
            onnxruntime.__version__, _own_code())


@functools.cache
def _own_code() -> str:
    """A hash of lazygrad's own source files: its rewrites, export and partition decide the
    graphs as much as torch does, and an edited checkout has no new version to say so."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _read(path: Path, decode: Callable[[bytes], Any]) -> Any:
    """`decode` of the file's bytes; None if absent, or if damaged (`decode` gives None: the
    file is removed, to be written again)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    found = decode(data)
    if found is None:
        path.unlink(missing_ok=True)
    return found


def _decode_record(data: bytes) -> dict | None:
    body = data[len(INDEX_MAGIC):]
    checksum, payload = body[:32], body[32:]
    if not data.startswith(INDEX_MAGIC) or hashlib.sha256(payload).digest() != checksum:
        return None
    return json.loads(payload)


class DiskCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.lazygrad"

    def load(self, key: str) -> Graphs | None:
        """The stored graphs, or None if absent or damaged (a damaged file is removed)."""
        return _read(self._path(key), _decode)

    def store(self, key: str, graphs: Graphs) -> None:
        """Write atomically; a cache that cannot be written is skipped, never fatal."""
        self._write(self._path(key), _encode(graphs))

    # ---- the index: signature-level records naming graphs (`index_key.py`) ------------------

    def _record_path(self, key: str) -> Path:
        return self.directory / f"{key}.index"

    def read_record(self, key: str) -> dict | None:
        """The index record, or None if absent or damaged (a damaged one is removed)."""
        return _read(self._record_path(key), _decode_record)

    def write_record(self, key: str, record: dict) -> None:
        payload = json.dumps(record).encode()
        self._write(self._record_path(key),
                    INDEX_MAGIC + hashlib.sha256(payload).digest() + payload)

    def _write(self, path: Path, data: bytes) -> None:
        """Write to a temporary file in the folder, then rename: readers never see a torn file.
        A cache that cannot be written is skipped, never fatal."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(
                dir=self.directory, prefix=f".{path.name}.", suffix=".tmp"
            )
        except OSError:
            return
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except OSError:
            Path(temporary).unlink(missing_ok=True)


def _encode(graphs: Graphs) -> bytes:
    """MAGIC, SHA-256 of the payload; payload: header length, the JSON header (the plain fields
    and the length of each model), then the models: forward, backward, backward segments."""
    fields = {f.name: getattr(graphs, f.name) for f in dataclasses.fields(graphs)}
    models = [fields.pop("forward"), fields.pop("backward"), *fields.pop("backward_segments")]
    blobs = [b"" if model is None else model.SerializeToString() for model in models]
    header = json.dumps({**_plain(fields), "models": [len(blob) for blob in blobs]}).encode()
    payload = struct.pack("<Q", len(header)) + header + b"".join(blobs)
    return MAGIC + hashlib.sha256(payload).digest() + payload


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _decode(data: bytes) -> Graphs | None:
    if not data.startswith(MAGIC):
        return None
    body = data[len(MAGIC):]
    checksum, payload = body[:32], body[32:]
    if len(checksum) < 32 or hashlib.sha256(payload).digest() != checksum:
        return None
    (header_length,) = struct.unpack("<Q", payload[:8])
    offset = 8 + header_length
    header = json.loads(payload[8:offset])
    models: list[onnx.ModelProto | None] = []
    for length in header["models"]:
        blob = payload[offset : offset + length]
        models.append(onnx.load_from_string(blob) if length else None)
        offset += length
    forward, backward, *segments = models
    return Graphs(
        forward=forward,
        backward=backward,
        backward_segments=segments,
        forward_feeds=[Feed(**f) for f in header["forward_feeds"]],
        backward_feeds=[Feed(**f) for f in header["backward_feeds"]],
        mutations=[tuple(m) for m in header["mutations"]],
        roots=[
            OutputSlot(o["index"], [(name, args) for name, args in o["views"]])
            for o in header["roots"]
        ],
        outputs=[
            OutputView(o["source"], o["index"], [(name, args) for name, args in o["views"]])
            for o in header["outputs"]
        ],
        grads_for=header["grads_for"],
        grad_reach=header["grad_reach"],
        draws=[
            Draw(d["kind"], tuple(d["shape"]), d["dtype"], tuple(d["params"]),
                 tuple(d["strides"]))
            for d in header["draws"]
        ],
        locations={k: tuple(v) for k, v in header["locations"].items()},
        guards=header["guards"],
        differentiable=header["differentiable"],
        sized=[tuple(number) for number in header["sized"]],
        seconds=header["seconds"],
        check=header.get("check"),
    )
