// Runs the per-thread code of kernels/blake3.cu on the CPU (compiled by nvcc as host code), so
// the CPU tests check the kernel's own arithmetic without a GPU. Used by tests/test_kernels.py.
//
//   harness hash FILE MISALIGN LEN...   cuts FILE's bytes into pieces of the given lengths (the
//                                       rest is one more piece), each copied MISALIGN bytes past
//                                       an 8-aligned address, and hashes all of them together
//                                       level by level exactly as gds_persist/transfer/
//                                       device_hash.py launches the kernels (thread t of each
//                                       launch run in a loop); prints one line per piece: the
//                                       first 16 bytes of its BLAKE3 digest in hex
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../kernels/blake3.cu"

static int run_hash(const char* path, unsigned misalign, int nlens, char** lens_arg) {
    FILE* f = std::fopen(path, "rb");
    if (!f) { std::perror(path); return 2; }
    std::fseek(f, 0, SEEK_END);
    long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    std::vector<unsigned char> all((size_t)n + 1);
    if (n && std::fread(all.data(), 1, (size_t)n, f) != (size_t)n) { std::perror("fread"); return 2; }
    std::fclose(f);

    std::vector<long long> lens;
    long long used = 0;
    for (int i = 0; i < nlens; ++i) {
        long long len = std::strtoll(lens_arg[i], 0, 10);
        if (len < 0 || used + len > n) { std::fprintf(stderr, "bad length\n"); return 2; }
        lens.push_back(len);
        used += len;
    }
    lens.push_back(n - used);
    gdsb_u64 npieces = lens.size();

    std::vector<unsigned char*> blocks;
    std::vector<long long> ptrs, starts(1, 0);
    long long at = 0;
    for (gdsb_u64 p = 0; p < npieces; ++p) {
        unsigned char* b = (unsigned char*)std::malloc((size_t)lens[p] + 16);  // 16-aligned
        std::memcpy(b + misalign, all.data() + at, (size_t)lens[p]);
        at += lens[p];
        blocks.push_back(b);
        ptrs.push_back((long long)(gdsb_u64)(b + misalign));
        long long chunks = lens[p] ? (lens[p] + 1023) / 1024 : 1;
        starts.push_back(starts.back() + chunks);
    }
    gdsb_u64 total = (gdsb_u64)starts.back();
    std::vector<gdsb_u32> cvs(8 * total), next;
    for (gdsb_u64 t = 0; t < total; ++t) {  // the chunk launch
        gdsb_chunk_node(t, ptrs.data(), lens.data(), starts.data(), npieces, cvs.data());
    }
    std::vector<long long> in_starts = starts;
    for (;;) {  // parent launches until every piece is one CV
        bool more = false;
        std::vector<long long> out_starts(1, 0);
        for (gdsb_u64 p = 0; p < npieces; ++p) {
            long long m = in_starts[p + 1] - in_starts[p];
            if (m > 1) more = true;
            out_starts.push_back(out_starts.back() + (m > 1 ? (m + 1) / 2 : 1));
        }
        if (!more) break;
        gdsb_u64 out_total = (gdsb_u64)out_starts.back();
        next.assign(8 * out_total, 0);
        for (gdsb_u64 t = 0; t < out_total; ++t) {
            gdsb_parent_node(t, in_starts.data(), out_starts.data(), npieces, cvs.data(),
                             next.data());
        }
        cvs.swap(next);
        in_starts = out_starts;
    }
    for (gdsb_u64 p = 0; p < npieces; ++p) {
        const gdsb_u32* cv = cvs.data() + 8 * in_starts[p];
        for (int i = 0; i < 4; ++i) {
            for (int b = 0; b < 4; ++b) std::printf("%02x", (cv[i] >> (8 * b)) & 0xffu);
        }
        std::printf("\n");
        std::free(blocks[p]);
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 4 && std::strcmp(argv[1], "hash") == 0) {
        return run_hash(argv[2], (unsigned)std::strtoul(argv[3], 0, 10), argc - 4, argv + 4);
    }
    std::fprintf(stderr, "usage: %s hash FILE MISALIGN LEN...\n", argv[0]);
    return 2;
}
