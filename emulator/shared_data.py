"""Where data from outside the project lives: the shared data directory
beside the repository (``../shared/data``), never the repository itself.

The emulator is the bottom layer, so the RTL benches, the replay, the tests
and the benches all take these paths from here.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# The public Mooncake conversation trace (Apache-2.0); $CHM_MOONCAKE_TRACE points elsewhere.
MOONCAKE_CONVERSATION_TRACE = SHARED_DATA / "traces" / "mooncake_conversation_trace.jsonl"


def mooncake_conversation_trace() -> Path:
    """Where the Mooncake conversation trace is; FileNotFoundError saying where it is expected when absent."""
    path = Path(os.environ.get("CHM_MOONCAKE_TRACE") or MOONCAKE_CONVERSATION_TRACE)
    if not path.is_file():
        raise FileNotFoundError(errno.ENOENT, f"Mooncake conversation trace not found; its place is "
                                f"{MOONCAKE_CONVERSATION_TRACE} (the shared data directory beside the repository), "
                                f"or the file $CHM_MOONCAKE_TRACE names", str(path))
    return path
