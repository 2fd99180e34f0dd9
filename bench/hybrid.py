"""Hybrid (NemotronH: Mamba2 + attention) models: decode tokens/s, ours beside transformers' generate
in the same run, and the bytes a disaggregated request moves (KV + Mamba state). Prints JSON.

    python bench/hybrid.py [--batches 1 16] [--out bench/results/hybrid.json]

Models: the built-in ``tiny-hybrid``, and ``nemotron-h-small``: a NemotronH made by transformers with
random weights (hidden 1024, 12 layers "M-M*M-M-M*M-", 32 Mamba heads x 64, d_state 64, 8 groups;
SmolLM2's tokenizer), built into a temp cache on first use. Both fp32 (this CPU has no fast bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import bench_ours, bench_transformers  # noqa: E402  (bench/engine.py)
from json_report import emit_json  # noqa: E402

SMALL = dict(hidden_size=1024, layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention",
                                                   "linear_attention", "mlp", "linear_attention", "mlp",
                                                   "linear_attention", "full_attention", "linear_attention", "mlp"],
             num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=2816,
             mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=64, n_groups=8, conv_kernel=4,
             chunk_size=128, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def small_model_dir(cache: Path) -> Path:
    """A random-weight NemotronH written by transformers (config.json + safetensors + tokenizer)."""
    import shutil

    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from pdcluster.engine.models.registry import resolve_model

    out = cache / "nemotron-h-small"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**SMALL)).to(torch.float32)
    model.save_pretrained(str(out))
    tiny = resolve_model("tiny-hybrid", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, out / name)
    return out


def transfer_bytes(model: str) -> dict:
    """One disaggregated request per prompt length over tcp: bytes sent, split into KV and state."""
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.kv_transfer.config import TransferConfig
    from pdcluster.node.events import Tokens
    from pdcluster.prefill_node.worker import PrefillWorker

    cfg = EngineConfig(model=model, num_kv_blocks=512, max_model_len=2048, prefill_chunk_size=512)
    tc = TransferConfig(transport="tcp")
    p, d = PrefillWorker("p0", cfg, tc), DecodeWorker("d0", cfg, tc)
    done: set[str] = set()
    d.on_event = lambda e: done.add(e.request_id) if isinstance(e, Tokens) and e.finished else None
    rows = []
    try:
        d.connect_prefill(p.address)
        engine = p.engine
        bpb = engine.kv_spec.bytes_per_block
        for n in (100, 1000):
            before = p.stats()["bytes_sent"]
            rid = f"r{n}"
            d.submit(rid, list(range(300, 300 + n)), SamplingParams(max_tokens=2, ignore_eos=True), "p0")
            deadline = time.monotonic() + 120
            while rid not in done and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            sent = p.stats()["bytes_sent"] - before
            kv = -(-n // engine.kv_spec.block_size) * bpb
            rows.append({"prompt_tokens": n, "bytes_sent": sent, "kv_bytes": kv,
                         "state_bytes_sent": engine.num_state_blocks * bpb,
                         "state_payload_bytes": engine.state_shape.bytes_per_slot,
                         "state_share": round(engine.num_state_blocks * bpb / max(sent, 1), 3)})
    finally:
        p.close()
        d.close()
    return {"num_state_blocks": p.engine.num_state_blocks, "bytes_per_block": p.engine.kv_spec.bytes_per_block,
            "requests": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "pdcluster-bench-models"))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    small = small_model_dir(Path(args.cache))
    result: dict = {"dtype": "float32", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                    "torch_threads": __import__("torch").get_num_threads(), "decode": [], "transfer": {}}
    for name, model in (("tiny-hybrid", "tiny-hybrid"), ("nemotron-h-small", str(small))):
        model_dir = resolve_model(model, progress=False)
        tokenizer = Tokenizer(model_dir)
        for batch in args.batches:
            ours = bench_ours(model, "float32", batch, args.prompt_len, args.new_tokens)
            theirs = bench_transformers(str(model_dir), "float32", batch, args.prompt_len, args.new_tokens, tokenizer)
            result["decode"].append({"model": name, "batch": batch, "ours_decode_tok_s": round(ours["decode_tok_s"], 1),
                                     "transformers_decode_tok_s": round(theirs["decode_tok_s"], 1),
                                     "ratio": round(ours["decode_tok_s"] / theirs["decode_tok_s"], 2)})
            print(json.dumps(result["decode"][-1]), file=sys.stderr)
        result["transfer"][name] = transfer_bytes(model)
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
