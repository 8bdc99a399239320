"""tools/packed_workloads.py: the packed-document workloads of bench_nsa_vs_dense --packed and
the attended-pair counts behind its "share of the limit" column (pure functions, CPU, fast)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import packed_workloads as pw  # noqa: E402

# The configuration the H100 table was measured with (bench_nsa_vs_dense's CUDA defaults).
H100_RULE = pw.NSAPairRule(compress_block_size=64, selected_block_size=64,
                           num_selected_blocks=16, window_size=512)


def row_by_row_nsa_pairs(length: int, rule: pw.NSAPairRule) -> int:
    """The definition, one row at a time: selected min(i+1, n*l'), window min(i+1, w),
    compressed (i+1)//l."""
    selected_keys = rule.num_selected_blocks * rule.selected_block_size
    return sum(min(i + 1, selected_keys) + min(i + 1, rule.window_size)
               + (i + 1) // rule.compress_block_size for i in range(length))


def test_pair_counts_of_a_hand_checked_packing():
    # l = l' = 2, one selected block, window 2; documents of 4 and 1 tokens.
    # Document of 4, rows 0..3: selected 1+2+2+2 = 7, window 1+2+2+2 = 7, compressed
    # 0+1+1+2 = 4: 18 pairs against dense 1+2+3+4 = 10. Document of 1: 1 + 1 + 0 = 2 against 1.
    rule = pw.NSAPairRule(compress_block_size=2, selected_block_size=2, num_selected_blocks=1,
                          window_size=2)
    assert pw.nsa_document_pairs([4, 1], rule) == 20
    assert pw.dense_pairs([4, 1]) == 11
    assert pw.attended_pair_ratio([4, 1], rule) == pytest.approx(11 / 20)
    # Window off: the window branch adds nothing (7 + 4 and 1 + 0).
    no_window = pw.NSAPairRule(2, 2, 1, 0)
    assert pw.nsa_document_pairs([4, 1], no_window) == 12
    # Packing counts each document alone: one document of 5 (selected 9, window 9,
    # compressed 0+1+1+2+2 = 6) is not documents of 4 and 1.
    assert pw.dense_pairs([5]) == 15 and pw.nsa_document_pairs([5], rule) == 24


def test_pair_counts_match_the_row_by_row_definition():
    generator = random.Random(0)
    for _ in range(40):
        rule = pw.NSAPairRule(generator.choice([1, 2, 16, 64]), generator.choice([4, 16, 64]),
                              generator.randint(1, 16), generator.choice([0, 1, 7, 512]))
        lengths = [generator.randint(1, 3000) for _ in range(generator.randint(1, 4))]
        assert pw.nsa_document_pairs(lengths, rule) == sum(
            row_by_row_nsa_pairs(n, rule) for n in lengths)
        assert pw.dense_pairs(lengths) == sum(n * (n + 1) // 2 for n in lengths)


def test_the_four_standard_workloads_as_measured_on_the_h100():
    pytest.importorskip("numpy")
    expected = {  # name: (tokens, documents, longest, dense / NSA pairs to 2 places)
        "lognormal-2k": (65536, 25, 8031, 1.62),
        "docs-8k": (65536, 8, 8192, 2.70),
        "docs-1k": (16384, 16, 1024, 0.57),
        "docs-256": (16384, 64, 256, 0.50),
    }
    assert tuple(expected) == pw.STANDARD_WORKLOADS
    for name, (tokens, documents, longest, ratio) in expected.items():
        workload = pw.build_workload(name)
        assert (workload.total_tokens, workload.documents, workload.longest) == (
            tokens, documents, longest), name
        assert round(pw.attended_pair_ratio(workload.lengths, H100_RULE), 2) == ratio, name
        assert workload.cu_seqlens()[0] == 0 and workload.cu_seqlens()[-1] == tokens


def test_lognormal_lengths_reproduce_with_the_seed_and_fill_the_total_exactly():
    pytest.importorskip("numpy")
    first = pw.build_workload("lognormal-2k", seed=0)
    assert pw.build_workload("lognormal-2k", seed=0) == first
    # The first draws of seed 0 (pins numpy's stream: a change would move every table).
    assert first.lengths[:5] == (2322, 1794, 3885, 2274, 1198)
    assert pw.build_workload("lognormal-2k", seed=1).lengths != first.lengths
    for total in (1, 100, 2047, 65536, 100_003):
        lengths = pw.lognormal_lengths(total, 2048, seed=3)
        assert sum(lengths) == total and min(lengths) >= 1
    # Drawn one at a time: a larger total keeps the earlier documents (all but the trimmed one).
    short, long = pw.lognormal_lengths(30_000, 2048), pw.lognormal_lengths(65_536, 2048)
    assert long[:len(short) - 1] == short[:-1]


def test_lognormal_lengths_honour_the_cap():
    pytest.importorskip("numpy")
    # Median 16K, sigma 1: about a quarter of the draws exceed the 32K cap.
    lengths = pw.build_workload("lognormal-16k", 1 << 20).lengths
    assert max(lengths) == pw.LOGNORMAL_CAP and sum(lengths) == 1 << 20
    assert max(pw.lognormal_lengths(50_000, 1000, cap=1500)) == 1500


def test_equal_documents_hold_the_remainder_last():
    assert pw.equal_lengths(1024, 256) == [256] * 4
    assert pw.equal_lengths(1000, 256) == [256, 256, 256, 232]
    assert pw.equal_lengths(100, 256) == [100]
    assert pw.build_workload("docs-1k", 2500).lengths == (1024, 1024, 452)


def test_workload_names_and_default_totals():
    assert pw.parse_workload_name("lognormal-2k") == ("lognormal", 2048)
    assert pw.parse_workload_name("docs-256") == ("docs", 256)
    assert [pw.default_total_tokens(n) for n in pw.STANDARD_WORKLOADS] == [
        65536, 65536, 16384, 16384]
    for bad in ("docs-0", "docs", "uniform-1k", "docs-1m", "lognormal-2K"):
        with pytest.raises(ValueError, match="unknown packed workload"):
            pw.parse_workload_name(bad)
    with pytest.raises(ValueError, match="total_tokens"):
        pw.equal_lengths(0, 256)


def test_share_of_limit_is_the_speedup_over_the_pair_ratio():
    # The first hand-measured row: nsa 24.44 ms, dense FA4 16.72 ms, ratio 1.615.
    ratio = 1.615
    assert pw.share_of_limit(16.72, 24.44, ratio) == pytest.approx((16.72 / 24.44) / ratio)
    # At the limit exactly: NSA's time is dense's divided by the ratio.
    assert pw.share_of_limit(10.0, 10.0 / 2.7, 2.7) == pytest.approx(1.0)
