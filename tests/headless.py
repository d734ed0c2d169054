"""Headless Chromium for the tests that look at a rendered page: find it, run it, read its PNG screenshots."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium() -> str:
    """The Chromium binary, or a skip naming how to get it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not on PATH (apt-get install chromium); .ci/run installs it")
    return path


def launch(url: str, profile_dir: Path, *args: str) -> subprocess.Popen:
    """Open ``url`` with ``args`` (``--dump-dom``, ``--screenshot=...``) in a fresh user-data-dir; stdout is piped."""
    cmd = [chromium(), *FLAGS, f"--user-data-dir={profile_dir}", *args, url]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def png_rgb(path: Path) -> np.ndarray:
    """Decode an 8-bit RGB(A) non-interlaced PNG: zlib over the IDAT chunks, then undo each row's filter."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    rows = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, 1 + w * bpp)
    out = np.zeros((h, w * bpp), np.uint8)
    prev = out[0].copy()
    for y in range(h):
        f, line = rows[y, 0], rows[y, 1:]
        if f == 0:
            cur = line.copy()
        elif f == 1:  # Sub: a running sum along the row, per channel (uint8 wraps like the filter)
            cur = np.cumsum(line.reshape(w, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif f == 2:  # Up
            cur = line + prev
        else:  # Average, Paeth: sequential along the row
            cur_b, line_l, prev_l = bytearray(len(line)), line.tolist(), prev.tolist()
            for i, x in enumerate(line_l):
                a = cur_b[i - bpp] if i >= bpp else 0
                b = prev_l[i]
                if f == 3:
                    cur_b[i] = (x + (a + b) // 2) & 255
                    continue
                c = prev_l[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur_b[i] = (x + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.frombuffer(bytes(cur_b), np.uint8)
        out[y] = cur
        prev = cur
    return out.reshape(h, w, bpp)[..., :3]


def distinct_colours(rgb: np.ndarray) -> int:
    return len(np.unique(rgb.reshape(-1, 3).astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], np.uint32)))
