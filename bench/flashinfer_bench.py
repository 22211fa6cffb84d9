"""FlashInfer's paged decode over the staged cache, checked against ours, and timed beside our decode kernels.

Per case (batch x context, KV / q heads, head_dim; page 16) and config (`KVCacheConfig.recommended()`, ``bf16``,
``nvfp4``): a one-layer `interop.TorchKVCache` of random rows, staged as FlashInfer's HND pages and CSR
(``stage`` / ``flashinfer_csr``). Three answers to the same queries are compared (output within ``2^-6 *
max|ref|``, LSE within ``2^-6``): ours (``cache.decode_attention``), a float32 reference over exactly what
FlashInfer reads (`csr_attention`, base-2 LSE) and FlashInfer's FA2 over bf16 pages and e4m3 pages (per-tensor
scales). On a GPU all are timed (ms per call, GB/s and x the in-run copy floor), with ours jitted, the torch-native
Triton kernel and ``stage``. FlashInfer travels as wheels (``bash bench/tools/pack_flashinfer.sh``); a failing
import or JIT is recorded and not tried again. Writes ``DIR/flashinfer_bench.json`` (GPU: + a RESULTS section unless
``--no-md``). Exit 0: checks passed; 1: a check failed; 2: no FlashInfer.

    PYTHONPATH=. python3 bench/flashinfer_bench.py --out DIR [--cases 16x32768:8/32/128]
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from common import (append_results, bench_parser, copy_bandwidth, kv_bytes, md_table, parse_ints,  # noqa: E402
                    time_jax, time_torch, torch_cuda, versions, write_json)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from interop import TorchKVCache, lse_from_base2, lse_to_base2  # noqa: E402
from interop.dlpack import from_torch  # noqa: E402
from jmixedkv import KVCacheConfig  # noqa: E402
from jmixedkv.decode import decode_attention as jax_decode_attention  # noqa: E402

#: (batch, context, KV heads, q heads, head_dim): 16 x 32k and 64 x 8k at Llama-3-8B's and SmolLM2's heads
CASES = ((16, 32768, 8, 32, 128), (64, 8192, 8, 32, 128), (16, 32768, 3, 9, 64), (64, 8192, 3, 9, 64))
SMOKE_CASES = ((2, 40, 2, 8, 64),)
PAGE, APPEND_CHUNK, WORKSPACE_BYTES = 16, 16384, 128 << 20
OUT_RTOL = LSE_ATOL = 2.0 ** -6
E4M3_MAX = 448.0
NEEDS_CUDA = "needs CUDA"


def configs():
    """name -> `KVCacheConfig` of every cache the bench builds (page `PAGE`): recommended, plain bf16, plain NVFP4."""
    return {"recommended": KVCacheConfig.recommended(page_size=PAGE), "bf16": KVCacheConfig("bf16", page_size=PAGE),
            "nvfp4": KVCacheConfig("nvfp4", page_size=PAGE)}


def parse_cases(text):
    """``"16x32768:8/32/128,..."`` -> ((batch, context, KV heads, q heads, head_dim), ...), each value checked."""
    out = []
    for item in text.split(","):
        bc, _, heads = item.partition(":")
        case = parse_ints(bc, "--cases BATCHxCONTEXT", "x") + parse_ints(heads, "--cases KV/Q/HEAD_DIM", "/")
        if len(case) != 5 or min(case) < 1 or case[3] % case[2]:
            raise ValueError(f"--cases: {item!r} is not BATCHxCONTEXT:KV/Q/HEAD_DIM (e.g. 16x32768:8/32/128) of "
                             "positive values, q heads a multiple of KV heads")
        out.append(case)
    return tuple(out)


def error_text(e: BaseException, limit: int = 4000) -> str:
    """``Type: message`` of ``e``, at most ``limit`` characters (the end kept: a JIT failure's log ends there)."""
    return f"{type(e).__name__}: {e}"[-limit:]


# ------------------------------------------------------------------------------------------------ the cache
def filled_cache(cfg, batch, context, kv_heads, head_dim, device, seed=0):
    """A one-layer `TorchKVCache` of ``batch`` sequences holding ``context`` random bf16 rows each (appended
    `APPEND_CHUNK` tokens at a time) and the slots ``i32[batch]`` (torch, on ``device``)."""
    pages = -(-context // PAGE)
    cache = TorchKVCache(cfg, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, num_pages=batch * pages,
                         max_seqs=batch, max_pages_per_seq=pages, validate=False)
    slots = [cache.admit() for _ in range(batch)]
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_all = np.repeat(np.asarray(slots, np.int32), context)
    pos_all = np.tile(np.arange(context, dtype=np.int32), batch)
    for t0 in range(0, seq_all.size, APPEND_CHUNK):
        seq, pos = seq_all[t0:t0 + APPEND_CHUNK], pos_all[t0:t0 + APPEND_CHUNK]
        k, v = (torch.randn((seq.size, kv_heads, head_dim), generator=gen, device=device).to(torch.bfloat16)
                for _ in range(2))
        cache.append(0, k, v, seq, pos)
    return cache, torch.tensor(slots, dtype=torch.int32, device=device)


# ------------------------------------------------------------------------------------------------ references
def csr_attention(q, pages, csr, sm_scale, k_scale=1.0, v_scale=1.0):
    """Float32 decode attention as FlashInfer's paged decode reads the cache: ``q [B, Hq, D]``, HND ``pages
    [N, 2, H, page, D]`` (any float dtype; K / V values times ``k_scale`` / ``v_scale``), ``csr`` = (kv_indptr,
    kv_indices, kv_last_page_len). Query head ``h`` reads KV head ``h // (Hq / H)``. Returns ``(out f32[B, Hq, D],
    lse2 f32[B, Hq])``, the LSE in base 2 (FlashInfer's convention); a row without keys gives 0 and -inf."""
    indptr, indices, last = (t.cpu().tolist() for t in csr)
    b, hq, d = q.shape
    h, page = pages.shape[2], pages.shape[3]
    out = torch.zeros((b, hq, d), dtype=torch.float32, device=q.device)
    lse2 = torch.full((b, hq), -math.inf, dtype=torch.float32, device=q.device)
    for i in range(b):
        ids = indices[indptr[i]:indptr[i + 1]]
        n = (len(ids) - 1) * page + last[i] if ids else 0
        if n == 0:
            continue
        kv = pages[torch.tensor(ids, device=pages.device)].float()             # [P, 2, H, page, D]
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n] * k_scale
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n] * v_scale
        s = torch.einsum("hgd,hnd->hgn", q[i].float().reshape(h, hq // h, d), k) * sm_scale
        lse = torch.logsumexp(s, dim=-1)
        out[i] = torch.einsum("hgn,hnd->hgd", torch.exp(s - lse[..., None]), v).reshape(hq, d)
        lse2[i] = lse_to_base2(lse).reshape(hq)
    return out, lse2


def compare(out, lse, ref_out, ref_lse, checked=True):
    """``{out_err, lse_err, ok}``: output error relative to ``max|ref_out|``, LSE max abs error (natural log), and
    whether both are within `OUT_RTOL` / `LSE_ATOL` (no ``ok`` when not ``checked``: an error for information)."""
    out, ref_out = out.float().reshape(ref_out.shape), ref_out.float()
    out_err = float((out - ref_out).abs().max() / ref_out.abs().max().clamp(min=1e-30))
    lse_err = float((lse.float().reshape(ref_lse.shape) - ref_lse.float()).abs().max())
    if not checked:
        return dict(out_err=out_err, lse_err=lse_err)
    ok = math.isfinite(out_err) and math.isfinite(lse_err) and out_err <= OUT_RTOL and lse_err <= LSE_ATOL
    return dict(out_err=out_err, lse_err=lse_err, ok=ok)


def fp8_pages(pages):
    """``(pages e4m3 [N, 2, H, page, D], k_scale, v_scale)``: per-tensor scales ``amax / 448`` of K and V."""
    scales = [float(pages[:, i].float().abs().amax().clamp(min=1e-12)) / E4M3_MAX for i in (0, 1)]
    out = torch.empty(pages.shape, dtype=torch.float8_e4m3fn, device=pages.device)
    for i, s in enumerate(scales):
        out[:, i] = (pages[:, i].float() / s).to(torch.float8_e4m3fn)
    return out, scales[0], scales[1]


# ------------------------------------------------------------------------------------------------ FlashInfer
def jit_environment():
    """Point FlashInfer's JIT link at the CUDA libraries: ``CUDA_HOME`` (else taken from ``which nvcc``, wrong for
    a wrapper script) and, without a ``libcuda.so`` under it, a symlink to the driver's ``libcuda.so.1``
    (``FLASHINFER_EXTRA_LDFLAGS``). Returns what it set."""
    done = {}
    if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = done["CUDA_HOME"] = "/usr/local/cuda"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""
    if not any(os.path.exists(os.path.join(home, d, "libcuda.so")) for d in ("lib64", "lib64/stubs")):
        import ctypes.util
        import tempfile
        name = ctypes.util.find_library("cuda")          # the driver's libcuda.so.1, via ldconfig
        found = [os.path.join(d, n) for d in ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")
                 for n in ("libcuda.so.1", name or "libcuda.so.1") if os.path.exists(os.path.join(d, n))]
        if found:
            link_dir = tempfile.mkdtemp(prefix="libcuda_")
            os.symlink(found[0], os.path.join(link_dir, "libcuda.so"))
            flags = (os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "") + f" -L{link_dir}").strip()
            os.environ["FLASHINFER_EXTRA_LDFLAGS"] = done["FLASHINFER_EXTRA_LDFLAGS"] = flags
            done["libcuda"] = found[0]
    return done


def load_flashinfer(cuda: bool):
    """``(module or None, status dict)``: ``{"status": "needs CUDA"}`` off CUDA (nothing imported), else the import's
    version or its exception text, with the JIT's tools and `jit_environment`'s settings."""
    if not cuda:
        return None, {"status": NEEDS_CUDA}
    env = jit_environment()
    tools = dict(nvcc=shutil.which("nvcc"), ninja=shutil.which("ninja"), cuda_home=os.environ.get("CUDA_HOME"),
                 env_set=env)
    try:
        import flashinfer
    except Exception as e:
        return None, {"status": "import failed", "error": error_text(e), **tools}
    return flashinfer, {"status": "imported", "version": getattr(flashinfer, "__version__", "?"),
                        "path": os.path.dirname(flashinfer.__file__), **tools}


def flashinfer_decoder(fi, csr, hq, h, d, kv_dtype, q_dtype=torch.bfloat16):
    """A planned ``BatchDecodeWithPagedKVCacheWrapper`` (HND, FA2: the JIT decode kernel) for the CSR."""
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=csr[0].device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", backend="fa2")
    wrapper.plan(*csr, hq, h, d, PAGE, q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=q_dtype,
                 sm_scale=d ** -0.5)
    return wrapper


def run_flashinfer(fi, name, csr, q, pages, h, scales, ref, ours, timing):
    """Plan / run FlashInfer on HND ``pages`` (``scales``: ``(k_scale, v_scale)`` of FP8 pages or None); check its
    output and LSE (base 2 -> natural log) against ``ref`` (the CSR reference over the same pages) and ``ours``
    (recorded only for FP8 pages, whose rounding is coarser than the tolerance); time it when ``timing``. Returns
    the row's fields (``{name}_error`` on failure)."""
    b, hq, d = q.shape
    kw = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
    try:
        wrapper = flashinfer_decoder(fi, csr, hq, h, d, pages.dtype)
        out, lse2 = wrapper.run(q, pages, return_lse=True, **kw)
        torch.cuda.synchronize()
    except Exception as e:
        traceback.print_exc()
        return {f"{name}_error": error_text(e)}
    row = {f"{name}_vs_reference": compare(out, lse_from_base2(lse2), *ref),
           f"{name}_vs_ours": compare(out, lse_from_base2(lse2), *ours, checked=scales is None)}
    if timing:
        row[f"{name}_ms"] = time_torch(torch, lambda: wrapper.run(q, pages, return_lse=True, **kw))
    return row


# ------------------------------------------------------------------------------------------------ timing
def time_ours(cache, q, slots):
    """``(end to end ms, jitted ms)`` of our decode: ``TorchKVCache.decode_attention`` between CUDA events (host
    dispatch and DLPack included) and `jmixedkv.decode.decode_attention` jitted over the state (`time_jax`)."""
    e2e = time_torch(torch, lambda: cache.decode_attention(0, q, slots, sync="stream", validate=False))
    qj = from_torch(q.unsqueeze(1), copy=True)
    seq = jnp.asarray(slots.cpu().numpy())
    fn = jax.jit(lambda st, qq: jax_decode_attention(st, 0, qq, seq, backend=cache.backend))
    return e2e, time_jax(fn, cache.state, qj)


# ------------------------------------------------------------------------------------------------ one case
def run_case(case, fi, device, timing, skip=None):
    """Every config of one case: ours vs the CSR reference, FlashInfer (``fi`` not None) bf16 and FP8 vs both and
    (``timing``) the times. ``skip``: the FlashInfer paths that failed earlier (not tried again: a failing JIT build
    takes minutes); a path that fails here is added to it."""
    skip = set() if skip is None else skip
    batch, context, h, hq, d = case
    row = dict(batch=batch, context=context, kv_heads=h, q_heads=hq, head_dim=d, page=PAGE, configs={})
    gen = torch.Generator(device=device).manual_seed(1)
    q = (2 * torch.randn((batch, hq, d), generator=gen, device=device)).to(torch.bfloat16)
    for name, cfg in configs().items():
        cache, slots = filled_cache(cfg, batch, context, h, d, device)
        out, lse = cache.decode_attention(0, q, slots)
        staged = cache.stage(0, slots)
        csr = staged.flashinfer_csr()
        got = {}
        ref_out, ref_lse2 = csr_attention(q, staged.pages, csr, d ** -0.5)
        ref = (ref_out, lse_from_base2(ref_lse2))
        got["ours_vs_reference"] = compare(out, lse, *ref)
        if fi is not None and "flashinfer_bf16" not in skip:
            got.update(run_flashinfer(fi, "flashinfer_bf16", csr, q, staged.pages, h, None, ref, (out, lse), timing))
        if fi is not None and "flashinfer_fp8" not in skip:
            p8, ks, vs = fp8_pages(staged.pages)
            ref8 = csr_attention(q, p8, csr, d ** -0.5, ks, vs)
            got.update(run_flashinfer(fi, "flashinfer_fp8", csr, q, p8, h, (ks, vs),
                                      (ref8[0], lse_from_base2(ref8[1])), (out, lse), timing))
            del p8
        skip.update(k[:-len("_error")] for k in got if k.endswith("_error"))
        if timing:
            got["ours_e2e_ms"], got["ours_jit_ms"] = time_ours(cache, q, slots)
            got["stage_ms"] = time_torch(torch, lambda: cache.stage(0, slots, sync="stream", validate=False))
            if name == "recommended":       # the torch-native Triton kernel on its own random mixed_bf16 pools
                from interop.triton_attention import bench_paged_attention
                got["triton_ms"] = bench_paged_attention(batch, context, h, hq // h, d, PAGE, fmt="mixed_bf16",
                                                         first_n=cfg.first_n, last_n=cfg.last_n)["ms"]
        row["configs"][name] = got
        cache = staged = csr = None
        jax.clear_caches()
    return row


def checks_failed(rows):
    """Names of the failed checks, ``"BxC/H/Hq/D config check"``."""
    bad = []
    for r in rows:
        key = f"{r['batch']}x{r['context']}/{r['kv_heads']}/{r['q_heads']}/{r['head_dim']}"
        for name, got in r["configs"].items():
            bad += [f"{key} {name} {k}: {v}" for k, v in got.items() if isinstance(v, dict) and not v.get("ok", True)]
    return bad


def flashinfer_errors(rows):
    """Every ``*_error`` a row recorded (FlashInfer's plan / JIT / run exception text)."""
    return [f"{r['batch']}x{r['context']}/{r['head_dim']} {n} {k}: {v}" for r in rows
            for n, got in r["configs"].items() for k, v in got.items() if k.endswith("_error")]


# ------------------------------------------------------------------------------------------------ output
def timing_rows(rows, copy_tbs):
    """``[(shape, kernel, ms, GB/s, x floor)]``, one per (case, timed path)."""
    out, cfgs = [], configs()
    for r in rows:
        b, c, h, d = r["batch"], r["context"], r["kv_heads"], r["head_dim"]
        rec, plain, nv = (r["configs"].get(n, {}) for n in ("recommended", "bf16", "nvfp4"))
        items = [("FlashInfer FA2, bf16 KV (staged pages)", rec.get("flashinfer_bf16_ms"), "bf16", None),
                 ("FlashInfer FA2, FP8 KV (per-tensor scales)", rec.get("flashinfer_fp8_ms"), "fp8", None),
                 ("jmixedkv fused, recommended, jitted", rec.get("ours_jit_ms"), "nvfp4", "recommended"),
                 ("jmixedkv fused, recommended, TorchKVCache", rec.get("ours_e2e_ms"), "nvfp4", "recommended"),
                 ("Triton torch-native, mixed_bf16", rec.get("triton_ms"), "nvfp4", "recommended"),
                 ("jmixedkv fused, nvfp4 cache, jitted", nv.get("ours_jit_ms"), "nvfp4", "nvfp4"),
                 ("jmixedkv, bf16 cache, jitted", plain.get("ours_jit_ms"), "bf16", None),
                 ("stage() of the recommended cache (handoff copy)", rec.get("stage_ms"), None, None)]
        for kernel, ms, fmt, cfg in items:
            if ms is not None:
                twin = b * min(c, cfgs[cfg].first_n + cfgs[cfg].last_n) if cfg else 0
                nbytes = kv_bytes(b * c, h, d, fmt, twin) if fmt else None
                out.append((f"{b} x {c}, {r['q_heads']}/{h} heads, D {d}", kernel, ms,
                            nbytes and nbytes / ms / 1e6, nbytes and ms / (nbytes / (copy_tbs * 1e9))))
    return out


def tables(rows, copy_tbs):
    """Markdown: the timing table and the check table."""
    t = [(shape, kernel, f"{ms:.3f}", f"{gbs:,.0f}" if gbs else "", f"{x:.2f}" if x else "")
         for shape, kernel, ms, gbs, x in timing_rows(rows, copy_tbs)]
    c = []
    for r in rows:
        shape = f"{r['batch']} x {r['context']}, {r['q_heads']}/{r['kv_heads']}, D {r['head_dim']}"
        for name, got in r["configs"].items():
            c += [(shape, name, k, f"{v['out_err']:.2e}", f"{v['lse_err']:.2e}", v.get("ok", "not checked"))
                  for k, v in got.items() if isinstance(v, dict) and "out_err" in v]
    return (md_table(("shape", "kernel", "ms", "GB/s", "x bytes floor"), t),
            md_table(("shape", "config", "check", "out err (rel)", "LSE err", "ok"), c))


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--cases", default=None, help="BATCHxCONTEXT:KV/Q/HEAD_DIM,... (default: every case)")
    args = ap.parse_args(argv)
    cuda = torch_cuda() is not None and jax.default_backend() == "gpu"
    if not cuda and not args.smoke:
        print("flashinfer_bench: no GPU here; run on the H200 (or --smoke for the CPU checks)")
        return 0
    cases = parse_cases(args.cases) if args.cases else (SMOKE_CASES if args.smoke else CASES)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timing = cuda and not args.smoke
    fi, fi_status = load_flashinfer(cuda)
    print(f"flashinfer: {fi_status}")
    copy_tbs, how = copy_bandwidth(False) if timing else (1.0, "not measured (no timing)")
    meta = dict(versions(torch), copy_tbs=copy_tbs, copy_how=how, page=PAGE)
    skip, rows = set(), []
    for case in cases:                      # the JSON is rewritten after every case: a cut run keeps what it measured
        t0 = time.perf_counter()
        rows.append(run_case(case, fi, device, timing, skip))
        errors = flashinfer_errors(rows)
        if errors:
            fi_status = dict(fi_status, status="failed", run_errors=errors)
        failed = checks_failed(rows)
        write_json(args.out, "flashinfer_bench.json", dict(meta=meta, flashinfer=fi_status, rows=rows,
                                                           checks_failed=failed, timings=timing_rows(rows, copy_tbs)))
        print(f"case {case}: {time.perf_counter() - t0:.0f} s, checks failed {len(failed)}, FlashInfer errors "
              f"{len(errors)}", flush=True)
    t_md, c_md = tables(rows, copy_tbs)
    print(f"{t_md}\n{c_md}\nflashinfer: {fi_status}\nchecks failed: {'; '.join(failed) or 'none'}")
    if timing and not args.no_md:
        append_results("FlashInfer decode on the staged cache beside ours", meta,
                       f"flashinfer {fi_status.get('version', fi_status['status'])}; copy {copy_tbs:.2f} TB/s ({how}). "
                       f"`bench/flashinfer_bench.py`; one layer, page {PAGE}; ms per call.\n\n{t_md}\n\n{c_md}")
    if failed:
        return 1
    return 2 if fi_status["status"] not in ("imported", NEEDS_CUDA) or (cuda and fi is None) else 0


if __name__ == "__main__":
    sys.exit(main())
