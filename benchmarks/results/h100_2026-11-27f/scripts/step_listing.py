"""Per-step kernel listing from `step_kernels.py`'s CSVs: one steady decode step (between two of the window's
largest gaps), kernels grouped by name: count, total us, and the idle time before them."""
import collections
import csv
import statistics
import sys

for path in sys.argv[1:]:
    rows = [(r["name"], float(r["start_us"]), float(r["dur_us"])) for r in csv.DictReader(open(path))]
    gaps = sorted(((rows[i + 1][1] - rows[i][1] - rows[i][2], i) for i in range(len(rows) - 1)), reverse=True)
    cuts = sorted(i for g, i in gaps[:25] if g > 15)
    start, end = cuts[len(cuts) // 2] + 1, cuts[len(cuts) // 2 + 1] + 1
    step = rows[start:end]
    span = step[-1][1] + step[-1][2] - step[0][1]
    print(f"== {path}: {len(step)} kernels, span {span:.1f} us, busy {sum(r[2] for r in step):.1f} us")
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    prev = None
    for name, st, dur in step:
        a = agg[name[:72]]
        a[0] += 1
        a[1] += dur
        if prev is not None:
            a[2] += st - prev
        prev = st + dur
    for name, (count, dur, gap) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print(f"  {count:4d} {dur:8.1f} us  idle before {gap:7.1f} us  {name}")
    dec = [r[2] for r in rows if r[0].startswith("_paged_decode_kernel")]
    print(f"  decode kernel over the window: {len(dec)} launches, mean {statistics.mean(dec):.1f} us")
