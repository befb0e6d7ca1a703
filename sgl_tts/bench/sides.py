"""What each side of ``sgl-tts bench`` runs: the stock sides (SGLang's own scheduling policies), the
sgl-tts sides (the plugin, and the program settings of the speculation ablation), each side's
``sgl-tts run`` settings, and the decode curve an ``auto`` side decides on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl_tts.bench.errors import BenchError

if TYPE_CHECKING:
    from sgl_tts.bench.goodput_settings import BenchSettings
    from sgl_tts.bench.trace import StepTrace
    from sgl_tts.launch.decode_curve import MeasuredCurve

SIDES = ("stock", "sgl-tts")   # the default sides
# The stock sides: SGLang's own scheduling (the plugin observe-only), under each scheduling policy a user would try for prefix
# reuse before a plugin (issue 32): its default (fcfs), lpm (longest prefix match first) and
# dfs-weight (a depth-first walk of the radix tree, weighted by waiting requests). None: SGLang's default.
# ``stock+overlap`` runs the sgl-tts client (overlapped verification) on the stock servers: what the
# client alone wins, with no plugin (issue 64).
STOCK_POLICIES: dict[str, str | None] = {"stock": None, "stock-lpm": "lpm", "stock-dfs-weight": "dfs-weight",
                                         "stock+overlap": None}
# The baselines: stock SGLang and its own client-free programs, what a user would pick instead of sgl-tts
# (a report's "best stock" is the best of these)
BASELINES = ("stock", "stock-lpm", "stock-dfs-weight")
# Each side's run settings (issue 18's ablation, seed 000 Fig. 15): prefix-aware order (the plugin,
# "sgl-tts"), then speculative beam extension (exact mode), then LookAhead verification, then
# overlapped verification. Every sgl-tts side runs on the same servers' flags; only the program's
# settings differ, given as :class:`~sgl_tts.experiment.RunConfig` fields (the registry maps them).
SIDE_OPTIONS: dict[str, dict[str, Any]] = {
    "stock": {},
    "stock-lpm": {},
    "stock-dfs-weight": {},
    "stock+overlap": {"overlap_verification": True},
    "sgl-tts": {},
    "sgl-tts+spec": {"speculative": "exact-no-lookahead"},
    "sgl-tts+spec+lookahead": {"speculative": "exact"},
    "sgl-tts+spec+lookahead+overlap": {"speculative": "exact", "overlap_verification": True},
    "sgl-tts+locality": {},
    # the locality policy's rules one at a time (its ablation): which one cuts the recomputation
    "sgl-tts+locality-eviction": {},
    "sgl-tts+locality-order": {},
    # both rules and whole-family admission (--tts-locality-rules families)
    "sgl-tts+locality-families": {},
    # exact speculation under the cost controller (issue 33), on the generator's measured decode curve
    "sgl-tts+auto": {"speculative": "auto"},
    # overlapped verification alone (a beam's PRM request as soon as its step ends; no speculation)
    "sgl-tts+overlap": {"overlap_verification": True},
    # the setting to recommend: speculation where the curve says it pays, verification overlapped
    "sgl-tts+auto+overlap": {"speculative": "auto", "overlap_verification": True},
    # under KV pressure (issue 32): the locality policy on both servers and overlapped verification
    "sgl-tts+locality+overlap": {"overlap_verification": True},
    # the same, a family's PRM requests sent together once its siblings' steps ended (the PRM's cache)
    "sgl-tts+locality+overlap-by-family": {"overlap_verification": True, "overlap_by_family": True},
    "sgl-tts+locality-families+overlap-by-family": {"overlap_verification": True, "overlap_by_family": True},
    "sgl-tts+locality-families+overlap": {"overlap_verification": True},
    # many searches at once (issue 64): the oldest search's requests first on both servers
    # (--tts-admission search), without and with overlapped verification
    "sgl-tts+search-first": {},
    "sgl-tts+search-first+overlap": {"overlap_verification": True},
}
# The plugin's policy on an sgl-tts side's servers (:class:`~sgl_tts.plugin.settings.TTSSettings` fields):
# ``prefix-aware`` on the generator unless named here; a side named here runs these settings on both
# servers (the PRM's queue and radix cache are under the same pressure as the generator's, issue 32).
# --tts-admission search without aging: a request of a newer search that waited max_wait would go
# before the older searches' (which are what holds it back, and end)
_SEARCH_FIRST: dict[str, Any] = {"policy": "prefix-aware", "admission": "search", "max_wait": None}
SERVER_POLICIES: dict[str, dict[str, Any]] = {
    "sgl-tts+locality": {"policy": "locality"},
    "sgl-tts+locality-eviction": {"policy": "locality", "locality_rules": "eviction"},
    "sgl-tts+locality-order": {"policy": "locality", "locality_rules": "order"},
    "sgl-tts+locality-families": {"policy": "locality", "locality_rules": "families"},
    "sgl-tts+locality+overlap": {"policy": "locality"},
    "sgl-tts+locality+overlap-by-family": {"policy": "locality"},
    "sgl-tts+locality-families+overlap-by-family": {"policy": "locality", "locality_rules": "families"},
    "sgl-tts+locality-families+overlap": {"policy": "locality", "locality_rules": "families"},
    "sgl-tts+search-first": _SEARCH_FIRST,
    "sgl-tts+search-first+overlap": _SEARCH_FIRST,
}
ALL_SIDES = tuple(SIDE_OPTIONS)
# The load mode's sides (``--arrivals``, issue 64), which attribute a gain to its part: the baselines;
# the sgl-tts client on stock servers; the plugin's orders alone (prefix-aware, locality, locality with
# whole-family admission, the oldest search first); each with overlapped verification; and the
# recommended setting.
LOAD_SIDES = ("stock", "stock-lpm", "stock-dfs-weight", "stock+overlap", "sgl-tts", "sgl-tts+locality",
              "sgl-tts+locality-families", "sgl-tts+search-first", "sgl-tts+overlap", "sgl-tts+locality+overlap",
              "sgl-tts+locality-families+overlap", "sgl-tts+search-first+overlap", "sgl-tts+auto+overlap")


def is_stock(side: str) -> bool:
    """A side on stock SGLang's servers (no scheduling plugin: sgl-tts observe-only), as opposed to
    the sgl-tts servers."""
    return side in STOCK_POLICIES


def is_baseline(side: str) -> bool:
    """A side with no part of sgl-tts in it (:data:`BASELINES`): stock servers, no client setting."""
    return side in BASELINES


def run_config(side: str, algorithm: str, n: int, settings: "BenchSettings", trace: "StepTrace"):
    """``sgl-tts run``'s settings for one side's searches of ``algorithm`` at budget ``n``: the program's
    arguments come from its registry record, as ``sgl-tts run`` gives them."""
    from sgl_tts.experiment import RunConfig

    cfg = RunConfig(program=algorithm, n=n, beam_width=settings.beam_width, max_depth=trace.max_depth,
                    step_tokens=[trace.max_tokens], temperature=settings.temperature, seed=settings.seed,
                    progress=False, **SIDE_OPTIONS[side])
    cfg.validate()
    return cfg


def side_curve(side: str, generator_url: str, settings: "BenchSettings", trace: "StepTrace") -> "MeasuredCurve":
    """``speculative: auto``'s decode curve for ``side``: the generator server's
    (:func:`sgl_tts.launch.decode_curve.curve_for_server`, cached per server and machine) at a
    search's mean context (the prompt and half the trace's depth of median steps). A curve that
    cannot be measured raises :class:`~sgl_tts.bench.errors.BenchError` naming the side."""
    from sgl_tts.launch.cpu_profile import ProfileError
    from sgl_tts.launch.decode_curve import curve_for_server

    context = int(settings.prompt_tokens + trace.median_tokens * trace.max_depth / 2)
    if settings.context_tokens:
        context = min(context, settings.context_tokens // 2)
    try:
        return curve_for_server(generator_url, context=max(32, context))
    except ProfileError as exc:
        raise BenchError(f"side {side}: its decode curve: {exc}") from None


def side_slowdown(side: str, generator_url: str, prm_url: str):
    """``speculative: auto``'s measure of the PRM's slowdown beside generation for ``side`` (both
    servers of a bench side share this machine): :func:`sgl_tts.launch.verifier_slowdown.slowdown_for_servers`,
    cached per pair. A slowdown that cannot be measured raises :class:`~sgl_tts.bench.errors.BenchError`
    naming the side."""
    from sgl_tts.launch.cpu_profile import ProfileError
    from sgl_tts.launch.verifier_slowdown import slowdown_for_servers

    try:
        return slowdown_for_servers(generator_url, prm_url)
    except ProfileError as exc:
        raise BenchError(f"side {side}: the verifier's slowdown: {exc}") from None
