"""A draft model cut from its target: the target's first N decoder layers, its final norm and LM head (an early-exit
draft, as LayerSkip and self-speculative decoding draft), written as a model directory for
``--speculative-config '{"method": "draft_model", "model": DIR}'``. Its KV has the target's shape by construction, so
it drafts for any attention-only target; how often its drafts are accepted depends on how well the first N layers
already predict (bench/draft_model.py measures it).

    python -m pdcluster.engine.models.layer_skip --model smollm2 --num-layers 10 --out /tmp/smollm2-draft10
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from .hf_files import copy_tokenizer_files

LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def write_layer_skip_draft(model_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """``model_dir``'s first ``num_layers`` layers (and everything outside the layers) as a model directory at
    ``out_dir``; ValueError where the model has no more layers than that."""
    src, out = Path(model_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 0 < num_layers < total:
        raise ValueError(f"{src}: a draft of {num_layers} layers from a model of {total}: want 1..{total - 1}")
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                layer = LAYER.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    kept[name] = f.get_tensor(name)
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists follow the cut
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer_files(src, out)
    return out


def main() -> None:
    from pdcluster.engine.models.registry import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="the target: a built-in name, a directory or a Hub id")
    ap.add_argument("--num-layers", type=int, required=True, help="the target's first N layers")
    ap.add_argument("--out", required=True, help="the draft's directory")
    args = ap.parse_args()
    print(write_layer_skip_draft(resolve_model(args.model), args.out, args.num_layers))


if __name__ == "__main__":
    main()
