"""tools/bench_context_parallel.py on the CPU: --help, a bad argument, and one tiny run as a group
of one process (gloo), whose check against one-process nsa() must come out bitwise equal."""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_context_parallel.py"


def _load(name: str = "tools_bench_context_parallel"):
    """The tool as a module (a spawned rank loads its own copy)."""
    spec = importlib.util.spec_from_file_location(name, TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load()


def _tiny(seqlen: int, heads: int, kv_heads: int, *extra: str) -> list[str]:
    """A tiny CPU run's command line: head dim 16, small NSA blocks, one timed call."""
    return ["--device", "cpu", "--seqlen", str(seqlen), "--heads", str(heads),
            "--kv-heads", str(kv_heads), "--head-dim", "16", "--compress-block-size", "16",
            "--selected-block-size", "32", "--num-selected-blocks", "5", "--window-size", "32",
            "--warmup", "0", "--repeats", "1", *extra]


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
    result = bench.main(_tiny(128, 2, 1, "--num-seqs", "3", "--json", str(path)))
    assert result["mode"] == "heads" and result["world_size"] == 1
    assert result["bitwise_equal_one_device"] and result["max_abs_diff"] == 0
    assert result["fwd_ms"] > 0 and result["fwd_bwd_ms"] > 0
    assert "forward+backward" in capsys.readouterr().out
    written = json.loads(path.read_text())
    assert written["meta"]["tool"] == "bench_context_parallel"
    assert written["results"][0]["seqlen"] == 128


def test_overlap_chunks_reaches_the_call_and_the_results(bench, capsys):
    result = bench.main(_tiny(128, 4, 2, "--num-seqs", "2", "--overlap-chunks", "2",
                              "--layout", "zigzag"))
    assert result["overlap_chunks"] == 2 and result["bitwise_equal_one_device"]
    assert result["layout"] == "zigzag"
    assert "in 2 overlapped chunks" in capsys.readouterr().out
    with pytest.raises(ValueError, match="overlap_chunks must divide the KV heads of a rank"):
        bench.main(["--device", "cpu", "--seqlen", "128", "--heads", "4", "--kv-heads", "2",
                    "--head-dim", "16", "--warmup", "0", "--repeats", "1", "--no-check",
                    "--overlap-chunks", "3"])


def test_no_check_makes_only_the_ranks_shard(bench, monkeypatch, capsys):
    """--no-check compares nothing with one GPU, so no rank builds or gathers the whole sequence
    (at 4M tokens on 4 GPUs the full float32 draws alone filled an H200, then the gathered
    output and gradients did): each makes its own shard."""
    def whole_sequence(*args, **kwargs):
        raise AssertionError("--no-check built or gathered the whole sequence")
    monkeypatch.setattr(bench, "_full_inputs", whole_sequence)
    monkeypatch.setattr(bench, "unshard_sequence", whole_sequence)
    result = bench.main(_tiny(128, 2, 1, "--num-seqs", "3", "--no-check"))
    assert result["fwd_ms"] > 0 and result["fwd_bwd_ms"] > 0
    assert "bitwise_equal_one_device" not in result
    assert "equal to one device" not in capsys.readouterr().out


def test_sequence_mode_times_its_own_exchanges(bench, capsys):
    """Sequence mode runs zigzag unless told otherwise (2 chunks of 256 here: sequence mode needs
    2 x 128 rows a chunk)."""
    result = bench.main(_tiny(512, 4, 2, "--num-seqs", "3", "--mode", "sequence"))
    assert result["mode"] == "sequence" and result["layout"] == "zigzag"
    assert result["max_abs_diff"] < 1e-5
    assert result["exchange_fwd_ms"] == result["all_gather_kv_ms"]
    assert result["exchange_fwd_bwd_ms"] == result["all_gather_kv_ms"] + result["reduce_dkv_ms"]
    assert "mode sequence" in capsys.readouterr().out


def test_max_length_needs_cuda(bench):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", "cpu", "--max-length"])
    assert "--max-length needs CUDA" in str(exit_info.value.code)


def _search_with_limits(rank: int, world: int, store_path: str, limits: list[int],
                        results) -> None:
    """One rank of a gloo group: search_on_ranks where this rank fits up to limits[rank]."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    try:
        module = _load("tools_bench_context_parallel_child")
        rows, answer = module.search_on_ranks(
            lambda n: (n <= limits[rank], 1000 * n if n <= limits[rank] else 0),
            start=2, step=2, deadline=None, device=torch.device("cpu"), rank=rank)
        results.put((rank, [(r["seqlen"], r["fits"], r["peak_bytes"]) for r in rows], answer))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_groups_answer(tmp_path):
    """Two gloo ranks, one fitting up to 12 tokens and the other up to 7: both run the same
    trials and get the group's answer (6 fits, 8 does not), with the fullest rank's peaks."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    limits = [12, 7]
    processes = [context.Process(target=_search_with_limits,
                                 args=(rank, 2, str(tmp_path / "store"), limits, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    outcomes = dict((rank, (rows, answer)) for rank, rows, answer in
                    (results.get(timeout=120) for _ in processes))
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert outcomes[0] == outcomes[1]
    rows, answer = outcomes[0]
    assert answer == (6, 8)
    assert rows[:3] == [(2, True, 2000), (4, True, 4000), (8, False, None)]


def test_a_time_limit_stops_every_rank_before_a_trial(bench):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ticks = iter([0.0, 5.0, 50.0])
        tried = []
        rows, answer = bench.search_on_ranks(
            lambda n: (tried.append(n), (True, 1))[1], start=4, step=4, deadline=10.0,
            device=torch.device("cpu"), rank=0, clock=lambda: next(ticks))
    finally:
        dist.destroy_process_group()
    assert tried == [4, 8] and answer == (8, None) and len(rows) == 2
