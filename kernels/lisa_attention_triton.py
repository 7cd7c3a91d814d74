"""Triton kernel for one decode step of a LISA shared layer: the only kernel the LisaLlama model calls.

Shipped flat to the Hub next to the remote modeling code (via `lisa_kernels.py`); imports only torch and a
guarded triton, so a CPU-only install without triton still loads the model (which then keeps its torch path).

`lisa_decode_triton` - one decode step (Tq = 1). Fused: align (head mix + bias + FFN across heads) of the previous
layer's score row, low-rank q.k (absent at rank 0), write of this layer's score row (for a following shared layer),
online softmax and x V. Flash-decoding: the key axis is split over programs and a second kernel merges the partial
(max, sum, acc). Grid (B, Hkv, splits): a program reads all H source score rows of its key block (the mix needs
every head at each key) and produces the G = H/Hkv query heads that share its V head, so V is read exactly once and
the S_prev row Hkv times (L2).

Math (S_prev: the previous layer's scaled, unmasked pre-softmax scores):

    S[b,h,j] = sum_g mix[h,g] S_prev[b,g,j] + bias[h] + FFN(S_prev[b,:,j])[h] + <qlr[b,h,:], klr[b,h,j,:]> / sqrt(r)
    FFN(s)   = w2 @ gelu_tanh(w1 @ s + b1)       (F = 0 -> none; r = 0 -> no low-rank term)
    out[b,h] = sum_j softmax_j(S + attn_mask)[b,h,j] V[b, h // (H / Hkv), j]

All accumulation is fp32; bf16/fp16/fp32 inputs (fp32 dots use input_precision="ieee"). Autotuning uses several
configs only on a real CUDA device; otherwise exactly one config (a multi-config autotune needs a driver). Under
TRITON_INTERPRET=1 the kernel runs on CPU tensors. There is no torch fallback here: the model calls this only when
`triton_available(q_lr)`, and uses its own torch path otherwise. The prefill and low-rank-linear kernels, the
backend-dispatching wrappers and the torch references live in the repository's benchmarks/ folder (not shipped).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: triton_available() is False and the model keeps its torch path
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "triton_available", "lisa_decode_triton", "normalize_attn_mask"]

HAS_TRITON = triton is not None
_INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
# several autotune configs only with a real device (autotuning benchmarks on the GPU)
_TUNE = HAS_TRITON and not _INTERPRET and torch.cuda.is_available()
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_available(tensor: torch.Tensor | None = None) -> bool:
    """True when the Triton kernels can run: Triton imported and `tensor`, if given, on CUDA in fp32/fp16/bf16."""
    return HAS_TRITON and (tensor is None or (tensor.is_cuda and tensor.dtype in _DTYPES))


def normalize_attn_mask(attn_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """Returns an additive float mask broadcastable to (B, Tq, Tk) (a view where possible), or None.

    Accepts an additive float mask (B|1, 1, Tq|1, Tk) or (B|1, Tq|1, Tk); a boolean mask of those shapes
    (True = attend); or a 2D (B, Tk) keep-mask (bool or 0/1 integers, HF `attention_mask` style).
    Masked entries of boolean/keep masks become -inf.
    """
    if attn_mask is None:
        return None
    m = attn_mask
    if m.dim() == 2:  # HF-style (B, kv_len) keep mask
        if m.dtype.is_floating_point:
            raise ValueError("a 2D attn_mask must be a 0/1 or boolean keep-mask of shape (B, Tk)")
        m = m[:, None, -kv_len:].bool()
    elif m.dim() == 4:
        if m.shape[1] != 1:
            raise ValueError(f"attn_mask must have a singleton head dim, got {tuple(attn_mask.shape)}")
        m = m[:, 0]
    elif m.dim() != 3:
        raise ValueError(f"attn_mask must be 2D, 3D or 4D, got {tuple(attn_mask.shape)}")
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
    elif not m.dtype.is_floating_point:
        raise ValueError("a 3D/4D attn_mask must be additive (float) or boolean")
    return m.expand(batch, q_len, kv_len)


def _has_lowrank(qlr: torch.Tensor | None) -> bool:
    """A low-rank term exists only at rank r >= 1 (a rank-0 shared layer hands over (..., 0)-sized q/k)."""
    return qlr is not None and qlr.shape[-1] > 0


def _np2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _pad16(x: int) -> int:
    return max(16, _np2(x))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(t: torch.Tensor) -> int:
    if t.is_cuda:
        return _num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 4  # interpreter: only shapes the split heuristics


def _dot_prec(*dtypes: torch.dtype) -> str:
    """"ieee" (no TF32) as soon as one dot operand is fp32; the value is ignored for 16-bit operands."""
    return "ieee" if torch.float32 in dtypes else "tf32"


def _has_ffn(w1: torch.Tensor | None) -> bool:
    return w1 is not None and w1.numel() > 0


class _Launch(NamedTuple):
    kernel: Any  # JITFunction or Autotuner
    grid: Any  # tuple or callable(META)
    args: tuple  # runtime arguments, in kernel order (constexprs excluded)
    constexprs: dict  # constexpr arguments passed by the launcher (autotuned ones excluded)


def _run(launches: list[_Launch]) -> None:
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.constexprs)


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------

if HAS_TRITON:
    _LOG2E = tl.constexpr(1.4426950408889634)

    # decode BLOCK_N is fixed (split lengths are multiples of it); warps/stages are autotuned on CUDA
    _DECODE_BLOCK_N = 64 if _TUNE else 16
    _DECODE_CONFIGS_CUDA = [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)]
    _DECODE_CONFIGS = _DECODE_CONFIGS_CUDA if _TUNE else [triton.Config({}, num_warps=4, num_stages=2)]

    @triton.jit
    def _gelu_tanh(x):
        # 0.5 x (1 + tanh(u)) == x * sigmoid(2u); no tanh in core tl, and this form saturates cleanly
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x / (1.0 + tl.exp(-2.0 * u))

    @triton.jit
    def _align(
        src,
        rows,
        row_mask,
        M,
        C,
        W1,
        B1,
        W2,
        H,
        F,
        H_PAD: tl.constexpr,
        F_PAD: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_FFN: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """src: (H_PAD, P) source scores in the dot dtype, rows >= H zero. Returns (len(rows), P) fp32:
        mix[rows] @ src + bias[rows] + W2[rows] @ gelu(W1 @ src + b1). Weights are contiguous."""
        offs_h = tl.arange(0, H_PAD)
        hmask = offs_h < H
        mix = tl.load(M + rows[:, None] * H + offs_h[None, :], mask=row_mask[:, None] & hmask[None, :], other=0.0)
        out = tl.dot(mix.to(src.dtype), src, input_precision=DOT_PREC)
        if HAS_BIAS:
            out += tl.load(C + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_FFN:
            offs_f = tl.arange(0, F_PAD)
            fmask = offs_f < F
            w1 = tl.load(W1 + offs_f[:, None] * H + offs_h[None, :], mask=fmask[:, None] & hmask[None, :], other=0.0)
            hid = tl.dot(w1.to(src.dtype), src, input_precision=DOT_PREC)
            hid += tl.load(B1 + offs_f, mask=fmask, other=0.0).to(tl.float32)[:, None]
            act = _gelu_tanh(hid)
            w2 = tl.load(W2 + rows[:, None] * F + offs_f[None, :], mask=row_mask[:, None] & fmask[None, :], other=0.0)
            out += tl.dot(w2.to(src.dtype), act.to(src.dtype), input_precision=DOT_PREC)
        return out

    @triton.jit
    def _softmax_v_tile(s, m_i, l_i, acc, vt, DOT_PREC: tl.constexpr):
        """One key tile of the online softmax (FlashAttention-2 style): the rows' running max m_i, sum l_i and output
        acc updated with their scores s (-inf where masked) against the tile's values vt; returns (m_i, l_i, acc)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - m_use) * _LOG2E)
        p = tl.exp2((s - m_use[:, None]) * _LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        return m_new, l_i, acc

    @triton.autotune(configs=_DECODE_CONFIGS, key=["H_PAD", "G_PAD", "F_PAD", "D_PAD", "HAS_FFN", "SPLIT"])
    @triton.jit
    def _lisa_decode_kernel(
        SP, M, C, W1, B1, W2, QLR, KLR, V, MASK, S_OUT, O, O_PART, ML_PART,
        H, G, F, R, D, Tk, split_len, num_splits, lr_scale,
        stride_spb, stride_sph, stride_spn,
        stride_qb, stride_qh, stride_qr,
        stride_kb, stride_kh, stride_kn, stride_kr,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_mb, stride_mn,
        stride_sob, stride_soh, stride_son,
        stride_ob, stride_oh, stride_od,
        H_PAD: tl.constexpr, F_PAD: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_FFN: tl.constexpr, HAS_LR: tl.constexpr, HAS_MASK: tl.constexpr,
        WRITE_S: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)  # int64 batch/head offsets: (B,H,Tq,Tk)-sized tensors pass 2**31
        kvh = tl.program_id(1)
        sid = tl.program_id(2)
        offs_g = tl.arange(0, G_PAD)
        row_mask = offs_g < G
        rows = kvh * G + offs_g  # the query heads sharing V head kvh
        offs_h = tl.arange(0, H_PAD)
        hmask = offs_h < H
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        start = sid * split_len
        end = tl.minimum(start + split_len, Tk)

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        sp_base = SP + b * stride_spb
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            src = tl.load(
                sp_base + offs_h[:, None] * stride_sph + offs_n[None, :] * stride_spn,
                mask=hmask[:, None] & nmask[None, :],
                other=0.0,
            )
            s = _align(src, rows, row_mask, M, C, W1, B1, W2, H, F, H_PAD, F_PAD, HAS_BIAS, HAS_FFN, DOT_PREC)
            if HAS_LR:
                lr = tl.zeros([G_PAD, BLOCK_N], tl.float32)
                for rr in range(0, R):
                    qv = tl.load(QLR + b * stride_qb + rows * stride_qh + rr * stride_qr, mask=row_mask, other=0.0)
                    kv = tl.load(
                        KLR + b * stride_kb + rows[:, None] * stride_kh + offs_n[None, :] * stride_kn + rr * stride_kr,
                        mask=row_mask[:, None] & nmask[None, :],
                        other=0.0,
                    )
                    lr += qv.to(tl.float32)[:, None] * kv.to(tl.float32)
                s += lr * lr_scale
            if WRITE_S:
                tl.store(
                    S_OUT + b * stride_sob + rows[:, None] * stride_soh + offs_n[None, :] * stride_son,
                    s.to(S_OUT.dtype.element_ty),
                    mask=row_mask[:, None] & nmask[None, :],
                )
            if HAS_MASK:
                s += tl.load(MASK + b * stride_mb + offs_n * stride_mn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            s = tl.where(nmask[None, :], s, float("-inf"))
            vt = tl.load(
                V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=nmask[:, None] & dmask[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _softmax_v_tile(s, m_i, l_i, acc, vt, DOT_PREC)

        if SPLIT:
            part = (b * H + rows) * num_splits + sid  # O_PART: (B*H*splits, D_PAD), ML_PART: (B*H*splits, 2)
            tl.store(O_PART + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_mask[:, None])
            tl.store(ML_PART + part * 2, m_i, mask=row_mask)
            tl.store(ML_PART + part * 2 + 1, l_i, mask=row_mask)
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                O + b * stride_ob + rows[:, None] * stride_oh + offs_d[None, :] * stride_od,
                out.to(O.dtype.element_ty),
                mask=row_mask[:, None] & dmask[None, :],
            )

    @triton.jit
    def _lisa_decode_reduce_kernel(
        O_PART, ML_PART, O,
        H, D, num_splits,
        stride_ob, stride_oh, stride_od,
        NS_PAD: tl.constexpr, D_PAD: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H
        h = bh % H
        offs_s = tl.arange(0, NS_PAD)
        smask = offs_s < num_splits
        offs_d = tl.arange(0, D_PAD)
        part = bh * num_splits + offs_s
        m = tl.load(ML_PART + part * 2, mask=smask, other=float("-inf"))
        l = tl.load(ML_PART + part * 2 + 1, mask=smask, other=0.0)
        m_max = tl.max(m, 0)
        m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2((m - m_use) * _LOG2E)
        denom = tl.sum(w * l, 0)
        acc = tl.load(O_PART + part[:, None] * D_PAD + offs_d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(O + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(O.dtype.element_ty), mask=offs_d < D)

# ------------------------------------------------------------------------------------------------
# launch plan (shared by the runner and by the ahead-of-time compile test)
# ------------------------------------------------------------------------------------------------


def _align_weights(mix, bias, w1, b1, w2):
    """Contiguous weights + dummies for the absent ones. Returns (M, C, W1, B1, W2, F, has_bias, has_ffn)."""
    mix = mix.contiguous()
    has_ffn = _has_ffn(w1)
    f = w1.shape[0] if has_ffn else 0
    if has_ffn:
        w1c, w2c = w1.contiguous(), w2.contiguous()
        b1c = b1.contiguous() if b1 is not None else torch.zeros(f, dtype=w1.dtype, device=w1.device)
    else:
        w1c = w2c = b1c = mix
    has_bias = bias is not None
    return mix, (bias.contiguous() if has_bias else mix), w1c, b1c, w2c, f, has_bias, has_ffn


def _check_dtypes(*tensors):
    for t in tensors:
        if t is not None and t.dtype not in _DTYPES:
            raise TypeError(f"unsupported dtype {t.dtype}; expected fp32, fp16 or bf16")


def _decode_plan(s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask, return_scores, num_splits):
    if s_prev.dim() == 4:  # (B, H, 1, Tk) as handed over by the model
        s_prev = s_prev[:, :, -1]
    if qlr is not None and qlr.dim() == 4:
        qlr = qlr[:, :, -1]
    if not _has_lowrank(qlr):  # rank 0 (the lowrank=False ablation): aligned scores only, no 1/sqrt(r)
        qlr = klr = None
    _check_dtypes(s_prev, v, qlr, klr)
    batch, heads, kv_len = s_prev.shape
    kv_heads, head_dim = v.shape[1], v.shape[3]
    if heads % kv_heads or v.shape[2] != kv_len or kv_len < 1:
        raise ValueError(f"bad shapes: s_prev {tuple(s_prev.shape)}, v {tuple(v.shape)}")
    groups = heads // kv_heads
    dev = s_prev.device
    m_, c_, w1_, b1_, w2_, f, has_bias, has_ffn = _align_weights(mix, bias, w1, b1, w2)
    has_lr = qlr is not None
    rank = qlr.shape[-1] if has_lr else 1
    qlr_ = qlr if has_lr else s_prev[:, :, :1]
    klr_ = klr if has_lr else s_prev[:, :, :, None]
    mask = normalize_attn_mask(attn_mask, batch, 1, kv_len)
    mask_ = mask[:, 0] if mask is not None else s_prev[:, 0]
    s_out = torch.empty(batch, heads, kv_len, dtype=s_prev.dtype, device=dev) if return_scores else s_prev
    out = torch.empty(batch, heads, head_dim, dtype=v.dtype, device=dev)

    block_n = _DECODE_BLOCK_N
    n_blocks = _cdiv(kv_len, block_n)
    if num_splits is None:  # enough programs to fill the device twice, each split >= 2 blocks where possible
        num_splits = _cdiv(2 * _sm_count(s_prev), batch * kv_heads)
        num_splits = min(num_splits, max(1, n_blocks // 2), 256)
    num_splits = max(1, min(int(num_splits), n_blocks))
    split_len = _cdiv(n_blocks, num_splits) * block_n
    num_splits = _cdiv(kv_len, split_len)
    split = num_splits > 1
    d_pad = _pad16(head_dim)
    if split:
        o_part = torch.empty(batch * heads * num_splits * d_pad, dtype=torch.float32, device=dev)
        ml_part = torch.empty(batch * heads * num_splits * 2, dtype=torch.float32, device=dev)
    else:
        o_part = ml_part = out
    args = (
        s_prev, m_, c_, w1_, b1_, w2_, qlr_, klr_, v, mask_, s_out, out, o_part, ml_part,
        heads, groups, f, rank, head_dim, kv_len, split_len, num_splits, 1.0 / math.sqrt(rank),
        s_prev.stride(0), s_prev.stride(1), s_prev.stride(2),
        qlr_.stride(0), qlr_.stride(1), qlr_.stride(2),
        klr_.stride(0), klr_.stride(1), klr_.stride(2), klr_.stride(3),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        mask_.stride(0) if mask is not None else 0, mask_.stride(1) if mask is not None else 0,
        s_out.stride(0), s_out.stride(1), s_out.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
    )  # fmt: skip
    constexprs = dict(
        H_PAD=_pad16(heads), F_PAD=_pad16(f), G_PAD=_pad16(groups), D_PAD=d_pad, BLOCK_N=block_n,
        HAS_BIAS=has_bias, HAS_FFN=has_ffn, HAS_LR=has_lr, HAS_MASK=mask is not None,
        WRITE_S=bool(return_scores), SPLIT=split, DOT_PREC=_dot_prec(s_prev.dtype, v.dtype),
    )  # fmt: skip
    launches = [_Launch(_lisa_decode_kernel, (batch, kv_heads, num_splits), args, constexprs)]
    if split:
        launches.append(
            _Launch(
                _lisa_decode_reduce_kernel,
                (batch * heads,),
                (o_part, ml_part, out, heads, head_dim, num_splits, out.stride(0), out.stride(1), out.stride(2)),
                dict(NS_PAD=_np2(num_splits), D_PAD=d_pad, num_warps=4),
            )
        )
    return launches, out, (s_out if return_scores else None)


# ------------------------------------------------------------------------------------------------
# runner (any device under TRITON_INTERPRET=1, else CUDA)
# ------------------------------------------------------------------------------------------------


def _need_triton():
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")


def lisa_decode_triton(
    s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask=None, *, return_scores=True, num_splits=None
):
    """One decode step of a shared layer, on Triton (CUDA tensors; any device under TRITON_INTERPRET=1).

    s_prev (B,H,Tk) or (B,H,1,Tk); mix (H,H); bias (H,)|None; w1 (F,H)|None, b1 (F,)|None, w2 (H,F)|None;
    qlr (B,H,r) or (B,H,1,r) |None; klr (B,H,Tk,r)|None (r = 0 or None: no low-rank term); v (B,Hkv,Tk,D);
    attn_mask additive/bool broadcastable to (B,1,1,Tk) or a (B,Tk) keep-mask.
    Returns (out (B,H,D) in v.dtype, S (B,H,Tk) in s_prev.dtype or None if not return_scores).
    """
    _need_triton()
    launches, out, scores = _decode_plan(s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask, return_scores, num_splits)
    _run(launches)
    return out, scores
