"""Training FLOPs of the cost model against a hand computation: the matmuls of the active
parameters less the input embedding (a lookup), plus causal attention; the trainer's work in
token equivalents carries the same FLOPs; the median solved from a published mean length."""

import numpy as np
import pytest

from tidal.sim import perf
from tidal.sim.profiles import load_model
from tidal.sim.scenario import CostModelConfig, Dist, TrainerConfig, train_work_tokens


def _cm(**kw):
    return CostModelConfig(
        gpu="H20", model="qwen2.5-7b", engine_tp=4, efficiency={"decode": 0.3, "mfu": 0.4}, **kw
    )


def test_qwen2_5_7b_training_flops_match_the_hand_computation():
    # Qwen2.5-7B: 28 layers, hidden 3584, 28 query heads and 4 KV heads of 128, MLP 18944,
    # vocab 152064, untied. Per layer: q and o 3584^2 each, k and v 3584 x 512 each, MLP
    # 3 x 3584 x 18944 = 233,046,016; x 28 = 6,525,288,448; the output head 152064 x 3584 =
    # 544,997,376 is a matmul, the input embedding (the same size) a lookup:
    # M = 7,070,285,824 matmul parameters (active 7,615,283,200 with the lookup).
    m = load_model("qwen2.5-7b")
    assert m.active_params == 7_615_283_200
    assert m.matmul_params == 7_070_285_824
    # attention: 4 FLOPs per pair per attention dim (QK and AV) in 28 layers of 3584
    assert m.attn_flops_per_pair == 4 * 28 * 3584 == 401_408
    # One 1,000-token sequence, forward + backward + recompute (4 passes):
    # 4 x (2 x 7,070,285,824 x 1,000 + 401,408 x 1,000^2 / 2) = 57,365,102,592,000
    cm = _cm(recompute=True, old_log_prob=False)
    assert perf.train_sequence_flops(cm, 1000) == pytest.approx(57_365_102_592_000, rel=1e-12)
    assert perf.train_flops_per_token(cm) == pytest.approx(4 * 2 * 7_070_285_824)


def test_the_trainers_token_equivalents_carry_the_same_flops():
    cm = _cm(recompute=True, old_log_prob=True)
    tr = TrainerConfig(attn_tokens_per_pair=perf.attn_tokens_per_pair(load_model(cm.model)))
    for tokens in (300, 4_000, 28_672):
        assert train_work_tokens(tokens, tr) * perf.train_flops_per_token(cm) == pytest.approx(
            perf.train_sequence_flops(cm, tokens), rel=1e-12
        )
    # attention adds 1.4% to a 1K-token sample of the 7B and 41% to a 28K one
    assert train_work_tokens(1000, tr) / 1000 == pytest.approx(1.0142, abs=1e-4)
    assert train_work_tokens(28_672, tr) / 28_672 == pytest.approx(1.4070, abs=1e-3)


def test_a_tied_embedding_stays_a_matmul():
    from tidal.sim.profiles import model_from_config

    cfg = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "vocab_size": 100,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    }
    untied = model_from_config(cfg, "u")
    tied = model_from_config({**cfg, "tie_word_embeddings": True}, "t")
    assert untied.matmul_params == tied.matmul_params == tied.active_params
    assert untied.active_params - untied.matmul_params == 100 * 64


def test_a_published_mean_length_gives_the_median():
    d = Dist(mean=12_720, sigma=0.75, cap=32_768)
    z = np.random.default_rng(0).standard_normal(1_000_000)
    assert np.minimum(d.median * np.exp(0.75 * z), 32_768).mean() == pytest.approx(
        12_720, rel=0.002
    )
    assert Dist(**d.model_dump()).median == d.median  # round-trips
    with pytest.raises(ValueError, match="not both"):
        Dist(mean=12_720, median=5_000, sigma=0.75, cap=32_768)
    with pytest.raises(ValueError, match="within"):
        Dist(mean=40_000, sigma=0.75, cap=32_768)
