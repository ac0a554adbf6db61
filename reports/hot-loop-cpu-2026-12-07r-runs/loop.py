import sys, time, json, urllib.request, random
url = "http://127.0.0.1:31000/generate"
n, toks = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 300
rng = random.Random(0)
per = []
for i in range(n):
    body = {"input_ids": [rng.randrange(1, 512) for _ in range(192)],
            "sampling_params": {"max_new_tokens": toks, "ignore_eos": True, "temperature": 0}}
    t = time.perf_counter()
    r = urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}))
    out = json.loads(r.read())
    per.append((time.perf_counter() - t) / toks * 1e3)
per.sort()
print("ms/token median %.3f min %.3f max %.3f" % (per[len(per)//2], per[0], per[-1]))
