"""Request-level serving (sim/serving, `tpusim serve`): the workload's draws and trace files,
the cost model against the engine, and the schedulers against closed forms and hand-solved
schedules (every expected number below is computed from the engine's own step times)."""

from __future__ import annotations

import json
import random
import tracemalloc

import numpy as np
import pytest

from sim.runs import DecodeRequest, PrefillRequest, ServeRequest, ServeSweepRequest, run
from sim.runs.bind import resolve_pod, simulate_step
from sim.serving.costs import CostBounds, IterationCosts, StepModel
from sim.serving.metrics import parse_slo
from sim.serving.workload import (
    ArrivalKind,
    WorkloadConfig,
    generate,
    parse_lengths,
    read_trace,
)
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.inference import DecodeConfig
from workloads.models import MlpKind, TransformerSpec

# Two layers on a 2x2 v5e: each engine run takes a few ms, so the oracles stay cheap.
TINY = TransformerSpec(name="serve-tiny", num_layers=2, d_model=1024, num_heads=8,
                       num_kv_heads=8, head_dim=128, d_ff=4096, mlp=MlpKind.SWIGLU,
                       vocab_size=8192)
POD = {"model": TINY, "chip": "v5e", "shape": "2x2", "mesh": "tensor=4"}


def _trace(tmp_path, rows, name="t.csv"):
    p = tmp_path / name
    if name.endswith(".csv"):
        p.write_text("arrival_s,prompt_tokens,output_tokens\n"
                     + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    else:
        p.write_text("".join(json.dumps({"arrival_s": a, "prompt_tokens": b,
                                         "output_tokens": c}) + "\n" for a, b, c in rows))
    return str(p)


def _serve(**kw):
    return run(ServeRequest(**POD, **kw))


def _prefill_s(p: int) -> float:
    return run(PrefillRequest(**POD, batch=1, prompt_len=p)).summary["time_s"]


def _decode_s(b: int, c: int) -> float:
    return run(DecodeRequest(**POD, batch=b, context_len=c)).summary["step_time_s"]


# -- workload -----------------------------------------------------------------------------------
def _cfg(**kw):
    base = {"rate_per_s": 10.0, "num_requests": 20000,
            "prompt_tokens": parse_lengths("lognormal:1000,0.8", "--prompt-tokens"),
            "output_tokens": parse_lengths("uniform:10,20", "--output-tokens"), "seed": 7}
    base.update(kw)
    return WorkloadConfig(**base)


def test_poisson_gaps_have_the_rate_and_a_seed_gives_the_same_requests():
    w = generate(_cfg())
    gaps = np.diff(w.arrival_s)
    assert w.arrival_s[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() * 10.0 - 1) < 0.03
    assert abs(gaps.std() / gaps.mean() - 1) < 0.03  # exponential: CV 1
    again = generate(_cfg())
    assert np.array_equal(w.arrival_s, again.arrival_s)
    assert np.array_equal(w.prompt_tokens, again.prompt_tokens)
    assert not np.array_equal(w.arrival_s, generate(_cfg(seed=8)).arrival_s)


def test_gamma_gaps_have_the_rate_and_the_cv():
    w = generate(_cfg(arrival=ArrivalKind.GAMMA, cv=3.0))
    gaps = np.diff(w.arrival_s)
    assert abs(gaps.mean() * 10.0 - 1) < 0.06
    assert abs(gaps.std() / gaps.mean() / 3.0 - 1) < 0.08


def test_lengths_have_their_mean_and_range():
    w = generate(_cfg())
    assert abs(w.prompt_tokens.mean() / 1000 - 1) < 0.03
    assert w.prompt_tokens.min() >= 1
    assert w.output_tokens.min() == 10 and w.output_tokens.max() == 20
    assert np.all(generate(_cfg(prompt_tokens=parse_lengths("fixed:33", "x"))).prompt_tokens
                  == 33)


def test_duration_stops_arrivals_and_draws_the_expected_count():
    w = generate(_cfg(num_requests=None, duration_s=500.0))
    assert w.arrival_s.max() < 500.0
    assert abs(w.num_requests / 5000 - 1) < 0.05


@pytest.mark.parametrize("text", ["fixed", "fixed:0", "uniform:5", "uniform:9,3", "normal:3",
                                  "lognormal:100,nan", "lognormal:0.5,1", "fixed:1.5"])
def test_bad_length_distributions_are_refused(text):
    with pytest.raises(TpusimError, match="--prompt-tokens"):
        parse_lengths(text, "--prompt-tokens")


@pytest.mark.parametrize("name", ["t.csv", "t.jsonl"])
def test_a_trace_file_is_read_as_written(tmp_path, name):
    rows = [(0.0, 10, 3), (0.5, 20, 4), (0.5, 7, 1), (2.25, 100, 50)]
    w = read_trace(__import__("pathlib").Path(_trace(tmp_path, rows, name)))
    assert w.arrival_s.tolist() == [0.0, 0.5, 0.5, 2.25]
    assert w.prompt_tokens.tolist() == [10, 20, 7, 100]
    assert w.output_tokens.tolist() == [3, 4, 1, 50]


@pytest.mark.parametrize("body,match", [
    ("arrival_s,prompt_tokens\n0,1\n", "lacks column"),
    ("arrival_s,prompt_tokens,output_tokens\n1,5,5\n0.5,5,5\n", "before the previous"),
    ("arrival_s,prompt_tokens,output_tokens\n-1,5,5\n", "finite number >= 0"),
    ("arrival_s,prompt_tokens,output_tokens\n0,5.5,5\n", "not a whole number"),
    ("arrival_s,prompt_tokens,output_tokens\n0,5,0\n", "not a whole number"),
    ("arrival_s,prompt_tokens,output_tokens\nnan,5,5\n", "finite number"),
    ("", "empty"),
])
def test_bad_trace_files_are_refused_in_one_line(tmp_path, body, match):
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(TpusimError, match=match) as e:
        read_trace(p)
    assert "\n" not in str(e.value)


def test_a_trace_file_is_streamed_in_bounded_memory(tmp_path):
    p = tmp_path / "big.csv"
    n = 40_000
    with p.open("w") as f:
        f.write("arrival_s,prompt_tokens,output_tokens\n")
        for i in range(n):
            f.write(f"{i * 0.01:.2f},{100 + i % 50},{1 + i % 7}\n")
    tracemalloc.start()
    w = read_trace(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert w.num_requests == n
    # 32 bytes a row in arrays (twice while copied out), nowhere near a list of row dicts
    # (several hundred bytes a row).
    assert peak < 100 * n


def test_slo_text_is_parsed_and_bad_rules_refused():
    s = parse_slo("ttft=0.5,tpot=0.05")
    assert (s.ttft_s, s.tpot_s) == (0.5, 0.05)
    for bad in ("ttft", "ttft=0", "latency=1", "ttft=1,ttft=2", "tpot=inf"):
        with pytest.raises(TpusimError, match="^slo ") as e:
            parse_slo(bad)
        # every mention of the setting is a placeholder: the CLI writes each as --slo
        assert e.value.params == ("slo",)
        assert e.value.render(lambda n: "--" + n).count("--slo") == 2


# -- cost model -----------------------------------------------------------------------------
def test_cost_model_is_within_one_percent_of_the_engine_on_random_compositions():
    req = DecodeRequest(model=TINY, chip="v5e", shape="2x2", mesh="tensor=4", batch=1,
                        context_len=1)
    pod = resolve_pod(req)
    step = StepModel(chip=pod.chip, topology=pod.topology, model=TINY,
                     mesh=parse_mesh("tensor=4", None), config=DecodeConfig(batch=1,
                                                                            context_len=1),
                     simulate=lambda tr: simulate_step(req, tr, pod.chip, pod.topology))
    costs = IterationCosts(step, CostBounds(max_batch=64, max_context=2048, max_chunk=1024))
    rng = random.Random(3)
    for _ in range(30):
        # A batch of sequences at different contexts costs the batch at their mean context.
        ctx = [rng.randint(1, 2048) for _ in range(rng.randint(1, 64))]
        want = step.decode_s(len(ctx), round(sum(ctx) / len(ctx)))
        assert costs.decode_s(len(ctx), sum(ctx)) == pytest.approx(want, rel=0.01)
        t = rng.randint(1, 1024)
        k = rng.randint(0, 2048 - t)
        assert costs.prefill_s(t, k) == pytest.approx(step.prefill_s(t, k), rel=0.01)
    # At a grid point it is the engine's time itself.
    assert costs.decode_s(1, 1) == step.decode_s(1, 1)


def test_a_prefill_after_cached_tokens_costs_more_than_the_same_tokens_from_scratch():
    from workloads.inference import compile_prefill

    cfg = DecodeConfig(batch=1, context_len=600, prompt_len=100)
    mesh = parse_mesh("tensor=4", None)
    a = compile_prefill(TINY, mesh, 4, cfg)
    b = compile_prefill(TINY, mesh, 4, cfg, cached_len=500)
    fa = sum(o.flops for o in a.ops if o.name == "attention")
    fb = sum(o.flops for o in b.ops if o.name == "attention")
    # Each of the 100 tokens attends to 500 more keys: 4 * 500 * 100 * heads * head_dim FLOPs
    # per layer more (8 heads over tensor=4: 2 per chip).
    assert fb - fa == pytest.approx(4 * 500 * 100 * 2 * 128 * TINY.num_layers)
    with pytest.raises(TpusimError, match="cached_len"):
        compile_prefill(TINY, mesh, 4, cfg, cached_len=-1)


# -- exactness ------------------------------------------------------------------------------
@pytest.mark.parametrize("exact,rel", [(True, 1e-9), (False, 0.01)])
def test_one_request_alone_has_the_prefill_as_ttft_and_the_decode_steps_as_tpot(tmp_path,
                                                                                exact, rel):
    p, o = 300, 6
    r = _serve(arrival="trace", trace=_trace(tmp_path, [(0.0, p, o)]), exact_costs=exact)
    s = r.summary
    assert s["ttft_s"]["mean"] == pytest.approx(_prefill_s(p), rel=rel)
    # Token 1 comes from the prefill; tokens 2..o from decode steps over contexts p..p+o-2.
    want = np.mean([_decode_s(1, c) for c in range(p, p + o - 1)])
    assert s["tpot_s"]["mean"] == pytest.approx(want, rel=rel)
    assert s["queue_s"]["mean"] == 0.0


def test_a_full_static_batch_reproduces_serve_sweeps_throughput(tmp_path):
    b, p = 8, 256
    r = _serve(arrival="trace", trace=_trace(tmp_path, [(0.0, p, 2)] * b), scheduler="static",
               max_batch=b, exact_costs=True)
    its = r.result.iterations_frame()
    dec = its[its.decode_batch > 0]
    assert len(dec) == 1 and int(dec.decode_batch.iloc[0]) == b
    sweep = run(ServeSweepRequest(**POD, context_len=p, batches=str(b))).summary["rows"][0]
    tput = b / float(dec.duration_s.iloc[0]) / 4
    assert tput == pytest.approx(sweep["tokens_per_s_per_chip"], rel=1e-9)


def test_littles_law_holds_on_the_queue():
    r = _serve(rate=400, requests=600, prompt_tokens="uniform:16,512",
               output_tokens="uniform:2,64", max_batch=16)
    s, req = r.summary, r.result.requests
    end = float(np.nanmax(req["finish_s"]))
    # Time-averaged queue length = arrival rate x mean wait, over the run.
    waits = (req["scheduled_s"] - req["arrival_s"]).sum()
    assert s["queue_s"]["mean"] > 0
    assert s["queue_length"]["mean"] * end == pytest.approx(waits, rel=1e-9)


def test_at_low_load_throughput_is_the_arrival_rate_and_past_saturation_the_run_says_so():
    low = _serve(rate=20, requests=2000, prompt_tokens="uniform:16,256",
                 output_tokens="uniform:2,32").summary
    assert low["throughput_requests_per_s"] == pytest.approx(low["offered_rate_per_s"],
                                                             rel=0.01)
    assert not low["saturated"] and "note" not in low
    high = _serve(rate=1e6, requests=2000, prompt_tokens="uniform:16,256",
                  output_tokens="uniform:2,32", max_batch=8).summary
    assert high["saturated"] and "grows without bound" in high["note"]
    assert high["throughput_requests_per_s"] < 0.1 * high["offered_rate_per_s"]


@pytest.mark.parametrize("seed", [1, 2])
def test_continuous_batching_is_never_worse_than_static_in_mean_latency(seed):
    kw = dict(rate=300, requests=400, prompt_tokens="uniform:16,512",
              output_tokens="uniform:2,100", max_batch=16, seed=seed)
    cont = _serve(**kw).summary
    stat = _serve(scheduler="static", **kw).summary
    assert cont["e2e_s"]["mean"] <= stat["e2e_s"]["mean"]
    assert cont["ttft_s"]["mean"] <= stat["ttft_s"]["mean"]


def _step():
    req = DecodeRequest(**POD, batch=1, context_len=1)
    pod = resolve_pod(req)
    return StepModel(chip=pod.chip, topology=pod.topology, model=TINY,
                     mesh=parse_mesh("tensor=4", None), config=DecodeConfig(batch=1,
                                                                            context_len=1),
                     simulate=lambda tr: simulate_step(req, tr, pod.chip, pod.topology))


def test_chunked_prefill_lowers_p99_tpot_on_a_hand_solved_mixed_case(tmp_path):
    # A (16-token prompt, 3 tokens) starts alone; B's 2048-token prompt arrives mid-way
    # through A's prefill. Hand-solved schedules (e = the engine):
    #   whole:   it1 = e.pre(16,0); it2 = e.dec(1,16) + e.pre(2048,0) [A token 2, B token 1];
    #            it3 = e.dec(2, mean context (17+2048)/2, rounded half up: 1033) [A token 3:
    #            done; B token 2: done]
    #   chunked: it1 as before; it2 = e.dec(1,16) + e.pre(512,0);
    #            it3 = e.dec(1,17) + e.pre(512,512) [A done]; it4 = e.pre(512,1024);
    #            it5 = e.pre(512,1536) [B token 1]; it6 = e.dec(1,2048) [B token 2]
    e = _step()
    t1 = e.prefill_s(16, 0)
    rows = [(0.0, 16, 3), (t1 / 2, 2048, 2)]
    whole = _serve(arrival="trace", trace=_trace(tmp_path, rows), exact_costs=True)
    chunked = _serve(arrival="trace", trace=_trace(tmp_path, rows), exact_costs=True,
                     prefill_chunk=512)
    w_a = (e.decode_s(1, 16) + e.prefill_s(2048, 0) + e.decode_s(2, 1033)) / 2
    w_b = e.decode_s(2, 1033)
    c_a = (e.decode_s(1, 16) + e.prefill_s(512, 0) + e.decode_s(1, 17)
           + e.prefill_s(512, 512)) / 2
    c_b = e.decode_s(1, 2048)
    got_w = whole.result.requests_frame()
    got_c = chunked.result.requests_frame()
    assert got_w.tpot_s.tolist() == pytest.approx([w_a, w_b], rel=1e-9)
    assert got_c.tpot_s.tolist() == pytest.approx([c_a, c_b], rel=1e-9)
    assert chunked.summary["tpot_s"]["p99"] < whole.summary["tpot_s"]["p99"]
    # Chunking trades B's first token for A's smoothness.
    assert got_c.ttft_s[1] > got_w.ttft_s[1]


def test_kv_blocks_run_out_and_the_newest_sequence_is_preempted_and_recomputed(tmp_path):
    # A cache of 96 tokens (6 blocks of 16): two 40-token prompts fit (3 blocks each), but
    # growing to 48 + 1 tokens needs a 4th block each: the later one is preempted.
    step = _step()
    per_token = step.kv_capacity_tokens(2)[1]["kv_bytes_per_token"] / 4  # per chip
    w, act = step.kv_capacity_tokens(2)[1]["weights_bytes"], \
        step.kv_capacity_tokens(2)[1]["activation_bytes"]
    hbm = w + act + 96 * per_token + 1
    r = _serve(arrival="trace", trace=_trace(tmp_path, [(0.0, 40, 20), (0.0, 40, 20)]),
               overrides={"hbm_bytes": repr(hbm)}, max_batch=2, exact_costs=True)
    s = r.summary
    assert s["pools"][0]["kv_blocks"] == 6
    assert s["preemptions"] >= 1
    req = r.result.requests_frame()
    assert req.preemptions.tolist()[0] == 0 and req.preemptions.tolist()[1] >= 1
    assert req.finish_s.notna().all()
    its = r.result.iterations_frame()
    assert its.kv_blocks_used.max() <= 6
    # Every token is made once per run of it: B's recompute prefill covers prompt + tokens.
    assert its.prefill_tokens.sum() > 80


def test_routers_spread_requests_over_replicas():
    kw = dict(requests=300, prompt_tokens="uniform:16,128", output_tokens="uniform:2,16",
              replicas=3)
    rr = _serve(rate=200, router="round-robin", **kw)
    assert np.bincount(rr.result.requests["replica"]).tolist() == [100, 100, 100]
    assert rr.summary["num_chips"] == 12
    # A burst (all 300 within a few iterations): the load-aware routers balance it.
    for router in ("least-outstanding", "least-kv"):
        counts = np.bincount(_serve(rate=1e6, router=router, **kw).result.requests["replica"],
                             minlength=3)
        assert counts.min() > 50, (router, counts)
    # At a trickle the first replica is free whenever a request comes: least-outstanding
    # keeps sending it there.
    light = _serve(rate=5, router="least-outstanding", **kw).result.requests["replica"]
    assert np.bincount(light, minlength=3)[0] > 250


def test_disaggregated_pools_pay_the_kv_transfer_over_dcn(tmp_path):
    from sim.serving.transfer import permute_time_s

    r = _serve(arrival="trace", trace=_trace(tmp_path, [(0.0, 512, 4)]), prefill_replicas=1,
               decode_replicas=1, exact_costs=True)
    req = r.result.requests_frame()
    pod = resolve_pod(DecodeRequest(**POD, batch=1, context_len=1))
    chip = pod.chip
    nbytes = TINY.kv_cache_bytes(512, 2)
    # The network model's permute of each chip's share across the two slices, simulated for
    # this request's bytes (the run's model was simulated at two other sizes): on DCN, one
    # latency and one message overhead, then the bytes at each chip's DCN rate.
    transfer = permute_time_s(chip, pod.topology, nbytes // 4)
    assert transfer == pytest.approx(chip.dcn_latency_s + chip.dcn_message_overhead_s
                                     + nbytes / (4 * chip.eff_dcn_bytes_per_s), rel=1e-9)
    assert r.summary["kv_transfer"]["chips"] == 4
    assert float(req.kv_transferred_s[0] - req.first_token_s[0]) == pytest.approx(transfer,
                                                                                 rel=1e-9)
    e = _step()
    assert float(req.ttft_s[0]) == pytest.approx(e.prefill_s(512, 0), rel=1e-9)
    want_e2e = e.prefill_s(512, 0) + transfer + sum(e.decode_s(1, c) for c in range(512, 515))
    assert float(req.e2e_s[0]) == pytest.approx(want_e2e, rel=1e-9)


def test_disaggregated_halves_of_one_slice_send_the_kv_cache_over_ici(tmp_path):
    # Two 2x2 v5e replicas side by side make a 4x2 slice (no wraparound on v5e below a full
    # axis): every prefill chip sends its share two hops along x, and the middle link of each
    # row carries two chips' shares, so a byte per chip takes 2 / link rate, after two hops'
    # latency.
    rows = [(0.0, 512, 4)]
    r = _serve(arrival="trace", trace=_trace(tmp_path, rows), prefill_replicas=1,
               decode_replicas=1, exact_costs=True, kv_transfer="ici")
    dcn = _serve(arrival="trace", trace=_trace(tmp_path, rows), prefill_replicas=1,
                 decode_replicas=1, exact_costs=True)
    chip = resolve_pod(DecodeRequest(**POD, batch=1, context_len=1)).chip
    info = r.summary["kv_transfer"]
    assert (info["path"], info["hops"], info["pair_shape"], info["chips"]) == ("ici", 2, "4x2", 4)
    assert info["s_per_byte_per_chip"] == pytest.approx(2 / chip.eff_ici_link_bytes_per_s,
                                                        rel=1e-9)
    assert info["fixed_s"] == pytest.approx(2 * chip.ici_hop_latency_s, rel=1e-6)
    req = r.result.requests_frame()
    nbytes = TINY.kv_cache_bytes(512, 2)
    want = 2 * chip.ici_hop_latency_s + 2 * (nbytes / 4) / chip.eff_ici_link_bytes_per_s
    assert float(req.kv_transferred_s[0] - req.first_token_s[0]) == pytest.approx(want,
                                                                                 rel=1e-6)
    # Energy: the cache's bytes on the two ICI links they cross instead of DCN.
    e, e_dcn = r.summary["energy"]["energy_j_by_unit"], dcn.summary["energy"]["energy_j_by_unit"]
    assert e["dcn"] == 0 and e_dcn["dcn"] == pytest.approx(nbytes * chip.dcn_j_per_byte)
    assert e["ici"] - e_dcn["ici"] == pytest.approx(nbytes * 2 * chip.ici_j_per_byte)


@pytest.mark.parametrize("kw, words", [
    ({"kv_transfer": "ici"}, "kv_transfer says how a disaggregated split"),
    ({"kv_transfer": "nvlink", "prefill_replicas": 1, "decode_replicas": 1}, "does not exist"),
    ({"kv_transfer": "ici", "prefill_replicas": 1, "decode_replicas": 1,
      "decode_slice": "v5e-8", "decode_mesh": "tensor=8"}, "must be the same slice"),
])
def test_kv_transfer_settings_that_cannot_work_are_one_line_errors(kw, words):
    with pytest.raises(TpusimError, match=words) as e:
        _serve(requests=2, rate=1.0, prompt_tokens="fixed:16", output_tokens="fixed:2", **kw)
    assert "\n" not in str(e.value)


def test_same_inputs_give_identical_results():
    kw = dict(rate=100, requests=200, prompt_tokens="lognormal:200,0.5",
              output_tokens="uniform:2,20", seed=5)
    a, b = _serve(**kw), _serve(**kw)
    assert json.dumps(a.to_dict()) == json.dumps(b.to_dict())
    assert a.result.iterations == b.result.iterations


@pytest.mark.parametrize("kw,match", [
    ({"rate": 0, "requests": 5}, "^rate "),
    ({"rate": "nan", "requests": 5}, "^rate "),
    ({"rate": "inf", "requests": 5}, "^rate "),
    ({"rate": 1}, "requests N or duration"),
    ({"rate": 1, "requests": 5, "router": "random"}, "^router 'random' does not exist"),
    ({"rate": 1, "requests": 5, "scheduler": "fifo"}, "^scheduler 'fifo' does not exist"),
    ({"rate": 1, "requests": 5, "prefill_replicas": 2}, "both pools"),
    ({"rate": 1, "requests": 5, "prefill_replicas": 1, "decode_replicas": 0}, "both pools"),
    ({"rate": 1, "requests": 5, "slo": "ttft"}, "^slo "),
    ({"rate": 1, "requests": 5, "prompt_tokens": "fixed:20000000"}, "^prompt_tokens "),
    ({"rate": 1, "requests": 5, "arrival": "trace"}, "needs trace FILE"),
])
def test_bad_serving_input_is_one_line_naming_the_value(kw, match):
    full = {"prompt_tokens": "fixed:16", "output_tokens": "fixed:4", **kw}
    with pytest.raises(TpusimError, match=match) as e:
        _serve(**full)
    assert "\n" not in str(e.value)


def test_a_request_longer_than_the_context_is_refused_before_anything_runs():
    with pytest.raises(TpusimError, match="over the 16,777,216-token context") as e:
        _serve(rate=1, requests=2, prompt_tokens="fixed:10000000",
               output_tokens="fixed:10000000")
    assert "\n" not in str(e.value)


def test_a_request_longer_than_the_kv_cache_is_refused():
    with pytest.raises(TpusimError, match="does not fit .* KV cache even alone"):
        _serve(rate=1, requests=2, prompt_tokens="fixed:100000", output_tokens="fixed:4",
               overrides={"hbm_bytes": "2e8"})


# -- the command line -------------------------------------------------------------------------
_CLI = ["serve", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--mesh",
        "tensor=4"]


@pytest.mark.parametrize("extra,match", [
    (["--rate", "0", "--requests", "5"], "--rate '0' must be a finite number > 0"),
    (["--rate", "nan", "--requests", "5"], "--rate 'nan' must be a finite number > 0"),
    (["--rate", "1", "--requests", "5", "--router", "nearest"], "--router 'nearest'"),
    (["--rate", "1", "--requests", "5", "--prefill-replicas", "1", "--decode-replicas", "0"],
     "no decode replica|both pools"),
])
def test_bad_cli_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, extra, match):
    from sim.cli import main

    out = tmp_path / "out"
    rc = main([*_CLI, "--prompt-tokens", "fixed:16", "--output-tokens", "fixed:4", *extra,
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("tpusim: error: ")
    assert __import__("re").search(match, err), err
    assert not out.exists() or not any(out.iterdir())


def test_bad_trace_file_from_the_cli_writes_nothing(capsys, tmp_path):
    from sim.cli import main

    bad = tmp_path / "t.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens\n0,16,4\n0.5,16,x\n")
    out = tmp_path / "out"
    rc = main([*_CLI, "--arrival", "trace", "--trace", str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "line 3: output_tokens 'x'" in err and err.count("\n") == 1
    assert not out.exists() or not any(out.iterdir())


def test_cli_json_equals_the_api_and_out_writes_the_tables(capsys, tmp_path):
    import pandas as pd

    from sim.api import serve
    from sim.cli import main

    trace = _trace(tmp_path, [(0.0, 64, 4), (0.01, 32, 8), (0.02, 128, 2)])
    out = tmp_path / "out"
    rc = main([*_CLI, "--arrival", "trace", "--trace", trace, "--json", "--out", str(out)])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0
    api = serve(chip="v5e", shape="2x2", model="llama3-8b", mesh="tensor=4", arrival="trace",
                trace=trace)
    assert got == json.loads(json.dumps(api.to_dict()))
    for name in ("requests", "iterations"):
        assert (out / f"{name}.csv").exists() and (out / f"{name}.parquet").exists()
    req = pd.read_parquet(out / "requests.parquet")
    assert req.request.tolist() == [0, 1, 2]
    assert (req.finish_s >= req.first_token_s).all() and (req.first_token_s > req.arrival_s).all()
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        assert set(got[key]) == {"mean", "p50", "p90", "p99"}
    for key in ("throughput_requests_per_s", "throughput_tokens_per_s", "tokens_per_s_per_chip",
                "goodput_requests_per_s", "slo_attainment", "preemptions", "kv_utilization",
                "num_requests", "sim_events"):
        assert key in got


def test_a_serve_result_reruns_to_the_same_result():
    from sim.api import rerun

    r = _serve(rate=50, requests=60, prompt_tokens="uniform:16,64", output_tokens="fixed:8",
               seed=3)
    assert json.dumps(rerun(r.to_dict()).to_dict()) == json.dumps(r.to_dict())


def test_serving_plots_are_written_and_byte_identical_for_the_same_run(tmp_path):
    from sim.export.serving_plots import plot_serving, serving_figures

    r = _serve(rate=200, requests=200, prompt_tokens="uniform:16,256",
               output_tokens="uniform:2,32", replicas=2)
    figs = serving_figures(r.summary, r.result)
    assert set(figs) == {"latency_cdf.png", "kv_queue.png"}
    # The TTFT panel's CDF ends at 1: every request has a first token.
    line = figs["latency_cdf.png"].axes[0].lines[0]
    assert line.get_ydata()[-1] == pytest.approx(1.0)
    a = plot_serving(r.summary, r.result, tmp_path / "a")
    b = plot_serving(r.summary, r.result, tmp_path / "b")
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def test_the_jetstream_comparison_quotes_the_reference_table(reference_dir):
    from validation.serving_jetstream import ROWS

    text = (reference_dir / "serving.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| 2024-")]
    assert len(rows) == len(ROWS)
    for line, row in zip(rows, ROWS, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == row[0] and cells[2] == row[1]
        assert int(cells[4]) == row[4] and int(cells[5]) == row[5]
        assert float(cells[6].split()[0]) == row[6]
