"""Tiny random hybrid models (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next: Gated-DeltaNet + gated
attention, routed + shared experts for the MoE ones) against the float64 transformers reference in
tests/fixtures/hybrid/: prefill (serial and chunked GDN), token-by-token decode,
prefill-then-decode, two sequences in one batch, hidden-row export; snapshot-plane rollback and
save/restore (T2.3), refused rollbacks (T2.4), the micro-batch splitter (T2.5), the speculative
restore-and-replay fallback, n-gram speculation through pyfast.LLM, clear errors for missing /
mis-shaped recurrent tensors, the MTP block graph and batch invariance. Qwen3.5-only checks live
in test_qwen35_tiny.py.

Errors are max over rows of max|a - b| / max|b| (see test_hybrid_common.py): < 1e-3 against the
reference, < 1e-5 between our own runs (in practice they are bit-identical)."""
from __future__ import annotations

import pytest

from tests.models import test_hybrid_common as H

NAMES = ["qwen35", "qwen35moe", "qwen3next"]
pytestmark = [pytest.mark.skipif(not H.has_ops("gated_delta_net", "ssm_conv"), reason="native lacks the GDN ops"),
              pytest.mark.parametrize("name", NAMES)]


def test_prefill_matches_reference(name):
    assert H.record(name, "prefill", H.check_prefill_isas(name)) < H.TOL


def test_chunked_prefill_matches_reference(name):
    # chunk_min 4: the 13- and 9-token segments (and the 8 + 5 micro-batches) take the chunked form
    assert H.record(name, "prefill-chunked", H.check_prefill(name, chunk_min=4)) < H.TOL
    assert H.record(name, "prefill-chunked", H.check_prefill(name, chunk_min=4, n_ubatch=8)) < H.TOL


def test_prefill_in_micro_batches(name):
    assert H.record(name, "prefill-ubatch3", H.check_prefill(name, n_ubatch=3)) < H.TOL


def test_token_by_token_decode(name):
    assert H.record(name, "decode", H.check_decode(name)) < H.TOL


def test_prefill_then_decode(name):
    assert H.record(name, "prefill+decode", H.check_prefill_then_decode(name)) < H.TOL


def test_two_sequences_in_one_batch(name):
    assert H.record(name, "two-seqs", H.check_two_sequences(name)) < H.TOL


def test_hidden_export(name):
    assert H.record(name, "hidden", H.check_hidden(name)) < H.TOL


def test_rollback_then_redecode_equals_fresh_run(name):
    assert H.record(name, "rollback", H.check_rollback(name, R=3)) < H.TOL_SELF


def test_save_restore_fresh_and_dirty_context(name):
    assert H.record(name, "save-restore", H.check_save_restore(name, R=3)) < H.TOL_SELF


def test_rollback_refused_beyond_planes(name):
    H.check_rollback_errors(name, R=2)


def test_splitter_keeps_tails_together(name):
    assert H.record(name, "splitter", H.check_splitter(name)) < H.TOL


def test_spec_fallback_restore_and_replay(name):
    H.check_spec_fallback(name)


def test_ngram_speculation_greedy_identical(name):
    H.check_ngram_llm(name)


def test_missing_or_misshaped_recurrent_tensors(name, tmp_path):
    H.check_tensor_errors(name, tmp_path)


def test_trunk_ignores_nextn_blocks(name):
    model, _ = H.load(name)
    a = model.args
    assert a.n_nextn == 1 and a.n_layer == int(model.metadata[f"{name}.block_count"]) - 1
    assert f"blk.{a.n_layer}.nextn.eh_proj.weight" in model.weights
    spec = model.memory_spec()
    assert spec.recurrent_layers == (0, 1, 2) and spec.attn_layers == (3,)


def test_nextn_block_graph_matches_reference(name):
    """qwen35.build_nextn (the MTP block on its own KV cache) against the MTP reference."""
    assert H.record(name, "nextn", H.check_nextn(name)) < H.TOL


def test_batch_invariant_bit_exact(name):
    H.check_batch_invariance(name)


def test_merged_gate_up_experts(name, tmp_path):
    if name == "qwen35":
        pytest.skip("qwen35 is dense: no experts to merge")
    assert H.record(name, "merged-gate-up", H.check_merged_gate_up(name, tmp_path)) < H.TOL
