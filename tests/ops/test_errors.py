"""Graph building validates: a bad shape or dtype raises ValueError("[op] ...") naming the op, at
record time, before anything runs."""
from __future__ import annotations

import numpy as np
import pytest

from .harness import BF16, F16, F32, I32, K_QUANTS, Q4_0, Q8_0, N

DT = N.DType


def _x(g, name, dt, shape):
    return g.input(name, dt, list(shape))


def _att(g, q=(2, 1, 8), k=(5, 1, 8), v=(5, 1, 8), m=(2, 5), o=None, qt=F32, kt=F32, vt=F32, mt=F32, ot=I32):
    order = _x(g, "o", ot, o) if o is not None else None
    return g.attention(_x(g, "q", qt, q), _x(g, "k", kt, k), _x(g, "v", vt, v), _x(g, "m", mt, m), order)


def _sr(g, d=(8, 4), s=(2, 4), i=(2,), dt=F32, st=F32, it=I32):
    return g.set_rows(_x(g, "d", dt, d), _x(g, "s", st, s), _x(g, "i", it, i))


# (op, builder(g) that must raise). Each builder declares its own leaves.

_COMM: list = []


def _comm():
    """A one-rank communicator for the allreduce cases (kept for the whole session)."""
    if not _COMM:
        _COMM.append(N.Communicator.local())
    return _COMM[0]

BAD = {
    "get_rows": [
        ("table 1-D", lambda g: g.get_rows(_x(g, "t", F32, [8]), _x(g, "i", I32, [2]))),
        ("table i32", lambda g: g.get_rows(_x(g, "t", I32, [8, 4]), _x(g, "i", I32, [2]))),
        ("ids f32", lambda g: g.get_rows(_x(g, "t", F32, [8, 4]), _x(g, "i", F32, [2]))),
        ("ids 2-D", lambda g: g.get_rows(_x(g, "t", F32, [8, 4]), _x(g, "i", I32, [2, 1]))),
        ("table inner strided", lambda g: g.get_rows(g.permute(_x(g, "t", F32, [4, 8]), [1, 0]), _x(g, "i", I32, [2]))),
    ],
    "matmul": [
        ("x f16", lambda g: g.matmul(_x(g, "x", F16, [2, 32]), _x(g, "w", F32, [3, 32]))),
        ("w 3-D", lambda g: g.matmul(_x(g, "x", F32, [2, 32]), _x(g, "w", F32, [1, 3, 32]))),
        ("w i32", lambda g: g.matmul(_x(g, "x", F32, [2, 32]), _x(g, "w", I32, [3, 32]))),
        ("K differs", lambda g: g.matmul(_x(g, "x", F32, [2, 33]), _x(g, "w", F32, [3, 32]))),
        ("K differs q8_0", lambda g: g.matmul(_x(g, "x", F32, [2, 32]), _x(g, "w", Q8_0, [3, 64]))),
        ("x inner strided", lambda g: g.matmul(g.permute(_x(g, "x", F32, [32, 2]), [1, 0]), _x(g, "w", F32, [3, 32]))),
        ("w inner strided", lambda g: g.matmul(_x(g, "x", F32, [2, 3]), g.permute(_x(g, "w", F32, [3, 5]), [1, 0]))),
    ],
    "add": [
        ("not broadcastable", lambda g: g.add(_x(g, "a", F32, [4, 5]), _x(g, "b", F32, [4]))),
        ("b has more dims", lambda g: g.add(_x(g, "a", F32, [5]), _x(g, "b", F32, [2, 5]))),
        ("b f16", lambda g: g.add(_x(g, "a", F32, [4, 5]), _x(g, "b", F16, [5]))),
        ("a i32", lambda g: g.add(_x(g, "a", I32, [4, 5]), _x(g, "b", F32, [5]))),
    ],
    "mul": [
        ("not broadcastable", lambda g: g.mul(_x(g, "a", F32, [4, 5]), _x(g, "b", F32, [3, 5]))),
        ("b i32", lambda g: g.mul(_x(g, "a", F32, [4, 5]), _x(g, "b", I32, [1]))),
    ],
    "scale": [("a f16", lambda g: g.scale(_x(g, "a", F16, [4]), 2.0))],
    "allreduce": [("a f16", lambda g: g.allreduce(_x(g, "a", F16, [4]), _comm().id)),
                  ("unknown communicator", lambda g: g.allreduce(_x(g, "a", F32, [4]), 1 << 30))],
    "rms_norm": [
        ("a bf16", lambda g: g.rms_norm(_x(g, "a", BF16, [4, 8]), 1e-5)),
        ("negative eps", lambda g: g.rms_norm(_x(g, "a", F32, [4, 8]), -1e-5)),
        ("nan eps", lambda g: g.rms_norm(_x(g, "a", F32, [4, 8]), float("nan"))),
    ],
    "rope": [
        ("x 2-D", lambda g: g.rope(_x(g, "x", F32, [3, 8]), _x(g, "p", I32, [3]), 8)),
        ("pos f32", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", F32, [3]), 8)),
        ("pos length", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [4]), 8)),
        ("n_dims odd", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 7)),
        ("n_dims > head_dim", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 10)),
        ("n_dims 0", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 0)),
        ("mode 1", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 8, mode=1)),
        ("freq_base 0", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 8, freq_base=0.0)),
        ("freq_scale < 0", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 8, freq_scale=-1.0)),
        ("freq_factors length", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 8,
                                                 freq_factors=_x(g, "f", F32, [8]))),
        ("freq_factors f16", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 8,
                                              freq_factors=_x(g, "f", F16, [4]))),
        ("ext_factor nan", lambda g: g.rope(_x(g, "x", F32, [3, 2, 8]), _x(g, "p", I32, [3]), 8,
                                            ext_factor=float("nan"))),
        # the kernel keeps cos/sin for n_dims/2 <= 512 on the stack
        ("n_dims > 1024", lambda g: g.rope(_x(g, "x", F32, [2, 1, 1056]), _x(g, "p", I32, [2]), 1056)),
    ],
    "softmax": [
        ("a i32", lambda g: g.softmax(_x(g, "a", I32, [4, 8]))),
        ("mask f16", lambda g: g.softmax(_x(g, "a", F32, [4, 8]), _x(g, "m", F16, [4, 8]))),
        ("mask not broadcastable", lambda g: g.softmax(_x(g, "a", F32, [4, 8]), _x(g, "m", F32, [4, 7]))),
    ],
    "attention": [
        ("q 2-D", lambda g: _att(g, q=(2, 8))),
        ("k q4_0", lambda g: _att(g, q=(2, 1, 32), k=(5, 1, 32), v=(5, 1, 32), kt=Q4_0)),
        ("v bf16", lambda g: _att(g, vt=BF16)),
        ("q f16", lambda g: _att(g, qt=F16)),
        ("head dim differs", lambda g: _att(g, k=(5, 1, 4))),
        ("v n_kv differs", lambda g: _att(g, v=(6, 1, 8))),
        ("heads not a multiple", lambda g: _att(g, q=(2, 3, 8), k=(5, 2, 8), v=(5, 2, 8))),
        ("mask shape", lambda g: _att(g, m=(2, 4))),
        ("mask f16", lambda g: _att(g, mt=F16)),
        ("order f32", lambda g: _att(g, o=(5,), ot=F32)),
        ("order length", lambda g: _att(g, o=(4,))),
        ("mask inner strided", lambda g: g.attention(_x(g, "q", F32, [2, 1, 8]), _x(g, "k", F32, [5, 1, 8]),
                                                     _x(g, "v", F32, [5, 1, 8]),
                                                     g.permute(_x(g, "m", F32, [5, 2]), [1, 0]))),
        ("q inner strided", lambda g: g.attention(g.permute(_x(g, "q", F32, [8, 1, 2]), [2, 1, 0]),
                                                  _x(g, "k", F32, [5, 1, 8]), _x(g, "v", F32, [5, 1, 8]),
                                                  _x(g, "m", F32, [2, 5]))),
    ],
    "silu": [("a i32", lambda g: g.silu(_x(g, "a", I32, [4])))],
    "swiglu": [
        ("shapes differ", lambda g: g.swiglu(_x(g, "a", F32, [4, 8]), _x(g, "b", F32, [8]))),
        ("up f16", lambda g: g.swiglu(_x(g, "a", F32, [4, 8]), _x(g, "b", F16, [4, 8]))),
    ],
    "set_rows": [
        ("src f16", lambda g: _sr(g, st=F16)),
        ("idx f32", lambda g: _sr(g, it=F32)),
        ("idx 2-D", lambda g: _sr(g, i=(2, 1))),
        ("src rows != idx", lambda g: _sr(g, s=(3, 4))),
        ("row sizes differ", lambda g: _sr(g, s=(2, 5))),
        ("dst i32", lambda g: _sr(g, dt=I32)),
        ("dst rows strided", lambda g: g.set_rows(g.permute(_x(g, "d", F32, [4, 8]), [1, 0]), _x(g, "s", F32, [2, 4]),
                                                  _x(g, "i", I32, [2]))),
    ],
    "cpy": [
        ("to i32", lambda g: g.cpy(_x(g, "a", F32, [4, 32]), I32)),
        ("to q8_0, inner 33", lambda g: g.cpy(_x(g, "a", F32, [4, 33]), Q8_0)),
        ("from i32", lambda g: g.cpy(_x(g, "a", I32, [4, 32]), F32)),
        ("q4_0 to f16", lambda g: g.cpy(_x(g, "a", Q4_0, [4, 32]), F16)),
    ],
    "argmax": [("a f16", lambda g: g.argmax(_x(g, "a", F16, [4, 8])))],
    "reshape": [
        ("not contiguous", lambda g: g.reshape(g.permute(_x(g, "a", F32, [4, 8]), [1, 0]), [32])),
        ("count differs", lambda g: g.reshape(_x(g, "a", F32, [4, 8]), [33])),
        ("dim 0", lambda g: g.reshape(_x(g, "a", F32, [4, 8]), [0, 32])),
        ("5 dims", lambda g: g.reshape(_x(g, "a", F32, [4, 8]), [1, 1, 1, 4, 8])),
        ("q8_0 inner 16", lambda g: g.reshape(_x(g, "a", Q8_0, [2, 32]), [4, 16])),
    ],
    "view": [
        ("exceeds source", lambda g: g.view(_x(g, "a", F32, [4, 8]), [4, 8], None, 4)),
        ("strides exceed", lambda g: g.view(_x(g, "a", F32, [4, 8]), [4, 8], [64, 4], 0)),
        ("negative stride", lambda g: g.view(_x(g, "a", F32, [4, 8]), [2, 2], [-16, 4], 64)),
        ("negative offset", lambda g: g.view(_x(g, "a", F32, [4, 8]), [2], None, -4)),
        ("stride count", lambda g: g.view(_x(g, "a", F32, [4, 8]), [2, 2], [4], 0)),
    ],
    "permute": [
        ("axes count", lambda g: g.permute(_x(g, "a", F32, [4, 8]), [0])),
        ("not a permutation", lambda g: g.permute(_x(g, "a", F32, [4, 8, 2]), [0, 0, 1])),
        ("axis out of range", lambda g: g.permute(_x(g, "a", F32, [4, 8]), [0, 2])),
        ("quantized", lambda g: g.permute(_x(g, "a", Q8_0, [4, 32]), [1, 0])),
    ],
    "input": [
        ("duplicate name", lambda g: (_x(g, "a", F32, [4]), _x(g, "a", F32, [4]))),
        ("unsupported dtype", lambda g: _x(g, "a", DT.Q2_K, [256])),
        ("dim 0", lambda g: _x(g, "a", F32, [0, 4])),
        ("q8_0 inner 48", lambda g: _x(g, "a", Q8_0, [2, 48])),
    ],
    "external": [
        ("buffer too small", lambda g: g.external("w", F32, [4, 8], np.zeros(31, np.float32))),
        ("offset past end", lambda g: g.external("w", F32, [4], np.zeros(4, np.float32), offset=4)),
        ("strides too large", lambda g: g.external("w", F32, [4, 8], np.zeros(32, np.float32), strides=[64, 4])),
    ],
    "output": [
        ("duplicate name", lambda g: (g.output(_x(g, "a", F32, [4]), "o"), g.output(_x(g, "b", F32, [4]), "o"))),
    ],
}


def _run_ids(build, ids, **inputs):
    """Build an op whose ids are an input and run it with these ids on 3 and 1 threads: each run
    must raise ValueError naming the op (never crash or read out of bounds); the first is re-raised.
    inputs: name -> array for the other inputs."""

    def fn(g):
        ids_arr = np.asarray(ids, np.int32)
        errs = []
        for nt in (3, 1):
            gg = g if nt == 3 else N.Graph()  # a graph compiles into one plan
            gg.output(build(gg, gg.input("ids", I32, list(ids_arr.shape))), "out")
            p = N.Plan(gg, N.ThreadPool(nt))
            p.set_input("ids", ids_arr)
            for name, arr in inputs.items():
                p.set_input(name, arr)
            try:
                p.run()
            except ValueError as e:
                errs.append(e)
        assert len(errs) == 2 and str(errs[0]) == str(errs[1]), errs
        raise errs[0]
    return fn


BAD.update({
    "sigmoid": [("a f16", lambda g: g.sigmoid(_x(g, "a", F16, [4, 8])))],
    "softplus": [("a i32", lambda g: g.softplus(_x(g, "a", I32, [4, 8])))],
    "relu": [("a f16", lambda g: g.relu(_x(g, "a", F16, [4, 8])))],
    "gelu": [("a f16", lambda g: g.gelu(_x(g, "a", F16, [4, 8])))],
    "tanh": [("a bf16", lambda g: g.tanh(_x(g, "a", BF16, [4, 8])))],
    "l2_norm": [
        ("a bf16", lambda g: g.l2_norm(_x(g, "a", BF16, [4, 8]), 1e-6)),
        ("negative eps", lambda g: g.l2_norm(_x(g, "a", F32, [4, 8]), -1e-6)),
        ("nan eps", lambda g: g.l2_norm(_x(g, "a", F32, [4, 8]), float("nan"))),
    ],
    "concat": [
        ("rank differs", lambda g: g.concat(_x(g, "a", F32, [4, 8]), _x(g, "b", F32, [8]), 0)),
        ("dims differ off axis", lambda g: g.concat(_x(g, "a", F32, [4, 8]), _x(g, "b", F32, [3, 7]), 0)),
        ("axis out of range", lambda g: g.concat(_x(g, "a", F32, [4, 8]), _x(g, "b", F32, [4, 8]), 2)),
        ("axis < -ndim", lambda g: g.concat(_x(g, "a", F32, [4, 8]), _x(g, "b", F32, [4, 8]), -3)),
        ("b f16", lambda g: g.concat(_x(g, "a", F32, [4, 8]), _x(g, "b", F16, [4, 8]), 0)),
    ],
    "sum": [
        ("a i32", lambda g: g.sum(_x(g, "a", I32, [4, 8]), 0)),
        ("axis out of range", lambda g: g.sum(_x(g, "a", F32, [4, 8]), 2)),
        ("axis < -ndim", lambda g: g.sum(_x(g, "a", F32, [4, 8]), -3)),
    ],
    "topk": [
        ("a f16", lambda g: g.topk(_x(g, "a", F16, [4, 8]), 2)),
        ("k 0", lambda g: g.topk(_x(g, "a", F32, [4, 8]), 0)),
        ("k > n", lambda g: g.topk(_x(g, "a", F32, [4, 8]), 9)),
    ],
    "topk_mask": [
        ("a f16", lambda g: g.topk_mask(_x(g, "a", F16, [4, 8]), 2)),
        ("k 0", lambda g: g.topk_mask(_x(g, "a", F32, [4, 8]), 0)),
        ("k > n", lambda g: g.topk_mask(_x(g, "a", F32, [4, 8]), 9)),
    ],
    "gather": [
        ("ids f32", lambda g: g.gather(_x(g, "a", F32, [4, 8]), _x(g, "i", F32, [4, 2]))),
        ("a f16", lambda g: g.gather(_x(g, "a", F16, [4, 8]), _x(g, "i", I32, [4, 2]))),
        ("rank differs", lambda g: g.gather(_x(g, "a", F32, [4, 8]), _x(g, "i", I32, [2]))),
        ("leading dims differ", lambda g: g.gather(_x(g, "a", F32, [4, 8]), _x(g, "i", I32, [3, 2]))),
        ("run: id = E", _run_ids(lambda g, i: g.gather(_x(g, "a", F32, [4, 8]), i), [[0, 1]] * 3 + [[7, 8]],
                                 a=np.ones((4, 8), np.float32))),
        ("run: id < 0", _run_ids(lambda g, i: g.gather(_x(g, "a", F32, [4, 8]), i), [[0, -1]] + [[0, 1]] * 3,
                                 a=np.ones((4, 8), np.float32))),
    ],
    "matmul_id": [
        ("x f16", lambda g: g.matmul_id(_x(g, "x", F16, [2, 32]), _x(g, "w", F32, [4, 3, 32]), _x(g, "i", I32, [2, 2]))),
        ("w 2-D", lambda g: g.matmul_id(_x(g, "x", F32, [2, 32]), _x(g, "w", F32, [3, 32]), _x(g, "i", I32, [2, 2]))),
        ("w i32", lambda g: g.matmul_id(_x(g, "x", F32, [2, 32]), _x(g, "w", I32, [4, 3, 32]), _x(g, "i", I32, [2, 2]))),
        ("ids f32", lambda g: g.matmul_id(_x(g, "x", F32, [2, 32]), _x(g, "w", F32, [4, 3, 32]), _x(g, "i", F32, [2, 2]))),
        ("ids 1-D", lambda g: g.matmul_id(_x(g, "x", F32, [2, 32]), _x(g, "w", F32, [4, 3, 32]), _x(g, "i", I32, [2]))),
        ("K differs", lambda g: g.matmul_id(_x(g, "x", F32, [2, 33]), _x(g, "w", F32, [4, 3, 32]), _x(g, "i", I32, [2, 2]))),
        ("K differs q8_0", lambda g: g.matmul_id(_x(g, "x", F32, [2, 32]), _x(g, "w", Q8_0, [4, 3, 64]),
                                                 _x(g, "i", I32, [2, 2]))),
        ("T differs", lambda g: g.matmul_id(_x(g, "x", F32, [3, 32]), _x(g, "w", F32, [4, 3, 32]), _x(g, "i", I32, [2, 2]))),
        ("x 3-D k differs", lambda g: g.matmul_id(_x(g, "x", F32, [2, 3, 32]), _x(g, "w", F32, [4, 3, 32]),
                                                  _x(g, "i", I32, [2, 2]))),
        ("x inner strided", lambda g: g.matmul_id(g.permute(_x(g, "x", F32, [32, 2]), [1, 0]), _x(g, "w", F32, [4, 3, 32]),
                                                  _x(g, "i", I32, [2, 2]))),
        ("w inner strided", lambda g: g.matmul_id(_x(g, "x", F32, [2, 4]), g.permute(_x(g, "w", F32, [4, 4, 3]), [0, 2, 1]),
                                                  _x(g, "i", I32, [2, 2]))),
        ("run: id = E", _run_ids(lambda g, i: g.matmul_id(_x(g, "x", F32, [3, 32]), _x(g, "w", Q8_0, [4, 5, 32]), i),
                                 [[0, 1], [2, 4], [3, 3]], x=np.ones((3, 32), np.float32),
                                 w=np.zeros((4, 5, 34), np.uint8))),
        ("run: id < 0 f16", _run_ids(lambda g, i: g.matmul_id(_x(g, "x", F32, [3, 2, 8]), _x(g, "w", F16, [4, 5, 8]), i),
                                     [[0, 1], [2, 3], [-7, 3]], x=np.ones((3, 2, 8), np.float32),
                                     w=np.ones((4, 5, 8), np.float16))),
    ],
})



def _conv(g, x=(5, 8), w=(8, 4), s=(2, 3, 3, 8), q=(2, 4), xt=F32, wt=F32, st=F32, qt=I32):
    return g.ssm_conv(_x(g, "x", xt, x), _x(g, "w", wt, w), _x(g, "s", st, s), _x(g, "q", qt, q))


def _gdn(g, q=(5, 2, 8), k=None, v=(5, 4, 8), gate=(5, 4), b=(5, 4), s=(2, 3, 4, 64), sq=(2, 4), qt=F32, gt=F32,
         st=F32, sqt=I32, **kw):
    return g.gated_delta_net(_x(g, "q", qt, q), _x(g, "k", F32, k or q), _x(g, "v", F32, v), _x(g, "g", gt, gate),
                             _x(g, "b", F32, b), _x(g, "s", st, s), _x(g, "sq", sqt, sq), **kw)


# Bad seqs *values* are found when the op runs: test_recurrent.py checks those.
BAD.update({
    "ssm_conv": [
        ("x f16", lambda g: _conv(g, xt=F16)),
        ("x 1-D", lambda g: _conv(g, x=(8,))),
        ("w channels differ", lambda g: _conv(g, w=(7, 4))),
        ("w 3-D", lambda g: _conv(g, w=(1, 8, 4))),
        ("w bf16", lambda g: _conv(g, wt=BF16)),
        ("state window != kernel - 1", lambda g: _conv(g, s=(2, 3, 4, 8))),
        ("state channels differ", lambda g: _conv(g, s=(2, 3, 3, 9))),
        ("state 3-D", lambda g: _conv(g, s=(2, 3, 24))),
        ("state f16", lambda g: _conv(g, st=F16)),
        ("state not contiguous", lambda g: g.ssm_conv(_x(g, "x", F32, [5, 8]), _x(g, "w", F32, [8, 4]),
                                                      g.permute(_x(g, "s", F32, [3, 2, 3, 8]), [1, 0, 2, 3]),
                                                      _x(g, "q", I32, [2, 4]))),
        ("seqs f32", lambda g: _conv(g, qt=F32)),
        ("seqs 3 columns", lambda g: _conv(g, q=(2, 3))),
        ("seqs 1-D", lambda g: _conv(g, q=(4,))),
        ("x inner strided", lambda g: g.ssm_conv(g.permute(_x(g, "x", F32, [8, 5]), [1, 0]), _x(g, "w", F32, [8, 4]),
                                                 _x(g, "s", F32, [2, 3, 3, 8]), _x(g, "q", I32, [2, 4]))),
    ],
    "gated_delta_net": [
        ("q f16", lambda g: _gdn(g, qt=F16)),
        ("v 2-D", lambda g: _gdn(g, v=(5, 32))),
        ("q key dim differs", lambda g: _gdn(g, q=(5, 2, 4))),
        ("q tokens differ", lambda g: _gdn(g, q=(6, 2, 8))),
        ("k differs from q", lambda g: _gdn(g, k=(5, 1, 8))),
        ("heads not a multiple", lambda g: _gdn(g, q=(5, 3, 8))),
        ("g shape", lambda g: _gdn(g, gate=(5, 2))),
        ("g per-key dim differs", lambda g: _gdn(g, gate=(5, 4, 7))),
        ("g i32", lambda g: _gdn(g, gt=I32)),
        ("beta shape", lambda g: _gdn(g, b=(5, 4, 1))),
        ("state S x S not flattened", lambda g: _gdn(g, s=(2, 3, 4, 8))),
        ("state heads differ", lambda g: _gdn(g, s=(2, 3, 2, 64))),
        ("state 3-D", lambda g: _gdn(g, s=(2, 12, 64))),
        ("state f16", lambda g: _gdn(g, st=F16)),
        ("state not contiguous", lambda g: g.gated_delta_net(
            _x(g, "q", F32, [5, 2, 8]), _x(g, "k", F32, [5, 2, 8]), _x(g, "v", F32, [5, 4, 8]), _x(g, "g", F32, [5, 4]),
            _x(g, "b", F32, [5, 4]), g.permute(_x(g, "s", F32, [3, 2, 4, 64]), [1, 0, 2, 3]), _x(g, "sq", I32, [2, 4]))),
        ("seqs f32", lambda g: _gdn(g, sqt=F32)),
        ("seqs 5 columns", lambda g: _gdn(g, sq=(2, 5))),
        ("broadcast 2", lambda g: _gdn(g, broadcast=2)),
        ("chunk_min < 0", lambda g: _gdn(g, chunk_min=-1)),
        ("q inner strided", lambda g: g.gated_delta_net(
            g.permute(_x(g, "q", F32, [5, 8, 2]), [0, 2, 1]), _x(g, "k", F32, [5, 2, 8]), _x(g, "v", F32, [5, 4, 8]),
            _x(g, "g", F32, [5, 4]), _x(g, "b", F32, [5, 4]), _x(g, "s", F32, [2, 3, 4, 64]), _x(g, "sq", I32, [2, 4]))),
    ],
})

def _bad_params():
    for op, items in BAD.items():
        for what, fn in items:
            yield pytest.param(op, fn, id=f"{op}-{what.replace(' ', '_')}")


@pytest.mark.parametrize("op,build", list(_bad_params()))
def test_bad_arguments_raise_valueerror_naming_the_op(op, build):
    g = N.Graph()
    with pytest.raises(ValueError) as ei:
        build(g)
    assert str(ei.value).startswith(f"[{op}]"), f"message does not start with [{op}]: {ei.value}"


def test_every_op_has_error_cases():
    from .harness import op_names

    missing = [op for op in op_names() if op not in BAD]
    assert not missing, f"no error cases for {missing}"


def test_plan_input_errors():
    g = N.Graph()
    g.output(g.scale(g.input("x", F32, [4, 8]), 2.0), "y")
    p = N.Plan(g, N.ThreadPool(1))
    with pytest.raises(ValueError, match=r"^\[plan\]"):
        p.set_input("nope", np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match=r"^\[plan\]"):
        p.set_input("x", np.zeros((4, 7), np.float32))
    with pytest.raises(ValueError, match=r"^\[plan\]"):
        p.set_input("x", np.zeros((4, 8), np.float64))
    with pytest.raises(ValueError, match=r"^\[plan\]"):
        p.output("nope")


def test_plan_without_outputs_and_reuse_of_compiled_graph():
    g = N.Graph()
    g.scale(g.input("x", F32, [4]), 2.0)
    with pytest.raises(ValueError, match=r"^\[plan\]"):
        N.Plan(g, N.ThreadPool(1))
    g2 = N.Graph()
    g2.output(g2.input("x", F32, [4]), "x")
    N.Plan(g2, N.ThreadPool(1))
    with pytest.raises(ValueError):
        g2.scale(g2.input("y", F32, [4]), 2.0)
    with pytest.raises(ValueError):
        N.Plan(g2, N.ThreadPool(1))


def test_tensor_from_another_graph_is_rejected():
    g1, g2 = N.Graph(), N.Graph()
    a = g1.input("a", F32, [4])
    with pytest.raises(ValueError):
        g2.scale(a, 2.0)


# One builder per (op, argument): the argument gets the probed dtype, the others valid ones.
# Shapes keep every innermost dim a multiple of 256 so quantized dtypes are representable.
def _probe_builders():
    T, K = 32, 256

    P = {}
    P["get_rows"] = lambda g, r, dt: g.get_rows(_x(g, "t", dt if r == 0 else F32, [4, K]),
                                                _x(g, "i", dt if r == 1 else I32, [T]))
    P["matmul"] = lambda g, r, dt: g.matmul(_x(g, "x", dt if r == 0 else F32, [2, K]),
                                            _x(g, "w", dt if r == 1 else F32, [3, K]))
    for op in ("add", "mul", "swiglu"):
        P[op] = (lambda op: lambda g, r, dt: getattr(g, op)(_x(g, "a", dt if r == 0 else F32, [2, K]),
                                                           _x(g, "b", dt if r == 1 else F32, [2, K])))(op)
    P["scale"] = lambda g, r, dt: g.scale(_x(g, "a", dt, [2, K]), 2.0)
    P["allreduce"] = lambda g, r, dt: g.allreduce(_x(g, "a", dt, [2, K]), _comm().id)
    P["rms_norm"] = lambda g, r, dt: g.rms_norm(_x(g, "a", dt, [2, K]), 1e-5)
    P["silu"] = lambda g, r, dt: g.silu(_x(g, "a", dt, [2, K]))
    P["argmax"] = lambda g, r, dt: g.argmax(_x(g, "a", dt, [2, K]))
    P["rope"] = lambda g, r, dt: g.rope(_x(g, "x", dt if r == 0 else F32, [T, 1, K]),
                                        _x(g, "p", dt if r == 1 else I32, [T]), K,
                                        freq_factors=_x(g, "f", dt, [K // 2]) if r == 2 else None)
    P["softmax"] = lambda g, r, dt: g.softmax(_x(g, "a", dt if r == 0 else F32, [2, K]),
                                              _x(g, "m", dt if r == 1 else F32, [2, K]))

    def att(g, r, dt):
        d = [dt if r == i else F32 for i in range(4)] + [dt if r == 4 else I32]
        return g.attention(_x(g, "q", d[0], [2, 1, K]), _x(g, "k", d[1], [T, 1, K]), _x(g, "v", d[2], [T, 1, K]),
                           _x(g, "m", d[3], [2, T]), _x(g, "o", d[4], [T]))
    P["attention"] = att
    P["set_rows"] = lambda g, r, dt: g.set_rows(_x(g, "d", dt if r == 0 else F32, [4, K]),
                                                _x(g, "s", dt if r == 1 else F32, [T, K]),
                                                _x(g, "i", dt if r == 2 else I32, [T]))
    P["cpy"] = lambda g, r, dt: (g.cpy(_x(g, "a", dt, [2, K]), F32) if r == 0
                                 else g.cpy(_x(g, "a", F32, [2, K]), dt))
    P["reshape"] = lambda g, r, dt: g.reshape(_x(g, "a", dt, [2, K]), [1, 2, K] if dt in K_QUANTS else [4, K // 2])
    P["view"] = lambda g, r, dt: g.view(_x(g, "a", dt, [2, K]), [1, K], None, 0)
    P["permute"] = lambda g, r, dt: g.permute(_x(g, "a", dt, [2, K]), [1, 0])
    P["sigmoid"] = lambda g, r, dt: g.sigmoid(_x(g, "a", dt, [2, K]))
    P["softplus"] = lambda g, r, dt: g.softplus(_x(g, "a", dt, [2, K]))
    P["relu"] = lambda g, r, dt: g.relu(_x(g, "a", dt, [2, K]))
    P["gelu"] = lambda g, r, dt: g.gelu(_x(g, "a", dt, [2, K]))
    P["tanh"] = lambda g, r, dt: g.tanh(_x(g, "a", dt, [2, K]))
    P["l2_norm"] = lambda g, r, dt: g.l2_norm(_x(g, "a", dt, [2, K]), 1e-6)
    P["concat"] = lambda g, r, dt: g.concat(_x(g, "a", dt if r == 0 else F32, [2, K]),
                                            _x(g, "b", dt if r == 1 else F32, [2, K]), 0)
    P["sum"] = lambda g, r, dt: g.sum(_x(g, "a", dt, [2, K]), 0)
    P["topk"] = lambda g, r, dt: g.topk(_x(g, "a", dt, [2, K]), 4)
    P["topk_mask"] = lambda g, r, dt: g.topk_mask(_x(g, "a", dt, [2, K]), 4)
    P["gather"] = lambda g, r, dt: g.gather(_x(g, "a", dt if r == 0 else F32, [2, K]),
                                            _x(g, "i", dt if r == 1 else I32, [2, K]))
    P["matmul_id"] = lambda g, r, dt: g.matmul_id(_x(g, "x", dt if r == 0 else F32, [2, K]),
                                                  _x(g, "w", dt if r == 1 else F32, [4, 3, K]),
                                                  _x(g, "i", dt if r == 2 else I32, [2, 2]))
    P["ssm_conv"] = lambda g, r, dt: g.ssm_conv(_x(g, "x", dt if r == 0 else F32, [2, K]),
                                                _x(g, "w", dt if r == 1 else F32, [K, 4]),
                                                _x(g, "s", dt if r == 2 else F32, [2, 1, 3, K]),
                                                _x(g, "q", dt if r == 3 else I32, [1, 4]))

    def gdn(g, r, dt):
        d = [dt if r == i else F32 for i in range(6)] + [dt if r == 6 else I32]
        return g.gated_delta_net(_x(g, "q", d[0], [2, 1, K]), _x(g, "k", d[1], [2, 1, K]), _x(g, "v", d[2], [2, 1, K]),
                                 _x(g, "g", d[3], [2, 1, K]), _x(g, "b", d[4], [2, 1]), _x(g, "s", d[5], [1, 1, 1, K * K]),
                                 _x(g, "sq", d[6], [1, 4]))
    P["gated_delta_net"] = gdn
    return P


def test_graph_accepts_exactly_the_declared_dtypes():
    """cases.ACCEPTS (what the harness must cover) matches what graph validation accepts."""
    from .cases import ACCEPTS
    from .harness import ALL_TYPES, dname

    builders = _probe_builders()
    wrong = []
    for op, roles in ACCEPTS.items():
        for role, declared in roles.items():
            accepted = set()
            for dt in ALL_TYPES:
                try:
                    builders[op](N.Graph(), role, dt)
                    accepted.add(dt)
                except ValueError:
                    pass
            if accepted != declared:
                wrong.append(f"{op} arg {role}: graph accepts {sorted(map(dname, accepted))}, "
                             f"ACCEPTS says {sorted(map(dname, declared))}")
    assert not wrong, "\n".join(wrong)
