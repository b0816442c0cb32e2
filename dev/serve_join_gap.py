"""What a request joining a busy server costs the one already generating: one client streams 96 greedy tokens, a
second sends a long prompt 4 s later; prints the first client's largest and median gap between tokens, and the
second's time to first token. Start the server first, e.g.

    ggufspec serve qwen2.5-coder-1.5b -np 2 -c 8192 --prompt-chunk 128 --port 8092 &
    python dev/serve_join_gap.py 8092

(the joining prompt is the first 3,000 characters of ggufspec/serving.py: some 730 tokens)."""

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path


def stream(port: int, body: dict, out: list) -> None:
    """Each text piece's seconds since the request was sent, then the last event's usage."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"})
    start = time.time()
    with urllib.request.urlopen(request, timeout=900) as answer:
        for line in answer:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if event["choices"][0].get("text"):
                    out.append(time.time() - start)
                if "usage" in event:
                    out.append(event["usage"])


def main(port: int) -> None:
    greedy = {"ignore_eos": True, "temperature": 0, "mode": "target"}
    source = (Path(__file__).resolve().parents[1] / "ggufspec" / "serving.py").read_text()[:3000]
    first, second = [], []
    running = threading.Thread(target=stream, args=(port, {"prompt": "def quicksort(a):", "max_tokens": 96, **greedy},
                                                    first))
    running.start()
    time.sleep(4)
    joining = threading.Thread(target=stream, args=(port, {"prompt": source + "\n# What groups() does:", "max_tokens": 8,
                                                           **greedy}, second))
    joining.start()
    running.join()
    joining.join()
    times = [x for x in first if isinstance(x, float)]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    print(f"running request: {len(times)} pieces, largest gap {gaps[-1]:.2f} s, median gap {gaps[len(gaps) // 2]:.2f} s")
    print(f"joining request: first token after {next(x for x in second if isinstance(x, float)):.2f} s, "
          f"{second[-1]['prompt_tokens']} prompt tokens")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8080)
