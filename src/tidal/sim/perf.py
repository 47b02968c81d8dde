"""First-principles cost model: decode, prefill, training, optimizer, offload, weight sync.

In: a ``CostModelConfig`` (GPU and model names, engine tensor parallelism, memory fractions,
trainer phases and the three fitted efficiencies) and the cluster's engines and cells.
Out: ``EngineModel`` (one tensor-parallel engine replica: decode step time against batch and
context, KV-cache capacity, the saturation point, prefill time) and ``resolve``: the scenario
with every derived speed and cost filled in (peak decode, per-sequence cap, prefill
equivalents, training tokens/s per GPU, optimizer, offload / onload, weight sync, KV handoff).

The decode step of ``n`` resident sequences with ``S`` context tokens in all (roofline):
``max(bytes / (tp * HBM * e_dec), n * 2 * M / (tp * FLOPs * e_dec)) + overhead`` (``M`` below),
with ``bytes = dense weights + routed experts * (1 - (1 - k/E)**n) + kv * S + state * n``
(reading the experts a batch touches; reading the KV cache and the linear-attention state;
``kv`` counts every copy: with fewer KV heads than ``tp`` ranks each rank keeps and reads a
whole head, ``ModelProfile.kv_bytes_per_token_tp``).
When the cache holds only a share ``f`` of the sequences (``tp * HBM * mem_fraction - weights``
over what they need), ``f`` of them decode at a time: every sequence advances at ``f / step``.
Training: per pass (3 for forward and backward, + recompute + old-log-prob + reference) a
sequence of ``L`` tokens costs ``2 * M * L`` FLOPs in its matmuls (``M``: the active
parameters less an untied input embedding, a lookup) plus ``a * L**2 / 2`` in causal attention
(``a = 4 * full-attention layers * attention dim`` per (token, earlier token) pair), at
``mfu``; the trainer counts work in token equivalents, ``L + a / (2 M) * L**2 / 2``;
Adam reads and writes 16 bytes per parameter on the core cell; offload and onload
move weights, gradients and optimizer state over the host link; a weight sync moves the
weights over the scale-out link; links run at ``link`` efficiency. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.sim.profiles import GpuProfile, ModelProfile, load_gpu, load_model

if TYPE_CHECKING:
    from tidal.sim.scenario import CostModelConfig, Scenario

TRAIN_STATE_BYTES_PER_PARAM = 16  # bf16 weights + bf16 grads + fp32 master, m, v (12)


@dataclass(frozen=True)
class EngineModel:
    """One tensor-parallel engine replica; every query is a pure function of its inputs."""

    tp: int
    dense_bytes: float
    expert_bytes: float
    keep_prob: float  # 1 - k/E: chance a token leaves one given expert untouched
    kv_bytes_per_token: float
    state_bytes_per_seq: float
    flops_per_token: float
    bytes_s: float  # tp * HBM bandwidth * decode efficiency
    flops_s: float  # tp * peak FLOPs * decode efficiency
    prefill_flops_s: float  # tp * peak FLOPs * mfu
    overhead_s: float
    kv_capacity_bytes: float
    attn_flops_per_pair: float = 0.0  # 4 * full-attention layers * attn dim (QK and AV)

    def step_s(self, n: float, ctx_tokens: float) -> float:
        """One decode step of ``n`` resident sequences holding ``ctx_tokens`` in all."""
        touched = 1.0 - self.keep_prob**n if self.expert_bytes else 0.0
        mem = (
            self.dense_bytes
            + self.expert_bytes * touched
            + self.kv_bytes_per_token * ctx_tokens
            + self.state_bytes_per_seq * n
        ) / self.bytes_s
        comp = n * self.flops_per_token / self.flops_s
        return (mem if mem > comp else comp) + self.overhead_s

    def memory_bound(self, n: float) -> bool:
        """Whether a step of ``n`` sequences at zero context is bound by memory, not FLOPs."""
        touched = 1.0 - self.keep_prob**n if self.expert_bytes else 0.0
        mem = (
            self.dense_bytes + self.expert_bytes * touched + self.state_bytes_per_seq * n
        ) / self.bytes_s
        return mem >= n * self.flops_per_token / self.flops_s

    def seq_rate(self, n: float, ctx_tokens: float) -> float:
        """Tokens/s of each of ``n`` sequences (``ctx_tokens`` in all) sharing the replica;
        when the KV cache holds only a share of them they take turns."""
        if n <= 0:
            return 0.0
        need = self.kv_bytes_per_token * ctx_tokens + self.state_bytes_per_seq * n
        f = 1.0 if need <= self.kv_capacity_bytes else self.kv_capacity_bytes / need
        return f / self.step_s(n * f, ctx_tokens * f)

    def throughput_tok_s(self, n: float, ctx_per_seq: float) -> float:
        """Decode tokens/s of the replica with ``n`` sequences of ``ctx_per_seq`` context."""
        return n * self.seq_rate(n, n * ctx_per_seq)

    def kv_capacity_seqs(self, ctx_per_seq: float) -> float:
        """Sequences of ``ctx_per_seq`` context the KV cache holds at once."""
        per = self.kv_bytes_per_token * ctx_per_seq + self.state_bytes_per_seq
        return self.kv_capacity_bytes / per if per > 0 else float("inf")

    def saturation_batch(self, ctx_per_seq: float, max_batch: int, fraction: float = 0.9) -> int:
        """The engine's saturation point: the smallest batch (at most ``max_batch`` and the KV
        capacity) whose throughput reaches ``fraction`` of the best over batches up to it.
        Beyond it more concurrency adds little throughput and only slows every sequence."""
        top = max(1, min(max_batch, int(self.kv_capacity_seqs(ctx_per_seq))))
        best = max(self.throughput_tok_s(n, ctx_per_seq) for n in range(1, top + 1))
        for n in range(1, top + 1):
            if self.throughput_tok_s(n, ctx_per_seq) >= fraction * best:
                return n
        return top

    def prefill_s(self, tokens: float, cached_tokens: float = 0.0) -> float:
        """Prefill of ``tokens`` after ``cached_tokens`` already in the cache, on one replica
        (compute-bound at ``mfu``): the weights' FLOPs per token plus attention over every
        (token, earlier token) pair, ``tokens * (cached + tokens / 2)`` of them."""
        if tokens <= 0:
            return 0.0
        pairs = tokens * (max(0.0, cached_tokens) + 0.5 * tokens)
        return (
            tokens * self.flops_per_token + pairs * self.attn_flops_per_pair
        ) / self.prefill_flops_s


def engine_model(cm: CostModelConfig, mem_fraction: float) -> EngineModel:
    gpu, model = load_gpu(cm.gpu), load_model(cm.model)
    return build_engine(
        gpu,
        model,
        cm.engine_tp,
        mem_fraction,
        cm.efficiency.decode,
        cm.efficiency.mfu,
        cm.step_overhead_s,
    )


def build_engine(
    gpu: GpuProfile,
    model: ModelProfile,
    tp: int,
    mem_fraction: float,
    e_dec: float,
    mfu: float,
    base_overhead_s: float,
) -> EngineModel:
    nb = model.bytes_per_param
    # Two all-reduces per layer inside the replica (tensor parallelism), on top of the base.
    overhead = base_overhead_s + (2 * model.layers * gpu.allreduce_latency_s if tp > 1 else 0.0)
    return EngineModel(
        tp=tp,
        dense_bytes=model.dense_params * nb,
        expert_bytes=model.expert_params * nb,
        keep_prob=1.0 - (model.experts_per_tok / model.experts if model.experts else 0.0),
        kv_bytes_per_token=model.kv_bytes_per_token_tp(tp),  # KV heads replicated past tp
        state_bytes_per_seq=2 * model.state_bytes_per_seq,  # read and written every step
        flops_per_token=2 * model.matmul_params,
        bytes_s=tp * gpu.hbm_bytes_s * e_dec,
        flops_s=tp * gpu.flops * e_dec,
        prefill_flops_s=tp * gpu.flops * mfu,
        overhead_s=overhead,
        kv_capacity_bytes=max(0.0, tp * gpu.hbm_gb * 1e9 * mem_fraction - model.weight_bytes),
        attn_flops_per_pair=model.attn_flops_per_pair,
    )


def train_flops_per_token(cm: CostModelConfig) -> float:
    """Matmul FLOPs of one trained token over the forward + backward (+ recomputed forward) +
    old-log-prob + reference passes (attention comes on top: ``train_sequence_flops``)."""
    model = load_model(cm.model)
    passes = 3 + cm.recompute + cm.old_log_prob + cm.ref_log_prob
    return 2 * model.matmul_params * passes


def attn_tokens_per_pair(model: ModelProfile) -> float:
    """Token equivalents (matmul FLOPs of one token, per pass) of one causal attention pair."""
    return model.attn_flops_per_pair / (2 * model.matmul_params)


def train_sequence_flops(cm: CostModelConfig, tokens: float) -> float:
    """Training FLOPs of one sequence of ``tokens`` tokens over every pass: its matmuls and
    its causal attention (``tokens**2 / 2`` pairs)."""
    model = load_model(cm.model)
    passes = 3 + cm.recompute + cm.old_log_prob + cm.ref_log_prob
    return passes * (
        2 * model.matmul_params * tokens + model.attn_flops_per_pair * tokens * tokens / 2
    )


def resolve(sc: Scenario) -> Scenario:
    """The scenario with every speed and cost its cost model derives (unchanged without
    ``costmodel``). Idempotent: derived fields are overwritten, never compounded."""
    cm = sc.costmodel
    if cm is None:
        return sc
    gpu, model = load_gpu(cm.gpu), load_model(cm.model)
    std, hyb = engine_model(cm, cm.mem_fraction), engine_model(cm, cm.hybrid_mem_fraction)
    cl = sc.cluster
    engines = [(std, cl.standalone_slots // max(1, cl.standalone_gpus // cm.engine_tp))]
    engines += [
        (hyb if s.kind == "hybrid" else std, s.slots // max(1, s.gpus // cm.engine_tp))
        for s in cl.cell_specs()
    ]
    # Upper bounds over every engine (the oracle needs bounds): zero context, full batch.
    peak = max(e.throughput_tok_s(max(1, n), 0.0) for e, n in engines) / cm.engine_tp
    cap = std.seq_rate(1, 0.0)
    # The oracle may add the KV reads per context token only where the peak is memory-bound
    # (then every decode step's time is at least its bytes over the bandwidth).
    kv_term = (
        std.kv_bytes_per_token / cm.engine_tp / (gpu.hbm_bytes_s * cm.efficiency.decode)
        if all(e.memory_bound(max(1, n)) for e, n in engines)
        else 0.0
    )
    link = cm.efficiency.link
    core_gpus = min(s.gpus for s in cl.cell_specs())
    state_gb = model.total_params * TRAIN_STATE_BYTES_PER_PARAM / core_gpus / 1e9
    host_gb_s = gpu.host_gb_s * link
    adam_s = 2 * model.total_params * TRAIN_STATE_BYTES_PER_PARAM / (core_gpus * gpu.hbm_bytes_s)
    return sc.model_copy(
        update={
            "engine": sc.engine.model_copy(
                update={
                    "decode_tok_s_per_gpu": peak,
                    "seq_cap_tok_s": cap,
                    "kv_gpu_s_per_ctx_token": kv_term,
                    # Decode-token equivalents of a prefilled token at the peak (the oracle's bound:
                    # the weights' FLOPs only, at the peak decode speed per GPU).
                    "prefill_equiv": std.prefill_s(1.0) * cm.engine_tp * peak,
                }
            ),
            "trainer": sc.trainer.model_copy(
                update={
                    "train_tok_s_per_gpu": gpu.flops
                    * cm.efficiency.mfu
                    / train_flops_per_token(cm),
                    "attn_tokens_per_pair": attn_tokens_per_pair(model),
                    "optimizer_s": cm.optimizer_overhead_s + adam_s,
                    "host_gb_s": host_gb_s,
                    "weight_passes": 3 + cm.recompute + cm.old_log_prob + cm.ref_log_prob,
                }
            ),
            "costs": sc.costs.model_copy(
                update={
                    "weight_gb": model.weight_bytes / 1e9,
                    "sync_gb_s": gpu.network_gb_s * link,
                    "offload_s": state_gb / host_gb_s,
                    "onload_s": state_gb / host_gb_s,
                    "kv_kb_per_token": model.kv_bytes_per_token / 1e3,
                    "kv_gb_s": gpu.network_gb_s * link,
                }
            ),
        }
    )


def engine_models(sc: Scenario) -> tuple[EngineModel, EngineModel] | None:
    """(standalone, hybrid) replica models of a scenario with a cost model, else None."""
    cm = sc.costmodel
    if cm is None:
        return None
    return engine_model(cm, cm.mem_fraction), engine_model(cm, cm.hybrid_mem_fraction)


def saturation_point(
    sc: Scenario, ctx_per_seq: float, hybrid: bool = False, fraction: float = 0.9
) -> int:
    """Sequences per engine (all its replicas) beyond which a standalone (or hybrid) engine of
    the scenario gains less than ``1 - fraction`` of its best throughput, within its slots:
    where admission control should stop adding work. Needs a cost model."""
    models = engine_models(sc)
    if models is None or sc.costmodel is None:
        from tidal.errors import ConfigError

        raise ConfigError("costmodel", f"{sc.name}: the saturation point needs a cost model")
    cl, tp = sc.cluster, sc.costmodel.engine_tp
    specs = [s for s in cl.cell_specs() if s.kind == "hybrid"] if hybrid else []
    gpus, slots = (
        (specs[0].gpus, specs[0].slots) if specs else (cl.standalone_gpus, cl.standalone_slots)
    )
    replicas = max(1, gpus // tp)
    model = models[1] if hybrid else models[0]
    return replicas * model.saturation_batch(ctx_per_seq, max(1, slots // replicas), fraction)
