"""Short, stable hashes that keep kernel object names unique and within their length limits."""

from __future__ import annotations

import base64
import hashlib

NFT_NAME_MAX = 255
"""nft's longest table, chain, set or counter name, in bytes."""
NFT_COMMENT_MAX = 128
"""nft's longest comment, in bytes."""
XT_COMMENT_MAX = 255
"""iptables' longest comment (the comment match's), in bytes."""


def short_hash(text: str, length: int = 16) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return base64.b32encode(digest).decode()[:length]


def within(text: str, limit: int) -> str:
    """`text` when it fits in `limit` bytes; else as much of its start as fits beside a hash of
    the whole, so that two long texts sharing a start still differ."""
    if len(text.encode()) <= limit:
        return text
    digest = short_hash(text, 8)
    start = text.encode()[: limit - len(digest) - 1].decode(errors="ignore")
    return f"{start}~{digest}"
