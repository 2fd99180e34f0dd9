"""What one worker's steps cost, fitted from the points `pdcluster profile` measured.

Three linear models, fitted by least squares on relative error (a 20 ms decode step counts as much as
a 1 s prefill) with non-negative coefficients:

- prefill step: ``a + b * tokens + c * attn`` where ``tokens`` are the prompt tokens the step computes
  (all chunks together) and ``attn`` the attention work, ``sum(chunk * (computed + chunk / 2))``
  query-key pairs over the chunks.
- decode step: ``a(batch) + c * context``, ``context`` the sum of the batch's context lengths and
  ``a(batch)`` one intercept per measured batch size, interpolated linearly between them (and extended
  past the largest along the last two): the step time is not linear in the batch on a CPU (here one
  request takes 63 ms, two 100 ms, eight 116 ms: a batch of one runs matrix-vector kernels, more run
  matrix-matrix ones), and a straight line through the grid was 30% off exactly where light loads run.
  The straight line ``a + b * batch + c * context`` is kept in the profile (``fits.decode``) for a
  profile without raw points.
- transfer: ``a + b * bytes`` (one request's KV, end to end through the real transport).

A mixed step (colocated: decodes and prefill chunks in one batch) is the decode model plus the prefill
model's per-token and attention terms; the profile measures a few and records that model's error.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from pdcluster.engine.step_trace import attn_pairs  # the features a served step trace records

PREFILL_FEATURES = ("tokens", "attn")
DECODE_FEATURES = ("batch", "context")
TRANSFER_FEATURES = ("bytes",)


class ProfileError(ValueError):
    """A profile file that cannot be used: the message names the file and what is wrong."""


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


@dataclass(frozen=True)
class BatchTable:
    """Decode step seconds ``a(batch) + context_coef * context``; ``a`` interpolated between ``batches``."""

    batches: tuple[int, ...]
    intercepts: tuple[float, ...]
    context_coef: float
    mean_rel_err: float = 0.0
    max_rel_err: float = 0.0

    def predict(self, batch: float, context: float) -> float:
        b, a = self.batches, self.intercepts
        if len(b) == 1 or batch <= b[0]:
            base = a[0] * batch / b[0] if batch < b[0] else a[0]
        elif batch >= b[-1]:
            base = a[-1] + max(0.0, (a[-1] - a[-2]) / (b[-1] - b[-2])) * (batch - b[-1])
        else:
            base = float(np.interp(batch, b, a))
        return base + self.context_coef * context


def fit_batch_table(points: list[dict]) -> BatchTable:
    """Least squares on relative error with one intercept per batch size and a shared, non-negative
    context coefficient (``batch``, ``context``, ``seconds`` per point)."""
    if not points:
        raise ProfileError("no decode points to fit a batch table")
    batches = sorted({int(p["batch"]) for p in points})
    y = np.array([float(p["seconds"]) for p in points])
    if np.any(y <= 0):
        raise ProfileError("decode: every measured time must be > 0")
    onehot = np.array([[1.0 if int(p["batch"]) == b else 0.0 for b in batches] for p in points])
    ctx = np.array([float(p["context"]) for p in points])
    w = 1.0 / y
    sol, *_ = np.linalg.lstsq(np.column_stack([onehot, ctx]) * w[:, None], y * w, rcond=None)
    coef = float(sol[-1])
    if coef < 0:  # context cannot make a step faster: intercepts alone
        coef = 0.0
        sol, *_ = np.linalg.lstsq(onehot * w[:, None], y * w, rcond=None)
    intercepts = [max(0.0, float(v)) for v in sol[:len(batches)]]
    table = BatchTable(tuple(batches), tuple(intercepts), coef)
    rel = np.array([abs(table.predict(int(p["batch"]), float(p["context"])) - yy) / yy for p, yy in zip(points, y)])
    return replace(table, mean_rel_err=float(rel.mean()), max_rel_err=float(rel.max()))


def _table_from(d: dict, where: str) -> BatchTable:
    try:
        batches = tuple(int(b) for b in d["batches"])
        intercepts = tuple(float(a) for a in d["intercepts"])
        coef = float(d["context_coef"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{where}: want {{'batches', 'intercepts', 'context_coef'}}, got {d!r:.120} ({e})") from None
    if not batches or len(batches) != len(intercepts) or list(batches) != sorted(set(batches)) or batches[0] < 1:
        raise ProfileError(f"{where}: batches must be increasing sizes >= 1, one intercept each; got {d!r:.120}")
    return BatchTable(batches, intercepts, coef, float(d.get("mean_rel_err", 0.0)), float(d.get("max_rel_err", 0.0)))


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
    max_num_batched_tokens: int = 2048  # the engine's CPU defaults (engine/batch_limits.py); a profile says its own
    prefill_chunk_size: int = 2048  # resolved (EngineConfig.prefill_chunk_tokens): the engine default
    max_num_seqs: int = 128
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
    decode_table: BatchTable | None = None  # preferred over ``decode`` when the profile has one
    # partner step kind -> this step's kind -> slowdown (>= 1), "prefill" / "decode" each; None: the
    # single ``corun_slowdown`` for every pairing (a profile from before these were measured).
    corun_beside: dict[str, dict[str, float]] | None = None
    # A served worker's step over the bare engine's (served.py): prefill steps, and decode (or mixed) steps.
    served_prefill_factor: float = 1.0
    served_decode_factor: float = 1.0

    def corun_factor(self, kind: str, partner_kinds: list[str]) -> float:
        """How much slower a ``kind`` step runs while other workers run steps of ``partner_kinds``
        (the worst pairing: a third busy worker adds its CPU share, accounted separately)."""
        if not partner_kinds:
            return 1.0
        if not self.corun_beside:
            return self.corun_slowdown
        return max(self.corun_beside.get(p, {}).get(kind, self.corun_slowdown) for p in partner_kinds)

    def decode_s(self, num_decode: int, context: int) -> float:
        if self.decode_table is not None:
            return self.decode_table.predict(num_decode, context)
        return self.decode.predict(batch=num_decode, context=context)

    def served_step_s(self, prefill_tokens: int = 0, attn: float = 0.0, num_decode: int = 0, context: int = 0) -> float:
        """``step_s`` as a served worker runs it (times the profile's served factor for its kind)."""
        factor = self.served_decode_factor if num_decode else self.served_prefill_factor
        return factor * self.step_s(prefill_tokens, attn, num_decode, context)

    def step_s(self, prefill_tokens: int = 0, attn: float = 0.0, num_decode: int = 0, context: int = 0) -> float:
        """Seconds of one engine step at full speed (see the module docstring for a mixed step)."""
        if num_decode == 0:
            return self.prefill.predict(tokens=prefill_tokens, attn=attn)
        t = self.decode_s(num_decode, context)
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
        table = None
        if "decode_table" in fits:
            table = _table_from(fits["decode_table"], f"{where}: fits.decode_table")
        elif profile.get("points", {}).get("decode"):  # a profile written before the table: its raw points
            table = fit_batch_table(profile["points"]["decode"])
        beside = None
        raw = profile.get("corun", {}).get("beside")
        if raw:
            try:
                beside = {str(p): {str(k): max(1.0, float(v)) for k, v in kinds.items()} for p, kinds in raw.items()}
            except (AttributeError, TypeError, ValueError) as e:
                raise ProfileError(f"{where}: corun.beside wants {{partner: {{kind: slowdown}}}}, got {raw!r:.120} ({e})") from None
        return cls(_fit_from(fits["prefill"], f"{where}: fits.prefill"), _fit_from(fits["decode"], f"{where}: fits.decode"),
                   _fit_from(fits["transfer"], f"{where}: fits.transfer"), kv, layers,
                   int(profile.get("threads", 1) or 1), slowdown, background, limits, str(profile.get("model", "")),
                   table, beside, *_served_factors(profile.get("served"), where))


def _served_factors(served, where: str) -> tuple[float, float]:
    if not served or not served.get("measured"):
        return 1.0, 1.0
    try:
        factors = float(served["prefill_factor"]), float(served["decode_factor"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{where}: served wants prefill_factor and decode_factor, got {served!r:.120} ({e})") from None
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise ProfileError(f"{where}: served factors must be positive numbers, got {factors}")
    return factors


def load_cost_model(path: str | Path) -> CostModel:
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"--profile: {p} does not exist; make one with `pdcluster profile --out {p}`")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"--profile: cannot read {p} as JSON: {e}") from None
    return CostModel.from_profile(data, where=str(p))
