"""Count a `perf script -F comm,tid,ip,sym,dso` capture's samples (one thread) by where they are: inside the
executable's call, under XLA's per-execution constant allocation, and the callers of the allocator's leaf functions.
Usage: python perf-dwarf-callers.py <perf script output, .gz or plain>"""
import collections, gzip, re, sys

path = sys.argv[1]
lines = (gzip.open(path, "rt") if path.endswith(".gz") else open(path)).read().split("\n")
samples, cur = [], []
for line in lines:
    if not line.strip():
        if cur:
            samples.append(cur)
        cur = []
        continue
    if not line.startswith("\t") and not line.startswith(" " * 8):
        cur = []
        continue
    parts = line.strip().split(" ", 1)
    cur.append(re.sub(r"\+0x[0-9a-f]+", "", parts[1] if len(parts) > 1 else "?"))
if cur:
    samples.append(cur)
has = lambda s, k: any(k in x for x in s)  # noqa: E731
print("samples", len(samples))
print("in the executable's call (PjitFunction::Call / PjRtLoadedExecutable::Execute):",
      sum(has(s, "PjitFunction::Call") or has(s, "PjRtLoadedExecutable::Execute") for s in samples))
print("under xla::CpuDeviceMemory::CreateConstantMemory:", sum(has(s, "CreateConstantMemory") for s in samples))
print("under PyArray_MapIterNew:", sum(has(s, "PyArray_MapIterNew") for s in samples))
alloc = ("_int_free", "unlink_chunk", "_int_malloc", "malloc_consolidate", "_int_memalign", "_mid_memalign")
callers = collections.Counter()
for s in samples:
    if any(k in s[0] for k in alloc):
        fr = next((x for x in s[1:] if not any(k in x for k in ("libc", "malloc", "free", "unlink", "consolidate",
                                                                   "inlined", "operator new"))), "?")
        callers[fr[:120]] += 1
print("allocator leaf samples by first caller outside the allocator:")
for k, v in callers.most_common(12):
    print(f"  {v:4d} {k}")
