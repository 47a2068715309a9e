"""Tiny random Qwen3.5-MoE (Gated-DeltaNet + gated attention, routed + shared experts) against the float64
transformers reference in tests/fixtures/hybrid/: prefill (serial and chunked GDN), token-by-token
decode, prefill-then-decode, two sequences in one batch, hidden-row export; snapshot-plane
rollback and save/restore (T2.3), refused rollbacks (T2.4), the micro-batch splitter (T2.5), the
speculative restore-and-replay fallback, n-gram speculation through pyfast.LLM, and clear errors
for missing / mis-shaped recurrent tensors.

Errors are max over rows of max|a - b| / max|b| (see test_hybrid_common.py): < 1e-3 against the
reference, < 1e-5 between our own runs (in practice they are bit-identical)."""
from __future__ import annotations

import pytest

from tests.models import test_hybrid_common as H

NAME = "qwen35moe"
pytestmark = pytest.mark.skipif(not H.has_ops("gated_delta_net", "ssm_conv"), reason="native lacks the GDN ops")


def test_prefill_matches_reference():
    assert H.record(NAME, "prefill", H.check_prefill_isas(NAME)) < H.TOL


def test_chunked_prefill_matches_reference():
    # chunk_min 4: the 13- and 9-token segments (and the 8 + 5 micro-batches) take the chunked form
    assert H.record(NAME, "prefill-chunked", H.check_prefill(NAME, chunk_min=4)) < H.TOL
    assert H.record(NAME, "prefill-chunked", H.check_prefill(NAME, chunk_min=4, n_ubatch=8)) < H.TOL


def test_prefill_in_micro_batches():
    assert H.record(NAME, "prefill-ubatch3", H.check_prefill(NAME, n_ubatch=3)) < H.TOL


def test_token_by_token_decode():
    assert H.record(NAME, "decode", H.check_decode(NAME)) < H.TOL


def test_prefill_then_decode():
    assert H.record(NAME, "prefill+decode", H.check_prefill_then_decode(NAME)) < H.TOL


def test_two_sequences_in_one_batch():
    assert H.record(NAME, "two-seqs", H.check_two_sequences(NAME)) < H.TOL


def test_hidden_export():
    assert H.record(NAME, "hidden", H.check_hidden(NAME)) < H.TOL


def test_rollback_then_redecode_equals_fresh_run():
    assert H.record(NAME, "rollback", H.check_rollback(NAME, R=3)) < H.TOL_SELF


def test_save_restore_fresh_and_dirty_context():
    assert H.record(NAME, "save-restore", H.check_save_restore(NAME, R=3)) < H.TOL_SELF


def test_rollback_refused_beyond_planes():
    H.check_rollback_errors(NAME, R=2)


def test_splitter_keeps_tails_together():
    assert H.record(NAME, "splitter", H.check_splitter(NAME)) < H.TOL


def test_spec_fallback_restore_and_replay():
    H.check_spec_fallback(NAME)


def test_ngram_speculation_greedy_identical():
    H.check_ngram_llm(NAME)


def test_missing_or_misshaped_recurrent_tensors(tmp_path):
    H.check_tensor_errors(NAME, tmp_path)


def test_trunk_ignores_nextn_blocks():
    model, _ = H.load(NAME)
    a = model.args
    assert a.n_nextn == 1 and a.n_layer == int(model.metadata[f"{NAME}.block_count"]) - 1
    assert f"blk.{a.n_layer}.nextn.eh_proj.weight" in model.weights
    spec = model.memory_spec()
    assert spec.recurrent_layers == (0, 1, 2) and spec.attn_layers == (3,)


def test_nextn_block_graph_matches_reference():
    """qwen35.build_nextn (the MTP block on its own KV cache) against the MTP reference."""
    assert H.record(NAME, "nextn", H.check_nextn(NAME)) < H.TOL


def test_batch_invariant_bit_exact():
    H.check_batch_invariance(NAME)


def test_merged_gate_up_experts(tmp_path):
    assert H.record(NAME, "merged-gate-up", H.check_merged_gate_up(NAME, tmp_path)) < H.TOL
