"""Memory planner for a generator and a PRM on one GPU (seed 000 §3.2.3, §4.3; seed 001 ch. 5).

The generator decodes (memory-bandwidth bound, hungry for KV); the PRM prefills (compute bound, it
saturates with little KV). Given both models' ``config.json``, a GPU and a workload, the planner
splits the KV budget between them with the seed's roofline-guided search:

    T_tot = ceil(N / B_pre) T_pre(B_pre, S) + ceil(N / B_dec) S_dec T_dec(B_dec, S_cache)
    subject to  KV_prm(H + B_pre U_pre) + KV_gen(H + B_dec U_dec) <= M

with ``T = max(FLOPs / P, bytes / BW) + t_fwd`` per batch, H the tokens every request shares (the
question) and U a request's own part (:class:`Workload`); the seed has H = 0 and no t_fwd, which on an
H200 starved the PRM (issue 37). A stage given room for B requests may run smaller
batches, so its time is the best over batch sizes up to B (:meth:`Roofline.stage_times`): more memory
never hurts, the optimum lies on the memory boundary, and the search over B_pre with B_dec on the
boundary (Eq. 1; ties to the larger B_dec) is exact (tests compare it with brute force); memory past
what the best batches need is split in proportion to their needs. The offload
alternative keeps only the active model's KV on the GPU and pays the idle one's transfer.

The search takes any cost model per model (:class:`StageCosts`): on a GPU both models'
:class:`Roofline`, on the CPU their profiles measured on live servers
(:class:`sgl_tts.launch.cpu_profile.CpuProfile`).

This module is pure arithmetic (no torch, no GPU); ``sgl-tts plan`` prints its result.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

GiB = 1 << 30
# SGLang's fixed cost per forward pass on a GPU, beyond the roofline: measured on an H200 (issue 37,
# 2026-11-26): 2.9 ms per decode round of the 1.5B generator at batches <= 64 (104.1 s of generator time
# over 36,174 rounds, the stock side) where the roofline gives at most 0.9 ms. One figure, one GPU:
# the other profiles share it until they are measured.
FORWARD_SECONDS = 0.002
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}


# ------------------------------------------------------------------------------------ model shapes
@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a model's ``config.json``.

    Attributes:
        kv_bytes_per_token: KV-cache bytes one token takes in every layer (K and V; for MLA the
            compressed latent plus the rope key, as SGLang stores it).
        weight_bytes: bytes of the weights (from the checkpoint files when known, else estimated from
            the config).
        flops_per_token: 2 x the parameters a token passes through (active experts only for MoE),
            embeddings excluded.
        attn_width: query heads x head dim (attention FLOPs per cached token are ~4 x layers x this).
    """

    name: str
    layers: int
    kv_bytes_per_token: int
    weight_bytes: int
    flops_per_token: int
    attn_width: int
    params: int

    @classmethod
    def from_config(cls, config: str | os.PathLike | Mapping[str, Any], *, name: str | None = None,
                    kv_dtype: str | None = None) -> "ModelShape":
        """From a ``config.json`` path, a model folder or a parsed dict. Weights are the
        checkpoint's ``*.safetensors`` sizes when a folder has them."""
        folder: Path | None = None
        if isinstance(config, Mapping):
            cfg = dict(config)
        else:
            path = Path(config)
            if path.is_dir():
                folder, path = path, path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}; pass a model folder or its config.json")
            cfg = json.loads(path.read_text())
            folder = folder or path.parent
            name = name or (folder.name if path.name == "config.json" else path.stem)
        cfg = {**cfg.get("text_config", {}), **cfg} if "text_config" in cfg else cfg
        try:
            layers = int(cfg["num_hidden_layers"])
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            vocab = int(cfg["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"config of {name or 'the model'} lacks {exc.args[0]!r}: not a decoder "
                             f"config.json this planner knows") from None
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        wbytes = DTYPE_BYTES.get(dtype, 2)
        kbytes = DTYPE_BYTES.get(kv_dtype or dtype, wbytes)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        inter = int(cfg.get("intermediate_size", 4 * hidden))
        if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): one compressed latent + rope key per layer
            rank, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim", 64))
            nope, vdim = int(cfg.get("qk_nope_head_dim", head_dim)), int(cfg.get("v_head_dim", head_dim))
            kv_per_token = layers * (rank + rope) * kbytes
            q_lora = cfg.get("q_lora_rank")
            q = hidden * heads * (nope + rope) if not q_lora else hidden * q_lora + q_lora * heads * (nope + rope)
            attn = q + hidden * (rank + rope) + rank * heads * (nope + vdim) + heads * vdim * hidden
            attn_width = heads * (nope + rope)
        else:
            kv_per_token = 2 * layers * kv_heads * head_dim * kbytes
            attn = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim
            if cfg.get("model_type") == "qwen2" or cfg.get("attention_bias"):
                attn += heads * head_dim + 2 * kv_heads * head_dim
            attn_width = heads * head_dim
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts:
            moe_inter = int(cfg.get("moe_intermediate_size") or inter)
            shared = int(cfg.get("n_shared_experts") or 0)
            top_k = int(cfg.get("num_experts_per_tok") or 1)
            dense_layers = int(cfg.get("first_k_dense_replace") or 0)
            moe_layers = layers - dense_layers
            mlp_total = dense_layers * 3 * hidden * inter + moe_layers * (
                (experts + shared) * 3 * hidden * moe_inter + hidden * experts)
            mlp_active = dense_layers * 3 * hidden * inter + moe_layers * (top_k + shared) * 3 * hidden * moe_inter
        else:
            mlp_total = mlp_active = layers * 3 * hidden * inter
        embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
        body_total = layers * (attn + 2 * hidden) + mlp_total + hidden
        body_active = layers * (attn + 2 * hidden) + mlp_active + hidden
        params = embed + body_total
        weights = _checkpoint_bytes(folder) or params * wbytes
        # per token: the body, plus the LM head (one vocab x hidden product)
        flops = 2 * (body_active + vocab * hidden)
        return cls(name or str(cfg.get("model_type", "model")), layers, kv_per_token, weights, flops,
                   attn_width, params)


def _checkpoint_bytes(folder: Path | None) -> int:
    if folder is None or not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# ----------------------------------------------------------------------------------------- hardware
@dataclasses.dataclass(frozen=True)
class Hardware:
    """Peak dense bf16 tensor throughput, memory bandwidth, memory and host link of a GPU (vendor
    specification sheets, no sparsity); ``--measure`` replaces the two ceilings with measured ones.
    ``forward_seconds`` is what every forward pass costs on top of the roofline (kernel launches, the
    scheduler's round, sampling): without it a batch of one looks as cheap per token as a batch of 64
    whenever the roofline is compute bound, and the planner starved the PRM on an H200 (issue 37,
    docs/benchmarks/LOG.md "GPU results")."""

    name: str
    tflops: float
    bandwidth_gbs: float
    memory_gib: float
    host_link_gbs: float = 25.0
    forward_seconds: float = FORWARD_SECONDS


HARDWARE = {h.name: h for h in (
    Hardware("H100", 989.0, 3350.0, 80.0, 50.0),
    Hardware("H200", 989.0, 4800.0, 141.0, 50.0),
    Hardware("A100-80G", 312.0, 2039.0, 80.0, 25.0),
    Hardware("L40S", 362.0, 864.0, 48.0, 25.0),
    Hardware("RTX4090", 165.2, 1008.0, 24.0, 25.0),
    Hardware("RTX3090", 71.0, 936.0, 24.0, 25.0),
)}


def measure_ceilings(device: str = "cuda", *, size: int = 8192, repeats: int = 20) -> tuple[float, float]:
    """Measured (TFLOP/s, GB/s) of the local GPU: a bf16 matmul of ``size``^3 and a device-to-device
    copy of 1 GiB, best of ``repeats``. Needs CUDA."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--measure needs a CUDA GPU on this machine; pass --ceilings TFLOPS GBS instead")
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    src = torch.empty(GiB // 2, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    tflops = 2 * size ** 3 / best(lambda: a @ b) / 1e12
    gbs = 2 * src.numel() * src.element_size() / best(lambda: dst.copy_(src)) / 1e9   # read + write
    del a, b, src, dst
    torch.cuda.empty_cache()   # the servers started next count this memory as free
    return tflops, gbs


# ----------------------------------------------------------------------------------------- roofline
@dataclasses.dataclass(frozen=True)
class Workload:
    """One search iteration: ``requests`` beams, each verified on ``verify_tokens`` tokens (prompt and
    path so far) and extended by ``step_tokens`` generated tokens on a ``prompt_tokens`` context.

    What the requests share, which a radix cache keeps once per pool: the first ``shared_tokens`` of
    every context (the question), and the rest of the context within groups of ``siblings`` (a
    beam's children extend the same path; beam width for beam search and DVTS, 1 when every request
    has its own path). The defaults (0, 1) count every request's whole context, as the seed does;
    on the H200 that made the budget look too small for both models at full batch and starved the
    PRM (issue 37).

    ``searches``: the searches in flight at once, which ``requests`` counts all of (a service); each
    holds its own question, so the shared head is held once per search. Planned for one search, a
    service's generator gets too little (docs/MEMORY_PLANNER.md, "Under load")."""

    requests: int
    prompt_tokens: int
    step_tokens: int
    verify_tokens: int
    shared_tokens: int = 0
    siblings: int = 1
    searches: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name != "shared_tokens" and getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")
        if not 0 <= self.shared_tokens <= min(self.prompt_tokens, self.verify_tokens):
            raise ValueError(f"shared_tokens must be between 0 and the prompt and verify tokens "
                             f"({min(self.prompt_tokens, self.verify_tokens)}), got {self.shared_tokens}")

    def generator_tokens(self) -> tuple[float, float]:
        """(tokens held once, tokens per request) of the generator's pool: the shared head, then per
        request its siblings' share of the rest of the context and its own step."""
        return self.shared_tokens * self.searches, (self.prompt_tokens - self.shared_tokens) / self.siblings + self.step_tokens

    def prm_tokens(self) -> tuple[float, float]:
        """(tokens held once, tokens per request) of the PRM's pool: the shared head, the siblings'
        share of the context the PRM reads with the generator, and what it reads past it (the step)."""
        common = min(self.prompt_tokens, self.verify_tokens)
        return (self.shared_tokens * self.searches, (common - self.shared_tokens) / self.siblings
                + self.verify_tokens - common)


class Roofline:
    """Per-batch latency of a model on a GPU: ``max(FLOPs / peak, bytes / bandwidth)`` plus the
    GPU profile's fixed cost per forward pass."""

    def __init__(self, model: ModelShape, hw: Hardware):
        self.model, self.hw = model, hw

    def prefill(self, batch: int, tokens: int) -> float:
        m = self.model
        flops = batch * tokens * m.flops_per_token + 2 * m.layers * m.attn_width * batch * tokens * tokens
        traffic = m.weight_bytes + batch * tokens * m.kv_bytes_per_token
        return max(flops / (self.hw.tflops * 1e12), traffic / (self.hw.bandwidth_gbs * 1e9)) + self.hw.forward_seconds

    def decode_step(self, batch: int, cached: float) -> float:
        m = self.model
        flops = batch * m.flops_per_token + 4 * m.layers * m.attn_width * batch * cached
        traffic = m.weight_bytes + batch * cached * m.kv_bytes_per_token
        return max(flops / (self.hw.tflops * 1e12), traffic / (self.hw.bandwidth_gbs * 1e9)) + self.hw.forward_seconds

    def stage_times(self, n: int, cost: Callable[[int], float]) -> tuple[list[float], list[int]]:
        """:func:`stage_times` (kept as a method for old callers)."""
        return stage_times(n, cost)


class CostModel(Protocol):
    """Seconds a model takes per batch: what the search needs of :class:`Roofline` (a GPU's ceilings)
    or of :class:`sgl_tts.launch.cpu_profile.CpuProfile` (measured on a live CPU server)."""

    def prefill(self, batch: int, tokens: int) -> float:
        """Seconds to prefill ``batch`` requests of ``tokens`` tokens each."""

    def decode_step(self, batch: int, cached: float) -> float:
        """Seconds of one decode step of ``batch`` requests over ``cached`` tokens each."""


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """The cost model of each model of the pair (the generator decodes, the PRM prefills)."""

    generator: CostModel
    prm: CostModel


def stage_costs(gen: ModelShape, prm: ModelShape, costs: "Hardware | StageCosts") -> StageCosts:
    """``costs`` itself, or both models' :class:`Roofline` on the GPU ``costs``."""
    if isinstance(costs, StageCosts):
        return costs
    return StageCosts(Roofline(gen, costs), Roofline(prm, costs))


def stage_times(n: int, cost: Callable[[int], float]) -> tuple[list[float], list[int]]:
    """For room ``b = 1..n``: the best total time ``min over k <= b of ceil(n / k) cost(k)`` and
    the batch size achieving it (the larger one on ties)."""
    best, arg = [math.inf], [0]
    for k in range(1, n + 1):
        t = math.ceil(n / k) * cost(k)
        if t <= best[-1]:
            best.append(t)
            arg.append(k)
        else:
            best.append(best[-1])
            arg.append(arg[-1])
    return best, arg


# -------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass
class Plan:
    """The split and what it predicts (times per search iteration, seconds)."""

    strategy: str                 # "shared" (both KV pools on the GPU) or "offload"
    kv_budget_bytes: int
    prm_room: int                 # requests the PRM's KV pool holds (B_pre on the boundary)
    gen_room: int                 # requests the generator's KV pool holds (B_dec)
    prm_batch: int                # the batch size that achieves the predicted time (<= room)
    gen_batch: int
    prm_kv_bytes: int
    gen_kv_bytes: int
    prm_seconds: float
    gen_seconds: float
    offload_seconds: float = 0.0

    @property
    def total_seconds(self) -> float:
        return self.prm_seconds + self.gen_seconds + self.offload_seconds


@dataclasses.dataclass(frozen=True)
class _Pool:
    """A KV pool's bytes for ``b`` requests: the shared head once, then ``b`` times a request's own part."""

    head: float
    per: float

    @classmethod
    def of(cls, model: ModelShape, tokens: tuple[float, float]) -> "_Pool":
        return cls(model.kv_bytes_per_token * tokens[0], model.kv_bytes_per_token * tokens[1])

    def __call__(self, b: float) -> float:
        return self.head + b * self.per

    def room(self, size: float) -> int:
        """The most requests it holds in ``size`` bytes."""
        return max(0, math.floor((size - self.head) / self.per + 1e-9))


def _pools(gen: ModelShape, prm: ModelShape, work: Workload) -> tuple[_Pool, _Pool]:
    return _Pool.of(prm, work.prm_tokens()), _Pool.of(gen, work.generator_tokens())


def solve(gen: ModelShape, prm: ModelShape, hw: "Hardware | StageCosts", work: Workload, kv_budget: int) -> Plan:
    """The seed's search: every B_pre with B_dec on the memory boundary (Eq. 1, each pool holding
    its shared tokens once: :class:`Workload`); the minimum total time, ties to the larger B_dec.
    Memory beyond what the best batches need is then split between the pools in proportion to what
    each needs: every radix cache keeps more of the paths it will read again, and the predicted time
    stays the minimum (more room never predicts more time). ``hw``: a GPU (both models'
    :class:`Roofline`) or each model's own cost model (:class:`StageCosts`, e.g. CPU profiles
    measured on live servers)."""
    pre, dec = _pools(gen, prm, work)
    if kv_budget < pre(1) + dec(1):
        raise ValueError(f"the KV budget ({kv_budget / GiB:.2f} GiB) cannot hold one verifier request "
                         f"({pre(1) / GiB:.3f} GiB) and one generator request ({dec(1) / GiB:.3f} GiB)")
    n = work.requests
    pre_t, pre_b, dec_t, dec_b = _stage_tables(gen, prm, hw, work)
    best: tuple | None = None
    for b_pre in range(1, n + 1):   # past N requests the PRM gains nothing the generator would not lose
        if pre(b_pre) + dec(1) > kv_budget:
            break
        b_dec = dec.room(kv_budget - pre(b_pre))
        key = (pre_t[b_pre] + dec_t[min(b_dec, n)], -b_dec, b_pre)
        if best is None or key < best[0]:
            best = (key, b_pre, b_dec)
    assert best is not None
    _, b_pre, b_dec = best
    batch_pre, batch_dec = pre_b[b_pre], dec_b[min(b_dec, n)]
    need_pre, need_dec = pre(batch_pre), dec(batch_dec)
    prm_bytes = need_pre + (kv_budget - need_pre - need_dec) * need_pre / (need_pre + need_dec)
    gen_bytes = kv_budget - prm_bytes
    return Plan("shared", kv_budget, pre.room(prm_bytes), dec.room(gen_bytes), batch_pre, batch_dec,
                int(prm_bytes), int(gen_bytes), pre_t[b_pre], dec_t[min(b_dec, n)])


def brute_force(gen: ModelShape, prm: ModelShape, hw: "Hardware | StageCosts", work: Workload, kv_budget: int
                ) -> tuple[float, int, int]:
    """The minimum over *every* feasible (B_pre, B_dec) pair (tests check :func:`solve` against it)."""
    pre, dec = _pools(gen, prm, work)
    n = work.requests
    pre_t, _, dec_t, _ = _stage_tables(gen, prm, hw, work)
    best = None
    b_pre = 1
    while pre(b_pre) + dec(1) <= kv_budget:
        b_dec = 1
        while pre(b_pre) + dec(b_dec) <= kv_budget:
            key = (pre_t[min(b_pre, n)] + dec_t[min(b_dec, n)], -b_dec, b_pre)
            if best is None or key < best:
                best = key
            b_dec += 1
        b_pre += 1
    assert best is not None
    return best[0], best[2], -best[1]


def offload_plan(gen: ModelShape, prm: ModelShape, hw: Hardware, work: Workload, kv_budget: int) -> Plan:
    """Seed 000 §4.3.2: only the active model's KV on the GPU (each may use the whole budget), the
    idle one's moved to host memory and back each iteration over the host link."""
    pre, dec = _pools(gen, prm, work)
    n = work.requests
    pre_t, pre_b, dec_t, dec_b = _stage_tables(gen, prm, hw, work)
    b_pre = max(1, min(n, pre.room(kv_budget)))
    b_dec = max(1, min(n, dec.room(kv_budget)))
    moved = 2 * (pre(pre_b[b_pre]) + dec(dec_b[b_dec]))   # out and back, both pools
    return Plan("offload", kv_budget, b_pre, b_dec, pre_b[b_pre], dec_b[b_dec], int(pre(b_pre)),
                int(dec(b_dec)), pre_t[b_pre], dec_t[b_dec], moved / (hw.host_link_gbs * 1e9))


def _stage_tables(gen: ModelShape, prm: ModelShape, hw: "Hardware | StageCosts", work: Workload):
    costs = stage_costs(gen, prm, hw)
    pre, dec = costs.prm, costs.generator
    cached = work.prompt_tokens + work.step_tokens / 2
    pre_t, pre_b = stage_times(work.requests, lambda b: pre.prefill(b, work.verify_tokens))
    dec_t, dec_b = stage_times(work.requests, lambda b: work.step_tokens * dec.decode_step(b, cached))
    return pre_t, pre_b, dec_t, dec_b


# ---------------------------------------------------------------------------------- SGLang flags
@dataclasses.dataclass
class ServerFlags:
    """SGLang flags of one server (``--mem-fraction-static`` is of the memory free when it starts)."""

    mem_fraction_static: float
    max_total_tokens: int
    max_running_requests: int | None           # None: SGLang derives it
    chunked_prefill_size: int | None = None
    hicache_size_gb: int | None = None     # host-memory KV tier (HiCache) for an offload plan

    def args(self) -> list[str]:
        out = ["--mem-fraction-static", f"{self.mem_fraction_static:.4f}",
               "--max-total-tokens", str(self.max_total_tokens)]
        if self.max_running_requests is not None:
            out += ["--max-running-requests", str(self.max_running_requests)]
        if self.chunked_prefill_size:
            out += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.hicache_size_gb:
            out += ["--enable-hierarchical-cache", "--hicache-size", str(self.hicache_size_gb)]
        return out


def server_flags(plan: Plan, gen: ModelShape, prm: ModelShape, work: Workload, gpu_bytes: int,
                 reserve_bytes: int, first: str = "generator", offload: Plan | None = None,
                 min_pool_tokens: Mapping[str, int] | None = None) -> dict[str, ServerFlags]:
    """Flags for both servers in start-up order: each server's static pool (weights + its KV) is a
    fraction of the memory free when it starts, which for the second is what the first left (seed 001
    ch. 5: a fraction of the total would over-commit). With an ``offload`` plan (two SGLang servers
    cannot swap a whole pool out), each server keeps ``plan``'s GPU pool and gets a HiCache host tier
    as large as the offload plan's pool, so its evicted KV is reloaded from host memory instead of
    recomputed."""
    if first not in ("generator", "prm"):
        raise ValueError(f"first must be 'generator' or 'prm', got {first!r}")
    kv = {"generator": plan.gen_kv_bytes, "prm": plan.prm_kv_bytes}
    per = {"generator": gen.kv_bytes_per_token, "prm": prm.kv_bytes_per_token}
    # SGLang refuses a request longer than its server's pool: each pool holds at least one request
    # of ``min_pool_tokens`` (e.g. the context length), the bytes taken from the other pool.
    for name, other in (("prm", "generator"), ("generator", "prm")):
        floor = int((min_pool_tokens or {}).get(name, 0))
        short = floor * per[name] - kv[name]
        if short > 0:
            kv[name] += short
            kv[other] -= short
    for name in kv:
        floor = int((min_pool_tokens or {}).get(name, 0))
        if kv[name] // per[name] < max(1, floor):
            raise ValueError(f"the KV budget cannot give each server a pool of its longest request "
                             f"({dict(min_pool_tokens or {})} tokens)")
    pools = {"generator": (gen.weight_bytes + kv["generator"], kv["generator"] // gen.kv_bytes_per_token,
                           plan.gen_batch, None),
             # the PRM only prefills (its requests never grow in the pool): its pool is the limit SGLang
             # needs, and a cap on running requests below it only serialises the verifier (the H200,
             # issue 37: a cap of 1 cost 29.8 ms per request against 7.0 ms batched)
             "prm": (prm.weight_bytes + kv["prm"], kv["prm"] // prm.kv_bytes_per_token,
                     None, plan.prm_batch * work.verify_tokens)}
    host = {} if offload is None else {"generator": offload.gen_kv_bytes, "prm": offload.prm_kv_bytes}
    order = [first, "prm" if first == "generator" else "generator"]
    free = gpu_bytes
    out = {}
    for name in order:
        static, tokens, batch, chunk = pools[name]
        tier = host.get(name)
        out[name] = ServerFlags(static / free, int(tokens), None if batch is None else int(batch), chunk,
                                max(1, math.ceil(tier / 1e9)) if tier else None)
        free -= static + reserve_bytes // 2   # its pools plus its share of the runtime reserve
    return out


def static_split_flags(gen: ModelShape, prm: ModelShape, gpu_bytes: int, reserve_bytes: int,
                       generator_share: float = 0.5, first: str = "generator",
                       min_pool_tokens: Mapping[str, int] | None = None) -> dict[str, ServerFlags]:
    """Flags of the unplanned baseline: the generator gets ``generator_share`` of the budget and the
    PRM the rest (each pool is its share less half the reserve; its KV is what the weights leave),
    SGLang's own batch limits. Fractions are of the memory free at each start, as in
    :func:`server_flags`; ``--max-total-tokens`` caps each KV pool, which is what emulates a smaller
    card on a larger one."""
    if not 0 < generator_share < 1:
        raise ValueError(f"the generator's share must be in (0, 1), got {generator_share}")
    if first not in ("generator", "prm"):
        raise ValueError(f"first must be 'generator' or 'prm', got {first!r}")
    floors = {k: int(v) for k, v in (min_pool_tokens or {}).items()}
    need = {name: (model.weight_bytes + reserve_bytes / 2 + floors.get(name, 0) * model.kv_bytes_per_token)
            / gpu_bytes for name, model in (("generator", gen), ("prm", prm))}
    lo, hi = need["generator"], 1 - need["prm"]
    hint = (f"; choose a generator share between {math.ceil(lo * 100) / 100:.2f} and "
            f"{math.floor(hi * 100) / 100:.2f}" if lo < hi else "; no share fits both: a larger budget is needed")
    shares = {"generator": (gen, generator_share), "prm": (prm, 1 - generator_share)}
    free = gpu_bytes
    out = {}
    for name in (first, "prm" if first == "generator" else "generator"):
        model, share = shares[name]
        static = share * gpu_bytes - reserve_bytes / 2
        kv = static - model.weight_bytes
        if kv <= 0:
            raise ValueError(f"a {share:.0%} share ({share * gpu_bytes / GiB:.2f} GiB less half the reserve) "
                             f"does not hold the {name}'s weights ({model.weight_bytes / GiB:.2f} GiB){hint}")
        floor = floors.get(name, 0)
        if kv // model.kv_bytes_per_token < floor:
            raise ValueError(f"a {share:.0%} share leaves the {name} a pool of {int(kv // model.kv_bytes_per_token)} "
                             f"tokens, less than its longest request ({floor}){hint}")
        out[name] = ServerFlags(static / free, int(kv // model.kv_bytes_per_token), None)
        free -= static + reserve_bytes // 2
    return out


def plan_pair(gen: ModelShape, prm: ModelShape, hw: Hardware, work: Workload, gpu_bytes: int, *,
              reserve_bytes: int | None = None) -> tuple[Plan, Plan | None]:
    """The best shared split and the offload alternative for a GPU budget of ``gpu_bytes``. The
    reserve (activations, CUDA graphs, allocator slack of two runtimes) defaults to 8% of the budget,
    at least 1 GiB."""
    reserve = reserve_bytes if reserve_bytes is not None else max(GiB, int(0.08 * gpu_bytes))
    kv_budget = gpu_bytes - gen.weight_bytes - prm.weight_bytes - reserve
    if kv_budget <= 0:
        raise ValueError(
            f"the weights alone do not fit: generator {gen.weight_bytes / GiB:.2f} GiB + PRM "
            f"{prm.weight_bytes / GiB:.2f} GiB + reserve {reserve / GiB:.2f} GiB > budget "
            f"{gpu_bytes / GiB:.2f} GiB")
    shared = solve(gen, prm, hw, work, kv_budget)
    try:
        off = offload_plan(gen, prm, hw, work, kv_budget)
    except ValueError:
        off = None
    return shared, off


def parse_bytes(text: str) -> int:
    """``24GiB``, ``24GB``, ``0.4*24GiB`` style sizes (GiB/MiB binary, GB/MB decimal)."""
    s = text.strip().replace(" ", "")
    factor = 1.0
    if "*" in s:
        head, s = s.split("*", 1)
        factor = float(head)
    units = {"gib": GiB, "mib": 1 << 20, "gb": 10 ** 9, "mb": 10 ** 6, "b": 1}
    for unit, mult in units.items():
        if s.lower().endswith(unit):
            return int(factor * float(s[:-len(unit)]) * mult)
    raise ValueError(f"cannot read a size from {text!r}; write e.g. 24GiB or 0.4*24GiB")


@dataclasses.dataclass
class PairPlan:
    """Everything ``sgl-tts plan`` / ``sgl-tts serve`` decide for a generator + PRM pair."""

    hw: Hardware
    budget: int
    reserve: int
    gen: ModelShape
    prm: ModelShape
    work: Workload
    shared: Plan
    offload: Plan | None
    flags: dict[str, ServerFlags]

    @property
    def choice(self) -> str:
        return "offload" if self.offload is not None and self.offload.total_seconds < self.shared.total_seconds \
            else "shared"


def context_tokens(config: str | os.PathLike) -> int:
    """A model's context length (``max_position_embeddings``; 0 when its config does not say)."""
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return int(json.loads(path.read_text()).get("max_position_embeddings") or 0)
    except (OSError, ValueError):
        return 0


def workload_from_args(args) -> Workload:
    """The planner's workload from the shared flags (``--shared-tokens`` and ``--siblings`` absent: none;
    ``--searches-in-flight`` Q: Q searches of ``--beams`` requests each)."""
    searches = getattr(args, "searches_in_flight", None)
    searches = 1 if searches is None else searches
    if searches < 1:
        raise ValueError(f"--searches-in-flight must be >= 1, got {searches}")
    return Workload(args.beams * searches, args.prompt_tokens, args.step_tokens, args.verify_tokens,
                    getattr(args, "shared_tokens", 0) or 0, getattr(args, "siblings", 1) or 1, searches)


def plan_from_args(args) -> PairPlan:
    """The plan the shared flags ask for (``ValueError`` / ``FileNotFoundError`` on bad input)."""
    hw = HARDWARE[args.gpu]
    if args.ceilings:
        hw = dataclasses.replace(hw, tflops=args.ceilings[0], bandwidth_gbs=args.ceilings[1])
    elif args.measure:
        tflops, gbs = measure_ceilings()
        hw = dataclasses.replace(hw, tflops=tflops, bandwidth_gbs=gbs)
    budget = parse_bytes(args.gpu_memory) if args.gpu_memory else int(hw.memory_gib * GiB)
    reserve = parse_bytes(args.reserve) if args.reserve else max(GiB, int(0.08 * budget))
    gen, prm = ModelShape.from_config(args.generator), ModelShape.from_config(args.prm)
    work = workload_from_args(args)
    shared, off = plan_pair(gen, prm, hw, work, budget, reserve_bytes=reserve)
    use_offload = off is not None and off.total_seconds < shared.total_seconds
    longest = getattr(args, "longest_request", None)
    floors = {name: min(ctx, longest) if longest and ctx else (longest or ctx)
              for name, ctx in (("generator", context_tokens(args.generator)), ("prm", context_tokens(args.prm)))}
    flags = server_flags(shared, gen, prm, work, budget, reserve, first=args.first,
                         offload=off if use_offload else None, min_pool_tokens=floors)
    return PairPlan(hw, budget, reserve, gen, prm, work, shared, off, flags)


__all__ = ["FORWARD_SECONDS", "HARDWARE", "CostModel", "GiB", "Hardware", "StageCosts", "stage_costs", "stage_times", "ModelShape", "Plan", "Roofline", "ServerFlags", "Workload",
           "PairPlan", "brute_force", "plan_from_args", "measure_ceilings",
           "offload_plan", "parse_bytes", "plan_pair", "server_flags", "solve", "static_split_flags", "workload_from_args"]
