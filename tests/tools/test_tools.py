"""Smoke and behaviour tests of the command-line tools, at tiny sizes on the CPU.

Each tool is loaded from its file and its main(argv) called in this process (torch is imported
once); train_packed also runs once as a subprocess, the way a user runs it.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
# Each tool and a phrase of the description its --help prints.
TOOL_DESCRIPTIONS = {
    "train_packed": "packed varlen synthetic recall sequences",
    "profile_nsa": "each stage of the NSA forward and backward",
    "profile_nsa_forward": "each stage of the NSA forward and backward",  # the former name
    "bench_nsa_vs_dense": "vs dense causal attention",
    "plot_bench": "Charts (PNG)",
    "diagnose_memory": "size of the sparsity metadata",
    "trace_sm90_forward": "Where a work tile's time goes",
    "dispatch_table": "dispatch at a glance",
    "bench_kernels": "sm90 forward and backward kernels against FA4",
    "tune_sm90_backward": "variants of the sm90 backward kernel",
    "sanitize_sm90_backward": "for compute-sanitizer",
    "bench_selection": "nsa()'s block selection",
    "bench_context_parallel": "nsa() across GPUs",
    "train_lm": "NSA and dense attention on real long documents",
    "run_gpu_tests": "split over the visible GPUs",
    "profile_host": "Where an eager nsa() call spends host time",
    "profile_kernels": "kernel by kernel",
    "bench_masked": "FlexAttention and SDPA on the same mask and bias",
}


@functools.cache
def load_tool(name: str):
    """The tool's module, loaded from its file once (dataclasses need it in sys.modules), with
    tools/ on sys.path for the helpers it imports (_common), whichever test runs first."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def common():
    load_tool("train_packed")  # load_tool puts tools/ on sys.path, where _common lives
    import _common
    return _common


# ----------------------------------------------------------------------------------------------
# Every tool: --help, and bad arguments rejected with a message naming them
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TOOL_DESCRIPTIONS))
def test_help_describes_the_tool(name, capsys):
    module = load_tool(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    assert TOOL_DESCRIPTIONS[name] in " ".join(out.split())  # argparse re-wraps lines


@pytest.mark.parametrize("name", ["profile_nsa", "profile_nsa_forward", "bench_nsa_vs_dense",
                                  "diagnose_memory", "train_packed"])
def test_heads_not_a_multiple_of_kv_heads_is_rejected(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool(name).main(["--device", "cpu", "--heads", "6", "--kv-heads", "4"])
    assert exit_info.value.code == 2
    assert "--kv-heads" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--methods", "nsa,flash9"), ("--passes", "bwd"),
                                           ("--methods", "none")])
def test_bench_rejects_unknown_methods_and_passes(option, value, capsys):
    with pytest.raises(SystemExit):
        load_tool("bench_nsa_vs_dense").main(["--device", "cpu", option, value])
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("value", ["bwd,fwd+bwd", "", "fwd,bwd,dq"])
def test_bench_kernels_rejects_unknown_passes_before_needing_a_gpu(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool("bench_kernels").main(["--passes", value])
    assert exit_info.value.code == 2
    assert "--passes" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--variants", "fma,bogus"], "unknown variants ['bogus']"),
    (["--device", "cpu"], "needs an sm90 GPU"),
])
def test_bench_selection_rejects_unknown_variants_and_the_cpu(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool("bench_selection").main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# train_packed: the data, a run as a user runs it, and that the loss falls
# ----------------------------------------------------------------------------------------------

def test_packed_batch_keeps_sequences_apart_and_answers_recall_the_head():
    tp = load_tool("train_packed")
    task = tp.RegisterRecallTask(num_registers=3, values_per_register=5, num_fillers=7,
                                 query_every=4, min_len=6, max_len=60)
    batch = tp.packed_batch(task, tokens_per_step=400, generator=torch.Generator().manual_seed(5))
    cu = batch.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == batch.tokens.numel() <= 400
    assert all(task.min_len <= b - a <= task.max_len for a, b in zip(cu, cu[1:]))
    assert batch.max_seqlen == max(b - a for a, b in zip(cu, cu[1:]))
    assert batch.loss_mask.sum() > 0
    for a, b in zip(cu, cu[1:]):
        tokens = batch.tokens[a:b]
        assert batch.positions[a:b].tolist() == list(range(b - a))
        assert tokens[0] == tp.BOS
        assert torch.equal(batch.targets[a:b - 1], tokens[1:])
        assert not batch.loss_mask[b - 1]  # the last token predicts nothing across sequences
        head = tokens[1:1 + task.num_registers]
        value_of = {int((t - task.first_value) // task.values_per_register): int(t) for t in head}
        for t in torch.nonzero(batch.loss_mask[a:b]).flatten().tolist():
            asked = int(tokens[t]) - task.first_ask  # the query token; its target is the answer
            assert 0 <= asked < task.num_registers
            assert int(batch.targets[a + t]) == value_of[asked]


def test_train_packed_runs_as_a_script(tmp_path):
    out = tmp_path / "train.json"
    completed = subprocess.run(
        [sys.executable, str(TOOLS / "train_packed.py"), "--device", "cpu", "--steps", "3",
         "--tokens-per-step", "256", "--min-len", "16", "--max-len", "128", "--dim", "32",
         "--no-progress", "--json", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert "summary (3 steps on cpu)" in completed.stdout
    summary = json.loads(out.read_text())
    assert len(summary["losses"]) == 3 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["tokens_per_second"] > 0
    assert summary["backend"]["forward"].startswith("fallback")


def test_train_packed_loss_falls_below_the_answer_entropy(capsys):
    tp = load_tool("train_packed")
    args = tp.parse_args(["--device", "cpu", "--steps", "30", "--tokens-per-step", "1024",
                          "--min-len", "32", "--max-len", "256", "--registers", "2",
                          "--values-per-register", "8", "--lr", "1e-2", "--no-progress"])
    summary = tp.train(args)
    assert summary["first_loss"] > summary["answer_entropy"]
    assert summary["last_loss"] < 0.75 * summary["answer_entropy"]


# ----------------------------------------------------------------------------------------------
# profile, bench, plot, diagnose at tiny sizes
# ----------------------------------------------------------------------------------------------

TINY = ["--device", "cpu", "--seqlens", "200", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--warmup", "1", "--repeats", "1"]


def test_profile_times_every_stage(tmp_path):
    """The forward alone (`--passes fwd`), through the former name: the forward's keys, no
    backward ones."""
    out = tmp_path / "profile.json"
    profile = load_tool("profile_nsa_forward")
    assert profile.main([*TINY, "--num-seqs", "3", "--gate", "--passes", "fwd",
                         "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert [s["stage"] for s in result["stages"]] == list(load_tool("profile_nsa").STAGES)
    assert all(s["ms"] > 0 for s in result["stages"])
    assert result["sequences"] == 3 and result["tokens"] == 200
    assert result["sum_ms"] == pytest.approx(sum(s["ms"] for s in result["stages"]))
    assert result["nsa_forward_ms"] > 0 and result["passes"] == ["fwd"]
    assert "backward_stages" not in result and "nsa_forward_backward_ms" not in result
    # Off the GPU no device time; the glue is the first three stages' share of the sum.
    assert all(s["device_ms"] is None for s in result["stages"])
    assert result["sum_device_ms"] is None and result["nsa_forward_device_ms"] is None
    glue = sum(s["ms"] for s in result["stages"][:3])
    assert result["glue_ms"] == pytest.approx(glue) and result["glue_device_ms"] is None
    assert result["glue_share"] == pytest.approx(glue / result["sum_ms"])


EVERY_BACKWARD_STAGE = [
    "gate weights", "transposed lists",
    "compressed: recompute fwd", "compressed: gate pass", "compressed: attention bwd",
    "compressed: add dq", "compressed: compress bwd",
    "selected: recompute fwd", "selected: gate pass", "selected: attention bwd",
    "selected: add dq",
    "window: recompute fwd", "window: gate pass", "window: attention bwd", "window: add dq",
    "gate backward", "dk, dv to input dtype"]


def test_profile_times_every_forward_and_backward_stage(tmp_path, capsys):
    """Both passes (the default) with learned gates on varlen sequences: every forward and
    backward stage timed, in the table and the JSON, beside nsa() end to end."""
    out = tmp_path / "profile.json"
    profile = load_tool("profile_nsa")
    assert profile.main([*TINY, "--num-seqs", "3", "--gate", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["meta"]["command"].startswith("python tools/profile_nsa.py")
    (result,) = payload["results"]
    assert result["passes"] == ["fwd", "bwd"]
    assert [s["stage"] for s in result["stages"]] == list(profile.STAGES)
    assert [s["stage"] for s in result["backward_stages"]] == EVERY_BACKWARD_STAGE
    assert profile.backward_stages(profile.BRANCH_NAMES, gate=True) == EVERY_BACKWARD_STAGE
    assert all(s["ms"] > 0 for s in result["stages"] + result["backward_stages"])
    assert result["backward_sum_ms"] == pytest.approx(
        sum(s["ms"] for s in result["backward_stages"]))
    assert result["nsa_forward_ms"] > 0 and result["nsa_forward_backward_ms"] > 0
    backends = {s["stage"]: s["backend"] for s in result["backward_stages"]}
    assert backends["selected: attention bwd"].startswith("fallback")
    for stage in [*profile.STAGES, *EVERY_BACKWARD_STAGE, "sum of backward stages",
                  "sum of fwd + bwd stages", "nsa() forward+backward", "glue (first three)"]:
        assert stage in printed


def test_profile_backward_alone_without_window_or_gate(tmp_path):
    """`--passes bwd`: the forward's stages run untimed; no window branch (w=0) and mean
    gating: no window stages and no gate backward."""
    out = tmp_path / "profile.json"
    profile = load_tool("profile_nsa")
    assert profile.main([*TINY, "--passes", "bwd", "--window-size", "0",
                         "--num-cmp-selected-blocks", "1", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert "stages" not in result and "nsa_forward_ms" not in result
    expected = profile.backward_stages(["compressed", "selected"], gate=False)
    assert [s["stage"] for s in result["backward_stages"]] == expected
    assert not any(name.startswith("window") or name == "gate backward" for name in expected)
    assert all(s["ms"] > 0 for s in result["backward_stages"])
    assert result["nsa_forward_backward_ms"] > 0


@pytest.mark.parametrize("value", ["fwd,dq", "", "fwd+bwd"])
def test_profile_rejects_unknown_passes(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool("profile_nsa").main(["--device", "cpu", "--passes", value])
    assert exit_info.value.code == 2
    assert "--passes" in capsys.readouterr().err


def test_bench_and_plot(tmp_path):
    out = tmp_path / "bench.json"
    bench = load_tool("bench_nsa_vs_dense")
    assert bench.main([*TINY, "--seqlens", "128,256", "--methods", "nsa,dense,sdpa,fa4",
                       "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["meta"]["command"].startswith("python tools/bench_nsa_vs_dense.py")
    rows = {(r["seqlen"], r["method"], r["pass"]): r for r in payload["results"]}
    for n in (128, 256):
        for method in ("nsa", "dense", "sdpa"):
            for pass_ in ("fwd", "fwd+bwd"):
                row = rows[(n, method, pass_)]
                assert row["status"] == "ok" and row["ms"] > 0 and row["tflops"] > 0
        assert rows[(n, "dense", "fwd")]["speedup"] == pytest.approx(1.0)
        if not torch.cuda.is_available():
            assert rows[(n, "fa4", "fwd")]["status"].startswith("unavailable")

    forward_only = tmp_path / "forward.json"
    assert bench.main([*TINY, "--methods", "nsa", "--passes", "fwd", "--json",
                       str(forward_only)]) == 0
    assert [r["pass"] for r in json.loads(forward_only.read_text())["results"]] == ["fwd"]

    png = tmp_path / "bench.png"
    assert load_tool("plot_bench").main([str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_switches_set_the_library_constants_and_refuse_anything_else(common, monkeypatch):
    """`--switch MODULE.NAME=VALUE` sets one of kernels/, nsa/ or sparsity/'s UPPER_CASE
    constants for the run (an A/B of a dispatch choice as two runs of one command); everything
    else is refused with the switch named."""
    import kernels.sm90.backward as backward
    import kernels.sm90.spec as spec

    monkeypatch.setattr(backward, "OWNED_DKV_STORES", True)
    monkeypatch.setattr(spec, "FUSED_DQ_MIN_KEYS", spec.FUSED_DQ_MIN_KEYS)
    applied = common.apply_switches(["kernels.sm90.backward.OWNED_DKV_STORES=False",
                                     "kernels.sm90.spec.FUSED_DQ_MIN_KEYS=1"])
    assert backward.OWNED_DKV_STORES is False and spec.FUSED_DQ_MIN_KEYS == 1
    assert applied == ["kernels.sm90.backward.OWNED_DKV_STORES=False",
                       "kernels.sm90.spec.FUSED_DQ_MIN_KEYS=1"]
    assert common.apply_switches(["kernels.sm90.backward.OWNED_DKV_STORES=1"])
    assert backward.OWNED_DKV_STORES is True
    for switch, message in [
            ("kernels.sm90.backward.OWNED_DKV_STORES", "expected MODULE.NAME=VALUE"),
            ("torch.backends.cudnn.enabled=False", "must be in one of"),
            ("kernels.no_such_module.SWITCH=1", "no module kernels.no_such_module"),
            ("kernels.sm90.backward.NO_SUCH_SWITCH=1", "no UPPER_CASE constant NO_SUCH_SWITCH"),
            ("kernels.sm90.backward.run=1", "no UPPER_CASE constant run"),
            ("kernels.sm90.backward.OWNED_DKV_STORES=maybe", "not a Python literal"),
            ("kernels.sm90.spec.FUSED_DQ_MIN_KEYS=1.5", "is of type int, got float")]:
        with pytest.raises(ValueError, match=message):
            common.apply_switches([switch])


def test_switched_puts_the_previous_values_back(common, monkeypatch):
    """`switched`: the switches hold inside the block and the previous values after it, also
    when the block raises; a bad switch sets nothing."""
    import kernels.sm90.backward as backward
    import nsa.function as function

    monkeypatch.setattr(backward, "OWNED_DKV_STORES", True)
    monkeypatch.setattr(function, "SHARED_GATE_PASS", True)
    with common.switched(["kernels.sm90.backward.OWNED_DKV_STORES=False",
                          "nsa.function.SHARED_GATE_PASS=False"]):
        assert backward.OWNED_DKV_STORES is False and function.SHARED_GATE_PASS is False
    assert backward.OWNED_DKV_STORES is True and function.SHARED_GATE_PASS is True
    with pytest.raises(RuntimeError), common.switched(
            ["kernels.sm90.backward.OWNED_DKV_STORES=False"]):
        raise RuntimeError("inside")
    assert backward.OWNED_DKV_STORES is True
    with pytest.raises(ValueError, match="NOPE"):
        with common.switched(["nsa.function.SHARED_GATE_PASS=False", "nsa.function.NOPE=1"]):
            pass
    assert function.SHARED_GATE_PASS is True


def test_profile_kernels_lists_the_step_and_runs_an_ab(capsys, monkeypatch):
    """CPU smoke run: the op table of a forward+backward (ms per step, launches, the total),
    and an A/B whose rounds alternate the library's settings and the switch, left as they
    were after it, each round with its steps' time from an idle device (--from-idle)."""
    import nsa.function as function

    monkeypatch.setattr(function, "SHARED_GATE_PASS", True)
    tool = load_tool("profile_kernels")
    tiny = ["--device", "cpu", "--seqlens", "200", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--warmup", "1", "--repeats", "1", "--top", "5"]
    assert tool.main(tiny) == 0
    out = capsys.readouterr().out
    assert "200 tokens:" in out and "(all)" in out and "ms/step" in out
    assert tool.main([*tiny, "--rounds", "2", "--from-idle", "--switch",
                      "nsa.function.SHARED_GATE_PASS=False"]) == 0
    out = capsys.readouterr().out
    assert "round 1 (A)" in out and "round 2 (B)" in out and "B - A" in out
    assert out.count("ms from an idle GPU") == 2  # --from-idle: a step time per round
    assert function.SHARED_GATE_PASS is True
    assert tool.main([*tiny, "--forward"]) == 0  # a forward alone
    out = capsys.readouterr().out
    assert "nsa() forward," in out and "per forward\n" in out and "(all)" in out
    for bad in (["--switch", "nsa.function.NOPE=1"],
                ["--rounds", "1", "--switch", "nsa.function.SHARED_GATE_PASS=False"],
                ["--packed", "no-such-workload"],
                ["--graph"]):  # a CUDA graph: refused on the CPU
        with pytest.raises(SystemExit):
            tool.main([*tiny, *bad])


def test_profile_kernels_time_only_times_rounds_without_the_profiler(capsys, monkeypatch):
    """--time-only: a step time from an idle device per round and each setting's median, no
    kernel table (the profiler is never started); one setting without --switch; refused with
    the options that read a kernel table."""
    import nsa.function as function

    monkeypatch.setattr(function, "SHARED_GATE_PASS", True)
    tool = load_tool("profile_kernels")

    def no_profiler(*args, **kwargs):
        raise AssertionError("--time-only started the profiler")
    monkeypatch.setattr(tool, "kernel_times", no_profiler)
    tiny = ["--device", "cpu", "--seqlens", "200", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--warmup", "1", "--repeats", "1", "--time-only"]
    assert tool.main([*tiny, "--rounds", "2", "--switch",
                      "nsa.function.SHARED_GATE_PASS=False"]) == 0
    out = capsys.readouterr().out
    assert "round 1 (A)" in out and "round 2 (B)" in out and "(all)" not in out
    assert out.count("ms from an idle GPU per forward+backward") == 2
    assert "median of the rounds, A (the library's settings)" in out and "B - A" in out
    assert function.SHARED_GATE_PASS is True
    assert tool.main(tiny) == 0
    out = capsys.readouterr().out
    assert out.count("ms from an idle GPU per forward+backward (median of 1)") == 1
    for bad in (["--by-launch"], ["--gaps"]):
        with pytest.raises(SystemExit):
            tool.main([*tiny, *bad])


def test_profile_kernels_by_launch_splits_a_kernel_by_its_place_in_the_step(capsys):
    """--by-launch: a kernel launched n > 1 times in every step gets a row per place in the
    step (the branches' attention kernels share one name), in launch order, whatever order
    the profiler lists them in; one launched once a step, or not equally often in every
    step, keeps one row."""
    tool = load_tool("profile_kernels")
    # Two steps: "attn" three times a step (10, 20, 30 us), "fill" once, "odd" 3 times in all.
    recorded = [(130, "attn", 31.0), (0, "attn", 10.0), (5, "fill", 1.0), (10, "attn", 20.0),
                (20, "attn", 30.0), (100, "attn", 11.0), (110, "attn", 21.0),
                (105, "fill", 3.0), (1, "odd", 1.0), (2, "odd", 1.0), (101, "odd", 1.0)]
    rows = collections.defaultdict(float)
    for key, microseconds in tool.launch_order(recorded, steps=2):
        rows[key] += microseconds
    assert rows == {("attn", 1): 21.0, ("attn", 2): 41.0, ("attn", 3): 61.0,
                    ("fill", 0): 4.0, ("odd", 0): 3.0}
    assert tool.main(["--device", "cpu", "--seqlens", "200", "--heads", "4", "--kv-heads", "2",
                      "--head-dim", "16", "--warmup", "1", "--repeats", "2", "--top", "40",
                      "--by-launch"]) == 0
    assert " @2" in capsys.readouterr().out  # some op runs twice or more a step


def test_profile_kernels_idle_report_finds_the_gaps_between_kernels():
    """--gaps: overlapping kernels count once, each idle stretch is named by the kernel that
    ended last before it and the one that starts it, longest first; --gaps with --switch is
    refused."""
    tool = load_tool("profile_kernels")
    # Two steps of 100 us: a (0-40) overlapped by b (30-50), idle 50-60, c (60-100); then d
    # (130-200), e (200-230) back to back: idle 30 us between the steps.
    intervals = [(60, 100, "c"), (0, 40, "a"), (30, 50, "b"), (130, 200, "d"),
                 (200, 230, "e")]
    report = tool.idle_report(intervals, steps=2, top=5)
    assert "span 0.115 ms per step, kernels 0.095, idle 0.020 in 1.0 gaps" in report
    rows = [line.split() for line in report.splitlines()[2:]]
    assert rows == [["30.0", "c", "->", "d"], ["10.0", "b", "->", "c"]]
    with pytest.raises(SystemExit):
        tool.main(["--device", "cpu", "--seqlens", "200", "--gaps", "--switch",
                   "nsa.function.SHARED_GATE_PASS=False"])


def test_profile_kernels_idle_report_counts_steps_from_their_start_marker():
    """--gaps --from-idle: each step starts with a marker of no length (after the sync); the
    idle before a marker (between steps) leaves the span and the gaps, the idle right after
    it is the step's wait before its first kernel, named so."""
    tool = load_tool("profile_kernels")
    start = tool.STEP_START
    # Step 1: marker at 0, idle 0-10 (the host), a 10-50, idle 50-60, b 60-100. The sync: idle
    # to 300. Step 2: marker at 300, idle to 320, c 320-400.
    intervals = [(60, 100, "b"), (0, 0, start), (10, 50, "a"), (300, 300, start),
                 (320, 400, "c")]
    report = tool.idle_report(intervals, steps=2, top=5)
    assert ("span 0.100 ms per step, kernels 0.080, idle 0.020 in 1.5 gaps (of it 0.015 "
            "before the first kernel") in report
    rows = [line.split("  ")[-1] for line in report.splitlines()[2:]]
    assert [float(line.split()[0]) for line in report.splitlines()[2:]] == [20.0, 10.0, 10.0]
    assert rows == [f"{start} -> c", "a -> b", f"{start} -> a"]
    # Without markers the report stays as it was.
    assert "idle between the profiled steps included" in tool.idle_report(
        [(0, 10, "a"), (20, 30, "b")], steps=1, top=5)


def test_profile_kernels_keeps_kernels_that_share_a_long_prefix_apart():
    """The three branches' backward kernels differ only past the table's name width: each
    keeps a row of its own (numbered by first launch), names that fit stay as they are."""
    tool = load_tool("profile_kernels")
    prefix = "k" * tool.NAME_WIDTH
    assert tool.shown_names([prefix + "_window", "short", prefix + "_selected"]) == [
        prefix + " #1", "short", prefix + " #2"]


def test_bench_takes_switches_and_names_them(tmp_path, capsys, monkeypatch):
    import kernels.sm90.backward as backward

    monkeypatch.setattr(backward, "OWNED_DKV_STORES", True)
    bench = load_tool("bench_nsa_vs_dense")
    assert bench.main([*TINY, "--methods", "nsa", "--passes", "fwd",
                       "--switch", "kernels.sm90.backward.OWNED_DKV_STORES=False"]) == 0
    assert "kernels.sm90.backward.OWNED_DKV_STORES=False" in capsys.readouterr().out
    assert backward.OWNED_DKV_STORES is False
    with pytest.raises(SystemExit):
        bench.main([*TINY, "--switch", "nsa.NOPE=1"])
    assert "--switch 'nsa.NOPE=1'" in capsys.readouterr().err


def test_clock_samples_parse_and_summarise_by_window(common):
    """--clocks: nvidia-smi's csv lines become timestamped samples (a line with N/A or a header
    is skipped), and a window gets the medians of the samples inside it and the share with the
    software power cap (bit 0x4); a window without samples gets None. On the CPU the bench
    refuses --clocks by name."""
    import _clocks

    lines = ["timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active",
             "2026/11/30 15:02:17.100, 1965, 420.5, 0x0000000000000000",
             "2026/11/30 15:02:17.120, 1650, 698.0, 0x0000000000000004",
             "2026/11/30 15:02:17.140, 1680, 701.0, 0x0000000000000004",
             "2026/11/30 15:02:17.160, [N/A], 700.0, 0x0000000000000004",
             "2026/11/30 15:02:19.000, 345, 80.0, 0x0000000000000001"]
    samples = [_clocks.parse_sample(line) for line in lines]
    assert samples[0] is None and samples[4] is None
    kept = [sample for sample in samples if sample is not None]
    assert [sample.sm_mhz for sample in kept] == [1965, 1650, 1680, 345]
    assert kept[1].time - kept[0].time == pytest.approx(0.02)
    summary = _clocks.summarise([s for s in kept if s.time <= kept[2].time])
    assert (summary.sm_mhz, summary.watts, summary.samples) == (1680, 698.0, 3)
    assert summary.power_capped == pytest.approx(2 / 3)
    assert _clocks.summarise([]) is None
    bench = load_tool("bench_nsa_vs_dense")
    with pytest.raises(SystemExit):
        bench.main([*TINY, "--methods", "nsa", "--clocks"])
    sampled = bench.Result(8192, "nsa", "fwd+bwd", 2.0, None, 1.5, "ok", sm_mhz=1680.0,
                           watts=698.0, power_capped=summary.power_capped)
    unsampled = bench.Result(8192, "fa4", "fwd+bwd", 3.0, None, 1.0, "ok")
    table = bench.format_table([sampled, unsampled], "fa4").splitlines()
    assert table[1].split()[-4:] == ["MHz", "W", "capped", "status"]
    assert table[3].split()[-4:] == ["1680", "698", "67%", "ok"]
    assert table[4].split()[-4:] == ["-", "-", "-", "ok"]


def test_bench_rounds_interleave_the_methods_and_keep_the_median_round(monkeypatch, capsys,
                                                                      tmp_path):
    """--rounds 3: every method prepared first, then each round times every method's passes in
    an order rotated by one a round; a figure is the median of its rounds' medians, its clock
    windows one per round. A method that runs out of memory in a later round is reported so,
    the others keep their figures."""
    bench = load_tool("bench_nsa_vs_dense")
    args = bench.parse_args([*TINY, "--rounds", "3"])
    calls = []

    def method(name, fails_after=None):
        def run(q, k, v, packing=None):
            calls.append(name)
            if fails_after is not None and len([c for c in calls if c == name]) > fails_after:
                raise torch.OutOfMemoryError("test: no memory left")
            return q * 1.0
        return run
    # ms per (method, pass) in rounds 0, 1, 2: the medians are the middle values.
    figures = {("a", "fwd"): [3.0, 1.0, 2.0], ("a", "fwd+bwd"): [30.0, 10.0, 20.0],
               ("b", "fwd"): [7.0, 9.0, 8.0], ("b", "fwd+bwd"): [70.0, 90.0, 80.0]}
    timed = []

    def fake_time_ms(fn, device, *, warmup, repeats):
        fn()
        name = calls[-1]
        pass_ = ("fwd", "fwd+bwd")[len([t for t in timed if t[0] == name]) % 2]
        timed.append((name, pass_))
        round_index = len([t for t in timed if t == (name, pass_)]) - 1
        return figures.get((name, pass_), [1.0] * 3)[round_index]
    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    runners = {"a": method("a"), "b": method("b"), "c": method("c", fails_after=3)}
    failed = {}
    timings = bench.timed_in_rounds(runners, ["a", "b", "c"], 200, args, None, failed)
    # Round 0: a, b, c; round 1: b, c (out of memory), a; round 2: c dropped, so a, b.
    order = [name for name, pass_ in timed if pass_ == "fwd"]
    assert order == ["a", "b", "c", "b", "a", "a", "b"]
    assert failed == {"c": "out of memory"}
    assert set(timings) == {"a", "b"}
    assert timings["a"]["fwd"][0] == 2.0 and timings["a"]["fwd+bwd"][0] == 20.0
    assert timings["b"]["fwd"][0] == 8.0 and timings["b"]["fwd+bwd"][0] == 80.0
    assert len(timings["a"]["fwd"][2]) == 3  # a clock window per round
    assert timings["a"]["fwd"][3] == [3.0, 1.0, 2.0]  # and each round's figure
    assert bench.rounds_order(["a", "b", "c"], 4) == ["b", "c", "a"]
    # The whole tool, timing for real: the table says what its figures are and how far its
    # rounds spread; the JSON keeps each round's figure.
    monkeypatch.undo()
    out = tmp_path / "rounds.json"
    assert bench.main([*TINY, "--methods", "nsa,dense", "--passes", "fwd", "--rounds", "2",
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "medians of 2 interleaved rounds' medians" in printed
    assert "spread" in printed.splitlines()[3]
    rows = json.loads(out.read_text())["results"]
    assert all(len(row["round_ms"]) == 2 and min(row["round_ms"]) <= row["ms"]
               <= max(row["round_ms"]) for row in rows)


def test_bench_varlen_packs_the_batch_and_reports_padded_only_methods(tmp_path):
    """--num-seqs: every method gets the same packed sequences; ours run them varlen, SDPA and
    fa4-nsa say they take padded inputs only; the attended pairs are the sequences' own."""
    out = tmp_path / "varlen.json"
    bench = load_tool("bench_nsa_vs_dense")
    assert bench.main([*TINY, "--seqlens", "256", "--batch", "2", "--num-seqs", "5",
                       "--methods", "nsa,dense,sdpa", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["meta"]["problem"]["num_seqs"] == 5
    rows = {(r["method"], r["pass"]): r for r in payload["results"]}
    for method in ("nsa", "dense"):
        for pass_ in ("fwd", "fwd+bwd"):
            assert rows[(method, pass_)]["status"] == "ok" and rows[(method, pass_)]["ms"] > 0
    assert "padded inputs only" in rows[("sdpa", "fwd")]["status"]
    args = bench.parse_args([*TINY, "--seqlens", "256", "--batch", "2", "--num-seqs", "5"])
    packing = bench.packing_for(256, args)
    assert len(packing.lengths) == 5 and sum(packing.lengths) == 512
    assert packing.host_cu_seqlens == tuple(packing.cu_seqlens.tolist())
    # The sequences' own causal triangles, not one of the whole batch
    assert bench.attended_pairs("dense", packing.lengths, args) == sum(
        n * (n + 1) // 2 for n in packing.lengths)
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--seqlens", "4", "--num-seqs", "9"])


def test_bench_packed_workloads_run_every_method_on_the_same_documents(tmp_path, capsys):
    """--packed: each workload's documents go to nsa() and our dense varlen attention alike (on
    the CPU: no FA4, no graph, both said), and the summary gives the pair ratio beside the times
    and the speedup's share of it."""
    out = tmp_path / "packed.json"
    bench = load_tool("bench_nsa_vs_dense")
    tiny = ["--device", "cpu", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--warmup", "1", "--repeats", "1", "--passes", "fwd"]
    assert bench.main([*tiny, "--packed", "docs-64,lognormal-64", "--total-tokens", "160,256",
                       "--methods", "nsa,nsa-graph,dense,fa4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "docs-64: 160 tokens in 3 documents, the longest 64" in printed
    assert "share of limit" in printed and "target: 70% of the limit" in printed
    payload = json.loads(out.read_text())
    assert payload["meta"]["problem"]["packed"] == ["docs-64", "lognormal-64"]
    assert "git_commit" in payload["meta"]
    workloads = {w["workload"]: w for w in payload["packed"]["workloads"]}
    assert workloads["docs-64"]["lengths"] == [64, 64, 32]
    assert sum(workloads["lognormal-64"]["lengths"]) == 256
    rows = {(r["workload"], r["method"]): r for r in payload["results"]}
    assert rows[("docs-64", "nsa")]["status"] == "ok" and rows[("docs-64", "nsa")]["seqlen"] == 160
    assert rows[("docs-64", "nsa-graph")]["status"].startswith("unavailable")
    assert rows[("lognormal-64", "fa4")]["status"].startswith("unavailable")
    summary = payload["packed"]["summary"]
    assert [(r["workload"], r["method"], r["dense_method"]) for r in summary] == [
        ("docs-64", "nsa", "dense"), ("lognormal-64", "nsa", "dense")]
    for row in summary:
        pairs = workloads[row["workload"]]
        assert row["pair_ratio"] == pytest.approx(pairs["dense_pairs"] / pairs["nsa_pairs"])
        assert row["share_of_limit"] == pytest.approx(
            row["dense_ms"] / row["pair_ratio"] / row["nsa_ms"])


def test_bench_packed_table_prefers_fa4_as_the_dense_reference():
    bench = load_tool("bench_nsa_vs_dense")
    import packed_workloads
    workload = packed_workloads.build_workload("docs-8k")
    rule = packed_workloads.NSAPairRule(64, 64, 16, 512)

    def result(method, pass_, ms):
        return bench.Result(65536, method, pass_, ms, None, None, "ok", workload="docs-8k")
    results = [result("nsa", "fwd", 10.0), result("nsa-graph", "fwd", 8.0),
               result("dense", "fwd", 40.0), result("fa4", "fwd", 27.0)]
    rows = bench.packed_summary(results, [workload], rule)
    assert [(r["method"], r["dense_method"], r["dense_ms"]) for r in rows] == [
        ("nsa", "fa4", 27.0), ("nsa-graph", "fa4", 27.0)]
    ratio = packed_workloads.attended_pair_ratio(workload.lengths, rule)
    assert rows[1]["speedup"] == pytest.approx(27.0 / 8.0)
    assert rows[1]["share_of_limit"] == pytest.approx(27.0 / 8.0 / ratio)
    table = bench.format_packed_table(rows)
    # docs-8k: ratio 2.70; nsa at 2.70x reaches 100% of the limit, the graph 125%: both ok
    assert "docs-8k" in table and "2.70" in table and "ok" in table and "below" not in table


@pytest.mark.parametrize("argv, message", [
    (["--packed", "docs-1k", "--seqlens", "512"], "drop --seqlens"),
    (["--packed", "docs-1k", "--num-seqs", "2"], "drop --num-seqs"),
    (["--packed", "docs-1k,uniform-2k"], "unknown packed workload 'uniform-2k'"),
    (["--packed", "docs-1k,docs-256", "--total-tokens", "1,2,3"], "--total-tokens"),
    (["--total-tokens", "512"], "--total-tokens needs --packed"),
    (["--packed", "docs-1k", "--branch-profile"], "--branch-profile is padded"),
])
def test_bench_rejects_inconsistent_packed_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool("bench_nsa_vs_dense").main(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_packed_standard_names_the_four_workloads():
    args = load_tool("bench_nsa_vs_dense").parse_args(["--device", "cpu", "--packed", "standard"])
    assert [(w.name, w.total_tokens) for w in args.workloads] == [
        ("lognormal-2k", 65536), ("docs-8k", 65536), ("docs-1k", 16384), ("docs-256", 16384)]
    assert args.seqlens == [65536, 65536, 16384, 16384] and args.batch == 1


def test_bench_branch_profile_times_each_branch_forward_and_backward(tmp_path):
    """--branch-profile: each NSA branch alone on nsa()'s own lists, forward and backward (and
    --deterministic passed through), here on the CPU's fallback; --methods none runs only it."""
    out = tmp_path / "branches.json"
    bench = load_tool("bench_nsa_vs_dense")
    assert bench.main([*TINY, "--seqlens", "128,200", "--methods", "none", "--branch-profile",
                       "--deterministic", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["results"] == [] and payload["meta"]["problem"]["deterministic"] is True
    rows = payload["branch_profile"]
    assert [(r["seqlen"], r["branch"]) for r in rows] == [
        (n, branch) for n in (128, 200) for branch in ("compressed", "selected", "window")]
    for row in rows:
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["bwd_tflops"] > 0
        assert row["bwd_over_fwd"] == pytest.approx(row["bwd_ms"] / row["fwd_ms"])
        assert row["fwd_backend"].startswith("fallback") and row["bwd_backend"].startswith(
            "fallback")
        assert row["transpose_ms"] is None  # no kernel reads transposed lists on the CPU


def test_bench_deterministic_runs_nsa_forward_and_backward(tmp_path):
    out = tmp_path / "deterministic.json"
    bench = load_tool("bench_nsa_vs_dense")
    assert bench.main([*TINY, "--methods", "nsa,dense", "--deterministic", "--json",
                       str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["method"], r["pass"]) for r in rows} == {
        (m, p) for m in ("nsa", "dense") for p in ("fwd", "fwd+bwd")}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows)


def test_plot_rejects_a_file_that_is_not_bench_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": []}))
    with pytest.raises(SystemExit, match="not a bench_nsa_vs_dense JSON"):
        load_tool("plot_bench").main([str(bad)])


def test_diagnose_reports_metadata_and_saved_bytes(tmp_path):
    out = tmp_path / "memory.json"
    assert load_tool("diagnose_memory").main(
        [*TINY, "--seqlens", "256,512", "--num-cmp-selected-blocks", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    for result in results:
        metadata = result["metadata"]
        for key in ("selection", "selected_lists", "selected_lists_transposed",
                    "compressed_lists"):
            assert metadata[key] > 0
        assert metadata["tiles"] == -(-result["seqlen"] // 128)
        assert metadata["kv_blocks"] == -(-result["seqlen"] // 16)
        # Dense attention saves q, k, v, out and lse: more than its inputs.
        assert result["dense"]["saved_for_backward"] > result["inputs"]
        assert result["nsa"]["saved_for_backward"] >= result["inputs"]
    assert results[1]["metadata"]["selected_lists"] > results[0]["metadata"]["selected_lists"]
    # The must-exist tensors: q, out, dout, dq (4 x q), k, v, dk, dv (2 x (k + v)), a float32
    # lse; peaks need CUDA.
    for result in results:
        n = result["seqlen"]
        q_bytes, kv_bytes = n * 4 * 16 * 4, 2 * n * 2 * 16 * 4
        assert result["must_exist"] == 4 * q_bytes + 2 * kv_bytes + 4 * 4 * n
        assert result["nsa"]["peak_fwd_bwd"] is None and result["nsa"]["peak_over_must_exist"] is None


def test_diagnose_without_dense_measures_nsa_alone(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert load_tool("diagnose_memory").main(
        [*TINY, "--seqlens", "256", "--no-dense", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["dense"] is None
    assert result["nsa"]["saved_for_backward"] >= result["inputs"]
    memory_rows = [line for line in capsys.readouterr().out.splitlines()
                   if line.strip().startswith("saved_for_backward")]
    assert memory_rows and memory_rows[0].split()[-1] == "-"  # the dense column is empty


def test_diagnose_max_length_needs_cuda(capsys):
    assert load_tool("diagnose_memory").main([*TINY, "--max-length"]) == 2
    assert "--max-length needs a CUDA device" in capsys.readouterr().err


class _FakeClock:
    """A clock that only the faked trials advance (`_fake_search`)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fake_search(monkeypatch, longest: int, per_trial: float, argv: list[str]):
    """max_length's rows and the trials it ran, with fits faked: N fits iff N <= longest, each
    trial taking per_trial seconds on a fake clock."""
    tool = load_tool("diagnose_memory")
    clock, tried = _FakeClock(), []

    def fake_fits(n, args, backward):
        tried.append((n, backward))
        clock.now += per_trial
        if n > longest:
            return False, dict(error="out of memory")
        return True, dict(peak=n, must_exist=n, stage="backward" if backward else "forward")

    monkeypatch.setattr(tool, "fits", fake_fits)
    args = tool.parse_args([*TINY, "--max-length", *argv])
    return tool.max_length(args, clock=clock), tried


def test_max_length_doubles_then_bisects_to_the_resolution(monkeypatch):
    rows, tried = _fake_search(monkeypatch, longest=5 * 65536 + 100, per_trial=1.0,
                               argv=["--seqlens", "65536", "--passes", "fwd+bwd"])
    assert [n // 65536 for n, _ in tried] == [1, 2, 4, 8, 6, 5]
    assert rows[-1] == dict(pass_="fwd+bwd", max_seqlen=5 * 65536, first_failure=6 * 65536,
                            complete=True)


def test_max_length_time_limit_reports_the_range_found_so_far(monkeypatch, capsys):
    # 2.5 trials' worth of seconds: 64K, 128K and 256K run (the last one starts at 2 s), the
    # 512K trial never starts; the fwd+bwd pass is not started at all.
    rows, tried = _fake_search(monkeypatch, longest=5 * 65536, per_trial=1.0,
                               argv=["--seqlens", "65536", "--time-limit", "2.5"])
    assert [n // 65536 for n, _ in tried] == [1, 2, 4]
    answers = [r for r in rows if "max_seqlen" in r]
    assert answers == [
        dict(pass_="fwd", max_seqlen=4 * 65536, first_failure=None, complete=False),
        dict(pass_="fwd+bwd", max_seqlen=0, first_failure=None, complete=False)]
    out = capsys.readouterr().out
    assert "fwd: stopped by the time limit: 262144 tokens fit, no longer N was tried" in out
    assert "fwd+bwd: not searched" in out


def test_max_length_time_limit_during_the_bisection_keeps_the_bracket(monkeypatch, capsys):
    # 8 x 64K fails at the 4th trial; the 5th (6 x 64K, a fit) ends at 5 s, the limit.
    rows, tried = _fake_search(monkeypatch, longest=6 * 65536 + 1, per_trial=1.0,
                               argv=["--seqlens", "65536", "--passes", "fwd",
                                     "--time-limit", "5"])
    assert [n // 65536 for n, _ in tried] == [1, 2, 4, 8, 6]
    assert rows[-1] == dict(pass_="fwd", max_seqlen=6 * 65536, first_failure=8 * 65536,
                            complete=False)
    assert "the longest N that fits lies in [393216, 524288)" in capsys.readouterr().out


def test_max_length_time_limit_before_anything_fits_says_so(monkeypatch, capsys):
    # 4 x 64K fails at once (the first trial ends at 1 s, the limit); no bisection step runs.
    rows, tried = _fake_search(monkeypatch, longest=65536, per_trial=1.0,
                               argv=["--seqlens", "262144", "--passes", "fwd",
                                     "--time-limit", "1"])
    assert [n // 65536 for n, _ in tried] == [4]
    assert rows[-1] == dict(pass_="fwd", max_seqlen=0, first_failure=4 * 65536, complete=False)
    assert "lies in [0, 262144) (no N tried fits, 262144 does not)" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-3", "inf", "soon"])
def test_diagnose_rejects_a_time_limit_that_is_not_a_positive_number(value, capsys):
    with pytest.raises(SystemExit):
        load_tool("diagnose_memory").parse_args([*TINY, "--max-length", "--time-limit", value])
    assert "--time-limit" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------

def test_nsa_pairs_matches_a_row_by_row_count(common):
    n, l, l_sel, blocks, w = 300, 16, 32, 3, 40
    expected = sum((i + 1) // l + min(i + 1, blocks * l_sel) + min(i + 1, w) for i in range(n))
    assert common.nsa_pairs(n, l, l_sel, blocks, w) == expected
    assert common.causal_pairs(n) == sum(i + 1 for i in range(n))


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000])
def test_closed_form_pair_counts_match_row_by_row_counts(common, n):
    for cap in (0, 1, 40, 512, 5000):
        assert common.capped_causal_pairs(n, cap) == sum(min(i + 1, cap) for i in range(n))
    for factor in (1, 2, 16, 64):
        assert common.compressed_pairs(n, factor) == sum((i + 1) // factor for i in range(n))
        for cap in (0, 1, 3, 20):
            assert common.compressed_pairs(n, factor, cap) == sum(
                min((i + 1) // factor, cap) for i in range(n))


def test_nsa_pairs_caps_the_sparse_compressed_branch(common):
    n, l, l_sel, blocks, w = 70000, 16, 32, 3, 40
    cap = 2 * common.compressed_key_cap(1)  # two KV blocks of compressed tokens
    expected = sum(min((i + 1) // l, cap) + min(i + 1, blocks * l_sel) + min(i + 1, w)
                   for i in range(n))
    assert common.nsa_pairs(n, l, l_sel, blocks, w, num_cmp_selected_blocks=2) == expected
    assert common.compressed_key_cap(None) is None


def test_varlen_lengths_split_exactly(common):
    lengths = common.varlen_lengths(1000, 7, torch.Generator().manual_seed(0))
    assert len(lengths) == 7 and sum(lengths) == 1000 and min(lengths) >= 1
    assert common.cu_seqlens_of(lengths, torch.device("cpu")).tolist()[-1] == 1000
    with pytest.raises(ValueError, match="cannot split"):
        common.varlen_lengths(3, 4, torch.Generator())


def test_time_ms_warms_up_then_takes_the_median(common):
    calls = []
    ms = common.time_ms(lambda: calls.append(sum(range(1000))), torch.device("cpu"),
                        warmup=2, repeats=3)
    assert len(calls) == 5 and ms > 0


def test_interleaved_medians_alternates_the_functions_round_by_round(common):
    """Every round calls each function (2 warm-up + `repeats` timed calls) before the next
    round starts, so no function's calls all come first; each gets its own median."""
    log = []
    slow = lambda: (log.append("slow"), sum(range(20000)))
    fast = lambda: log.append("fast")
    medians = common.interleaved_medians({"slow": slow, "fast": fast}, torch.device("cpu"),
                                         rounds=4, repeats=3)
    assert log.count("slow") == log.count("fast") == 4 * 5
    rounds = [log[i:i + 10] for i in range(0, len(log), 10)]
    assert all(sorted(set(r)) == ["fast", "slow"] and r.count("slow") == 5 for r in rounds)
    assert set(medians) == {"slow", "fast"} and medians["slow"] > medians["fast"] > 0


@pytest.mark.parametrize("text", ["", "12,x", "0,4", "-3"])
def test_int_list_rejects_bad_lists(common, text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        common.int_list(text)


def test_trace_phase_table_reads_cycles_per_phase(common):
    """tools/trace_sm90_forward.py's table from a synthetic buffer with known phase lengths."""
    trace_tool = load_tool("trace_sm90_forward")
    from kernels.sm90.trace import (CONSUMER_EVENTS, KV_TILES_SLOT, PRODUCER_EVENTS,
                                    trace_shape)

    ctas, roles, tiles, slots = trace_shape(num_ctas=2, tile_m=128, num_tiles=6)
    assert (ctas, roles, tiles, slots) == (2, 3, 3, len(CONSUMER_EVENTS) + 1)
    buffer = torch.zeros(ctas, roles, tiles, slots, dtype=torch.int64)
    period = 1000
    for cta in range(ctas):
        for tile in range(tiles):
            start = 5000 + tile * period
            kv_tiles = 1 + tile % 2
            buffer[cta, 0, tile, :len(PRODUCER_EVENTS)] = start + torch.arange(
                len(PRODUCER_EVENTS)) * 10
            for role in (1, 2):
                # Consumer phase i lasts 20 * i cycles; the last event is never stamped.
                steps = torch.tensor([20 * i for i in range(len(CONSUMER_EVENTS) - 1)])
                buffer[cta, role, tile, :len(CONSUMER_EVENTS) - 1] = start + steps.cumsum(0)
                buffer[cta, role, tile, KV_TILES_SLOT] = kv_tiles
    rows = {(role, kv, phase): median
            for role, kv, phase, median, _ in trace_tool.phase_table(buffer)}
    names = CONSUMER_EVENTS
    assert rows[("consumer wg0", 1, f"{names[0]} -> {names[1]}")] == 20
    assert rows[("consumer wg1", 2, f"{names[2]} -> {names[3]}")] == 60
    assert ("consumer wg0", 1, f"{names[-2]} -> {names[-1]}") not in rows  # never stamped
    assert rows[("consumer wg0", 1, "tile period")] == period
    assert rows[("producer", 2, f"{PRODUCER_EVENTS[0]} -> {PRODUCER_EVENTS[1]}")] == 10
    # The producer issued Q at start + 20; consumer warpgroup 0 saw it at start + 60.
    assert rows[("producer->wg0", 1, "Q issued -> ready")] == 60 - 20
    # Both warpgroups were stamped at the same cycles: no offset between them.
    assert rows[("wg1 - wg0", 2, "s0_done")] == 0


def test_bench_kernels_summary_gives_compressed_and_floor_as_shares_of_dense():
    bench = load_tool("bench_kernels")
    rows = [dict(seqlen=n, case=case, ours_tflops=tflops, fa4_tflops=fa4)
            for n, case, tflops, fa4 in [
                (16384, "dense causal", 700.0, 730.0), (16384, "compress_factor 64", 280.0, None),
                (16384, "Q -> O copy (floor)", 364.0, None),
                (16384, bench.PACKED_CASE, 245.0, 146.0), (65536, "dense causal", 680.0, None),
                (65536, "compress_factor 64", 544.0, None)]]
    assert bench.summary(rows) == [
        "N=16384: of our dense causal TFLOP/s: compress_factor 64 40%, Q -> O copy (floor) 52%, "
        f"{bench.PACKED_CASE} (ours, of its own dense) 35%, "
        f"{bench.PACKED_CASE} (fa4, of its own dense) 20%",
        "N=65536: of our dense causal TFLOP/s: compress_factor 64 80%"]


@pytest.mark.parametrize("heads, rows, cols, width", [(2, 5, 7, 3), (3, 4, 9, 9), (1, 6, 1, 1)])
def test_bench_kernels_transposed_lists_match_a_loop(heads, rows, cols, width):
    """FA4's backward lists: per head and KV block, the ascending q tiles listing it."""
    bench = load_tool("bench_kernels")
    generator = torch.Generator().manual_seed(heads * 100 + cols)
    count = torch.randint(0, width + 1, (heads, rows), generator=generator, dtype=torch.int32)
    index = torch.stack([torch.stack([torch.randperm(cols, generator=generator)[:width].sort()
                                      .values for _ in range(rows)]) for _ in range(heads)])
    index = index.to(torch.int32)
    t_count, t_index = bench.transposed_block_lists(count, index, cols)
    assert t_count.shape == (heads, cols) and t_index.dtype == torch.int32
    for h in range(heads):
        for c in range(cols):
            expected = [r for r in range(rows) if c in index[h, r, :count[h, r]].tolist()]
            assert t_count[h, c] == len(expected)
            assert t_index[h, c, :len(expected)].tolist() == expected


def test_bench_kernels_rows_ratios_and_tables():
    """Row fields (forward names unchanged, backward added), TFLOP/s (backward 2.5x the
    forward's flops, forward+backward 3.5x), speed ratios FA4 / ours, 64-key shares, tables."""
    bench = load_tool("bench_kernels")
    pairs, heads, dim = 1e8, 32, 128
    medians = {"ours fwd": 2.0, "fa4 fwd": 3.0, "ours bwd": 4.0, "fa4 bwd": 5.0,
               "ours fwd+bwd": 6.0}
    row = bench.make_row(16384, "block-sparse 25%", pairs, heads, dim, medians)
    forward_tflops = 4 * dim * pairs * heads / 2e-3 / 1e12
    assert row["ours_tflops"] == pytest.approx(forward_tflops)
    assert row["ours_bwd_tflops"] == pytest.approx(2.5 * 4 * dim * pairs * heads / 4e-3 / 1e12)
    assert row["ours_fwdbwd_tflops"] == pytest.approx(3.5 * 4 * dim * pairs * heads / 6e-3 / 1e12)
    assert row["ratio"] == pytest.approx(1.5) and row["bwd_ratio"] == pytest.approx(1.25)
    assert row["fa4_fwdbwd_ms"] is None and row["fwdbwd_ratio"] is None
    forward_only = bench.make_row(16384, "dense causal", pairs, heads, dim,
                                  {"ours fwd": 1.0, "fa4 fwd": 1.0})
    assert forward_only["ratio"] == 1.0 and forward_only["ours_bwd_ms"] is None
    small_blocks = bench.make_row(16384, "block-sparse 25%" + bench.SPARSE_64_SUFFIX, pairs,
                                  heads, dim, {"ours fwd": 2.5, "ours bwd": 8.0})
    rows = [row, forward_only, small_blocks]
    assert bench.sparse_block_shares(rows) == [
        "N=16384: ours at 64-key blocks, of ours at 128-key blocks (TFLOP/s): "
        "block-sparse 25% fwd 80%, block-sparse 25% bwd 50%"]
    assert small_blocks["ours_bwd_tflops_share_of_128key"] == pytest.approx(0.5)
    assert len(bench.forward_table(rows)) == 4 and len(bench.backward_table(rows)) == 3
    assert [line.split()[-4:] for line in bench.ratio_table(rows)[1:]] == [
        ["1.50", "1.25", "-", f"{row['ours_bwd_tflops']:.0f}"],
        ["1.00", "-", "-", "-"], ["-", "-", "-", f"{small_blocks['ours_bwd_tflops']:.0f}"]]


def test_tune_rejects_unknown_cases_before_needing_a_gpu(capsys):
    tune = load_tool("tune_sm90_forward")
    with pytest.raises(SystemExit):
        tune.main(["--cases", "window,bogus"])
    assert "--cases: unknown ['bogus']" in capsys.readouterr().err


def test_tune_packed_cases_split_the_tokens_into_sequences():
    tune = load_tool("tune_sm90_forward")
    assert tune.packed_lengths(16384, "packed256") == [256] * 64
    mixed = tune.packed_lengths(16384, "mixed32")
    assert len(mixed) == 32 and sum(mixed) == 16384 and min(mixed) >= 1
    assert mixed == tune.packed_lengths(16384, "mixed32")  # seeded
    with pytest.raises(ValueError, match="packed1024"):
        tune.packed_lengths(1500, "packed1024")
    name, pairs, kwargs, fa4_kwargs, n_k, lengths = next(tune.cases(1024, 4, ["packed256"]))
    assert lengths == [256] * 4 and n_k == 1024 and kwargs == dict(causal=True)
    assert pairs == 4 * 256 * 257 // 2


def test_tune_nsa_case_needs_the_kv_heads_of_its_shared_lists():
    tune = load_tool("tune_sm90_forward")
    with pytest.raises(ValueError, match="nsa16: lists per KV head need heads_kv"):
        next(tune.cases(1024, 4, ["nsa16"]))


def test_docs_dispatch_table_is_the_dispatchers():
    table = load_tool("dispatch_table").table()
    docs = (REPO / "docs" / "kernels.md").read_text()
    assert "\n".join(table) in docs, "docs/kernels.md: rerun `python tools/dispatch_table.py`"


def test_sanitize_case_needs_an_sm90_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU answer only")
    assert load_tool("sanitize_sm90_backward").main([]) == 1
    assert "needs an sm_90 GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_profile_host_needs_a_gpu(capsys):
    assert load_tool("profile_host").main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_profile_host_per_call_table_reports_microseconds_and_calls_per_step():
    import cProfile
    import pstats

    tool = load_tool("profile_host")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(4):
        sorted(range(10))
        sorted(range(10))
    profile.disable()
    text = tool.per_call_table(pstats.Stats(profile), 4, 3, "probe")
    assert text.count("--- probe, 4 calls, by") == 2
    row = next(line for line in text.splitlines() if "sorted" in line)
    own, cumulative, calls = (float(x) for x in row.split()[:3])
    assert calls == 2.0 and 0 < own <= cumulative  # two calls a step, in us per step


def test_profile_host_first_launch_records_the_first_launcher_call_and_restores(monkeypatch):
    import types

    tool = load_tool("profile_host")
    calls = []
    module = types.ModuleType("kernels._first_launch_probe")
    module.launch_compiled = lambda *args: calls.append(("compiled", args))
    module.launch_on_current_stream = lambda *args: calls.append(("glue", args))
    originals = (module.launch_compiled, module.launch_on_current_stream,
                 torch.cuda.CUDAGraph.replay)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with tool.FirstLaunch() as first:
        assert first.at is None
        before = tool.time.perf_counter()
        module.launch_on_current_stream(1)
        at = first.at
        module.launch_compiled(2)
    assert at is not None and before <= at <= first.at  # the first call's time, kept
    assert calls == [("glue", (1,)), ("compiled", (2,))]  # each launcher still ran
    assert (module.launch_compiled, module.launch_on_current_stream,
            torch.cuda.CUDAGraph.replay) == originals


def test_run_gpu_tests_deals_every_test_once_round_robin():
    tool = load_tool("run_gpu_tests")
    ids = [f"t::{i}" for i in range(10)]
    shards = tool.deal(ids, 4)
    assert shards == [ids[0::4], ids[1::4], ids[2::4], ids[3::4]]
    assert sorted(sum(shards, [])) == sorted(ids)


def test_run_gpu_tests_reads_pytest_counts():
    tool = load_tool("run_gpu_tests")
    assert tool.counts("== 3 failed, 120 passed, 2 skipped, 1 error in 10.0s ==") == {
        "failed": 3, "passed": 120, "skipped": 2, "error": 1}


def test_run_gpu_tests_names_the_failed_tests():
    tool = load_tool("run_gpu_tests")
    log = "\n".join([
        "tests/a.py::test_x[case-1] FAILED                                   [ 50%]",
        "=========================== short test summary info ===========================",
        "FAILED tests/a.py::test_x[case-1] - AssertionError: assert 0.02 < 0.01",
        "ERROR tests/b.py::test_y - RuntimeError: CUDA error",
        "FAILED to collect nothing here",
        "== 1 failed, 3 passed, 1 error in 9.1s =="])
    assert tool.failures(log) == ["FAILED tests/a.py::test_x[case-1]",
                                  "ERROR tests/b.py::test_y"]
    assert tool.failures("== 4 passed in 1.0s ==") == []


def test_run_gpu_tests_keeps_shards_inside_the_callers_visible_devices(monkeypatch):
    tool = load_tool("run_gpu_tests")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert tool.visible_devices(2) == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert tool.visible_devices(3) == ["0", "1", "2"]


def test_run_gpu_tests_keeps_whole_gpu_tests_out_of_the_shared_shards():
    tool = load_tool("run_gpu_tests")
    path = ["tests/nsa/test_nsa_two_million_tokens.py"]
    alone = tool.collect(path, f"(gpu) and {tool.WHOLE_GPU}", allow_empty=True)
    assert len(alone) == 1 and "two_million" in alone[0]
    assert tool.collect(path, f"(gpu) and not {tool.WHOLE_GPU}", allow_empty=True) == []


def test_run_gpu_tests_stops_its_shards_and_what_they_started():
    """A caller's timeout must not leave shards running on the GPUs: _stop kills each shard's
    process group (here a shell and the sleep it started)."""
    import subprocess
    import time

    tool = load_tool("run_gpu_tests")
    shard = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    time.sleep(0.2)
    tool._stop([shard])
    assert shard.poll() is not None
    # Left in the group: only zombies (killed, not yet reaped by init), no running process.
    states = subprocess.run(["ps", "-o", "stat=", "-g", str(shard.pid)], capture_output=True,
                            text=True).stdout.split()
    assert all(state.startswith("Z") for state in states), states


# ----------------------------------------------------------------------------------------------
# --context-parallel N of bench_nsa_vs_dense and diagnose_memory (run by bench_context_parallel)
# ----------------------------------------------------------------------------------------------

TINY_NSA = ["--device", "cpu", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--compress-block-size", "16", "--selected-block-size", "32",
            "--num-selected-blocks", "5", "--window-size", "32"]


def test_bench_nsa_vs_dense_times_nsa_across_the_ranks(tmp_path, capsys):
    """A group of one process (gloo): the problem reaches bench_context_parallel, which checks
    it against one-process nsa() per length (bitwise) and writes one row per length."""
    path = tmp_path / "cp.json"
    code = load_tool("bench_nsa_vs_dense").main(
        [*TINY_NSA, "--context-parallel", "1", "--seqlens", "128,256", "--num-seqs", "2",
         "--gate", "--warmup", "1", "--repeats", "1", "--json", str(path)])
    assert code == 0
    rows = json.loads(path.read_text())["results"]
    assert [row["seqlen"] for row in rows] == [128, 256]
    assert all(row["bitwise_equal_one_device"] and row["weights"] for row in rows)
    assert all(row["num_seqs"] == 2 and row["heads"] == 2 for row in rows)
    assert "nsa context parallel: 1 ranks" in capsys.readouterr().out


def test_diagnose_memory_across_the_ranks_reports_each_length(capsys):
    code = load_tool("diagnose_memory").main(
        [*TINY_NSA, "--context-parallel", "1", "--seqlens", "128"])
    assert code == 0
    assert "N=128 on 1 ranks: forward+backward peak - (CPU)" in capsys.readouterr().out


def test_context_parallel_needs_its_ranks_and_one_sequence(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="runs under torchrun --nproc-per-node 4"):
        load_tool("diagnose_memory").main([*TINY_NSA, "--context-parallel", "4"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="--batch 1"):
        load_tool("diagnose_memory").main([*TINY_NSA, "--context-parallel", "1", "--batch", "2"])
    with pytest.raises(SystemExit) as exit_info:
        load_tool("bench_nsa_vs_dense").main(["--device", "cpu", "--context-parallel", "2",
                                              "--packed", "docs-256"])
    assert exit_info.value.code == 2
    assert "not with --packed" in capsys.readouterr().err


def test_the_delegated_command_line_carries_the_problem():
    tool = load_tool("bench_nsa_vs_dense")
    args = tool.parse_args([*TINY_NSA, "--seqlens", "256", "--num-cmp-selected-blocks", "2",
                            "--deterministic", "--recompute", "keep"])
    argv = sys.modules["bench_context_parallel"].delegated_argv(args, 256)
    assert argv[argv.index("--num-cmp-selected-blocks") + 1] == "2"
    assert "--no-weights" in argv and "--deterministic" in argv  # mean gates: no weights
    assert argv[argv.index("--recompute") + 1] == "keep"
    assert argv[argv.index("--window-size") + 1] == "32"


# ----------------------------------------------------------------------------------------------
# bench_masked: masks and biases against FlexAttention and SDPA
# ----------------------------------------------------------------------------------------------

def test_bench_masked_times_every_workload_on_the_cpu(tmp_path, capsys):
    """A tiny run on the fallback: every workload (windows, the tile mask with and without the
    bias) gets its passes, the JSON rows say what they counted."""
    out = tmp_path / "masked.json"
    rows = load_tool("bench_masked").main([
        "--device", "cpu", "--seqlen", "256", "--heads", "2", "--head-dim", "64", "--windows",
        "32,300", "--methods", "ours,ours-prepared,sdpa,dense", "--warmup", "0", "--repeats",
        "1", "--json", str(out)])
    names = [row["workload"] for row in rows]
    assert names == ["window 32", "window 300", "tiles10", "tiles10 mask only"]
    for row in rows:
        for method in ("ours", "ours-prepared", "sdpa", "dense"):
            assert row["ms"][f"{method} fwd"] > 0 and row["ms"][f"{method} fwd+bwd"] > 0
        assert 0 < row["kept_share"] <= 1
    assert rows[0]["kept_share"] < rows[1]["kept_share"]
    assert rows[-1]["bias_heads"] == 0 and rows[0]["bias_heads"] == 1
    assert json.loads(out.read_text())["results"][0]["workload"] == "window 32"
    assert "flex/ours  flex/prepared" in capsys.readouterr().out
    for row in rows:  # both of ours checked: the tensor mask and the prepared one
        assert set(row["check"]) == {"ours", "ours-prepared"}
        for errors in row["check"].values():
            assert set(errors) == ({"out", "dq"} if row is rows[-1] else {"out", "dq", "dbias"})
            assert all(error < 1e-3 for error in errors.values())


def test_bench_masked_refuses_to_time_a_wrong_result(monkeypatch):
    """The check before timing: ours made wrong (its out scaled) stops the run, naming what
    differs."""
    tool = load_tool("bench_masked")
    right = tool.flash_attn_func
    monkeypatch.setattr(tool, "flash_attn_func", lambda *a, **kw: right(*a, **kw) * 1.1)
    with pytest.raises(RuntimeError, match="differs from the torch path.*out"):
        tool.main(["--device", "cpu", "--seqlen", "600", "--heads", "2", "--head-dim", "64",
                   "--windows", "32", "--no-tiles", "--methods", "ours", "--warmup", "0",
                   "--repeats", "1"])


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ours,flash"], "--methods"), (["--passes", "bwd"], "--passes"),
    (["--bias-heads", "3"], "--bias-heads")])
def test_bench_masked_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool("bench_masked").main(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
