"""The resolved options of one nsa() call."""
from __future__ import annotations

from dataclasses import dataclass

from nsa.selection_rule import CMP_KV_BLOCK, SELECTION_Q_TILE


@dataclass(frozen=True)
class NSAConfig:
    """Every option of nsa() after validation: hashable host values only."""

    compress_block_size: int
    selected_block_size: int
    num_selected_blocks: int
    window_size: int
    causal: bool
    softmax_scale: float
    num_cmp_selected_blocks: int | None = None
    q_tile: int = SELECTION_Q_TILE
    cmp_kv_block: int = CMP_KV_BLOCK
    # The backward's mode: bit-identical gradients from run to run (slower), not a change of
    # the function; every branch's attention backward gets it.
    deterministic: bool = False

    def resolved(self, softmax_scale: float, num_selected_blocks: int) -> "NSAConfig":
        """This config with the values validation resolves per call. Spelled out field by field
        (not `dataclasses.replace` or `**self.__dict__`): torch.compile's Dynamo in torch 2.11
        cannot trace a frozen dataclass's __dict__ (a graph break under fullgraph=True, seen on
        the H100 machine; torch 2.13 traces it)."""
        return NSAConfig(
            compress_block_size=self.compress_block_size,
            selected_block_size=self.selected_block_size, num_selected_blocks=num_selected_blocks,
            window_size=self.window_size, causal=self.causal, softmax_scale=softmax_scale,
            num_cmp_selected_blocks=self.num_cmp_selected_blocks, q_tile=self.q_tile,
            cmp_kv_block=self.cmp_kv_block, deterministic=self.deterministic)

    @property
    def branches(self) -> tuple[bool, bool, bool]:
        """Which of (compressed, selected, window) run; window_size=0 switches the window off."""
        return (True, True, self.window_size > 0)

    def selection_kwargs(self) -> dict:
        """The keyword arguments select_blocks (and its reference) take from the config."""
        return dict(compress_block_size=self.compress_block_size,
                    selected_block_size=self.selected_block_size,
                    num_selected_blocks=self.num_selected_blocks,
                    softmax_scale=self.softmax_scale, causal=self.causal,
                    num_cmp_selected_blocks=self.num_cmp_selected_blocks,
                    q_tile=self.q_tile, cmp_kv_block=self.cmp_kv_block)
