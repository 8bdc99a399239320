"""The sm90 forward's dispatch at a glance: which tile and schedule `choose_spec` picks for the
common calls, as the markdown table in docs/kernels.md (a CPU test keeps the two equal).

    python tools/dispatch_table.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.sm90.spec import choose_spec  # noqa: E402

HEAD_DIMS = (64, 128, 192, 256)
# (row label, choose_spec keywords): calls as kernels.flash_attn_func and nsa()'s branches make
# them; 16K keys stands for any key length over 4096.
CALLS = {
    "dense, keys > 4096": dict(causal=True, window_size=(-1, 0), max_seqlen_k=16384),
    "dense, packed sequences <= 4096 keys": dict(causal=True, window_size=(-1, 0),
                                                 max_seqlen_k=4096),
    "causal window < 2048": dict(causal=True, window_size=(511, 0), max_seqlen_k=16384),
    "compressed keys (compress_factor > 1)": dict(causal=True, window_size=(-1, 0),
                                                  compress_factor=64, max_seqlen_k=256),
    "block-sparse, lists <= 48 blocks": dict(causal=True, window_size=(-1, 0),
                                             sparse_block_size=64, sparse_list_capacity=16),
    "block-sparse, longer lists": dict(causal=True, window_size=(-1, 0),
                                       sparse_block_size=64, sparse_list_capacity=200),
}
SWITCHES = {"persistent": "persistent", "pingpong": "turns", "store_warp": "storer warp",
            "heads_fastest": "heads side by side", "narrow_first_tile": "narrow first tile",
            "o_in_q": "O in Q buffer"}


def describe(spec) -> str:
    """tile, buffers and switches of one spec, e.g. `128x128, Q2 KV2, persistent, turns`."""
    parts = [f"{spec.tile_m}x{spec.tile_n}", f"Q{spec.q_stages} KV{spec.num_stages}"]
    parts += [label for field, label in SWITCHES.items() if getattr(spec, field)]
    return ", ".join(parts)


def table() -> list[str]:
    lines = ["| call (bf16/fp16) | " + " | ".join(f"head dim {d}" for d in HEAD_DIMS) + " |",
             "|---|" + "---|" * len(HEAD_DIMS)]
    for label, kwargs in CALLS.items():
        cells = [describe(choose_spec(dtype="bfloat16", head_dim=d, **kwargs))
                 for d in HEAD_DIMS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print("\n".join(table()))


if __name__ == "__main__":
    main()
