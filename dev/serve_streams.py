"""N clients at once streaming greedy fixed-length completions from an OpenAI-compatible server (ggufspec serve or
llama-server): per client the gaps between text pieces, then the median gap, the aggregate tok/s and the median
time to first token. For profiling a loaded server against another on the same prompts, e.g.

    ggufspec serve -m TARGET.gguf -np 4 -c 4096 --mode target --port 8094 &
    python dev/serve_streams.py 8094 4 64
    llama-server -m TARGET.gguf -np 4 -c 4096 -t 2 --port 8095 &
    python dev/serve_streams.py 8095 4 64

(arguments: port, clients, tokens per request, and optionally ggufspec's `mode` per request, target by default;
each client sends one of four short code prompts)."""

import json
import statistics
import sys
import threading
import time
import urllib.request

PROMPTS = ["def quicksort(a):", "class LinkedList:\n    def __init__(self):", "import json\n\ndef load(path):",
           "# Print the primes below 100\n"]


def stream(port: int, prompt: str, n: int, out: list, mode: str = "target") -> None:
    """Seconds since sending at each text piece."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "mode": mode}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as answer:
        for line in answer:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                out.append(time.perf_counter() - start)


def main(port: int, clients: int, n: int, mode: str = "target") -> None:
    stream(port, PROMPTS[0], 4, [], mode)  # warm-up
    times = [[] for _ in range(clients)]
    threads = [threading.Thread(target=stream, args=(port, PROMPTS[i % len(PROMPTS)], n, times[i], mode))
               for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    print(f"{mode}: {clients} clients x {n} tokens: {clients * n / wall:.2f} tok/s in all, median gap "
          f"{1000 * statistics.median(gaps):.1f} ms, first piece after {statistics.median(t[0] for t in times):.2f} s "
          f"(median), pieces {sum(map(len, times))}")
    long = [g for g in gaps if g > 1.5 * statistics.median(gaps)]
    print(f"  mean gap {1000 * statistics.mean(gaps):.1f} ms; {len(long)} gaps over 1.5x the median, "
          f"{sum(long):.2f} s in all; last piece after {max(t[-1] for t in times):.2f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
