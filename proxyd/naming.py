"""Short, stable hashes that keep kernel object names unique and within their length limits."""

from __future__ import annotations

import base64
import hashlib


def short_hash(text: str, length: int = 16) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return base64.b32encode(digest).decode()[:length]
