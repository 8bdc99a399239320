"""CuTe DSL (nvidia-cutlass-dsl) is a declared dependency: without it the CPU suite must fail,
not pass with the kernels' compile checks skipped.

Runs pytest in a subprocess with `import cutlass` made to fail (a plugin puts None in
sys.modules, as a broken install would behave), on the tests that need CuTe DSL on the CPU
(the kernels' compile checks, the gated sum's builds, the trace tool's table): every one must
error or fail, none may skip.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NEEDS_CUTE_DSL = [
    "tests/kernels/test_sm90_compile.py",
    "tests/kernels/test_sm90_backward_compile.py",
    "tests/kernels/test_gated_sum.py",
    "tests/tools/test_tools.py",
]


def test_missing_cute_dsl_fails_the_run(tmp_path):
    (tmp_path / "no_cutlass.py").write_text("import sys\nsys.modules['cutlass'] = None\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no_cutlass", "-p", "no:cacheprovider",
         "--continue-on-collection-errors", "-k", "not test_tools or trace_phase_table",
         *NEEDS_CUTE_DSL],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})
    output = result.stdout + result.stderr
    summary = output.strip().splitlines()[-1]
    assert result.returncode not in (0, 5), output[-3000:]
    assert "skipped" not in summary and "passed" not in summary, summary
    # Each file that needs CuTe DSL fails to collect; test_tools' one CuTe DSL test fails.
    assert "1 failed" in summary and "3 errors" in summary, summary
