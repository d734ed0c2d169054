"""The quickstart's ```python snippets run as written, in the page's order, on a machine without a GPU.

They run in one namespace, as a reader pastes them one after another, in a subprocess that sees no CUDA device
(``CUDA_VISIBLE_DEVICES=""``, also on a GPU machine) and in a fresh folder, since the page writes
``profile.json`` and ``ckpt.pt``. A traceback points at the snippet's line in docs/quickstart.md.

A snippet that needs a GPU says so on its first line, ``# needs a CUDA GPU``, and is skipped here; the page has
none, and the test below keeps it that way unless the marker is there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "docs" / "quickstart.md"
SNIPPET = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
NEEDS_GPU = "# needs a CUDA GPU"

# Runs the snippets in order in one namespace; each is padded with blank lines so that its line numbers are the page's.
RUNNER = """
import json, sys
ns = {"__name__": "__main__"}
for line, source, gpu in json.load(open(sys.argv[1])):
    if gpu:
        print(f"quickstart: skipped the snippet at line {line} (needs a CUDA GPU)", flush=True)
        continue
    exec(compile("\\n" * (line - 1) + source, sys.argv[2], "exec"), ns)
    print(f"quickstart: ran the snippet at line {line}", flush=True)
"""


def snippets(text: str) -> list[tuple[int, str, bool]]:
    """(first line of the code in the page, code, needs a GPU) of each ```python block."""
    return [
        (text.count("\n", 0, m.start(1)) + 1, m[1], m[1].lstrip().startswith(NEEDS_GPU)) for m in SNIPPET.finditer(text)
    ]


def test_snippets_are_found_with_their_lines_and_markers():
    page = "# t\n\n```python\nx = 1\n```\n\ntext\n\n```python\n# needs a CUDA GPU\ny = x\n```\n\n```bash\nls\n```\n"
    assert snippets(page) == [(4, "x = 1\n", False), (10, "# needs a CUDA GPU\ny = x\n", True)]


def test_no_snippet_assumes_a_gpu_unless_marked():
    found = snippets(QUICKSTART.read_text())
    assert len(found) >= 5, "the quickstart's snippets were not found"
    for line, source, gpu in found:
        if not gpu:
            assert not re.search(r"\.cuda\(|[\"']cuda[:\"']", source.replace('"cuda" if torch.cuda', "")), (
                f"docs/quickstart.md:{line}: the snippet hard-codes CUDA; pick the device with "
                f'`device = "cuda" if torch.cuda.is_available() else "cpu"`, or mark it `{NEEDS_GPU}`'
            )


def test_quickstart_runs_on_cpu(tmp_path: Path):
    found = snippets(QUICKSTART.read_text())
    (tmp_path / "snippets.json").write_text(json.dumps(found))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's environment, not the tests'
    # no GPU; one thread: torch's default of one per core crawls while other test processes share the cores
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # the checkout, then the user's own
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [sys.executable, "-c", RUNNER, "snippets.json", str(QUICKSTART.relative_to(ROOT))]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"a quickstart snippet failed on CPU:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    ran = re.findall(r"^quickstart: ran the snippet at line (\d+)$", proc.stdout, re.M)
    assert [int(line) for line in ran] == [line for line, _, gpu in found if not gpu]
    assert "kitsune summary" in proc.stdout and "kitsune fusion plan" in proc.stdout  # print_summary, the plan
    assert (tmp_path / "profile.json").is_file() and (tmp_path / "ckpt.pt").is_file()
