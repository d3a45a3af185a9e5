"""The simulator runs the real schedulers and caches: its steps must be the real engine's steps.

For the same requests (added at the same step indices, so neither clock matters), the simulated
engine's per-step batch composition — prefill / decode tokens, wasted slots, preemptions,
prefix hits, KV used / reserved, queue lengths, context read — equals the real engine's on the
tiny model, for every cache x scheduler. Each case also checks that the feature it is about
(preemption, prefix hits, wasted slots) actually happened, so the equality is not vacuous.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from simulator import SimulatedLLM

COMPOSITION = ("num_seqs", "num_prefill_tokens", "num_decode_tokens", "num_wasted_slots", "num_preempted",
               "prefix_hit_tokens", "kv_used_tokens", "kv_reserved_tokens", "kv_capacity_tokens",
               "num_waiting", "num_running", "context_tokens", "prefill_attention_pairs", "padded_attention_pairs",
               "shared_context_tokens")
SYSTEM_PROMPT = [7 + (i * 13) % 400 for i in range(24)]  # shared by the first requests: prefix hits


def requests() -> list[tuple[int, list[int], SamplingParams]]:
    """(step index to add at, prompt, params): a shared prefix, ragged lengths, late arrivals."""
    plan = []
    for index in range(8):
        own = [20 + (index * 31 + j * 7) % 450 for j in range(3 + 5 * index % 17)]
        prompt = SYSTEM_PROMPT + own if index < 5 else own
        params = SamplingParams(max_tokens=6 + (index * 5) % 13, ignore_eos=True)
        plan.append((0 if index < 4 else 2 * index, prompt, params))
    return plan


# capacity: contiguous reserves max_model_len (512 for tiny) per sequence -> 2 regions;
# paged / prefix get 24 blocks of 4 for up to 8 requests of ~30-60 tokens -> queueing or preemption.
CACHES = {"contiguous": {"capacity_tokens": 1024}, "paged": {"capacity_tokens": 96}, "prefix": {"capacity_tokens": 96}}


def run_steps(engine, plan) -> tuple[list[tuple], list]:
    outputs, step, pending = [], 0, list(plan)
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            engine.add_request(prompt, params)
        outputs.extend(engine.step())
        step += 1
        assert step < 1000, "runaway loop"
    composition = [tuple(getattr(record, name) for name in COMPOSITION) for record in engine.step_records]
    return composition, sorted((o for o in outputs if o.finished), key=lambda o: o.request_id)


@pytest.mark.parametrize("scheduler", ["static", "continuous", "preemptive"])
@pytest.mark.parametrize("cache", ["contiguous", "paged", "prefix"])
def test_simulated_steps_equal_real_steps(cache, scheduler):
    options = dict(cache=cache, scheduler=scheduler, block_size=4, max_num_seqs=4, **CACHES[cache])
    real = LLM(model="tiny", device="cpu", **options)
    simulated = SimulatedLLM(model="tiny", hardware="h100", **options)
    assert simulated.cache.kv_caches == []  # no KV tensors: block accounting alone
    real_steps, real_outputs = run_steps(real, requests())
    sim_steps, sim_outputs = run_steps(simulated, requests())
    assert sim_steps == real_steps
    assert [(o.request_id, len(o.token_ids), o.num_preemptions, o.num_cached_tokens) for o in sim_outputs] == \
        [(o.request_id, len(o.token_ids), o.num_preemptions, o.num_cached_tokens) for o in real_outputs]
    totals = {name: sum(step[COMPOSITION.index(name)] for step in real_steps)
              for name in ("num_preempted", "prefix_hit_tokens", "num_wasted_slots", "shared_context_tokens")}
    assert (totals["num_preempted"] > 0) == (scheduler == "preemptive" and cache != "contiguous")
    assert (totals["prefix_hit_tokens"] > 0) == (cache == "prefix")
    assert (totals["shared_context_tokens"] > 0) == (cache == "prefix")  # hit blocks read by two sequences of a step
    assert (totals["num_wasted_slots"] > 0) == (scheduler == "static")
    simulated.free_blocks_check()


def test_chunked_prefill_steps_equal_real_steps():
    options = dict(cache="prefix", scheduler="preemptive", block_size=4, max_num_seqs=4, capacity_tokens=128,
                   max_num_batched_tokens=16, chunked_prefill=True)
    real_steps, _ = run_steps(LLM(model="tiny", device="cpu", **options), requests())
    sim_steps, _ = run_steps(SimulatedLLM(model="tiny", hardware="h100", **options), requests())
    assert sim_steps == real_steps
    assert any(step[COMPOSITION.index("num_prefill_tokens")] and step[COMPOSITION.index("num_decode_tokens")]
               for step in real_steps), "no mixed prefill + decode step: chunking was not exercised"


def test_padded_pairs_are_what_the_real_runner_hands_the_attention_backend():
    """The recorded padded attention pairs equal ``n x max query x max context`` summed over the
    attention calls the real runner makes (its split of mixed steps into decode / prefill runs)."""
    engine = LLM(model="tiny", device="cpu", cache="paged", scheduler="continuous", block_size=4, max_num_seqs=4,
                 capacity_tokens=256)
    calls_per_step = []
    prepare = engine.runner.prepare

    def recording_prepare(scheduled):
        inputs = prepare(scheduled)
        calls = [part for _, _, part in inputs.attention_parts] if inputs.attention_parts else [inputs.metadata]
        calls_per_step.append(sum(len(call.query_lens) * call.max_query_len * call.max_context_len
                                  for call in calls if call.max_query_len > 1))
        return inputs

    engine.runner.prepare = recording_prepare
    run_steps(engine, requests())
    recorded = [record.padded_attention_pairs for record in engine.step_records]
    assert recorded == calls_per_step
    assert any(record.num_decode_tokens >= 2 and record.num_prefill_tokens for record in engine.step_records), \
        "no split mixed step exercised"
    assert sum(recorded) > sum(record.prefill_attention_pairs for record in engine.step_records)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_private_block_stats_equal_the_block_walk(cache):
    """Caches that never share blocks sum KV use per sequence; it must equal the per-block walk."""
    from strategies.cache.paged import used_and_reserved_tokens

    engine = SimulatedLLM(model="tiny", hardware="h100", cache=cache, scheduler="preemptive", block_size=4,
                          max_num_seqs=4, **CACHES[cache])
    pending, step = requests(), 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            engine.add_request(*pending.pop(0)[1:])
        engine.step()
        step += 1
        stats = engine.cache.stats()
        assert (stats.used_tokens, stats.reserved_tokens) == used_and_reserved_tokens(
            engine.cache.live_seqs.values(), engine.cache.block_size)


def test_driver_advances_the_virtual_clock_instead_of_sleeping():
    """Arrivals 1,000 s apart: the driver jumps the clock (a sleeping driver would hang here)."""
    from experiments.harness.driver import drive
    from experiments.harness.workloads import WorkloadRequest

    engine = SimulatedLLM(model="tiny", hardware="h100")
    requests = [WorkloadRequest(f"r{i}", [5 + i] * 8, SamplingParams(max_tokens=4, ignore_eos=True), 1000.0 * i)
                for i in range(3)]
    result = drive(engine, requests, progress=False)
    assert [r.request_id for r in result.records] == ["r0", "r1", "r2"]
    for index, record in enumerate(result.records):
        assert record.arrival_s == pytest.approx(1000.0 * index)
        assert 1000.0 * index < record.first_token_s < record.finish_s < 1000.0 * index + 1.0
    assert result.wall_s > 2000.0  # virtual seconds


def test_rejects_like_the_real_engine_and_keeps_serving():
    options = dict(cache="paged", scheduler="continuous", block_size=4, capacity_tokens=64)
    real, simulated = LLM(model="tiny", device="cpu", **options), SimulatedLLM(model="tiny", hardware="h100", **options)
    for bad_prompt, bad_params in (([], SamplingParams()), ([1] * 60, SamplingParams(max_tokens=10)),
                                   ([600], SamplingParams()), ([1] * 500, SamplingParams(max_tokens=20))):
        errors = []
        for engine in (real, simulated):
            with pytest.raises(ValueError) as caught:
                engine.add_request(bad_prompt, bad_params)
            errors.append(str(caught.value))
        assert errors[0] == errors[1]
    [output] = simulated.generate([[3, 4, 5]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(output.token_ids) == 5 and output.finish_reason == "length"


def test_output_length_distribution_ends_requests_with_eos():
    """With ``mean_output_tokens`` outputs end at EOS after geometric lengths, the same on a fresh
    engine; without it EOS never comes. (A pool of 8,192 tokens: the tiny model's KV on a whole
    H100 would be millions of blocks to set up, and the pool plays no part here.)"""
    def engine(**options) -> SimulatedLLM:
        return SimulatedLLM(model="tiny", hardware="h100", capacity_tokens=8192, **options)

    outputs = engine(mean_output_tokens=8).generate([[3 + i, 4, 5] for i in range(40)], SamplingParams(max_tokens=100))
    lengths = [len(o.token_ids) for o in outputs]
    assert all(o.finish_reason == "stop" and o.token_ids[-1] == 2 for o in outputs if len(o.token_ids) < 100)
    assert len(set(lengths)) > 5 and 4 < sum(lengths) / len(lengths) < 16  # geometric, mean 8
    again = engine(mean_output_tokens=8).generate([[3 + i, 4, 5] for i in range(40)], SamplingParams(max_tokens=100))
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # deterministic
    never = engine().generate([[3, 4, 5]], SamplingParams(max_tokens=300))
    assert len(never[0].token_ids) == 300  # without a distribution EOS never comes


def test_engine_simulated_needs_hardware_and_labels_its_times(tmp_path):
    from hydra import compose, initialize_config_dir

    from engine.config import CONF_DIR
    from experiments.harness.job import execute

    overrides = ["engine=simulated", "model=tiny", "workload=burst", "workload.concurrency=2", "driver.progress=false",
                 "plots=false"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        missing = compose("config", overrides=overrides)
        # a pool of 8,192 tokens: the tiny model's KV on a whole H200 would be 31 million blocks to set up
        with_h200 = compose("config", overrides=[*overrides, "hardware=h200", "engine.kv_capacity=8192"])
    with pytest.raises(ValueError, match="needs hardware=<name>; known: .*h100"):
        SimulatedLLM.from_config(missing)
    outcome = execute(with_h200, tmp_path, {"engine": "simulated", "hardware": "h200", "model": "tiny"}, [])
    assert not outcome.failed
    assert outcome.summary["run"]["timing"].startswith("projected, uncalibrated")
    assert outcome.summary["run"]["hardware"] == "h200"
    assert "projected, uncalibrated" in (tmp_path / "summary.md").read_text()
