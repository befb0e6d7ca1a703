"""The memory planner (sgl_tts.launch.memory): sizes from real config.json files, the roofline-guided split
against brute force, the boundary property, SGLang flags in start-up order, refusals."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from sgl_tts.launch.memory import (HARDWARE, GiB, Hardware, ModelShape, Workload, brute_force, offload_plan,
                            parse_bytes, plan_pair, server_flags, solve, static_split_flags)

CONFIGS = Path(__file__).parent / "data" / "configs"


@pytest.mark.parametrize("name, kv_bytes, params_billion", [
    # KV per token = 2 (K, V) x layers x KV heads x head dim x 2 bytes (bf16)
    ("qwen2.5-1.5b", 2 * 28 * 2 * 128 * 2, 1.54),
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2, 7.62),
    ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2, 8.03),
    ("mistral-7b-v0.1", 2 * 32 * 8 * 128 * 2, 7.24),
    # MLA: layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes, one latent for all heads
    ("deepseek-v2-lite", 27 * (512 + 64) * 2, 15.7),
])
def test_kv_and_weight_sizes_from_real_configs(name, kv_bytes, params_billion):
    shape = ModelShape.from_config(CONFIGS / f"{name}.json")
    assert shape.kv_bytes_per_token == kv_bytes
    assert shape.params / 1e9 == pytest.approx(params_billion, rel=0.01)
    assert shape.weight_bytes == 2 * shape.params           # bf16, no checkpoint files next to it
    assert ModelShape.from_config(CONFIGS / f"{name}.json", kv_dtype="fp8").kv_bytes_per_token == kv_bytes // 2


def test_a_model_folder_counts_its_checkpoint_bytes():
    from sgl_tts.models import shipped_model

    folder = shipped_model("prm")
    shape = ModelShape.from_config(folder)
    assert shape.weight_bytes == (folder / "model.safetensors").stat().st_size
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelShape.from_config(CONFIGS / "missing")
    with pytest.raises(ValueError, match="lacks 'num_hidden_layers'"):
        ModelShape.from_config({"hidden_size": 8})


def pool_bytes(model, head, per, b):
    """Bytes of a pool of ``b`` requests, from the Workload's definition: the head once, then ``b``
    requests' own parts."""
    return model.kv_bytes_per_token * (head + b * per)


def random_instance(rng):
    cfgs = sorted(CONFIGS.glob("*.json"))
    gen = ModelShape.from_config(rng.choice(cfgs))
    prm = ModelShape.from_config(rng.choice(cfgs))
    hw = rng.choice(list(HARDWARE.values()))
    prompt, verify = rng.randrange(16, 600), rng.randrange(16, 900)
    shared = rng.choice([0, rng.randrange(0, min(prompt, verify) + 1)])
    work = Workload(requests=rng.randrange(1, 40), prompt_tokens=prompt, step_tokens=rng.randrange(8, 400),
                    verify_tokens=verify, shared_tokens=shared, siblings=rng.choice([1, 1, 2, 4, 8]))
    # the shared head is held once; a request holds its siblings' share of the rest of the context
    # and its own part (the generator its step, the PRM what it reads past the generator's context)
    common = min(prompt, verify)
    per_pre = (common - shared) / work.siblings + verify - common
    per_dec = (prompt - shared) / work.siblings + work.step_tokens
    kv_pre = lambda b: pool_bytes(prm, shared, per_pre, b)  # noqa: E731
    kv_dec = lambda b: pool_bytes(gen, shared, per_dec, b)  # noqa: E731
    one = kv_pre(1) + kv_dec(1)
    budget = int(one + rng.randrange(0, 30) * max(kv_pre(1), kv_dec(1)))
    return gen, prm, hw, work, budget, kv_pre, kv_dec


def test_the_search_equals_brute_force_and_splits_the_rest_by_need():
    rng = random.Random(0)
    for _ in range(300):
        gen, prm, hw, work, budget, kv_pre, kv_dec = random_instance(rng)
        plan = solve(gen, prm, hw, work, budget)
        t, _, _ = brute_force(gen, prm, hw, work, budget)
        assert plan.total_seconds == t
        # the whole budget is given out, and each pool holds the rooms the plan names
        assert budget - 2 <= plan.prm_kv_bytes + plan.gen_kv_bytes <= budget
        assert kv_pre(plan.prm_room) <= plan.prm_kv_bytes + 1 < kv_pre(plan.prm_room + 1)
        assert kv_dec(plan.gen_room) <= plan.gen_kv_bytes + 1 < kv_dec(plan.gen_room + 1)
        assert 1 <= plan.prm_batch <= min(plan.prm_room, work.requests)
        assert 1 <= plan.gen_batch <= min(plan.gen_room, work.requests)
        # what the best batches leave over goes to both pools in proportion to those batches' needs
        need_pre, need_dec = kv_pre(plan.prm_batch), kv_dec(plan.gen_batch)
        assert plan.prm_kv_bytes == pytest.approx(budget * need_pre / (need_pre + need_dec), abs=2)


def test_more_memory_never_predicts_more_time():
    rng = random.Random(1)
    for _ in range(50):
        gen, prm, hw, work, budget, kv_pre, kv_dec = random_instance(rng)
        times = [solve(gen, prm, hw, work, budget + int(k * kv_dec(1))).total_seconds for k in range(5)]
        assert times == sorted(times, reverse=True)


def test_under_pressure_decode_wants_the_memory_prefill_saturates():
    """The seed's asymmetry on its 1.5B+1.5B configuration, where both models cannot batch a whole
    iteration (256 requests in 0.4 x 24 GB): most of the KV budget goes to the generator, and the
    verifier is compute bound at the chosen batch."""
    gen = prm = ModelShape.from_config(CONFIGS / "qwen2.5-1.5b.json")
    hw = HARDWARE["RTX4090"]
    work = Workload(requests=256, prompt_tokens=300, step_tokens=256, verify_tokens=800)
    plan, off = plan_pair(gen, prm, hw, work, int(0.4 * 24 * GiB))
    assert plan.gen_kv_bytes > 2 * plan.prm_kv_bytes and plan.gen_batch > plan.prm_batch
    flops_time = plan.prm_batch * work.verify_tokens * prm.flops_per_token / (hw.tflops * 1e12)
    assert plan.prm_seconds >= flops_time * (256 // plan.prm_batch) > 0
    assert off is not None and off.offload_seconds > 0



def test_a_service_is_planned_for_its_searches_in_flight(capsys):
    """Issue 64 (docs/MEMORY_PLANNER.md, "Under load"): planned for one search, a service with five in
    flight gave its generator too small a pool. With ``searches`` the workload is every search's
    requests, each search's question held once, and the generator gets the larger share."""
    import argparse

    from sgl_tts.launch.memory import workload_from_args

    one = Workload(64, 1275, 254, 1529, shared_tokens=300, siblings=4)
    five = Workload(320, 1275, 254, 1529, shared_tokens=300, siblings=4, searches=5)
    # five questions held once each; a request's own share is the same as in one search
    assert five.generator_tokens() == (1500, one.generator_tokens()[1]) and one.generator_tokens()[0] == 300
    assert five.prm_tokens() == (1500, one.prm_tokens()[1])
    qwen = ModelShape.from_config(CONFIGS / "qwen2.5-1.5b.json")
    budget = int(0.4 * 24 * GiB)
    plans = [plan_pair(qwen, qwen, HARDWARE["H200"], w, budget)[0] for w in (one, five)]
    shares = [round(p.gen_kv_bytes / (p.gen_kv_bytes + p.prm_kv_bytes), 3) for p in plans]
    assert shares == [0.5, 0.791]
    assert [(p.gen_batch, p.prm_batch, p.gen_room, p.prm_room) for p in plans] == [(64, 64, 106, 106), (160, 40, 166, 41)]
    # the flags: K searches of --beams requests each
    args = argparse.Namespace(beams=64, prompt_tokens=1275, step_tokens=254, verify_tokens=1529,
                              shared_tokens=300, siblings=4, searches_in_flight=5)
    assert workload_from_args(args) == five
    args.searches_in_flight = 0
    with pytest.raises(ValueError, match=r"^--searches-in-flight must be >= 1, got 0$"):
        workload_from_args(args)
    from sgl_tts.cli.plan import main

    qwen_cfg = str(CONFIGS / "qwen2.5-1.5b.json")
    assert main(["--generator", qwen_cfg, "--prm", qwen_cfg, "--gpu", "H200", "--gpu-memory", "0.4*24GiB",
                 "--beams", "64", "--prompt-tokens", "1275", "--step-tokens", "254", "--verify-tokens", "1529",
                 "--shared-tokens", "300", "--siblings", "4", "--searches-in-flight", "5"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("; 320 requests, prompt 1275, step 254, verify 1529 tokens (5 searches in flight, "
                           "300 shared by each search's requests, the rest of a context by 4 siblings)")

def test_the_h200_run_plan_batches_the_verifier_and_keeps_both_caches():
    """The failure measured on an H200 (issue 37, docs/benchmarks/LOG.md "GPU results"): the seed's model
    (no cost per forward pass, every request's whole context counted) gives the PRM room for one
    request, and the server then ran every PRM request alone. With the fixed cost per forward pass
    and the shared question / sibling paths, both models batch all 64 and the rest of the budget is
    split between the caches."""
    import dataclasses

    qwen = ModelShape.from_config(CONFIGS / "qwen2.5-1.5b.json")
    budget = int(0.4 * 24 * GiB)
    seed_hw = dataclasses.replace(HARDWARE["H200"], forward_seconds=0.0)
    seed, _ = plan_pair(qwen, qwen, seed_hw, Workload(64, 1275, 254, 1529), budget)
    assert (seed.prm_room, seed.prm_batch) == (1, 1)
    work = Workload(64, 1275, 254, 1529, shared_tokens=300, siblings=4)
    plan, _ = plan_pair(qwen, qwen, HARDWARE["H200"], work, budget)
    assert (plan.prm_batch, plan.gen_batch) == (64, 64)
    # a request holds 254 + 975 / 4 tokens of its own: 497.75 of each pool's tokens, 300 shared once
    per_request = qwen.kv_bytes_per_token * (254 + (1275 - 300) / 4)
    assert plan.prm_room == plan.gen_room == int((plan.prm_kv_bytes - 300 * qwen.kv_bytes_per_token) // per_request)
    assert plan.prm_room > 100
    reserve = max(GiB, int(0.08 * budget))
    flags = server_flags(plan, qwen, qwen, work, budget, reserve, min_pool_tokens={"generator": 4096, "prm": 4096})
    assert "--max-running-requests" not in flags["prm"].args()        # the PRM batches what its pool holds
    assert flags["generator"].max_running_requests == 64
    assert flags["prm"].chunked_prefill_size == 64 * 1529


def _small_gen_large_prm():
    """A 1.5B generator + 7B PRM planned for 32 requests in 90% of a 24 GB card (2 GiB reserve)."""
    gen = ModelShape.from_config(CONFIGS / "qwen2.5-1.5b.json")
    prm = ModelShape.from_config(CONFIGS / "qwen2.5-7b.json")
    work = Workload(requests=32, prompt_tokens=200, step_tokens=128, verify_tokens=600)
    gpu, reserve = int(0.9 * 24 * GiB), 2 * GiB
    plan, _ = plan_pair(gen, prm, HARDWARE["RTX4090"], work, gpu, reserve_bytes=reserve)
    return gen, prm, work, gpu, reserve, plan


def test_second_server_fraction_is_of_what_the_first_left():
    gen, prm, work, gpu, reserve, plan = _small_gen_large_prm()
    flags = server_flags(plan, gen, prm, work, gpu, reserve, first="generator")
    g_static = gen.weight_bytes + plan.gen_kv_bytes
    assert flags["generator"].mem_fraction_static == pytest.approx(g_static / gpu)
    assert flags["prm"].mem_fraction_static == pytest.approx(
        (prm.weight_bytes + plan.prm_kv_bytes) / (gpu - g_static - reserve // 2))
    other = server_flags(plan, gen, prm, work, gpu, reserve, first="prm")
    assert other["prm"].mem_fraction_static == pytest.approx((prm.weight_bytes + plan.prm_kv_bytes) / gpu)
    assert flags["generator"].max_total_tokens == plan.gen_kv_bytes // gen.kv_bytes_per_token
    assert flags["prm"].chunked_prefill_size == plan.prm_batch * 600
    assert flags["generator"].args()[:2] == ["--mem-fraction-static", f"{g_static / gpu:.4f}"]
    assert "--enable-hierarchical-cache" not in flags["generator"].args()
    _, off = plan_pair(gen, prm, HARDWARE["RTX4090"], work, gpu, reserve_bytes=reserve)
    tiered = server_flags(plan, gen, prm, work, gpu, reserve, offload=off)
    args = tiered["generator"].args()
    assert args[args.index("--hicache-size") + 1] == str(math.ceil(off.gen_kv_bytes / 1e9))
    assert tiered["generator"].mem_fraction_static == flags["generator"].mem_fraction_static


def test_each_pool_holds_its_longest_request_taken_from_the_other_pool():
    gen, prm, work, gpu, reserve, plan = _small_gen_large_prm()
    pool = plan.prm_kv_bytes // prm.kv_bytes_per_token
    floor = pool + 4000
    flags = server_flags(plan, gen, prm, work, gpu, reserve, min_pool_tokens={"prm": floor, "generator": 4096})
    assert flags["prm"].max_total_tokens == floor
    moved = floor * prm.kv_bytes_per_token - plan.prm_kv_bytes
    assert flags["generator"].max_total_tokens == (plan.gen_kv_bytes - moved) // gen.kv_bytes_per_token
    assert flags["generator"].max_running_requests == plan.gen_batch    # the generator's batch stays as planned
    assert flags["prm"].max_running_requests is None
    with pytest.raises(ValueError, match="cannot give each server a pool of its longest request"):
        server_flags(plan, gen, prm, work, gpu, reserve, min_pool_tokens={"prm": 10**6})


def test_the_static_split_gives_each_server_its_share_less_half_the_reserve():
    gen = ModelShape.from_config(CONFIGS / "qwen2.5-1.5b.json")
    gpu, reserve = int(0.4 * 24 * GiB), GiB
    flags = static_split_flags(gen, gen, gpu, reserve, 0.5)
    static = 0.5 * gpu - reserve / 2
    assert flags["generator"].max_total_tokens == int((static - gen.weight_bytes) // gen.kv_bytes_per_token)
    assert flags["prm"].max_total_tokens == flags["generator"].max_total_tokens
    assert flags["generator"].mem_fraction_static == pytest.approx(static / gpu)
    assert flags["prm"].mem_fraction_static == pytest.approx(static / (gpu - static - reserve // 2))
    assert "--max-running-requests" not in flags["generator"].args()   # SGLang's own batch limit
    with pytest.raises(ValueError, match=r"a 5% share \(0.48 GiB less half the reserve\) does not hold the "
                                         r"generator's weights \(2.88 GiB\)"):
        static_split_flags(gen, gen, gpu, reserve, 0.05)
    # each pool must hold its longest request too; the error names the shares that would
    with pytest.raises(ValueError, match=r"a 50% share leaves the generator a pool of \d+ tokens, less than its "
                                         r"longest request \(100000\); choose a generator share between "
                                         r"0.\d\d and 0.\d\d"):
        static_split_flags(gen, gen, gpu, reserve, 0.5, min_pool_tokens={"generator": 100_000})


def test_a_plan_that_cannot_fit_is_refused_with_the_numbers():
    big = ModelShape.from_config(CONFIGS / "llama-3.1-8b.json")
    work = Workload(requests=8, prompt_tokens=100, step_tokens=64, verify_tokens=200)
    with pytest.raises(ValueError, match=r"the weights alone do not fit: generator 14\.96 GiB \+ PRM "
                                         r"14\.96 GiB \+ reserve 1\.73 GiB > budget 21\.60 GiB"):
        plan_pair(big, big, HARDWARE["RTX4090"], work, int(0.9 * 24 * GiB))
    with pytest.raises(ValueError, match="must be >= 1"):
        Workload(requests=0, prompt_tokens=1, step_tokens=1, verify_tokens=1)
    with pytest.raises(ValueError, match=r"shared_tokens must be between 0 and the prompt and verify tokens "
                                         r"\(100\), got 150"):
        Workload(requests=8, prompt_tokens=100, step_tokens=64, verify_tokens=200, shared_tokens=150)
    with pytest.raises(ValueError, match="siblings must be >= 1, got 0"):
        Workload(requests=8, prompt_tokens=100, step_tokens=64, verify_tokens=200, siblings=0)
    assert parse_bytes("24GiB") == 24 * GiB and parse_bytes("0.4*24GiB") == int(0.4 * 24 * GiB)
    assert parse_bytes("80GB") == 80 * 10 ** 9
    with pytest.raises(ValueError, match="cannot read a size"):
        parse_bytes("lots")
    assert isinstance(HARDWARE["H200"], Hardware)


def test_plan_command_prints_the_split_and_refuses_what_cannot_fit(capsys):
    from sgl_tts.cli import main

    qwen15, qwen7 = str(CONFIGS / "qwen2.5-1.5b.json"), str(CONFIGS / "qwen2.5-7b.json")
    assert main(["plan", "--generator", qwen15, "--prm", qwen7, "--gpu-memory", "0.9*24GiB", "--beams", "32",
                 "--json"]) == 0
    out = __import__("json").loads(capsys.readouterr().out)
    plan = out["plan"]
    assert out["generator"]["name"] == "qwen2.5-1.5b" and out["prm"]["name"] == "qwen2.5-7b"
    assert plan["gen_kv_bytes"] + plan["prm_kv_bytes"] <= plan["kv_budget_bytes"]
    assert out["flags"]["generator"][0] == "--mem-fraction-static" and out["choice"] in ("shared", "offload")
    assert main(["plan", "--generator", qwen15, "--prm", qwen15, "--gpu-memory", "0.4*24GiB", "--shared-tokens", "300",
                 "--siblings", "4", "--json"]) == 0
    out = __import__("json").loads(capsys.readouterr().out)
    assert (out["workload"]["shared_tokens"], out["workload"]["siblings"]) == (300, 4)
    assert "--max-running-requests" not in out["flags"]["prm"]
    assert main(["plan", "--generator", qwen15, "--prm", qwen15, "--gpu-memory", "0.4*24GiB"]) == 0
    text = capsys.readouterr().out
    assert "| KV pool |" in text and "generator flags: --mem-fraction-static" in text
    assert main(["plan", "--generator", str(CONFIGS / "llama-3.1-8b.json"), "--prm", str(CONFIGS / "llama-3.1-8b.json"),
                 "--gpu-memory", "0.9*24GiB"]) == 1
    assert "the weights alone do not fit: generator 14.96 GiB" in capsys.readouterr().err


def test_ceilings_can_be_given_and_measuring_needs_a_gpu(capsys):
    import torch

    from sgl_tts.cli import main

    qwen = str(CONFIGS / "qwen2.5-1.5b.json")
    assert main(["plan", "--generator", qwen, "--prm", qwen, "--gpu-memory", "0.4*24GiB", "--ceilings", "100", "500",
                 "--json"]) == 0
    out = __import__("json").loads(capsys.readouterr().out)
    assert (out["gpu"]["tflops"], out["gpu"]["bandwidth_gbs"]) == (100.0, 500.0)
    if not torch.cuda.is_available():
        assert main(["plan", "--generator", qwen, "--prm", qwen, "--measure"]) == 1
        assert "--measure needs a CUDA GPU on this machine; pass --ceilings TFLOPS GBS instead" in capsys.readouterr().err


@pytest.mark.gpu
def test_measured_ceilings_are_near_the_profile():
    from sgl_tts.launch.memory import measure_ceilings

    tflops, gbs = measure_ceilings()
    assert 100 < tflops < 1200 and 500 < gbs < 6000
