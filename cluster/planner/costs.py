"""What one worker's steps cost, fitted from the points `pdcluster profile` measured.

Three linear models, fitted by least squares on relative error (a 20 ms decode step counts as much as
a 1 s prefill) with non-negative coefficients:

- prefill step: ``a + b * tokens + c * attn`` where ``tokens`` are the prompt tokens the step computes
  (all chunks together) and ``attn`` the attention work, ``sum(chunk * (computed + chunk / 2))``
  query-key pairs over the chunks.
- decode step: ``a + b * batch + c * context``, ``context`` the sum of the batch's context lengths.
- transfer: ``a + b * bytes`` (one request's KV, end to end through the real transport).

A mixed step (colocated: decodes and prefill chunks in one batch) is the decode model plus the prefill
model's per-token and attention terms; the profile measures a few and records that model's error.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PREFILL_FEATURES = ("tokens", "attn")
DECODE_FEATURES = ("batch", "context")
TRANSFER_FEATURES = ("bytes",)


class ProfileError(ValueError):
    """A profile file that cannot be used: the message names the file and what is wrong."""


def attn_pairs(chunk: int, computed: int) -> float:
    """Query-key pairs of a prefill chunk of ``chunk`` tokens after ``computed`` cached ones."""
    return chunk * (computed + chunk / 2.0)


@dataclass(frozen=True)
class Fit:
    intercept: float
    coef: dict[str, float]
    mean_rel_err: float = 0.0
    max_rel_err: float = 0.0
    num_points: int = 0

    def predict(self, **x: float) -> float:
        return self.intercept + sum(c * float(x[name]) for name, c in self.coef.items())


def fit_linear(points: list[dict], features: tuple[str, ...], target: str = "seconds") -> Fit:
    """Non-negative least squares on relative error: drop the most negative term and refit, at most
    once per term (an active set small enough to do by hand)."""
    if not points:
        raise ProfileError(f"no points to fit {target} over {', '.join(features)}")
    y = np.array([float(p[target]) for p in points])
    if np.any(y <= 0):
        raise ProfileError(f"{target}: every measured time must be > 0")
    x = np.array([[1.0] + [float(p[f]) for f in features] for p in points])
    keep = list(range(x.shape[1]))
    beta = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        w = (1.0 / y)[:, None]  # relative error: scale each row by its own size
        sol, *_ = np.linalg.lstsq(x[:, keep] * w, y * w[:, 0], rcond=None)
        beta = np.zeros(x.shape[1])
        beta[keep] = sol
        negative = [i for i in keep if beta[i] < 0]
        if not negative:
            break
        keep.remove(min(negative, key=lambda i: beta[i]))
        if not keep:
            beta = np.zeros(x.shape[1])
            break
    beta = np.clip(beta, 0.0, None)
    rel = np.abs(x @ beta - y) / y
    return Fit(float(beta[0]), {f: float(b) for f, b in zip(features, beta[1:])}, float(rel.mean()),
               float(rel.max()), len(points))


def _fit_from(d: dict, where: str) -> Fit:
    try:
        return Fit(float(d["intercept"]), {str(k): float(v) for k, v in d["coef"].items()},
                   float(d.get("mean_rel_err", 0.0)), float(d.get("max_rel_err", 0.0)), int(d.get("num_points", 0)))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProfileError(f"{where}: want {{'intercept': s, 'coef': {{...}}}}, got {d!r:.120} ({e})") from None


@dataclass(frozen=True)
class EngineLimits:
    """The scheduler settings the profile ran with (the simulator schedules the same way)."""

    block_size: int = 16
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    max_num_seqs: int = 64
    kv_capacity_tokens: int = 0  # a decode worker's KV pool, in tokens (0: unlimited)


@dataclass(frozen=True)
class CostModel:
    prefill: Fit
    decode: Fit
    transfer: Fit
    kv_bytes_per_token: int
    num_layers: int
    threads: int = 1
    # Step time with another busy worker on the same host / step time alone (>= 1), with the CPU shares
    # taken out: memory bandwidth and caches the workers share even when each has its own cores.
    corun_slowdown: float = 1.0
    # CPU cores other work used on the profiling host while the step times were measured (they are the
    # speed of a worker alone beside that much background load).
    profile_background_cores: float = 0.0
    limits: EngineLimits = field(default_factory=EngineLimits)
    model: str = ""

    def step_s(self, prefill_tokens: int = 0, attn: float = 0.0, num_decode: int = 0, context: int = 0) -> float:
        """Seconds of one engine step at full speed (see the module docstring for a mixed step)."""
        if num_decode == 0:
            return self.prefill.predict(tokens=prefill_tokens, attn=attn)
        t = self.decode.predict(batch=num_decode, context=context)
        if prefill_tokens:
            t += self.prefill.coef.get("tokens", 0.0) * prefill_tokens + self.prefill.coef.get("attn", 0.0) * attn
        return t

    def prefill_s(self, num_tokens: int) -> float:
        """One prompt alone, chunked as the engine does."""
        total, done = 0.0, 0
        while done < num_tokens:
            chunk = min(self.limits.prefill_chunk_size, num_tokens - done)
            total += self.step_s(prefill_tokens=chunk, attn=attn_pairs(chunk, done))
            done += chunk
        return total

    def transfer_s(self, num_tokens: int) -> float:
        return self.transfer.predict(bytes=num_tokens * self.kv_bytes_per_token)

    def exposed_transfer_s(self, num_tokens: int, prefill_s: float) -> float:
        """Transfer time not hidden behind the prefill. The KV streams one send per layer while the
        forward pass runs (the profile times the same per-layer sends), so what is left after the first
        token is the last layer's share, or the part of the whole transfer that outlasts the prefill."""
        whole = self.transfer_s(num_tokens)
        return max(whole / max(1, self.num_layers), whole - prefill_s)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_profile(cls, profile: dict, where: str = "profile") -> "CostModel":
        if not isinstance(profile, dict) or "fits" not in profile:
            raise ProfileError(f"{where}: not a pdcluster profile (no 'fits'); make one with `pdcluster profile`")
        fits = profile["fits"]
        try:
            kv = int(profile["kv_bytes_per_token"])
            layers = int(profile["num_layers"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{where}: missing or bad kv_bytes_per_token / num_layers ({e})") from None
        for name in ("prefill", "decode", "transfer"):
            if name not in fits:
                raise ProfileError(f"{where}: fits.{name} is missing; re-run `pdcluster profile`")
        limits = EngineLimits(**{k: int(v) for k, v in profile.get("engine", {}).items()
                                 if k in EngineLimits.__dataclass_fields__})
        slowdown = float(profile.get("corun", {}).get("slowdown", 1.0) or 1.0)
        if not math.isfinite(slowdown) or slowdown < 1.0:
            slowdown = 1.0
        background = float(profile.get("host", {}).get("background_cores", 0.0) or 0.0)
        if not math.isfinite(background) or background < 0:
            background = 0.0
        return cls(_fit_from(fits["prefill"], f"{where}: fits.prefill"), _fit_from(fits["decode"], f"{where}: fits.decode"),
                   _fit_from(fits["transfer"], f"{where}: fits.transfer"), kv, layers,
                   int(profile.get("threads", 1) or 1), slowdown, background, limits, str(profile.get("model", "")))


def load_cost_model(path: str | Path) -> CostModel:
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"--profile: {p} does not exist; make one with `pdcluster profile --out {p}`")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"--profile: cannot read {p} as JSON: {e}") from None
    return CostModel.from_profile(data, where=str(p))
