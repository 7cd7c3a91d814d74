"""LISA prefill and fused low-rank-linear Triton kernels, and the backend-dispatching wrappers of all three ops.

Research code, not in the wheel nor shipped with converted models: the model calls only the decode kernel
(kernels/lisa_kernels.py -> kernels/lisa_attention_triton.py). These are kept for the benchmarks
(benchmarks/kernel_speed.py) and the kernel tests (tests/test_kernels.py). Load this file as one package spanning
kernels/, modeling/ and research/ (flat relative imports, as on the Hub; see `load_kernels` in
benchmarks/kernel_speed.py): it reuses the decode file's helpers and Triton building blocks, and its torch path is the
shipped reference, modeling/lisa_reference.py.

Ops (math in modeling/lisa_reference.py, dense Align); every public op dispatches to Triton when its tensors are on
CUDA and Triton is importable, otherwise to its torch path (`backend="auto"|"triton"|"torch"`): `lisa_decode_torch`,
`lisa_prefill_torch` (the reference in float32; a row with no visible key gives 0) and `lowrank_linear_torch`:

* `lisa_decode`   - the decode kernel of kernels/lisa_attention_triton.py (`lisa_decode_triton`) behind the
  dispatch, with the torch path as fallback.
* `lisa_prefill`  - causal prefill, FlashAttention-2 style online softmax over key tiles, GQA.
    - materialised path (`s_prev` given, or the FFN is present, or `return_scores=True`):
      `_lisa_scores_kernel` builds S tile-wise with all heads per tile (mix and FFN as tensor-core dots
      over the head axis) and writes it (B,H,Tq,Tk); then `_lisa_prefill_kernel` reads S tiles.
      With `causal_skip=True` (default) tiles entirely above the causal diagonal are not computed and
      S is 0 there (masked out by every consumer); `causal_skip=False` returns the full unmasked S.
    - fast path (previous layer is normal attention: `q_prev`/`k_prev` given, no FFN, and
      `return_scores=False`): `_lisa_prefill_kernel` recomputes the mixed scores tile-wise as
      sum_kv (sum_{g in kv} mix[h,g] scale q_g) k_kv^T + qlr_h klr_h^T / sqrt(r) + bias_h, so no
      N x N tensor ever reaches global memory. S cannot be returned on this path, so use it only when
      the next layer is not shared. Programs are per (batch, output head, query block), as in FA2 (an
      all-heads program would need H x BLOCK_M x D accumulators); the price is that each one recomputes
      the mixed scores from all source heads: Hkv QK^T-sized dots per tile (8 for Llama-3-8B, 32 for
      Llama-2-7B), i.e. ~(Hkv + 1) / 2 x the FLOPs of plain attention. The materialised path instead
      pays O(B H Tq Tk) HBM traffic; which one is faster depends on the shape (benchmarks/kernel_speed.py).
* `lowrank_linear` - y = (x @ B_w^T) @ A_w^T + bias for small M (decode, M <= 16): the rank-sized
  intermediate stays in registers; grid over (rank blocks, K splits) with fp32 atomics into y (so the
  result is not bitwise deterministic). Prefill-sized inputs use the two torch GEMMs.
* `fused_lisa_prefill` - the prefill counterpart of kernels/lisa_kernels.py `fused_lisa_decode` (module layout).

All accumulation is fp32; bf16/fp16/fp32 inputs (fp32 dots use input_precision="ieee"). Autotuning uses several
configs only on a real CUDA device; otherwise exactly one config per kernel. Under TRITON_INTERPRET=1 the kernels
run on CPU tensors when called with backend="triton". A rank-0 low-rank term (q/k of last dim 0) is no term.
"""

from __future__ import annotations

import math

import torch

from .lisa_attention_triton import (  # noqa: F401 - decode names re-exported for kernel_speed.py and the tests
    _DTYPES,
    _INTERPRET,
    _TUNE,
    HAS_TRITON,
    _align_weights,
    _cdiv,
    _check_dtypes,
    _decode_plan,
    _dot_prec,
    _has_ffn,
    _has_lowrank,
    _Launch,
    _need_triton,
    _np2,
    _pad16,
    _run,
    _sm_count,
    lisa_decode_triton,
    normalize_attn_mask,
    tl,
    triton,
    triton_available,
)
from .lisa_kernels import _module_align_weights, fused_lisa_decode  # noqa: F401 - re-exported
from .lisa_reference import shared_attention_reference

__all__ = [
    "HAS_TRITON",
    "triton_available",
    "lisa_decode",
    "lisa_prefill",
    "lowrank_linear",
    "lisa_decode_triton",
    "lisa_prefill_triton",
    "lowrank_linear_triton",
    "fused_lisa_decode",
    "fused_lisa_prefill",
]

# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------

if HAS_TRITON:
    # globals of the kernels below (Triton resolves them here); the online-softmax step is the decode kernel's
    from .lisa_attention_triton import _align, _softmax_v_tile

    # block sizes (autotuned on CUDA)
    _SCORES_CONFIGS_CUDA = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=2)
        for (bm, bn, w) in ((1, 128, 4), (1, 128, 8), (2, 64, 4), (2, 64, 8), (2, 128, 8), (4, 64, 8))
    ]  # P = BLOCK_M * BLOCK_N = 256 with 4 warps spills at H = 32 (ptxas, sm_90)
    _SCORES_CONFIGS = (
        _SCORES_CONFIGS_CUDA if _TUNE else [triton.Config({"BLOCK_M": 2, "BLOCK_N": 16}, num_warps=4, num_stages=2)]
    )

    _PREFILL_CONFIGS_CUDA = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for (bm, bn, w, s) in (
            (128, 64, 8, 3),
            (128, 32, 8, 3),
            (64, 64, 4, 3),
            (64, 32, 4, 4),
            (64, 64, 8, 2),
        )
    ]
    _PREFILL_CONFIGS = (
        _PREFILL_CONFIGS_CUDA if _TUNE else [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=2)]
    )

    @triton.autotune(configs=_SCORES_CONFIGS, key=["tune_q", "tune_k", "H_PAD", "F_PAD", "HAS_FFN"])
    @triton.jit
    def _lisa_scores_kernel(
        SP, M, C, W1, B1, W2, QLR, KLR, S_OUT,
        H, F, R, Tq, Tk, lr_scale, tune_q, tune_k,
        stride_spb, stride_sph, stride_spm, stride_spn,
        stride_qb, stride_qh, stride_qm, stride_qr,
        stride_kb, stride_kh, stride_kn, stride_kr,
        stride_sob, stride_soh, stride_som, stride_son,
        H_PAD: tl.constexpr, F_PAD: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_FFN: tl.constexpr, HAS_LR: tl.constexpr,
        CAUSAL_SKIP: tl.constexpr, DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # one program: all H heads of a BLOCK_M x BLOCK_N (query, key) tile, flattened to P positions so the
        # head mix / FFN are (H x H) @ (H x P) dots
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_p = tl.arange(0, BLOCK_M * BLOCK_N)
        offs_i = pid_m * BLOCK_M + offs_p // BLOCK_N
        offs_j = pid_n * BLOCK_N + offs_p % BLOCK_N
        pmask = (offs_i < Tq) & (offs_j < Tk)
        offs_h = tl.arange(0, H_PAD)
        hmask = offs_h < H
        offs_h64 = offs_h.to(tl.int64)  # h * Tq * Tk can pass 2**31
        omask = hmask[:, None] & pmask[None, :]
        out_ptrs = (
            S_OUT + b * stride_sob + offs_h64[:, None] * stride_soh + offs_i[None, :] * stride_som
            + offs_j[None, :] * stride_son
        )  # fmt: skip
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, Tq - 1)
        if CAUSAL_SKIP:
            compute = pid_n * BLOCK_N <= Tk - Tq + last_row
        else:
            compute = pid_n * BLOCK_N >= 0
        if compute:
            src = tl.load(
                SP + b * stride_spb + offs_h64[:, None] * stride_sph + offs_i[None, :] * stride_spm
                + offs_j[None, :] * stride_spn,
                mask=omask,
                other=0.0,
            )  # fmt: skip
            s = _align(src, offs_h, hmask, M, C, W1, B1, W2, H, F, H_PAD, F_PAD, HAS_BIAS, HAS_FFN, DOT_PREC)
            if HAS_LR:
                lr = tl.zeros([H_PAD, BLOCK_M * BLOCK_N], tl.float32)
                for rr in range(0, R):
                    qv = tl.load(
                        QLR + b * stride_qb + offs_h[:, None] * stride_qh + offs_i[None, :] * stride_qm + rr * stride_qr,
                        mask=omask,
                        other=0.0,
                    )
                    kv = tl.load(
                        KLR + b * stride_kb + offs_h[:, None] * stride_kh + offs_j[None, :] * stride_kn + rr * stride_kr,
                        mask=omask,
                        other=0.0,
                    )
                    lr += qv.to(tl.float32) * kv.to(tl.float32)
                s += lr * lr_scale
            tl.store(out_ptrs, s.to(S_OUT.dtype.element_ty), mask=omask)
        else:  # entirely above the causal diagonal: never attended to, write zeros instead of computing
            tl.store(out_ptrs, tl.zeros([H_PAD, BLOCK_M * BLOCK_N], S_OUT.dtype.element_ty), mask=omask)

    @triton.autotune(configs=_PREFILL_CONFIGS, key=["tune_q", "tune_k", "H", "G", "D_PAD", "FROM_QK"])
    @triton.jit
    def _lisa_prefill_kernel(
        S, QP, KP, M, C, QLR, KLR, V, MASK, O,
        H, G, Tq, Tk, D, DP, R, lr_scale, prev_scale, tune_q, tune_k,
        stride_sb, stride_sh, stride_sm, stride_sn,
        stride_qpb, stride_qph, stride_qpm, stride_qpd,
        stride_kpb, stride_kph, stride_kpn, stride_kpd,
        stride_qb, stride_qh, stride_qm, stride_qr,
        stride_kb, stride_kh, stride_kn, stride_kr,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_mb, stride_mm, stride_mn,
        stride_ob, stride_oh, stride_om, stride_od,
        FROM_QK: tl.constexpr, GROUP_ONE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LR: tl.constexpr, HAS_MASK: tl.constexpr,
        D_PAD: tl.constexpr, DP_PAD: tl.constexpr, R_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)  # int64: h * Tq * Tk of a materialised S can pass 2**31
        b = bh // H
        h = bh % H
        kvh = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < Tq
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        past = Tk - Tq
        hi = tl.minimum(Tk, past + (pid_m + 1) * BLOCK_M)  # causal: no key beyond the block's last query

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

        if FROM_QK:
            offs_dp = tl.arange(0, DP_PAD)
            dpmask = offs_dp < DP
            if HAS_LR:
                offs_r = tl.arange(0, R_PAD)
                rmask = offs_r < R
                qlr = tl.load(
                    QLR + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_r[None, :] * stride_qr,
                    mask=mmask[:, None] & rmask[None, :],
                    other=0.0,
                )
                qlr = (qlr.to(tl.float32) * lr_scale).to(QLR.dtype.element_ty)
            if HAS_BIAS:
                c_h = tl.load(C + h).to(tl.float32)

        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < Tk
            if FROM_QK:
                # mixed scores without S_prev: sum_kv (sum_{g in kv} mix[h, g] scale q_g) @ k_kv^T
                s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for kv in range(0, H // G):
                    kt = tl.load(
                        KP + b * stride_kpb + kv * stride_kph + offs_n[None, :] * stride_kpn
                        + offs_dp[:, None] * stride_kpd,
                        mask=nmask[None, :] & dpmask[:, None],
                        other=0.0,
                    )  # fmt: skip
                    if GROUP_ONE:  # MHA: scale the (BM, BN) product, cheaper than scaling the (BM, D) query
                        w = tl.load(M + h * H + kv).to(tl.float32) * prev_scale
                        qg = tl.load(
                            QP + b * stride_qpb + kv * stride_qph + offs_m[:, None] * stride_qpm
                            + offs_dp[None, :] * stride_qpd,
                            mask=mmask[:, None] & dpmask[None, :],
                            other=0.0,
                        )  # fmt: skip
                        s += w * tl.dot(qg, kt, input_precision=DOT_PREC)
                    else:  # GQA: fold the group's queries first, one dot per KV head
                        qt = tl.zeros([BLOCK_M, DP_PAD], tl.float32)
                        for gg in range(0, G):
                            g = kv * G + gg
                            w = tl.load(M + h * H + g).to(tl.float32) * prev_scale
                            qg = tl.load(
                                QP + b * stride_qpb + g * stride_qph + offs_m[:, None] * stride_qpm
                                + offs_dp[None, :] * stride_qpd,
                                mask=mmask[:, None] & dpmask[None, :],
                                other=0.0,
                            )  # fmt: skip
                            qt += w * qg.to(tl.float32)
                        s = tl.dot(qt.to(kt.dtype), kt, s, input_precision=DOT_PREC)
                if HAS_LR:
                    klr = tl.load(
                        KLR + b * stride_kb + h * stride_kh + offs_n[None, :] * stride_kn + offs_r[:, None] * stride_kr,
                        mask=nmask[None, :] & rmask[:, None],
                        other=0.0,
                    )
                    s = tl.dot(qlr, klr, s, input_precision=DOT_PREC)
                if HAS_BIAS:
                    s += c_h
            else:
                s = tl.load(
                    S + b * stride_sb + h * stride_sh + offs_m[:, None] * stride_sm + offs_n[None, :] * stride_sn,
                    mask=mmask[:, None] & nmask[None, :],
                    other=0.0,
                ).to(tl.float32)
            if HAS_MASK:
                s += tl.load(
                    MASK + b * stride_mb + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn,
                    mask=mmask[:, None] & nmask[None, :],
                    other=0.0,
                ).to(tl.float32)
            keep = (offs_n[None, :] <= past + offs_m[:, None]) & nmask[None, :]
            s = tl.where(keep, s, float("-inf"))
            vt = tl.load(
                V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=nmask[:, None] & dmask[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _softmax_v_tile(s, m_i, l_i, acc, vt, DOT_PREC)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
            out.to(O.dtype.element_ty),
            mask=mmask[:, None] & dmask[None, :],
        )

    @triton.jit
    def _lowrank_linear_kernel(
        X, BW, AW, Y,
        M, K, R, N, k_per_split,
        stride_xm, stride_xk, stride_br, stride_bk, stride_an, stride_ar, stride_ym, stride_yn,
        DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # program (rank block, K split): t = x[:, ks] @ B_w[rb, ks]^T stays in registers, then
        # y += t @ A_w[:, rb]^T (exact by linearity in t) with fp32 atomics; y starts as the bias (or 0)
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        mmask = offs_m < M
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        t = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < k_end
            xt = tl.load(
                X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=mmask[:, None] & kmask[None, :],
                other=0.0,
            )
            bt = tl.load(
                BW + offs_r[None, :] * stride_br + offs_k[:, None] * stride_bk,
                mask=rmask[None, :] & kmask[:, None],
                other=0.0,
            )
            t = tl.dot(xt, bt, t, input_precision=DOT_PREC)
        t_in = t.to(AW.dtype.element_ty)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < N
            at = tl.load(
                AW + offs_n[None, :] * stride_an + offs_r[:, None] * stride_ar,
                mask=nmask[None, :] & rmask[:, None],
                other=0.0,
            )
            y = tl.dot(t_in, at, input_precision=DOT_PREC)
            tl.atomic_add(
                Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, y, mask=mmask[:, None] & nmask[None, :]
            )


# ------------------------------------------------------------------------------------------------
# launch plans (shared by the runners and by the ahead-of-time compile test)
# ------------------------------------------------------------------------------------------------


def _scores_plan(s_prev, mix, bias, w1, b1, w2, qlr, klr, causal_skip):
    batch, heads, q_len, kv_len = s_prev.shape
    m_, c_, w1_, b1_, w2_, f, has_bias, has_ffn = _align_weights(mix, bias, w1, b1, w2)
    has_lr = qlr is not None
    rank = qlr.shape[-1] if has_lr else 1
    qlr_ = qlr if has_lr else s_prev[:, :, :, :1]
    klr_ = klr if has_lr else s_prev[:, :, :1, :].transpose(2, 3)
    s_out = torch.empty(batch, heads, q_len, kv_len, dtype=s_prev.dtype, device=s_prev.device)
    args = (
        s_prev, m_, c_, w1_, b1_, w2_, qlr_, klr_, s_out,
        heads, f, rank, q_len, kv_len, 1.0 / math.sqrt(rank), _np2(q_len), _np2(kv_len),
        *s_prev.stride(), *qlr_.stride(), *klr_.stride(), *s_out.stride(),
    )  # fmt: skip
    constexprs = dict(
        H_PAD=_pad16(heads), F_PAD=_pad16(f), HAS_BIAS=has_bias, HAS_FFN=has_ffn, HAS_LR=has_lr,
        CAUSAL_SKIP=bool(causal_skip), DOT_PREC=_dot_prec(s_prev.dtype),
    )  # fmt: skip

    def grid(meta):
        return (_cdiv(q_len, meta["BLOCK_M"]), _cdiv(kv_len, meta["BLOCK_N"]), batch)

    return _Launch(_lisa_scores_kernel, grid, args, constexprs), s_out


def _prefill_attn_launch(scores, q_prev, k_prev, prev_scale, mix, bias, qlr, klr, v, mask, out):
    """`_lisa_prefill_kernel` launch; scores given -> read S tiles, else recompute from q_prev/k_prev."""
    batch, heads, q_len, head_dim = out.shape
    kv_len, kv_heads = v.shape[2], v.shape[1]
    from_qk = scores is None
    dummy = v
    if from_qk:
        qp, kp = q_prev, k_prev
        dp = q_prev.shape[-1]
        s_ = dummy
        s_strides = (0, 0, 0, 0)
    else:
        qp = kp = dummy
        dp = 1
        s_ = scores
        s_strides = scores.stride()
    has_lr = from_qk and qlr is not None
    has_bias = from_qk and bias is not None
    rank = qlr.shape[-1] if qlr is not None else 1
    qlr_ = qlr if has_lr else dummy
    klr_ = klr if has_lr else dummy
    m_ = mix.contiguous() if from_qk else dummy
    c_ = bias.contiguous() if has_bias else m_
    mask_ = mask if mask is not None else dummy
    args = (
        s_, qp, kp, m_, c_, qlr_, klr_, v, mask_, out,
        heads, heads // kv_heads, q_len, kv_len, head_dim, dp, rank, 1.0 / math.sqrt(rank),
        float(prev_scale), _np2(q_len), _np2(kv_len),
        *s_strides,
        *(qp.stride() if from_qk else (0, 0, 0, 0)),
        *(kp.stride() if from_qk else (0, 0, 0, 0)),
        *(qlr_.stride() if has_lr else (0, 0, 0, 0)),
        *(klr_.stride() if has_lr else (0, 0, 0, 0)),
        *v.stride(),
        *(mask.stride() if mask is not None else (0, 0, 0)),
        *out.stride(),
    )  # fmt: skip
    constexprs = dict(
        FROM_QK=from_qk, GROUP_ONE=heads == kv_heads, HAS_BIAS=has_bias, HAS_LR=has_lr, HAS_MASK=mask is not None,
        D_PAD=_pad16(head_dim), DP_PAD=_pad16(dp), R_PAD=_pad16(rank),
        DOT_PREC=_dot_prec(v.dtype, qp.dtype if from_qk else v.dtype, qlr_.dtype if has_lr else v.dtype),
    )  # fmt: skip

    def grid(meta):
        return (_cdiv(q_len, meta["BLOCK_M"]), batch * heads)

    return _Launch(_lisa_prefill_kernel, grid, args, constexprs)


def _prefill_plan(
    s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask, q_prev, k_prev, prev_scale, return_scores, causal_skip
):
    if not _has_lowrank(qlr):  # rank 0: aligned scores only, no 1/sqrt(r)
        qlr = klr = None
    _check_dtypes(s_prev, q_prev, k_prev, v, qlr, klr)
    batch, kv_heads, kv_len, head_dim = v.shape
    if s_prev is None:
        if q_prev is None or k_prev is None:
            raise ValueError("give s_prev, or q_prev and k_prev")
        heads, q_len = q_prev.shape[1], q_prev.shape[2]
        prev_scale = q_prev.shape[-1] ** -0.5 if prev_scale is None else prev_scale
    else:
        heads, q_len = s_prev.shape[1], s_prev.shape[2]
        prev_scale = 1.0
    if heads % kv_heads or q_len > kv_len:
        raise ValueError(f"bad shapes: H={heads}, Hkv={kv_heads}, Tq={q_len}, Tk={kv_len}")
    if s_prev is None and (k_prev.shape[1] != kv_heads or k_prev.shape[2] != kv_len):
        raise ValueError(f"k_prev {tuple(k_prev.shape)} must have v's KV heads and length {tuple(v.shape)}")
    mask = normalize_attn_mask(attn_mask, batch, q_len, kv_len)
    out = torch.empty(batch, heads, q_len, head_dim, dtype=v.dtype, device=v.device)
    launches = []
    if s_prev is None and (return_scores or _has_ffn(w1)):
        # S must exist (returned, or the FFN needs every source head at each position): materialise S_prev
        groups = heads // kv_heads
        q = q_prev.reshape(batch, kv_heads, groups * q_len, q_prev.shape[-1])
        s_prev = (torch.matmul(q, k_prev.transpose(-1, -2)) * prev_scale).view(batch, heads, q_len, kv_len)
    if s_prev is not None:
        scores_launch, scores = _scores_plan(s_prev, mix, bias, w1, b1, w2, qlr, klr, causal_skip)
        launches.append(scores_launch)
        launches.append(_prefill_attn_launch(scores, None, None, 1.0, mix, bias, qlr, klr, v, mask, out))
        return launches, out, (scores if return_scores else None)
    launches.append(_prefill_attn_launch(None, q_prev, k_prev, prev_scale, mix, bias, qlr, klr, v, mask, out))
    return launches, out, None


def _lowrank_plan(x, b_w, a_w, bias, block_r=None, split_k=None):
    _check_dtypes(x, b_w, a_w, bias)
    in_features = x.shape[-1]
    rank, out_features = b_w.shape[0], a_w.shape[0]
    x2 = x.reshape(-1, in_features)
    rows = x2.shape[0]
    if rows > 16:
        raise ValueError("lowrank_linear_triton is for at most 16 rows (decode); use the torch GEMMs")
    b_w = b_w.to(x.dtype)
    a_w = a_w.to(x.dtype)
    if bias is not None:  # the fp32 accumulator starts as the bias: no bias logic in the kernel
        y = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
        y.copy_(bias.expand(rows, out_features))  # a copy: never accumulate into the caller's bias
    else:
        y = torch.zeros(rows, out_features, dtype=torch.float32, device=x.device)
    block_k = 64 if _TUNE else 32
    block_r = block_r or (32 if rank >= 32 else 16)
    block_n = 128 if _TUNE else 32
    n_r = _cdiv(rank, block_r)
    k_blocks = _cdiv(in_features, block_k)
    if split_k is None:  # ~one wave of programs; every split re-reads A_w[:, rb] (from L2)
        split_k = _cdiv(_sm_count(x), n_r)
    split_k = max(1, min(int(split_k), k_blocks))
    k_per_split = _cdiv(k_blocks, split_k) * block_k
    split_k = _cdiv(in_features, k_per_split)
    args = (
        x2, b_w, a_w, y, rows, in_features, rank, out_features, k_per_split,
        x2.stride(0), x2.stride(1), b_w.stride(0), b_w.stride(1), a_w.stride(0), a_w.stride(1),
        y.stride(0), y.stride(1),
    )  # fmt: skip
    constexprs = dict(
        DOT_PREC=_dot_prec(x.dtype),
        BLOCK_M=16, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return [_Launch(_lowrank_linear_kernel, (n_r, split_k), args, constexprs)], y


# ------------------------------------------------------------------------------------------------
# Triton runners (any device under TRITON_INTERPRET=1, else CUDA)
# ------------------------------------------------------------------------------------------------


def lisa_prefill_triton(
    s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask=None, *,
    q_prev=None, k_prev=None, prev_scale=None, return_scores=False, causal_skip=True,
):  # fmt: skip
    _need_triton()
    launches, out, scores = _prefill_plan(
        s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask, q_prev, k_prev, prev_scale, return_scores, causal_skip
    )
    _run(launches)
    return out, scores


def lowrank_linear_triton(x, b_w, a_w, bias=None, *, block_r=None, split_k=None):
    _need_triton()
    launches, y = _lowrank_plan(x, b_w, a_w, bias, block_r, split_k)
    _run(launches)
    return y.to(x.dtype).reshape(*x.shape[:-1], a_w.shape[0])


# ------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------


def _reference_attention(
    s_prev: torch.Tensor, mix: torch.Tensor, bias: torch.Tensor | None, w1: torch.Tensor | None,
    b1: torch.Tensor | None, w2: torch.Tensor | None, qlr: torch.Tensor | None, klr: torch.Tensor | None,
    v: torch.Tensor, attn_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The shipped reference (dense Align) in float32 with the kernels' conventions: a causal mask plus `attn_mask`, no
    low-rank term for qlr None or of width 0, a row with no visible key gives 0. s_prev (B,H,Tq,Tk) -> (out in
    v.dtype, S in s_prev.dtype)."""
    batch, heads, q_len, kv_len = s_prev.shape
    mask = torch.full((q_len, kv_len), float("-inf"), device=s_prev.device).triu(kv_len - q_len + 1)
    extra = normalize_attn_mask(attn_mask, batch, q_len, kv_len)
    if extra is not None:
        mask = mask + extra.float()[:, None]
    if qlr is None:
        qlr, klr = s_prev.new_zeros(batch, heads, q_len, 0), s_prev.new_zeros(batch, heads, kv_len, 0)

    def f32(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.float()

    out, scores = shared_attention_reference(
        s_prev.float(), qlr.float(), klr.float(), v.float(), mix=mix.float(),
        bias=mix.new_zeros(heads, dtype=torch.float32) if bias is None else bias.float(),
        ffn_in_weight=f32(w1) if _has_ffn(w1) else None, ffn_in_bias=f32(b1), ffn_out_weight=f32(w2), mask=mask,
    )  # fmt: skip
    return out.nan_to_num(nan=0.0).to(v.dtype), scores.to(s_prev.dtype)


def lisa_prefill_torch(
    s_prev: torch.Tensor | None, mix: torch.Tensor, bias: torch.Tensor | None, w1: torch.Tensor | None,
    b1: torch.Tensor | None, w2: torch.Tensor | None, qlr: torch.Tensor | None, klr: torch.Tensor | None,
    v: torch.Tensor, attn_mask: torch.Tensor | None = None, *, q_prev: torch.Tensor | None = None,
    k_prev: torch.Tensor | None = None, prev_scale: float | None = None, return_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """`lisa_prefill`'s torch path (`_reference_attention`); S_prev = prev_scale q_prev k_prev^T where s_prev is None."""
    if s_prev is None:
        heads, kv_heads = q_prev.shape[1], k_prev.shape[1]
        scale = q_prev.shape[-1] ** -0.5 if prev_scale is None else prev_scale
        keys = k_prev.float().repeat_interleave(heads // kv_heads, dim=1)
        s_prev = (q_prev.float() @ keys.transpose(-1, -2) * scale).to(q_prev.dtype)
    out, scores = _reference_attention(s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask)
    return out, (scores if return_scores else None)


def lisa_decode_torch(
    s_prev: torch.Tensor, mix: torch.Tensor, bias: torch.Tensor | None, w1: torch.Tensor | None,
    b1: torch.Tensor | None, w2: torch.Tensor | None, qlr: torch.Tensor | None, klr: torch.Tensor | None,
    v: torch.Tensor, attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`lisa_decode`'s torch path: one query row, s_prev (B,H,Tk), qlr (B,H,r) -> (out (B,H,D), S (B,H,Tk))."""
    out, scores = _reference_attention(
        s_prev[:, :, None], mix, bias, w1, b1, w2, None if qlr is None else qlr[:, :, None], klr, v, attn_mask
    )
    return out[:, :, 0], scores[:, :, 0]


def lowrank_linear_torch(
    x: torch.Tensor, b_w: torch.Tensor, a_w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`lowrank_linear`'s torch path: two GEMMs."""
    return torch.nn.functional.linear(torch.nn.functional.linear(x, b_w), a_w, bias)


def _use_triton(backend: str, *tensors) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        _need_triton()
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    present = [t for t in tensors if t is not None]
    return HAS_TRITON and all(t.is_cuda and t.dtype in _DTYPES for t in present)


def lisa_decode(
    s_prev: torch.Tensor,
    mix: torch.Tensor,
    bias: torch.Tensor | None,
    w1: torch.Tensor | None,
    b1: torch.Tensor | None,
    w2: torch.Tensor | None,
    qlr: torch.Tensor | None,
    klr: torch.Tensor | None,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    return_scores: bool = True,
    num_splits: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step of a shared layer.

    s_prev (B,H,Tk) or (B,H,1,Tk); mix (H,H); bias (H,)|None; w1 (F,H)|None, b1 (F,)|None, w2 (H,F)|None;
    qlr (B,H,r) or (B,H,1,r) |None; klr (B,H,Tk,r)|None; v (B,Hkv,Tk,D); attn_mask additive/bool
    broadcastable to (B,1,1,Tk) or a (B,Tk) keep-mask.
    Returns (out (B,H,D) in v.dtype, S (B,H,Tk) in s_prev.dtype or None if not return_scores).
    """
    if _use_triton(backend, s_prev, v, qlr, klr):
        return lisa_decode_triton(
            s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask, return_scores=return_scores, num_splits=num_splits
        )
    if s_prev.dim() == 4:
        s_prev = s_prev[:, :, -1]
    if qlr is not None and qlr.dim() == 4:
        qlr = qlr[:, :, -1]
    out, scores = lisa_decode_torch(s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask)
    return out, (scores if return_scores else None)


def lisa_prefill(
    s_prev: torch.Tensor | None,
    mix: torch.Tensor,
    bias: torch.Tensor | None,
    w1: torch.Tensor | None,
    b1: torch.Tensor | None,
    w2: torch.Tensor | None,
    qlr: torch.Tensor | None,
    klr: torch.Tensor | None,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    q_prev: torch.Tensor | None = None,
    k_prev: torch.Tensor | None = None,
    prev_scale: float | None = None,
    return_scores: bool = False,
    causal_skip: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal prefill of a shared layer (query i at absolute position Tk - Tq + i).

    Either s_prev (B,H,Tq,Tk) (materialised previous scores), or s_prev=None with q_prev (B,H,Tq,Dp) and
    k_prev (B,Hkv,Tk,Dp) of a normal previous layer (S_prev = prev_scale * q_prev k_prev^T, default
    prev_scale = Dp**-0.5). qlr (B,H,Tq,r), klr (B,H,Tk,r), v (B,Hkv,Tk,D), attn_mask additive/bool
    broadcastable to (B,1,Tq,Tk) or a (B,Tk) keep-mask.
    Returns (out (B,H,Tq,D) in v.dtype, S (B,H,Tq,Tk) or None). The fused no-N x N path is taken when
    s_prev is None, there is no FFN and return_scores=False. With causal_skip (Triton only) S is 0 above
    the causal diagonal instead of the unmasked value.
    """
    if _use_triton(backend, s_prev, q_prev, k_prev, v, qlr, klr):
        return lisa_prefill_triton(
            s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask,
            q_prev=q_prev, k_prev=k_prev, prev_scale=prev_scale, return_scores=return_scores, causal_skip=causal_skip,
        )  # fmt: skip
    return lisa_prefill_torch(
        s_prev, mix, bias, w1, b1, w2, qlr, klr, v, attn_mask,
        q_prev=q_prev, k_prev=k_prev, prev_scale=prev_scale, return_scores=return_scores,
    )  # fmt: skip


def lowrank_linear(
    x: torch.Tensor,
    b_w: torch.Tensor,
    a_w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """y = (x @ b_w^T) @ a_w^T + bias; b_w (rank, in), a_w (out, rank). Triton only for <= 16 rows."""
    rows = x.numel() // max(1, x.shape[-1])
    if backend != "torch" and rows <= 16 and _use_triton(backend, x, b_w, a_w):
        return lowrank_linear_triton(x, b_w, a_w, bias)
    return lowrank_linear_torch(x, b_w, a_w, bias)


def fused_lisa_prefill(
    module, prev_scores: torch.Tensor, q_lr: torch.Tensor, k_lr: torch.Tensor, value: torch.Tensor,
    additive_mask: torch.Tensor | None, return_scores: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Prefill from materialised previous scores (B,H,Tq,Tk) -> (attn_output (B,Tq,H,D), scores or None).
    Scores above the causal diagonal come back as 0 (never attended to)."""
    out, scores = lisa_prefill(
        prev_scores, *_module_align_weights(module), q_lr, k_lr, value, additive_mask, return_scores=return_scores
    )
    return out.transpose(1, 2), scores
