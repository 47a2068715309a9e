"""The high-level API on the default model: generation, streaming, stop strings, chat, seeds,
prefix reuse, and input errors."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast.llm import LLM


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, n_ctx=512, n_threads=2)


def manual_greedy(llm: LLM, prompt: list[int], n: int) -> list[int]:
    llm.ctx.clear()
    llm._cached = []
    logits = llm.ctx.decode(prompt, seq_ids=0)[-1]
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        if llm.tokenizer.is_eog(t):
            break
        out.append(t)
        logits = llm.ctx.decode([t], seq_ids=0)[-1]
    llm.ctx.clear()
    return out


def test_greedy_generate_equals_argmax_loop(llm):
    prompt = "The three primary colors are"
    res = llm.generate(prompt, max_tokens=12, temperature=0)
    assert res.tokens == manual_greedy(llm, llm.tokenize(prompt), 12)
    assert res.text == llm.detokenize(res.tokens)
    assert res.finish_reason in ("length", "stop")
    assert res.timings.n_gen == len(res.tokens)


def test_stream_concatenates_to_full_text(llm):
    prompt = "List three fruits:"
    full = llm.generate(prompt, max_tokens=20, temperature=0)
    chunks = list(llm.generate(prompt, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].result is not None and chunks[-1].result.tokens == full.tokens


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_result_text_is_the_streamed_text(llm, seed):
    # stream=False decodes the text once at the end; streaming decodes it token by token. Sampled
    # output of a multilingual prompt cut at odd lengths (mid-character at times) or at EOS must
    # give the same tokens and the same text either way.
    prompt = "Write a sentence in Chinese, one in Russian and three emoji:"
    for n in (7, 13, 40):
        kw = dict(max_tokens=n, temperature=1.2, seed=seed)
        full = llm.generate(prompt, **kw)
        chunks = list(llm.generate(prompt, stream=True, **kw))
        res = chunks[-1].result
        assert res.tokens == full.tokens and res.finish_reason == full.finish_reason
        assert "".join(c.text for c in chunks) == res.text == full.text


def test_prefix_reuse_gives_same_output(llm):
    p = "def add(a, b):\n    return"
    a = llm.generate(p, max_tokens=8, temperature=0)
    b = llm.generate(p, max_tokens=8, temperature=0)  # the prompt is now cached
    assert b.timings.n_prompt_cached > 0
    assert a.tokens == b.tokens


def test_stop_string_truncates(llm):
    full = llm.generate("Count: 1, 2, 3,", max_tokens=16, temperature=0)
    assert len(full.text) > 4
    stop = full.text[2:4]
    res = llm.generate("Count: 1, 2, 3,", max_tokens=16, temperature=0, stop=[stop])
    assert res.finish_reason == "stop"
    assert res.text == full.text[: full.text.find(stop)]
    streamed = "".join(c.text for c in llm.generate("Count: 1, 2, 3,", max_tokens=16, temperature=0,
                                                     stop=[stop], stream=True))
    assert streamed == res.text


def test_seed_reproducible_and_sampling_varies(llm):
    kw = dict(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = llm.generate("Once upon a time", seed=7, **kw)
    b = llm.generate("Once upon a time", seed=7, **kw)
    assert a.tokens == b.tokens
    others = {tuple(llm.generate("Once upon a time", seed=s, **kw).tokens) for s in range(1, 5)}
    assert len(others) > 1


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = llm.apply_chat_template(msgs)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    res = llm.chat(msgs, max_tokens=24, temperature=0)
    assert res.prompt_tokens == llm.tokenize(text)
    assert "4" in res.text
    assert res.finish_reason == "stop"  # the model ends its turn with <|im_end|>


def test_logits_matches_decode(llm):
    toks = llm.tokenize("Hello there, general")
    lg = llm.logits(toks)
    assert lg.shape == (len(toks), llm.n_vocab)
    llm.ctx.clear()
    last = llm.ctx.decode(toks, seq_ids=0)[-1]
    llm.ctx.clear()
    np.testing.assert_array_equal(lg[-1], last)


def test_bad_inputs(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("hi", max_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hi", max_tokens=4, temperature=-1)
    with pytest.raises(ValueError, match="context"):
        llm.generate(list(range(600)), max_tokens=1)
    assert llm.generate("hi", max_tokens=0).tokens == []


def test_missing_model_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(tmp_path / "nope.gguf")


def test_weights_in_memory_equal_the_mapped_file(smollm2_path):
    """By default the weights are read into one huge-page buffer; every tensor's bytes equal the
    file's (PYFAST_MMAP / mmap=True keeps the mapping), they are read-only, and both give the same
    logits."""
    from pyfast.models import Model
    mem, mapped = Model(smollm2_path, mmap=False), Model(smollm2_path, mmap=True)
    assert not mem.mmap and mapped.mmap
    for name in mem.weights.info:
        a, b = mem.weights.data(name), mapped.weights.data(name)
        assert a.dtype == np.uint8 and a.size == mem.weights.info[name].nbytes
        assert not a.flags.writeable
        assert np.array_equal(a, b), name
    a = mem.weights.data("token_embd.weight")
    assert a.ctypes.data != mapped.weights.data("token_embd.weight").ctypes.data
    prompt = [1, 504, 3458, 282, 2940, 30]
    from pyfast.context import Context
    la = Context(mem, n_ctx=64, n_threads=2).decode(prompt, seq_ids=0)
    lb = Context(mapped, n_ctx=64, n_threads=2).decode(prompt, seq_ids=0)
    assert np.array_equal(la, lb)


def test_weights_read_by_several_threads_equal_the_file(smollm2_path, tmp_path, monkeypatch):
    """A file read in parts by several loader threads (the split a multi-GB file gets, here on
    8 MiB parts) holds the file's bytes in every tensor and gives the mapped file's logits."""
    import shutil
    from pyfast.context import Context
    from pyfast.models import Model, base
    seen = []

    def cuts(total, packs):
        c = base_cuts(total, packs, part_bytes=8 << 20)
        seen.append(c)
        return c

    base_cuts = base._read_cuts
    monkeypatch.setattr(base, "_read_cuts", cuts)
    fresh = tmp_path / "parts.gguf"  # its own in-memory copy (other tests may hold the file's)
    shutil.copyfile(smollm2_path, fresh)
    mem, mapped = Model(fresh, mmap=False), Model(smollm2_path, mmap=True)
    for name in mem.weights.info:
        assert np.array_equal(mem.weights.data(name), mapped.weights.data(name)), name
    assert len(seen) == 1 and len(seen[0]) == base._LOAD_THREADS + 1  # 8 parts of a 92 MB file
    prompt = [1, 504, 3458, 282, 2940, 30]
    la = Context(mem, n_ctx=64, n_threads=2).decode(prompt, seq_ids=0)
    lb = Context(mapped, n_ctx=64, n_threads=2).decode(prompt, seq_ids=0)
    assert np.array_equal(la, lb)


def test_models_of_one_file_share_the_weights_in_memory(smollm2_path):
    """Like a mapping, one in-memory copy per file and process: a second Model (a draft model of
    the same file, another LLM) shares it, also after the first one is gone."""
    import gc
    from pyfast.models import Model
    def at(m, name):  # the bytes graphs read (packed or not: the same for every sharer)
        data, packed = m.weights.matmul_data(name)
        return data.ctypes.data, packed

    a, b = Model(smollm2_path, mmap=False), Model(smollm2_path, mmap=False)
    addr = at(a, "token_embd.weight")
    assert at(b, "token_embd.weight") == addr
    del a
    gc.collect()
    c = Model(smollm2_path, mmap=False)
    assert at(c, "blk.0.attn_q.weight") == at(b, "blk.0.attn_q.weight")
    assert at(c, "token_embd.weight") == addr


def test_packed_weights_give_the_same_logits(smollm2_path, tmp_path):
    """In memory, matmul weights are packed (x16) at the first graph build where the kernels read
    that layout; the logits equal those of the mapped (row-major) file bit for bit, for one and
    several rows, and data() still gives the file's bytes."""
    import shutil
    from pyfast.context import Context
    from pyfast.models import Model
    from pyfast.models.base import packing_enabled
    fresh = tmp_path / "copy.gguf"  # its own in-memory copy (other tests may hold the file's)
    shutil.copyfile(smollm2_path, fresh)
    mem, mapped = Model(fresh, mmap=False), Model(smollm2_path, mmap=True)
    cm, cf = Context(mem, n_ctx=64, n_threads=2), Context(mapped, n_ctx=64, n_threads=2)
    prompt = [1, 504, 3458, 282, 2940, 30]
    np.testing.assert_array_equal(cm.decode(prompt, seq_ids=0, logits="all"), cf.decode(prompt, seq_ids=0, logits="all"))
    for n in (1, 2, 5):
        toks = np.array([504, 3458, 282, 2940, 30][:n], dtype=np.int32)
        a = cm.decode_run(toks, len(prompt), 0).copy()
        b = cf.decode_run(toks, len(prompt), 0).copy()
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(cm.last_argmax(), a.argmax(axis=1))
        cm.truncate(0, len(prompt))
        cf.truncate(0, len(prompt))
    packed = mem.weights._pack.packed
    if packing_enabled():
        assert "token_embd.weight" in packed and "blk.0.ffn_up.weight" in packed
    for name in ("token_embd.weight", "blk.0.ffn_up.weight", "blk.3.attn_v.weight"):
        assert np.array_equal(mem.weights.data(name), mapped.weights.data(name)), name


def test_weights_are_mapped_when_memory_is_short(smollm2_path, monkeypatch):
    """Without PYFAST_MMAP the weights are read into memory only when they take at most half of
    the available memory; PYFAST_MMAP=0 / 1 decides either way."""
    import pyfast.models as M
    monkeypatch.delenv("PYFAST_MMAP", raising=False)
    monkeypatch.setattr(M, "_mem_available", lambda: 1 << 40)
    assert not M.Model(smollm2_path).mmap
    monkeypatch.setattr(M, "_mem_available", lambda: 100 << 20)   # 100 MiB, the file is 94 MiB
    assert M.Model(smollm2_path).mmap
    monkeypatch.setenv("PYFAST_MMAP", "0")
    assert not M.Model(smollm2_path).mmap
    monkeypatch.setenv("PYFAST_MMAP", "1")
    monkeypatch.setattr(M, "_mem_available", lambda: 1 << 40)
    assert M.Model(smollm2_path).mmap


def test_truncated_tensor_data_is_a_clear_error(smollm2_path):
    """A tensor-data section that ends early (the file shrank after it was opened) is a clear
    error at the first weight access, not a short buffer."""
    from pyfast.models.base import Weights, _Packing, _segments
    from pyfast.gguf import GGUFReader
    r = GGUFReader(smollm2_path)
    w = Weights(r, in_memory=False)
    w.reader = type("R", (), {"data_offset": r.data_offset, "file_size": r.file_size + 4096, "path": r.path,
                               "tensors": r.tensors})()
    w._pack = _Packing()  # what an in-memory Weights sets up before its loader runs
    w._pack.segments = _segments(r.file_size + 4096 - r.data_offset, [])
    w._read_all("collapse")  # the file is 4 KiB shorter than the section it is told to read
    with pytest.raises(ValueError, match="file ended at byte"):
        w._wait_loaded()


class _CountingLock:
    """A threading.Lock that counts how often Buffer.collapse took it."""

    def __init__(self):
        import threading
        self.lock = threading.Lock()
        self.n = 0

    def acquire(self):
        self.lock.acquire()
        self.n += 1

    def release(self):
        self.lock.release()


def test_buffer_collapse_keeps_bytes_under_concurrent_reads():
    """Buffer.collapse moves the weights' pages into huge pages under running readers: every byte
    stays where it was (a reader summing the buffer meanwhile always gets the same sum), the bytes
    are copied and moved holding the lock it is given, and a buffer that was not collapsed (no
    transparent huge pages, or only part of a 2 MiB page in range) is left as it was."""
    import threading
    from pyfast._loader import load_native
    native = load_native()
    n = (24 << 20) + 12345
    buf = native.Buffer(n, huge_pages=True, advise=False)
    a = np.frombuffer(buf, dtype=np.uint8)
    a[:] = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    ref = a.copy()
    want = int(a.sum(dtype=np.uint64))
    sums, stop = [], threading.Event()

    def reader():  # at least one pass, however quick the collapse
        while True:
            sums.append(int(a.sum(dtype=np.uint64)))
            if stop.is_set():
                return

    t = threading.Thread(target=reader)
    t.start()
    lk = _CountingLock()
    try:
        assert buf.collapse(0, 1 << 20, lk) is False and lk.n == 0  # no whole 2 MiB page in range
        moved = [buf.collapse(off, min(8 << 20, n - off), lk) for off in range(0, n, 8 << 20)]
    finally:
        stop.set()
        t.join()
    assert sums and all(s == want for s in sums)
    np.testing.assert_array_equal(a, ref)
    assert lk.n == sum(moved)  # the lock was taken once per collapsed range, and released
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        thp = "[never]"
    if "[never]" not in thp:  # where the kernel has huge pages, every range holding whole 2 MiB pages moved
        assert moved == [True, True, True, False]  # the last range is 12345 bytes: no whole page
    assert lk.lock.acquire(blocking=False)
    a[::4096] = 7  # still writable memory at the same addresses
    assert int(a[4096]) == 7
    with pytest.raises(IndexError, match="out of bounds"):
        buf.collapse(n - 10, 20)


def test_collapse_starts_after_the_first_graph_run(smollm2_path, tmp_path, monkeypatch):
    """The move into huge pages waits for the first graph run on the weights (Context tells the
    weights once; its fresh pages would slow that first prompt), or _COLLAPSE_WAIT_S at most."""
    import shutil
    import threading
    from pyfast.context import Context
    from pyfast.models import Model, base

    class Fake:  # a buffer that records the ranges it was asked to move
        nbytes = 48 << 20

        def __init__(self):
            self.calls = []

        def collapse(self, off, n, lock):
            self.calls.append((off, n))
            return True

    fake, go = Fake(), threading.Event()
    t = threading.Thread(target=base._collapse, args=(lambda: fake, threading.Lock(), go))
    t.start()
    t.join(0.3)
    assert t.is_alive() and fake.calls == []  # waiting for the first run
    go.set()
    t.join(5)
    assert not t.is_alive() and fake.calls == [(0, 16 << 20), (16 << 20, 16 << 20), (32 << 20, 16 << 20)]
    monkeypatch.setattr(base, "_COLLAPSE_WAIT_S", 0.1)  # no run ever: it starts after the wait
    fake = Fake()
    t = threading.Thread(target=base._collapse, args=(lambda: fake, threading.Lock(), threading.Event()))
    t.start()
    t.join(5)
    assert not t.is_alive() and len(fake.calls) == 3
    # a Context's first decode tells its weights
    monkeypatch.setattr(base, "_COLLAPSE_WAIT_S", 60.0)
    fresh = tmp_path / "go.gguf"  # its own in-memory copy (other tests may hold the file's)
    shutil.copyfile(smollm2_path, fresh)
    m = Model(fresh, mmap=False)
    m.weights._wait_loaded()
    ctx = Context(m, n_ctx=32, n_threads=1)
    assert not m.weights._pack.computed.is_set()
    ctx.decode([1, 504], seq_ids=0)
    assert m.weights._pack.computed.is_set()
