"""The figures of a routing-drift meter, read once: plain numbers, no torch.

``RoutingDrift`` (and its ``LayerDrift`` rows) is what ``DriftMeter.drift()`` and
``MegatronReplay.drift()`` return, and what a process without torch (a driver, the demo's
report) may hold, merge and log: ``as_metrics(prefix=...)`` flattens it into the stable
keys any logger takes. Records are mergeable (``a.merge(b)`` or ``a + b``: counts add,
means are weighted by their counts), so micro-batches, steps or ranks combine on the host
exactly as their sums would on the device (up to float rounding of the means).
"""

from __future__ import annotations

from dataclasses import dataclass

from routeplay.errors import SpecMismatch

__all__ = ["LayerDrift", "RoutingDrift"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerDrift:
    """One MoE layer's figures.

    Example:
        >>> layer = meter.drift().layers[0]
        >>> layer.share, layer.overlap
    """

    layer: int
    """MoE layer index (column of the routes)."""
    routes: int
    """(token, layer) routes compared: real tokens that reached this layer."""
    differing: int
    """Of those, the routes whose native expert set differs from the replayed one."""
    overlap: float
    """Mean ``|native ∩ replayed| / K`` over the routes (a layer row exists only once a
    route was compared)."""

    @property
    def share(self) -> float:
        """``differing / routes``."""
        return self.differing / self.routes if self.routes else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingDrift:
    """A meter's figures, read once (see ``DriftMeter.drift``).

    Example:
        >>> drift = session.drift()
        >>> wandb.log(drift.as_metrics(prefix="train/routing/"), step=step)
    """

    top_k: int
    """Experts per token."""
    layers: tuple[LayerDrift, ...]
    """The MoE layers that saw a real token, in order (a PP stage: its own layers)."""
    tokens: int
    """Real tokens of the measured forwards (counted once per forward)."""
    tokens_differing: int
    """Of those, the tokens with at least one differing layer."""
    logprob_tokens: int
    """Response tokens whose log-probs were compared (0: none given)."""
    kl_k3: float | None
    """Mean k3 KL(engine || trainer) per response token; None without log-probs."""
    logprob_gap: float | None
    """Mean ``|trainer - engine|`` log-prob per response token; None without log-probs."""

    @property
    def routes(self) -> int:
        """(token, layer) routes compared, all layers."""
        return sum(layer.routes for layer in self.layers)

    @property
    def differing(self) -> int:
        """Differing routes, all layers."""
        return sum(layer.differing for layer in self.layers)

    @property
    def measured(self) -> bool:
        """Whether any replayed route was compared: without one there is no figure (an
        empty meter, a forward of padding only), never a ``0.0`` that reads as agreement."""
        return self.routes > 0 and self.tokens > 0

    @property
    def route_share(self) -> float | None:
        """Share of (token, layer) routes that differ, all layers (None: none compared)."""
        return self.differing / self.routes if self.measured else None

    @property
    def overlap(self) -> float | None:
        """Mean ``|native ∩ replayed| / K`` over every compared route (None: none)."""
        if not self.measured:
            return None
        return sum(layer.overlap * layer.routes for layer in self.layers) / self.routes

    @property
    def token_share(self) -> float | None:
        """Share of real tokens with at least one differing layer (None: none compared)."""
        return self.tokens_differing / self.tokens if self.measured else None

    @property
    def layers_per_token(self) -> float | None:
        """Mean number of differing layers per real token (None: none compared)."""
        return self.differing / self.tokens if self.measured else None

    def merge(self, other: RoutingDrift) -> RoutingDrift:
        """The figures of both spans together (steps, micro-batches, ranks).

        Example:
            >>> run = sum(steps[1:], steps[0])            # RoutingDrift per step
            >>> run.layers_per_token
        """
        if other.top_k != self.top_k:
            raise SpecMismatch(
                "drift figures of another top-k cannot merge",
                expected=self.top_k,
                found=other.top_k,
                where="RoutingDrift.merge",
            )
        lp_tokens = self.logprob_tokens + other.logprob_tokens
        return RoutingDrift(
            top_k=self.top_k,
            layers=_merged_layers(self.layers, other.layers),
            tokens=self.tokens + other.tokens,
            tokens_differing=self.tokens_differing + other.tokens_differing,
            logprob_tokens=lp_tokens,
            kl_k3=_weighted(self.kl_k3, self.logprob_tokens, other.kl_k3, other.logprob_tokens),
            logprob_gap=_weighted(
                self.logprob_gap, self.logprob_tokens, other.logprob_gap, other.logprob_tokens
            ),
        )

    def __add__(self, other: RoutingDrift) -> RoutingDrift:
        return self.merge(other)

    @classmethod
    def empty(cls, top_k: int) -> RoutingDrift:
        """Nothing measured (the neutral element of ``merge``)."""
        return cls(
            top_k=top_k,
            layers=(),
            tokens=0,
            tokens_differing=0,
            logprob_tokens=0,
            kl_k3=None,
            logprob_gap=None,
        )

    def as_metrics(self, prefix: str = "routing_drift/") -> dict[str, float]:
        """Flat ``{key: float}`` for any logger (wandb, TensorBoard, MLflow).

        Keys, after ``prefix``: ``tokens``, ``routes``; once a route was compared
        (``measured``), ``route_diff_share``, ``overlap``, ``token_diff_share``,
        ``layers_per_token`` and per MoE layer ``l`` (the layers this rank measured):
        ``layer_{l}/route_diff_share``, ``layer_{l}/overlap``; with log-probs: ``kl_k3``,
        ``logprob_abs_gap``, ``logprob_tokens``. Nothing measured: no share, no overlap.

        Example:
            >>> meter.drift().as_metrics()["routing_drift/route_diff_share"]
            0.0125
        """
        shares = {
            "route_diff_share": self.route_share,
            "overlap": self.overlap,
            "token_diff_share": self.token_share,
            "layers_per_token": self.layers_per_token,
        }
        out = {f"{prefix}{key}": value for key, value in shares.items() if value is not None}
        out[f"{prefix}tokens"] = float(self.tokens)
        out[f"{prefix}routes"] = float(self.routes)
        for layer in self.layers:
            out[f"{prefix}layer_{layer.layer}/route_diff_share"] = layer.share
            out[f"{prefix}layer_{layer.layer}/overlap"] = layer.overlap
        if self.kl_k3 is not None and self.logprob_gap is not None:
            out[f"{prefix}kl_k3"] = self.kl_k3
            out[f"{prefix}logprob_abs_gap"] = self.logprob_gap
            out[f"{prefix}logprob_tokens"] = float(self.logprob_tokens)
        return out


def _merged_layers(a: tuple[LayerDrift, ...], b: tuple[LayerDrift, ...]) -> tuple[LayerDrift, ...]:
    rows = {layer.layer: layer for layer in a}
    for layer in b:
        mine = rows.get(layer.layer)
        if mine is None:
            rows[layer.layer] = layer
            continue
        routes = mine.routes + layer.routes
        rows[layer.layer] = LayerDrift(
            layer=layer.layer,
            routes=routes,
            differing=mine.differing + layer.differing,
            overlap=(mine.overlap * mine.routes + layer.overlap * layer.routes) / routes
            if routes
            else 1.0,
        )
    return tuple(rows[index] for index in sorted(rows))


def _weighted(a: float | None, n: int, b: float | None, m: int) -> float | None:
    """The mean of two means over ``n`` and ``m`` items (None: no item on either side)."""
    if a is None or not n:
        return b if m else None
    if b is None or not m:
        return a
    return (a * n + b * m) / (n + m)
