"""The record of a run: the event log (``events.jsonl``), the loss log, and the recovery summary."""
