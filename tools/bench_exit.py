"""How long `mindspec serve` takes to exit: start it, wait until every graph has run (idle), send SIGINT,
and time from its "server stopped" line to the process's end (and its memory then).

    .venv/bin/python tools/bench_exit.py [--port 18601] [--max-batch 8] [--max-seq 512]
"""
import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", default="18601")
    ap.add_argument("--max-batch", default="8")
    ap.add_argument("--max-seq", default="512")
    a = ap.parse_args()
    exe = os.path.join(os.path.dirname(sys.executable), "mindspec")
    p = subprocess.Popen([exe, "serve", "--port", a.port, "--max-batch", a.max_batch, "--max-seq", a.max_seq],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while True:  # ready, and every graph loaded and run
        time.sleep(2)
        try:
            m = urllib.request.urlopen(f"http://127.0.0.1:{a.port}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        if "mindspec_graphs_cold 0.0" in m and "mindspec_engine_healthy 1.0" in m:
            break
    with open(f"/proc/{p.pid}/status") as f:
        rss = int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1e6
    print(f"every graph in after {time.time() - t0:.0f} s, {rss:.1f} GB", flush=True)
    p.send_signal(signal.SIGINT)
    for line in p.stderr:
        if "server stopped" in line:
            t = time.time()
            break
    p.wait()
    print(f"exit code {p.returncode}, {time.time() - t:.2f} s after 'server stopped'")


if __name__ == "__main__":
    main()
