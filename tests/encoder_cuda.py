"""An encoder's check on CUDA (test_bert.py, test_modernbert.py): float32 on the GPU equals transformers on the CPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pdcluster.engine.models.tiny_bert import transformers_outputs


def on_cuda(test):
    """A ``gpu`` test, skipped where no CUDA device is (CI) or Triton is interpreted."""
    skip = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                              reason="needs a CUDA device")
    return pytest.mark.gpu(skip(test))


def assert_equal_to_transformers_on_cuda(make_engine, embed_dir, cross_dir, texts: list[str], query: str,
                                         docs: list[str]) -> None:
    """[CLS] and mean embeddings of ``texts`` by the embedding model, and the cross-encoder's scores of ``query``
    against ``docs``, within 1e-4 of transformers'. ``make_engine(path, device=...)``: the test's engine."""
    want = transformers_outputs(embed_dir, texts)
    engine = make_engine(embed_dir, device="cuda")
    for got, ref in zip(engine.embed(texts, pooling="cls", normalize=False), want):
        assert np.abs(got - ref[0].numpy()).max() < 1e-4
    for got, ref in zip(engine.embed(texts, pooling="mean", normalize=False), want):
        assert np.abs(got - ref.mean(0).numpy()).max() < 1e-4
    scores = [float(torch.sigmoid(x)[0]) for x in transformers_outputs(cross_dir, [(query, d) for d in docs])]
    assert np.abs(np.array(make_engine(cross_dir, device="cuda").score(query, docs)) - np.array(scores)).max() < 1e-4
