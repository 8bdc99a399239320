"""The causal LM (nsa/models/lm.py), the document corpus (corpus.py) and the optional Hugging
Face wrapper (hf.py, skipped where transformers is not installed)."""
from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from nsa.models.corpus import (DocumentPacker, find_documents, heldout_batches, is_heldout,
                               source_roots, split_documents)
from nsa.models.lm import (BOS_ID, EOS_ID, MODEL_PRESETS, CausalLM, LMConfig,
                           shared_parameter_names)

# The tiny preset with nsa()'s small test tiles: short inputs cover many selection tiles.
TINY = replace(MODEL_PRESETS["tiny"], compress_block_size=4, selected_block_size=8,
               num_selected_blocks=4, window_size=12, test_q_tile=16, test_cmp_kv_block=4)
LENGTHS = [50, 7, 39]


def packed_ids(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (sum(lengths),), generator=generator)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return ids, cu


def test_presets_sizes():
    """tiny for CI; small ~90M and base ~170M parameters for the GPU comparison."""
    counts = {}
    for name in ("small", "base"):  # counted from the config: building them takes seconds
        config = MODEL_PRESETS[name]
        per_layer = (config.hidden_size * config.head_dim
                     * (2 * config.num_heads + 2 * config.num_kv_heads)
                     + 3 * config.hidden_size * config.intermediate_size)
        counts[name] = per_layer * config.num_layers
    assert 60e6 < counts["small"] < 120e6
    assert 100e6 < counts["base"] < 300e6


def test_nsa_and_dense_models_share_every_common_weight():
    nsa_model = CausalLM(TINY, seed=3)
    dense_model = CausalLM(TINY.with_attention("dense"), seed=3)
    names = shared_parameter_names(nsa_model, dense_model)
    dense_parameters = dict(dense_model.named_parameters())
    assert set(dense_parameters) == set(names)  # dense has nothing of its own
    for name, parameter in nsa_model.named_parameters():
        if name in dense_parameters:
            assert torch.equal(parameter, dense_parameters[name]), name
        else:
            assert name.rsplit(".", 1)[-1] in ("W_k", "W_v", "W_gate")
    other_seed = CausalLM(TINY, seed=4)
    assert not torch.equal(other_seed.embedding.weight, nsa_model.embedding.weight)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_packed_equals_padded_and_loss_and_gradients(attention):
    config = TINY.with_attention(attention)
    model = CausalLM(config, seed=0)
    ids, cu = packed_ids([40, 40])
    packed_logits = model(ids, cu_seqlens=cu)
    padded_logits = model(ids.view(2, 40))
    torch.testing.assert_close(packed_logits.view(2, 40, -1), padded_logits,
                               rtol=1e-5, atol=1e-5)
    labels = torch.cat([ids[1:], ids.new_tensor([-100])])
    loss = model(ids, cu_seqlens=cu, labels=labels)
    torch.testing.assert_close(loss, F.cross_entropy(packed_logits, labels, ignore_index=-100))
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


def test_recompute_reaches_every_layer():
    """LMConfig.recompute is the layers' nsa() memory policy (no effect on values)."""
    model = CausalLM(replace(MODEL_PRESETS["tiny"], recompute=True))
    layers = [m for m in model.modules() if type(m).__name__ == "NSAAttention"]
    assert layers and all(layer.recompute is True for layer in layers)


def test_state_dict_round_trip():
    model = CausalLM(TINY, seed=1)
    with torch.no_grad():
        for parameter in model.parameters():  # off the initial values, W_k/W_v included
            parameter.add_(torch.randn_like(parameter) * 0.01)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    restored = CausalLM(TINY, seed=2)
    restored.load_state_dict(torch.load(buffer))
    ids, cu = packed_ids(LENGTHS)
    assert torch.equal(model(ids, cu_seqlens=cu), restored(ids, cu_seqlens=cu))


def test_documents_do_not_see_each_other():
    model = CausalLM(TINY, seed=0)
    ids, cu = packed_ids(LENGTHS)
    logits = model(ids, cu_seqlens=cu)
    a, b = int(cu[2]), int(cu[3])
    alone = model(ids[a:b], cu_seqlens=torch.tensor([0, b - a], dtype=torch.int32))
    torch.testing.assert_close(logits[a:b], alone, rtol=1e-5, atol=1e-5)


def test_context_parallel_layout_is_refused_by_name():
    """Before the positions or any layer read it, and before the group is used (a stand-in
    object: nothing may reach it)."""
    ids, cu = packed_ids(LENGTHS)
    with pytest.raises(ValueError, match="context_parallel_layout must be one of"):
        CausalLM(TINY, seed=0)(ids, cu_seqlens=cu, context_parallel_group=object(),
                               context_parallel_layout="zig-zag")


# --- corpus ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stdlib_documents():
    return find_documents(source_roots(include_torch=False))


def test_corpus_is_sorted_and_split_by_a_fixed_rule(stdlib_documents):
    names = [d.name for d in stdlib_documents]
    assert names == sorted(names) and len(names) > 500
    assert all(n.startswith("stdlib/") and n.endswith(".py") for n in names)
    train, heldout = split_documents(stdlib_documents)
    assert {d.name for d in train}.isdisjoint(d.name for d in heldout)
    assert len(train) + len(heldout) == len(stdlib_documents)
    assert 0.02 < len(heldout) / len(stdlib_documents) < 0.09
    assert all(is_heldout(d.name) for d in heldout)
    document = stdlib_documents[0]
    tokens = document.tokens()
    assert tokens[0] == BOS_ID and tokens[-1] == EOS_ID
    assert document.paths == (document.paths[0],)
    assert bytes(tokens[1:-1].tolist()) == document.paths[0].read_bytes()


def test_package_documents_join_one_directory_s_files_in_name_order(stdlib_documents):
    packages = find_documents(source_roots(include_torch=False), unit="package")
    names = [d.name for d in packages]
    assert names == sorted(names) and all(n.endswith("/") for n in names)
    by_directory = {}
    for d in stdlib_documents:  # the file documents, grouped by their directory
        by_directory.setdefault(d.name[:d.name.rindex("/") + 1], []).append(d.paths[0])
    assert {d.name: d.paths for d in packages} == {k: tuple(v) for k, v in by_directory.items()}
    json = next(d for d in packages if d.name == "stdlib/json/")
    assert len(json.paths) > 1
    tokens = json.tokens()
    assert tokens[0] == BOS_ID and tokens[-1] == EOS_ID
    assert bytes(tokens[1:-1].tolist()) == b"".join(p.read_bytes() for p in json.paths)
    lengths = sorted(len(d.tokens()) for d in packages[:60])
    assert lengths[len(lengths) // 2] > 8192  # long documents, unlike most files
    with pytest.raises(ValueError, match="unit must be one of"):
        find_documents(source_roots(include_torch=False), unit="module")


def test_packer_fills_batches_splits_documents_and_replays(stdlib_documents):
    documents = stdlib_documents[:30]
    tokens_per_batch = 4096
    stream = iter(DocumentPacker(documents, tokens_per_batch, seed=5))
    batches = [next(stream) for _ in range(12)]  # more than one epoch of 30 files
    again = iter(DocumentPacker(documents, tokens_per_batch, seed=5))
    for batch in batches:
        assert batch.num_tokens == tokens_per_batch  # always full, never padded
        assert batch.host_cu_seqlens == tuple(batch.cu_seqlens.tolist())
        assert batch.max_seqlen == max(b - a for a, b in zip(batch.host_cu_seqlens,
                                                              batch.host_cu_seqlens[1:]))
        ends = torch.tensor(batch.host_cu_seqlens[1:]) - 1
        assert (batch.labels[ends] == -100).all()
        inside = torch.ones(batch.num_tokens, dtype=torch.bool)
        inside[ends] = False
        assert torch.equal(batch.labels[:-1][inside[:-1]], batch.input_ids[1:][inside[:-1]])
        replay = next(again)
        assert torch.equal(replay.input_ids, batch.input_ids)
    # The stream is the documents in the epoch's shuffled order, whole: rebuild the first one.
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(5))
    stream_tokens = torch.cat([b.input_ids for b in batches])
    first = documents[int(order[0])].tokens()
    assert torch.equal(stream_tokens[:len(first)], first)
    assert not torch.equal(next(iter(DocumentPacker(documents, tokens_per_batch, seed=6)))
                           .input_ids, batches[0].input_ids)


def test_heldout_batches_are_fixed_and_the_last_is_not_padded(stdlib_documents):
    _, heldout = split_documents(stdlib_documents)
    few = heldout[:3]
    total = sum(len(d.tokens()) for d in few)
    batches = heldout_batches(few, 4096, count=1000)
    assert sum(b.num_tokens for b in batches) == total
    assert all(b.num_tokens == 4096 for b in batches[:-1])
    assert 0 < batches[-1].num_tokens <= 4096
    assert torch.equal(heldout_batches(few, 4096, count=1)[0].input_ids, batches[0].input_ids)


def test_empty_corpus_is_refused():
    with pytest.raises(ValueError, match="empty"):
        DocumentPacker([], 1024)


# --- Hugging Face ------------------------------------------------------------------------------

def test_hugging_face_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nsa.models.hf import NSALMConfig, NSALMForCausalLM, register_auto_classes

    register_auto_classes()
    fields = {k: v for k, v in TINY.to_dict().items()}
    config = NSALMConfig(**fields)
    assert config.lm_config() == TINY
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert isinstance(model, NSALMForCausalLM)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(reloaded, NSALMForCausalLM)
    assert reloaded.config.lm_config() == TINY
    ids, cu = packed_ids(LENGTHS)
    out = model(ids[None], labels=ids[None], cu_seqlens=cu)
    again = reloaded(ids[None], labels=ids[None], cu_seqlens=cu)
    assert torch.equal(out.logits, again.logits)
    assert out.logits.shape == (1, sum(LENGTHS), TINY.vocab_size)
    # Shifted inside, never across a sequence boundary.
    targets = torch.cat([ids[1:], ids.new_tensor([-100])])
    targets[cu[1:].long() - 1] = -100
    expected = F.cross_entropy(out.logits[0], targets, ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    padded = model(ids[:80].view(2, 40), labels=ids[:80].view(2, 40))
    assert padded.logits.shape == (2, 40, TINY.vocab_size) and torch.isfinite(padded.loss)
    assert isinstance(LMConfig(**config.lm_config().to_dict()), LMConfig)
