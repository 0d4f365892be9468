"""The image builder's one error, in a module of its own so every other module (the Dockerfile
parser too) can raise it: `python -m deploy.lab.image` reports it as a message, not a traceback.
"""

from __future__ import annotations


class ImageError(Exception):
    pass
