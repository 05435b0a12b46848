"""The simulator's floor: how long this interpreter takes to wake N threads blocked on one event.

    python bench/thread_wake.py [--threads 8 64 128 1024] [--trials 20]

``bench/control_plane.py`` runs every simulated rank as a Python thread, and each simulated step
ends with every rank woken at least twice (from its step's sleep, and from the vote). This times
the wake-up alone: N threads wait on one ``threading.Event``, it is set, and the time until the last
thread ran is taken (median and max over ``--trials``), with the time per thread. Threads of one
interpreter wake one at a time (each takes the interpreter lock), so the figure grows with N; the
smallest N is the baseline the others are read against.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def wake_all(n: int) -> float:
    """Seconds from setting one event to the last of ``n`` threads waiting on it having run."""
    go, woken, lock, last = threading.Event(), [], threading.Lock(), threading.Event()

    def wait() -> None:
        go.wait()
        with lock:
            woken.append(time.perf_counter())
            if len(woken) == n:
                last.set()

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)  # every thread blocked in the wait
    start = time.perf_counter()
    go.set()
    if not last.wait(timeout=60.0):
        raise SystemExit(f"{n} threads: not all woke within 60 s")
    for thread in threads:
        thread.join(timeout=10.0)
    return max(woken) - start


def main(argv: list[str] | None = None) -> list[tuple[int, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[8, 64, 128, 1024])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args(argv)
    if min(args.threads) < 1 or args.trials < 1:
        raise SystemExit("--threads and --trials must be at least 1")
    rows = []
    print(f"{'threads':>8} {'median':>10} {'max':>10} {'per thread':>11} {'x baseline':>11}")
    for n in sorted(args.threads):
        times = [wake_all(n) for _ in range(args.trials)]
        median = statistics.median(times)
        rows.append((n, median, max(times)))
        print(
            f"{n:>8} {median * 1e3:>8.2f}ms {max(times) * 1e3:>8.2f}ms {median / n * 1e6:>9.1f}us "
            f"{median / rows[0][1]:>10.1f}x"
        )
    print(f"(baseline: {rows[0][0]} threads; one interpreter, woken one at a time)")
    return rows


if __name__ == "__main__":
    main()
