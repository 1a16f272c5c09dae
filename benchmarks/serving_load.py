"""Load test on loopback: dynamic batching vs serving one instance at a time (TreeLSTM).

A server process (stdlib HTTP on 127.0.0.1, one intra-op thread) encodes one UD sentence per
request with a Child-Sum TreeLSTM, either one request at a time (eager ``model(sentence)`` behind a
lock: what a server does without batching) or through a :class:`batchcraft.serving.DynamicBatcher`
(requests gathered up to ``--max-batch`` or ``--max-wait-ms``, run as one ``autobatch`` call). The
client sends POSTs with open-loop Poisson arrivals at each rate; latency runs from the scheduled
arrival to the answer (so a server that falls behind is charged for the queue). Every run is
bounded in requests and time.

    flock /tmp/batchcraft-cpu.lock python benchmarks/serving_load.py [--rates 50,100,200,400,800]
        [--seconds 3] [--hidden 256] [--plot docs/scale-out-serving.png] [--write-doc]
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# -- server ------------------------------------------------------------------------------------

def _sentence(body: dict, vocab, upos_vocab):
    from batchcraft.data import Sentence

    heads = body["heads"]
    children = [[] for _ in heads]
    for i, h in enumerate(heads):
        if h >= 0:
            children[h].append(i)
    s = Sentence(words=body["words"], upos=body["upos"], heads=heads, deprels=["_"] * len(heads),
                 children=children, root=heads.index(-1))
    s.word_ids = [vocab.stoi.get(w.lower(), 0) for w in s.words]
    s.upos_ids = [upos_vocab.stoi.get(t, 0) for t in s.upos]
    return s


def serve(mode: str, hidden: int, max_batch: int, max_wait_ms: float) -> None:
    import torch

    import batchcraft
    from batchcraft.data import UPOS_TAGS, Vocab, encode, load_sentences
    from batchcraft.models.treelstm import TreeLSTM
    from batchcraft.serving import DynamicBatcher

    torch.set_num_threads(1)
    sents = load_sentences()
    vocab = Vocab.from_sentences(sents)
    encode(sents, vocab)
    upos_vocab = Vocab(UPOS_TAGS)
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), hidden=hidden).eval()
    with torch.no_grad():  # warm-up: each signature is traced on first sight
        f = batchcraft.autobatch(model)
        for k in range(0, 512, 32):
            f(sents[k:k + 32])
        for s in sents[:50]:
            model(s)
    lock = threading.Lock()
    batcher = DynamicBatcher(f, max_batch_size=max_batch, max_wait_s=max_wait_ms / 1e3) if mode == "batched" else None

    def answer(s):
        if batcher is not None:
            return batcher(s)
        with lock, torch.no_grad():
            return model(s)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            h = answer(_sentence(body, vocab, upos_vocab))
            # a small answer (the root state's norm and first values): serialising 256 floats
            # would cost more than the model at low load
            out = json.dumps({"norm": float(h.norm()), "head": h[:4].tolist()}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    # I/O threads must get the GIL while the batcher records a batch (Python-heavy): switch
    # more often than every 5 ms; keep-alive connections (the client reuses them) avoid a new
    # thread per request
    sys.setswitchinterval(0.001)
    ThreadingHTTPServer.request_queue_size = 512
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    print(f"PORT {httpd.server_address[1]}", flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), httpd.shutdown()), daemon=True).start()
    httpd.serve_forever()  # until the client closes our stdin
    if batcher is not None:
        batcher.close(timeout=30)
        print(f"BATCHES {json.dumps(batcher.stats.batch_sizes)}", flush=True)


# -- client ------------------------------------------------------------------------------------

_local = threading.local()


def _post(port: int, payload: bytes, timeout_s: float) -> bool:
    """One POST on this client thread's keep-alive connection (reopened after an error)."""
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status == 200
    except (OSError, http.client.HTTPException):
        conn.close()
        _local.conn = None
        return False


def load(port: int, payloads: list[bytes], rate: float, seconds: float, max_requests: int,
         timeout_s: float, seed: int = 0) -> dict:
    """Open-loop Poisson arrivals at ``rate`` per second for ``seconds`` (at most ``max_requests``)."""
    rng = random.Random(seed)
    n = min(max_requests, max(1, int(rate * seconds)))
    t, sched = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        sched.append(t)
    order = [rng.randrange(len(payloads)) for _ in range(n)]
    results: list = [None] * n
    start = time.perf_counter() + 0.05

    def one(i):
        delay = start + sched[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        ok = _post(port, payloads[order[i]], timeout_s)
        results[i] = (ok, time.perf_counter() - (start + sched[i]), time.perf_counter())

    def close():
        if getattr(_local, "conn", None) is not None:
            _local.conn.close()
            _local.conn = None

    with ThreadPoolExecutor(max_workers=96) as pool:
        list(pool.map(one, range(n)))
        list(pool.map(lambda _: close(), range(96)))
    ok = [r for r in results if r[0]]
    lat = sorted(r[1] for r in ok)
    end = max((r[2] for r in ok), default=start)
    return {"offered_rps": rate, "requests": n, "ok": len(ok),
            "throughput_rps": len(ok) / (end - start) if ok else 0.0,
            "p50_ms": 1e3 * lat[len(lat) // 2] if lat else math.nan,
            "p99_ms": 1e3 * lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] if lat else math.nan}


def run_mode(mode: str, args, payloads) -> tuple[list[dict], list[int]]:
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", mode, "--hidden", str(args.hidden),
           "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        line = server.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"server did not start: {line!r}")
        port = int(line.split()[1])
        rows = []
        for rate in args.rates:
            row = load(port, payloads, rate, args.seconds, args.max_requests, args.timeout_s)
            row["mode"] = mode
            rows.append(row)
            print(f"{mode:>15} {rate:6.0f} req/s offered: {row['throughput_rps']:6.1f} req/s, "
                  f"p50 {row['p50_ms']:7.1f} ms, p99 {row['p99_ms']:7.1f} ms ({row['ok']}/{row['requests']} ok)",
                  file=sys.stderr)
        server.stdin.close()  # the server's signal to stop
        out = server.stdout.read()
        server.wait(timeout=60)
        batches = json.loads(out.split("BATCHES ", 1)[1]) if "BATCHES " in out else []
        return rows, batches
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def table(rows: list[dict]) -> str:
    by = {(r["mode"], r["offered_rps"]): r for r in rows}
    rates = sorted({r["offered_rps"] for r in rows})
    lines = ["| offered (req/s) | one at a time: req/s | p50 ms | p99 ms | dynamic batching: req/s | p50 ms | p99 ms | throughput ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rate in rates:
        a, b = by[("one-at-a-time", rate)], by[("batched", rate)]
        lines.append(f"| {rate:.0f} | {a['throughput_rps']:.0f} | {a['p50_ms']:.1f} | {a['p99_ms']:.1f} | "
                     f"{b['throughput_rps']:.0f} | {b['p50_ms']:.1f} | {b['p99_ms']:.1f} | "
                     f"{b['throughput_rps'] / a['throughput_rps']:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style, color in (("one-at-a-time", "o-", "tab:blue"), ("batched", "s-", "tab:orange")):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["offered_rps"])
        x = [r["offered_rps"] for r in rs]
        label = "one instance at a time" if mode == "one-at-a-time" else "dynamic batching (autobatch)"
        ax1.plot(x, [r["throughput_rps"] for r in rs], style, color=color, label=label)
        ax2.plot(x, [r["p50_ms"] for r in rs], style, color=color, label=f"{label}, p50")
        ax2.plot(x, [r["p99_ms"] for r in rs], style.replace("-", "--"), color=color, alpha=0.5,
                 label=f"{label}, p99")
    ax1.plot(x, x, ":", color="grey", label="offered")
    ax1.set(xlabel="offered load (requests/s)", ylabel="throughput (requests/s)", xscale="log", yscale="log")
    ax2.set(xlabel="offered load (requests/s)", ylabel="latency (ms)", xscale="log", yscale="log")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", choices=["one-at-a-time", "batched"], help=argparse.SUPPRESS)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[50, 100, 200, 400, 800])
    ap.add_argument("--seconds", type=float, default=3.0, help="arrival window per rate")
    ap.add_argument("--max-requests", type=int, default=1500, help="requests per rate at most")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="per request")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--write-doc", action="store_true", help="put the table into docs/scale-out.md")
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.hidden, args.max_batch, args.max_wait_ms)
        return 0
    from batchcraft.data import load_sentences
    from batchcraft.measure.machine import machine_info

    sents = load_sentences(limit=400)
    payloads = [json.dumps({"words": s.words, "upos": s.upos, "heads": s.heads}).encode() for s in sents]
    rows, batches = [], {}
    t0 = time.perf_counter()
    for mode in ("one-at-a-time", "batched"):
        r, b = run_mode(mode, args, payloads)
        rows += r
        batches[mode] = b
    sizes = batches.get("batched") or [0]
    info = machine_info()
    text = (f"{table(rows)}\n\nTreeLSTM hidden {args.hidden}, UD EWT sentences (mean "
            f"{statistics.mean(len(s) for s in sents):.1f} words), server 1 intra-op thread, client on the "
            f"same 2-core machine; dynamic batching: max batch {args.max_batch}, max wait {args.max_wait_ms:g} ms, "
            f"mean batch {statistics.mean(sizes):.1f} instances (max {max(sizes)}); {args.seconds:g} s of Poisson "
            f"arrivals per rate; torch {info.get('torch')}. Command: `flock /tmp/batchcraft-cpu.lock "
            f"python benchmarks/serving_load.py --rates {','.join(f'{r:g}' for r in args.rates)} "
            f"--seconds {args.seconds:g}`; {time.perf_counter() - t0:.0f} s.")
    print(text)
    from _report import ROOT, save_json, write_section

    save_json("serving_load", {"rows": rows, "batch_sizes": batches, "machine": info, "args": vars(args)})
    if args.plot:
        plot(rows, args.plot, f"TreeLSTM h{args.hidden} over HTTP on loopback (2-core CPU)")
    if args.write_doc:
        write_section("serving-load", text, ROOT / "docs" / "scale-out.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
