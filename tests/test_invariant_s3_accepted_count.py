"""S3 (docs/invariants.md; source report 003): accepted-token counting.

The rejection sampler's output has one row per request: valid tokens contiguous from position 0 (the
accepted drafts, then the target's token), -1 everywhere after. So the count of valid tokens equals the
index of the first -1 equals ``(output_token_ids != -1).sum(dim=1)`` (``num_valid_tokens``): no
cat-a-sentinel-and-argmax. Property-tested over random drafts, random target logits (greedy and
sampled, with and without draft probabilities), and greedy acceptance checked against a reference loop.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcluster.engine.rejection_sampler import PLACEHOLDER, num_valid_tokens, rejection_sample
from pdcluster.engine.sampling_params import SamplingParams

VOCAB = 6  # tiny: drafts often match the target, so every acceptance length shows up


@st.composite
def batches(draw):
    num_reqs = draw(st.integers(1, 6))
    drafts, logits, params, seeds, probs = [], [], [], [], []
    for _ in range(num_reqs):
        k = draw(st.integers(0, 5))
        drafts.append(draw(st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k)))
        flat = draw(st.lists(st.integers(-4, 4), min_size=(k + 1) * VOCAB, max_size=(k + 1) * VOCAB))
        # distinct-ish logits: integer grid plus a per-cell offset, so argmax ties are rare but possible
        row = torch.tensor(flat, dtype=torch.float32).view(k + 1, VOCAB)
        logits.append(row + torch.arange(VOCAB, dtype=torch.float32) * 1e-3)
        greedy = draw(st.booleans())
        params.append(SamplingParams(temperature=0.0 if greedy else draw(st.sampled_from([0.5, 1.0, 2.0])), max_tokens=8))
        seeds.append(draw(st.integers(0, 2**31 - 1)))
        use_q = draw(st.booleans()) and k > 0
        probs.append(torch.softmax(torch.tensor(draw(st.lists(st.integers(-3, 3), min_size=k * VOCAB,
                                                                  max_size=k * VOCAB)), dtype=torch.float32)
                                   .view(k, VOCAB), -1) if use_q else None)
    return drafts, logits, params, seeds, probs


def _reference_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    out = []
    for i, d in enumerate(drafts):
        t = int(torch.argmax(logits[i]))
        out.append(t)
        if t != d:
            return out
    out.append(int(torch.argmax(logits[len(drafts)])))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_S3_valid_tokens_contiguous_and_counted_by_sum(batch):
    drafts, logits, params, seeds, probs = batch
    out = rejection_sample(logits, drafts, params, seeds, [0] * len(drafts), draft_probs=probs)
    width = max(len(d) for d in drafts) + 1
    assert out.shape == (len(drafts), width)
    counts = num_valid_tokens(out)
    torch.testing.assert_close(counts, (out != PLACEHOLDER).sum(dim=1))
    for r, row in enumerate(out.tolist()):
        n = int(counts[r])
        first_placeholder = row.index(PLACEHOLDER) if PLACEHOLDER in row else width
        assert n == first_placeholder, f"row {r}: count {n} != first -1 at {first_placeholder}: {row}"
        assert all(t != PLACEHOLDER for t in row[:n]) and all(t == PLACEHOLDER for t in row[n:]), row
        assert 1 <= n <= len(drafts[r]) + 1
        assert row[: n - 1] == drafts[r][: n - 1], "every valid token but the last is an accepted draft"
        if params[r].greedy:
            assert row[:n] == _reference_greedy(logits[r], drafts[r])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8), st.integers(1, 6))
def test_S3_count_is_right_when_every_draft_is_accepted(accepted, width_extra):
    """Rows with no -1 at all (every draft accepted, plus the bonus token) are where an argmax-for-the-
    first-(-1) without a sentinel column would count 0: the sum does not care."""
    k = max(accepted) + width_extra - 1
    out = torch.full((len(accepted), k + 1), PLACEHOLDER, dtype=torch.int64)
    for r, a in enumerate(accepted):
        out[r, : a + 1] = 7
    out[0, :] = 7  # one fully accepted row
    expected = torch.tensor([k + 1] + [a + 1 for a in accepted[1:]])
    torch.testing.assert_close(num_valid_tokens(out), expected)
