"""Benchmark: the checksums a manifest could use, on one core, over 256 MiB of random bytes in memory.

Why the manifest (``ckpttool/manifest.py``) hashes with xxh3: it must not slow a save or a verify that
already moves every byte once. Best of 3 per algorithm:

    .venv/bin/python bench/hashes.py
"""

import hashlib
import os
import zlib

import xxhash

from _common import GB, timed

if __name__ == "__main__":
    buf = memoryview(os.urandom(256 << 20))
    for name, fn in [("xxh3_64 (xxhash)", lambda: xxhash.xxh3_64(buf).hexdigest()),
                     ("CRC-32 (zlib)", lambda: zlib.crc32(buf)),
                     ("SHA-256 (hashlib)", lambda: hashlib.sha256(buf).hexdigest())]:
        print(f"{name:20s} {len(buf) / min(timed(fn) for _ in range(3)) / GB:5.1f} GB/s")
