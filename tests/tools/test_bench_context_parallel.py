"""tools/bench_context_parallel.py on the CPU: --help, a bad argument, and one tiny run as a group
of one process (gloo), whose check against one-process nsa() must come out bitwise equal."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_context_parallel.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tools_bench_context_parallel", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_help_describes_the_tool(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    assert "nsa() across GPUs" in " ".join(capsys.readouterr().out.split())


def test_heads_not_a_multiple_of_kv_heads_is_rejected(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", "cpu", "--heads", "6", "--kv-heads", "4"])
    assert exit_info.value.code == 2
    assert "--kv-heads" in capsys.readouterr().err


def test_tiny_run_on_one_cpu_process_matches_one_device(bench, tmp_path, capsys):
    path = tmp_path / "cp.json"
    result = bench.main(["--device", "cpu", "--seqlen", "128", "--num-seqs", "3", "--heads", "2",
                         "--kv-heads", "1", "--head-dim", "16", "--compress-block-size", "16",
                         "--selected-block-size", "32", "--num-selected-blocks", "5",
                         "--window-size", "32", "--warmup", "0", "--repeats", "1",
                         "--json", str(path)])
    assert result["mode"] == "heads" and result["world_size"] == 1
    assert result["bitwise_equal_one_device"] and result["max_abs_diff"] == 0
    assert result["fwd_ms"] > 0 and result["fwd_bwd_ms"] > 0
    assert "forward+backward" in capsys.readouterr().out
    written = json.loads(path.read_text())
    assert written["meta"]["tool"] == "bench_context_parallel"
    assert written["results"][0]["seqlen"] == 128


def test_overlap_chunks_reaches_the_call_and_the_results(bench, capsys):
    result = bench.main(["--device", "cpu", "--seqlen", "128", "--num-seqs", "2", "--heads", "4",
                         "--kv-heads", "2", "--head-dim", "16", "--compress-block-size", "16",
                         "--selected-block-size", "32", "--num-selected-blocks", "5",
                         "--window-size", "32", "--warmup", "0", "--repeats", "1",
                         "--overlap-chunks", "2"])
    assert result["overlap_chunks"] == 2 and result["bitwise_equal_one_device"]
    assert "in 2 overlapped chunks" in capsys.readouterr().out
    with pytest.raises(ValueError, match="overlap_chunks must divide the KV heads of a rank"):
        bench.main(["--device", "cpu", "--seqlen", "128", "--heads", "4", "--kv-heads", "2",
                    "--head-dim", "16", "--warmup", "0", "--repeats", "1", "--no-check",
                    "--overlap-chunks", "3"])
