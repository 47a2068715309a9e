"""Every op case, declared once as data: op, leaf arguments (shape, dtype, values, layout),
params and tolerance. test_ops.py runs each one for every ISA this CPU has and 1 and 3 threads.

Shapes use odd sizes (1, 7, 33, 65) on purpose: they straddle SIMD widths, block sizes and the
kernels' tiles (matmul: 16 weight rows x 64 activation rows per work item; attention: 8 query
rows per tile). Layouts make the op read strided memory: permuted(...) views and padded(...)
views into a larger input (whose memory outside the view is NaN).

ACCEPTS lists, for each op and argument (or "out" for cpy's target dtype), the dtypes the op
accepts; test_ops.test_dtype_coverage checks every one of them has a case.
"""
from __future__ import annotations

import numpy as np

from .harness import (
    BF16, EXACT, F16, F32, I32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QUANT, TOL_F32, TOL_QMM,
    WEIGHT_TYPES, K_QUANTS,
    CONTIG, Arg, Case, Tol, causal_mask, choice, fixed, ints, kv_mask, normal, padded, permutation, permuted,
)

FLOATS = (F32, F16, BF16)
QUANTS = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)

ACCEPTS = {
    "get_rows": {0: set(WEIGHT_TYPES), 1: {I32}},
    "matmul": {0: {F32}, 1: set(WEIGHT_TYPES)},
    "add": {0: {F32}, 1: {F32}},
    "mul": {0: {F32}, 1: {F32}},
    "scale": {0: {F32}},
    "rms_norm": {0: {F32}},
    "rope": {0: {F32}, 1: {I32}, 2: {F32}},
    "softmax": {0: {F32}, 1: {F32}},
    "attention": {0: {F32}, 1: {F32, F16, Q8_0}, 2: {F32, F16, Q8_0}, 3: {F32}, 4: {I32}},
    "silu": {0: {F32}},
    "swiglu": {0: {F32}, 1: {F32}},
    "set_rows": {0: set(WEIGHT_TYPES), 1: {F32}, 2: {I32}},
    "cpy": {0: set(WEIGHT_TYPES), "out": set(WEIGHT_TYPES)},
    "argmax": {0: {F32}},
    "reshape": {0: {F32, F16, BF16, I32, *QUANTS}},
    "view": {0: {F32, F16, BF16, I32, *QUANTS}},
    "permute": {0: {F32, F16, BF16, I32}},
    "sigmoid": {0: {F32}},
    "softplus": {0: {F32}},
    "relu": {0: {F32}},
    "gelu": {0: {F32}},
    "tanh": {0: {F32}},
    "l2_norm": {0: {F32}},
    "concat": {0: {F32}, 1: {F32}},
    "sum": {0: {F32}},
    "topk": {0: {F32}},
    "topk_mask": {0: {F32}},
    "gather": {0: {F32}, 1: {I32}},
    "matmul_id": {0: {F32}, 1: set(WEIGHT_TYPES), 2: {I32}},
    "ssm_conv": {0: {F32}, 1: {F32}, 2: {F32}, 3: {I32}},
    "gated_delta_net": {0: {F32}, 1: {F32}, 2: {F32}, 3: {F32}, 4: {F32}, 5: {F32}, 6: {I32}},
    "allreduce": {0: {F32}},
}


def _mm_tol(wt) -> Tol:
    return TOL_QMM if wt in QUANT else TOL_F32


def _row(dt, n32: int) -> int:
    """A row length for dt: n32 for the 32-block and float types, 256 * ceil(n32 / 256) for the
    K-quants (256-element super-blocks)."""
    return -(-n32 // 256) * 256 if dt in K_QUANTS else n32


def _cases() -> list[Case]:
    C: list[Case] = []

    # ---- get_rows: the decoded rows must equal the table's rows exactly -------------------
    for dt, (V, D) in {F32: (33, 7), F16: (65, 33), BF16: (7, 65), Q8_0: (33, 64),
                       Q4_0: (7, 96), Q4_1: (65, 32), Q5_0: (33, 64), Q5_1: (7, 96), Q4_K: (9, 256),
                       Q5_K: (7, 512), Q6_K: (33, 256)}.items():
        C.append(Case("get_rows", (Arg((V, D), dt), Arg((9,), I32, ints(0, V))), tol=EXACT))
    C += [
        Case("get_rows", (Arg((5, 32), F32), Arg((1,), I32, fixed([4]))), tol=EXACT),
        Case("get_rows", (Arg((7, 3, 32), F32), Arg((5,), I32, fixed([6, 0, 6, 3, 1]))), tol=EXACT),
        Case("get_rows", (Arg((7, 3, 32), Q8_0), Arg((4,), I32, fixed([0, 6, 2, 2]))), tol=EXACT),
        # strided table rows (a view of every row of a wider table) and strided ids
        Case("get_rows", (Arg((9, 33), F32, layout=padded((2, 7))), Arg((6,), I32, ints(0, 9))), tol=EXACT),
        Case("get_rows", (Arg((9, 64), Q4_0, layout=padded((3, 64))), Arg((6,), I32, ints(0, 9))), tol=EXACT),
        Case("get_rows", (Arg((9, 256), Q6_K, layout=padded((3, 512))), Arg((6,), I32, ints(0, 9))), tol=EXACT),
        Case("get_rows", (Arg((7, 2, 256), Q4_K), Arg((4,), I32, fixed([0, 6, 2, 2]))), tol=EXACT),
        Case("get_rows", (Arg((9, 65), F16, layout=padded((1, 0))),
                          Arg((7,), I32, ints(0, 9), layout=padded((3,), step=2))), tol=EXACT),
        # a 3-D table whose rows [H, D] are not contiguous (permuted from [H, V, D])
        Case("get_rows", (Arg((7, 3, 32), F32, layout=permuted(1, 0, 2)), Arg((4,), I32, fixed([6, 0, 3, 3]))),
             tol=EXACT, label="table_rows_noncontig"),
    ]

    # ---- matmul: x[..., K] @ w[N, K].T for every weight dtype --------------------------------
    for wt in WEIGHT_TYPES:
        Ks = (256, 512, 768) if wt in K_QUANTS else (32, 96, 288) if wt in QUANT else (1, 33, 300)
        for (M, N), K in zip(((1, 1), (7, 33), (33, 65)), Ks):
            C.append(Case("matmul", (Arg((M, K)), Arg((N, K), wt, normal(0.5))), tol=_mm_tol(wt)))
        K = 256 if wt in K_QUANTS else 64 if wt in QUANT else 65
        C += [
            # batched 3-D / 4-D activations, a permuted x (inner dim contiguous) and strided rows
            Case("matmul", (Arg((2, 5, K)), Arg((7, K), wt)), tol=_mm_tol(wt)),
            Case("matmul", (Arg((5, 3, K), layout=permuted(1, 0, 2)), Arg((17, K), wt)), tol=_mm_tol(wt)),
            Case("matmul", (Arg((9, K), layout=padded((2, 32))), Arg((16, K), wt, layout=padded((3, 0)))),
                 tol=_mm_tol(wt)),
        ]
    C += [
        Case("matmul", (Arg((2, 1, 3, 64)), Arg((5, 64), F16)), tol=TOL_F32),
        Case("matmul", (Arg((64,)), Arg((7, 64), Q8_0)), tol=TOL_QMM),  # 1-D x
        # rows starting 4 bytes past a 64-byte boundary (no alignment assumptions in the kernels)
        Case("matmul", (Arg((5, 64), layout=padded((1, 3), start=(0, 1))), Arg((9, 64), Q8_0)), tol=TOL_QMM),
        Case("matmul", (Arg((5, 37), layout=padded((1, 3), start=(0, 1))),
                        Arg((9, 37), F16, layout=padded((1, 1), start=(0, 1)))), tol=TOL_F32),
        Case("matmul", (Arg((2, 3, 4, 64), layout=permuted(2, 0, 1, 3)), Arg((5, 64), Q4_0)), tol=TOL_QMM),
        Case("matmul", (Arg((2, 3, 4, 33), layout=permuted(1, 2, 0, 3)), Arg((5, 33), BF16)), tol=TOL_F32),
        Case("matmul", (Arg((65, 64)), Arg((33, 64), Q4_1)), tol=TOL_QMM),  # > one 64-row tile
        Case("matmul", (Arg((3, 1024), normal(3.0)), Arg((7, 1024), Q8_0, normal(0.02))), tol=TOL_QMM),
        Case("matmul", (Arg((4, 64), normal(1.0, 5.0)), Arg((9, 64), Q4_1, normal(0.1, 0.3))), tol=TOL_QMM),
        # the newer types: unaligned rows, > one 64-row tile, offset-heavy weights, long rows
        Case("matmul", (Arg((5, 256), layout=padded((1, 3), start=(0, 1))), Arg((9, 256), Q6_K)), tol=TOL_QMM),
        Case("matmul", (Arg((5, 512), layout=padded((1, 3), start=(0, 1))), Arg((7, 512), Q5_K)), tol=TOL_QMM),
        Case("matmul", (Arg((65, 256)), Arg((17, 256), Q4_K)), tol=TOL_QMM),
        Case("matmul", (Arg((65, 64)), Arg((33, 64), Q5_0)), tol=TOL_QMM),
        Case("matmul", (Arg((4, 96), normal(1.0, 5.0)), Arg((9, 96), Q5_1, normal(0.1, 0.3))), tol=TOL_QMM),
        Case("matmul", (Arg((4, 256), normal(1.0, 5.0)), Arg((9, 256), Q4_K, normal(0.1, 0.3))), tol=TOL_QMM),
        Case("matmul", (Arg((3, 1536), normal(3.0)), Arg((7, 1536), Q6_K, normal(0.02))), tol=TOL_QMM),
    ]

    # ---- elementwise with broadcasting ------------------------------------------------------
    for op in ("add", "mul"):
        C += [
            Case(op, (Arg((7, 33)), Arg((7, 33)))),
            Case(op, (Arg((7, 33)), Arg((33,)))),
            Case(op, (Arg((7, 33)), Arg((7, 1)))),
            Case(op, (Arg((1,)), Arg((1,)))),
            Case(op, (Arg((3, 5, 65)), Arg((5, 1)))),
            Case(op, (Arg((2, 3, 5, 65)), Arg((1, 3, 1, 65)))),
            Case(op, (Arg((5, 7, 3), layout=permuted(2, 0, 1)), Arg((7, 3)))),
            Case(op, (Arg((7, 33), layout=padded((2, 5))), Arg((33,), layout=padded((4,), step=3)))),
            Case(op, (Arg((6, 33)), Arg((6, 33), layout=permuted(1, 0)))),
        ]
    C += [
        Case("scale", (Arg((7, 33)),), {"s": 0.5}),
        Case("scale", (Arg((1,)),), {"s": -3.0}),
        Case("scale", (Arg((5, 7, 3), layout=permuted(1, 2, 0)),), {"s": 0.1}),
        Case("scale", (Arg((7, 65), layout=padded((1, 9), step=2)),), {"s": 1e-3}),
        Case("allreduce", (Arg((7, 33)),), tol=EXACT),
        Case("allreduce", (Arg((5, 7, 3), layout=permuted(1, 2, 0)),), tol=EXACT),
        Case("allreduce", (Arg((3, 65)),), {"root_only": True}, tol=EXACT),
    ]

    # ---- rms_norm ---------------------------------------------------------------------------
    C += [
        Case("rms_norm", (Arg((1, 1)),), {"eps": 1e-6}),
        Case("rms_norm", (Arg((7, 33)),), {"eps": 1e-5}),
        Case("rms_norm", (Arg((3, 65), normal(10.0, 3.0)),), {"eps": 0.0}),
        Case("rms_norm", (Arg((2, 3, 576)),), {"eps": 1e-5}),
        Case("rms_norm", (Arg((7, 33), layout=permuted(1, 0)),), {"eps": 1e-6}),  # inner stride 28 B
        Case("rms_norm", (Arg((4, 3, 17), layout=padded((1, 2, 4))),), {"eps": 1e-6}),
        Case("rms_norm", (Arg((5, 8), normal(1e-3)),), {"eps": 1e-2}),
    ]

    # ---- rope -------------------------------------------------------------------------------
    for mode in (0, 2):
        C += [
            Case("rope", (Arg((1, 1, 2)), Arg((1,), I32, fixed([3]))), {"n_dims": 2, "mode": mode}),
            Case("rope", (Arg((2, 3, 10)), Arg((2,), I32, fixed([9, 40]))), {"n_dims": 6, "mode": mode}),
            Case("rope", (Arg((2, 1, 1040)), Arg((2,), I32, fixed([5, 3000]))), {"n_dims": 1024, "mode": mode}),
            Case("rope", (Arg((7, 3, 64)), Arg((7,), I32, ints(0, 4096))), {"n_dims": 64, "mode": mode}),
            Case("rope", (Arg((5, 2, 80)), Arg((5,), I32, fixed([0, 1, 2, 100, 7]))),
                 {"n_dims": 32, "mode": mode, "freq_base": 1e6, "freq_scale": 0.25}),
            Case("rope", (Arg((7, 4, 32), layout=permuted(1, 0, 2)), Arg((7,), I32, ints(0, 64))),
                 {"n_dims": 32, "mode": mode}),
            Case("rope", (Arg((3, 2, 34), layout=padded((1, 1, 3), step=2)), Arg((3,), I32, ints(0, 9))),
                 {"n_dims": 16, "mode": mode, "freq_base": 500.0}),
            # per-pair frequency factors (Llama 3's rope_freqs), YaRN, both, and an attention factor
            Case("rope", (Arg((5, 3, 64)), Arg((5,), I32, fixed([0, 1, 77, 900, 8191])),
                          Arg((16,), F32, fixed(np.linspace(1.0, 8.0, 16)))),
                 {"n_dims": 32, "mode": mode, "freq_base": 5e5}),
            Case("rope", (Arg((6, 2, 48)), Arg((6,), I32, fixed([0, 3, 100, 2047, 4096, 70000]))),
                 {"n_dims": 48, "mode": mode, "freq_base": 1e4, "freq_scale": 0.25, "ext_factor": 1.0,
                  "corr_low": 4.0, "corr_high": 15.0}),
            Case("rope", (Arg((4, 2, 32), layout=permuted(1, 0, 2)), Arg((4,), I32, ints(0, 5000)),
                          Arg((8,), F32, fixed([1.0, 1.0, 2.0, 3.5, 4.0, 4.0, 6.0, 8.0]))),
                 {"n_dims": 16, "mode": mode, "freq_scale": 0.5, "ext_factor": 0.5, "attn_factor": 0.8,
                  "corr_low": 2.0, "corr_high": 2.0}),
            Case("rope", (Arg((3, 1, 16)), Arg((3,), I32, fixed([1, 2, 3]))),
                 {"n_dims": 16, "mode": mode, "attn_factor": 1.25}),
        ]

    # ---- softmax ----------------------------------------------------------------------------
    C += [
        Case("softmax", (Arg((7, 33)),)),
        Case("softmax", (Arg((1, 1)),)),
        Case("softmax", (Arg((7, 33), normal(5.0)),), {"scale": 0.125}),
        Case("softmax", (Arg((7, 33)), Arg((7, 33), F32, kv_mask(0.5, full_rows=(3,))))),
        Case("softmax", (Arg((5, 65)), Arg((65,), F32, kv_mask(0.2, bias=2.0))), {"scale": 0.3}),
        Case("softmax", (Arg((3, 5, 65)), Arg((5, 65), F32, kv_mask(0.3)))),
        Case("softmax", (Arg((6, 9)), Arg((6, 1), F32, normal()))),
        Case("softmax", (Arg((33, 7), layout=permuted(1, 0)), Arg((33, 7), F32, kv_mask(0.3)))),
        Case("softmax", (Arg((7, 33), layout=padded((1, 3))),
                         Arg((7, 33), F32, kv_mask(0.3), layout=padded((2, 5))))),
    ]

    # ---- attention --------------------------------------------------------------------------
    def att(T, Hq, Hkv, D, n_kv, kt=F32, vt=F32, Dv=None, mask=None, order=False, scale=None,
            qlay=None, kvlay=None, label=""):
        Dv = Dv or D
        args = [
            Arg((T, Hq, D), F32, layout=qlay or CONTIG),
            Arg((n_kv, Hkv, D), kt, layout=kvlay or CONTIG),
            Arg((n_kv, Hkv, Dv), vt, layout=kvlay or CONTIG),
            Arg((T, n_kv), F32, mask or kv_mask(0.3)),
        ]
        if order:
            args.append(Arg((n_kv,), I32, permutation()))
        return Case("attention", tuple(args), {"scale": scale if scale is not None else D ** -0.5},
                    label=label)

    C += [
        att(1, 1, 1, 8, 1, label="tiny"),
        att(7, 4, 2, 64, 33, mask=causal_mask(26), label="causal_gqa2"),
        att(7, 4, 2, 64, 33, kt=F16, vt=F16, mask=causal_mask(26), label="causal_f16"),
        att(5, 6, 2, 32, 65, kt=F16, vt=F32, Dv=48, label="gqa3_mixed_dv48"),
        att(9, 2, 2, 16, 17, mask=kv_mask(0.4, full_rows=(0, 5)), label="fully_masked_rows"),
        att(4, 4, 1, 32, 33, mask=kv_mask(0.2, bias=3.0), order=True, label="bias_order_mqa"),
        att(33, 2, 1, 64, 65, vt=F16, mask=causal_mask(32), order=True, label="t33_order"),
        att(7, 4, 2, 32, 20, qlay=permuted(1, 0, 2), kvlay=padded((5, 1, 0)), label="strided_qkv"),
        att(3, 8, 8, 128, 7, kt=F16, vt=F16, kvlay=padded((2, 2, 0)), scale=0.05, label="mha_d128_f16view"),
        att(3, 2, 1, 20, 9, kt=F16, vt=F16, Dv=12, label="d20_dv12_f16"),
        # a Q8_0 KV cache (blocks of 32 along the head dim)
        att(7, 4, 2, 64, 33, kt=Q8_0, vt=Q8_0, mask=causal_mask(26), label="causal_q8_0"),
        att(5, 6, 2, 32, 65, kt=Q8_0, vt=F16, Dv=64, order=True, label="gqa3_q8k_f16v"),
        att(33, 2, 1, 64, 65, kt=Q8_0, vt=Q8_0, mask=causal_mask(32), order=True, label="t33_q8_0_lanes"),
        att(3, 8, 8, 128, 7, kt=Q8_0, vt=Q8_0, kvlay=padded((2, 2, 0)), scale=0.05, label="mha_d128_q8_0view"),
    ]

    # ---- silu / swiglu ----------------------------------------------------------------------
    C += [
        Case("silu", (Arg((7, 33), normal(3.0)),)),
        Case("silu", (Arg((1,), F32, fixed([-2.5])),)),
        Case("silu", (Arg((4, 65), normal(30.0)),)),
        Case("silu", (Arg((5, 7), layout=permuted(1, 0)),)),
        Case("silu", (Arg((3, 33), layout=padded((1, 2), step=2)),)),
        Case("swiglu", (Arg((7, 33)), Arg((7, 33)))),
        Case("swiglu", (Arg((2, 3, 65), normal(4.0)), Arg((2, 3, 65)))),
        Case("swiglu", (Arg((9, 5), layout=permuted(1, 0)), Arg((9, 5), layout=padded((1, 1))))),
    ]

    # ---- set_rows (dst is an input here; sentinel tests with external buffers: test_quant) ----
    for dt, (R, D) in {F32: (10, 33), F16: (9, 65), BF16: (7, 7), Q8_0: (8, 64), Q4_0: (8, 96),
                       Q4_1: (5, 32), Q5_0: (6, 64), Q5_1: (5, 96), Q4_K: (4, 256), Q5_K: (5, 256),
                       Q6_K: (4, 512)}.items():
        C.append(Case("set_rows", (Arg((R, D), dt), Arg((3, D)), Arg((3,), I32, fixed([R - 1, 0, 2]))),
                      tol=EXACT))
    C += [
        Case("set_rows", (Arg((6, 2, 32), F16), Arg((2, 64)), Arg((2,), I32, fixed([5, 1]))), tol=EXACT),
        Case("set_rows", (Arg((9,), F16), Arg((3,)), Arg((3,), I32, fixed([8, 0, 4]))), tol=EXACT),
        Case("set_rows", (Arg((6, 2, 32), Q8_0), Arg((1, 2, 32)), Arg((1,), I32, fixed([3]))), tol=EXACT),
        Case("set_rows", (Arg((8, 33), F32), Arg((4, 33), layout=permuted(1, 0)),
                          Arg((4,), I32, fixed([7, 3, 1, 0]))), tol=EXACT),
        Case("set_rows", (Arg((8, 64), Q4_0), Arg((3, 64), layout=padded((1, 0), step=2)),
                          Arg((3,), I32, fixed([2, 4, 6]), layout=padded((2,), step=2))), tol=EXACT),
    ]

    # ---- cpy: every (source, target) pair the op accepts ------------------------------------
    for src in FLOATS:
        for dst in WEIGHT_TYPES:
            C.append(Case("cpy", (Arg((7, _row(dst, 64)), src, normal(2.0)),), {"dtype": dst}, tol=EXACT))
    for src in QUANTS:
        C.append(Case("cpy", (Arg((5, _row(src, 96)), src),), {"dtype": F32}, tol=EXACT))
    C += [
        Case("cpy", (Arg((3, 2, 256), F16, layout=permuted(1, 0, 2)),), {"dtype": Q5_K}, tol=EXACT),
        Case("cpy", (Arg((6, 256), Q6_K, layout=padded((2, 512))),), {"dtype": F32}, tol=EXACT),
    ]
    C += [
        Case("cpy", (Arg((1, 32)),), {"dtype": Q4_1}, tol=EXACT),
        Case("cpy", (Arg((3, 5, 33)),), {"dtype": F16}, tol=EXACT),
        Case("cpy", (Arg((64, 7), layout=permuted(1, 0)),), {"dtype": F16}, tol=EXACT),
        Case("cpy", (Arg((5, 7), F16, layout=permuted(1, 0)),), {"dtype": F16}, tol=EXACT),
        Case("cpy", (Arg((3, 64), layout=permuted(1, 0)),), {"dtype": F32}, tol=EXACT),
        Case("cpy", (Arg((5, 64), F32, layout=permuted(1, 0)),), {"dtype": Q8_0}, tol=EXACT),
        Case("cpy", (Arg((2, 3, 64), F16, layout=permuted(1, 0, 2)),), {"dtype": Q4_0}, tol=EXACT),
        Case("cpy", (Arg((4, 33), BF16, layout=padded((2, 3), step=2)),), {"dtype": F32}, tol=EXACT),
        Case("cpy", (Arg((6, 64), Q4_1, layout=padded((2, 64))),), {"dtype": F32}, tol=EXACT),
        Case("cpy", (Arg((4, 1), F32, normal(1e4)),), {"dtype": F16}, tol=EXACT),
    ]

    # ---- argmax (ties resolve to the first index, as numpy's) ---------------------------------
    C += [
        Case("argmax", (Arg((7, 33)),), tol=EXACT),
        Case("argmax", (Arg((1, 1)),), tol=EXACT),
        Case("argmax", (Arg((65,)),), tol=EXACT),
        Case("argmax", (Arg((9, 65), F32, choice([-1.0, 0.0, 2.0])),), tol=EXACT, label="ties"),
        Case("argmax", (Arg((33, 7), layout=permuted(1, 0)),), tol=EXACT),
        # logits-sized rows: split by columns over threads, then combined (first maximum wins)
        Case("argmax", (Arg((3, 5000), F32, choice([-1.0, 0.0, 2.0])),), tol=EXACT, label="long ties"),
        Case("argmax", (Arg((1, 49152)),), tol=EXACT, label="one long row"),
        Case("argmax", (Arg((17, 4099), layout=padded((1, 5), step=2)),), tol=EXACT, label="long strided"),
        # NaN: numpy's answer is the first NaN (rows of 100 values hold one about every 400th)
        Case("argmax", (Arg((40, 100), F32, choice([0.0, 1.0] * 200 + [float("nan")])),), tol=EXACT, label="nan"),
        Case("argmax", (Arg((4, 4500), F32, choice([0.0, 1.0] * 2000 + [float("nan")])),), tol=EXACT,
             label="long nan"),
        Case("argmax", (Arg((3, 4, 33), normal(1.0, -50.0), layout=padded((1, 1, 4), step=2)),), tol=EXACT),
    ]

    C += _moe_cases()
    C += _recurrent_cases()

    # ---- view ops (no kernel: the output is read through the view's strides) -------------------
    C += [
        Case("reshape", (Arg((3, 7, 11)),), {"shape": (21, 11)}, tol=EXACT),
        Case("reshape", (Arg((33,)),), {"shape": (3, 1, 11)}, tol=EXACT),
        Case("reshape", (Arg((4, 6), F16),), {"shape": (24,)}, tol=EXACT),
        Case("reshape", (Arg((4, 6), BF16),), {"shape": (2, 12)}, tol=EXACT),
        Case("reshape", (Arg((5, 3), I32, ints(-9, 9)),), {"shape": (15,)}, tol=EXACT),
        Case("reshape", (Arg((4, 64), Q8_0),), {"shape": (8, 32)}, tol=EXACT),
        Case("reshape", (Arg((2, 96), Q4_0),), {"shape": (2, 3, 32)}, tol=EXACT),
        Case("reshape", (Arg((3, 64), Q4_1),), {"shape": (6, 32)}, tol=EXACT),
        Case("reshape", (Arg((3, 64), Q5_0),), {"shape": (3, 2, 32)}, tol=EXACT),
        Case("reshape", (Arg((2, 96), Q5_1),), {"shape": (6, 32)}, tol=EXACT),
        Case("reshape", (Arg((2, 512), Q4_K),), {"shape": (4, 256)}, tol=EXACT),
        Case("reshape", (Arg((4, 256), Q5_K),), {"shape": (2, 2, 256)}, tol=EXACT),
        Case("reshape", (Arg((3, 512), Q6_K),), {"shape": (6, 256)}, tol=EXACT),
        Case("view", (Arg((7, 33)),), {"shape": (3, 5), "strides": (66, 2), "offset": 1}, tol=EXACT),
        Case("view", (Arg((7, 33)),), {"shape": (7, 33)}, tol=EXACT),
        Case("view", (Arg((5, 9), F16),), {"shape": (4, 2, 3), "strides": (9, 4, 1), "offset": 2}, tol=EXACT),
        Case("view", (Arg((5, 9), BF16),), {"shape": (9,), "strides": (5,), "offset": 0}, tol=EXACT),
        Case("view", (Arg((8, 6), I32, ints(0, 99)),), {"shape": (3, 2), "strides": (12, 1), "offset": 7},
             tol=EXACT),
        Case("view", (Arg((6, 64), Q4_0),), {"shape": (3, 32), "strides": (128, 1), "offset": 32}, tol=EXACT),
        Case("view", (Arg((4, 96), Q8_0),), {"shape": (2, 64), "strides": (192, 1), "offset": 96}, tol=EXACT),
        Case("view", (Arg((3, 64), Q4_1),), {"shape": (3, 32), "strides": (64, 1), "offset": 0}, tol=EXACT),
        Case("view", (Arg((4, 64), Q5_0),), {"shape": (2, 32), "strides": (128, 1), "offset": 32}, tol=EXACT),
        Case("view", (Arg((3, 96), Q5_1),), {"shape": (3, 64), "strides": (96, 1), "offset": 32}, tol=EXACT),
        Case("view", (Arg((3, 512), Q4_K),), {"shape": (3, 256), "strides": (512, 1), "offset": 256}, tol=EXACT),
        Case("view", (Arg((4, 256), Q5_K),), {"shape": (2, 256), "strides": (512, 1), "offset": 0}, tol=EXACT),
        Case("view", (Arg((2, 768), Q6_K),), {"shape": (2, 2, 256), "strides": (768, 256, 1), "offset": 256},
             tol=EXACT),
        Case("permute", (Arg((2, 3, 5)),), {"axes": (2, 0, 1)}, tol=EXACT),
        Case("permute", (Arg((2, 3, 1, 4)),), {"axes": (3, 1, 0, 2)}, tol=EXACT),
        Case("permute", (Arg((7, 33), F16),), {"axes": (1, 0)}, tol=EXACT),
        Case("permute", (Arg((3, 4, 5), BF16),), {"axes": (0, 2, 1)}, tol=EXACT),
        Case("permute", (Arg((3, 4), I32, ints(-5, 5)),), {"axes": (1, 0)}, tol=EXACT),
    ]
    return C



def _with_nans(p: float = 0.2, infs: bool = True):
    """normal values with NaN (and +-inf) sprinkled in: topk's NaN / inf ordering."""
    import numpy as np

    def gen(rng, shape):
        x = rng.standard_normal(shape).astype(np.float32)
        u = rng.random(shape)
        x[u < p] = np.nan
        if infs:
            x[(u >= p) & (u < p + 0.05)] = np.inf
            x[(u >= p + 0.05) & (u < p + 0.1)] = -np.inf
        return x

    return gen


def _moe_cases() -> list[Case]:
    """sigmoid, softplus, l2_norm, concat, sum, topk, gather, matmul_id."""
    C: list[Case] = []
    # ---- sigmoid / softplus (softplus returns x itself above 20, as torch) -------------------
    edge = [-100.0, -89.0, -20.0, -1e-3, 0.0, 1e-3, 19.9, 20.0, 20.1, 30.0, 89.0, 100.0]
    for op in ("sigmoid", "softplus", "relu", "gelu", "tanh"):
        C += [
            Case(op, (Arg((7, 33), normal(10.0)),)),
            Case(op, (Arg((1,), F32, fixed([-2.5])),)),
            Case(op, (Arg((12,), F32, fixed(edge)),), label="edges"),
            Case(op, (Arg((2, 3, 65), normal(3.0)),)),
            Case(op, (Arg((5, 7), layout=permuted(1, 0)),)),
            Case(op, (Arg((3, 33), normal(8.0), layout=padded((1, 2), step=2)),)),
        ]
    # ---- l2_norm ------------------------------------------------------------------------------
    C += [
        Case("l2_norm", (Arg((1, 1)),), {"eps": 1e-6}),
        Case("l2_norm", (Arg((7, 33)),), {"eps": 1e-6}),
        Case("l2_norm", (Arg((3, 65), normal(10.0, 3.0)),), {"eps": 0.0}),
        Case("l2_norm", (Arg((2, 5, 128)),), {"eps": 1e-6}),
        Case("l2_norm", (Arg((4, 3), F32, fixed([0.0] * 3 + [1e-4] * 3 + [3.0, -4.0, 0.0] + [1e-20] * 3)),),
             {"eps": 1e-6}, label="zero_tiny_rows"),
        Case("l2_norm", (Arg((7, 33), layout=permuted(1, 0)),), {"eps": 1e-6}),
        Case("l2_norm", (Arg((4, 3, 17), layout=padded((1, 2, 4))),), {"eps": 1e-5}),
        Case("l2_norm", (Arg((5, 8), normal(1e-3)),), {"eps": 1e-2}),
    ]
    # ---- concat ---------------------------------------------------------------------------------
    C += [
        Case("concat", (Arg((7, 33)), Arg((7, 5))), {"axis": -1}, tol=EXACT),
        Case("concat", (Arg((3, 33)), Arg((4, 33))), {"axis": 0}, tol=EXACT),
        Case("concat", (Arg((1,)), Arg((7,))), {"axis": 0}, tol=EXACT),
        Case("concat", (Arg((2, 3, 65)), Arg((2, 1, 65))), {"axis": 1}, tol=EXACT),
        Case("concat", (Arg((2, 3, 4, 7)), Arg((2, 3, 1, 7))), {"axis": -2}, tol=EXACT),
        Case("concat", (Arg((2, 1, 4, 7)), Arg((2, 2, 4, 7))), {"axis": 1}, tol=EXACT),
        Case("concat", (Arg((3, 4, 5)), Arg((3, 4, 2))), {"axis": 2}, tol=EXACT),
        Case("concat", (Arg((5, 7), layout=permuted(1, 0)), Arg((5, 3), layout=padded((2, 3), step=2))),
             {"axis": 1}, tol=EXACT),
        Case("concat", (Arg((3, 2, 9), layout=permuted(1, 0, 2)), Arg((3, 1, 9), layout=padded((1, 1, 2)))),
             {"axis": 1}, tol=EXACT),
        Case("concat", (Arg((6, 33), layout=padded((1, 3))), Arg((1, 33), layout=permuted(1, 0))),
             {"axis": 0}, tol=EXACT),
    ]
    # ---- sum (the MoE combine: [T, k, N] summed over k) --------------------------------------------
    C += [
        Case("sum", (Arg((7, 33)),), {"axis": -1}),
        Case("sum", (Arg((7, 33)),), {"axis": 0}),
        Case("sum", (Arg((65,)),), {"axis": 0}),
        Case("sum", (Arg((1, 1)),), {"axis": 1}),
        Case("sum", (Arg((3, 8, 130)),), {"axis": 1}),
        Case("sum", (Arg((2, 3, 5, 7)),), {"axis": 2}),
        Case("sum", (Arg((2, 3, 5, 7)),), {"axis": 0}),
        Case("sum", (Arg((3, 1000), normal(1.0, 2.0)),), {"axis": -1}),
        Case("sum", (Arg((65, 70)),), {"axis": 0}),
        Case("sum", (Arg((33, 7), layout=permuted(1, 0)),), {"axis": -1}),
        Case("sum", (Arg((5, 6, 7), layout=permuted(2, 0, 1)),), {"axis": 1}),
        Case("sum", (Arg((4, 3, 17), layout=padded((1, 2, 4), step=2)),), {"axis": 1}),
        Case("sum", (Arg((4, 3, 17), layout=padded((1, 2, 4))),), {"axis": -1}),
    ]
    # ---- topk (largest first; ties: lower index; NaN below everything) -----------------------------
    C += [
        Case("topk", (Arg((7, 64)),), {"k": 8}, tol=EXACT),
        Case("topk", (Arg((1, 1)),), {"k": 1}, tol=EXACT),
        Case("topk", (Arg((33,)),), {"k": 33}, tol=EXACT),
        Case("topk", (Arg((9, 65)),), {"k": 65}, tol=EXACT),
        Case("topk", (Arg((5, 200)),), {"k": 40}, tol=EXACT),
        Case("topk", (Arg((9, 33), F32, choice([-1.0, 0.0, 2.0])),), {"k": 7}, tol=EXACT, label="ties"),
        Case("topk", (Arg((9, 65), F32, choice([-1.0, 0.0, 2.0])),), {"k": 50}, tol=EXACT, label="ties_k50"),
        Case("topk", (Arg((2, 8), F32, fixed([0.0, -0.0, 1.0, -0.0, 0.0, -1.0, 1.0, 0.0] * 2)),), {"k": 6},
             tol=EXACT, label="signed_zeros"),
        Case("topk", (Arg((9, 33), F32, _with_nans()),), {"k": 9}, tol=EXACT, label="nan_inf"),
        Case("topk", (Arg((4, 65), F32, _with_nans(0.7)),), {"k": 60}, tol=EXACT, label="nan_inf_k60"),
        Case("topk", (Arg((3, 5, 128)),), {"k": 8}, tol=EXACT),
        Case("topk", (Arg((33, 7), layout=permuted(1, 0)),), {"k": 3}, tol=EXACT),
        Case("topk", (Arg((3, 4, 65), layout=padded((1, 1, 4), step=2)),), {"k": 5}, tol=EXACT),
    ]
    # ---- topk_mask (topk's picks as a 0 / -inf mask; the DSA sparse mask, grouped routing) -------
    C += [
        Case("topk_mask", (Arg((7, 64)),), {"k": 8}, tol=EXACT),
        Case("topk_mask", (Arg((1, 1)),), {"k": 1}, tol=EXACT),
        Case("topk_mask", (Arg((9, 65)),), {"k": 65}, tol=EXACT),
        Case("topk_mask", (Arg((3, 1100)),), {"k": 1025}, tol=EXACT, label="past_1024"),
        Case("topk_mask", (Arg((9, 33), F32, choice([-1.0, 0.0, 2.0])),), {"k": 7}, tol=EXACT, label="ties"),
        Case("topk_mask", (Arg((4, 65), F32, _with_nans(0.7)),), {"k": 20}, tol=EXACT, label="nan_inf"),
        Case("topk_mask", (Arg((33, 7), layout=permuted(1, 0)),), {"k": 3}, tol=EXACT),
        Case("topk_mask", (Arg((3, 4, 65), layout=padded((1, 1, 4), step=2)),), {"k": 5}, tol=EXACT),
    ]
    # ---- gather (take_along_axis on the last dim) ------------------------------------------------
    C += [
        Case("gather", (Arg((7, 64)), Arg((7, 8), I32, ints(0, 64))), tol=EXACT),
        Case("gather", (Arg((1, 1)), Arg((1, 1), I32, fixed([0]))), tol=EXACT),
        Case("gather", (Arg((2, 3, 33)), Arg((2, 3, 5), I32, ints(0, 33))), tol=EXACT),
        Case("gather", (Arg((4, 3)), Arg((4, 7), I32, ints(0, 3))), tol=EXACT),  # k > E, repeats
        Case("gather", (Arg((33,)), Arg((65,), I32, ints(0, 33))), tol=EXACT),
        Case("gather", (Arg((9, 7), layout=permuted(1, 0)), Arg((9, 4), I32, ints(0, 7), layout=padded((1, 3), step=2))),
             tol=EXACT),
        Case("gather", (Arg((3, 4, 65), layout=padded((1, 1, 4), step=2)),
                        Arg((3, 4, 2), I32, ints(0, 65), layout=permuted(1, 0, 2))), tol=EXACT),
    ]
    # ---- matmul_id: out[t, j] = x[t] (or x[t, j]) @ w[ids[t, j]].T for every weight dtype ----------
    for wt in WEIGHT_TYPES:
        K = 256 if wt in K_QUANTS else 96 if wt in QUANT else 33
        tol = _mm_tol(wt)
        C += [
            # 2-D x shared by a token's k experts; ids with repeats (also within a row)
            Case("matmul_id", (Arg((7, K)), Arg((5, 33, K), wt, normal(0.5)), Arg((7, 3), I32, ints(0, 5))), tol=tol),
            # 3-D x (one row per (token, slot)), odd sizes
            Case("matmul_id", (Arg((5, 3, K)), Arg((7, 17, K), wt, normal(0.5)), Arg((5, 3), I32, ints(0, 7))), tol=tol),
        ]
    K8, KK = 64, 256
    C += [
        Case("matmul_id", (Arg((1, K8)), Arg((1, 1, K8), Q8_0), Arg((1, 1), I32, fixed([0]))), tol=TOL_QMM),
        Case("matmul_id", (Arg((1, 1, 1)), Arg((1, 1, 1), F32), Arg((1, 1), I32, fixed([0]))), tol=TOL_F32),
        # every row routed to one expert, > one 64-row tile of it
        Case("matmul_id", (Arg((70, K8)), Arg((3, 33, K8), Q4_0), Arg((70, 2), I32, fixed([1] * 140))),
             tol=TOL_QMM, label="all_to_one_q4_0"),
        Case("matmul_id", (Arg((33, 2, KK)), Arg((4, 17, KK), Q4_K), Arg((33, 2), I32, fixed([3] * 66))),
             tol=TOL_QMM, label="all_to_one_q4_k"),
        Case("matmul_id", (Arg((65, 65)), Arg((2, 7, 65), F16), Arg((65, 1), I32, fixed([0] * 65))),
             tol=TOL_F32, label="all_to_one_f16"),
        # many tokens over many experts (several tiles; experts with none, one, many rows)
        Case("matmul_id", (Arg((65, KK)), Arg((9, 20, KK), Q6_K), Arg((65, 4), I32, ints(0, 7))), tol=TOL_QMM),
        Case("matmul_id", (Arg((33, 3, K8)), Arg((9, 33, K8), Q8_0), Arg((33, 3), I32, ints(0, 9))), tol=TOL_QMM),
        # strided x / w / ids
        Case("matmul_id", (Arg((7, K8), layout=padded((2, 32))), Arg((5, 17, K8), Q4_1, layout=padded((2, 3, 0))),
                           Arg((7, 2), I32, ints(0, 5), layout=padded((1, 3), step=2))), tol=TOL_QMM),
        Case("matmul_id", (Arg((5, 3, KK), layout=permuted(1, 0, 2)), Arg((4, 9, KK), Q5_K), Arg((5, 3), I32, ints(0, 4))),
             tol=TOL_QMM),
        Case("matmul_id", (Arg((5, 2, 37), layout=padded((1, 1, 3), start=(0, 0, 1))),
                           Arg((3, 9, 37), BF16, layout=padded((1, 1, 1), start=(0, 1, 1))),
                           Arg((5, 2), I32, ints(0, 3), layout=permuted(1, 0))), tol=TOL_F32),
    ]
    return C


def _recurrent_cases() -> list[Case]:
    """ssm_conv and gated_delta_net (the output; states and snapshot planes: test_recurrent.py).
    seqs rows are (t0, n, slot, src_plane)."""
    import numpy as np

    from .harness import uniform

    def unit_rows(rng, shape):  # q, k arrive L2-normalised over the key dim
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    def seqs(rows):
        return Arg((len(rows), 4), I32, fixed(np.array(rows, np.int32)))

    def gdn(T, Hk, Hv, S, P, n_slot, rows, kda=False, qlay=CONTIG, vlay=CONTIG, **params):
        return (Arg((T, Hk, S), unit_rows, layout=qlay), Arg((T, Hk, S), unit_rows),
                Arg((T, Hv, S), F32, normal(), layout=vlay),
                Arg((T, Hv, S) if kda else (T, Hv), F32, uniform(-1.0, -0.01)),
                Arg((T, Hv), F32, uniform(0.05, 0.95)), Arg((P, n_slot, Hv, S * S), F32, normal(0.3)), seqs(rows))

    tol = Tol(1e-9, 1e-4)  # a recurrence over up to 65 f32 tokens vs float64
    return [
        Case("ssm_conv", (Arg((7, 33), layout=padded((2, 5))), Arg((33, 4)), Arg((3, 2, 3, 33)),
                          seqs([[0, 2, 1, 0], [2, 5, 0, 2]])), label="two_segments"),
        # taps read through a permuted view; tokens 0 and 2 in no segment (-> 0); an empty segment
        Case("ssm_conv", (Arg((9, 70)), Arg((70, 4), layout=permuted(1, 0)), Arg((4, 3, 3, 70)),
                          seqs([[1, 1, 2, 3], [3, 6, 0, 0], [2, 0, 1, 1]])), label="gaps_strided_w"),
        Case("ssm_conv", (Arg((65, 1)), Arg((1, 2)), Arg((2, 1, 1, 1)), seqs([[0, 65, 0, 1]])), label="c1_k2"),
        Case("gated_delta_net", gdn(7, 2, 4, 16, 2, 3, [[0, 3, 2, 1], [3, 4, 0, 0]]), {"broadcast": 1},
             tol=tol, label="gda_serial_interleaved"),
        Case("gated_delta_net", gdn(33, 1, 2, 32, 3, 2, [[0, 20, 1, 2], [20, 13, 0, 0]], kda=True,
                                    qlay=permuted(1, 0, 2), vlay=padded((1, 1, 0))), {"chunk_min": 8},
             tol=tol, label="kda_chunked_strided"),
        Case("gated_delta_net", gdn(65, 1, 2, 20, 2, 1, [[0, 65, 0, 1]]), {"chunk_min": 1, "scale": 0.3},
             tol=tol, label="gda_chunked_s20"),
    ]


CASES: list[Case] = _cases()
