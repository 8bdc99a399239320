"""Launch one case of the sm90 forward kernel a few times, the last inside an NVTX range
"profiled", for a profiler to pick out (tools/ncu_sm90_forward.sh runs Nsight Compute on it).

    python tools/launch_sm90_forward.py --case compressed --seqlens 16384 --variant persistent+q2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, tune and trace tools

import _common  # noqa: E402
from tune_sm90_forward import add_one_case_arguments, one_case  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_one_case_arguments(parser)
    parser.add_argument("--warmup", type=_common.positive_int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (sm_90)")
    from kernels.sm90.forward import run

    device = torch.device("cuda")
    for n in args.seqlens:
        _, q, k, v, call = one_case(args, n, device)
        for _ in range(args.warmup):
            run(q, k, v, **call)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profiled")
        run(q, k, v, **call)
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"{_common.describe_device(device)}: {args.case} N={n} variant "
              f"{args.variant or 'dispatched'} launched")


if __name__ == "__main__":
    main()
