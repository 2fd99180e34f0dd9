"""What the API process spends turning a stream's tokens into text: engine/tokenizer.py's Detokenizer fed
one token at a time (as the HTTP API streams), outputs of 500, 2,000 and 8,000 tokens of English text
(this README through SmolLM2's tokenizer), with a stop string that never matches. Prints JSON (and
writes it with --out): microseconds per token on average and over the last 100 tokens.

    python bench/detokenize.py [--out bench/results/detokenize.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def per_token_us(tokenizer, token_ids: list[int]) -> dict:
    from pdcluster.engine.tokenizer import Detokenizer

    detok = Detokenizer(tokenizer, ["<never appears>"])
    stamps = [time.perf_counter()]
    pieces = []
    for i, token_id in enumerate(token_ids):
        pieces.append(detok.add([token_id], final=i == len(token_ids) - 1))
        stamps.append(time.perf_counter())
    assert "".join(pieces) == tokenizer.decode(token_ids), "the streamed text is not the output's"
    n = len(token_ids)
    return {"num_tokens": n, "us_per_token": round((stamps[-1] - stamps[0]) / n * 1e6, 1),
            "us_per_token_last_100": round((stamps[-1] - stamps[-101]) / 100 * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import import_pdcluster
    from json_report import emit_json

    import_pdcluster()
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model("tiny-random", progress=False))  # SmolLM2's tokenizer
    token_ids = tokenizer.encode((ROOT / "README.md").read_text(encoding="utf-8") * 2)[:8000]
    result = {"tokenizer": "SmolLM2 (tiny-random's)",
              "outputs": [per_token_us(tokenizer, token_ids[:n]) for n in (500, 2000, 8000)]}
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
