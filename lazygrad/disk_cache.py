"""On-disk cache of built backward graphs, shared by processes, safe against torn files.

A second process that exports the same forward graph skips gradient building and splitting: the
key is a content hash of the forward graph plus everything else the backward graph depends on.
Each file carries a SHA-256 of its payload; a file that fails the check is deleted and rebuilt,
never used. Writes go to a temporary file in the same folder and are renamed into place, so a
reader sees either the old file, the new one, or none, even with two writers at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import onnx
import onnxruntime

from lazygrad.gradient import BackwardGraph

ENV_VAR = "LAZYGRAD_CACHE_DIR"
MAGIC = b"LAZYGRAD-BACKWARD-2\n"
_DEFAULT = Path(__file__).resolve().parent.parent / "cache"


def default_directory() -> Path | None:
    """`$LAZYGRAD_CACHE_DIR` if set (empty: no disk cache), else the project's `cache/` folder."""
    configured = os.environ.get(ENV_VAR)
    if configured is not None:
        return Path(configured) if configured else None
    return _DEFAULT


def fingerprint(forward: onnx.ModelProto) -> str:
    """Content hash of a forward graph (its nodes, names, types: the signature it was made for)."""
    return hashlib.sha256(forward.SerializeToString()).hexdigest()


def cache_key(forward_fingerprint: str, *parts: object) -> str:
    """Key of one build: the forward graph, what else the build depends on, and the builder."""
    identity = (forward_fingerprint, MAGIC, onnxruntime.__version__, parts)
    return hashlib.sha256(repr(identity).encode()).hexdigest()


class DiskCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.lazygrad"

    def load(self, key: str) -> BackwardGraph | None:
        """The stored graph, or None if absent or damaged (a damaged file is removed)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        graph = _decode(data)
        if graph is None:
            path.unlink(missing_ok=True)
        return graph

    def store(self, key: str, graph: BackwardGraph) -> None:
        """Write atomically; a cache that cannot be written is skipped, never fatal."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(
                dir=self.directory, prefix=f".{key}.", suffix=".tmp"
            )
        except OSError:
            return
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(_encode(graph))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self._path(key))
        except OSError:
            Path(temporary).unlink(missing_ok=True)


def _encode(graph: BackwardGraph) -> bytes:
    header = json.dumps(
        {
            "grad_of": graph.grad_of,
            "reads": graph.reads,
            "grads_for": graph.grads_for,
            "build_seconds": graph.build_seconds,
            "forward_nodes": [node.SerializeToString().hex() for node in graph.forward_nodes],
        }
    ).encode()
    payload = struct.pack("<Q", len(header)) + header + graph.model.SerializeToString()
    return MAGIC + hashlib.sha256(payload).digest() + payload


def _decode(data: bytes) -> BackwardGraph | None:
    if not data.startswith(MAGIC):
        return None
    body = data[len(MAGIC):]
    checksum, payload = body[:32], body[32:]
    if len(checksum) < 32 or hashlib.sha256(payload).digest() != checksum:
        return None
    (header_length,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8 : 8 + header_length])
    model = onnx.load_from_string(payload[8 + header_length :])
    return BackwardGraph(
        model=model,
        grad_of=header["grad_of"],
        reads=header["reads"],
        grads_for=header["grads_for"],
        build_seconds=header["build_seconds"],
        forward_nodes=[
            onnx.NodeProto.FromString(bytes.fromhex(node)) for node in header["forward_nodes"]
        ],
    )
