"""The Node.js snippet of ``docs/wire.md`` section 2, run with node on real stage output
frames: the arrays it reads are the ones the Python encoder sent.

The snippet is taken from the document itself, so the document is what is tested. The frames
come from the stage's own encoder (``_codec``), as the output thread makes them; zeromq is
not needed in node: the driver gets each message's parts as Buffers, as ``zeromq`` gives
them. ``@msgpack/msgpack`` is installed with npm once, into pytest's cache."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from enginecore.stage import _codec

pytestmark = pytest.mark.slow

_MSGPACK = "@msgpack/msgpack@3.1.3"
_WIRE_MD = Path(__file__).resolve().parents[2] / "docs" / "wire.md"

# What the driver appends to the snippet: read the messages (each a list of base64 parts)
# from stdin, decode each with the snippet's decodeBody, print the results as JSON. Each
# part is a Buffer at an odd offset in its memory: a frame's Buffer need not be aligned.
_DRIVER = r"""
import { readFileSync } from "node:fs";

function plain(v) {
  if (ArrayBuffer.isView(v)) {
    return { type: v.constructor.name,
             values: Array.from(v, (x) => (typeof x === "bigint" ? x.toString() : x)) };
  }
  if (Array.isArray(v)) return v.map(plain);
  if (v !== null && typeof v === "object") {
    return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, plain(x)]));
  }
  return v;
}

const messages = JSON.parse(readFileSync(0, "utf8"));
const decoded = messages.map((parts64) => decodeBody(parts64.map((b64) => {
  const raw = Buffer.from(b64, "base64");
  const part = Buffer.alloc(raw.length + 1).subarray(1);
  raw.copy(part);
  return part;
})));
process.stdout.write(JSON.stringify(decoded.map(plain)));
"""

_TYPED = {
    "<f4": "Float32Array",
    "<f8": "Float64Array",
    "<i4": "Int32Array",
    "<i8": "BigInt64Array",
    "|u1": "Uint8Array",
}


def _snippet() -> str:
    blocks = re.findall(r"```js\n(.*?)```", _WIRE_MD.read_text(), re.DOTALL)
    assert len(blocks) == 1, "docs/wire.md should have exactly one js block"
    assert "function decodeBody(parts)" in blocks[0]
    return str(blocks[0])


@pytest.fixture(scope="session")
def node_modules(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A directory with ``@msgpack/msgpack`` installed: in pytest's cache (git-ignored),
    installed once and kept across sessions; without that cache, for this session only."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node or npm is not installed")
    with contextlib.ExitStack() as stack:
        cache = getattr(request.config, "cache", None)
        if cache is not None:
            prefix = Path(cache.mkdir("node-msgpack"))
        else:
            prefix = Path(stack.enter_context(tempfile.TemporaryDirectory(dir="/tmp")))
        installed = prefix / "node_modules" / "@msgpack" / "msgpack" / "package.json"
        wanted = _MSGPACK.rpartition("@")[2]
        if not installed.exists() or json.loads(installed.read_text())["version"] != wanted:
            npm = ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund"]
            subprocess.run([*npm, _MSGPACK], check=True, capture_output=True, timeout=150)
        yield prefix / "node_modules"


def _outputs_frames() -> Iterator[tuple[list[Any], list[bytes]]]:
    """Real output frames: (the payloads, the frame's parts), each an ``outputs`` event of
    arrays and buffers, small ones inline and big ones out of band."""
    rng = np.random.default_rng(7)
    for size in (3, 600):  # bytes per array: 4 * 3 and 8 * 3 inline; 600+ out of band
        payloads: list[Any] = [
            rng.standard_normal((size, 2)).astype(np.float32),
            rng.standard_normal(size),
            rng.integers(-(2**31), 2**31, size, dtype=np.int32),
            np.concatenate([rng.integers(-(2**63), 2**63, size - 1), [2**53 + 1]]),
            rng.integers(0, 256, (size, 3), dtype=np.uint8),
            np.arange(2 * size, dtype=np.float32)[1::2],  # not contiguous: sent as a copy
            bytes(range(256)) * (size // 100 + 1),
            memoryview(bytes(i % 251 for i in range(2 * size))),
            np.array(size * 0.5),  # 0-d
            np.zeros((0, size), np.float32),  # empty
        ]
        rids = [f"r{i}" for i in range(len(payloads))]
        event = ("outputs", rids, [False] * len(payloads), payloads)
        parts = _codec.Encoder().encode([_codec.prepare(event, "output payload")])
        yield payloads, [bytes(memoryview(part)) for part in parts]


def _expected(payload: Any) -> Any:
    if isinstance(payload, np.ndarray):
        values = payload.ravel().tolist()
        if payload.dtype == np.int64:
            values = [str(v) for v in values]
        return {
            "dtype": payload.dtype.str,
            "shape": list(payload.shape),
            "data": {"type": _TYPED[payload.dtype.str], "values": values},
        }
    return list(bytes(payload))


def _got(value: Any) -> Any:
    return value if "dtype" in value else value["values"]  # bytes: Buffer or Uint8Array


@pytest.mark.timeout(180)  # the first session's npm install
def test_the_node_snippet_reads_real_output_frames(node_modules: Path) -> None:
    frames = list(_outputs_frames())
    assert any(len(parts) == 1 for _, parts in frames)  # all inline
    assert any(len(parts) > 5 for _, parts in frames)  # most out of band
    messages = [[base64.b64encode(part).decode() for part in parts] for _, parts in frames]
    with tempfile.TemporaryDirectory() as tmp:
        # Next to a node_modules, for the snippet's import to resolve.
        driver = Path(tmp) / "driver.mjs"
        driver.write_text(_snippet() + _DRIVER)
        (Path(tmp) / "node_modules").symlink_to(node_modules)
        result = subprocess.run(
            ["node", str(driver)],
            input=json.dumps(messages),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    decoded = json.loads(result.stdout)
    assert len(decoded) == len(frames)
    for (payloads, _), batch in zip(frames, decoded, strict=True):
        [[tag, rids, finished, got]] = batch
        assert (tag, len(rids), finished) == ("outputs", len(payloads), [False] * len(payloads))
        assert [_got(v) for v in got] == [_expected(p) for p in payloads]
