"""driver/ is the wire contract alone: it imports nothing of ours (DESIGN.md, "the house")."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_driver_imports_nothing_of_ours():
    modules = sorted(p.stem for p in (ROOT / "driver").glob("*.py") if p.stem != "__init__")
    assert {"wire", "errors", "native", "wire_build"} <= set(modules)
    assert not {"server", "serve", "node_info"} & set(modules)  # the device process lives in emulator/serve/
    code = (f"import sys; import {', '.join('driver.' + m for m in modules)}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'emulator', 'libchm', 'host_runtime'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
