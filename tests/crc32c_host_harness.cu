// Runs the per-thread code of kernels/crc32c.cu on the CPU (compiled by nvcc as host code), so
// the CPU tests check the kernel's own arithmetic without a GPU. Used by tests/test_kernels.py.
//
//   harness crc FILE SEG MISALIGN   CRC32C of FILE's bytes placed MISALIGN bytes past an 8-aligned
//                                   address, computed segment by segment exactly as the grid does;
//                                   prints "total nsegments crc(seg0) crc(seg1) ..." in hex
//   harness shift NBYTES CRC        prints gdsp_multiply(gdsp_x_pow_8n(NBYTES), CRC) in hex
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../kernels/crc32c.cu"

static int run_crc(const char* path, gdsp_u64 seg, unsigned misalign) {
    FILE* f = std::fopen(path, "rb");
    if (!f) { std::perror(path); return 2; }
    std::fseek(f, 0, SEEK_END);
    long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    unsigned char* base = (unsigned char*)std::malloc((size_t)n + 16);  // malloc: 16-aligned
    unsigned char* data = base + misalign;
    if (n && std::fread(data, 1, (size_t)n, f) != (size_t)n) { std::perror("fread"); return 2; }
    std::fclose(f);

    static gdsp_u32 tab[8 * 256];
    for (int j = 0; j < 8 * 256; ++j) tab[j] = gdsp_table_entry(j >> 8, j & 255);

    gdsp_u64 segments = ((gdsp_u64)n + seg - 1) / seg;
    gdsp_u32 total = 0;
    gdsp_u32* own = (gdsp_u32*)std::malloc((segments + 1) * sizeof(gdsp_u32));
    for (gdsp_u64 k = segments; k-- > 0;) {  // any order: XOR commutes, like the atomics
        total ^= gdsp_segment_contribution(tab, data, (gdsp_u64)n, seg, k, &own[k]);
    }
    std::printf("%08x %llu", total, segments);
    for (gdsp_u64 k = 0; k < segments; ++k) std::printf(" %08x", own[k]);
    std::printf("\n");
    std::free(own);
    std::free(base);
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 5 && std::strcmp(argv[1], "crc") == 0) {
        return run_crc(argv[2], std::strtoull(argv[3], 0, 10), (unsigned)std::strtoul(argv[4], 0, 10));
    }
    if (argc == 4 && std::strcmp(argv[1], "shift") == 0) {
        gdsp_u64 nbytes = std::strtoull(argv[2], 0, 10);
        gdsp_u32 crc = (gdsp_u32)std::strtoul(argv[3], 0, 10);
        std::printf("%08x\n", gdsp_multiply(gdsp_x_pow_8n(nbytes), crc));
        return 0;
    }
    std::fprintf(stderr, "usage: %s crc FILE SEG MISALIGN | shift NBYTES CRC\n", argv[0]);
    return 2;
}
