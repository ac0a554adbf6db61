import glob, re, statistics, collections
rows = collections.defaultdict(list)
for f in sorted(glob.glob('/tmp/ab10/ob-*.md')):
    side = 'base' if '-base-' in f else 'head'
    for line in open(f):
        m = re.match(r'\| (\d+) \| (no overlap|overlap) \| 1 \| ([\d.]+) \|.*\| ([\d.]+) \| (\d+) \|$', line.strip())
        if m:
            bs, loop, it, dev = int(m[1]), m[2], float(m[3]), float(m[4])
            rows[(side, loop, bs)].append(round(100 * dev / it, 1))
for k in sorted(rows):
    print(k, rows[k], 'median', statistics.median(rows[k]))
