"""The compile key of the sm90 forward kernel.

Everything that changes the generated code lives in `FwdSpec`; everything else (sequence
lengths, head counts, window sizes, the compress factor, the softmax scale, the block-sparse
lists) is a runtime
argument, so one compiled kernel serves every sequence length and batch.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class FwdSpec:
    dtype: str                 # "bfloat16" | "float16"
    head_dim: int              # 64 | 128 | 192 | 256 (q, k and v share it)
    causal: bool
    has_window_left: bool      # window sizes themselves are runtime Int32
    has_window_right: bool
    block_sparse: bool         # iterate compact full/mask lists instead of a block range
    compressed: bool = False   # compress_factor may exceed 1 (its value is a runtime argument)
    tile_m: int = 128          # query rows per CTA, 64 per consumer warpgroup: 128 (two), 192
                               # (three, 160 registers each: tile_n 64, or 128 at head dim 64)
                               # or 64 (one, sized for two CTAs per SM)
    tile_n: int = 128          # keys per KV tile; the block-sparse column block size
    num_stages: int = 2        # K and V pipeline depth
    q_stages: int = 1          # Q buffers: 2 lets a persistent CTA load the next tile's Q early
    persistent: bool = False   # one CTA per SM walking tiles (kernels/sm90/tile_scheduler.py)
    heads_fastest: bool = False  # tile order: a GQA group's heads side by side (L2 sharing)
    pingpong: bool = False     # consumer warpgroups take turns issuing wgmma (named barriers)
    defer_store: bool = False  # persistent: a tile's output is stored under the next tile's
                               # first Q K^T instead of after its own last P V
    overlap_tiles: bool = False  # persistent: a tile's last P V runs under the next tile's
                                 # first softmax; its output is finalised and stored after
    store_warp: bool = False   # a producer-warpgroup warp TMA-stores the output and writes lse;
                               # the consumers only stage them (kernels/sm90/epilogue.py)
    narrow_first_tile: bool = False  # the first (diagonal) KV tile is multiplied and softmaxed
                                     # only as far as each warpgroup's rows see, in 32-key steps
    o_in_q: bool = False       # one tile per CTA (not persistent, one Q buffer): the output is
                               # staged in the Q buffer, which frees an output buffer's smem
    trace: bool = False        # diagnostic build: per-tile phase timestamps (kernels/sm90/trace.py)
    row_dot_output: bool = False  # the epilogue writes rowsum(dO * O) per row and head
                                  # (float32) instead of O and lse: nsa()'s backward takes a
                                  # recomputed branch's gate gradient without writing its output
    screen_masked_v: bool = False  # diagnostic build: each masked KV tile's V stage read for
                                   # non-finite values before its P V (kernels/sm90/screen.py),
                                   # the least an exact fix of masked NaN leaks pays; measured,
                                   # never dispatched
    q_positions: bool = False  # each sequence's queries start at a position of their own (an
                               # (S,) int32 argument: q_start_positions), which every causal and
                               # window limit reads (kernels/sm90/block_range.py)
    score_mask: bool = False   # a user mask read in the lists' "mask" tiles (block_sparse only;
                               # kernels/sm90/score_mod.py)
    score_bias: str = ""       # an additive bias of this dtype read in every visited tile
                               # ("" none; block_sparse only)
    score_pairs: bool = False  # the mask's and bias's slabs and rows start an even number of
                               # elements apart: adjacent key pairs read as one load
    score_bias_tma: bool = False  # a 16-bit bias's (tile_m, tile_n) tile TMA-loaded into the K
                                  # stage with K (its rows 16 bytes apart) and read from smem,
                                  # instead of cell pairs from global memory

    @property
    def score_mods(self) -> bool:
        """Whether the kernel reads a user mask or bias (kernels/sm90/score_mod.py)."""
        return self.score_mask or bool(self.score_bias)

    def writing_row_dots(self) -> "FwdSpec":
        """This spec with `row_dot_output`: the row dots come from the consumers' registers,
        so no output staging (storer warp, deferred or overlapped stores, O in the Q buffer)
        and no output buffer (`smem_bytes`)."""
        return dataclasses.replace(self, row_dot_output=True, store_warp=False,
                                   defer_store=False, overlap_tiles=False, o_in_q=False)

    @property
    def ctas_per_sm(self) -> int:
        """Two CTAs share an SM with one consumer warpgroup (64-row tiles), else one."""
        return 2 if self.tile_m == 64 else 1

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA, laid out as the kernel's `SharedStorage`: mbarriers and
        the lse staging, then Q, K, V, (unless `o_in_q` or `row_dot_output`) O and (with
        `score_bias_tma`) bias buffers, each 1024-byte aligned (16-bit elements)."""
        def aligned(size: int, to: int) -> int:
            return -(-size // to) * to

        barriers = 8 * 2 * (self.q_stages + 2 * self.num_stages)
        size = aligned(barriers, 16) + 4 * self.tile_m  # lse: one float32 per row
        buffers = [self.tile_m * self.q_stages, self.tile_n * self.num_stages,
                   self.tile_n * self.num_stages] + (
                       [] if self.o_in_q or self.row_dot_output else [self.tile_m])
        for elements in buffers:
            size = aligned(size, 1024) + 2 * elements * self.head_dim
        if self.score_bias_tma:  # one bias tile per K stage
            size = aligned(size, 1024) + 2 * self.tile_m * self.tile_n * self.num_stages
        return size

    def fits_in_smem(self) -> bool:
        """Whether `ctas_per_sm` CTAs of this spec fit one SM's shared memory."""
        return (self.smem_bytes <= SMEM_PER_CTA
                and self.ctas_per_sm * (self.smem_bytes + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM)


# sm_90 (H100/H200): 228 KiB of shared memory per SM, of which one CTA may take 227 KiB; the
# driver reserves 1 KiB per resident CTA.
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA = 227 * 1024
SMEM_RESERVED_PER_CTA = 1024
# 64K 32-bit registers per SM; a warp-specialized kernel's consumers get at most 240 a thread.
REGISTERS_PER_SM = 65536
MAX_CONSUMER_REGISTERS = 240


def consumer_registers(num_threads: int, consumer_threads: int, ctas_per_sm: int,
                       producer_regs: int) -> int:
    """Registers per consumer thread of a warp-specialized CTA after `setmaxnreg`, the one
    rule of every such kernel here: each thread starts with the launch's count (a multiple of
    8 that fits `ctas_per_sm` CTAs of `num_threads`), the producer threads give theirs back
    down to `producer_regs`, and the consumers take what that frees and no more:
    `setmaxnreg.inc` waits until the registers are free, so asking for more hangs the CTA (a
    640-thread CTA starts at 96, not at 65536 / 640). At most MAX_CONSUMER_REGISTERS."""
    launch = REGISTERS_PER_SM // ctas_per_sm // num_threads // 8 * 8
    freed = (launch - producer_regs) * (num_threads - consumer_threads)
    return min(MAX_CONSUMER_REGISTERS, (launch + freed // consumer_threads) // 8 * 8)



# Packed sequences of at most this many keys take the persistent short-range schedule.
SHORT_SEQUENCE_KEYS = 4096


def choose_spec(
    *, dtype: str, head_dim: int, causal: bool, window_size: tuple[int, int],
    compress_factor: int = 1, sparse_block_size: int | None = None,
    sparse_list_capacity: int | None = None, tile_m: int = 128,
    max_seqlen_k: int | None = None,
) -> FwdSpec:
    """The kernel variant the dispatcher compiles for a call (tools/tune_sm90_forward.py
    measures the alternatives). `max_seqlen_k` (the longest key sequence; None: unknown) only
    picks among compiled variants: it is not part of the compile key."""
    # The cached choice sees hashable, coarse arguments: a list window and every distinct
    # max_seqlen_k would otherwise fail to hash or crowd the cache.
    return _choose_spec(
        dtype=dtype, head_dim=head_dim, causal=bool(causal),
        window_size=(int(window_size[0]), int(window_size[1])),
        compress_factor=compress_factor, sparse_block_size=sparse_block_size,
        sparse_list_capacity=sparse_list_capacity, tile_m=tile_m,
        short_keys=max_seqlen_k is not None and max_seqlen_k <= SHORT_SEQUENCE_KEYS)


# Cached: `can_run` and `run` both ask for the spec of every launch (a frozen dataclass, safe
# to share).
@functools.lru_cache(maxsize=256)
def _choose_spec(
    *, dtype: str, head_dim: int, causal: bool, window_size: tuple[int, int],
    compress_factor: int, sparse_block_size: int | None, sparse_list_capacity: int | None,
    tile_m: int, short_keys: bool,
) -> FwdSpec:
    left, right = window_size
    # Short KV ranges per query tile (a causal window, compressed keys): persistent CTAs walking
    # 128x128 tiles with two Q buffers, ping-pong between the consumer warpgroups, and the
    # output store handed to a storer warp, so a tile's store and the next tile's Q load
    # overlap the compute. H100, device time, interleaved (tools/tune_sm90_forward.py,
    # 2026-11-22): window 512 0.319 -> 0.295 ms at 16K and 1.282 -> 1.204 at 64K against the
    # earlier pick (64x64 tiles, two CTAs per SM, which led before the storer warp); compressed keys
    # 0.128 -> 0.121-0.123 ms at 16K, 1.041 -> 1.02-1.06 at 64K (ping-pong alone: no change).
    # Storing a tile's output under the next tile's first Q K^T (`defer_store`) adds 0-1%,
    # not taken. Dense causal runs 10% slower persistent: its long tiles balance better as one
    # CTA per tile. Measured at window 512 (short) and without a window (dense); a window as
    # long as a few thousand keys behaves like dense, so only windows under 2048 keys count as
    # short.
    #
    # Compressed keys also narrow the first (diagonal) KV tile to the 32-key chunks each
    # warpgroup's rows see (on average half a 128-key tile is past every row): 2026-11-23,
    # interleaved, 0.122-0.124 -> 0.115-0.116 ms at 16K, 1.02-1.06 -> 1.00-1.06 at 64K. Windows
    # keep the full tile (0.305-0.310 vs 0.306 ms at 16K, 1.217-1.273 vs 1.225-1.241 at 64K:
    # their diagonal tile is one of five).
    #
    # Block-sparse lists of at most 48 blocks per query tile (`sparse_list_capacity`, the
    # lists' allocated length: NSA's selected branch lists 16-20) take the persistent
    # schedule too, without ping-pong: 2026-11-23, interleaved against FA4 on the same random
    # 128x128 lists, 5% at 16K (6 blocks) 0.404 -> 0.338 ms (FA4 0.382), 5% at 64K (26 blocks)
    # 6.18 -> 5.97 (FA4 5.85), 25% at 16K (32 blocks) 1.703 -> 1.654; 25% at 64K (128
    # blocks) 27.8 -> 28.1, slower, so long lists keep one CTA per tile.
    #
    # Windows also put a GQA group's heads side by side in the tile order (`heads_fastest`):
    # the CTAs running at once then share each K/V tile of the group in L2 and read one band of
    # Q and O rows. 2026-11-23, interleaved: 16K 0.303 -> 0.298 ms, 64K 1.209 -> 1.174 (FA4
    # 0.338 / 1.416). Compressed keys do not gain (16K 0.116 -> 0.119, 64K 1.039 -> 1.022), nor
    # short block-sparse lists, whose per-head lists share nothing (5% at 64K 5.95 -> 8.42).
    # Head dims 192 and 256: the same kernel with 64-key tiles and one Q buffer. One tile per
    # CTA stages the output in the Q buffer (`o_in_q`), which leaves room for two K/V stages at
    # 256 (Q 64 + K 64 + V 64 KiB); the persistent schedule needs the Q buffer for the next
    # tile, so at 256 it keeps one K/V stage (192 KiB with its output buffer). Registers fit as
    # they are (the output accumulator of 64 rows x 256 columns is 128 per thread, scores and P
    # of a 64-key tile 48 more; SASS shows no spills at 240). H100, 2026-11-23, interleaved
    # (tune_sm90_forward.py, 16K): head dim 256 dense causal 8.21 -> 6.24-6.41 ms with two
    # stages (FA4 5.67); windows 0.674 -> 0.612 ms (64K 2.691 -> 2.466) one tile per CTA with
    # two stages, against the persistent schedule with one; compressed keys stay persistent
    # (256: 0.233 vs 0.323 ms; 192: 0.183 vs 0.267). Head dim 192 keeps the head dim 128
    # schedules (window: persistent 0.430 ms vs 0.506-0.518 one tile per CTA); its dense
    # causal gains 1-2% from `o_in_q` and 96- or 112-key tiles, within noise, not taken; head
    # dim 256 dense takes 80-key tiles (6.64 -> 6.35 ms, FA4 5.81; 225 KiB), which windows
    # cannot: `narrow_first_tile` works in 32-key steps.
    #
    # Dense attention over packed short sequences (every key sequence <= 4096, head dims 64 to
    # 192) is a short KV range too: each 128-row tile sees at most 32 KV tiles, and one CTA per
    # tile spends much of each tile on its prologue and epilogue. It takes the window schedule
    # (persistent, ping-pong, storer warp, GQA heads side by side; two Q buffers up to 128).
    # 2026-11-24, H100, interleaved, 16K tokens, H=32, Hkv=8 (docs/history.md section 1): D=128
    # causal 64 x 256 0.206 -> 0.141 ms (FA4 0.230), 8 x 2048 0.513 -> 0.452 (FA4 0.524), 4 x 4096
    # 0.883 -> 0.837 (FA4 0.883), 32 random lengths 0.409 -> 0.298 (FA4 0.342); non-causal
    # alike; 2 x 8192 a tie, 1 x 16384 3% slower, so longer sequences keep one CTA per tile.
    # D=192: 64 x 256 0.262 -> 0.209, 4 x 4096 1.336 -> 1.292, 32 random lengths 0.524 ->
    # 0.424. Not D=256, whose persistent schedule has one K/V stage: 4 x 4096 1.70 -> 2.42.
    # Narrowing the diagonal tile adds nothing there (+-2%).
    wide = head_dim > 128
    window = causal and 0 <= left < 2048 and compress_factor == 1
    short_sequences = (short_keys and head_dim <= 192
                       and compress_factor == 1 and left < 0 and (causal or right < 0)
                       and sparse_block_size is None)
    short_lists = (sparse_block_size is not None and sparse_list_capacity is not None
                   and sparse_list_capacity <= 48)
    short_kv = ((sparse_block_size is None and (compress_factor != 1 or window))
                or short_lists or short_sequences)
    persistent = short_kv and not (window and head_dim > 192)
    # Head dim 64 over long KV ranges: 192x128 tiles, three consumer warpgroups taking turns
    # round robin (FA3's tile and scheduling there). At 64 columns the output accumulator is 32
    # registers per thread, so 160 hold it beside 128-key scores and P (SASS: no spills), and
    # a CTA has 50% more rows to hide each warpgroup's softmax under the others' products.
    # 2026-11-24, H100, interleaved (tune_sm90_forward.py --head-dim 64): dense causal 16K
    # 2.708 -> 2.196 ms with 192-row tiles (FA4 1.879), 64K 42.20 -> 34.82 (FA4 32.11); the
    # turns then 2.32 -> 2.10 (FA4 1.95) and 34.76 -> 33.31 (FA4 31.94); non-causal 16K 5.23
    # -> 4.07 -> 3.97 (FA4 3.80). Short ranges keep 128-row tiles (192 rows: packed 4096-token
    # sequences 0.632 -> 0.686 ms, window 512 0.244 -> 0.317); block-sparse lists are built
    # for 128-row tiles.
    if head_dim == 64 and not short_kv and sparse_block_size is None:
        tile_m = 192
    tile_n = sparse_block_size if sparse_block_size is not None else (64 if wide else 128)
    if head_dim > 192 and not short_kv and sparse_block_size is None:
        tile_n = 80  # FA4's width there; fits beside two stages with the output in the Q buffer
    spec = FwdSpec(
        dtype=dtype,
        head_dim=head_dim,
        causal=bool(causal),
        has_window_left=left >= 0,
        has_window_right=right >= 0 and not causal,
        block_sparse=sparse_block_size is not None,
        compressed=compress_factor != 1,
        tile_m=tile_m,
        tile_n=tile_n,
        persistent=persistent,
        heads_fastest=(window or short_sequences) and persistent and sparse_block_size is None,
        q_stages=2 if persistent and not wide else 1,
        # A persistent CTA's next Q would land on an output staged in the Q buffer.
        o_in_q=wide and not persistent,
        num_stages=1 if head_dim > 192 and persistent else 2,
        pingpong=(persistent and tile_m == 128 and not short_lists) or tile_m == 192,
        store_warp=persistent,
        narrow_first_tile=short_kv and sparse_block_size is None
        and (compress_factor != 1 or not persistent),
    )
    if not spec.fits_in_smem():
        raise ValueError(f"no sm90 forward variant for head_dim {head_dim} with "
                         f"{tile_n}-key tiles fits shared memory ({spec.smem_bytes} bytes)")
    return spec


@dataclass(frozen=True)
class BwdSpec:
    """The compile key of the sm90 backward kernel (kernels/sm90/bwd_sm90.py).

    One CTA owns one KV tile of one KV head and walks every query head of its GQA group over the
    query tiles that see the tile, so dK and dV stay in registers and are written once: no
    atomics, no float32 dK/dV buffers. dQ either comes from the query-centric kernel
    (`dq_separate`: `DqSpec`), or this kernel adds it into a float32 accumulator (the fused
    dQ, `fuses_dq`)."""
    dtype: str                 # "bfloat16" | "float16"
    head_dim: int              # 64 | 128
    causal: bool
    has_window_left: bool
    has_window_right: bool
    block_sparse: bool         # walk the transposed (CSR) lists instead of a query-tile range
    compressed: bool = False
    deterministic: bool = False  # no order-dependent float32 sums (with `dq_separate`)
    split_lists: bool = False  # block-sparse: work units of at most a chunk of list entries
                               # (kernels/sm90/backward.py `work_units`); dK/dV partials are
                               # then added into float32 accumulators
    split_rows: bool = False   # dense: `row_splits` CTAs per KV tile share its query tiles
                               # (few KV tiles: compressed keys); dK/dV partials then go into
                               # float32 accumulators. Dispatched when a call has fewer KV
                               # tiles than SMs
    dq_separate: bool = True   # skip dQ here: the query-centric kernel computes it (DqSpec);
                               # False fuses it (`fuses_dq`)
    tile_n: int = 128          # keys per CTA, 64 per consumer warpgroup
    tile_m: int = 64           # query rows per step: 64, or 128 with two consumer warpgroups
                               # (head dim 64: `choose_backward_spec`)
    q_stages: int = 2          # Q (+ lse) and dO (+ dO.O) pipeline depth
    add_dkv: bool = False      # dK/dV added into the caller's float32 sums (one CTA per KV
                               # tile: a load, add and store; nsa()'s running dk, dv)
    store_dkv_sums: bool = False  # dK/dV stored into the caller's float32 sums, which hold
                                  # nothing yet (`kernels.dkv_sums.UnwrittenDkvSums`: nsa()'s
                                  # first branch on them; no zeroing, no load)
    owned_dkv_stores: bool = False  # `split_lists` into the kernel's own float32 partials: a
                                    # unit that is the only one adding into its KV tile (its
                                    # whole list, one list per KV head) stores dK/dV in the
                                    # input dtype instead; kernels/sm90/dkv_tiles.py zeroes and
                                    # converts the other tiles
    one_cta_per_sm: bool = False  # 64-key tiles: one CTA per SM (240 registers per consumer
                                  # thread instead of 232), see `ctas_per_sm`
    heavy_first: bool = False  # dense walks: CTAs launched KV tile by KV tile, KV heads
                               # innermost, so the tiles with the longest walks start first
    alternate_steps: bool = False  # 64-key tiles: two consumer warpgroups share the tile and
                                   # take alternate query steps, each with its own dK/dV
                                   # (summed through smem at the end); one CTA per SM
    row_bands: bool = False    # `split_rows` by bands of query steps common to every KV tile
                               # (`row_splits` bands per sequence), CTAs launched band by band
                               # (KV tiles, then KV heads innermost): the CTAs running together
                               # add the fused dQ into one band of rows, which L2 can hold.
                               # Dispatched for long compressed causal keys (2026-11-27,
                               # ROW_BANDS_FUSED_MIN_KEYS)
    q_positions: bool = False  # as `FwdSpec.q_positions`
    score_mask: bool = False   # as `FwdSpec.score_mask` (block_sparse with the fused dQ only)
    score_bias: str = ""       # as `FwdSpec.score_bias`
    score_bias_grad: bool = False  # dS summed into a float32 dbias by reductions
                                   # (kernels/sm90/score_mod.py)
    score_dbias_stores: bool = False  # with score_bias_grad: every dbias cell takes one dS (a
                                      # bias slab per batch entry and query head), stored in
                                      # the bias's dtype instead of summed into float32
    score_dbias_tiles: bool = False  # with score_bias_grad, summed: the float32 sums hold the
                                     # visited 128 x 128 tiles alone, (slots, 128, 128), each
                                     # found through a (slabs, Tq, Tk) int32 slot map
    score_stage_bias: bool = False  # a 16-bit bias's tile copied to smem by cp.async at each
                                    # step (rows 16 bytes apart; KV tiles inside the keys) and
                                    # read there on S^T, instead of cell by cell from global
    dq_stores: bool = False    # the fused dQ stores each 64-row block instead of adding it:
                               # every (query head, 64-row tile) is one CTA's (one KV tile per
                               # sequence, split rows disjoint; kernels/sm90/backward.py
                               # `dq_store_opens_sums`), so it opens `DqSums` unzeroed
    stores_ds: bool = False    # 64-key lists beside the dQ kernel: each step's dS^T is stored
                               # (input dtype, one 64 x 64 tile per forward-list slot, query
                               # head and 64-row half) for the dQ kernel to read
                               # (`DqSpec.reads_ds`) instead of recomputing S and dP

    @property
    def score_mods(self) -> bool:
        return self.score_mask or bool(self.score_bias)

    @property
    def key_warpgroups(self) -> int:
        """Consumer warpgroups that split the tile's keys (64 each)."""
        return self.tile_n // 64

    @property
    def num_consumer_warpgroups(self) -> int:
        """The key warpgroups, or with `alternate_steps` two warpgroups on the same 64 keys:
        each takes every other step of the walk, so one's exponentials run while the other's
        products do, at 240 registers per thread (two 64-key CTAs per SM have 232, and ptxas
        serialises every wgmma there)."""
        return 2 if self.alternate_steps else self.key_warpgroups

    @property
    def warpgroups_per_step(self) -> int:
        """Consumer warpgroups that take part in one step (and release its Q/dO stage)."""
        return 1 if self.alternate_steps else self.num_consumer_warpgroups

    @property
    def ctas_per_sm(self) -> int:
        """One consumer warpgroup (64-key tiles: NSA's blocks) is sized for two CTAs per SM.
        At head dim 128 two CTAs leave 232 registers per consumer thread, and ptxas then
        serialises every wgmma of the kernel (SASS: a wait after each of the 48 HGMMAs);
        `one_cta_per_sm` gives it 240, where the products overlap the softmax again."""
        return 2 if self.tile_n == 64 and not (self.one_cta_per_sm or self.alternate_steps) else 1

    @property
    def dv_before_ds(self) -> bool:
        """Issue dV += P^T dO before computing dS, so the product runs under it (H100,
        2026-11-24, measured together with the dense walks' mask loops: dense causal and
        compress factor 64 about 5% faster at 64K, within the run-to-run spread at 16K). Not
        where registers run short: two 64-key CTAs per SM at head dim 128 (232 registers,
        ptxas serialises every wgmma anyway; the early issue made the backward 7-9% slower),
        and 128-row steps, where the float32 P kept live beside the dV product made ptxas
        serialise every wgmma (SASS: a wait after each of the 96 HGMMAs; head dim 64 dense
        causal at 16K 6.13 ms against 4.69 ms with dV after dS, H100, 2026-11-25)."""
        return not (self.ctas_per_sm == 2 and self.head_dim == 128) and self.tile_m == 64

    @property
    def fuses_dq(self) -> bool:
        """dQ = dS K in this kernel, in FA3/FA4's order: dS double-buffered in smem (one
        buffer per Q stage, so no barrier waits for the other warpgroup's previous dQ read),
        dQ issued before dK += dS^T Q, each warpgroup's dQ staged in smem while dK runs, and a
        warp of the producer warpgroup (the dQ writer) adding it into the float32 accumulator
        with a bulk reduce-add (kernels/sm90/dq_accumulator.py)."""
        return not self.dq_separate

    @property
    def can_fuse_dq(self) -> bool:
        """The fused dQ needs one dQ product per step (every warpgroup's block at once: its
        share of the columns, or with 128-row steps its own rows; not 64-key tiles at head dim
        128) and two Q stages; its float32 sums land in any order, so not in the
        deterministic mode."""
        if self.alternate_steps:
            return False  # dQ staging would need a buffer per warpgroup and step
        if self.dq_rows_per_warpgroup:
            one_pass = self.num_consumer_warpgroups * 64 == self.tile_m
        else:
            one_pass = self.dq_cols_per_warpgroup * self.num_consumer_warpgroups == self.head_dim
        return one_pass and self.q_stages == 2 and not self.deterministic

    @property
    def ds_stages(self) -> int:
        """dS buffers in smem (the fused dQ's A operand)."""
        return 2 if self.fuses_dq else 0

    @property
    def partial_dkv(self) -> bool:
        """Several CTAs add into one KV tile's dK/dV (float32 accumulators, converted after)."""
        return self.split_lists or self.split_rows

    @property
    def float32_dkv(self) -> bool:
        """dK/dV land in float32 tensors: partial sums, or the caller's sums (`add_dkv`,
        `store_dkv_sums`)."""
        return self.partial_dkv or self.add_dkv or self.store_dkv_sums

    @property
    def dq_rows_per_warpgroup(self) -> bool:
        """The fused dQ = dS K split by rows: with 128-row steps each warpgroup computes all
        columns of its own 64 rows (one 64-row tile of the accumulator); with 64-row steps the
        warpgroups split the columns."""
        return self.tile_m > 64

    @property
    def dq_cols_per_warpgroup(self) -> int:
        """Columns of one warpgroup's dQ block, a 64-row block of the accumulator: the head
        dim when the warpgroups split rows, else its share of the columns per pass (at most
        64: one warpgroup of 232 registers cannot hold a 64 x 128 float32 accumulator beside
        dK and dV)."""
        if self.dq_rows_per_warpgroup:
            return self.head_dim
        return min(64, self.head_dim // self.num_consumer_warpgroups)

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA as `BackwardSm90.shared_storage_struct` lays it out."""
        def aligned(size: int, to: int) -> int:
            return -(-size // to) * to

        barriers = 8 * 2 * (1 + 2 * self.q_stages)
        size = aligned(barriers, 16)
        size = aligned(size, 128) + 4 * self.tile_m * self.q_stages  # lse
        size = aligned(size, 128) + 4 * self.tile_m * self.q_stages  # dO.O
        buffers = [self.tile_n, self.tile_n, self.tile_m * self.q_stages,
                   self.tile_m * self.q_stages]
        for rows in buffers:
            size = aligned(size, 1024) + 2 * rows * self.head_dim
        if self.fuses_dq:  # dS, and one 64-row float32 dQ staging block per warpgroup
            size = aligned(size, 1024) + 2 * self.tile_m * self.tile_n * self.ds_stages
            size = aligned(size, 1024) + 4 * QUERY_SLOT_ROWS * self.dq_cols_per_warpgroup * (
                self.num_consumer_warpgroups)
        if self.score_stage_bias:
            size = aligned(size, 128) + 2 * self.tile_m * (self.tile_n + STAGED_BIAS_PAD)
        return size

    def fits_in_smem(self) -> bool:
        return (self.smem_bytes <= SMEM_PER_CTA
                and self.ctas_per_sm * (self.smem_bytes + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM)


# Elements after each row of the backward's staged bias tile (`BwdSpec.score_stage_bias`):
# rows 272 bytes apart, so the S^T fragment's reads of four query rows two apart fall on
# different banks.
STAGED_BIAS_PAD = 8


@dataclass(frozen=True)
class DqSpec:
    """The compile key of the query-centric dQ kernel (kernels/sm90/bwd_dq_sm90.py), which runs
    beside the KV-centric backward when that one skips its dQ (`BwdSpec.dq_separate`)."""
    dtype: str                 # "bfloat16" | "float16"
    head_dim: int              # 64 | 128
    causal: bool
    has_window_left: bool
    has_window_right: bool
    block_sparse: bool         # walk the forward's lists
    compressed: bool = False
    list_block: int = 64       # block-sparse: keys per listed block (64 or 128)
    tile_m: int = 128          # query rows per CTA, 64 per consumer warpgroup
    tile_n: int = 64           # keys per visited KV tile
    kv_stages: int = 2         # K and V pipeline depth
    accumulate: bool = False   # add dQ into the values dQ holds (nsa()'s running dq)
    q_positions: bool = False  # as `FwdSpec.q_positions`
    # Add a fused-dQ float32 accumulator (kernels/sm90/dq_accumulator.py: blocks of this many
    # columns in the dQ product's register order) into dQ before it is written: nsa()'s last
    # branch takes the fused branches' `DqSums` so, instead of a conversion pass. 0: none.
    sums_block_cols: int = 0
    # Store dQ, unscaled, into that accumulator instead of writing dq (`sums_block_cols` > 0,
    # not `accumulate`): the first of nsa()'s branches on this kernel opens the `DqSums` that
    # later fused-dQ calls add into, so the sums are never zeroed (and dq is written once, by
    # the call that consumes them).
    stores_sums: bool = False
    # dQ = dS K from the dS^T tiles the KV-centric kernel stored (`BwdSpec.stores_ds`):
    # kernels/sm90/bwd_dq_from_ds.py, one product per step instead of three. 64-key lists only.
    reads_ds: bool = False
    ctas_per_sm: int = 1       # `reads_ds`: CTAs sized to share an SM (registers and smem;
                               # tile_m 64 at two)
    heads_per_cta: int = 1     # `reads_ds`: query heads of one list head (a GQA group's) per
                               # CTA, a consumer warpgroup per (head, 64-row half): they share
                               # each entry's K stage (tile_m 128, the heads' dS tiles of an
                               # entry adjacent, so still one box)

    def __post_init__(self):
        if self.stores_sums and (self.sums_block_cols <= 0 or self.accumulate or self.reads_ds):
            raise ValueError("DqSpec.stores_sums: needs sums_block_cols, and neither accumulate "
                             "nor reads_ds (it writes no dq)")
        if self.heads_per_cta > 1 and not (self.reads_ds and self.tile_m == 128):
            raise ValueError("DqSpec.heads_per_cta: reads_ds with 128-row CTAs (each head's two "
                             "dS tiles of an entry lie side by side)")

    @property
    def tiles_per_list_block(self) -> int:
        """KV tiles visited per list entry (a 128-key block is two 64-key tiles)."""
        return self.list_block // self.tile_n if self.block_sparse else 1

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA as `DqBackwardSm90.shared_storage_struct` lays it out."""
        def aligned(size: int, to: int) -> int:
            return -(-size // to) * to

        if self.reads_ds:  # K and the entry's 64 x 64 dS tiles (rows x heads) per stage
            size = aligned(8 * 2 * self.kv_stages, 16)
            size = aligned(size, 1024) + 2 * self.tile_n * self.head_dim * self.kv_stages
            return aligned(size, 1024) + (2 * self.tile_m * self.heads_per_cta * self.tile_n
                                          * self.kv_stages)
        size = aligned(8 * 2 * (1 + self.kv_stages), 16)
        for rows in (self.tile_m, self.tile_m, self.tile_n * self.kv_stages,
                     self.tile_n * self.kv_stages):
            size = aligned(size, 1024) + 2 * rows * self.head_dim
        return size

    def fits_in_smem(self) -> bool:
        return (self.smem_bytes <= SMEM_PER_CTA
                and self.ctas_per_sm * (self.smem_bytes + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM)


BACKWARD_HEAD_DIMS = (64, 128)
# Rows per query tile of the backward's row statistics and fused-dQ accumulator layout
# (kernels/sm90/backward.py `QueryTiles`); a backward step (`BwdSpec.tile_m`) is one or two.
QUERY_SLOT_ROWS = 64
# A dS tile (`BwdSpec.stores_ds`, kernels/sm90/ds_tiles.py): one 64-row, 64-key step.
DS_TILE_ROWS = 64
DS_TILE_ELEMENTS = DS_TILE_ROWS * 64
FUSED_DQ_MIN_KEYS = 4096  # the fused dQ from this longest sequence (keys) on
# 128-key block-sparse lists per query head take the fused dQ (64-key tiles cannot:
# `can_fuse_dq`) where the lists are at least FUSED_DQ_MIN_LIST_WIDTH[head_dim] query tiles
# wide: each unit of the fused path walks one head's list, loads K and V for it and adds
# float32 dK/dV partials, and the float32 dQ accumulator is zeroed and converted, which short
# lists do not repay. Lists per KV group keep the dQ kernel: there the fused path lost on the
# H100. 2026-11-27, two kernels / fused, same call (ms):
# | H100, D=128 | lists per query head: width 7 (5% at 16K) 1.44 / 2.13, 27 (5% at 64K) 21.2
# |   / 25.0, 52 (10% at 64K) 42.3 / 41.8, 27 (20% at 16K) 5.20 / 4.77, 33 (25% at 16K) 6.25 /
# |   5.60; per KV group (4 heads): 10% at 16K 2.89 / 3.34, NSA-like 16 x 128 3.22 / 3.13 at
# |   16K, 13.4 / 16.6 at 64K
# | H100, D=64 | per query head: width 27 12.4 / 10.2, 129 56.7 / 42.1 (64K)
# | H200 | the same trend with less loss on short lists (more HBM bandwidth for the partials):
# |   D=128 width 7 1.43 / 1.71, 14 2.73 / 2.76, 27 (64K) 22.3 / 20.2; D=64 width 7 0.87 / 0.94
# At D=64 nothing was measured between widths 7 and 27: 16 sits between them.
FUSED_DQ_LIST_BLOCK = 128
FUSED_DQ_MIN_LIST_WIDTH = {64: 16, 128: 32}
# 64-key tiles with two consumer warpgroups on alternate query steps (`BwdSpec.alternate_steps`,
# 2026-11-25): compiles without serialised wgmmas (SASS: 6 waits for 48 HGMMAs at head dim 128,
# against a wait after each of them at two CTAs per SM) and matches the fallback on the GPU,
# but is slower than two CTAs per SM (H100, 2026-11-25, D=128, the whole backward: random 25%
# 64-key lists 5.70 -> 5.84 ms at 16K, 100.4 -> 114.3 at 64K; NSA-like 16 x 64 per group
# 2.65 -> 2.69 at 16K): kept as a tuner variant, not dispatched.
ALTERNATE_STEPS_AT_64_KEYS = False
# Causal compressed keys: CTAs in order of decreasing work (`BwdSpec.heavy_first`). KV tile n
# of a compressed causal call walks the query tiles from n * 128 * cf on, so its work falls
# linearly with n; launched head by head, the heavy tiles of the last heads start late (a
# greedy model of 132 SMs put that order at 1.24-1.59x the balanced time from 16K to 512K,
# heaviest first at 1.00-1.10x). H100, 2026-11-25, compress factor 64, H=32, Hkv=8, D=128,
# the whole backward interleaved with the order by heads: 0.641 -> 0.609 ms at 16K, 4.45 ->
# 4.02 at 64K, 15.1 -> 13.9 at 128K, 61.9 -> 51.0 at 256K.
HEAVY_FIRST_COMPRESSED_CAUSAL = True
# `BwdSpec.row_bands` wherever `split_rows` is dispatched: a switch for the GPU tests (the
# tuner turns the spec field itself).
ROW_BANDS_FOR_SPLIT_ROWS = False
# Compressed causal keys from this many keys on (the longest sequence) run split rows by bands
# with the fused dQ (`BwdSpec.row_bands`): the CTAs running together add into about one band
# of the float32 dQ accumulator, which L2 holds, and the query-centric dQ kernel's three
# products per step become one. H100, 2026-11-27, compress factor 64, H=32, Hkv=8, D=128, the
# whole backward (heaviest first with the dQ kernel / row bands with it / row bands fused):
# 64K (1024 keys) 4.02 / 3.89 / 4.38 ms, 128K (2048 keys) 13.73 / - / 13.06, 256K (4096
# keys) 50.2 / 50.0 / 46.2. Since nsa()'s fused branches share one accumulator that the
# selected branch's dQ kernel consumes (kernels/sm90/backward.py `DqSums`), the fused dQ no
# longer pays a conversion, only the zeroing, and wins from 512 keys: H200, 2026-11-30, nsa()
# forward+backward, the A/B of `python tools/profile_kernels.py --seqlens 16384,32768,65536
# --from-idle --rounds 4 --switch kernels.sm90.spec.ROW_BANDS_FUSED_MIN_KEYS=...` (kernel
# time: the dQ kernel's against the fused KV-centric kernel's growth and the zeroing): 16K
# (256 keys) -0.220 +0.170 +0.058 ms, a tie; 32K (512) -0.611 +0.267 +0.115; 64K (1024)
# -1.866 +0.729 +0.229.
ROW_BANDS_FUSED_MIN_KEYS = 512
# Every optional fused dQ (dense keys, sliding windows, the row bands) only while its float32
# accumulator (4 bytes per query row, head and dim) stays within this; beyond it the dQ
# kernel, which needs none. nsa()'s backward at 1M tokens (H=32, D=128) held a 16 GiB
# accumulator through its window branch: peak 63,201 MiB, 1.54x the 41,088 MiB that must exist
# (H200, 2026-12-01, `python tools/diagnose_memory.py --seqlens 1048576 --no-dense`), where issue
# 39 allows 1.25x. The fused dQ of wide lists per query head is not optional (`fuses_listed_dq`).
FUSED_DQ_MAX_ACCUMULATOR_BYTES = 4 << 30
# Sliding windows (dense keys) take the fused dQ from FUSED_DQ_MIN_KEYS on (`choose_backward_spec`);
# False keeps them on the dQ kernel. A switch for the A/B.
FUSED_DQ_WINDOWS = True
BACKWARD_DENSE_TILE_N = 128  # keys per backward CTA without block-sparse lists
H100_NUM_SMS = 132  # the SM count assumed where no GPU is asked (compile-only dispatch)


@dataclass(frozen=True)
class ListShape:
    """What the backward dispatch reads of a call's block-sparse lists: shapes only, no device
    read (`list_shape`)."""
    spans_kv_groups: bool    # each list serves all query heads of a KV group (list heads <= Hkv)
    per_query_head: bool     # one list per query head (list heads >= H; MHA lists are both)
    width: int               # forward list slots per query tile (full + mask): about the
                             # entries of a transposed list, each KV block being listed about
                             # as often as a tile lists blocks


def list_shape(block_sparse, num_heads: int, num_kv_heads: int) -> ListShape:
    list_heads = block_sparse.full_count.shape[1]
    return ListShape(spans_kv_groups=list_heads <= num_kv_heads,
                     per_query_head=list_heads >= num_heads,
                     width=block_sparse.full_index.shape[-1] + block_sparse.mask_index.shape[-1])


def plain_mask(causal: bool, window_size, compress_factor: int) -> bool:
    """No compress factor and no window (a right window under causal masking is no window)."""
    left, right = int(window_size[0]), int(window_size[1])
    return compress_factor == 1 and left < 0 and (bool(causal) or right < 0)


def fuses_listed_dq(sparse_block_size, head_dim: int, deterministic: bool, causal: bool,
                    window_size, compress_factor: int, lists: ListShape | None) -> bool:
    """Whether a block-sparse call's lists run as head-major work units with the fused dQ:
    128-key lists, one per query head, at least FUSED_DQ_MIN_LIST_WIDTH[head_dim] wide, with
    no compress factor or window (`plain_mask`: the fused dQ measured slower on compressed keys,
    2026-11-24, and nothing else was measured), not in deterministic mode. `lists` None (a
    compile-only caller) counts as NSA's lists, one per KV group: not fused."""
    if sparse_block_size != FUSED_DQ_LIST_BLOCK or deterministic:
        return False
    if not plain_mask(causal, window_size, compress_factor):
        return False
    if lists is None or head_dim not in FUSED_DQ_MIN_LIST_WIDTH:
        return False
    return lists.per_query_head and lists.width >= FUSED_DQ_MIN_LIST_WIDTH[head_dim]


def splits_lists(sparse_block_size, head_dim: int, deterministic: bool, causal: bool,
                 window_size, compress_factor: int, lists: ListShape | None) -> bool:
    """`BwdSpec.split_lists` of a call (`choose_backward_spec`; kernels/validate.py checks the
    grid by it): its lists run as work units, a one-dimensional grid. Lists that serve a KV
    group (NSA's; `lists` None counts as such) are split beside the dQ kernel; lists per query
    head only where they take the fused dQ (`fuses_listed_dq`)."""
    if sparse_block_size is None or deterministic:
        return False
    return lists is None or lists.spans_kv_groups or fuses_listed_dq(
        sparse_block_size, head_dim, deterministic, causal, window_size, compress_factor, lists)


def choose_backward_spec(
    *, dtype: str, head_dim: int, causal: bool, window_size: tuple[int, int],
    compress_factor: int = 1, sparse_block_size: int | None = None,
    deterministic: bool = False, kv_tile_ctas: int | None = None,
    max_seqlen_k: int | None = None, num_sms: int = H100_NUM_SMS,
    lists: ListShape | None = None, dq_accumulator_bytes: int | None = None,
) -> BwdSpec:
    """The backward variant the dispatcher compiles for a call. Head dims above 128 do not fit:
    dK and dV of a 64-key warpgroup slice take 64 x D float32 registers each per thread group
    (128 + 128 per thread at D=256).

    `kv_tile_ctas` (KV tiles x KV heads x sequences of the call, when known) picks `split_rows`
    for calls that would leave SMs idle: compressed keys at 16K make 16 CTAs on 132 SMs
    (H100, 2026-11-24: compress_factor 64 backward 5.93 -> 2.25 ms with split rows and the TMA
    dQ reduce). Calls that fill the GPU keep one CTA per KV tile (split rows cost float32 dK/dV
    accumulators and a conversion: causal window 512 at 16K 2.61 -> 2.80 ms).

    `lists` (`list_shape`; None: a compile-only caller, taken as lists that serve a KV group,
    NSA's): lists that serve every query head of a KV group are split into work units beside
    the dQ kernel. Lists per query head inside a group are not: a unit walks one list, so each
    would walk one head of the group and add float32 dK/dV partials per head (random lists per
    query head, 25% of the 128-key blocks at 16K: 13.6 ms split, 7.3 ms with one CTA walking
    the group, 2026-11-24); except wide 128-key lists, whose units take the fused dQ
    (`fuses_listed_dq`, 2026-11-27).

    `dq_accumulator_bytes` (4 x q's elements; None: unknown, a compile-only caller) bounds the
    optional fused dQ's float32 accumulator (FUSED_DQ_MAX_ACCUMULATOR_BYTES): dense keys fuse
    where it fits or is unknown, compressed keys' row bands only where it is known to fit."""
    if head_dim not in BACKWARD_HEAD_DIMS:
        raise ValueError(f"no sm90 backward variant for head_dim {head_dim} "
                         f"(supported: {BACKWARD_HEAD_DIMS})")
    left, right = int(window_size[0]), int(window_size[1])
    tile_n = sparse_block_size if sparse_block_size is not None else BACKWARD_DENSE_TILE_N
    list_call = (sparse_block_size, head_dim, deterministic, causal, window_size,
                 compress_factor, lists)
    fused_lists = fuses_listed_dq(*list_call)
    # Head dim 64 steps 128 query rows (FA3/FA4's tile there): at 64 rows a step's
    # exponentials, row statistics and barriers carried half the tensor work of head dim 128
    # (H100, 2026-11-25, the whole backward with FA4 in the same run: dense causal 0.83x ->
    # 1.02x FA4 at 16K, 0.87x -> 1.02x at 64K; window 512 0.94x -> 0.97x, 1.09x -> 1.12x).
    tile_m = 128 if head_dim == 64 and tile_n == 128 else 64
    q_stages = 2
    spec = BwdSpec(
        dtype=dtype, head_dim=head_dim, causal=bool(causal), has_window_left=left >= 0,
        has_window_right=right >= 0 and not causal, block_sparse=sparse_block_size is not None,
        compressed=compress_factor != 1, deterministic=bool(deterministic), tile_n=tile_n,
        tile_m=tile_m, q_stages=q_stages,
        alternate_steps=ALTERNATE_STEPS_AT_64_KEYS and tile_n == 64,
        heavy_first=(HEAVY_FIRST_COMPRESSED_CAUSAL and compress_factor != 1 and bool(causal)
                     and sparse_block_size is None),
        # NSA lists block 0 in every query tile: one work unit per KV block would run N/128
        # tiles where the average runs ~8. Split lists into chunks (not in deterministic mode,
        # whose dK/dV must not depend on the order of float32 partial sums). Wide 128-key lists
        # per query head are split too (below, they take the fused dQ).
        split_lists=splits_lists(*list_call),
        split_rows=(sparse_block_size is None and not deterministic and kv_tile_ctas is not None
                    and kv_tile_ctas < num_sms))
    # dQ fused into this kernel (FA3/FA4's order and dQ writer warp, `fuses_dq`) for dense
    # keys (causal, full, or a sliding window; not compressed keys nor lists). H100,
    # 2026-11-24, torch.profiler device time of the kernels alone (fused / KV-centric + dQ):
    # dense causal 16K 10.07 / 10.59 ms, 64K 163.2 / 183.7; causal window 512 0.80 / 1.04 and
    # 3.10 / 4.07 (a tie once the float32 accumulator is zeroed and converted on the H100;
    # on the H200, 2026-11-29, the whole backward with both, `tools/tune_sm90_backward.py`:
    # 8K 0.549 -> 0.489 ms, 16K 1.063 -> 0.945, so windows fuse since); compress
    # factor 64 0.53 / 0.47 and 6.14 / 4.04; random 25% 128-key lists 5.20 / 5.84 and
    # 134.6 / 111.0 (the reductions land on query tiles in random order at 64K).
    # Packed short sequences keep the dQ kernel: a KV tile meets few query tiles there, and
    # the accumulator's zeroing and conversion cost more than the fused product saves (same
    # day, 16K tokens in causal sequences of L, fused / two kernels: L = 256-1024
    # 1.16-1.18x, 2048 1.09x, 4096 0.95x, 8192 0.91x, 16384 0.84x). `max_seqlen_k` None: a
    # compile-only caller, taken as long.
    # Elsewhere dQ comes from the query-centric kernel: recomputing S and dP once more per
    # query tile cost less than the fused dQ's reductions, Q/dO reloads and accumulator
    # conversion (H100, 2026-11-24, the fused dQ before the writer warp vs `dq own kernel`):
    # random 64-key lists like NSA's selected branch 16K 7.25 -> 3.40 ms, 64K 29.1 -> 13.1;
    # compress factor 64 16K 2.26 -> 1.40, 64K 13.0 -> 7.5; causal window 512 16K 2.60 ->
    # 1.93. The deterministic mode takes it everywhere (it sums dQ in registers, in a fixed
    # order; `can_fuse_dq`).
    # Wide 128-key lists per query head take the fused dQ too, in work units taken head by
    # head (kernels/sm90/backward.py `work_units`, `list_chunk`), so the fused
    # dQ's sums land in one head's accumulator at a time, which L2 holds. H200, 2026-11-27,
    # random 25% lists per query head, two kernels / fused: 16K 6.18 / 5.35 ms, 64K 105.2 /
    # 85.4 (FA4 5.31 / 85.4 in the same run; KV block by KV block the fused dQ took 128.8 ms
    # at 64K).
    dense_keys = (not spec.block_sparse and compress_factor == 1
                  and (FUSED_DQ_WINDOWS or plain_mask(causal, window_size, compress_factor)))
    long_keys = max_seqlen_k is None or max_seqlen_k >= FUSED_DQ_MIN_KEYS
    accumulator_fits = (dq_accumulator_bytes is not None
                        and dq_accumulator_bytes <= FUSED_DQ_MAX_ACCUMULATOR_BYTES)
    if fused_lists:  # split for the fused dQ: it must be there (`splits_lists` counts on it)
        assert spec.can_fuse_dq and spec.split_lists, spec
    if ((dense_keys and long_keys and (accumulator_fits or dq_accumulator_bytes is None)
         or fused_lists) and spec.can_fuse_dq):
        spec = dataclasses.replace(spec, dq_separate=False)
    compressed_causal = (spec.compressed and spec.causal and not spec.block_sparse
                         and not spec.has_window_left)
    if (compressed_causal and spec.can_fuse_dq and max_seqlen_k is not None
            and max_seqlen_k >= ROW_BANDS_FUSED_MIN_KEYS and accumulator_fits):
        spec = dataclasses.replace(spec, split_rows=True, row_bands=True, heavy_first=False,
                                   dq_separate=False)
    if ROW_BANDS_FOR_SPLIT_ROWS and spec.split_rows:
        spec = dataclasses.replace(spec, row_bands=True, heavy_first=False)
    if not spec.fits_in_smem():
        raise ValueError(f"no sm90 backward variant for head_dim {head_dim} with {tile_n}-key "
                         f"tiles fits shared memory ({spec.smem_bytes} bytes)")
    return spec


def fused_dq_block_cols(head_dim: int) -> int:
    """Columns per block of the float32 dQ accumulator of dense keys' fused dQ (causal, window:
    nsa()'s window branch), the layout a dQ kernel storing `DqSums` first writes
    (`DqSpec.stores_sums`)."""
    return choose_backward_spec(dtype="bfloat16", head_dim=head_dim, causal=True,
                                window_size=(-1, 0)).dq_cols_per_warpgroup


def dq_spec_for(spec: BwdSpec, accumulate: bool = False, sums_block_cols: int = 0,
                stores_sums: bool = False, heads_per_list: int = 1) -> DqSpec:
    """The dQ kernel that runs beside a `dq_separate` backward: the same features, the same
    list blocks (the KV-centric kernel's tile_n when block-sparse); `accumulate` adds dQ into
    the given tensor's values, `sums_block_cols` a fused-dQ accumulator (`DqSpec`), or with
    `stores_sums` is stored into it; reading the dS tiles the backward stores (`stores_ds`),
    with DS_KV_STAGES of K and dS in flight, DS_HEADS_PER_CTA of a list's `heads_per_list`
    query heads per CTA where they divide them."""
    assert spec.dq_separate
    ds_layout = {}
    if spec.stores_ds:
        heads = DS_HEADS_PER_CTA if heads_per_list % DS_HEADS_PER_CTA == 0 else 1
        ds_layout = dict(reads_ds=True, kv_stages=DS_KV_STAGES, heads_per_cta=heads,
                         ctas_per_sm=1 if heads > 1 else DS_CTAS_PER_SM,
                         tile_m=128 if heads > 1 else 128 // DS_CTAS_PER_SM)
    return DqSpec(dtype=spec.dtype, head_dim=spec.head_dim, causal=spec.causal,
                  has_window_left=spec.has_window_left, has_window_right=spec.has_window_right,
                  block_sparse=spec.block_sparse, compressed=spec.compressed,
                  list_block=spec.tile_n if spec.block_sparse else 64, accumulate=accumulate,
                  q_positions=spec.q_positions, sums_block_cols=sums_block_cols,
                  stores_sums=stores_sums, **ds_layout)


# The dQ kernel reading dS tiles moves 16 KiB of K and 8 KiB of dS per 64 rows and product:
# it runs on memory, so its stages keep the loads ahead. Two CTAs per SM of one 64-row
# consumer warpgroup each (two 128-row CTAs of two do not build: every instruction must fit
# 65536 / (2 x 384) = 80 registers and the dQ product needs 94), or 1: one 128-row CTA per SM;
# H200, 2026-11-30, nsa()'s selected dQ two / one: 8K 0.238 / 0.244 ms, 64K 1.984 / 1.966.
DS_CTAS_PER_SM = 2
DS_KV_STAGES = 4
# The dQ kernel on the dS tiles is bound by L2: with one query head per CTA a GQA group's heads
# read each entry's K block once each per 64-row half (eight times per 128-row tile at group
# 4). Two heads of a list per CTA (a consumer warpgroup per head and half, one CTA per SM)
# share each K stage: H200, 2026-11-30, nsa()'s selected dQ kernel two heads / one head a CTA
# 1.561 / 1.638 ms on 8 x 8K, 1.657 / 1.799 log-normal, 1.593 / 1.725 at 64K. 1: one head per
# CTA (the switch for the A/B).
DS_HEADS_PER_CTA = 2


def ds_tile_count(block_sparse, num_heads: int) -> int:
    """The dS tiles a `stores_ds` backward keeps, of DS_TILE_ELEMENTS each: two 64 x 64 tiles
    per forward-list slot (full and mask, padded widths included) and query head of the list
    (kernels/sm90/ds_tiles.py)."""
    slots = block_sparse.full_index.numel() + block_sparse.mask_index.numel()
    heads_per_list = num_heads // block_sparse.full_count.shape[1]
    return slots * heads_per_list * 2
