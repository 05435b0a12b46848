"""The node's batch-cache reader: runs the data pipeline once per node, ahead of training.

:func:`run_reader_process` is the process's body: the entry point
:mod:`ckless_lightning.data.cache_reader` runs it in a cold process, the fork server in a
forked one. Started by the node agent (which must not import Lightning, so neither does this
module)::

    python -m ckless_lightning.data.cache_reader --prepared PATH --root DIR --dp-ranks 0,1,2,3 \\
        --dp-size 4 --micro-batch-size 4 --seed 1234 --prefetch 8 --lookback 4 --start-step 0

It keeps every local consumer's window ``[want - lookback, want + prefetch)`` in the cache,
where ``want`` is the step the consumer last asked for through its ``want.<i>`` file
(:meth:`~ckless_lightning.data.batch_cache.BatchCacheReader.request`). Missing entries are
built nearest-first (the wanted steps themselves, then the rest of the windows in step
order); entries outside every window are evicted, so retention follows the slowest
consumer. A consumer that asks for a step far from the others (a restart) gets its own
window at once: that is the refill. Entries that fail verification are rebuilt. Runs until
SIGTERM and exits 0; a killed reader may be restarted at any time (it deletes its temp files
and keeps the valid entries).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckless_lightning.data.batch_cache import BatchCacheLayout, BatchCacheWriter, source_tag
from ckless_lightning.data.loader import StepBatchLoader
from ckless_lightning.data.packing import load_prepared
from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.contract import die_with_parent

__all__ = ["consumer_wants", "run_reader", "run_reader_process", "window_steps"]

Source = Callable[[int, int], dict[str, Any]]


def consumer_wants(layout: BatchCacheLayout, default: int) -> list[int]:
    """The step each local consumer asked for last (``default`` for one that has not asked yet)."""
    wants = []
    for i in range(layout.n_ranks):
        path = layout.want_path(i)
        try:
            text = path.read_text()
        except FileNotFoundError:
            wants.append(default)
            continue
        try:
            wants.append(int(text))
        except ValueError:
            raise ValueError(
                f"{path} holds {text!r}, not a step number; only BatchCacheReader.request may write it. "
                "Delete the file."
            ) from None
    return wants


def window_steps(wants: Sequence[int], prefetch: int, max_steps: int | None) -> list[int]:
    """Steps to have built, in build order: the wanted steps ascending, then the rest ascending."""
    first = sorted(set(wants))
    rest = sorted({s for w in first for s in range(w + 1, w + prefetch)} - set(first))
    return [s for s in first + rest if max_steps is None or s < max_steps]


def _as_source(
    layout: BatchCacheLayout, source_for_rank: dict[int, Callable[[int], dict]] | Source
) -> Source:
    if not isinstance(source_for_rank, dict):
        return source_for_rank
    missing = [r for r in layout.dp_ranks if r not in source_for_rank]
    if missing:
        raise ValueError(
            f"source_for_rank has no source for dp ranks {missing} of this node "
            f"(has {sorted(source_for_rank)})."
        )
    return lambda step, dp_rank: source_for_rank[dp_rank](step)


def run_reader(
    layout: BatchCacheLayout,
    source_for_rank: dict[int, Callable[[int], dict]] | Source,
    *,
    prefetch: int,
    lookback: int,
    start_step: int,
    max_steps: int | None,
    stop: threading.Event | Callable[[], bool],
    poll_s: float = 0.01,
    stall_at: int | None = None,
    on_stall: Callable[[int], None] | None = None,
) -> None:
    """Keep the node's cache filled around its consumers until ``stop`` says so.

    ``source_for_rank`` maps each local dp rank to ``batch(step)`` (``StepBatchLoader.batch``)
    or is one ``source(step, dp_rank)`` function. Nothing at or past ``max_steps`` is built.
    Source errors propagate (the reader exits; restarting it is safe).
    ``stall_at`` (fault injection, ``fault=reader_stall``): on reaching that step the reader stops
    building for good while it keeps running (``on_stall(step)`` first), as a wedged reader would.
    """
    if prefetch < 1 or lookback < 0:
        raise ValueError(f"prefetch={prefetch} must be >= 1 and lookback={lookback} >= 0.")
    writer = BatchCacheWriter(layout, _as_source(layout, source_for_rank))
    writer.clean_temp()
    if isinstance(stop, threading.Event):
        stopped: Callable[[], bool] = stop.is_set
        idle: Callable[[], Any] = lambda: stop.wait(poll_s)
    else:
        stopped, idle = stop, lambda: time.sleep(poll_s)
    built: set[int] = set()  # written or verified by this process and not evicted since
    while not stopped():
        wants = consumer_wants(layout, start_step)
        writer.evict_except({s for w in set(wants) for s in range(w - lookback, w + prefetch)})
        todo = window_steps(wants, prefetch, max_steps)
        built.intersection_update(todo)
        step = next((s for s in todo if s not in built or not layout.entry_path(s).exists()), None)
        if step is None:
            idle()
            continue
        if step == stall_at:
            if on_stall is not None:
                on_stall(step)
            while not stopped():
                time.sleep(1.0)
            return
        writer.write(step)  # rebuilds an entry that exists but fails verification
        built.add(step)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ckless_lightning.data.cache_reader",
        description="Fill one node's batch cache ahead of its ranks; runs until SIGTERM.",
    )
    parser.add_argument("--prepared", required=True, help="prepared dataset directory (prepare_dataset)")
    parser.add_argument("--root", required=True, help="this node's cache dir (create_cache_dir)")
    parser.add_argument("--dp-ranks", required=True, help="this node's dp ranks, local order: 0,1,2,3")
    parser.add_argument("--dp-size", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--lookback", type=int, default=4)
    parser.add_argument("--start-step", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--parent-pid", type=int, default=None, help="die with this parent (the node agent)")
    parser.add_argument(
        "--stall-at-step", type=int, default=None, help="fault injection: stop building at this step"
    )
    parser.add_argument("--events", default=None, help="the job's events.jsonl (for the injected stall)")
    parser.add_argument("--ready-fd", type=int, default=None, help="a pipe to the agent: a line says 'ready'")
    args = parser.parse_args(argv)
    try:
        args.dp_ranks = tuple(int(r) for r in args.dp_ranks.split(","))
    except ValueError:
        parser.error(f"--dp-ranks={args.dp_ranks!r} must be comma-separated integers, e.g. 0,1,2,3")
    return args


def run_reader_process(argv: Sequence[str] | None = None) -> int:
    """Entry point of the reader process; returns 0 after SIGTERM or SIGINT."""
    args = _parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    dataset = load_prepared(args.prepared)
    loaders = {
        r: StepBatchLoader(
            dataset,
            seed=args.seed,
            micro_batch_size=args.micro_batch_size,
            dp_rank=r,
            dp_size=args.dp_size,
            accumulate=args.accumulate,
        )
        for r in args.dp_ranks
    }
    layout = BatchCacheLayout(
        root=Path(args.root),
        dp_ranks=args.dp_ranks,
        micro_batch_size=args.micro_batch_size,
        row_len=len(dataset[0]["input_ids"]),
        source_tag=source_tag(args.prepared, args.seed, args.dp_size, args.micro_batch_size, args.accumulate),
    )
    if args.ready_fd is not None:  # imports done, dataset open: from now on it owes progress
        with os.fdopen(args.ready_fd, "wb") as ready:
            ready.write(b"ready\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"cache_reader: root={layout.root} dp_ranks={list(layout.dp_ranks)} "
        f"window=[{max(0, args.start_step - args.lookback)}, {args.start_step + args.prefetch}) "
        f"prefetch={args.prefetch} lookback={args.lookback} max_steps={args.max_steps}",
        flush=True,
    )
    run_reader(
        layout,
        {r: loader.batch for r, loader in loaders.items()},
        prefetch=args.prefetch,
        lookback=args.lookback,
        start_step=args.start_step,
        max_steps=args.max_steps,
        stop=stop,
        stall_at=args.stall_at_step,
        on_stall=lambda step: _report_stall(args.events, step),
    )
    return 0


def _report_stall(events_path: str | None, step: int) -> None:
    print(f"cache_reader: stalling at step {step} (fault injection: fault=reader_stall)", flush=True)
    if events_path is not None:
        EventLog(Path(events_path), source="reader").emit(
            "process_fault_injected", target="reader", signal="stall", step=step
        )
