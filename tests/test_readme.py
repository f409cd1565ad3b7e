"""Every ```python block of README.md runs as written, in order, in one namespace.

The blocks run in a fresh interpreter (cwd a temporary directory), compiled
with README.md's own line numbers, so a block that stops running fails this
test with the block's number, its line and the traceback into README.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

# Runs in the child: executes each block in one shared namespace and stops at
# the first that raises, naming it.
_DRIVER = textwrap.dedent(
    """
    import json, sys, traceback

    readme, blocks = json.load(open(sys.argv[1]))
    namespace = {"__name__": "__main__"}
    for number, (line, source) in enumerate(blocks, 1):
        # Padding puts each statement on its README line: tracebacks point into README.md.
        code = compile("\\n" * (line - 1) + source, readme, "exec")
        try:
            exec(code, namespace)
        except BaseException:
            print(f"README.md python block {number} (line {line}) failed:", file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)
    print(f"ran {len(blocks)} python blocks")
    """
)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first code line, source) of each ```python block, in order."""
    blocks: list[tuple[int, str]] = []
    start: int | None = None
    lines: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if start is None:
            if line.strip() == "```python":
                start, lines = number + 1, []
        elif line.strip().startswith("```"):
            blocks.append((start, "\n".join(lines) + "\n"))
            start = None
        else:
            lines.append(line)
    assert start is None, f"README.md: the python block opened before line {start} is never closed"
    return blocks


def test_readme_python_blocks_run_in_order(tmp_path: Path) -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "README.md has no ```python block: nothing would be checked"
    (tmp_path / "blocks.json").write_text(json.dumps([str(README), blocks]))
    (tmp_path / "driver.py").write_text(_DRIVER)
    proc = subprocess.run(
        [sys.executable, "driver.py", "blocks.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stderr}\n--- stdout ---\n{proc.stdout}"
    assert f"ran {len(blocks)} python blocks" in proc.stdout
