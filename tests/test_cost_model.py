"""The cost model's arithmetic against hand-computed numbers, and the NNLS fit's round trip."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from engine.config import CONF_DIR
from engine.step_shape import StepShape, attention_runs, padded_pairs
from simulator.cost_model import CostModel, fit_coefficients, predict, tile_tail_rows
from simulator.hardware import Hardware
from simulator.llm import SimulatedLLM, kv_capacity_from_memory
from simulator.model_shapes import model_config_for_costs, parameter_count

TINY = model_config_for_costs(yaml.safe_load((CONF_DIR / "model" / "tiny.yaml").read_text())["hf_config"])
LLAMA_8B = model_config_for_costs(yaml.safe_load((CONF_DIR / "model" / "llama-3.1-8b.yaml").read_text())["hf_config"])


def shape(seqs=1, rows=1, decode=1, sampled=1, context=1, pairs=0, shared=0) -> StepShape:
    return StepShape(num_seqs=seqs, num_rows=rows, num_decode_tokens=decode, num_wasted_slots=0,
                     num_sampled=sampled, context_tokens=context, prefill_attention_pairs=pairs,
                     shared_context_tokens=shared)


def test_padded_pairs_by_hand():
    """Dense attention computes each call's rectangle: ragged prompts pad to the longest; a mixed
    step with a run of >= 2 decodes attends its prompts alone, with one decode it pads it too."""
    assert padded_pairs([3, 5], [3, 5]) == 2 * 5 * 5  # causal would be 6 + 15
    assert padded_pairs([1, 1, 4], [10, 12, 4]) == 1 * 4 * 4  # decode run attended apart
    assert padded_pairs([1, 4], [10, 4]) == 2 * 4 * 10  # one decode: one padded call
    assert padded_pairs([1, 1, 4], [10, 12, 4], min_decode_run=None) == 3 * 4 * 12  # never split
    assert padded_pairs([1, 1], [10, 12]) == 0  # decode-only: the context term
    assert attention_runs([1, 1, 4, 6, 1, 1]) == [(0, 2), (2, 4), (4, 6)]


def test_the_hardware_picks_causal_or_padded_pairs():
    step = StepShape(num_seqs=2, num_rows=8, num_decode_tokens=0, num_wasted_slots=0, num_sampled=2,
                     context_tokens=8, prefill_attention_pairs=21, padded_attention_pairs=50)
    hardware = dict(name="unit", peak_tflops=1, bandwidth_tbps=1)
    assert CostModel(Hardware(**hardware), TINY).terms(step).attention_s == pytest.approx(21 * 4 * 2 * 4 * 16 * 1e-12)
    assert CostModel(Hardware(**hardware, attention_pairs="padded"), TINY).terms(step).attention_s == \
        pytest.approx(50 * 4 * 2 * 4 * 16 * 1e-12)
    with pytest.raises(ValueError, match="attention_pairs must be one of"):
        Hardware(**hardware, attention_pairs="sparse")


def test_small_batch_regime_prices_steps_of_few_rows_only():
    hw = Hardware(name="unit", peak_tflops=1, bandwidth_tbps=1, weight_time_scale=0.0, small_batch_rows=24,
                  small_batch_time_scale=0.5)
    model = CostModel(hw, TINY)
    for rows, extra in ((24, 0.5), (25, 0.0)):
        step = shape(seqs=rows, rows=rows, decode=rows, sampled=rows, context=rows)
        terms = model.terms(step)
        assert terms.small_batch_linear_s == (terms.linear_s if extra else 0.0)
        assert model.step_time(step) == pytest.approx((1 + extra) * terms.linear_s + terms.kv_s, rel=1e-12)


def test_tile_tail_rows_by_hand():
    """The few-row GEMM's remainder tiles: rows past the full 8-row tiles, in pairs; one row alone
    is the weight stream; above the kernel's limit oneDNN runs the GEMM."""
    expected = {1: 0, 2: 2, 3: 4, 4: 4, 5: 6, 7: 8, 8: 0, 9: 2, 15: 8, 16: 0, 17: 2, 128: 0, 129: 0}
    assert {rows: tile_tail_rows(rows, 8, 128) for rows in expected} == expected
    assert [tile_tail_rows(rows, 4, 32) for rows in (3, 4, 5, 7, 33)] == [4, 0, 2, 4, 0]  # AVX2's 4-row tile
    assert tile_tail_rows(7, 0, 128) == 0  # no tiled kernel (the GPU presets)


def test_tile_tail_makes_seven_rows_cost_more_than_eight():
    """The measured shape of the skinny GEMM (docs/simulator.md): a step of 8 decode rows is
    cheaper than one of 7; the tail term, priced by hand, is what makes it so."""
    hw = Hardware(name="unit", peak_tflops=1, bandwidth_tbps=1, dtype_bytes=4, weight_time_scale=0.0,
                  small_batch_rows=128, small_batch_tile_rows=8, tile_tail_time_scale=0.5)
    model = CostModel(hw, TINY)
    layer_flops, head_flops = 2 * 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64), 2 * 512 * 64
    for rows, tail in ((7, 8), (8, 0), (9, 2)):
        step = shape(seqs=rows, rows=rows, decode=rows, sampled=rows, context=rows)
        terms = model.terms(step)
        assert terms.tile_tail_s == pytest.approx(tail * (layer_flops + head_flops) * 1e-12, rel=1e-12)
        assert model.step_time(step) == pytest.approx(terms.linear_s + 0.5 * terms.tile_tail_s + terms.kv_s, rel=1e-12)
    seven, eight = (model.step_time(shape(seqs=n, rows=n, decode=n, sampled=n, context=n)) for n in (7, 8))
    assert seven > eight


def test_larger_gemms_are_priced_on_their_padded_rows():
    """servelab's prepacked oneDNN linears compute rows padded to 4 buckets per octave
    (``engine.weight_copies.onednn_row_bucket``): 129 rows cost 160, 913 cost 1,024; the few-row path
    (<= 128 rows) and a hardware without buckets compute the rows as they are."""
    base = dict(name="unit", peak_tflops=1, bandwidth_tbps=1, weight_time_scale=0.0, small_batch_rows=128)
    padded, plain = CostModel(Hardware(**base, large_batch_row_buckets=4), TINY), CostModel(Hardware(**base), TINY)
    for rows, computed in ((128, 128), (129, 160), (200, 224), (913, 1024), (1024, 1024)):
        step = shape(seqs=1, rows=rows, decode=0, sampled=1, context=rows)
        assert padded.terms(step).linear_s == pytest.approx(
            computed * padded.linear_s_per_row + padded.lm_head_s_per_row, rel=1e-12)
        assert plain.terms(step).linear_s == pytest.approx(rows * plain.linear_s_per_row + plain.lm_head_s_per_row,
                                                           rel=1e-12)


def test_shared_context_counts_blocks_read_twice_in_a_step():
    """Three requests on the prefix cache (blocks of 4): the first computes a 10-token prompt,
    the next two hit its 2 full blocks; once all three decode together, 2 sequences re-read
    those 8 tokens (16 shared), and the third block (partial, its owner's alone) is not shared."""
    from engine import SamplingParams

    llm = SimulatedLLM(model="tiny", hardware="h100", cache="prefix", block_size=4, capacity_tokens=256)
    prompt = list(range(10, 20))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.add_request(prompt, params)
    llm.step()  # the leader's prefill fills the cache
    llm.add_request(prompt[:8] + [30, 31], params)
    llm.add_request(prompt[:8] + [40], params)
    while llm.has_unfinished():
        llm.step()
    records = llm.step_records
    assert [r.prefix_hit_tokens for r in records[:2]] == [0, 16]
    decode_all = [r for r in records if r.num_decode_tokens == 3]
    assert decode_all and all(r.shared_context_tokens == 16 for r in decode_all)
    assert records[0].shared_context_tokens == 0  # one sequence: nothing to share


def test_shared_context_is_priced_by_its_own_scale():
    step = shape(seqs=3, rows=3, decode=3, sampled=3, context=300, shared=200)
    base = dict(name="unit", peak_tflops=1, bandwidth_tbps=1, dtype_bytes=4, weight_time_scale=0.0, kv_time_scale=2.0)
    per_token = 2 * 2 * 32 * 4 * 1e-12  # tiny's K and V bytes per token, at 1 TB/s
    cheap = CostModel(Hardware(**base, shared_kv_time_scale=0.5), TINY)
    terms = cheap.terms(step)
    assert (terms.kv_s, terms.shared_kv_s) == pytest.approx((100 * per_token, 200 * per_token), rel=1e-12)
    assert cheap.step_time(step) == pytest.approx(terms.linear_s + 2.0 * terms.kv_s + 0.5 * terms.shared_kv_s, rel=1e-12)
    unknown = CostModel(Hardware(**base), TINY)  # not calibrated with shared blocks: as the rest of the KV
    assert unknown.step_time(step) == pytest.approx(terms.linear_s + 2.0 * 300 * per_token, rel=1e-12)


def test_parameter_counts_match_the_published_sizes():
    assert parameter_count(LLAMA_8B) == 8_030_261_248  # Llama-3.1-8B: "8.03B"
    # tiny by hand: per layer q/k/v/o 64*(64+32+32) + 64*64, MLP 3*64*128, 2 norms of 64
    layer = 64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert parameter_count(TINY) == 512 * 64 + 2 * layer + 64


def test_step_time_by_hand_on_tiny():
    """1 TFLOP/s and 1 TB/s with every multiplier 1: each term is FLOPs or bytes x 1e-12."""
    hw = Hardware(name="unit", peak_tflops=1, bandwidth_tbps=1, dtype_bytes=4, step_overhead_s=1e-3,
                  seq_overhead_s=1e-4)
    layer = 64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    prefill = shape(seqs=2, rows=100, decode=0, sampled=2, context=100, pairs=2 * (50 * 51 // 2))
    linear = (100 * 2 * 2 * layer + 2 * 2 * 512 * 64) * 1e-12
    weights = (2 * layer + 512 * 64 + 64) * 4 * 1e-12
    kv = 100 * (2 * 2 * 32 * 4) * 1e-12
    attention = 2 * 1275 * (4 * 2 * 4 * 16) * 1e-12
    expected = 1e-3 + 2e-4 + max(linear, weights) + kv + attention
    assert CostModel(hw, TINY).step_time(prefill) == pytest.approx(expected, rel=1e-12)


def test_roofline_decode_waits_for_weights_and_prefill_for_math():
    h100 = Hardware(name="h100", peak_tflops=989, bandwidth_tbps=3.35)
    model = CostModel(h100, LLAMA_8B)
    decode = model.step_time(shape(seqs=1, rows=1, context=1000))
    weights_s = (parameter_count(LLAMA_8B) - 128256 * 4096) * 2 / 3.35e12  # every weight but the embedding
    assert decode == pytest.approx(weights_s + 1000 * 131072 / 3.35e12, rel=1e-3)
    prefill = model.step_time(shape(seqs=1, rows=8192, decode=0, context=8192, pairs=8192 * 8193 // 2))
    assert prefill > 8192 * 2 * 6.98e9 / 989e12  # compute bound: at least the linear FLOPs at peak


def test_more_work_never_costs_less():
    model = CostModel(Hardware(name="h100", peak_tflops=989, bandwidth_tbps=3.35, step_overhead_s=1e-3,
                               seq_overhead_s=1e-5), LLAMA_8B)
    base = model.step_time(shape(seqs=8, rows=8, decode=8, sampled=8, context=8000))
    for bigger in (shape(seqs=9, rows=9, decode=9, sampled=9, context=8000),
                   shape(seqs=8, rows=8, decode=8, sampled=8, context=9000),
                   shape(seqs=8, rows=4000, decode=8, sampled=8, context=12000, pairs=4_000_000)):
        assert model.step_time(bigger) > base


def test_nnls_recovers_known_coefficients_and_sets_aside_disturbed_steps():
    units = Hardware(name="units", peak_tflops=0.15, bandwidth_tbps=0.025, dtype_bytes=4, small_batch_rows=24,
                     small_batch_tile_rows=8)
    model = CostModel(units, TINY)
    rng, prefix_rng = np.random.default_rng(0), np.random.default_rng(7)
    shapes = []
    for _ in range(200):
        seqs = int(rng.integers(1, 32))
        prefill = int(rng.integers(0, 400)) if rng.random() < 0.3 else 0
        rows = seqs + prefill
        context = seqs * int(rng.integers(16, 400))
        shared = (seqs - 1) * 16 * int(prefix_rng.integers(0, 100)) if prefix_rng.random() < 0.3 else 0  # a shared prefix
        shapes.append(shape(seqs=seqs, rows=rows, decode=seqs, sampled=seqs, context=context + shared,
                            pairs=prefill * (prefill + 1) // 2, shared=shared))
    # no weight-bound regime (c_w = 0); c_tail large enough that tiny's few tail rows stand out of the noise
    truth = np.array([0.01, 0.0015, 0.4, 3.0, 0.0, 2.0, 7.0, 50.0, 0.7])
    seconds = np.array([model.terms(s).fit_row() for s in shapes]) @ truth
    seconds = seconds * rng.uniform(0.999, 1.001, size=len(seconds))  # timer-level noise
    seconds[::20] *= 10  # every 20th step disturbed by another process
    fit = fit_coefficients([model.terms(s) for s in shapes], seconds.tolist())
    assert fit.num_kept == 190 and fit.r_squared > 0.99
    assert np.allclose(list(fit.coefficients.values()), truth, rtol=0.05)


def test_fit_finds_the_weight_bound_regime_of_small_batches():
    """Steps priced by the formula's max (small decode batches wait for the weights, larger ones
    for the math): the fit searches the crossover and recovers c_w beside the other coefficients."""
    units = Hardware(name="units", peak_tflops=0.15, bandwidth_tbps=0.025, dtype_bytes=4, small_batch_rows=0)
    model = CostModel(units, TINY)
    per_row = model.linear_s_per_row + model.lm_head_s_per_row
    c_lin = 0.4
    c_w = c_lin * 10.5 * per_row / model.weights_s  # decode batches of <= 10 rows are weight-bound
    truth = np.array([0.01, 0.0015, c_lin, 0.0, c_w, 2.0, 7.0, 0.0, 0.0])
    rng = np.random.default_rng(1)
    shapes = []
    for _ in range(300):
        seqs = int(rng.integers(1, 40))
        prefill = int(rng.integers(1, 300)) if rng.random() < 0.3 else 0
        shapes.append(shape(seqs=seqs, rows=seqs + prefill, decode=seqs, sampled=seqs,
                            context=seqs * int(rng.integers(16, 400)), pairs=prefill * (prefill + 1) // 2))
    x = np.array([model.terms(s).fit_row() for s in shapes])
    seconds = predict(x, truth)
    assert (x[:, 4] * c_w > x[:, 2] * c_lin).any() and (x[:, 4] * c_w < x[:, 2] * c_lin).any()  # both regimes occur
    fit = fit_coefficients([model.terms(s) for s in shapes], seconds.tolist())
    assert fit.r_squared > 0.999
    assert np.allclose(list(fit.coefficients.values()), truth, rtol=0.02, atol=1e-6)


def test_kv_capacity_from_memory_by_hand():
    h100 = Hardware(name="h100", peak_tflops=989, bandwidth_tbps=3.35, memory_gb=80)
    # (80 GB x 0.9 - 8.03e9 params x 2 bytes) / (2 x 32 layers x 8 heads x 128 x 2 bytes)
    assert kv_capacity_from_memory(h100, LLAMA_8B, 0.9) == int((72e9 - 8_030_261_248 * 2) // 131072)
    with pytest.raises(ValueError, match="tensor_parallel"):
        seventy = model_config_for_costs(yaml.safe_load((CONF_DIR / "model" / "llama-3.1-70b.yaml").read_text())["hf_config"])
        kv_capacity_from_memory(h100, seventy, 0.9)


DATASHEETS = {  # name: (TB/s, dense bf16 TFLOP/s, GB) from the vendors' datasheets
    "a100-80gb": (2.0, 312, 80), "h100": (3.35, 989, 80), "h200": (4.8, 989, 141), "l4": (0.3, 121, 24),
    "rtx4090": (1.0, 165, 24),
}


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_presets_carry_the_datasheet_and_say_projected(name):
    llm = SimulatedLLM(model="llama-3.1-8b", hardware=name)
    hw = llm.hardware
    assert (hw.bandwidth_tbps, hw.peak_tflops, hw.memory_gb) == DATASHEETS[name]
    assert llm.describe()["timing"].startswith("projected, uncalibrated")
    assert llm.cache.stats().capacity_tokens == pytest.approx(kv_capacity_from_memory(hw, LLAMA_8B, 0.9), abs=16)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown hardware 'tpu'.*h100"):
        SimulatedLLM(model="tiny", hardware="tpu")
    with pytest.raises(ValueError, match="unknown model 'gpt-9'.*llama-3.1-8b"):
        SimulatedLLM(model="gpt-9", hardware="h100")


def test_tensor_parallel_makes_70b_fit_and_scales_the_peaks():
    with pytest.raises(ValueError, match="leave no KV memory on h100.*tensor_parallel"):
        SimulatedLLM(model="llama-3.1-70b", hardware="h100")
    from omegaconf import OmegaConf

    from engine.config import engine_config, load_group_option

    cfg = engine_config("llama-3.1-70b", "paged", "continuous", "torch_sdpa", "cpu", "float32", "random", 0, {}, {})
    cfg.hardware = load_group_option("hardware", "h100", {"tensor_parallel": 2})
    engine = SimulatedLLM.from_config(OmegaConf.create(cfg))
    weights = parameter_count(engine.model_config) * 2
    assert engine.cache.stats().capacity_tokens == pytest.approx((160e9 * 0.9 - weights) / 327680, abs=16)
    assert engine.hardware.flops_per_s == 2 * 989e12 and "tp=2" in engine.describe()["timing"]
