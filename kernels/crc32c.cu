// CRC32C (Castagnoli) of device memory, bit for bit equal to the host CRC32C that gds_persist
// records in every manifest (reflected polynomial 0x82F63B78, initial value ~0, final xor ~0).
//
// Scheme (mirrored on the CPU by gds_persist.format.checksum.crc32c_segmented, which the CPU
// tests run):
//   * the buffer of n bytes is cut into segments of `seg` bytes (a multiple of 8; the last one
//     may be short); thread i of the grid computes the ordinary CRC32C of segment i with a
//     slicing-by-8 table kept in shared memory;
//   * it then carries that CRC past every byte after its segment: multiply by x^(8 * bytes_after)
//     mod P (GF(2)), using the table x^(2^k) mod P below, so the work is O(log n), not O(n);
//   * because crc(A + B) = shift(crc(A), len(B)) ^ crc(B), the CRC of the whole buffer is the
//     XOR of all these shifted segment CRCs, in any order: a warp reduction plus one atomicXor
//     per warp into *total (which the caller zeroes).
//
// Everything except the kernel itself is __host__ __device__, so tests/crc32c_host_harness.cu
// compiles this very file with nvcc and runs the same per-segment code on the CPU (no GPU needed).
// Only builtin types are used so that NVRTC (cupy.RawModule) compiles it without any headers.
//
// Launch contract (gds_persist/transfer/device_crc.py): blockDim.x a multiple of 32 (256 is
// used), gridDim.x >= ceil(ceil(n / seg) / blockDim.x); pointers are passed as 64-bit integers.

#define GDSP_HD __host__ __device__

typedef unsigned int gdsp_u32;
typedef unsigned long long gdsp_u64;

#define GDSP_POLY 0x82F63B78u
#define GDSP_X0 0x80000000u  // the polynomial 1 in reflected bit order

// x^(2^k) mod P for k = 0..63 in reflected order (tests/test_kernels.py checks these against
// gds_persist.format.checksum.X_POW_2K).
#define GDSP_X_POW_2K_VALUES \
    0x40000000u, 0x20000000u, 0x08000000u, 0x00800000u, 0x00008000u, 0x82f63b78u, 0x6ea2d55cu, \
    0x18b8ea18u, 0x510ac59au, 0xb82be955u, 0xb8fdb1e7u, 0x88e56f72u, 0x74c360a4u, 0xe4172b16u, \
    0x0d65762au, 0x35d73a62u, 0x28461564u, 0xbf455269u, 0xe2ea32dcu, 0xfe7740e6u, 0xf946610bu, \
    0x3c204f8fu, 0x538586e3u, 0x59726915u, 0x734d5309u, 0xbc1ac763u, 0x7d0722ccu, 0xd289cabeu, \
    0xe94ca9bcu, 0x05b74f3fu, 0xa51e1f42u, 0x40000000u, 0x20000000u, 0x08000000u, 0x00800000u, \
    0x00008000u, 0x82f63b78u, 0x6ea2d55cu, 0x18b8ea18u, 0x510ac59au, 0xb82be955u, 0xb8fdb1e7u, \
    0x88e56f72u, 0x74c360a4u, 0xe4172b16u, 0x0d65762au, 0x35d73a62u, 0x28461564u, 0xbf455269u, \
    0xe2ea32dcu, 0xfe7740e6u, 0xf946610bu, 0x3c204f8fu, 0x538586e3u, 0x59726915u, 0x734d5309u, \
    0xbc1ac763u, 0x7d0722ccu, 0xd289cabeu, 0xe94ca9bcu, 0x05b74f3fu, 0xa51e1f42u, 0x40000000u, \
    0x20000000u

__constant__ gdsp_u32 gdsp_x_pow_2k_device[64] = {GDSP_X_POW_2K_VALUES};
#ifndef __CUDA_ARCH__  // host compilation pass only (NVRTC and device passes never see it)
static const gdsp_u32 gdsp_x_pow_2k_host[64] = {GDSP_X_POW_2K_VALUES};
#endif

GDSP_HD inline gdsp_u32 gdsp_x_pow_2k(int k) {
#ifdef __CUDA_ARCH__
    return gdsp_x_pow_2k_device[k];
#else
    return gdsp_x_pow_2k_host[k];
#endif
}

// a * b mod P (both reflected).
GDSP_HD inline gdsp_u32 gdsp_multiply(gdsp_u32 a, gdsp_u32 b) {
    gdsp_u32 product = 0;
    for (gdsp_u32 bit = GDSP_X0; bit != 0; bit >>= 1) {
        if (a & bit) product ^= b;
        b = (b & 1u) ? (b >> 1) ^ GDSP_POLY : b >> 1;
    }
    return product;
}

// x^(8 * nbytes) mod P; nbytes < 2^61.
GDSP_HD inline gdsp_u32 gdsp_x_pow_8n(gdsp_u64 nbytes) {
    gdsp_u32 result = GDSP_X0;
    for (int k = 3; nbytes != 0; nbytes >>= 1, ++k) {
        if (nbytes & 1ull) result = gdsp_multiply(gdsp_x_pow_2k(k), result);
    }
    return result;
}

// Entry i of slicing table k: the register after byte i followed by k zero bytes, from 0.
GDSP_HD inline gdsp_u32 gdsp_table_entry(int k, int i) {
    gdsp_u32 c = (gdsp_u32)i;
    for (int step = 0; step < 8 * (k + 1); ++step) c = (c & 1u) ? (c >> 1) ^ GDSP_POLY : c >> 1;
    return c;
}

// Continue the raw (already inverted) register `crc` over len bytes at p; tab holds 8 x 256.
GDSP_HD inline gdsp_u32 gdsp_crc32c_update(const gdsp_u32* tab, const unsigned char* p,
                                           gdsp_u64 len, gdsp_u32 crc) {
    while (len != 0 && ((gdsp_u64)p & 7ull) != 0) {
        crc = tab[(crc ^ *p++) & 0xffu] ^ (crc >> 8);
        --len;
    }
    while (len >= 8) {  // slicing-by-8 on aligned little-endian 64-bit words
        gdsp_u64 w = *(const gdsp_u64*)p;
        gdsp_u32 lo = (gdsp_u32)w ^ crc;
        gdsp_u32 hi = (gdsp_u32)(w >> 32);
        crc = tab[7 * 256 + (lo & 0xffu)] ^ tab[6 * 256 + ((lo >> 8) & 0xffu)] ^
              tab[5 * 256 + ((lo >> 16) & 0xffu)] ^ tab[4 * 256 + (lo >> 24)] ^
              tab[3 * 256 + (hi & 0xffu)] ^ tab[2 * 256 + ((hi >> 8) & 0xffu)] ^
              tab[1 * 256 + ((hi >> 16) & 0xffu)] ^ tab[0 * 256 + (hi >> 24)];
        p += 8;
        len -= 8;
    }
    while (len-- != 0) crc = tab[(crc ^ *p++) & 0xffu] ^ (crc >> 8);
    return crc;
}

// Thread i's share of CRC32C(data[0:n]): the CRC32C of segment i, shifted past the bytes after
// it. The segment's own CRC32C goes to *segment_crc.
GDSP_HD inline gdsp_u32 gdsp_segment_contribution(const gdsp_u32* tab, const unsigned char* data,
                                                  gdsp_u64 n, gdsp_u64 seg, gdsp_u64 i,
                                                  gdsp_u32* segment_crc) {
    gdsp_u64 lo = i * seg;
    gdsp_u64 hi = lo + seg < n ? lo + seg : n;
    gdsp_u32 crc = ~gdsp_crc32c_update(tab, data + lo, hi - lo, 0xFFFFFFFFu);
    *segment_crc = crc;
    return gdsp_multiply(gdsp_x_pow_8n(n - hi), crc);
}

// total_addr: one uint32 the caller zeroed; segments_addr: 0, or ceil(n / seg) uint32 that get
// each segment's own CRC32C (for tests and diagnostics).
extern "C" __global__ void gdsp_crc32c(gdsp_u64 data_addr, gdsp_u64 n, gdsp_u64 seg,
                                       gdsp_u64 total_addr, gdsp_u64 segments_addr) {
    __shared__ gdsp_u32 tab[8 * 256];
    for (int j = threadIdx.x; j < 8 * 256; j += blockDim.x) tab[j] = gdsp_table_entry(j >> 8, j & 255);
    __syncthreads();

    const unsigned char* data = (const unsigned char*)data_addr;
    gdsp_u64 i = (gdsp_u64)blockIdx.x * blockDim.x + threadIdx.x;
    gdsp_u64 segments = (n + seg - 1) / seg;
    gdsp_u32 value = 0;
    if (i < segments) {
        gdsp_u32 own;
        value = gdsp_segment_contribution(tab, data, n, seg, i, &own);
        if (segments_addr != 0) ((gdsp_u32*)segments_addr)[i] = own;
    }
    // every lane of every warp reaches this point (no early return), as the full mask requires
    for (int offset = 16; offset > 0; offset >>= 1) value ^= __shfl_xor_sync(0xffffffffu, value, offset);
    if ((threadIdx.x & 31) == 0 && value != 0) atomicXor((gdsp_u32*)total_addr, value);
}
