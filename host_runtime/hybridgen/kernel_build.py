"""cffi (API mode) build of the CPU logits kernel.

BLAS handles the logits scan badly (a GEMM with 192-long rows and 9 output
columns runs far below memory bandwidth), so the scan is a small C loop: one
pass over token-major K rows, 9 dot products of 64 per row, OpenMP over
tokens, AVX-512 intrinsics where the CPU has them (else a loop the compiler
vectorises). Built on first use into the package
directory (``*.so`` is git-ignored); ``load()`` returns None when no compiler
is available and the caller falls back to torch.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import cffi

from driver.native import load_or_build

# "_mt": the signature with a thread count; a new name, so that a stale build of the old one is never loaded
MODULE = "host_runtime.hybridgen._logits_kernel_mt"

CDEF = """
void hg_logits_rows(const float *k, long n_tokens, int n_kv_heads, int head_dim,
                    const float *q, int n_heads, float *out, int n_threads);
"""

SOURCE = r"""
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* out[s * n_heads + h] = k[s, kv(h), :] . q[h, :]  (q pre-scaled by 1/sqrt(d); kv(h) = h / group),
   on n_threads OpenMP threads (the caller's CPU budget: OpenMP's default takes every core) */
void hg_logits_rows(const float *k, long n_tokens, int n_kv_heads, int head_dim,
                    const float *q, int n_heads, float *out, int n_threads)
{
    const int group = n_heads / n_kv_heads;
    const long row = (long)n_kv_heads * head_dim;
#ifdef __AVX512F__
    if (head_dim % 16 == 0) {
        /* explicit 16-lane FMAs + one in-register reduction per head: the compiler's own
           vectorisation of the loop below reaches about half of this */
        #pragma omp parallel for schedule(static) num_threads(n_threads)
        for (long s = 0; s < n_tokens; s++) {
            const float *ks = k + s * row;
            float *os = out + s * n_heads;
            _mm_prefetch((const char *)(ks + 4 * row), _MM_HINT_T0);
            for (int h = 0; h < n_heads; h++) {
                const float *kh = ks + (long)(h / group) * head_dim;
                const float *qh = q + (long)h * head_dim;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(kh), _mm512_loadu_ps(qh));
                for (int c = 16; c < head_dim; c += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(kh + c), _mm512_loadu_ps(qh + c), acc);
                os[h] = _mm512_reduce_add_ps(acc);
            }
        }
        return;
    }
#endif
    #pragma omp parallel for schedule(static) num_threads(n_threads)
    for (long s = 0; s < n_tokens; s++) {
        const float *ks = k + s * row;
        float *os = out + s * n_heads;
        for (int h = 0; h < n_heads; h++) {
            const float *kh = ks + (long)(h / group) * head_dim;
            const float *qh = q + (long)h * head_dim;
            float acc = 0.0f;
            #pragma omp simd reduction(+:acc)
            for (int c = 0; c < head_dim; c++)
                acc += kh[c] * qh[c];
            os[h] = acc;
        }
    }
}
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(MODULE, SOURCE, extra_compile_args=["-O3", "-march=native", "-fopenmp"],
                      extra_link_args=["-fopenmp"])


def build() -> Path:
    """Compile in a scratch directory and put only the shared object into the package."""
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="hybridgen-kernel-") as tmp:
        so = Path(ffibuilder.compile(tmpdir=tmp, verbose=False))
        dest = here / so.name
        shutil.copy2(so, dest)
    return dest


def load():
    """The compiled module (building it once if needed), or None when it cannot be built."""
    lock_path = Path(tempfile.gettempdir()) / f"hybridgen-kernel-{Path(__file__).resolve().parent.stat().st_ino}.lock"
    try:
        return load_or_build(MODULE, build, lock_path)
    except Exception:  # no compiler / headers: the torch kernel still works
        return None


if __name__ == "__main__":
    print(build())
