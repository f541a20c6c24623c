"""What differs between the Python versions ddpkit supports."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 12):
    from typing import override
else:  # typing_extensions comes with torch
    from typing_extensions import override

__all__ = ["override"]
