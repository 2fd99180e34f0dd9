"""`pdcluster loadtest --dataset sharegpt-multiturn` against a real `pdcluster serve --mode local` with a
host offload tier and a device pool far smaller than the conversations' working set (issue 27 item 4):
every turn completes, each turn's prompt extends the previous one's, and the report (and /metrics)
counts the prompt tokens served from each cache tier: some came back from host memory, and fewer
were computed than sent."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pdcluster.cli.main import main
from pdcluster.tools.loadtest.datasets import DatasetOptions
from pdcluster.tools.loadtest.multiturn import load_conversations
from pdcluster.tools.server_process import ServeProcess

MODEL = "tiny-random"
MAX_MODEL_LEN = 640
NUM_KV_BLOCKS = 48  # 768 tokens: a conversation's last turn fits, the four conversations' history does not
NUM_CONVERSATIONS = 4
OUTPUT_LEN = 8


def _sample(text: str, name: str, tier: str) -> float:
    """One labelled sample of the exposition text (a regex, independent of the harness's parser)."""
    pattern = re.compile(rf'^{re.escape(name)}\{{[^}}]*tier="{tier}"[^}}]*\}} ([0-9.eE+-]+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = ServeProcess(["--mode", "local", "--model", MODEL, "--num-kv-blocks", str(NUM_KV_BLOCKS),
                      "--max-model-len", str(MAX_MODEL_LEN), "--kv-offload-host-gib", "0.05"], timeout_s=180)
    yield s
    s.close()


@pytest.fixture(scope="module")
def conversations(tiny_dir):
    from pdcluster.engine.tokenizer import Tokenizer

    options = DatasetOptions(num_prompts=NUM_CONVERSATIONS, seed=0, fixed_output_len=OUTPUT_LEN,
                             max_model_len=MAX_MODEL_LEN)
    return load_conversations(options, Tokenizer(tiny_dir))


def test_each_turn_extends_the_previous_prompt(conversations):
    for conversation in conversations:
        turns = conversation.turns
        assert len(turns) >= 4
        for previous, turn in zip(turns, turns[1:]):
            assert turn.prompt[:len(previous.prompt)] == previous.prompt
            assert turn.prompt_len > previous.prompt_len
        assert turns[-1].prompt_len + OUTPUT_LEN <= MAX_MODEL_LEN


@pytest.mark.timeout(300)
def test_conversations_are_served_partly_from_the_offload_tier(server, conversations, tmp_path, capsys):
    rc = main(["loadtest", "--no-progress", "--base-url", server.base_url, "--model", MODEL,
               "--dataset", "sharegpt-multiturn", "--num-prompts", str(NUM_CONVERSATIONS), "--think-time-s", "0.05",
               "--output-len", str(OUTPUT_LEN), "--seed", "0", "--num-warmups", "0", "--timeout-s", "60",
               "--result-json", str(tmp_path / "r.json")])
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    num_turns = sum(len(c.turns) for c in conversations)
    assert result["completed"] == num_turns and result["failed"] == 0, result.get("errors")
    assert result["total_input_tokens"] == sum(c.num_prompt_tokens for c in conversations)

    server_metrics = result["server_metrics"]
    cached = server_metrics["prompt_tokens_cached"]
    assert set(cached) == {"device", "offload"}
    assert cached["offload"] > 0, cached  # evicted history came back from host memory
    total = server_metrics["prompt_tokens_total"]
    assert total == result["total_input_tokens"]
    assert server_metrics["prompt_tokens_computed"] == total - cached["device"] - cached["offload"] < total

    summary = capsys.readouterr().err
    assert re.search(rf"cached \(offload\)\s+{cached['offload']}\n", summary), summary
    assert re.search(rf"computed\s+{server_metrics['prompt_tokens_computed']}\n", summary), summary

    # /metrics: every tier's usage, and the counters the report was computed from.
    text = httpx.get(server.base_url + "/metrics", timeout=30, trust_env=False).text
    assert _sample(text, "pdcluster:kv_tier_capacity_blocks", "device") == NUM_KV_BLOCKS
    assert _sample(text, "pdcluster:kv_tier_capacity_blocks", "host") > NUM_KV_BLOCKS
    assert _sample(text, "pdcluster:kv_tier_blocks", "host") > 0
    assert _sample(text, "pdcluster:kv_tier_blocks", "device") == 0  # idle: nothing in use
    assert _sample(text, "pdcluster:prompt_tokens_cached_total", "offload") == cached["offload"]
