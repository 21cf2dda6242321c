// tree_verify_v1_combine: the LSE merge stage of tree_verify (after any prefix version and tail_v1).

#define D_V 512  // value width = kv_lora_rank
#define NEG_INF __int_as_float(0xff800000)  // -inf without math.h (NVRTC has no host headers)

// LSE merge. parts [B, nparts, M, 512] and part_lse [B, nparts, M] (normalised partials), plus an
// optional extra part [B*M, 512] / [B*M] (extra == nullptr: none). out [B*M, 512], lse [B*M].
// Grid (B*M), block 128 (4 dims per thread, float4).
extern "C" __global__ void __launch_bounds__(128) tree_verify_v1_combine(
    const float* __restrict__ parts, const float* __restrict__ part_lse, int nparts, int M,
    const float* __restrict__ extra, const float* __restrict__ extra_lse, float* __restrict__ out,
    float* __restrict__ lse) {
    const long long n = blockIdx.x;
    const long long b = n / M, r = n - b * M;
    const int t = threadIdx.x;
    const float* pl = part_lse + b * nparts * M + r;
    float mx = NEG_INF;
    bool nan = false;
    for (int s = 0; s < nparts; ++s) {
        const float v = pl[(long long)s * M];
        nan |= (v != v);
        mx = fmaxf(mx, v);
    }
    if (extra) {
        const float v = extra_lse[n];
        nan |= (v != v);
        mx = fmaxf(mx, v);
    }
    float4* o = reinterpret_cast<float4*>(out + n * D_V) + t;
    if (nan) {
        const float qn = __int_as_float(0x7fc00000);
        *o = make_float4(qn, qn, qn, qn);
        if (t == 0) lse[n] = qn;
        return;
    }
    const float base = mx == NEG_INF ? 0.f : mx;
    float z = 0.f;
    for (int s = 0; s < nparts; ++s) z += expf(pl[(long long)s * M] - base);
    if (extra) z += expf(extra_lse[n] - base);
    const float inv = z > 0.f ? 1.f / z : 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < nparts; ++s) {
        const float w = expf(pl[(long long)s * M] - base) * inv;
        const float4 v = reinterpret_cast<const float4*>(parts + ((b * nparts + s) * M + r) * D_V)[t];
        acc.x = fmaf(w, v.x, acc.x);
        acc.y = fmaf(w, v.y, acc.y);
        acc.z = fmaf(w, v.z, acc.z);
        acc.w = fmaf(w, v.w, acc.w);
    }
    if (extra) {
        const float w = expf(extra_lse[n] - base) * inv;
        const float4 v = reinterpret_cast<const float4*>(extra + n * D_V)[t];
        acc.x = fmaf(w, v.x, acc.x);
        acc.y = fmaf(w, v.y, acc.y);
        acc.z = fmaf(w, v.z, acc.z);
        acc.w = fmaf(w, v.w, acc.w);
    }
    *o = acc;
    if (t == 0) lse[n] = z > 0.f ? base + logf(z) : NEG_INF;
}
