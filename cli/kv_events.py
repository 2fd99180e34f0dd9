"""`pdcluster kv-events`: watch a running server's KV events (serve --kv-events-config, vLLM's format:
wire/kv_events.py): it reads the workers' endpoints from GET /kv_event_sources, subscribes to each, and prints every
event as it comes, one line each (or JSON lines), for as long as asked. ``--replay-from SEQ`` first asks each worker
with a replay endpoint for the batches it kept from that sequence number on."""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx


def add_kv_events_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "kv-events", help="watch a running server's KV events (serve --kv-events-config)",
        description="Subscribe to every worker's KV events (vLLM's format) and print them as they come.")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (its /kv_event_sources)")
    p.add_argument("--seconds", type=float, default=600.0, help="stop after this long (default 600)")
    p.add_argument("--max-batches", type=int, default=0, help="stop after this many batches (0: no limit)")
    p.add_argument("--replay-from", type=int, default=None, metavar="SEQ",
                   help="first replay each worker's kept batches from this sequence number (its replay_endpoint)")
    p.add_argument("--json", action="store_true", help="one JSON object a batch: rank, worker, seq, ts, events")
    p.set_defaults(func=kv_events_main)


def kv_events_main(args: argparse.Namespace) -> int:
    import zmq

    from pdcluster.engine.config import ConfigError
    from pdcluster.wire.kv_events import END_SEQ, decode_batch

    if not args.seconds > 0:
        raise ConfigError(f"--seconds: must be > 0, got {args.seconds}")
    try:
        sources = httpx.get(f"{args.url.rstrip('/')}/kv_event_sources", timeout=30).json()
    except (httpx.HTTPError, ValueError) as e:
        print(f"pdcluster kv-events: error: {args.url}: {e}", file=sys.stderr)
        return 1
    if not isinstance(sources, dict) or not sources:
        print(f"pdcluster kv-events: error: {args.url} publishes no KV events (start it with --kv-events-config)",
              file=sys.stderr)
        return 1
    ctx = zmq.Context()
    shown = 0

    def show(source: dict, seq: int, payload: bytes) -> None:
        nonlocal shown
        try:
            ts, events, rank = decode_batch(payload)
        except ValueError as e:
            print(f"# worker {source.get('worker_id')}: {e}", file=sys.stderr)
            return
        shown += 1
        if args.json:
            print(json.dumps({"rank": rank, "worker_id": source.get("worker_id"), "seq": seq, "ts": ts,
                              "events": events}), flush=True)
            return
        for e in events:
            blocks = len(e.get("block_hashes", ()))
            extra = f" tokens={len(e['token_ids'])} parent={e['parent_block_hash']}" if e["type"] == "BlockStored" else ""
            print(f"rank={rank} seq={seq} {e['type']} medium={e.get('medium')} blocks={blocks}{extra}", flush=True)

    try:
        # Subscribed first, then the replay: a batch published meanwhile comes both ways and is shown once (by seq).
        subs = []
        for source in sources.values():
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(source["endpoint"])
            sub.setsockopt(zmq.SUBSCRIBE, source.get("topic", "").encode())
            subs.append((sub, source))
        shown_seq = [-1] * len(subs)  # per worker, the last sequence number shown
        if args.replay_from is not None:
            time.sleep(0.2)  # the subscriptions reach the publishers (zmq's slow joiner)
            for i, (_, source) in enumerate(subs):
                if not source.get("replay_endpoint"):
                    continue
                replay = ctx.socket(zmq.DEALER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.connect(source["replay_endpoint"])
                replay.send_multipart([b"", args.replay_from.to_bytes(8, "big")])
                for _ in range(source.get("buffer_steps", 10_000) + 1):  # bounded: the kept batches, then END_SEQ
                    if not replay.poll(10_000):
                        break
                    _, _, seq, payload = replay.recv_multipart()
                    if seq == END_SEQ:
                        break
                    shown_seq[i] = int.from_bytes(seq, "big")
                    show(source, shown_seq[i], payload)
                replay.close()
        poller = zmq.Poller()
        for sub, _ in subs:
            poller.register(sub, zmq.POLLIN)
        deadline = time.monotonic() + args.seconds
        while (left := deadline - time.monotonic()) > 0 and not (args.max_batches and shown >= args.max_batches):
            for sock, _ in poller.poll(int(min(left, 1.0) * 1000) + 1):
                i = next(i for i, (sub, _) in enumerate(subs) if sub is sock)
                _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > shown_seq[i] or seq == 0:  # not replayed already (0: the worker restarted, counting anew)
                    shown_seq[i] = seq
                    show(subs[i][1], seq, payload)
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(linger=0)
    return 0
