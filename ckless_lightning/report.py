"""``python -m ckless_lightning.report RUN_DIR [--against OTHER_RUN] [--out PATH] [--require-equal]``.

Prints a finished (or killed) run's recovery summary, draws its timeline
picture (default ``RUN_DIR/timeline.png``, :mod:`ckless_lightning.record.timeline_plot`)
and, with ``--against``, overlays the other run's losses and says whether the
two runs' per-step losses are bitwise equal. Exit codes: 0 the picture was
drawn (equal or not); 1 drawing failed, or ``--require-equal`` and the losses
differ; 2 a run dir without ``events.jsonl`` (``--against``: without
``losses.jsonl``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ckless_lightning.report",
        description="Print a run's recovery summary and draw its timeline picture.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (holds events.jsonl, losses.jsonl)")
    parser.add_argument("--against", type=Path, help="another run dir: overlay and compare its losses")
    parser.add_argument("--out", type=Path, help="where to write the picture (default RUN_DIR/timeline.png)")
    parser.add_argument(
        "--require-equal", action="store_true", help="exit 1 when the losses differ from --against's"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the report for ``argv`` (default ``sys.argv[1:]``); returns the exit code (see the module doc)."""
    args = _parser().parse_args(argv)
    events_path = args.run_dir / "events.jsonl"
    if not events_path.is_file():
        print(f"report: no events.jsonl in {args.run_dir} (looked for {events_path})", file=sys.stderr)
        return 2
    if args.against is not None and not (args.against / "losses.jsonl").is_file():
        print(f"report: --against {args.against} has no losses.jsonl", file=sys.stderr)
        return 2

    from ckless_lightning.record.loss_compare import compare_losses
    from ckless_lightning.record.summary import summarize_run
    from ckless_lightning.record.timeline_plot import render_timeline

    try:
        print(summarize_run(args.run_dir).format())
        print()
        picture = render_timeline(args.run_dir, out=args.out, against=args.against)
    except (ImportError, ValueError, OSError) as err:
        print(
            f"report: could not draw the timeline of {args.run_dir}: {type(err).__name__}: {err}",
            file=sys.stderr,
        )
        return 1
    print(f"timeline:     {picture}")
    if args.against is None:
        return 0
    comparison = compare_losses(args.run_dir, args.against)
    print(comparison.describe(str(args.against)))
    return 1 if args.require_equal and not comparison.equal else 0


if __name__ == "__main__":
    sys.exit(main())
