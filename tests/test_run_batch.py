"""`pdcluster run-batch`: an OpenAI Batch file through one in-process engine. Each line's answer is the HTTP API's for
its body (the engine's greedy text, its vectors), in the input's order; a line that cannot be run gets a 400 line
that says why and the rest still run; a missing input file or a bad flag is one line and status 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import make_engine
from pdcluster.cli.main import main
from pdcluster.engine.sampling_params import SamplingParams

MODEL = "tiny-random"
PROMPTS = ["Hello there, how", "The list of numbers: 3, 1, 4,"]


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _run(tmp_path, lines: list[str], *flags: str) -> tuple[int, list[dict]]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc = main(["run-batch", "--model", MODEL, "--num-kv-blocks", "128", "--max-model-len", "512", "-i", str(src),
               "-o", str(dst), "--no-progress", *flags])
    return rc, [json.loads(x) for x in dst.read_text().splitlines()] if dst.exists() else []


@pytest.mark.timeout(300)
def test_a_batch_answers_each_line_in_order(tiny_dir, tmp_path):
    engine = make_engine(MODEL, num_kv_blocks=128)
    texts = [o.text for o in engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))]
    vectors = engine.embed(PROMPTS)
    lines = [
        _line("cmpl-0", "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True,
                                            "temperature": 0}),
        _line("emb", "/v1/embeddings", {"model": MODEL, "input": PROMPTS}),
        "this is not JSON",
        _line("chat", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                               "max_tokens": 4}),
        "",  # blank lines are skipped
        _line("cmpl-1", "/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "ignore_eos": True,
                                            "temperature": 0}),
        _line("cmpl-1", "/v1/completions", {"model": MODEL, "prompt": "again", "max_tokens": 2}),  # a duplicate id
        _line("get", "/v1/completions", {"model": MODEL, "prompt": "x"}, method="GET"),
        _line("where", "/v1/images/generations", {"prompt": "x"}),
        _line("streamed", "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}),
        _line("zero", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}),
        _line("who", "/v1/completions", {"model": "gpt-4", "prompt": "x", "max_tokens": 2}),
        _line("score", "/score", {"text_1": PROMPTS[0], "text_2": PROMPTS}),
        _line("rerank", "/v2/rerank", {"query": PROMPTS[1], "documents": PROMPTS, "top_n": 1}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),  # no custom_id
    ]
    rc, out = _run(tmp_path, lines)
    assert rc == 0
    ids = [o["custom_id"] for o in out]
    assert ids == ["cmpl-0", "emb", None, "chat", "cmpl-1", "cmpl-1", "get", "where", "streamed", "zero", "who",
                   "score", "rerank", None]
    status = {i: o["response"]["status_code"] for i, o in enumerate(out)}
    ok = [0, 1, 3, 4, 11, 12]
    assert [i for i in status if status[i] == 200] == ok
    for i, o in enumerate(out):
        assert o["id"].startswith("batch_req_") and o["response"]["request_id"]
        if i in ok:
            assert o["error"] is None
        else:
            assert o["error"]["message"] and o["response"]["body"]["error"] == o["error"]
    assert out[0]["response"]["body"]["choices"][0]["text"] == texts[0]
    assert out[4]["response"]["body"]["choices"][0]["text"] == texts[1]
    for d, ref in zip(out[1]["response"]["body"]["data"], vectors):
        assert np.abs(np.array(d["embedding"], dtype=np.float32) - ref).max() < 1e-5
    assert out[3]["response"]["body"]["object"] == "chat.completion"
    assert "line 3: not JSON" in out[2]["error"]["message"]
    assert "used on an earlier line" in out[5]["error"]["message"]
    assert "method must be POST" in out[6]["error"]["message"]
    assert "url must be one of" in out[7]["error"]["message"]
    assert "stream must be false" in out[8]["error"]["message"]
    assert "max_tokens" in out[9]["error"]["message"]
    assert out[10]["response"]["status_code"] == 404
    assert len(out[11]["response"]["body"]["data"]) == 2
    assert len(out[12]["response"]["body"]["results"]) == 1
    assert "custom_id must be" in out[13]["error"]["message"]


@pytest.mark.timeout(300)
def test_served_model_name_takes_several_names(tiny_dir, tmp_path):
    """--served-model-name a b (as vllm run-batch): a body's model may be either, and the answers name the first;
    --model's own name is then not served."""
    lines = [_line(f"{model}-{i}", url, {"model": model, **body}) for model in ("a", "b", MODEL)
             for i, (url, body) in enumerate((("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2}),
                                              ("/v1/embeddings", {"input": PROMPTS[0]})))]
    rc, out = _run(tmp_path, lines, "--served-model-name", "a", "b")
    assert rc == 0
    assert [o["response"]["status_code"] for o in out] == [200, 200, 200, 200, 404, 404]
    assert [o["response"]["body"]["model"] for o in out[:4]] == ["a"] * 4
    assert out[4]["error"]["code"] == "model_not_found" and "'a', 'b'" in out[4]["error"]["message"]


def test_bad_files_and_flags_are_one_line(tiny_dir, tmp_path, capsys):
    rc = main(["run-batch", "--model", MODEL, "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o")])
    assert rc == 2 and "--input-file: cannot read" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_text("")
    for flags, says in ((["--max-concurrency", "0"], "--max-concurrency: must be at least 1"),
                        (["--request-timeout-s", "0"], "--request-timeout-s: must be > 0"),
                        (["--pooler-config", "{x"], "--pooler-config:"),
                        (["--served-model-name", "a", "a"], "--served-model-name: 'a' is given twice")):
        rc = main(["run-batch", "--model", MODEL, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o"), *flags])
        assert rc == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
