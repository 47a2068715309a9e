"""The op harness: every op of native/include/pyfast/ops.def against a float64 numpy reference.

harness.py  - loading the native module, ISAs / thread pools, dtype codecs, numpy references,
              running one declared case through a graph, comparison by normalized MSE.
cases.py    - the op cases, declared once as data (op, shapes, layouts, dtypes, params, tolerance)
              and the table of dtypes each op accepts (a coverage test keeps them in sync).
test_ops.py - every case x every ISA this CPU has x 1 and 3 threads, with sentinels around outputs.
test_quant.py, test_invariance.py, test_errors.py - quantized formats, batch invariance, errors.
"""
