"""`tokenrelay usage`: the usage topic summed per tenant and period, each request counted once.

Reads every record the usage topic holds (gateway/tenancy/usage.py) from its
beginning, keeps one per request id (a record sent twice counts once), and
sums them per tenant and per hour, day or month of their end (UTC):
requests by outcome, prompt tokens, those of them found cached, and output
tokens. Prints a table, or one JSON object with `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterable
from datetime import UTC, datetime

from bus.kafka import KafkaBus
from bus.settings import KafkaSettings
from bus.topics import usage_topic
from schemas.messages import UsageRecord

NO_TENANT = "-"
_PERIOD_FORMATS = {"hour": "%Y-%m-%dT%H", "day": "%Y-%m-%d", "month": "%Y-%m", "all": "all"}
OUTCOMES = ("finished", "cancelled", "timed_out", "failed")


def summarize(
    records: Iterable[UsageRecord], period: str, since: float = 0.0, until: float = float("inf")
) -> list[dict]:
    """One row per tenant and period, in order: each request once (its latest record), ended in [since, until)."""
    latest = {record.request_id: record for record in records}
    rows: dict[tuple[str, str], dict] = {}
    for record in latest.values():
        if not since <= record.ended_at < until:
            continue
        when = datetime.fromtimestamp(record.ended_at, UTC).strftime(_PERIOD_FORMATS[period])
        tenant = record.tenant or NO_TENANT
        row = rows.setdefault(
            (tenant, when),
            {"tenant": tenant, "period": when, "requests": 0, **dict.fromkeys(OUTCOMES, 0)}
            | {"prompt_tokens": 0, "cached_prompt_tokens": 0, "output_tokens": 0},
        )
        row["requests"] += 1
        row[record.outcome] += 1
        row["prompt_tokens"] += record.prompt_tokens
        row["cached_prompt_tokens"] += record.cached_prompt_tokens
        row["output_tokens"] += record.output_tokens
    return [rows[key] for key in sorted(rows)]


def _time(text: str, default: float) -> float:
    if not text:
        return default
    moment = datetime.fromisoformat(text)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


async def _records(bootstrap: str, prefix: str) -> list[UsageRecord]:
    bus = KafkaBus(KafkaSettings(bootstrap_servers=bootstrap), client_id="tokenrelay-usage")
    await bus.start()
    try:
        return [m for m in await bus.read_to_end(usage_topic(prefix)) if isinstance(m, UsageRecord)]
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> int:
    try:
        since, until = _time(args.since, 0.0), _time(args.until, float("inf"))
    except ValueError as error:
        raise SystemExit(f"tokenrelay usage: --since/--until: {error}") from None
    records = asyncio.run(_records(args.kafka_bootstrap, args.topic_prefix))
    rows = summarize(records, args.period, since, until)
    if args.json:  # with the records read, and the requests they are of: a record sent twice shows there
        distinct = len({record.request_id for record in records})
        print(json.dumps({"period": args.period, "records": len(records), "requests": distinct, "rows": rows}))
        return 0
    columns = ["tenant", "period", "requests", *OUTCOMES, "prompt_tokens", "cached_prompt_tokens", "output_tokens"]
    table = [columns, *([str(row[c]) for c in columns] for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    return 0
