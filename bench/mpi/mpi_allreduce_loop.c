/* mpi_allreduce_loop: the baseline for cohort's MPI engine, a plain loop
 * around MPI_Allreduce (float32, sum, in place), timed the way cohort-bench
 * times its own: warm-up, barrier, `iters` operations back to back, and the
 * slowest rank's mean per operation. busbw follows nccl-tests:
 * bytes / time * 2(n-1)/n.
 *
 *   mpirun -np 2 mpi_allreduce_loop [--iters N] [--json] BYTES...
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int iters_for(long bytes) {
  long n = (64L << 20) / bytes; /* ~64 MiB of traffic, as cohort-bench */
  return (int)(n < 5 ? 5 : n > 200 ? 200 : n);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int fixed_iters = 0, json = 0;
  for (int a = 1; a < argc; ++a) {
    if (!strcmp(argv[a], "--iters") && a + 1 < argc) {
      fixed_iters = atoi(argv[++a]);
    } else if (!strcmp(argv[a], "--json")) {
      json = 1;
    }
  }
  if (rank == 0 && !json) {
    printf("# mpi_allreduce_loop  world %d  float32 sum\n%12s %8s %12s %12s\n", size, "bytes",
           "iters", "time(us)", "busbw(GB/s)");
  }
  for (int a = 1; a < argc; ++a) {
    if (!strcmp(argv[a], "--iters")) { ++a; continue; }
    if (!strcmp(argv[a], "--json")) continue;
    const long bytes = atol(argv[a]);
    const int count = (int)(bytes / (long)sizeof(float));
    if (count <= 0) continue;
    float* buf = malloc((size_t)count * sizeof(float));
    for (int i = 0; i < count; ++i) buf[i] = 1.0f;
    const int iters = fixed_iters > 0 ? fixed_iters : iters_for(bytes);
    for (int i = 0; i < 3; ++i) {
      MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int i = 0; i < iters; ++i) {
      MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    double us = (MPI_Wtime() - start) / iters * 1e6;
    MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const double algbw = (double)count * sizeof(float) / us / 1e3;
    const double busbw = size > 1 ? algbw * 2.0 * (size - 1) / size : 0.0;
    if (rank == 0) {
      if (json) {
        printf("{\"backend\":\"plain-mpi\",\"world\":%d,\"bytes\":%ld,\"iters\":%d,\"us\":%.3f,"
               "\"algbw_gbs\":%.4f,\"busbw_gbs\":%.4f}\n",
               size, (long)count * (long)sizeof(float), iters, us, algbw, busbw);
      } else {
        printf("%12ld %8d %12.2f %12.3f\n", (long)count * (long)sizeof(float), iters, us, busbw);
      }
      fflush(stdout);
    }
    free(buf);
  }
  MPI_Finalize();
  return 0;
}
