"""The CPU cost model (``sgl_tts.launch.cpu_profile``) and the memory planner on it: interpolation and
JSON round trip of a hand-made profile, ``solve`` on a hand-checked case, the planned CPU flags, the
cache key and a corrupt cache file, and one short measurement on a live CPU SGLang server."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sgl_tts.launch.cpu_profile import (CpuProfile, ProfileError, ProfileGrid, load_or_measure, machine_identity,
                                        measure_profile, profile_key, server_settings)
from sgl_tts.launch.cpu_serving import plan_cpu_pair
from sgl_tts.launch.memory import ModelShape, StageCosts, Workload, brute_force, solve

CONFIGS = Path(__file__).resolve().parents[1] / "sgl_tts" / "bench" / "configs"


def profile(prefill, decode, *, batches=(1, 2, 4), contexts=(11, 21), decode_tokens=2, model="m") -> CpuProfile:
    return CpuProfile(model, "key", "machine", "cpu", 2, "0.5.15", "2026-11-26", {"attention": "native"},
                      batches, contexts, decode_tokens, prefill, decode)


def test_the_profile_interpolates_holds_below_and_extends_linearly_above():
    p = profile(prefill=[[1.0, 3.0], [2.0, 5.0], [4.0, 9.0]], decode=[[0.1, 0.2], [0.2, 0.4], [0.4, 0.8]])
    # prefill's token axis is the prompts' length: contexts - decode_tokens / 2 = (10, 20)
    assert p.prefill(1, 10) == 1.0 and p.prefill(4, 20) == 9.0
    assert p.prefill(1, 15) == pytest.approx(2.0)           # halfway between 10 and 20 tokens
    assert p.prefill(3, 10) == pytest.approx(3.0)           # halfway between batch 2 and 4
    assert p.prefill(3, 15) == pytest.approx((3.5 + 6.5) / 2)   # batch 2 at 15 tokens 3.5, batch 4 6.5
    assert p.prefill(1, 5) == 1.0                           # below the grid: held
    assert p.prefill(4, 30) == pytest.approx(14.0)          # above: the last cell's slope (+5 per 10 tokens)
    assert p.decode_step(2, 16) == pytest.approx(0.3)       # contexts 11 and 21: halfway
    assert p.decode_step(8, 21) == pytest.approx(1.6)       # batch 8: twice batch 4's step
    assert p.decode_step(1, 1) == pytest.approx(0.1)


def test_the_profile_round_trips_through_json_and_refuses_bad_tables(tmp_path):
    p = profile(prefill=[[1.0, 3.0], [2.0, 5.0], [4.0, 9.0]], decode=[[0.1, 0.2], [0.2, 0.4], [0.4, 0.8]])
    path = p.save(tmp_path / "p.json")
    assert CpuProfile.load(path) == p
    assert json.loads(path.read_text())["format"] == 1
    with pytest.raises(ValueError, match="3 x 2"):
        profile(prefill=[[1.0, 3.0]], decode=[[0.1, 0.2], [0.2, 0.4], [0.4, 0.8]])
    with pytest.raises(ValueError, match="positive"):
        profile(prefill=[[1.0, 3.0], [2.0, 5.0], [4.0, 0.0]], decode=[[0.1, 0.2], [0.2, 0.4], [0.4, 0.8]])


def test_solve_on_a_hand_checked_cpu_case():
    """N = 4 requests, prompt 8, step 4, PRM input 10; generator KV 10 B/token (120 B a request), PRM
    5 B/token (50 B a request), budget 400 B. Boundary: B_pre 1..3 -> B_dec 2, B_pre 4..5 -> B_dec 1.
    Generator, 4 steps at cached 10: batch 1 step 1.0 s -> 4 x 4 x 1.0 = 16; batch 2 step 1.2 -> 2 x
    4 x 1.2 = 9.6. PRM prefill of 10 tokens: batch 1 1.0 -> 4.0; batch 2 1.5 -> 3.0; room 3: batch 3
    is 2.05 -> 4.1, so batch 2 (3.0); room 4: 2.6. Totals: (1, 2) 13.6, (2, 2) 12.6, (3, 2) 12.6,
    (4, 1) 18.6, (5, 1) 18.6: B_pre 2 (the tie goes to the smaller PRM room), B_dec 2."""
    gen = ModelShape("gen", 1, 10, 0, 0, 0, 0)
    prm = ModelShape("prm", 1, 5, 0, 0, 0, 0)
    costs = StageCosts(profile(prefill=[[9.0, 9.0], [9.0, 9.0], [9.0, 9.0]],
                               decode=[[1.0, 3.0], [1.2, 3.0], [2.0, 3.0]], contexts=(10, 20)),
                       profile(prefill=[[1.0, 9.0], [1.5, 9.0], [2.6, 9.0]], decode=[[9.0, 9.0]] * 3))
    work = Workload(requests=4, prompt_tokens=8, step_tokens=4, verify_tokens=10)
    plan = solve(gen, prm, costs, work, 400)
    assert (plan.prm_room, plan.gen_room, plan.prm_batch, plan.gen_batch) == (2, 2, 2, 2)
    # the 60 bytes the batches leave (400 - 100 - 240) go to both pools by need, 100 : 240
    assert (plan.prm_kv_bytes, plan.gen_kv_bytes) == (int(100 + 60 * 100 / 340), int(400 - (100 + 60 * 100 / 340)))
    assert (plan.prm_kv_bytes, plan.gen_kv_bytes) == (117, 282)
    assert plan.prm_seconds == pytest.approx(3.0) and plan.gen_seconds == pytest.approx(9.6)
    assert brute_force(gen, prm, costs, work, 400) == (pytest.approx(12.6), 2, 2)


def test_the_planned_cpu_split_gives_the_prm_one_context_and_the_generator_the_rest():
    """The bench's CPU models (generator 2,048 B/token, PRM 3,584 B/token, context 2,048) at 24 MiB: a
    PRM whose prefill gains nothing from batching (time linear in batch) gets room 1, raised to one
    context-long request (2,048 x 3,584 = 7,340,032 B); the generator the rest, 17,825,792 B = 8,704
    tokens."""
    gen, prm = CONFIGS / "tiny-cpu-generator.json", CONFIGS / "tiny-cpu-prm.json"
    linear = [[0.01 * b, 0.02 * b] for b in (1, 2, 4)]
    decode = [[0.010, 0.012], [0.011, 0.013], [0.013, 0.016]]   # batching pays: more generator room
    costs = StageCosts(profile(linear, decode, contexts=(256, 1024)), profile(linear, decode, contexts=(256, 1024)))
    work = Workload(requests=64, prompt_tokens=700, step_tokens=54, verify_tokens=780)
    p = plan_cpu_pair(gen, prm, "24MiB", work, costs)
    # room: (25,165,824 - 780 x 3,584) // (754 x 2,048) = 22,370,304 // 1,544,192 = 14 generator requests
    assert (p.plan.prm_room, p.plan.gen_room, p.plan.prm_batch) == (1, 14, 1)
    assert p.flags["prm"].max_total_tokens == 2048
    assert p.flags["generator"].max_total_tokens == 8704
    assert p.generator_share == pytest.approx(17_825_792 / 25_165_824)
    with pytest.raises(ValueError, match="cannot hold one context-long request"):
        plan_cpu_pair(gen, prm, "8MiB", work, costs)


def test_the_cache_key_follows_the_model_and_settings_and_a_corrupt_file_is_named(tmp_path):
    gen, prm = CONFIGS / "tiny-cpu-generator.json", CONFIGS / "tiny-cpu-prm.json"
    native = server_settings(None, "native")
    key = profile_key(gen, native)
    assert key.startswith("configs-") and key == profile_key(gen, native)
    assert len({key, profile_key(prm, native), profile_key(gen, server_settings(None, "ragged")),
                profile_key(gen, native, ProfileGrid(batches=(1, 2)))}) == 4
    assert set(machine_identity()) == {"cpu", "cores", "sglang"} and machine_identity()["sglang"] == "0.5.15"
    (tmp_path / f"{key}.json").write_text('{"format": 1, "model": "tiny-cpu-gen')
    with pytest.raises(ProfileError, match=f"the cached CPU profile .*{key}.json is corrupt.*--remeasure"):
        load_or_measure(gen, cache_dir=tmp_path)
    good = dataclasses.replace(profile([[1.0, 2.0]] * 3, [[0.1, 0.2]] * 3), key=key)
    good.save(tmp_path / f"{key}.json")
    assert load_or_measure(gen, cache_dir=tmp_path) == good   # a cached profile is read, nothing started


def test_the_grid_gives_way_to_the_models_context():
    """A point's longest request: a prompt of C - decode_tokens // 2 tokens and decode_tokens + 1 new
    ones; SGLang answers 400 for a prompt past the model's context and generates at most context - 2
    tokens in all (the shipped tiny models have 512 positions: `sgl-tts serve --device cpu` failed
    measuring them at context 512 and 1024)."""
    from sgl_tts.launch.memory import context_tokens
    from sgl_tts.models import shipped_model

    grid = ProfileGrid()
    assert grid.contexts == (128, 512, 1024) and grid.within(0) is grid and grid.within(4096) is grid
    assert grid.within(512).contexts == (128, 501) and grid.within(512).batches == grid.batches
    assert grid.within(100).contexts == (89,)                   # every context gives way to the one that fits
    with pytest.raises(ValueError, match="a model of 20 tokens of context has no room"):
        grid.within(20)
    gen = shipped_model("generator")
    assert context_tokens(gen) == 512
    native = server_settings(None, "native")
    assert profile_key(gen, native, grid.within(512)) != profile_key(gen, native)   # what load_or_measure keys by


@pytest.mark.server
@pytest.mark.timeout(300)
def test_a_short_live_measurement_is_positive_and_grows_with_the_batch(tiny_model_path):
    """Batch 1 vs 8 at contexts 64 and 256, the minimum of two repeats, on a real CPU server (float32,
    the shipped tiny model's shape). A decode step over 8 sequences does 8x the attention and the
    same weight pass, so it is never cheaper than over 1; measured noise on 2 shared cores is a few ms,
    so the check allows 20% (the step itself is several ms). Prefill of 8 prompts is 8x the work of
    one. (With one repeat it failed once beside another job on the two cores.)"""
    grid = ProfileGrid(batches=(1, 8), contexts=(64, 256), decode_tokens=8, repeats=2)
    p = measure_profile(tiny_model_path, dtype="float32", grid=grid, progress=False)
    assert p.batches == (1, 8) and p.contexts == (64, 256) and p.sglang == "0.5.15"
    assert all(v > 0 for row in p.prefill_seconds + p.decode_seconds for v in row)
    for j in range(2):
        assert p.decode_seconds[1][j] >= 0.8 * p.decode_seconds[0][j]
        assert p.prefill_seconds[1][j] >= 0.8 * p.prefill_seconds[0][j]
    assert p.prefill_seconds[1][1] >= 0.8 * p.prefill_seconds[1][0]   # 8 x 252 tokens vs 8 x 60


def _cached_profiles(models_dir: Path, cache: Path) -> None:
    """The bench's CPU models' folders, with the hand-made profiles of the planned-split case cached."""
    from sgl_tts.bench.command import model_folder

    linear = [[0.01 * b, 0.02 * b] for b in (1, 2, 4)]
    decode = [[0.010, 0.012], [0.011, 0.013], [0.013, 0.016]]
    for name in ("tiny-cpu-generator", "tiny-cpu-prm"):
        folder = model_folder(name, models_dir)
        key = profile_key(folder, server_settings(None, "native"))
        dataclasses.replace(profile(linear, decode, contexts=(256, 1024), model=name), key=key).save(cache / f"{key}.json")


def test_bench_on_the_cpu_plans_the_sgl_tts_side_and_keeps_the_stock_split(tmp_path, capsys):
    """The planned-split case above through ``sgl-tts bench --device cpu`` (profiles from the cache):
    the sgl-tts side's PRM gets one context (2,048 tokens), its generator the rest of 24 MiB (8,704);
    the stock side keeps --stock-split 0.5 (6,144 and 3,510 tokens)."""
    from sgl_tts.bench.command import apply_device_defaults, bench_header, prepare
    from sgl_tts.cli.bench import build_parser, main as bench_main

    _cached_profiles(tmp_path / "models", tmp_path / "profiles")
    argv = ["--device", "cpu", "--n", "64", "--algorithms", "beam_search", "--kv-memory", "24MiB",
            "--prompt-tokens", "512", "--models-dir", str(tmp_path / "models"), "--profile-dir", str(tmp_path / "profiles")]
    assert bench_main([*argv, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    pools = {name: int(cmd.split("--max-total-tokens ")[1].split()[0]) for name, cmd in zip(lines[1::2], lines[2::2])}
    assert pools == {"# stock generator": 6144, "# stock prm": 3510, "# sgl-tts generator": 8704, "# sgl-tts prm": 2048}
    args = build_parser().parse_args(argv)
    apply_device_defaults(args)
    header = bench_header(args, argv, prepare(args))
    assert header["splits"]["stock"] == {"generator_share": 0.5, "planned": False}
    planned = header["splits"]["sgl-tts"]
    assert planned["planned"] is True and planned["generator_share"] == round(17_825_792 / 25_165_824, 4)
    # a PRM whose prefill time is linear in the batch batches one request; what the batches leave is
    # split by need (3 PRM requests of the shared-prompt workload), and its pool is raised to one context
    assert planned["batches"]["prm"] == 1 and planned["rooms"]["prm"] == 3
    assert header["workload"]["requests"] == 64
    assert (header["workload"]["shared_tokens"], header["workload"]["siblings"]) == (512, 4)


def test_plan_on_the_cpu_prints_the_same_split(tmp_path, capsys):
    from sgl_tts.cli.plan import main as plan_main

    _cached_profiles(tmp_path / "models", tmp_path / "profiles")
    assert plan_main(["--device", "cpu", "--generator", str(tmp_path / "models" / "tiny-cpu-generator"),
                      "--prm", str(tmp_path / "models" / "tiny-cpu-prm"), "--cpu-attention", "native",
                      "--kv-memory", "24MiB", "--beams", "64", "--prompt-tokens", "700", "--step-tokens", "54",
                      "--verify-tokens", "780", "--profile-dir", str(tmp_path / "profiles"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["plan"]["prm_room"], out["plan"]["gen_room"]) == (1, 14)
    assert out["flags"]["generator"][:4] == ["--device", "cpu", "--max-total-tokens", "8704"]
    assert out["flags"]["prm"][:4] == ["--device", "cpu", "--max-total-tokens", "2048"]


def test_a_point_reads_each_timing_from_its_quietest_sample():
    """Prefill, the 1-token and the (1 + D)-token times each take their own minimum over the samples
    (the repeats that took turns over the grid): a burst of load on one sample's 1-token time does not
    shorten the decode step, and a step that noise makes negative is kept at 1 us."""
    from sgl_tts.launch.cpu_profile import _point_from_samples

    grid = ProfileGrid(batches=(1,), contexts=(64,), decode_tokens=8, repeats=3)
    samples = [(0.50, 0.90, 0.98), (0.20, 0.10, 0.20), (0.30, 0.12, 0.17)]   # the first under a burst
    prefill, step = _point_from_samples(samples, 1, 64, grid)
    assert prefill == 0.20 and step == pytest.approx((0.17 - 0.10) / 8)
    assert _point_from_samples([(0.2, 0.3, 0.1)], 1, 64, grid) == (0.2, 1e-6)
