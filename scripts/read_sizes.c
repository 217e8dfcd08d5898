/* Random-read rate of a file's disk against the read's size, at a fixed queue depth: the curve the disk tier's rule
   for merging reads across gaps is chosen from (docs/engine.md, "Models larger than memory"; docs/bench.md, "Fewer,
   larger reads"). THREADS threads each issue O_DIRECT reads of one size at random page-aligned offsets of FILE for
   SECONDS; one JSON line per size: reads/s, MB/s and the wall time per read at that depth. In C, not Python: an
   interpreter's per-call cost caps small reads below the disk's rate on two cores.

   cc -O2 -pthread scripts/read_sizes.c -o read_sizes
   ./read_sizes FILE [THREADS=32] [SECONDS=3] [SIZE_BYTES ...=4096 8192 16384 24576 32768 65536 131072]
   e.g. ./read_sizes relu7b.q4_0.powerinfer.gguf.neurons 32 3 8192 16384 24576 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { kMaxThreads = 256 };

struct Probe {
    int fd;
    long size, pages;
    double stop;
    long reads[kMaxThreads];
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

struct Arg {
    struct Probe *p;
    long i;
};

static void *reader(void *v) {
    struct Arg *a = v;
    struct Probe *p = a->p;
    void *buf;
    if (posix_memalign(&buf, 4096, (size_t)p->size) != 0) { fprintf(stderr, "read_sizes: out of memory\n"); exit(1); }
    unsigned seed = 1234u + 7919u * (unsigned)a->i;
    long n = 0;
    while (now() < p->stop)
        for (int k = 0; k < 64; ++k, ++n) {
            const unsigned long r = ((unsigned long)rand_r(&seed) << 31) ^ (unsigned long)rand_r(&seed);
            if (pread(p->fd, buf, (size_t)p->size, (off_t)(r % (unsigned long)p->pages) * 4096) != p->size) {
                perror("read_sizes: pread");
                exit(1);
            }
        }
    p->reads[a->i] = n;
    free(buf);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fprintf(argc < 2 ? stderr : stdout,
                "usage: read_sizes FILE [THREADS=32] [SECONDS=3] [SIZE_BYTES ...=4096 8192 16384 24576 32768 65536 131072]\n"
                "random O_DIRECT reads of each size at THREADS in flight; one JSON line per size\n");
        return argc < 2 ? 2 : 0;
    }
    static struct Probe p;
    p.fd = open(argv[1], O_RDONLY | O_DIRECT);
    if (p.fd < 0) { perror("read_sizes: open (O_DIRECT)"); return 1; }
    struct stat st;
    fstat(p.fd, &st);
    const int threads = argc > 2 ? atoi(argv[2]) : 32;
    const double seconds = argc > 3 ? atof(argv[3]) : 3.0;
    if (threads < 1 || threads > kMaxThreads || seconds <= 0) { fprintf(stderr, "read_sizes: THREADS in 1..256, SECONDS > 0\n"); return 2; }
    static const long defaults[] = {4096, 8192, 16384, 24576, 32768, 65536, 131072};
    const int n_sizes = argc > 4 ? argc - 4 : (int)(sizeof defaults / sizeof defaults[0]);
    for (int s = 0; s < n_sizes; ++s) {
        p.size = argc > 4 ? atol(argv[4 + s]) : defaults[s];
        if (p.size < 512 || p.size % 512 || p.size >= st.st_size) { fprintf(stderr, "read_sizes: sizes are multiples of 512 below the file's\n"); return 2; }
        p.pages = (st.st_size - p.size) / 4096;
        pthread_t t[kMaxThreads];
        struct Arg args[kMaxThreads];
        const double t0 = now();
        p.stop = t0 + seconds;
        for (long i = 0; i < threads; ++i) {
            args[i] = (struct Arg){&p, i};
            pthread_create(&t[i], NULL, reader, &args[i]);
        }
        long total = 0;
        for (int i = 0; i < threads; ++i) {
            pthread_join(t[i], NULL);
            total += p.reads[i];
        }
        const double el = now() - t0;
        printf("{\"bytes\": %ld, \"threads\": %d, \"reads_per_s\": %.0f, \"mb_per_s\": %.1f, \"us_per_read\": %.2f}\n", p.size,
               threads, (double)total / el, (double)total * (double)p.size / el / 1e6, el / (double)total * 1e6);
        fflush(stdout);
    }
    return 0;
}
