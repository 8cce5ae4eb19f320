// BLAKE3 of device memory, bit for bit the standard BLAKE3 digest (gds_persist keeps its first
// 16 bytes: gds_persist.format.hashing.content_hash, the content hash of incremental saves).
//
// BLAKE3 is a binary tree over 1 KiB chunks: a chunk's chaining value (CV) depends only on its
// bytes and its index; two neighbouring subtrees merge with one parent compression; the tree is
// left-complete (a left subtree always holds a power-of-two number of chunks), which is exactly
// what merging the CVs of one level pairwise, carrying an odd last one up unchanged, produces;
// only the final merge (or the only chunk's last block) carries the ROOT flag. So:
//   * gdsp_blake3_chunks: one thread per chunk of every piece computes the chunk's CV
//     (the ROOT flag when the piece is a single chunk: that CV is then the digest);
//   * gdsp_blake3_parents: one thread per node of the next level merges two CVs (ROOT when they
//     are the last two of their piece) or carries one up; the host launches it level by level
//     until every piece is one CV.
// Many pieces (extents) go through each launch together: thread t finds its piece by binary
// search in a table of cumulative node counts.
//
// Everything except the kernels is __host__ __device__, so tests/blake3_host_harness.cu compiles
// this very file with nvcc and runs the same per-thread code on the CPU (no GPU needed). Only
// builtin types are used so that NVRTC (cupy.RawModule) compiles it without any headers.
//
// Launch contract (gds_persist/transfer/device_hash.py): any block size; pointers and tables are
// passed as 64-bit integers (tables: int64 on the device); CVs are 8 x uint32 per node.

#define GDSP_HD __host__ __device__

typedef unsigned int gdsb_u32;
typedef unsigned long long gdsb_u64;

#define GDSB_CHUNK 1024ull
#define GDSB_BLOCK 64u
#define GDSB_CHUNK_START 1u
#define GDSB_CHUNK_END 2u
#define GDSB_PARENT 4u
#define GDSB_ROOT 8u

GDSP_HD inline gdsb_u32 gdsb_iv(int i) {
    switch (i) {
        case 0: return 0x6A09E667u;
        case 1: return 0xBB67AE85u;
        case 2: return 0x3C6EF372u;
        case 3: return 0xA54FF53Au;
        case 4: return 0x510E527Fu;
        case 5: return 0x9B05688Cu;
        case 6: return 0x1F83D9ABu;
        default: return 0x5BE0CD19u;
    }
}

GDSP_HD inline gdsb_u32 gdsb_rotr(gdsb_u32 x, int n) { return (x >> n) | (x << (32 - n)); }

GDSP_HD inline void gdsb_g(gdsb_u32* s, int a, int b, int c, int d, gdsb_u32 mx, gdsb_u32 my) {
    s[a] = s[a] + s[b] + mx;
    s[d] = gdsb_rotr(s[d] ^ s[a], 16);
    s[c] = s[c] + s[d];
    s[b] = gdsb_rotr(s[b] ^ s[c], 12);
    s[a] = s[a] + s[b] + my;
    s[d] = gdsb_rotr(s[d] ^ s[a], 8);
    s[c] = s[c] + s[d];
    s[b] = gdsb_rotr(s[b] ^ s[c], 7);
}

// The compression function, truncated to the 8 words a chaining value (or a <= 32-byte root
// output) needs: out[i] = s[i] ^ s[i + 8].
GDSP_HD inline void gdsb_compress(const gdsb_u32* cv, const gdsb_u32* block, gdsb_u64 counter,
                                  gdsb_u32 block_len, gdsb_u32 flags, gdsb_u32* out) {
    gdsb_u32 s[16];
    gdsb_u32 m[16];
    gdsb_u32 t[16];
    for (int i = 0; i < 8; ++i) s[i] = cv[i];
    for (int i = 0; i < 4; ++i) s[8 + i] = gdsb_iv(i);
    s[12] = (gdsb_u32)counter;
    s[13] = (gdsb_u32)(counter >> 32);
    s[14] = block_len;
    s[15] = flags;
#pragma unroll
    for (int i = 0; i < 16; ++i) m[i] = block[i];
#pragma unroll
    for (int r = 0; r < 7; ++r) {
        gdsb_g(s, 0, 4, 8, 12, m[0], m[1]);
        gdsb_g(s, 1, 5, 9, 13, m[2], m[3]);
        gdsb_g(s, 2, 6, 10, 14, m[4], m[5]);
        gdsb_g(s, 3, 7, 11, 15, m[6], m[7]);
        gdsb_g(s, 0, 5, 10, 15, m[8], m[9]);
        gdsb_g(s, 1, 6, 11, 12, m[10], m[11]);
        gdsb_g(s, 2, 7, 8, 13, m[12], m[13]);
        gdsb_g(s, 3, 4, 9, 14, m[14], m[15]);
        if (r < 6) {  // the message permutation of the spec: 2 6 3 10 7 0 4 13 1 11 12 5 9 14 15 8
            t[0] = m[2]; t[1] = m[6]; t[2] = m[3]; t[3] = m[10];
            t[4] = m[7]; t[5] = m[0]; t[6] = m[4]; t[7] = m[13];
            t[8] = m[1]; t[9] = m[11]; t[10] = m[12]; t[11] = m[5];
            t[12] = m[9]; t[13] = m[14]; t[14] = m[15]; t[15] = m[8];
#pragma unroll
            for (int i = 0; i < 16; ++i) m[i] = t[i];
        }
    }
    for (int i = 0; i < 8; ++i) out[i] = s[i] ^ s[i + 8];
}

// 16 little-endian words of a block of `len` (<= 64) bytes, zero-padded.
GDSP_HD inline void gdsb_load_block(const unsigned char* p, gdsb_u32 len, gdsb_u32* words) {
    if (len == GDSB_BLOCK && (((gdsb_u64)p) & 3ull) == 0) {
        const gdsb_u32* w = (const gdsb_u32*)p;  // little-endian hosts and GPUs only
        for (int i = 0; i < 16; ++i) words[i] = w[i];
        return;
    }
    for (int i = 0; i < 16; ++i) words[i] = 0;
    for (gdsb_u32 i = 0; i < len; ++i) words[i >> 2] |= ((gdsb_u32)p[i]) << (8 * (i & 3));
}

// CV of one chunk of `len` (0..1024) bytes at chunk index `index`; `root`: it is the whole input.
GDSP_HD inline void gdsb_chunk_cv(const unsigned char* chunk, gdsb_u64 len, gdsb_u64 index,
                                  int root, gdsb_u32* out) {
    gdsb_u32 cv[8];
    gdsb_u32 words[16];
    for (int i = 0; i < 8; ++i) cv[i] = gdsb_iv(i);
    gdsb_u64 nblocks = len ? (len + GDSB_BLOCK - 1) / GDSB_BLOCK : 1;
    for (gdsb_u64 j = 0; j < nblocks; ++j) {
        gdsb_u64 lo = j * GDSB_BLOCK;
        gdsb_u32 block_len = (gdsb_u32)((len - lo) < GDSB_BLOCK ? (len - lo) : GDSB_BLOCK);
        if (len == 0) block_len = 0;
        gdsb_u32 flags = (j == 0 ? GDSB_CHUNK_START : 0u);
        if (j == nblocks - 1) flags |= GDSB_CHUNK_END | (root ? GDSB_ROOT : 0u);
        gdsb_load_block(chunk + lo, block_len, words);
        gdsb_compress(cv, words, index, block_len, flags, cv);
    }
    for (int i = 0; i < 8; ++i) out[i] = cv[i];
}

GDSP_HD inline void gdsb_parent_cv(const gdsb_u32* left, const gdsb_u32* right, int root,
                                   gdsb_u32* out) {
    gdsb_u32 iv[8];
    gdsb_u32 block[16];
    for (int i = 0; i < 8; ++i) {
        iv[i] = gdsb_iv(i);
        block[i] = left[i];
        block[8 + i] = right[i];
    }
    gdsb_compress(iv, block, 0ull, GDSB_BLOCK, GDSB_PARENT | (root ? GDSB_ROOT : 0u), out);
}

// The piece p with starts[p] <= t < starts[p + 1] (starts: npieces + 1 cumulative counts).
GDSP_HD inline gdsb_u64 gdsb_find(const long long* starts, gdsb_u64 npieces, gdsb_u64 t) {
    gdsb_u64 lo = 0, hi = npieces;  // invariant: starts[lo] <= t < starts[hi]
    while (hi - lo > 1) {
        gdsb_u64 mid = (lo + hi) / 2;
        if ((gdsb_u64)starts[mid] <= t) lo = mid; else hi = mid;
    }
    return lo;
}

// Thread t of the chunk level: the CV of chunk t of all pieces' chunks laid end to end.
// ptrs[p], lens[p]: piece p's address and length; starts: cumulative chunk counts (a 0-byte
// piece has one empty chunk).
GDSP_HD inline void gdsb_chunk_node(gdsb_u64 t, const long long* ptrs, const long long* lens,
                                    const long long* starts, gdsb_u64 npieces, gdsb_u32* cvs) {
    gdsb_u64 p = gdsb_find(starts, npieces, t);
    gdsb_u64 index = t - (gdsb_u64)starts[p];
    gdsb_u64 nchunks = (gdsb_u64)(starts[p + 1] - starts[p]);
    gdsb_u64 n = (gdsb_u64)lens[p];
    gdsb_u64 lo = index * GDSB_CHUNK;
    gdsb_u64 len = n > lo ? (n - lo < GDSB_CHUNK ? n - lo : GDSB_CHUNK) : 0;
    const unsigned char* base = (const unsigned char*)(gdsb_u64)ptrs[p];
    gdsb_chunk_cv(base + lo, len, index, nchunks == 1, cvs + 8 * t);
}

// Thread t of a parent level: node t of the next level of all pieces. in_starts / out_starts:
// cumulative node counts per piece of this level and the next (ceil(m / 2) each; 1 when m == 1).
GDSP_HD inline void gdsb_parent_node(gdsb_u64 t, const long long* in_starts,
                                     const long long* out_starts, gdsb_u64 npieces,
                                     const gdsb_u32* in_cvs, gdsb_u32* out_cvs) {
    gdsb_u64 p = gdsb_find(out_starts, npieces, t);
    gdsb_u64 i = t - (gdsb_u64)out_starts[p];
    gdsb_u64 m = (gdsb_u64)(in_starts[p + 1] - in_starts[p]);
    const gdsb_u32* left = in_cvs + 8 * ((gdsb_u64)in_starts[p] + 2 * i);
    if (2 * i + 1 < m) {
        gdsb_parent_cv(left, left + 8, m == 2, out_cvs + 8 * t);
    } else {
        for (int k = 0; k < 8; ++k) out_cvs[8 * t + k] = left[k];  // carried up unchanged
    }
}

extern "C" __global__ void gdsp_blake3_chunks(gdsb_u64 ptrs, gdsb_u64 lens, gdsb_u64 starts,
                                              gdsb_u64 npieces, gdsb_u64 total, gdsb_u64 cvs) {
    gdsb_u64 t = (gdsb_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= total) return;
    gdsb_chunk_node(t, (const long long*)ptrs, (const long long*)lens, (const long long*)starts,
                    npieces, (gdsb_u32*)cvs);
}

extern "C" __global__ void gdsp_blake3_parents(gdsb_u64 in_starts, gdsb_u64 out_starts,
                                               gdsb_u64 npieces, gdsb_u64 total,
                                               gdsb_u64 in_cvs, gdsb_u64 out_cvs) {
    gdsb_u64 t = (gdsb_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= total) return;
    gdsb_parent_node(t, (const long long*)in_starts, (const long long*)out_starts, npieces,
                     (const gdsb_u32*)in_cvs, (gdsb_u32*)out_cvs);
}
