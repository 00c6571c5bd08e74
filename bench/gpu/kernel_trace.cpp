// Kernel timeline by CUPTI injection (benchmarks only; never linked into kestrel). Run any CUDA program with
//   CUDA_INJECTION64_PATH=build/bench/libkestrel_kernel_trace.so KESTREL_TRACE_OUT=trace.csv PROGRAM ...
// and the CUDA driver loads this library at the program's first CUDA call and runs InitializeInjection(), which
// enables CUPTI's concurrent-kernel activity records; at exit one CSV line per kernel goes to KESTREL_TRACE_OUT
// (default kernel_trace.csv): start and end in ns on the GPU's clock, the graph and graph node it came from (0
// outside graphs), the correlation id of the launching API call (one per cudaGraphLaunch: a replay's kernels
// share it), stream, grid, block and the kernel's short name. bench/gpu/timeline.py turns it into a per-replay
// table with each kernel's gap to (or overlap with) the previous one.
//
// Why: Nsight Compute serialises kernels, so it cannot show what programmatic dependent launch overlaps inside the
// decode step's graph, and the GPU machine's only nsys (the collector bundled with Nsight Compute) writes a trace
// it cannot import (bench/RESULTS.md, session 27).
#include <cupti.h>

#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Rec {
  uint64_t start, end, graph_node;
  uint32_t graph, corr, stream;
  int gx, gy, gz, bx;
  std::string name;
};

std::mutex g_mu;
std::vector<Rec>* g_recs = nullptr;  // leaked on purpose: written from CUPTI's thread until the process exits
constexpr size_t kBufBytes = size_t(8) << 20;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  std::fprintf(stderr, "kernel_trace: %s: %s\n", what, s ? s : "?");
}

// The identifier of a (demangled) kernel name: "void ns::(anonymous namespace)::k<1, 2>(Args)" -> "k".
std::string short_name(const char* mangled) {
  if (!mangled) return "?";
  int st = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &st);
  std::string s = st == 0 && d ? d : mangled;
  std::free(d);
  for (size_t at; (at = s.find("(anonymous namespace)::")) != std::string::npos;) s.erase(at, 23);
  s = s.substr(0, s.find_first_of("<("));  // the template arguments or the parameters end it
  const size_t colon = s.rfind("::"), space = s.rfind(' ');
  const size_t from = colon != std::string::npos ? colon + 2 : space != std::string::npos ? space + 1 : 0;
  return s.substr(from);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufBytes));
  *size = kBufBytes;
  *max_records = 0;
}

size_t g_dropped = 0;

void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t, size_t valid) {
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_dropped += dropped;
  }
  CUpti_Activity* rec = nullptr;
  std::vector<Rec> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    got.push_back(Rec{k->start, k->end, k->graphNodeId, k->graphId, k->correlationId, k->streamId, k->gridX, k->gridY,
                      k->gridZ, k->blockX, short_name(k->name)});
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_recs->insert(g_recs->end(), got.begin(), got.end());
}

void write_out() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char* path = std::getenv("KESTREL_TRACE_OUT");
  std::FILE* f = std::fopen(path ? path : "kernel_trace.csv", "w");
  if (!f) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path ? path : "kernel_trace.csv");
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(f, "start_ns,end_ns,graph,graph_node,corr,stream,grid,block,name\n");
  for (const Rec& r : *g_recs)
    std::fprintf(f, "%llu,%llu,%u,%llu,%u,%u,%dx%dx%d,%d,%s\n", (unsigned long long)r.start, (unsigned long long)r.end,
                 r.graph, (unsigned long long)r.graph_node, r.corr, r.stream, r.gx, r.gy, r.gz, r.bx, r.name.c_str());
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu kernels -> %s (%zu records dropped by CUPTI)\n", g_recs->size(),
               path ? path : "kernel_trace.csv", g_dropped);
}

}  // namespace

extern "C" int InitializeInjection(void) {
  g_recs = new std::vector<Rec>();
  g_recs->reserve(size_t(1) << 20);
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable concurrent kernels");
  std::atexit(write_out);
  return 1;
}
