"""Benchmarks for the LISA kernels, bf16, one run, side by side: the decode kernel the model ships with
(kernels/lisa_attention_triton.py) and the research prefill / low-rank kernels (research/lisa_prefill_triton.py).

    python benchmarks/kernel_speed.py               # full set (CUDA)
    python benchmarks/kernel_speed.py --quick       # one shape per table
    python benchmarks/kernel_speed.py --only decode

On CUDA it prints, per shape, medians measured in the same process:
  * prefill: fused LISA prefill vs torch SDPA (causal, same B/H/Hkv/T/D): time ratio and TFLOP/s
    (TFLOP/s use the plain-attention FLOP count 4*B*H*T^2*D/2 for both, so the numbers compare like for like;
    the fast path really does ~(Hkv+1)/2 x that work for the score recompute), plus the eager torch reference;
    both paths: fast (previous layer = normal attention, no FFN, no S out) and materialised (S_prev given,
    FFN, S returned for a following shared layer);
  * decode at 8k context: achieved GB/s of the fused decode kernel vs the device peak (H200: 4.8 TB/s),
    next to SDPA decode (a normal layer reading K and V) and the eager reference;
  * lowrank_linear vs two torch GEMMs (and the dense GEMM it replaces), with event timing and CUDA-graph timing.
Every fused result is also checked against the torch path, the shipped reference modeling/lisa_reference.py
(max abs error printed).
Without CUDA it runs a tiny smoke configuration of the torch fallback path and says so; it never needs a GPU
to exit cleanly.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda"
DRY = False  # --cpu-dry-run: the GPU tables on tiny CPU shapes (torch path), to check this script without a GPU

MODELS = {  # attention shapes: heads, kv heads, head dim, low-rank r
    "llama2-7b": dict(heads=32, kv_heads=32, head_dim=128, rank=16),
    "llama3-8b": dict(heads=32, kv_heads=8, head_dim=128, rank=16),
}


def load_kernels():
    """Imports kernels/, modeling/ and research/ as one private package (the files use flat relative imports, as on
    the Hub) and returns research/lisa_prefill_triton.py: every op behind its backend dispatch, the decode kernel
    re-exported from kernels/, and the torch paths (`*_torch`) on the shipped reference."""
    spec = importlib.machinery.ModuleSpec("_lisa_kernels", None, is_package=True)
    spec.submodule_search_locations = [str(ROOT / "kernels"), str(ROOT / "modeling"), str(ROOT / "research")]
    sys.modules["_lisa_kernels"] = importlib.util.module_from_spec(spec)
    return importlib.import_module("_lisa_kernels.lisa_prefill_triton")


def bench_ms(fn, graph=False):
    if DRY:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]
    import triton.testing as tt

    fn()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    if graph:
        return tt.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def safe(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        print("    !! out of memory")
        return None
    except Exception:  # noqa: BLE001 - keep benchmarking the other rows, show the problem
        print("    !! " + traceback.format_exc().strip().replace("\n", "\n    !! "))
        return None


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def layer_params(heads, rank, ffn, dtype, device, gen):
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    mix = (torch.eye(heads, device=device) + 0.05 * torch.randn(heads, heads, generator=gen, device=device)).to(dtype)
    return dict(
        mix=mix,
        bias=r(heads, scale=0.1),
        w1=r(ffn, heads, scale=heads**-0.5) if ffn else None,
        b1=r(ffn, scale=0.1) if ffn else None,
        w2=r(heads, ffn, scale=ffn**-0.5 * 0.1) if ffn else None,
    )


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------------------------------------


def bench_prefill(kt, quick):
    dev, dt = DEV, (torch.float32 if DRY else torch.bfloat16)
    seqs = [48] if DRY else [4096] if quick else [2048, 8192]
    print("\n== prefill: causal, bf16, B=1, r=16 (times: median ms) ==")
    print(
        f"{'model':<10} {'T':>6} {'path':<12} {'lisa ms':>9} {'sdpa ms':>9} {'ratio':>7} "
        f"{'lisa TF/s':>10} {'sdpa TF/s':>10} {'ref ms':>9} {'max err':>9}"
    )
    for name, m in MODELS.items():
        for T in seqs:
            gen = torch.Generator(device=dev).manual_seed(0)
            H, Hkv, D, r = m["heads"], m["kv_heads"], m["head_dim"], m["rank"]
            q = torch.randn(1, H, T, D, device=dev, dtype=dt, generator=gen)
            k = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=gen)
            v = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=gen)
            qlr = torch.randn(1, H, T, r, device=dev, dtype=dt, generator=gen)
            klr = torch.randn(1, H, T, r, device=dev, dtype=dt, generator=gen)
            flops = 4 * H * T * T * D / 2  # causal QK^T + PV, the SDPA count
            sdpa = safe(
                bench_ms, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
            )
            for path, ffn in (("fast", 0), ("materialised", 32)):
                p = layer_params(H, r, ffn, dt, dev, gen)
                wargs = (p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], qlr, klr, v)
                if path == "fast":
                    kw = dict(q_prev=q, k_prev=k, return_scores=False)

                    def run(kw=kw, wargs=wargs):
                        return kt.lisa_prefill(None, *wargs, **kw)

                    def run_ref(kw=kw, wargs=wargs):
                        return kt.lisa_prefill_torch(None, *wargs, **kw)
                else:
                    s_prev = safe(lambda: (q.float() @ k.float().repeat_interleave(H // Hkv, 1).transpose(-1, -2) * D**-0.5).to(dt))
                    if s_prev is None:
                        print(f"{name:<10} {T:>6} {path:<12} (S_prev does not fit)")
                        continue

                    def run(s_prev=s_prev, wargs=wargs):
                        return kt.lisa_prefill(s_prev, *wargs, return_scores=True)

                    def run_ref(s_prev=s_prev, wargs=wargs):
                        return kt.lisa_prefill_torch(s_prev, *wargs, return_scores=True)

                t = safe(bench_ms, run)
                err = None
                ref_ms = None
                if T <= 4096:
                    ref_ms = safe(bench_ms, run_ref)
                    got = safe(run)
                    want = safe(run_ref)
                    if got is not None and want is not None:
                        err = max_err(got[0], want[0])
                        del want
                    del got
                ratio = None if (t is None or sdpa is None) else t / sdpa
                print(
                    f"{name:<10} {T:>6} {path:<12} {fmt(t):>9} {fmt(sdpa):>9} {fmt(ratio, '.2f'):>7} "
                    f"{fmt(None if t is None else flops / t / 1e9, '.1f'):>10} "
                    f"{fmt(None if sdpa is None else flops / sdpa / 1e9, '.1f'):>10} {fmt(ref_ms):>9} {fmt(err, '.2e'):>9}"
                )
                if not DRY:
                    torch.cuda.empty_cache()


def bench_decode(kt, quick, peak_gbs):
    dev, dt = DEV, (torch.float32 if DRY else torch.bfloat16)
    Tk = 100 if DRY else 8192
    batches = [1] if quick else [1, 16]
    es = 2  # bf16 bytes
    print(f"\n== decode: Tk={Tk}, bf16, r=16 and 0 (rank 0: the lowrank=False ablation) (GB/s vs peak {peak_gbs:.0f} GB/s) ==")
    print(
        f"{'model':<10} {'B':>3} {'F':>3} {'r':>3} {'lisa us':>9} {'GB/s':>8} {'%peak':>6} {'splits':>6} "
        f"{'sdpa us':>9} {'sdpa GB/s':>9} {'ref us':>9} {'max err':>9}"
    )
    for name, m in MODELS.items():
        H, Hkv, D, r = m["heads"], m["kv_heads"], m["head_dim"], m["rank"]
        for B in batches:
            gen = torch.Generator(device=dev).manual_seed(1)
            s_prev = torch.randn(B, H, Tk, device=dev, dtype=dt, generator=gen) * 2
            qlr = torch.randn(B, H, r, device=dev, dtype=dt, generator=gen)
            klr = torch.randn(B, H, Tk, r, device=dev, dtype=dt, generator=gen)
            v = torch.randn(B, Hkv, Tk, D, device=dev, dtype=dt, generator=gen)
            k = torch.randn(B, Hkv, Tk, D, device=dev, dtype=dt, generator=gen)
            q = torch.randn(B, H, 1, D, device=dev, dtype=dt, generator=gen)
            sdpa = safe(bench_ms, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=Hkv != H))
            sdpa_bytes = 2 * B * Hkv * Tk * D * es
            for ffn, rank in ((0, r), (32, r), (32, 0)):  # rank 0: the model's (..., 0)-sized low-rank q/k
                p = layer_params(H, r, ffn, dt, dev, gen)
                args = (s_prev, p["mix"], p["bias"], p["w1"], p["b1"], p["w2"], qlr[..., :rank], klr[..., :rank], v)
                # bytes that must move: S_prev row in, S row out, low-rank keys, V (weights are negligible)
                nbytes = (2 * B * H * Tk + B * H * Tk * rank + B * Hkv * Tk * D) * es
                t = safe(bench_ms, lambda: kt.lisa_decode(*args))
                ref_t = safe(bench_ms, lambda: kt.lisa_decode_torch(*args))
                got, want = safe(kt.lisa_decode, *args), safe(kt.lisa_decode_torch, *args)
                err = None if got is None or want is None else max(max_err(got[0], want[0]), max_err(got[1], want[1]))
                launches = safe(kt._decode_plan, *args, None, True, None)
                splits = launches[0][0].grid[2] if launches else None
                gbs = None if t is None else nbytes / (t * 1e-3) / 1e9
                print(
                    f"{name:<10} {B:>3} {ffn:>3} {rank:>3} {fmt(None if t is None else t * 1e3, '.1f'):>9} {fmt(gbs, '.0f'):>8} "
                    f"{fmt(None if gbs is None else 100 * gbs / peak_gbs, '.0f'):>6} {fmt(splits, 'd'):>6} "
                    f"{fmt(None if sdpa is None else sdpa * 1e3, '.1f'):>9} "
                    f"{fmt(None if sdpa is None else sdpa_bytes / (sdpa * 1e-3) / 1e9, '.0f'):>9} "
                    f"{fmt(None if ref_t is None else ref_t * 1e3, '.1f'):>9} {fmt(err, '.2e'):>9}"
                )


def bench_lowrank(kt, quick):
    dev, dt = DEV, (torch.float32 if DRY else torch.bfloat16)
    shapes = [(64, 48, 16)] if DRY else [(4096, 4096, 256)] if quick else [(4096, 4096, 256), (4096, 4096, 1024), (4096, 14336, 512)]
    rows_list = [1] if quick else [1, 4, 16]
    print("\n== lowrank_linear: y = (x B^T) A^T, bf16 (us, median; 'graph' = CUDA-graph replay, no launch overhead) ==")
    print(
        f"{'M':>3} {'K':>6} {'N':>6} {'rank':>5} {'fused':>8} {'2 GEMMs':>8} {'dense':>8} "
        f"{'fused/g':>8} {'2GEMM/g':>8} {'dense/g':>8} {'max err':>9}"
    )
    for K, N, R in shapes:
        gen = torch.Generator(device=dev).manual_seed(2)
        b_w = torch.randn(R, K, device=dev, dtype=dt, generator=gen) * K**-0.5
        a_w = torch.randn(N, R, device=dev, dtype=dt, generator=gen) * R**-0.5
        w = torch.randn(N, K, device=dev, dtype=dt, generator=gen) * K**-0.5
        for M in rows_list:
            x = torch.randn(M, K, device=dev, dtype=dt, generator=gen)

            def fused(x=x):
                return kt.lowrank_linear(x, b_w, a_w)

            def two(x=x):
                return F.linear(F.linear(x, b_w), a_w)

            def dense(x=x):
                return F.linear(x, w)

            res = [safe(bench_ms, f, graph=g) for g in ((False,) if DRY else (False, True)) for f in (fused, two, dense)]
            err = safe(lambda: max_err(fused(), kt.lowrank_linear_torch(x.float(), b_w.float(), a_w.float())))
            us = [None if t is None else t * 1e3 for t in res]
            print(f"{M:>3} {K:>6} {N:>6} {R:>5} " + " ".join(f"{fmt(u, '.1f'):>8}" for u in us) + f" {fmt(err, '.2e'):>9}")


def cpu_smoke(kt):
    print("CUDA is not available: GPU benchmarks skipped. Tiny CPU smoke run of the dispatch (torch reference path);")
    print("these timings say nothing about the kernels.")
    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D, r = 1, 4, 2, 32, 16, 4
    p = layer_params(H, r, 8, torch.float32, "cpu", gen)
    s_prev = torch.randn(B, H, T, T, generator=gen)
    qlr, klr = torch.randn(B, H, T, r, generator=gen), torch.randn(B, H, T, r, generator=gen)
    v = torch.randn(B, Hkv, T, D, generator=gen)
    wargs = (p["mix"], p["bias"], p["w1"], p["b1"], p["w2"])
    t0 = time.perf_counter()
    out, scores = kt.lisa_prefill(s_prev, *wargs, qlr, klr, v, return_scores=True)
    t1 = time.perf_counter()
    dout, drow = kt.lisa_decode(s_prev[:, :, -1], *wargs, qlr[:, :, -1], klr, v)
    t2 = time.perf_counter()
    y = kt.lowrank_linear(torch.randn(2, 64, generator=gen), torch.randn(8, 64, generator=gen), torch.randn(32, 8, generator=gen))
    t3 = time.perf_counter()
    ok = max_err(dout, out[:, :, -1]) < 1e-4 and max_err(drow, scores[:, :, -1]) < 1e-4 and y.shape == (2, 32)
    print(f"  prefill {1e3 * (t1 - t0):.2f} ms, decode {1e3 * (t2 - t1):.2f} ms, lowrank {1e3 * (t3 - t2):.2f} ms; "
          f"decode == last prefill row: {ok}")
    print(f"  triton imported: {kt.HAS_TRITON}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one shape per table")
    ap.add_argument("--only", choices=["prefill", "decode", "lowrank"], action="append")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="HBM peak for the %%peak column (H200: 4800)")
    ap.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    kt = load_kernels()
    if args.cpu_dry_run:  # exercise the GPU tables' code on tiny CPU tensors (torch reference path)
        global DEV, DRY
        DEV, DRY = "cpu", True
        for m in MODELS.values():
            m.update(heads=4, kv_heads=m["kv_heads"] // 8, head_dim=16, rank=4)
        run_tables(kt, args)
        return 0
    if not torch.cuda.is_available():
        cpu_smoke(kt)
        return 0
    if not kt.HAS_TRITON:
        print("triton is not installed: nothing to benchmark (the torch reference is the only path)")
        return 0
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"triton {sys.modules['triton'].__version__}")
    torch.backends.cuda.matmul.allow_tf32 = False
    run_tables(kt, args)
    return 0


def run_tables(kt, args) -> None:
    """The tables --only asks for (all by default), decode first."""
    only = set(args.only or ["prefill", "decode", "lowrank"])
    if "decode" in only:
        bench_decode(kt, args.quick, args.peak_gbs)
    if "lowrank" in only:
        bench_lowrank(kt, args.quick)
    if "prefill" in only:
        bench_prefill(kt, args.quick)


if __name__ == "__main__":
    sys.exit(main())
