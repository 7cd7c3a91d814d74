"""LISA attention / low-rank kernels: Triton vs the shipped torch reference, on this CPU machine.

The decode kernel the model calls ships in kernels/ (lisa_attention_triton.py, behind lisa_kernels.py); the
reference every path is tested against ships in modeling/ (lisa_reference.py: `ref`); the prefill and low-rank
kernels and the backend-dispatching wrappers are research code, research/lisa_prefill_triton.py (`kt`, which
re-exports the decode kernel's names). The three folders load as one private package (flat relative imports, as on
the Hub). The expected values are the reference in float64 (`_expected`), called with the kernels' arguments.

* Interpreter tests (`test_interp_*`): Triton's interpreter must be chosen before `triton.language` is
  first imported (its own helpers such as `tl.zeros` are `@triton.jit` functions decorated at import), and
  switching it on for the whole pytest process would turn every other Triton kernel into an interpreted
  one. So the numerics run in ONE child process (`python tests/test_kernels.py --interp-child ...` with
  TRITON_INTERPRET=1 from the start), started once per session for the selected cases; each parent test
  reports its own case from the child's JSON result. The child starts early (from the compile tests'
  fixture), so it overlaps with the ahead-of-time compiles on a 2-core machine.
* AOT tests (`test_compile_*`): the kernels are compiled in this process with
  `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` down to a cubin (bundled ptxas), with
  the argument specialisation the JIT would use on a GPU (ints == 1 folded, 16-divisibility hints). This
  surfaces GPU-only errors (dot shapes, dtype rules, layouts, shared memory) without a GPU; it does not
  check numerics on a GPU.
* Dispatch tests: which implementation runs (Triton entry points stubbed, torch paths spied on) for CPU tensors,
  GPU tensors (a CPU tensor subclass reporting is_cuda), forced backends and with `triton` hidden; the torch
  path's numbers (the reference's) are checked against the layer's math written out as plain loops (`_naive_lisa`).

bf16 is only compiled, never run: the interpreter's bf16 tl.dot is not trustworthy.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_COPIES: dict[str, tuple] = {}


def _load_copy(pkg_name: str):
    """Imports kernels/ + modeling/ + research/ as a private package `pkg_name`.

    Returns (research/lisa_prefill_triton.py, modeling/lisa_reference.py). The copies stay out of sys.modules
    afterwards.
    """
    if pkg_name not in _COPIES:
        spec = importlib.machinery.ModuleSpec(pkg_name, None, is_package=True)
        spec.submodule_search_locations = [str(ROOT / "kernels"), str(ROOT / "modeling"), str(ROOT / "research")]
        sys.modules[pkg_name] = importlib.util.module_from_spec(spec)
        try:
            _COPIES[pkg_name] = (
                importlib.import_module(f"{pkg_name}.lisa_prefill_triton"),
                importlib.import_module(f"{pkg_name}.lisa_reference"),
            )
        finally:
            for name in [n for n in sys.modules if n == pkg_name or n.startswith(pkg_name + ".")]:
                del sys.modules[name]
    return _COPIES[pkg_name]


def _layer(batch, heads, kv_heads, q_len, kv_len, head_dim, rank, ffn, dtype, seed=0, with_bias=True):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    p = dict(
        mix=rand(heads, heads, scale=0.5),
        bias=rand(heads, scale=0.5) if with_bias else None,
        w1=rand(ffn, heads, scale=0.5) if ffn else None,
        b1=rand(ffn, scale=0.5) if ffn else None,
        w2=rand(heads, ffn, scale=0.5) if ffn else None,
        s_prev=rand(batch, heads, q_len, kv_len, scale=1.5),
        qlr=rand(batch, heads, q_len, rank) if rank else None,
        klr=rand(batch, heads, kv_len, rank) if rank else None,
        v=rand(batch, kv_heads, kv_len, head_dim),
        q_prev=rand(batch, heads, q_len, 16),
        k_prev=rand(batch, kv_heads, kv_len, 16),
    )
    return {k: (t.to(dtype) if t is not None else None) for k, t in p.items()}


def _padding_mask(batch, q_len, kv_len, dtype):
    """Additive (B,1,Tq,Tk) mask, HF style (finfo.min): batch row 0 has 3 left-padded keys."""
    m = torch.zeros(batch, 1, q_len, kv_len, dtype=dtype)
    m[0, :, :, :3] = torch.finfo(dtype).min
    return m


TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=3e-2, rtol=2e-2)}


def _close(actual, expected, dtype, what):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _expected(ref, s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask=None):
    """The shipped reference in float64, called with the kernels' arguments (dense Align; s_prev (B,H,Tq,Tk), or
    (B,H,Tk) with qlr (B,H,r) at decode; the kernels' mask: causal, the queries at the last Tq positions, plus
    `attn_mask`, additive (B,1,Tq|1,Tk) or a (B,Tk) keep-mask). Returns (out, S) in the layout of s_prev."""
    d = lambda t: None if t is None else _plain(t).double()  # noqa: E731
    decode = s_prev.dim() == 3
    s_prev = d(s_prev[:, :, None] if decode else s_prev)
    batch, heads, q_len, kv_len = s_prev.shape
    if qlr is None:
        qlr, klr = torch.zeros(batch, heads, q_len, 0), torch.zeros(batch, heads, kv_len, 0)
    qlr = d(qlr[:, :, None] if qlr.dim() == 3 else qlr)
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask = torch.zeros(batch, 1, q_len, kv_len, dtype=torch.float64).masked_fill(~causal, -math.inf)
    if attn_mask is not None and attn_mask.dim() == 2:
        mask = mask.masked_fill(~attn_mask.bool()[:, None, None, :], -math.inf)
    elif attn_mask is not None:
        mask = mask + d(attn_mask)
    out, scores = ref.shared_attention_reference(
        s_prev, qlr, d(klr), d(v), mix=d(mix), bias=torch.zeros(heads, dtype=torch.float64) if bias is None else d(bias),
        ffn_in_weight=d(w1), ffn_in_bias=d(b1), ffn_out_weight=d(w2), mask=mask,
    )  # fmt: skip
    return (out[:, :, 0], scores[:, :, 0]) if decode else (out, scores)


# ------------------------------------------------------------------------------------------------
# interpreter cases (run in the child process; `kt` = kernels with interpreted Triton, `ref` = reference)
# ------------------------------------------------------------------------------------------------

F32, F16 = torch.float32, torch.float16

DECODE_CASES = {  # (batch, H, Hkv, Tk, rank, ffn, mask, splits, dtype)
    "gqa-f32-nosplit": (2, 4, 2, 37, 3, 0, False, 1, F32),
    "gqa-ffn-mask-split3-f32": (2, 4, 2, 37, 3, 5, True, 3, F32),
    "h3-onekv-mask-split2-f32": (1, 3, 1, 20, 2, 0, True, 2, F32),  # H not a power of 2, one KV head
    "mha-ffn-nolr-autosplit-f32": (2, 4, 4, 37, 0, 5, False, None, F32),  # no low-rank term
    "gqa-ffn-mask-split3-f16": (2, 4, 2, 37, 3, 5, True, 3, F16),
}


def _case_decode(kt, ref, batch, heads, kv_heads, kv_len, rank, ffn, mask, splits, dtype):
    p = _layer(batch, heads, kv_heads, 1, kv_len, 16, rank, ffn, dtype)
    s_prev = p["s_prev"][:, :, 0]
    qlr = p["qlr"][:, :, 0] if rank else None
    am = _padding_mask(batch, 1, kv_len, dtype) if mask else None
    args = (s_prev, p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], qlr, p["klr"], p["v"], am)
    out, scores = kt.lisa_decode(*args, num_splits=splits, backend="triton")
    ref_out, ref_scores = _expected(ref, *args)
    assert out.shape == (batch, heads, 16) and out.dtype == dtype
    assert scores.shape == (batch, heads, kv_len) and scores.dtype == dtype
    _close(scores, ref_scores, dtype, "scores")
    _close(out, ref_out, dtype, "out")


def _case_decode_model_layout(kt, ref):
    """The model hands over (B,H,1,Tk) score rows, (B,H,1,r) queries, a (B,Tk) keep-mask; no S requested."""
    p = _layer(1, 4, 2, 1, 21, 16, 2, 0, F32, seed=3)
    keep = torch.ones(1, 21, dtype=torch.long)
    keep[0, :2] = 0
    args = (p["s_prev"], p["mix"], p["bias"], None, None, None, p["qlr"], p["klr"], p["v"], keep)
    out, scores = kt.lisa_decode(*args, return_scores=False, backend="triton")
    ref_out, _ = _expected(ref, *args)
    ref_out = ref_out[:, :, 0]
    assert scores is None
    _close(out, ref_out, F32, "out")


def _align_module(mix, bias, w1, b1, w2):
    """A stand-in for a dense-Align `LisaSharedAttention`: what kernels/lisa_kernels.py reads of it."""
    from types import SimpleNamespace

    ffn_in = ffn_out = None
    if w1 is not None:
        ffn_in = torch.nn.Linear(w1.shape[1], w1.shape[0])
        ffn_out = torch.nn.Linear(w1.shape[0], w1.shape[1], bias=False)
        with torch.no_grad():
            ffn_in.weight.copy_(w1), ffn_in.bias.copy_(b1), ffn_out.weight.copy_(w2)
    return SimpleNamespace(align=SimpleNamespace(mix=mix, bias=bias, ffn_in=ffn_in, ffn_out=ffn_out))


def _case_adapter(kt, ref, rank, ffn, mask):
    """kernels/lisa_kernels.py `fused_lisa_decode` (what lisa_attention.py calls, in its layout: (B,H,1,Tk)
    score rows, (B,H,1,r) queries, an additive (B,1,1,Tk) mask) vs the shipped reference. There is no torch
    fallback in the adapter, so this runs the (interpreted) Triton kernel."""
    B, H, Hkv, Tk, D = 2, 4, 2, 23, 8
    p = _layer(B, H, Hkv, 1, Tk, D, 0, ffn, F32, seed=5)
    g = torch.Generator().manual_seed(6)
    q_lr, k_lr = torch.randn(B, H, 1, rank, generator=g), torch.randn(B, H, Tk, rank, generator=g)
    am = None
    if mask:
        am = torch.zeros(B, 1, 1, Tk)
        am[1, ..., :2] = torch.finfo(torch.float32).min
    module = _align_module(p["mix"], p["bias"], p["w1"], p["b1"], p["w2"])
    out, scores = kt.fused_lisa_decode(module, p["s_prev"], q_lr, k_lr, p["v"], am)
    expect_out, expect_scores = _expected(ref, p["s_prev"], p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], q_lr, k_lr, p["v"], am)
    expect_out = expect_out.transpose(1, 2)
    assert out.shape == (B, 1, H, D) and scores.shape == (B, H, 1, Tk)
    _close(scores, expect_scores, F32, "scores")
    _close(out, expect_out, F32, "out")


def _case_decode_rank0(kt, ref, splits):
    """Rank 0 (the `lowrank=False` ablation): the model hands over (..., 0)-sized low-rank q/k; no 1/sqrt(0), aligned
    scores only."""
    p = _layer(2, 4, 2, 1, 37, 16, 0, 5, F32, seed=8)
    qlr, klr = torch.zeros(2, 4, 1, 0), torch.zeros(2, 4, 37, 0)
    args = (p["s_prev"], p["mix"], p["bias"], p["w1"], p["b1"], p["w2"])
    am = _padding_mask(2, 1, 37, F32)
    out, scores = kt.lisa_decode(*args, qlr, klr, p["v"], am, num_splits=splits, backend="triton")
    ref_out, ref_scores = _expected(ref, p["s_prev"][:, :, 0], *args[1:], None, None, p["v"], am)
    _close(scores, ref_scores, F32, "scores")
    _close(out, ref_out, F32, "out")


def _case_prefill_rank0(kt, ref):
    """Rank 0 on both prefill routes (fused from q_prev/k_prev, and materialised from S_prev)."""
    p = _layer(1, 4, 2, 9, 13, 16, 0, 0, F32, seed=9)
    qlr, klr = torch.zeros(1, 4, 9, 0), torch.zeros(1, 4, 13, 0)
    w = (p["mix"], p["bias"], None, None, None)
    kw = dict(q_prev=p["q_prev"], k_prev=p["k_prev"])
    out, _ = kt.lisa_prefill(None, *w, qlr, klr, p["v"], **kw, backend="triton")
    s_prev = p["q_prev"] @ p["k_prev"].repeat_interleave(2, dim=1).transpose(-1, -2) / 4.0  # Dp = 16
    ref_out, _ = _expected(ref, s_prev, *w, None, None, p["v"])
    _close(out, ref_out, F32, "fused out")
    out, scores = kt.lisa_prefill(p["s_prev"], *w, qlr, klr, p["v"], return_scores=True, causal_skip=False,
                                  backend="triton")  # fmt: skip
    ref_out, ref_scores = _expected(ref, p["s_prev"], *w, None, None, p["v"])
    _close(out, ref_out, F32, "materialised out")
    _close(scores, ref_scores, F32, "materialised scores")


PREFILL_CASES = {  # (batch, H, Hkv, Tq, Tk, rank, ffn, mask, causal_skip, dtype)
    "chunked-ffn-mask-full-S-f32": (2, 4, 2, 13, 21, 3, 5, True, False, F32),  # 8 cached keys
    "square-causal-skip-f32": (1, 4, 2, 19, 19, 3, 0, False, True, F32),
    "chunked-ffn-mask-skip-f16": (2, 4, 2, 13, 21, 3, 5, True, True, F16),
}


def _case_prefill(kt, ref, batch, heads, kv_heads, q_len, kv_len, rank, ffn, mask, causal_skip, dtype):
    p = _layer(batch, heads, kv_heads, q_len, kv_len, 16, rank, ffn, dtype, seed=1)
    am = _padding_mask(batch, q_len, kv_len, dtype) if mask else None
    args = (p["s_prev"], p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], p["qlr"], p["klr"], p["v"], am)
    out, scores = kt.lisa_prefill(*args, return_scores=True, causal_skip=causal_skip, backend="triton")
    ref_out, ref_scores = _expected(ref, *args)
    _close(out, ref_out, dtype, "out")
    assert torch.isfinite(scores.float()).all()
    if causal_skip:  # S is only guaranteed where a query can see the key (0 in skipped tiles)
        visible = torch.ones(q_len, kv_len).tril(kv_len - q_len).bool()
        _close(scores[..., visible], ref_scores[..., visible], dtype, "scores (visible part)")
    else:
        _close(scores, ref_scores, dtype, "scores")


PREFILL_QK_CASES = {  # (H, Hkv, ffn, return_scores, dtype)
    "fast-gqa-f32": (4, 2, 0, False, F32),  # fused, no N x N: GQA fold of the queries
    "fast-mha-f32": (3, 3, 0, False, F32),  # fused, MHA: scaled per-head products
    "fast-gqa-f16": (4, 2, 0, False, F16),
    "ffn-materialised-f32": (4, 2, 5, False, F32),  # FFN: S_prev materialised, scores + attention kernels
    "return-scores-f32": (4, 2, 0, True, F32),  # S requested: same materialised route
}


def _case_prefill_qk(kt, ref, heads, kv_heads, ffn, return_scores, dtype):
    batch, q_len, kv_len = 2, 11, 18
    p = _layer(batch, heads, kv_heads, q_len, kv_len, 16, 3, ffn, dtype, seed=2)
    am = _padding_mask(batch, q_len, kv_len, dtype)
    args = (None, p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], p["qlr"], p["klr"], p["v"], am)
    kw = dict(q_prev=p["q_prev"], k_prev=p["k_prev"], prev_scale=0.3, return_scores=return_scores)
    out, scores = kt.lisa_prefill(*args, **kw, causal_skip=False, backend="triton")
    s_prev = 0.3 * p["q_prev"].double() @ p["k_prev"].double().repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2)
    ref_out, ref_scores = _expected(ref, s_prev, *args[1:])
    _close(out, ref_out, dtype, "out")
    if return_scores:
        _close(scores, ref_scores, dtype, "scores")
    else:
        assert scores is None


LOWRANK_CASES = {  # (rows, rank, bias, split_k, dtype)
    "m1-bias-f32": (1, 40, True, None, F32),
    "m5-splitk3-f32": (5, 24, False, 3, F32),
    "m16-bias-splitk2-f16": (16, 40, True, 2, F16),
}


def _case_lowrank(kt, ref, rows, rank, bias, split_k, dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 100, generator=g).to(dtype)  # K = 100: not a multiple of BLOCK_K
    b_w = (torch.randn(rank, 100, generator=g) / 10).to(dtype)
    a_w = (torch.randn(70, rank, generator=g) / math.sqrt(rank)).to(dtype)
    b = torch.randn(70, generator=g).to(dtype) if bias else None
    y = kt.lowrank_linear_triton(x, b_w, a_w, b, split_k=split_k)
    assert y.shape == (rows, 70) and y.dtype == dtype
    expected = x.double() @ b_w.double().T @ a_w.double().T + (0 if b is None else b.double())
    _close(y, expected, dtype, "y")


INTERP_CASES = {
    **{f"decode/{k}": (_case_decode, v) for k, v in DECODE_CASES.items()},
    "decode/model-layout-keepmask-f32": (_case_decode_model_layout, ()),
    "decode/rank0-ffn-mask-nosplit-f32": (_case_decode_rank0, (1,)),
    "decode/rank0-ffn-mask-split3-f32": (_case_decode_rank0, (3,)),
    "adapter/rank3-ffn-mask-f32": (_case_adapter, (3, 5, True)),
    "adapter/rank0-nomask-f32": (_case_adapter, (0, 0, False)),  # a rank-0 (lowrank=False) dense-Align shared layer
    "prefill/rank0-f32": (_case_prefill_rank0, ()),
    **{f"prefill/{k}": (_case_prefill, v) for k, v in PREFILL_CASES.items()},
    **{f"prefill_qk/{k}": (_case_prefill_qk, v) for k, v in PREFILL_QK_CASES.items()},
    **{f"lowrank/{k}": (_case_lowrank, v) for k, v in LOWRANK_CASES.items()},
}


def _interp_child(out_path: str, case_ids: list[str]) -> None:
    """Child process entry point (TRITON_INTERPRET=1 set by the parent before anything imports triton)."""
    kt, ref = _load_copy("_lisa_kernels_interp")
    assert kt.HAS_TRITON and kt._INTERPRET, "child must run with TRITON_INTERPRET=1"
    results = {}
    for case_id in case_ids:
        fn, args = INTERP_CASES[case_id]
        t0 = time.perf_counter()
        try:
            fn(kt, ref, *args)
            results[case_id] = {"ok": True, "seconds": time.perf_counter() - t0}
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results[case_id] = {"ok": False, "error": traceback.format_exc(), "seconds": time.perf_counter() - t0}
        Path(out_path).write_text(json.dumps(results))  # partial results survive a crash


class _InterpChild:
    """One child process running the selected interpreter cases; started lazily, read on demand."""

    def __init__(self, case_ids: list[str], workdir: Path):
        self.out = workdir / "interp_results.json"
        self.log = workdir / "interp_child.log"
        env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--interp-child", str(self.out), *case_ids]
        self.log_file = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log_file, stderr=subprocess.STDOUT)
        self.results: dict | None = None

    def result(self, case_id: str, timeout: float = 900) -> dict:
        if self.results is None:
            try:
                self.proc.wait(timeout=timeout)
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                self.log_file.close()
            self.results = json.loads(self.out.read_text()) if self.out.exists() else {}
        if case_id not in self.results:
            tail = self.log.read_text()[-4000:]
            pytest.fail(f"interpreter child gave no result for {case_id} (exit {self.proc.returncode}):\n{tail}")
        return self.results[case_id]

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self.log_file.closed:
            self.log_file.close()


@pytest.fixture(scope="session")
def interp_child(request, tmp_path_factory):
    """Starts the interpreter child for every selected test_interp case (once per session)."""
    pytest.importorskip("triton")
    selected = [
        item.callspec.params["case_id"]
        for item in request.session.items
        if item.name.startswith("test_interp[") and hasattr(item, "callspec")
    ]
    child = _InterpChild(selected, tmp_path_factory.mktemp("lisa_interp"))
    yield child
    child.close()


# ------------------------------------------------------------------------------------------------
# dispatch / fallbacks (in this process, no interpreter involved)
# ------------------------------------------------------------------------------------------------


class _TritonCalled(Exception):
    """Raised by the stubbed Triton entry points: the dispatcher chose the Triton path."""


class _FakeCuda(torch.Tensor):
    """A CPU tensor that claims to live on a GPU: the device test is all the dispatcher reads to pick Triton."""

    @property
    def is_cuda(self):
        return True


def _fake_cuda(t):
    return None if t is None else t.as_subclass(_FakeCuda)


def _plain(t):
    return t.as_subclass(torch.Tensor)


def _spy_dispatch(monkeypatch, kt) -> list[str]:
    """Replaces the three Triton entry points of `kt` by stubs raising _TritonCalled and wraps the three torch
    references it dispatches to; returns the list of the names called, in order."""
    calls: list[str] = []

    def triton_stub(name):
        def stub(*args, **kwargs):
            calls.append(name)
            raise _TritonCalled(name)

        return stub

    def reference_spy(name):
        real = getattr(kt, name)

        def spy(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return spy

    for name in ("lisa_decode_triton", "lisa_prefill_triton", "lowrank_linear_triton"):
        monkeypatch.setattr(kt, name, triton_stub(name))
    for name in ("lisa_decode_torch", "lisa_prefill_torch", "lowrank_linear_torch"):
        monkeypatch.setattr(kt, name, reference_spy(name))
    return calls


def _naive_lisa(s_prev, mix, bias, w1, b1, w2, qlr, klr, v, keep=None):
    """The shared layer written out entry by entry in float64, independently of kernels/ (module docstring of
    modeling/lisa_reference.py): S[b,:,i,j] from the H previous scores at (i, j), then a causal softmax over the
    visible keys (query i at absolute position Tk - Tq + i, `keep` (B,Tk) bool) and the GQA-weighted sum of V.
    Returns (out (B,H,Tq,D), S (B,H,Tq,Tk))."""
    d = lambda t: None if t is None else _plain(t).double()  # noqa: E731
    s_prev, mix, bias, w1, b1, w2, qlr, klr, v = map(d, (s_prev, mix, bias, w1, b1, w2, qlr, klr, v))
    batch, heads, q_len, kv_len = s_prev.shape
    group = heads // v.shape[1]
    scores = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.float64)
    out = torch.zeros(batch, heads, q_len, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for i in range(q_len):
            for j in range(kv_len):
                col = s_prev[b, :, i, j]
                s = mix @ col
                if bias is not None:
                    s = s + bias
                if w1 is not None:
                    x = w1 @ col + b1
                    gelu = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
                    s = s + w2 @ gelu
                if qlr is not None:
                    s = s + (qlr[b, :, i] * klr[b, :, j]).sum(-1) / math.sqrt(qlr.shape[-1])
                scores[b, :, i, j] = s
            visible = [j for j in range(kv_len) if j <= kv_len - q_len + i and (keep is None or keep[b, j])]
            for h in range(heads):
                row = scores[b, h, i, visible]
                weights = torch.exp(row - row.max())
                weights = weights / weights.sum()
                out[b, h, i] = sum(w * v[b, h // group, j] for w, j in zip(weights, visible))
    return out, scores


def _naive_close(actual, expected, what):
    torch.testing.assert_close(_plain(actual).double(), expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _dispatch_inputs(fake_cuda=False, dtype=F32):
    """One GQA layer with FFN, low-rank term and a padding mask (batch row 0: 3 keys masked), Tq=5 < Tk=9."""
    p = _layer(2, 4, 2, 5, 9, 16, 2, 3, dtype)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, :3] = False
    mask = _padding_mask(2, 5, 9, dtype)
    if fake_cuda:
        p = {k: _fake_cuda(t) for k, t in p.items()}
    return p, keep, mask


def test_auto_backend_on_cpu_tensors_runs_the_torch_reference(monkeypatch):
    """backend="auto" with CPU tensors (Triton importable here): the torch reference runs, never a Triton entry
    point, and its numbers are the layer's math (checked against a plain loop, not against the reference)."""
    kt, _ = _load_copy("_lisa_kernels_plain")
    calls = _spy_dispatch(monkeypatch, kt)
    p, keep, mask = _dispatch_inputs()
    args = (p["s_prev"], p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], p["qlr"], p["klr"], p["v"], mask)
    expect_out, expect_scores = _naive_lisa(*args[:9], keep=keep)

    out, scores = kt.lisa_prefill(*args, return_scores=True)
    assert calls == ["lisa_prefill_torch"]
    assert out.shape == (2, 4, 5, 16) and scores.shape == (2, 4, 5, 9)
    _naive_close(out, expect_out, "prefill out")
    _naive_close(scores, expect_scores, "prefill scores")

    # decode, in the model's layout ((B,H,1,Tk) scores, (B,H,1,r) query, (B,Tk) keep-mask): all unmasked keys seen
    calls.clear()
    dec_out, dec_expect = _naive_lisa(
        p["s_prev"][:, :, -1:], *args[1:6], p["qlr"][:, :, -1:], p["klr"], p["v"], keep=keep
    )  # fmt: skip
    out, scores = kt.lisa_decode(p["s_prev"][:, :, -1:], *args[1:6], p["qlr"][:, :, -1:], p["klr"], p["v"], keep.long())
    assert calls == ["lisa_decode_torch"]
    _naive_close(out, dec_out[:, :, 0], "decode out")
    _naive_close(scores, dec_expect[:, :, 0], "decode scores")
    calls.clear()
    _, no_scores = kt.lisa_decode(p["s_prev"][:, :, -1], *args[1:6], p["qlr"][:, :, -1], p["klr"], p["v"],
                                  return_scores=False)  # fmt: skip
    assert no_scores is None and calls == ["lisa_decode_torch"]

    calls.clear()
    x, b_w, a_w, bias = torch.randn(3, 8), torch.randn(4, 8), torch.randn(6, 4), torch.randn(6)
    y = kt.lowrank_linear(x, b_w, a_w, bias)
    assert calls == ["lowrank_linear_torch"]
    torch.testing.assert_close(y, ((x.double() @ b_w.double().T) @ a_w.double().T + bias.double()).float())
    assert kt.HAS_TRITON and kt.triton_available() and not kt.triton_available(x)


def test_backend_choice_routes_to_triton_only_where_it_can_run(monkeypatch):
    """The positive side of the dispatch rule (with stubbed Triton entry points): tensors on a GPU in fp32/fp16/bf16
    or backend="triton" reach Triton; fp64 GPU tensors, more than 16 low-rank rows and backend="torch" do not."""
    kt, _ = _load_copy("_lisa_kernels_plain")
    if not kt.HAS_TRITON:
        pytest.skip("triton is not installed")
    calls = _spy_dispatch(monkeypatch, kt)
    p, _, mask = _dispatch_inputs(fake_cuda=True)
    args = (p["s_prev"], p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], p["qlr"], p["klr"], p["v"], mask)
    dec = (p["s_prev"][:, :, -1], *args[1:6], p["qlr"][:, :, -1], p["klr"], p["v"])
    with pytest.raises(_TritonCalled):
        kt.lisa_prefill(*args)
    with pytest.raises(_TritonCalled):
        kt.lisa_decode(*dec)
    with pytest.raises(_TritonCalled):
        kt.lowrank_linear(_fake_cuda(torch.randn(16, 8)), _fake_cuda(torch.randn(4, 8)), _fake_cuda(torch.randn(6, 4)))
    assert calls == ["lisa_prefill_triton", "lisa_decode_triton", "lowrank_linear_triton"]

    calls.clear()
    kt.lisa_prefill(*args, backend="torch")
    kt.lisa_decode(*dec, backend="torch")
    kt.lowrank_linear(_fake_cuda(torch.randn(17, 8)), _fake_cuda(torch.randn(4, 8)), _fake_cuda(torch.randn(6, 4)))
    p64, _, _ = _dispatch_inputs(fake_cuda=True, dtype=torch.float64)
    kt.lisa_decode(p64["s_prev"][:, :, -1], p64["mix"], None, None, None, None, None, None, p64["v"])
    assert calls == [
        "lisa_prefill_torch", "lisa_decode_torch", "lowrank_linear_torch", "lisa_decode_torch"
    ]  # fmt: skip

    calls.clear()
    cpu = _dispatch_inputs()[0]
    with pytest.raises(_TritonCalled):  # forced: the caller asked for Triton (e.g. under TRITON_INTERPRET=1)
        kt.lisa_decode(cpu["s_prev"][:, :, -1], cpu["mix"], *[None] * 6, cpu["v"], backend="triton")
    assert calls == ["lisa_decode_triton"]
    with pytest.raises(ValueError, match="backend must be"):
        kt.lisa_decode(*dec, backend="bogus")


def test_without_triton_falls_back(monkeypatch):
    """With `triton` not importable the module still imports; every call, even with GPU tensors, runs the torch
    reference (right numbers), and backend="triton" is refused before any launch."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    kt, _ = _load_copy("_lisa_kernels_notriton")
    assert not kt.HAS_TRITON and not kt.triton_available() and not kt.triton_available(torch.zeros(1))
    calls = _spy_dispatch(monkeypatch, kt)
    p, keep, mask = _dispatch_inputs(fake_cuda=True)
    dec = (p["s_prev"][:, :, -1], p["mix"], p["bias"], None, None, None, p["qlr"][:, :, -1], p["klr"], p["v"])
    dec = (*dec, mask[:, :, -1:])
    out, scores = kt.lisa_decode(*dec)
    assert calls == ["lisa_decode_torch"]
    expect_out, expect_scores = _naive_lisa(
        p["s_prev"][:, :, -1:], *dec[1:6], p["qlr"][:, :, -1:], *dec[7:9], keep=keep
    )  # fmt: skip
    _naive_close(out, expect_out[:, :, 0], "decode out")
    _naive_close(scores, expect_scores[:, :, 0], "decode scores")
    calls.clear()
    x, b_w, a_w = torch.randn(2, 8), torch.randn(4, 8), torch.randn(6, 4)
    y = kt.lowrank_linear(_fake_cuda(x), _fake_cuda(b_w), _fake_cuda(a_w))
    assert calls == ["lowrank_linear_torch"]
    torch.testing.assert_close(_plain(y), (x.double() @ b_w.double().T @ a_w.double().T).float())
    calls.clear()
    for call in (
        lambda: kt.lisa_decode(*dec, backend="triton"),
        lambda: kt.lisa_prefill(p["s_prev"], *dec[1:6], p["qlr"], p["klr"], p["v"], backend="triton"),
        lambda: kt.lowrank_linear(x, b_w, a_w, backend="triton"),
    ):
        with pytest.raises(RuntimeError, match="triton is not installed"):
            call()
    assert calls == []


def test_reference_decode_equals_prefill_last_row():
    """The reference without a mask puts the queries at the last Tq positions: one decode row is prefill's last."""
    _, ref = _load_copy("_lisa_kernels_plain")
    p = _layer(2, 4, 2, 6, 6, 16, 3, 5, F32, seed=7)
    align = dict(mix=p["mix"], bias=p["bias"], ffn_in_weight=p["w1"], ffn_in_bias=p["b1"], ffn_out_weight=p["w2"])
    out, scores = ref.shared_attention_reference(p["s_prev"], p["qlr"], p["klr"], p["v"], **align)
    last = slice(-1, None)
    d_out, d_scores = ref.shared_attention_reference(p["s_prev"][:, :, last], p["qlr"][:, :, last], p["klr"], p["v"], **align)
    torch.testing.assert_close(d_out, out[:, :, last])
    torch.testing.assert_close(d_scores, scores[:, :, last])


def test_model_gate_and_adapter_without_triton(monkeypatch):
    """What lisa_attention.py imports from kernels/ (`fused_lisa_decode`, `triton_available`) imports without
    triton, and the gate it calls says no for every tensor, so the model keeps its torch path. With triton, only
    fp32/fp16/bf16 tensors on a GPU pass the gate (the kernel has no torch fallback)."""
    kt, _ = _load_copy("_lisa_kernels_plain")
    assert kt.triton_available(_fake_cuda(torch.zeros(1))) and kt.triton_available(_fake_cuda(torch.zeros(1).half()))
    assert not kt.triton_available(torch.zeros(1)) and not kt.triton_available(_fake_cuda(torch.zeros(1).double()))
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    kt, _ = _load_copy("_lisa_kernels_notriton")
    assert callable(kt.fused_lisa_decode) and not kt.triton_available(_fake_cuda(torch.zeros(1)))


# ------------------------------------------------------------------------------------------------
# ahead-of-time compile for sm_90 (H100/H200): GPU-only errors without a GPU
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def kaot(request, monkeypatch):
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia.compiler")
    if any(i.name.startswith("test_interp[") for i in request.session.items):
        request.getfixturevalue("interp_child")  # start the child now: it overlaps with the compiles
    if not isinstance(triton.language.zeros, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET was set when triton was imported: cannot compile in this process")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silence the 3.9 deprecation warning
    kt, _ = _load_copy("_lisa_kernels_plain")
    assert not kt._INTERPRET and isinstance(kt._lowrank_linear_kernel, triton.runtime.JITFunction)
    return kt


def _compile_sm90(launch, config=None):
    """Compiles one planned launch as the JIT would on an sm_90 device (same specialisation)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    kernel = launch.kernel
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    if config is None and isinstance(kernel, triton.runtime.Autotuner):
        config = kernel.configs[0]
    constexprs = dict(launch.constexprs)
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
    if config is not None:
        constexprs.update(config.kwargs)
        options.update(num_warps=config.num_warps, num_stages=config.num_stages)
    runtime_names = [n for n in fn.arg_names if n not in constexprs]
    assert len(runtime_names) == len(launch.args), "launch plan out of sync with the kernel signature"
    signature, attrs = {}, {}
    for name, value in zip(runtime_names, launch.args):
        ty, attr = native_specialize_impl(CUDABackend, value, False, True, True)
        if ty == "constexpr":  # ints equal to 1 are specialised away, as on a GPU
            constexprs[name] = attr
        else:
            signature[name] = ty
            if isinstance(attr, str) and attr:
                attrs[(fn.arg_names.index(name),)] = CUDABackend.parse_attr(attr)
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm.get("cubin"), "no cubin produced"
    assert compiled.metadata.shared <= 227 * 1024, f"{fn.__name__}: {compiled.metadata.shared} B shared memory"
    return compiled


def _llama3_layer(ffn, q_len=64, kv_len=64):
    # Llama-3-8B attention shapes (H=32, Hkv=8, D=128), r=16, bf16; short sequence (only types/constexprs matter)
    return _layer(1, 32, 8, q_len, kv_len, 128, 16, ffn, torch.bfloat16)


def test_compile_decode_sm90(kaot):
    import triton

    p = _llama3_layer(ffn=32, q_len=1, kv_len=256)
    am = torch.zeros(1, 1, 1, 256, dtype=torch.bfloat16)
    launches, _, _ = kaot._decode_plan(
        p["s_prev"][:, :, 0], p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], p["qlr"][:, :, 0], p["klr"], p["v"],
        am, True, 4,
    )  # fmt: skip
    assert len(launches) == 2  # split-K: partial kernel + merge kernel
    launches[0].constexprs["BLOCK_N"] = 64  # the block size used on CUDA
    _compile_sm90(launches[0], triton.Config({}, num_warps=4, num_stages=2))
    _compile_sm90(launches[1])
    # rank 0 (lowrank=False), in the model's layout: (B,H,1,Tk) scores, (B,H,1,0) queries, (B,H,Tk,0) keys
    q0, k0 = p["qlr"][..., :0], p["klr"][..., :0]
    launches, _, _ = kaot._decode_plan(p["s_prev"], p["mix"], p["bias"], None, None, None, q0, k0, p["v"], am, True, 1)
    assert len(launches) == 1 and not launches[0].constexprs["HAS_LR"]
    launches[0].constexprs["BLOCK_N"] = 64
    _compile_sm90(launches[0], triton.Config({}, num_warps=4, num_stages=2))


def test_compile_prefill_sm90(kaot):
    p = _llama3_layer(ffn=32)
    am = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
    launches, _, _ = kaot._prefill_plan(
        p["s_prev"], p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], p["qlr"], p["klr"], p["v"], am,
        None, None, None, True, True,
    )  # fmt: skip
    scores_launch, attn_launch = launches
    assert not attn_launch.constexprs["FROM_QK"]
    _compile_sm90(scores_launch, kaot._SCORES_CONFIGS_CUDA[0])
    _compile_sm90(attn_launch, kaot._PREFILL_CONFIGS_CUDA[0])


def test_compile_prefill_fast_path_sm90(kaot):
    p = _llama3_layer(ffn=0)
    q_prev = torch.randn(1, 32, 64, 128, dtype=torch.bfloat16)
    k_prev = torch.randn(1, 8, 64, 128, dtype=torch.bfloat16)
    launches, _, _ = kaot._prefill_plan(
        None, p["mix"], p["bias"], None, None, None, p["qlr"], p["klr"], p["v"], None,
        q_prev, k_prev, None, False, True,
    )  # fmt: skip
    (launch,) = launches
    assert launch.constexprs["FROM_QK"] and not launch.constexprs["GROUP_ONE"]
    _compile_sm90(launch, kaot._PREFILL_CONFIGS_CUDA[-1])


def test_compile_lowrank_sm90(kaot):
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    b_w = torch.randn(64, 512, dtype=torch.bfloat16)
    a_w = torch.randn(512, 64, dtype=torch.bfloat16)
    launches, _ = kaot._lowrank_plan(x, b_w, a_w, None)
    _compile_sm90(launches[0])


# the interpreter results come last: the child started by the compile tests has been running meanwhile
@pytest.mark.parametrize("case_id", list(INTERP_CASES))
def test_interp(interp_child, case_id):
    """Triton kernel (interpreted, CPU) vs the torch reference; fp32/fp16, see INTERP_CASES."""
    res = interp_child.result(case_id)
    if not res["ok"]:
        pytest.fail(f"[interpreter child] {case_id}:\n{res['error']}", pytrace=False)



if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--interp-child":
    _interp_child(sys.argv[2], sys.argv[3:])
