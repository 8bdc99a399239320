"""The shell tools answer --help without starting anything (README: every tool has --help)."""
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize("script", ["device_check.sh", "ncu_sm90_forward.sh"])
def test_shell_tool_answers_help(script):
    result = subprocess.run(["bash", str(TOOLS / script), "--help"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "tools/" + script in result.stdout
    assert result.stderr == ""


def test_ncu_tool_without_arguments_prints_usage_and_fails():
    result = subprocess.run(["bash", str(TOOLS / "ncu_sm90_forward.sh")], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2
    assert "OUTDIR NAME" in result.stdout
