"""Time each stage of the NSA forward and backward.

Forward (`--passes fwd`): compression, selection, block lists, each branch, gating. Backward
(`--passes bwd`): the stages nsa.function._gradients runs with `recompute=True` (where nsa()
keeps the branch outputs, its default up to 1/8 of the GPU's memory, the recompute rows do not
run and the gate pass reads the kept output: nsa/memory_policy.py): the gate weights, the transposed lists
(built once), then per branch the recompute of its forward (for the compressed branch with the
compression of K and V), its gate pass (nsa.function.gate_pass: dL/dg, and g_b * dO where
the attention backward is not the sm90 kernel, which takes the gate folded into lse; on the
sm90 kernels the recomputing forward writes dL/dg itself, nsa.function.fused_gate_pass, and
the gate pass row reads 0), its
attention backward
(Branch.backward with the branch's transposed lists, adding dk, dv into the running float32
sums), the add of its dq into the running dq and, for the compressed branch, compress_backward
of dK and dV; then the gate backward (with `--gate`) and last the conversion of the dk, dv sums
to the input dtype. Both passes by default.

Every stage runs through the library's own functions (nsa.compression, nsa.selection,
nsa.branches, nsa.gating) with the host copies of the sequence bounds NSAFunction holds, each
timed alone on the previous stage's real outputs: `--warmup` untimed calls, then the median of
`--repeats`, CUDA events on a GPU and perf_counter on the CPU. The last rows time nsa() end to end
(forward; forward+backward) for comparison with the sums. The backward needs the forward's
outputs: with `--passes bwd` the forward stages run once, untimed.

On a GPU each stage gets two times. "eager ms": the events span the host's work too, what an
eager caller waits for; at 16K a stage of a few launches is host-bound there (compression's
10-us kernels read 0.2 ms). "device ms": a spin kernel queued first lets the host enqueue the
whole stage before the start event (`_common.time_ms(gpu_only=True)`), so the events bracket
the launched work alone, as a CUDA graph replays it; the shares are of the device times.

    python tools/profile_nsa.py                                  # per-device default sizes
    python tools/profile_nsa.py --seqlens 65536 --json profile.json
    python tools/profile_nsa.py --passes fwd                     # the forward alone
    python tools/profile_nsa.py --num-seqs 8                     # varlen: 8 random lengths

tools/profile_nsa_forward.py, its former name, runs this tool with the same arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402
from kernels.gated_sum import GatedSum, backward_runs_on_sm90  # noqa: E402
from kernels.row_means import runs_on_sm90  # noqa: E402
from nsa import CMP_KV_BLOCK, SELECTION_Q_TILE, nsa  # noqa: E402
from nsa.compression import (compress_backward, compress_pair,  # noqa: E402
                             compressed_cu_seqlens, compute_dtype)
from nsa.function import (compressed_starts, describe_branches, fused_gate_pass,  # noqa: E402
                          gate_pass, select_for_branches, window_covered)
from nsa.gating import NUM_BRANCHES, gate_backward, gate_weights  # noqa: E402
from nsa.validation import validate_nsa_call  # noqa: E402
from nsa.window_covered import folded_gates, unfold_gate_gradients  # noqa: E402
from _common import (  # noqa: E402
    add_cmp_selected_argument, add_num_seqs_argument, add_problem_arguments, check_num_seqs, cu_seqlens_of, describe_device, measure_seqlens, nsa_options,
    problem_defaults_epilog, problem_summary, random_gate, random_qkv,
    resolve_problem_arguments, time_ms, varlen_lengths)

STAGES = ("compress k, v", "select blocks", "build block lists", "compressed branch",
          "selected branch", "window branch", "gate + combine")
GLUE_STAGES = STAGES[:3]  # issue 15's glue: at most 15% of the forward
PASSES = ("fwd", "bwd")
BRANCH_NAMES = ("compressed", "selected", "window")  # nsa.branches' order (Branch.index)
GATE_WEIGHTS, TRANSPOSED_LISTS, GATE_BACKWARD, GRADIENT_SUMS = (
    "gate weights", "transposed lists", "gate backward", "dk, dv to input dtype")
# Per branch, "<branch>: <step>"; the compressed branch adds COMPRESS_BACKWARD.
BRANCH_BACKWARD_STEPS = ("recompute fwd", "gate pass", "attention bwd", "add dq")
COMPRESS_BACKWARD = "compress bwd"


def backward_stages(branch_names, gate: bool) -> list[str]:
    """The backward's stage names, in the order they run, for these branches (by name)."""
    stages = [GATE_WEIGHTS, TRANSPOSED_LISTS]
    for name in branch_names:
        stages += [f"{name}: {step}" for step in BRANCH_BACKWARD_STEPS]
        if name == BRANCH_NAMES[0]:
            stages.append(f"{name}: {COMPRESS_BACKWARD}")
    if gate:
        stages.append(GATE_BACKWARD)
    stages.append(GRADIENT_SUMS)
    return stages


def passes_list(text: str) -> list[str]:
    """'fwd,bwd' -> ["fwd", "bwd"]: a non-empty subset of PASSES."""
    passes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(passes) - set(PASSES))
    if not passes or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(PASSES)}, got {text!r}")
    return [p for p in PASSES if p in passes]


def packed_problem(seqlen: int, args):
    """Packed q, k, v, cu_seqlens, max_seqlen: batch x seqlen tokens in num_seqs sequences
    (equal lengths when num_seqs == batch, the padded case)."""
    total = args.batch * seqlen
    if args.num_seqs is None:
        lengths = [seqlen] * args.batch
    else:
        lengths = varlen_lengths(total, args.num_seqs, torch.Generator().manual_seed(3))
    q, k, v = random_qkv((total, args.heads, args.head_dim), (total, args.kv_heads, args.head_dim),
                         args.torch_dtype, args.device)
    return q, k, v, cu_seqlens_of(lengths, args.device), max(lengths)


def profile(seqlen: int, args) -> dict:
    q, k, v, cu_seqlens, max_seqlen = packed_problem(seqlen, args)
    W_gate = random_gate(args.heads, args.head_dim, args.torch_dtype, args.device) \
        if args.gate else None
    config, sequences = validate_nsa_call(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, W_k=None, W_v=None,
        W_gate=W_gate, causal=True, softmax_scale=None,
        q_tile=SELECTION_Q_TILE,
        cmp_kv_block=CMP_KV_BLOCK, **nsa_options(args))
    l = config.compress_block_size
    forward_timed = "fwd" in args.passes

    def timed(fn) -> tuple[float, float | None]:
        """(eager ms, device ms or None off the GPU) of fn (the module docstring)."""
        eager = time_ms(fn, args.device, warmup=args.warmup, repeats=args.repeats)
        if args.device.type != "cuda":
            return eager, None
        return eager, time_ms(fn, args.device, warmup=0, repeats=args.repeats, gpu_only=True)

    # End to end as a training loop calls it: with the host copy of the bounds (without it
    # nsa() reads cu_seqlens back, a sync that the device-time column would count as work).
    host_cu_seqlens = tuple(cu_seqlens.tolist())

    def nsa_call(q_, k_, v_, W_gate_):
        return nsa(q_, k_, v_, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, W_gate=W_gate_,
                   host_cu_seqlens=host_cu_seqlens,
                   **nsa_options(args))

    # Each stage as NSAFunction.forward runs it, with the host copies of the sequence bounds it
    # holds (so the branches take the trusted kernel entry, without device reads); the next
    # stage reads this one's outputs.
    def compress_kv():
        cu_cmp = compressed_cu_seqlens(cu_seqlens, l)
        starts = compressed_starts(cu_seqlens, cu_cmp, sequences, config)
        k_cmp, v_cmp = compress_pair((k, v), starts, l, (None, None))
        return cu_cmp, k_cmp, v_cmp.to(v.dtype)

    def select():
        return select_for_branches(q, k_cmp, cu_seqlens, cu_seqlens_cmp, sequences, config)

    def build_branches():
        return describe_branches(selection, cu_seqlens, cu_seqlens_cmp, sequences, config)

    def gate_and_combine():
        # On sm90 the sum lands in the first output's storage: the terms are copies made for
        # this stage, which drift (a gated mean of random tensors) but never become zeros.
        total = GatedSum(folded_gates(gate_weights(q, W_gate, config.branches),
                                      window_covered(cu_seqlens, sequences, config)), like=q)
        for branch, branch_out in zip(branches, combine_terms):
            total.add(branch.index, branch_out)
        return total.result()

    rows = []

    def stage(name, fn, backend, into=None):
        """fn()'s result; its time appended to `into` (rows by default) when the pass is timed.
        backend: a label, or a function of the result giving it."""
        result = fn()
        if forward_timed or into is not None:
            label = backend(result) if callable(backend) else backend
            (rows if into is None else into).append((name, timed(fn), label))
        return result

    cu_seqlens_cmp, k_cmp, v_cmp = stage(
        STAGES[0], compress_kv,
        "sm90 kernel (row means)" if runs_on_sm90([k.flatten(1)]) else "torch")
    # The sm90 selection kernel writes the selected branch's lists too (then the list stage
    # builds the other branches' lists only).
    selection = stage(STAGES[1], select, lambda result: "torch" if result.selected_lists is None
                      else "sm90 kernel (+ selected lists)")
    branches = stage(STAGES[2], build_branches, "torch (sparsity)")

    k_cmp = k_cmp.to(k.dtype)
    branch_outputs, lses = [], []
    for name, branch in zip(STAGES[3:6], branches):
        keys, values = (k_cmp, v_cmp) if branch.reads_compressed else (k, v)
        branch_out, lse = stage(name, lambda: branch.forward(q, keys, values),
                                kernels.which_backend(q, keys, values, **branch.kernel_kwargs))
        branch_outputs.append(branch_out)
        lses.append(lse)
    result = {"seqlen": seqlen, "tokens": q.shape[0], "sequences": len(cu_seqlens) - 1,
              "passes": list(args.passes)}
    if forward_timed:
        combine_terms = [t.clone() for t in branch_outputs]
        rows.append((STAGES[6], timed(gate_and_combine), GatedSum.choose_backend(q)[0]))
        del combine_terms
        end_to_end = timed(lambda: nsa_call(q, k, v, W_gate))
        selected_lists = branches[1].kernel_kwargs["block_sparse"]
        stages = stage_rows("stages", "sum", rows)
        result.update({
            **stages,
            "nsa_forward_ms": end_to_end[0], "nsa_forward_device_ms": end_to_end[1],
            **glue_of(stages),
            "selected_lists_per_tile": int(selected_lists.full_index.shape[-1]
                                           + selected_lists.mask_index.shape[-1]),
        })
    del k_cmp, v_cmp
    if "bwd" in args.passes:
        result.update(profile_backward(q, k, v, W_gate, cu_seqlens, cu_seqlens_cmp, sequences,
                                       config, branches, branch_outputs, lses, stage, timed,
                                       nsa_call, args))
    return result


def profile_backward(q, k, v, W_gate, cu_seqlens, cu_seqlens_cmp, sequences, config, branches,
                     branch_outputs, lses, stage, timed, nsa_call, args) -> dict:
    """The backward's stages as nsa.function._gradients runs them, on a random dO, each timed
    alone on the previous stage's outputs; then nsa() forward+backward end to end."""
    rows = []
    dtype = compute_dtype(q.dtype)
    l = config.compress_block_size
    generator = torch.Generator().manual_seed(7)
    dout = torch.randn(q.shape, generator=generator).to(device=q.device, dtype=q.dtype)
    d_gates = torch.zeros(*q.shape[:2], NUM_BRANCHES, dtype=dtype, device=q.device)
    # The gates and those the branch outputs were summed with (nsa/window_covered.py): the
    # passes read the folded ones, gate_backward the gates, as in packed_gradients.
    covered = window_covered(cu_seqlens, sequences, config)

    def gate_weights_and_folded():
        weights = gate_weights(q, W_gate, config.branches)
        return weights, folded_gates(weights, covered).contiguous()
    gates, summed_gates = stage(GATE_WEIGHTS, gate_weights_and_folded, "torch", into=rows)
    gate_backend = "sm90" if backward_runs_on_sm90(q, d_gates) else "torch"
    # The running gradients as packed_gradients keeps them: dq in q's dtype, dk, dv in float32.
    sums = {"q": None, "k": None, "v": None}

    def transpose_all():
        return {branch.index: branch.transposed_lists() for branch in branches}

    transposed = transpose_all()
    transposed_backend = ("sparsity" if any(t is not None for t in transposed.values())
                          else "none (no kernel reads them)")
    stage(TRANSPOSED_LISTS, transpose_all, transposed_backend, into=rows)

    for branch, lse in zip(branches, lses):
        name = BRANCH_NAMES[branch.index]

        def branch_keys():
            if branch.reads_compressed:
                block_starts = compressed_starts(cu_seqlens, cu_seqlens_cmp, sequences, config)
                keys, values = (x_cmp.to(k.dtype) for x_cmp in compress_pair(
                    (k, v), block_starts, l, (None, None)))
                return block_starts, keys, values
            return None, k, v

        def recompute():
            block_starts, keys, values = branch_keys()
            return (block_starts, keys, values, *branch.forward(q, keys, values))

        block_starts, keys, values = branch_keys()
        branch_out = None  # recomputed only off the fused path
        options = dict(deterministic=config.deterministic,
                       block_sparse_transposed=transposed[branch.index])
        # As nsa() does: the backward checked and dispatched once per branch, for these keys
        plan = branch.plan_backward(q, keys, values, **options)
        on_kernel = plan is not None
        fused = on_kernel and fused_gate_pass(branch, dout, q, keys, values, summed_gates,
                                              d_gates, lse, plan) is not None
        if fused:  # the recomputing forward writes the gate gradient, not the output
            def recompute_row_dots():
                # The plan holds these keys, so the compression is not timed again here
                return fused_gate_pass(branch, dout, q, keys, values, summed_gates, d_gates,
                                       lse, plan)

            step = stage(f"{name}: {BRANCH_BACKWARD_STEPS[0]}", recompute_row_dots,
                         "sm90, writes <dO, o_b> (gate pass included; compression not "
                         "timed)", into=rows)
            rows.append((f"{name}: {BRANCH_BACKWARD_STEPS[1]}", (0.0, 0.0), "in recompute fwd"))
        else:  # the output recomputed (timed with the compression); the plan keeps these keys
            branch_out, _ = branch.forward(q, keys, values)
            rows.append((f"{name}: {BRANCH_BACKWARD_STEPS[0]}", timed(recompute),
                         kernels.which_backend(q, keys, values, **branch.kernel_kwargs)))
            step = stage(f"{name}: {BRANCH_BACKWARD_STEPS[1]}",
                         lambda: gate_pass(branch.index, dout, branch_out, summed_gates,
                                           d_gates, lse, on_kernel=on_kernel),
                         gate_backend, into=rows)
        if not branch.reads_compressed and sums["k"] is None:
            sums["k"], sums["v"] = (torch.zeros(x.shape, dtype=dtype, device=x.device)
                                    for x in (k, v))
        accumulators = None if branch.reads_compressed else (sums["k"], sums["v"])
        asked = {key: value for key, value in options.items()
                 if value is not None and value is not False}
        # Timed repeats add into the sums again: they drift, they never become zeros.
        dq_b, dk_b, dv_b = stage(
            f"{name}: {BRANCH_BACKWARD_STEPS[2]}",
            lambda: branch.backward(step.dout, q, keys, values, step.out, step.lse,
                                    dout_dot_out=step.dout_dot_out, lse_gate=step.lse_gate,
                                    dkv_accumulators=accumulators, plan=plan, **options),
            kernels.which_backend(q, keys, values, backward=True, **asked,
                                  **branch.kernel_kwargs), into=rows)
        if sums["q"] is None:
            sums["q"] = dq_b.clone()
        stage(f"{name}: {BRANCH_BACKWARD_STEPS[3]}", lambda: sums["q"].add_(dq_b), "torch",
              into=rows)
        if branch.reads_compressed:
            (dk_x, _), (dv_x, _) = stage(
                f"{name}: {COMPRESS_BACKWARD}",
                lambda: (compress_backward(dk_b, k, block_starts, l),
                         compress_backward(dv_b, v, block_starts, l)), "torch", into=rows)
            sums["k"], sums["v"] = dk_x, dv_x
        del block_starts, keys, values, branch_out, step, dq_b, dk_b, dv_b, plan

    if W_gate is not None:
        def unfolded_gate_backward():
            unfold_gate_gradients(d_gates, covered)
            return gate_backward(q, W_gate, gates, d_gates, sums["q"])
        stage(GATE_BACKWARD, unfolded_gate_backward, "torch", into=rows)
    stage(GRADIENT_SUMS, lambda: [sums[x].to(k.dtype) for x in ("k", "v")], "torch", into=rows)

    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    if W_gate is not None:
        inputs.append(W_gate.detach().requires_grad_())

    def forward_backward():
        out = nsa_call(*inputs[:3], inputs[3] if W_gate is not None else None)
        return torch.autograd.grad(out, inputs, dout)

    end_to_end = timed(forward_backward)
    return {**stage_rows("backward_stages", "backward_sum", rows),
            "nsa_forward_backward_ms": end_to_end[0],
            "nsa_forward_backward_device_ms": end_to_end[1]}


def stage_rows(key: str, sum_key: str, rows) -> dict:
    """The JSON of (name, (eager ms, device ms), backend) rows and their sums."""
    device = [timing[1] for _, timing, _ in rows]
    return {key: [{"stage": name, "ms": timing[0], "device_ms": timing[1], "backend": backend}
                  for name, timing, backend in rows],
            f"{sum_key}_ms": sum(timing[0] for _, timing, _ in rows),
            f"{sum_key}_device_ms": None if None in device else sum(device)}


def glue_of(forward: dict) -> dict:
    """Compression + selection + list building (the GLUE_STAGES rows of the forward's
    `stage_rows`): eager and device ms, and their share of the stages' sum (of device time on
    a GPU)."""
    glue = [stage for stage in forward["stages"] if stage["stage"] in GLUE_STAGES]
    eager = sum(stage["ms"] for stage in glue)
    if forward["sum_device_ms"] is None:
        return {"glue_ms": eager, "glue_device_ms": None,
                "glue_share": eager / max(forward["sum_ms"], 1e-12)}
    device = sum(stage["device_ms"] for stage in glue)
    return {"glue_ms": eager, "glue_device_ms": device,
            "glue_share": device / max(forward["sum_device_ms"], 1e-12)}


def _table(title: str, stages, total_ms, total_device_ms, width: int) -> list[str]:
    """Rows of eager ms, device ms and the share (of device time on a GPU, else of eager)."""
    on_device = total_device_ms is not None
    total = total_device_ms if on_device else total_ms
    share = "share dev" if on_device else "share"
    lines = [f"  {title:<{width}} {'eager ms':>10} {'device ms':>10} {share:>9}  backend",
             "  " + "-" * (width + 40)]
    for stage in stages:
        part = stage["device_ms"] if on_device else stage["ms"]
        lines.append(f"  {stage['stage']:<{width}} {_ms_pair(stage['ms'], stage['device_ms'])} "
                     f"{part / total if total else 0.0:9.1%}  {stage['backend']}")
    return lines


def _ms_pair(eager: float, device: float | None) -> str:
    return f"{eager:10.3f} {'-' if device is None else f'{device:.3f}':>10}"


def format_profile(result: dict) -> str:
    lines = [f"N={result['seqlen']} ({result['tokens']} tokens in {result['sequences']} "
             f"sequences)"]
    if "stages" in result:
        lines += _table("stage", result["stages"], result["sum_ms"], result["sum_device_ms"], 20)
        lines.append(f"  {'sum of stages':<20} "
                     f"{_ms_pair(result['sum_ms'], result['sum_device_ms'])}")
        lines.append(f"  {'glue (first three)':<20} "
                     f"{_ms_pair(result['glue_ms'], result['glue_device_ms'])} "
                     f"{result['glue_share']:9.1%}  of the sum")
        lines.append(f"  {'nsa() forward':<20} "
                     f"{_ms_pair(result['nsa_forward_ms'], result['nsa_forward_device_ms'])}"
                     f"  (end to end)")
    if "backward_stages" in result:
        if "stages" in result:
            lines.append("")
        lines += _table("backward stage", result["backward_stages"], result["backward_sum_ms"],
                        result["backward_sum_device_ms"], 28)
        lines.append(f"  {'sum of backward stages':<28} "
                     f"{_ms_pair(result['backward_sum_ms'], result['backward_sum_device_ms'])}")
        if "stages" in result:
            devices = (result["sum_device_ms"], result["backward_sum_device_ms"])
            both = _ms_pair(result["sum_ms"] + result["backward_sum_ms"],
                            None if None in devices else sum(devices))
            lines.append(f"  {'sum of fwd + bwd stages':<28} {both}")
        end_to_end = _ms_pair(result["nsa_forward_backward_ms"],
                              result["nsa_forward_backward_device_ms"])
        lines.append(f"  {'nsa() forward+backward':<28} {end_to_end}  (end to end)")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Time each stage of the NSA forward and backward.",
        epilog=problem_defaults_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser)
    parser.add_argument("--passes", type=passes_list, default=list(PASSES),
                        help="comma-separated: fwd (the forward's stages), bwd (the "
                             "backward's); default fwd,bwd")
    add_num_seqs_argument(parser)
    add_cmp_selected_argument(parser)
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    resolve_problem_arguments(args, parser)
    check_num_seqs(args, parser)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = describe_device(args.device)
    print(f"{device}, torch {torch.__version__}; {problem_summary(args)}; "
          f"passes {','.join(args.passes)}")
    measure_seqlens("profile_nsa", argv, args, device, profile, format_profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
